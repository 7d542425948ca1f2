"""One model replica on one device: its model, its optimizer, and its gradient buffers.

Every trainable parameter's gradient is a view into one flat buffer on the replica's device
(as DDP's ``gradient_as_bucket_view``): backward accumulates straight into it, so the gradients
are averaged as one buffer and the average comes back in one copy. Frozen parameters
(``requires_grad=False``) have no part in it: they are never averaged, copied or sent.

On a CUDA device the replica owns one stream, on which its shard is copied in (from pinned host
memory), forward, backward, the average's copy into the gradient buffer and the optimizer step
all run. Two markers (`paramsync.actors.multidevice.marker`) order the other replicas' work and
the host after it, with no ``synchronize()`` of a stream or device: ``ready`` is recorded after
backward's last gradient (and, when the average is taken on the host, after the gradient's copy
to a pinned host buffer: C-STREAMSYNC-001, the host reads a copy only after its event), and
``loaded`` after the average's copy into the gradient buffer. The stream starts each step after
the work the calling thread queued on its own stream (a state it loaded, say), and that stream
waits on the replica's step in turn, so the caller sees the updated parameters without a host
wait. The host waits on one event only where it reads bytes: the shard's loss (and, on the
host path, the gradients). On a CPU device the host buffer is the gradient buffer itself and
the markers do nothing.

The optimizer step is the user's optimizer as given: torch resolves an optimizer built with
``foreach=None`` (its default) to its foreach kernels when every parameter is a CUDA tensor, runs
its fused kernels when built with ``fused=True``, and runs one set of kernels per parameter (its
for-loop) when built with ``foreach=False``, or on the CPU by default. The replica keeps that
choice and reports it (`update_kernels`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from paramsync.actors.multidevice.marker import StreamMarker
from paramsync.actors.state.digest import StateDigest, StateHasher

__all__ = ["Replica", "trainable_parameters", "update_kernels"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters that require a gradient, with their names, in ``named_parameters`` order."""
    return [(name, param) for name, param in model.named_parameters() if param.requires_grad]


def update_kernels(optimizer: torch.optim.Optimizer) -> str:
    """Which of torch's implementations ``optimizer.step`` runs: ``"fused"``, ``"foreach"``,
    ``"for-loop"`` (one set of kernels per parameter), or ``"its own"`` for an optimizer with
    neither option (not one of torch's foreach-capable ones). Groups differing give their
    answers joined by ``"+"``."""
    if "foreach" not in optimizer.defaults and "fused" not in optimizer.defaults:
        return "its own"
    kinds = []
    for group in optimizer.param_groups:
        if group.get("fused"):
            kind = "fused"
        else:
            foreach = group.get("foreach")
            if foreach is None and not group.get("differentiable", False):
                foreach = _torch_default_foreach(group["params"])
            kind = "foreach" if foreach else "for-loop"
        if kind not in kinds:
            kinds.append(kind)
    return "+".join(kinds)


def _torch_default_foreach(params: list[torch.Tensor]) -> bool:
    """torch's choice for ``foreach=None``: foreach when every parameter is on a device its
    foreach kernels support (CUDA), the for-loop otherwise."""
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # a torch without the helper: its documented rule
        return bool(params) and all(param.device.type == "cuda" for param in params)
    _, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
    return bool(foreach)


