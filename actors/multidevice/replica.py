"""One model replica on one device: its model, its optimizer, and its gradient buffers.

Every trainable parameter's gradient is a view into one flat buffer on the replica's device
(as DDP's ``gradient_as_bucket_view``): backward accumulates straight into it, so the gradients
leave the device in one copy and the averaged gradient comes back in one copy. Frozen parameters
(``requires_grad=False``) have no part in it: they are never averaged, copied or sent.

On a CUDA device the replica owns one stream, on which its shard is copied in (from pinned host
memory), forward, backward, the gradient copy to a pinned host buffer, the averaged gradient's
copy back and the optimizer step all run; the stream is synchronized before the host reads
anything copied from the device (C-STREAMSYNC-001). On a CPU device the host buffer is the
gradient buffer itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from paramsync.actors.state.digest import StateDigest, StateHasher

__all__ = ["Replica", "trainable_parameters"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters that require a gradient, with their names, in ``named_parameters`` order."""
    return [(name, param) for name, param in model.named_parameters() if param.requires_grad]


class Replica:
    """One device's model and optimizer, with a flat gradient buffer over its trainable
    parameters and (on CUDA) its own stream and pinned host buffer."""

    def __init__(
        self,
        index: int,
        device: torch.device,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        check_buffers: bool = True,
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
        self.stream: Any = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device)
            self.host_grad = torch.zeros(self.numel, dtype=self.dtype, pin_memory=True)
        else:
            self.host_grad = self.grad
        self._hasher = StateHasher(buffers=check_buffers)
        self._attach()
        self.settle()

    def settle(self) -> None:
        """Wait for work queued on the device's default stream (the model's copy to the device,
        a state loaded from the main thread) before this replica's own stream uses it."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _attach(self) -> None:
        """Point every trainable parameter's ``.grad`` at its view of the flat buffer (again, if
        the loss function or the optimizer replaced or dropped it)."""
        for (_, param), view in zip(self.trainable, self._views):
            if param.grad is not view:
                param.grad = view

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
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

    def compute(self, loss_fn: LossFn, shard: Any) -> float:
        """Forward and backward on ``shard``: the trainable gradients end in ``host_grad``
        (copied there and the stream synchronized first, on CUDA). Returns the shard's loss."""
        with self._on_stream():
            self._attach()
            self.grad.zero_()
            loss = loss_fn(self.model, self.to_device(shard))
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError("loss_fn must return a scalar tensor (the shard's mean loss)")
            loss.backward()
            loss = loss.detach()
            if self.stream is not None:
                self.host_grad.copy_(self.grad, non_blocking=True)
                self.stream.synchronize()  # C-STREAMSYNC-001: before the host reads the copy
            return float(loss)

    def apply(self, averaged: torch.Tensor) -> None:
        """Load the averaged gradient (a host tensor) into the gradient buffer and take this
        replica's own optimizer step."""
        with self._on_stream():
            self._attach()
            self.grad.copy_(averaged, non_blocking=self.stream is not None)
            self.optimizer.step()
            if self.stream is not None:
                self.stream.synchronize()  # the host may overwrite ``averaged`` next step

    def load_gradient(self, gradient: torch.Tensor) -> None:
        """Write the flat host ``gradient`` into the trainable parameters' ``.grad`` (views of
        the flat buffer again)."""
        with self._on_stream():
            self._attach()
            self.grad.copy_(gradient, non_blocking=self.stream is not None)
            if self.stream is not None:
                self.stream.synchronize()

    def gradient_on_host(self) -> torch.Tensor:
        """The trainable parameters' current ``.grad`` (whatever tensors they are now; zeros for
        a missing one), flat, on the host (the stream synchronized first, C-STREAMSYNC-001)."""
        with self._on_stream():
            grads = [
                param.grad if param.grad is not None else torch.zeros_like(param)
                for _, param in self.trainable
            ]
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            if self.stream is not None:
                self.stream.synchronize()
            return flat.to("cpu")

    def digest(self) -> StateDigest:
        """The C-DDP-001 digest of this replica's parameters (trainable and frozen), buffers
        (unless ``check_buffers`` was False) and optimizer state."""
        with self._on_stream():
            return self._hasher.digest(self.model, self.optimizer)
