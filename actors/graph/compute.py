"""The compute actor: forward and backward of a worker's model, in a worker thread.

Running them off the event loop keeps it serving the network meanwhile. During the last
backward of a step, gradient hooks report each bucket the moment all its gradients exist, so
its all-reduce overlaps the rest of backward.

A trainable parameter the step's last backward gave no gradient (unused by the loss) would leave
its bucket never ready: the step fails naming it (`UnusedParametersError`), or, with
``find_unused`` (``TrainerOptions.find_unused_parameters``), its bucket is announced when
backward returns, holding what the step accumulated for it (zeros if nothing), and the
parameters unused in the whole step are reported (``on_unused``) so the gradient-comm actor
can agree with its peers which ones no rank used.

With mixed precision (`paramsync.actors.graph.precision`), the loss function runs under autocast and
backward runs on the scaled loss when there is a loss scaler; the loss it answers is unscaled.

Several replicas in one process (hierarchical data parallelism): a worker process holding
several devices in a `DataParallelCoordinator` has the compute actor run `primary_backward`
instead of the loss function: every device's shard runs forward and backward in parallel, and
only once their weighted in-process average is in the primary replica's gradients are all the
buckets announced (in order, when it returns), so the all-reduce across processes sends the
process's average.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import trio

from paramsync.actors.graph.messages import Backward
from paramsync.actors.graph.precision import MixedPrecision, autocast_of
from paramsync.actors.multidevice import DataParallelCoordinator, primary_backward
from paramsync.actors.state.buckets import Bucket
from paramsync.runtime.actor.base import Actor, run_in_thread
from paramsync.runtime.observe.trace import TraceRecorder

__all__ = ["ComputeActor", "LossFn", "UnusedParametersError"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``loss_fn(model, micro_batch) -> scalar loss``: the user's forward pass."""


class UnusedParametersError(RuntimeError):
    """A step's backward gave no gradient to trainable parameters, and the trainer was not told
    to expect that (``find_unused_parameters``)."""

    def __init__(self, step: int, names: list[str]) -> None:
        super().__init__(
            f"step {step}: backward produced no gradient for parameters {names} (unused by the "
            "loss in the step's last backward), so their buckets cannot be synchronized: pass "
            "TrainerOptions(find_unused_parameters=True) to train with parameters a step "
            "leaves unused"
        )
        self.step = step
        self.names = names