class Replica:
    """One device's model and optimizer, with a flat gradient buffer over its trainable
    parameters, its ``ready`` and ``loaded`` markers and (on CUDA) its own stream.

    ``stage_on_host``: copy the gradient to a pinned host buffer after backward (the average is
    taken on the host); on a CPU device the host buffer is the gradient buffer whatever it says.
    """

    def __init__(
        self,
        index: int,
        device: torch.device,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        check_buffers: bool = True,
        stage_on_host: bool = True,
    ) -> None:
        self.index = index
        self.device = device
        self.model = model
        self.optimizer = optimizer
        self.trainable = trainable_parameters(model)
        if not self.trainable:
            raise ValueError(f"replica {index}: the model has no trainable parameters")
        dtypes = {param.dtype for _, param in self.trainable}
        if len(dtypes) != 1:
            kinds = sorted(map(str, dtypes))
            raise ValueError(
                f"replica {index}: trainable parameters of several dtypes {kinds} are not "
                "supported (one flat gradient buffer per replica)"
            )
        self.dtype = dtypes.pop()
        self.numel = sum(param.numel() for _, param in self.trainable)
        self.grad = torch.zeros(self.numel, dtype=self.dtype, device=device)
        self._views: list[torch.Tensor] = []
        offset = 0
        for _, param in self.trainable:
            self._views.append(self.grad[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        self.ready = StreamMarker(device)
        """Recorded after backward's last gradient (and its host copy, when staged)."""
        self.loaded = StreamMarker(device)
        """Recorded after the average's copy into the gradient buffer."""
        self._loss_marker = StreamMarker(device)
        self._loss: torch.Tensor = torch.zeros(())
        self.stream: Any = None
        self._caller: Any = None
        self._staged = False
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device)
            self._loss_host = torch.zeros((), dtype=torch.float32, pin_memory=True)
            self._staged = stage_on_host
        self.host_grad = self.grad
        if self._staged:
            self.host_grad = torch.zeros(self.numel, dtype=self.dtype, pin_memory=True)
        self.update_kernels = update_kernels(optimizer)
        """`update_kernels` of the optimizer, as the user built it."""
        self._hasher = StateHasher(buffers=check_buffers)
        self._attach()
        self.settle()

    def settle(self) -> None:
        """Wait for work queued on the device's default stream (the model's copy to the device,
        a state loaded from the main thread) before this replica's own stream uses it. Never
        part of a step."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def caller_stream(self) -> Any:
        """The calling thread's current stream on this replica's device (None on the CPU)."""
        return torch.cuda.current_stream(self.device) if self.stream is not None else None

    def follow(self, caller: Any) -> None:
        """Order this replica's next work after ``caller`` (a `caller_stream`, taken on the
        thread that drives the step), and have ``caller`` wait on the replica's update."""
        self._caller = caller
        if caller is not None:
            self.stream.wait_stream(caller)

    def _release(self) -> None:
        """The caller's stream waits (on the device) for what this replica queued so far."""
        if self._caller is not None:
            self._caller.wait_stream(self.stream)

    def _attach(self) -> None:
        """Point every trainable parameter's ``.grad`` at its view of the flat buffer (again, if
        the loss function or the optimizer replaced or dropped it)."""
        for (_, param), view in zip(self.trainable, self._views):
            if param.grad is not view:
                param.grad = view

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """Run the block's device work on this replica's stream (on CUDA)."""
        if self.stream is None:
            yield
        else:
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                yield

    def to_device(self, shard: Any) -> Any:
        """``shard`` on this replica's device (from pinned memory, asynchronously, on CUDA)."""
        if self.device.type != "cuda":
            return (
                shard.to(self.device)
                if isinstance(shard, torch.Tensor)
                else tuple(field.to(self.device) for field in shard)
            )

        def move(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device.type == "cpu" and not tensor.is_pinned():
                tensor = tensor.pin_memory()
            return tensor.to(self.device, non_blocking=True)

        return move(shard) if isinstance(shard, torch.Tensor) else tuple(map(move, shard))

    def compute(self, loss_fn: LossFn, shard: Any) -> None:
        """Queue forward and backward on ``shard``: the trainable gradients end in the gradient
        buffer (and in ``host_grad`` when staged), then ``ready`` is recorded. The shard's loss
        is read by `loss_value`."""
        with self.on_stream():
            self._attach()
            self.grad.zero_()
            loss = loss_fn(self.model, self.to_device(shard))
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError("loss_fn must return a scalar tensor (the shard's mean loss)")
            loss.backward()
            self._loss = loss.detach()
            if self.stream is not None:
                if self._staged:
                    self.host_grad.copy_(self.grad, non_blocking=True)
                self.ready.record(self.stream)
                self._loss_host.copy_(self._loss, non_blocking=True)
                self._loss_marker.record(self.stream)

    def loss_value(self) -> float:
        """The last `compute`'s loss."""
        if self.stream is None:
            return float(self._loss)
        self._loss_marker.synchronize()  # the host reads the loss's bytes: its copy must be done
        return float(self._loss_host)

    def apply(
        self, source: torch.Tensor, after: StreamMarker | None = None, *, attach: bool = True
    ) -> None:
        """Load the averaged gradient ``source`` (the host's average, or one on a device once
        ``after`` is reached) into the gradient buffer, record ``loaded``, and queue this
        replica's own optimizer step; the caller's stream then waits on it. ``attach=False``
        when `compute` has just pointed the ``.grad`` fields at the buffer (the fused step)."""
        with self.on_stream():
            if attach:
                self._attach()
            if after is not None:
                after.wait(self.stream)
            self.grad.copy_(source, non_blocking=self.stream is not None)
            self.loaded.record(self.stream)
            self.optimizer.step()
            self._release()

    def load_gradient(self, gradient: torch.Tensor) -> None:
        """Write the flat host ``gradient`` into the trainable parameters' ``.grad`` (views of
        the flat buffer again), visible to the calling thread's stream."""
        caller = self.caller_stream()
        with self.on_stream():
            if caller is not None:
                self.stream.wait_stream(caller)
            self._attach()
            self.grad.copy_(gradient, non_blocking=self.stream is not None)
            self.loaded.record(self.stream)
            if caller is not None:
                caller.wait_stream(self.stream)
        self.loaded.synchronize()  # the caller may overwrite ``gradient`` once this returns

    def gradient_on_host(self) -> torch.Tensor:
        """The trainable parameters' current ``.grad`` (whatever tensors they are now; zeros for
        a missing one), flat, on the host (C-STREAMSYNC-001: the copy to pageable host memory
        returns once it is done, after the work queued before it)."""
        caller = self.caller_stream()
        with self.on_stream():
            if caller is not None:
                self.stream.wait_stream(caller)  # what the caller wrote into the gradients
            grads = [
                param.grad if param.grad is not None else torch.zeros_like(param)
                for _, param in self.trainable
            ]
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            return flat.to("cpu")

    def digest(self) -> StateDigest:
        """The C-DDP-001 digest of this replica's parameters (trainable and frozen), buffers
        (unless ``check_buffers`` was False) and optimizer state."""
        with self.on_stream():
            return self._hasher.digest(self.model, self.optimizer)
