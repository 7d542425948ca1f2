"""The optimizer actor: applies a step's averaged gradients, steps the LR scheduler, and reports
the state digest.

Before the step it clips the averaged gradients by their global norm when the trainer's options
ask for it (``clip_grad_norm``): every rank holds the same averaged gradients, so every rank
clips them identically. The digest is the identical-weights check (C-DDP-001): the coordinator
commits a step once every rank's digest agrees, and no rank changes its weights again before
that commit.

With a loss scaler (`paramsync.actors.graph.precision`), the step goes through it: it unscales the
averaged gradients (before clipping) and skips the step when one is inf or nan, identically on every
rank (the gradients are bitwise identical after the all-reduce); the digest then covers the scaler's
state too, so a rank that decided otherwise is caught by the same check.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from paramsync.actors.client.client import CoordinatorClient
from paramsync.actors.graph.messages import OptimizerStep, Verify
from paramsync.actors.graph.precision import GradScalerDigests, MixedPrecision
from paramsync.actors.state.digest import PendingDigest, Scheduler, StateDigest, StateHasher
from paramsync.runtime.actor.base import Actor, run_in_thread
from paramsync.runtime.observe.trace import TraceRecorder

__all__ = [
    "CheckCost",
    "ClipOptions",
    "OPTIMIZER_STEP_LOCK",
    "OptimizerActor",
    "clip_gradients",
    "clip_settings",
]

OPTIMIZER_STEP_LOCK = threading.Lock()
"""Optimizer steps of the trainers in one process run one at a time. torch's optimizers are not
safe to step from several threads at once: two threads taking the first AdamW step of two
identical replicas (tied embeddings, identical gradients) disagreed on the tied weight in about
1 run in 12 (tests/test_soak.py reproduces it without paramsync). Only in-process groups run
several trainers in one process, and a step is milliseconds, so the lock costs nothing else."""


def clip_gradients(model: torch.nn.Module, max_norm: float, norm_type: float = 2.0) -> float:
    """Scale ``model``'s gradients so their total ``norm_type``-norm is at most ``max_norm``
    (`torch.nn.utils.clip_grad_norm_`, parameters without a gradient left out); return the
    total norm before clipping."""
    grads = [param for param in model.parameters() if param.grad is not None]
    return float(torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type))


class ClipOptions(Protocol):
    """What the optimizer actor reads of the trainer's options (`paramsync.actors.train.options.
    TrainerOptions` has both fields): the gradient clipping."""

    @property
    def clip_grad_norm(self) -> float | None:
        """The largest total gradient norm (None: no clipping)."""

    @property
    def clip_norm_type(self) -> float:
        """The norm's order (2.0: Euclidean)."""


def clip_settings(options: ClipOptions) -> tuple[float, float] | None:
    """(max norm, norm type) of the trainer options' gradient clipping; None: no clipping."""
    if options.clip_grad_norm is None:
        return None
    return float(options.clip_grad_norm), float(options.clip_norm_type)


@dataclass
class CheckCost:
    """What the identical-weights check (C-DDP-001) has cost this worker: the CPU time spent
    hashing its state, and how many digests it reported. Reporting them (a ~1.9 KB message)
    and the coordinator's comparison are not included."""

    hash_cpu_seconds: float = 0.0
    digests: int = 0


class _Started:
    """A state digest started right after an optimizer step, with the loss scaler's entry of
    that moment (if the digests cover a scaler)."""

    __slots__ = ("_scaler", "entry", "pending")

    def __init__(self, pending: PendingDigest, scaler: GradScalerDigests | None) -> None:
        self.pending = pending
        self._scaler = scaler
        self.entry = scaler.entry() if scaler is not None else None

    def ready(self) -> bool:
        return self.pending.ready()

    def result(self) -> StateDigest:
        digest = self.pending.result()
        if self._scaler is not None:
            digest = self._scaler.extend(digest, self.entry)
        return digest


class OptimizerActor(Actor):
    """Applies the averaged gradients and reports the state digest (C-DDP-001).

    The digest of step s is hashed in the optimizer step's own thread call, right after the
    step: hashing beside the next forward pass instead made the two threads trade the GIL at
    every torch op, which cost more than the hash. The report leaves while step s+1 computes
    forward and backward, which only read the weights; step s+1's optimizer step first waits
    for step s's commit, so no weight changes before step s is committed everywhere. (Waiting
    for the commit right after the report instead woke the event loop in the middle of the
    next compute, when the commit came in; it now waits in the socket until the compute ends,
    see `CoordinatorClient.reads_deferred`.)

    A state on a CUDA device is folded there (`paramsync.actors.state.fold_digest`): the fold is
    enqueued right after the step and its few bytes read when they have landed, the wait (if
    any) on a worker thread, so the event loop runs step s+1 meanwhile.
    """

    accepts = (OptimizerStep, Verify)

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        client: CoordinatorClient,
        options: ClipOptions,
        trace: TraceRecorder,
        epoch: int = 1,
        on_applied: Callable[[int], None] | None = None,
        check_cost: CheckCost | None = None,
        zero_grads: Callable[[], None] | None = None,
        *,
        precision: MixedPrecision | None = None,
        on_skipped: Callable[[int], None] | None = None,
        scheduler: Scheduler | None = None,
        digest_buffers: bool = True,
        digest_algorithm: str | None = None,
    ) -> None:
        super().__init__("optimizer", mailbox_size=2)
        self.model = model
        self.optimizer = optimizer
        self.client = client
        self.options = options
        """The trainer's options: the actor reads only the gradient clipping (its peers'
        constructors take them too)."""
        self._clip = clip_settings(options)
        self.grad_norm: tuple[int, float] | None = None
        """(step, total gradient norm before clipping) of the last step applied with clipping."""
        self.trace = trace
        self.epoch = epoch
        self.last_digest: bytes | None = None
        self._on_applied = on_applied
        self.zero_grads = zero_grads
        """Zeroes the gradients after a step (None: ``optimizer.zero_grad(set_to_none=False)``)."""
        self.check_cost = check_cost if check_cost is not None else CheckCost()
        self.scheduler = scheduler
        """Stepped right after each optimizer step (torch's order); None: no scheduler."""
        self._hasher = StateHasher(buffers=digest_buffers, algorithm=digest_algorithm)
        """``digest_buffers``: the digest covers the model's buffers (not when each rank keeps
        its own, ``buffer_sync="local"``); ``digest_algorithm``: a
        `paramsync.actors.state.digest.DigestChoice` (None: the environment's, see
        `StateHasher`)."""
        self.precision = precision
        """Steps through its loss scaler, if it has one (None: ``optimizer.step()``)."""
        self._on_skipped = on_skipped
        """Called with each step the loss scaler skipped (inf or nan in the averaged gradients)."""
        scaler = precision.scaler if precision is not None else None
        self._scaler_digests = GradScalerDigests(scaler) if scaler is not None else None
        self._names_sent: tuple[str, ...] | None = None
        self._hashed: tuple[int, _Started, int, int] | None = None
        """(step, digest, start ns, end ns): started right after ``step``'s optimizer step."""

    def digest_grad_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """Cover ``scaler``'s state in every digest from now on (a loss scaler the caller's
        own loop drives, `paramsync.actors.train.ddp_wrapper`)."""
        self._scaler_digests = GradScalerDigests(scaler)

    async def handle(self, message: object) -> None:
        if isinstance(message, OptimizerStep):
            with self.trace.span("commit-wait", actor="optimizer", step=message.step - 1):
                await self.client.wait_commit(message.step - 1)
            with self.trace.span("optimizer", actor="optimizer", step=message.step) as span:
                await run_in_thread(self.apply, message.step)
                if self.grad_norm is not None and self.grad_norm[0] == message.step:
                    span.set(grad_norm=self.grad_norm[1])
            if message.verify:
                await self.report(message.step, force=False, wait=False)
            return
        assert isinstance(message, Verify)
        await self.report(message.step, force=message.force, wait=message.wait)

    async def report(self, step: int, *, force: bool, wait: bool) -> None:
        """Report ``step``'s state digest (on digest steps, or ``force``d) or its step end;
        ``wait``: then wait for the coordinator's commit of it. A hook point: a harness that
        must act before a digest is reported (the fault trials) wraps it in a subclass."""
        hashed, self._hashed = self._hashed, None
        if force or step % self.client.digest_interval == 0:
            if hashed is not None and hashed[0] == step and not force:
                _, pending, started, ended = hashed
                self.trace.complete("digest", started, ended, actor="optimizer", step=step)
                if pending.ready():
                    digest = pending.result()
                else:  # the device has yet to finish the fold: wait beside the event loop
                    digest = await run_in_thread(pending.result)
            else:  # an epoch's opening check: the state may have just arrived from a donor
                with self.trace.span("digest", actor="optimizer", step=step):
                    digest = await run_in_thread(self._timed_digest)
            self.last_digest = digest.digest
            # The tensor names travel with the epoch's first digest and when they change.
            names = None if digest.names is self._names_sent else digest.names
            await self.client.digest(
                step,
                digest.digest,
                digest.packed,
                self.epoch,
                names=names,
                algorithm=digest.algorithm,
            )
            self.check_cost.digests += 1
            self._names_sent = digest.names
        else:
            await self.client.step_done(step, self.epoch)
        if wait:
            with self.trace.span("commit-wait", actor="optimizer", step=step):
                await self.client.wait_commit(step)

    def _timed_digest(self) -> StateDigest:
        return self._timed_start().result()

    def _timed_start(self) -> _Started:
        """Start the state's digest now (the loss scaler's entry taken now too)."""
        cpu = time.thread_time()
        try:
            pending = self._hasher.start(self.model, self.optimizer, self.scheduler)
            return _Started(pending, self._scaler_digests)
        finally:
            self.check_cost.hash_cpu_seconds += time.thread_time() - cpu

    def apply(self, step: int) -> None:
        """Step the optimizer with ``step``'s reduced gradients (on a worker thread), clipped
        first if the options say so (unscaled first: the true gradients' norm), then the LR
        scheduler (also after a step the loss scaler skipped, as torch's AMP loop does)."""
        if self._clip is not None:
            if self.precision is not None:
                self.precision.unscale(self.optimizer)
            self.grad_norm = (step, clip_gradients(self.model, *self._clip))
        with OPTIMIZER_STEP_LOCK:
            if self.precision is None:
                self.optimizer.step()
            elif self.precision.step(self.optimizer) and self._on_skipped is not None:
                self._on_skipped(step)
            if self.scheduler is not None:
                self.scheduler.step()
            if self.zero_grads is not None:
                self.zero_grads()
            else:
                self.optimizer.zero_grad(set_to_none=False)
            if self._on_applied is not None:
                self._on_applied(step)
        self._hash_applied(step)

    def applied_by_caller(self, step: int, *, skipped: bool = False) -> None:
        """The caller's own thread stepped the optimizer with ``step``'s averaged gradients
        (torch DDP's shape, `paramsync.actors.train.ddp_wrapper`; ``skipped``: its loss scaler
        skipped the step): count it and hash the state in that thread, as `apply` does after its own
        step. A `Verify` of ``step`` then reports the digest."""
        if skipped and self._on_skipped is not None:
            self._on_skipped(step)
        if self._on_applied is not None:
            self._on_applied(step)
        self._hash_applied(step)

    def _hash_applied(self, step: int) -> None:
        if step % self.client.digest_interval == 0:
            started = time.perf_counter_ns()
            pending = self._timed_start()
            self._hashed = (step, pending, started, time.perf_counter_ns())