class ComputeActor(Actor):
    """Forward and backward in a worker thread; hooks announce finished gradient buckets.

    ``on_bucket(step, bucket)`` runs in the event loop. A bucket that backward finishes while
    others are still being computed is handed to it from the backward thread at once (its
    all-reduce overlaps the rest of backward); the last one is announced when backward
    returns, which wakes the event loop anyway: handing it over from the thread too would
    wake the loop a second time for the same moment.

    With ``find_unused``, buckets the last backward left incomplete are announced when it
    returns, after ``on_unused(step, names)`` has named the parameters no backward of the step
    gave a gradient.

    ``on_gradients(bucket)`` runs in backward's thread, inside the autograd engine, the moment
    a synchronizing backward has enqueued a bucket's last gradient, before the bucket is
    announced (where a device bucket records the event its reads wait on).
    """

    accepts = (Backward,)

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: LossFn,
        buckets: list[Bucket],
        on_bucket: Callable[[int, int], None],
        trace: TraceRecorder,
        *,
        find_unused: bool = False,
        on_unused: Callable[[int, frozenset[str]], None] | None = None,
        precision: MixedPrecision | None = None,
        replicas: DataParallelCoordinator | None = None,
        on_gradients: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__("compute", mailbox_size=2)
        if replicas is not None and precision is not None:
            raise ValueError("mixed precision is not supported with several devices per process")
        self.replicas = replicas
        """The process's replicas (None: the model alone): backward runs on all of them."""
        self.find_unused = find_unused
        self._on_unused = on_unused
        self.precision = precision
        """Autocast around the loss function and the loss scaler (None: full precision)."""
        self.model = model
        self.loss_fn = loss_fn
        self.trace = trace
        self._on_bucket = on_bucket
        self._on_gradients = on_gradients
        self._params = dict(model.named_parameters())
        self._bucket_of = {name: b.index for b in buckets for name in b.names}
        self._pending: list[int] = [len(b.names) for b in buckets]
        self._sizes = [len(b.names) for b in buckets]
        self._sync_step: int | None = None
        self._left = 0
        """Buckets of the current backward not finished yet."""
        self._last: tuple[int, int] | None = None
        """(step, bucket): the backward's last bucket, announced when it returns."""
        self._used: set[str] = set()
        """Parameters some backward of ``_used_step`` gave a gradient (written by the hooks)."""
        self._used_step: int | None = None
        self._fired: set[str] = set()
        """Parameters the current step's last backward gave a gradient."""
        self._incomplete: list[int] = []
        """Buckets the last backward left without all their gradients (``find_unused``)."""
        self._hand_over_last = False
        """Hand the backward's last bucket over from its thread too: a backward run by the
        caller's own thread (`expect_backward`), where no actor call returns after it."""
        self._on_started: Callable[[], None] | None = None
        """Called by the first hook of the armed synchronizing backward, inside the autograd
        engine (`expect_backward`'s ``on_started``)."""
        self._token = trio.lowlevel.current_trio_token()
        self._hooks = [
            self._params[name].register_post_accumulate_grad_hook(self._make_hook(name))
            for name in self._bucket_of
        ]

    def _make_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        bucket = self._bucket_of[name]

        def hook(_param: torch.Tensor) -> None:
            self._used.add(name)
            if self._sync_step is None:
                return
            if not self._fired and self._on_started is not None:
                self._on_started()
            self._fired.add(name)
            self._pending[bucket] -= 1
            if self._pending[bucket] == 0:
                if self._on_gradients is not None:
                    self._on_gradients(bucket)
                self._left -= 1
                if self._left or self._hand_over_last:
                    self._token.run_sync_soon(self._on_bucket, self._sync_step, bucket)
                else:
                    self._last = (self._sync_step, bucket)

        return hook

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the model."""
        for handle in self._hooks:
            handle.remove()

    async def handle(self, message: object) -> float:
        assert isinstance(message, Backward)
        loss = await run_in_thread(self.run_backward, message)
        self._announce_rest(message.step, message.sync)
        return loss

    def _announce_rest(self, step: int, sync: bool) -> None:
        """After a backward returned (in the event loop): the parameters unused in the step
        (``find_unused``) and the buckets it left incomplete (``find_unused``, or every bucket
        of a replicated backward), then its last bucket."""
        last, self._last = self._last, None
        incomplete, self._incomplete = self._incomplete, []
        if sync:
            if self.find_unused and self._on_unused is not None:
                unused = frozenset(name for name in self._bucket_of if name not in self._used)
                self._on_unused(step, unused)
            for bucket in incomplete:  # only `find_unused` or replicas leave any
                self._on_bucket(step, bucket)
        if last is not None:
            self._on_bucket(*last)

    def expect_backward(
        self,
        step: int,
        sync: bool,
        *,
        hand_over_last: bool = False,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        """Get the hooks ready for a backward of ``step``: with ``sync``, the step's last one,
        whose hooks announce the buckets (else gradients only accumulate). Called by
        `_backward`, or by a caller whose own thread runs the forward and backward (torch
        DDP's shape, `paramsync.actors.train.ddp_wrapper`), which passes ``hand_over_last`` and then
        calls `backward_returned` in the event loop. ``on_started`` runs once, in the
        autograd engine, when the synchronizing backward gives its first gradient (where the
        wrapper queues its end-of-backward callback)."""
        self._last = None
        self._incomplete = []
        self._hand_over_last = hand_over_last
        self._on_started = on_started if sync else None
        if step != self._used_step:
            self._used, self._used_step = set(), step
        if sync:
            self._fired = set()
            self._pending = list(self._sizes)
            self._left = len(self._sizes)
            self._sync_step = step

    @property
    def sync_backward_started(self) -> bool:
        """Whether the armed synchronizing backward has fired a hook already."""
        return self._sync_step is not None and bool(self._fired)

    def _backward_ended(self, step: int, sync: bool) -> None:
        """Disarm the hooks; a sync backward that left a bucket incomplete fails naming its
        parameters, or (``find_unused``) leaves it to `_announce_rest`."""
        self._sync_step = None
        if sync and any(self._pending):
            if not self.find_unused:
                missing = [name for name in self._bucket_of if name not in self._fired]
                raise UnusedParametersError(step, missing)
            self._incomplete = [i for i, left in enumerate(self._pending) if left]

    def backward_returned(self, step: int) -> None:
        """The caller's own sync backward of ``step`` (see `expect_backward`) has returned: in
        the event loop, announce what the hooks could not (or fail naming unused parameters)."""
        try:
            self._backward_ended(step, True)
        finally:
            self._hand_over_last = False
        self._announce_rest(step, True)

    def run_backward(self, message: Backward) -> float:
        """One `Backward` message's forward and backward, in the compute thread; returns the
        loss. A hook point: a harness that must act at a step's forward (the fault trials)
        wraps it in a subclass."""
        if self.replicas is not None:
            return self._replicated_backward(message)
        self.expect_backward(message.step, message.sync)
        try:
            with self.trace.span("forward", actor="compute", step=message.step):
                with autocast_of(self.precision):
                    loss = self.loss_fn(self.model, message.micro_batch)
            with self.trace.span("backward", actor="compute", step=message.step):
                (loss if self.precision is None else self.precision.scaled(loss)).backward()
        finally:
            self._sync_step = None
        self._backward_ended(message.step, message.sync)
        return float(loss.detach())

    def _replicated_backward(self, message: Backward) -> float:
        """Backward on every replica; the primary holds the process's weighted average, and
        every bucket is announced when this returns (the hooks announce none meanwhile)."""
        assert self.replicas is not None
        self._last, self._incomplete = None, []
        with self.trace.span("forward-backward", actor="compute", step=message.step):
            loss = primary_backward(self.replicas, message.micro_batch)
        if message.sync:
            self._incomplete = list(range(len(self._sizes)))
        return loss
