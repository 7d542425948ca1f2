"""The worker's actor graph and `DistributedTrainer` (seed 001).

A worker is a trio nursery of actors joined by bounded mailboxes:

- `ComputeActor` runs forward and backward in a worker thread, so the event loop keeps serving
  the network; during the last backward of a step, gradient hooks report each bucket the moment
  all its gradients exist;
- `GradCommActor` owns each bucket's flat buffer (the gradients are views of it, so backward
  fills it in place), reports a ready bucket (pre-averaged over accumulation steps) to the
  coordinator, and all-reduces it when the coordinator says go, overlapping the rest of
  backward; buckets run in the coordinator's order on every rank; from an epoch's second step
  on, buckets are reduced at once in the agreed order, without the round trip (response cache);
- `OptimizerActor` steps the optimizer with the averaged gradients and reports the state digest
  for the C-DDP-001 check, waiting for the coordinator's commit;
- `DataLoaderActor` (in `actors.graph.loader`) feeds batches of this rank's shard.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import trio

from actors.client.client import CoordinatorClient, Go
from actors.graph.loader import BatchSource, DataLoaderActor, LoaderPosition, LoadNext
from actors.state.buckets import DEFAULT_BUCKET_BYTES, Bucket, plan_buckets
from actors.state.digest import StateDigest, StateHasher, named_state, state_digest
from actors.state.training_state import (
    TrainingState,
    allocate,
    capture_state,
    manifest,
    restore_state,
)
from runtime.actor.base import Actor, ActorStopped, ActorSystem
from runtime.collectives.ring import (
    DEFAULT_CHUNK_BYTES,
    TRAINING_THREADED_MIN_BYTES,
    all_reduce,
    broadcast,
)
from runtime.config import DistributedConfig
from runtime.coordinator.core import agreement_hash, spec_hash
from runtime.errors import ActorFailed, ProtocolError, pick_error
from runtime.observe.trace import TraceRecorder
from runtime.protocol.messages import Hold, ResyncOrder, StartRun, StateManifest, StateTensor
from runtime.testing.faults import armed, fault_point
from runtime.transport.base import Transport

__all__ = [
    "DistributedTrainer",
    "CheckCost",
    "ComputeActor",
    "GradCommActor",
    "OptimizerActor",
    "TrainerOptions",
    "LossFn",
]

log = logging.getLogger("paramsync.trainer")

_OPTIMIZER_STEP_LOCK = threading.Lock()
"""Optimizer steps of the trainers in one process run one at a time. torch's optimizers are not
safe to step from several threads at once: two threads taking the first AdamW step of two
identical replicas (tied embeddings, identical gradients) disagreed on the tied weight in about
1 run in 12 (tests/test_soak.py reproduces it without paramsync). Only in-process groups run
several trainers in one process, and a step is milliseconds, so the lock costs nothing else."""

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``loss_fn(model, micro_batch) -> scalar loss``: the user's forward pass."""


@dataclass
class CheckCost:
    """What the identical-weights check (C-DDP-001) has cost this worker: the CPU time spent
    hashing its state, and how many digests it reported. Reporting them (a ~1.9 KB message)
    and the coordinator's comparison are not included."""

    hash_cpu_seconds: float = 0.0
    digests: int = 0


@dataclass(frozen=True)
class TrainerOptions:
    """Knobs of one worker's training loop."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    accumulation_steps: int = 1
    max_steps: int | None = None
    digest_interval: int | None = None
    """The coordinator sets how often digests are checked; a value here is an expectation:
    joining a run whose coordinator uses another interval is refused (None: follow it)."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    threaded_min_bytes: int = TRAINING_THREADED_MIN_BYTES
    """Buckets from this size all-reduce on blocking-socket threads (see `all_reduce`)."""
    threaded_shared_memory: bool = False
    """Run each shared-memory all-reduce on a worker thread rather than the event loop (see
    `runtime.transport.shm.SharedMemoryPlane.all_reduce`): one thread hand-off per bucket instead of
    event-loop wake-ups per step signal. Off: on this project's 2-core machine it made the
    step 1-5 % longer with 2 and 4 workers (BENCHMARKS.md); it may pay where the event loop
    is busier."""
    response_cache: bool = True
    """After an epoch's first step has negotiated every bucket with the coordinator, reduce
    buckets without waiting for its go (see `GradCommActor`); the coordinator still checks
    every report."""
    verify_overlap: bool = True
    """Check step s's digests while step s+1 computes. Turn off when the coordinator re-syncs
    diverged workers (``resync``): a re-sync must not overwrite weights a forward is reading."""

    def __post_init__(self) -> None:
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {self.accumulation_steps}")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {self.max_steps}")
        if self.digest_interval is not None and self.digest_interval < 1:
            raise ValueError(f"digest_interval must be >= 1, got {self.digest_interval}")


# ----------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Backward:
    """Run forward and backward on ``micro_batch``; ``sync`` on the step's last micro-batch."""

    step: int
    micro_batch: Any
    sync: bool


@dataclass(frozen=True)
class BucketReady:
    step: int
    bucket: int


@dataclass(frozen=True)
class OptimizerStep:
    """Apply the averaged gradients of ``step``."""

    step: int


@dataclass(frozen=True)
class Verify:
    """Report ``step``'s state digest; ``force``: a digest even off the digest interval (an
    epoch's starting-state check); ``wait``: then wait for the coordinator's commit (the next
    `OptimizerStep` waits for it anyway)."""

    step: int
    force: bool = False
    wait: bool = False


@dataclass
class _StepState:
    step: int
    reduced: int = 0
    all_reduced: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None


# ----------------------------------------------------------------------------- actors


class ComputeActor(Actor):
    """Forward and backward in a worker thread; hooks announce finished gradient buckets.

    ``on_bucket(step, bucket)`` runs in the event loop. A bucket that backward finishes while
    others are still being computed is handed to it from the backward thread at once (its
    all-reduce overlaps the rest of backward); the last one is announced when backward
    returns, which wakes the event loop anyway: handing it over from the thread too would
    wake the loop a second time for the same moment.
    """

    accepts = (Backward,)

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: LossFn,
        buckets: list[Bucket],
        on_bucket: Callable[[int, int], None],
        trace: TraceRecorder,
    ) -> None:
        super().__init__("compute", mailbox_size=2)
        self.model = model
        self.loss_fn = loss_fn
        self.trace = trace
        self._on_bucket = on_bucket
        self._params = dict(model.named_parameters())
        self._bucket_of = {name: b.index for b in buckets for name in b.names}
        self._pending: list[int] = [len(b.names) for b in buckets]
        self._sizes = [len(b.names) for b in buckets]
        self._sync_step: int | None = None
        self._left = 0
        """Buckets of the current backward not finished yet."""
        self._last: tuple[int, int] | None = None
        """(step, bucket): the backward's last bucket, announced when it returns."""
        self._token = trio.lowlevel.current_trio_token()
        self._hooks = [
            self._params[name].register_post_accumulate_grad_hook(self._make_hook(name))
            for name in self._bucket_of
        ]

    def _make_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        bucket = self._bucket_of[name]

        def hook(_param: torch.Tensor) -> None:
            if self._sync_step is None:
                return
            self._pending[bucket] -= 1
            if self._pending[bucket] == 0:
                self._left -= 1
                if self._left:
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
        loss = await trio.to_thread.run_sync(self._backward, message)
        last, self._last = self._last, None
        if last is not None:
            self._on_bucket(*last)
        return loss

    def _backward(self, message: Backward) -> float:
        self._last = None
        if message.sync:
            self._pending = list(self._sizes)
            self._left = len(self._sizes)
            self._sync_step = message.step
        try:
            fault_point("forward", message.step)
            with self.trace.span("forward", actor="compute", step=message.step):
                loss = self.loss_fn(self.model, message.micro_batch)
            fault_point("backward", message.step)
            with self.trace.span("backward", actor="compute", step=message.step):
                loss.backward()
        finally:
            self._sync_step = None
        if message.sync and any(self._pending):
            missing = [i for i, left in enumerate(self._pending) if left]
            raise RuntimeError(
                f"step {message.step}: backward produced no gradient for buckets {missing} "
                "(parameters unused by the loss cannot be synchronized)"
            )
        return float(loss.detach())


class GradCommActor(Actor):
    """Packs ready buckets, negotiates them with the coordinator, all-reduces them.

    The first step of an epoch negotiates every bucket: report it ready, all-reduce it when the
    coordinator says go, in the coordinator's order. Once every bucket has had its go, the
    members have agreed on each bucket's spec and order for the epoch (Horovod's response
    cache): from then on a bucket is reported ready marked cached and all-reduced at once, in
    the agreed order, without waiting for a round trip. The coordinator still checks each
    report against the agreement and stops the run naming the rank that differs, and the ring
    refuses a peer whose collective differs (ProtocolError), so nothing is reduced silently
    wrong. A new epoch (new members, a new ring) starts a new actor, hence a fresh negotiation.
    """

    accepts = (BucketReady, Go)

    def __init__(
        self,
        model: torch.nn.Module,
        buckets: list[Bucket],
        transport: Transport,
        client: CoordinatorClient,
        options: TrainerOptions,
        trace: TraceRecorder,
        epoch: int = 1,
        fold: bool = False,
    ) -> None:
        super().__init__("gradient-comm", mailbox_size=2 * len(buckets) + 4)
        self.buckets = buckets
        self.transport = transport
        self.client = client
        self.options = options
        self.trace = trace
        self.epoch = epoch
        plane = getattr(transport, "shared_memory", None)
        if plane is not None:
            plane.threaded = options.threaded_shared_memory
        params = dict(model.named_parameters())
        self._params = [[params[name] for name in bucket.names] for bucket in buckets]
        self._flats = [torch.empty(bucket.numel, dtype=bucket.dtype) for bucket in buckets]
        self._views = [_grad_views(ps, flat) for ps, flat in zip(self._params, self._flats)]
        for index in range(len(buckets)):
            self._bind(index)
        self._specs = [bucket.spec() for bucket in buckets]
        self._spec_hashes = [spec_hash(spec) for spec in self._specs]
        """What a cached report carries instead of the whole spec."""
        self._fold = fold
        """Every member folds: cached buckets get no report, the step report says so."""
        self._agreement = agreement_hash(dict(enumerate(self._spec_hashes)))
        self._packed = [False] * len(buckets)
        """Per bucket: whether this step copied the gradients in (they were not views)."""
        self.current: _StepState | None = None
        self._ready_ns: dict[int, int] = {}
        self._order: list[int] = []
        """Buckets in the order of the coordinator's gos (the epoch's first negotiation)."""
        self._cached: set[int] = set()
        """Buckets of the current step reported cached (reduced without a go)."""
        self._next = 0
        """Position in ``_order`` of the next cached bucket to reduce."""

    def _bind(self, index: int) -> None:
        """Make bucket ``index``'s gradients views of its flat buffer (torch DDP's
        ``gradient_as_bucket_view``): backward accumulates straight into the buffer and the
        reduced values land in the gradients, so neither needs a copy. A gradient that is not
        the view (none yet, or replaced: ``zero_grad(set_to_none=True)``) keeps its values."""
        views = self._views[index]
        if views is None:
            return
        with torch.no_grad():
            for param, view in zip(self._params[index], views):
                grad = param.grad
                if grad is view:
                    continue
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
                param.grad = view

    def zero_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """What ``optimizer.zero_grad(set_to_none=False)`` does after a step, cheaper: a bucket
        whose gradients are still views of its flat buffer is zeroed in one fill, not one
        kernel per gradient; any other gradient the optimizer holds is zeroed on its own."""
        done: set[int] = set()
        for index, flat in enumerate(self._flats):
            if self._bound(index):
                flat.zero_()
                done.update(id(param) for param in self._params[index])
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is not None and id(param) not in done:
                    if grad.grad_fn is not None:
                        grad.detach_()
                    else:
                        grad.requires_grad_(False)
                    grad.zero_()

    def _bound(self, index: int) -> bool:
        """Whether every gradient of bucket ``index`` is still its view of the flat buffer."""
        views = self._views[index]
        return views is not None and all(
            param.grad is view for param, view in zip(self._params[index], views)
        )

    @property
    def cache_ready(self) -> bool:
        """Whether buckets skip the round trip: every bucket has been agreed this epoch."""
        return self.options.response_cache and len(self._order) == len(self.buckets)

    def ready_soon(self, message: BucketReady) -> None:
        """Queue a bucket that backward finished (run by the event loop: must not raise). The
        mailbox holds every bucket and go of a step, so it is never full; if the actor is
        stopping, its epoch is ending and the step will be run again."""
        try:
            self.tell_nowait(message)
        except ActorStopped:
            pass
        except trio.WouldBlock:
            state = self.current
            if state is not None:
                state.error = RuntimeError(
                    f"step {message.step}: the gradient-comm mailbox is full (bucket "
                    f"{message.bucket} lost)"
                )
                state.all_reduced.set()

    def begin_step(self, step: int) -> _StepState:
        """Expect ``len(buckets)`` reductions for ``step``."""
        self.current = _StepState(step)
        self._cached = set()
        self._next = 0
        if not self.buckets:
            self.current.all_reduced.set()
        return self.current

    async def handle(self, message: object) -> None:
        if isinstance(message, BucketReady):
            await self._ready(message)
        else:
            assert isinstance(message, Go)
            await self._reduce(message)

    async def _ready(self, message: BucketReady) -> None:
        bucket = self.buckets[message.bucket]
        flat = self._flats[message.bucket]
        if self._bound(message.bucket):
            self._packed[message.bucket] = False  # backward wrote into the buffer itself
        else:
            grads = [param.grad for param in self._params[message.bucket]]
            with self.trace.span("pack", actor="gradient-comm", bucket=bucket.index):
                if grads and grads[0] is not None and grads[0].device.type == "cuda":
                    # C-STREAMSYNC-001: gradients must be complete before the host copy.
                    torch.cuda.current_stream(grads[0].device).synchronize()
                bucket.pack([g for g in grads if g is not None], flat)
            self._packed[message.bucket] = True
        if self.options.accumulation_steps > 1:
            flat.div_(self.options.accumulation_steps)
        spec = self._specs[bucket.index]
        if self.cache_ready:  # a bucket's spec is fixed: the agreed one
            if self._fold:  # no message on the critical path: the step report carries it
                self.client.folded(message.step, self.epoch, self._agreement)
            else:
                await self.client.ready(
                    message.step,
                    bucket.index,
                    self._spec_hashes[bucket.index],
                    self.epoch,
                    cached=True,
                )
            self._cached.add(bucket.index)
            # Reduce in the agreed order: every rank runs the same collectives in sequence.
            while self._next < len(self._order) and self._order[self._next] in self._cached:
                index = self._order[self._next]
                self._next += 1
                await self._all_reduce(message.step, index)
            return
        # Step s+1 may report before step s is committed: the coordinator holds the report and
        # says go only after the commit, so the check stays off the critical path.
        await self.client.ready(message.step, bucket.index, spec, self.epoch)
        self._ready_ns[bucket.index] = time.perf_counter_ns()

    async def _reduce(self, go: Go) -> None:
        state = self.current
        if state is None or go.step != state.step:
            raise RuntimeError(f"coordinator said go for step {go.step} outside that step")
        if go.bucket in self._cached:
            return  # reduced from the cache already (a peer negotiated it: same spec)
        sent = self._ready_ns.pop(go.bucket, None)
        if sent is not None:
            self.trace.complete(
                "negotiate",
                sent,
                time.perf_counter_ns(),
                actor="gradient-comm",
                bucket=go.bucket,
                step=go.step,
            )
        if go.bucket not in self._order:
            self._order.append(go.bucket)
        await self._all_reduce(go.step, go.bucket)

    async def _all_reduce(self, step: int, index: int) -> None:
        state = self.current
        assert state is not None and state.step == step
        bucket = self.buckets[index]
        flat = self._flats[index]
        with self.trace.span(
            "all-reduce", actor="gradient-comm", bucket=index, bytes=flat.numel() * 4
        ):
            reduce = partial(
                all_reduce,
                self.transport,
                flat,
                "avg",
                chunk_bytes=self.options.chunk_bytes,
                threaded_min_bytes=self.options.threaded_min_bytes,
            )
            if armed("allreduce", step):  # a fault trial: this rank dies in its all-reduce
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_die_mid_all_reduce, step)
                    await reduce()
            else:
                await reduce()
        if self._packed[index]:
            grads = [param.grad for param in self._params[index]]
            bucket.unpack(flat, [g for g in grads if g is not None])
            self._bind(index)  # views again from the next step on
        state.reduced += 1
        if state.reduced == len(self.buckets):
            state.all_reduced.set()


def _grad_views(params: list[torch.Tensor], flat: torch.Tensor) -> list[torch.Tensor] | None:
    """One view of ``flat`` per parameter, shaped like it, in bucket order; None where the
    gradients cannot live in the host buffer (a parameter on an accelerator, another dtype)."""
    views = []
    offset = 0
    for param in params:
        if param.device != flat.device or param.dtype != flat.dtype:
            return None
        count = param.numel()
        views.append(flat[offset : offset + count].view(param.shape))
        offset += count
    return views


async def _die_mid_all_reduce(step: int) -> None:
    # Runs at the all-reduce's first pause (the first peer signal or ring part it waits for;
    # with the threaded plane, the thread hand-off): this rank's part has started, its peers'
    # is not all in. Never cancelled, so the kill happens even if the collective never waits
    # (then right after it).
    await trio.lowlevel.checkpoint()
    fault_point("allreduce", step)


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
    """

    accepts = (OptimizerStep, Verify)

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        client: CoordinatorClient,
        options: TrainerOptions,
        trace: TraceRecorder,
        epoch: int = 1,
        on_applied: Callable[[int], None] | None = None,
        check_cost: CheckCost | None = None,
        zero_grads: Callable[[], None] | None = None,
    ) -> None:
        super().__init__("optimizer", mailbox_size=2)
        self.model = model
        self.optimizer = optimizer
        self.client = client
        self.options = options
        self.trace = trace
        self.epoch = epoch
        self.last_digest: bytes | None = None
        self._on_applied = on_applied
        self.zero_grads = zero_grads
        """Zeroes the gradients after a step (None: ``optimizer.zero_grad(set_to_none=False)``)."""
        self.check_cost = check_cost if check_cost is not None else CheckCost()
        self._hasher = StateHasher()
        self._names_sent: tuple[str, ...] | None = None
        self._hashed: tuple[int, StateDigest, int, int] | None = None
        """(step, digest, start ns, end ns): hashed right after ``step``'s optimizer step."""

    async def handle(self, message: object) -> None:
        if isinstance(message, OptimizerStep):
            with self.trace.span("commit-wait", actor="optimizer", step=message.step - 1):
                await self.client.wait_commit(message.step - 1)
            with self.trace.span("optimizer", actor="optimizer", step=message.step):
                await trio.to_thread.run_sync(self.apply, message.step)
            return
        assert isinstance(message, Verify)
        step = message.step
        hashed, self._hashed = self._hashed, None
        if message.force or step % self.client.digest_interval == 0:
            fault_point("digest", step)
            if hashed is not None and hashed[0] == step and not message.force:
                _, digest, started, ended = hashed
                self.trace.complete("digest", started, ended, actor="optimizer", step=step)
            else:  # an epoch's opening check: the state may have just arrived from a donor
                with self.trace.span("digest", actor="optimizer", step=step):
                    digest = await trio.to_thread.run_sync(self._timed_digest)
            self.last_digest = digest.digest
            # The tensor names travel with the epoch's first digest and when they change.
            names = None if digest.names is self._names_sent else digest.names
            await self.client.digest(step, digest.digest, digest.packed, self.epoch, names=names)
            self.check_cost.digests += 1
            self._names_sent = digest.names
        else:
            await self.client.step_done(step, self.epoch)
        if message.wait:
            with self.trace.span("commit-wait", actor="optimizer", step=step):
                await self.client.wait_commit(step)

    def _timed_digest(self) -> StateDigest:
        cpu = time.thread_time()
        try:
            return self._hasher.digest(self.model, self.optimizer)
        finally:
            self.check_cost.hash_cpu_seconds += time.thread_time() - cpu

    def apply(self, step: int) -> None:
        """Step the optimizer with ``step``'s reduced gradients (on a worker thread)."""
        with _OPTIMIZER_STEP_LOCK:
            fault_point("optimizer", step)
            self.optimizer.step()
            if self.zero_grads is not None:
                self.zero_grads()
            else:
                self.optimizer.zero_grad(set_to_none=False)
            if self._on_applied is not None:
                self._on_applied(step)
        if step % self.client.digest_interval == 0:
            started = time.perf_counter_ns()
            digest = self._timed_digest()
            self._hashed = (step, digest, started, time.perf_counter_ns())


# ----------------------------------------------------------------------------- trainer

Connect = Callable[[StartRun], Awaitable[Transport]]
"""Opens an epoch's data plane: a transport whose rank is this worker's ring position."""


class _StepAborted(Exception):
    """The step in flight was dropped by a membership change; it runs again in the new epoch."""


@dataclass
class _Epoch:
    start: StartRun
    transport: Transport
    compute: ComputeActor
    comm: GradCommActor
    optimizer: OptimizerActor
    ended: trio.Event = field(default_factory=trio.Event)
    """Set once the epoch is torn down (the supervisor then decides what comes next)."""


class DistributedTrainer:
    """Data-parallel training of one model replica, kept identical with its peers.

    Use it as an async context manager inside any trio application (``open``), or from a
    synchronous script through `actors.train.sync.SyncTrainer`. Each `train_batch` runs one
    optimizer
    step: forward and backward over ``accumulation_steps`` micro-batches, bucketed all-reduce of
    the trainable gradients (overlapping backward), optimizer step, and the coordinator's
    identical-weights check.

    The trainer lives through membership epochs. A supervisor task opens each epoch's data
    plane, brings a joiner the whole training state, and runs the epoch's actors; when the
    coordinator announces a new epoch (a worker died or joined) it drops the step in flight,
    which `train_batch` then runs again with the new members.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        config: DistributedConfig,
        client: CoordinatorClient,
        options: TrainerOptions,
        trace: TraceRecorder,
        connect: Connect,
    ) -> None:
        if client.start is None:
            raise ValueError("the client must have joined the run (client.join) first")
        if client.fold and not options.response_cache:
            # Its peers would reduce without reports while it waits for a go: a deadlock.
            raise ValueError(
                "the client offered to fold cached bucket reports (join fold=True), but "
                "response_cache is off: join with fold=False"
            )
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self._config = config
        self.client = client
        self.options = options
        self.trace = trace
        self.step = client.start.step
        self.losses: list[tuple[int, float]] = []
        self.step_seconds: list[float] = []
        self.check_cost = CheckCost()
        """The identical-weights check's cost to this worker so far (all epochs)."""
        self.epochs: list[tuple[int, int, tuple[int, ...]]] = []
        """(epoch, first step, members) of every epoch this worker took part in."""
        self.buckets = plan_buckets(list(model.named_parameters()), options.bucket_bytes)
        self._connect = connect
        self._owns_transports = True
        """Close each epoch's transport at its end (not a fixed one the caller passed in)."""
        self._epoch: _Epoch | None = None
        self._live = trio.Event()
        self._announced: list[StartRun | Hold] = []
        self._announced_event = trio.Event()
        self._step_scope: trio.CancelScope | None = None
        self._last_loss, self._last_loss_step = math.nan, -1
        self._held = trio.Event()
        """Set while the supervisor holds: no epoch live, the state at rest."""
        client.on_epoch = self._announce
        client.on_resync = self._resync
        client.resume_point = self._resume_point

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        config: DistributedConfig,
        transport: Transport | None,
        client: CoordinatorClient,
        options: TrainerOptions | None = None,
        trace: TraceRecorder | None = None,
        *,
        connect: Connect | None = None,
    ) -> AsyncIterator[DistributedTrainer]:
        """Start the worker's supervisor in a nursery of the caller's; yield once the first
        epoch is running (weights synchronized).

        ``client`` must already have joined the run (its coordinator accepted this model) and
        be served (`CoordinatorClient.serve`). Pass the data plane as a fixed ``transport``
        (a run whose membership never changes) or as ``connect``, which opens each epoch's.
        """
        options = options or TrainerOptions()
        trace = trace if trace is not None else TraceRecorder.disabled()
        if options.digest_interval not in (None, client.digest_interval):
            raise ValueError(
                f"this worker expects digest_interval={options.digest_interval}, the "
                f"coordinator checks every {client.digest_interval} steps"
            )
        if connect is None:
            if transport is None:
                raise ValueError("pass a transport or a connect function")
            if (transport.rank, transport.world_size) != (config.rank, config.world_size):
                raise ValueError("transport and config disagree on rank or world size")
            fixed = transport

            async def connect(start: StartRun) -> Transport:
                if start.epoch != 1 and fixed.world_size != len(start.members):
                    raise RuntimeError("a fixed transport cannot follow a membership change")
                return fixed

        trainer = cls(model, optimizer, loss_fn, config, client, options, trace, connect)
        trainer._owns_transports = transport is None
        async with trio.open_nursery() as nursery:
            await nursery.start(trainer._supervise)
            yield trainer
            nursery.cancel_scope.cancel()

    # ------------------------------------------------------------------ epochs

    def _announce(self, message: StartRun | Hold) -> None:
        """The coordinator announced a new epoch or a hold: end the live epoch now."""
        self._announced.append(message)
        self._announced_event.set()
        # Before the epoch's actors go: nothing more runs in it, and whatever they fail
        # with next belongs to the dropped step, which then reruns.
        if self._live.is_set():
            self._live = trio.Event()
        if self._step_scope is not None:
            self._step_scope.cancel()
        epoch = self._epoch
        if epoch is not None:
            epoch.transport.abort()  # wake collective threads blocked on dead peers

    async def _next_announcement(self, failure: BaseException | None) -> StartRun | Hold:
        """The coordinator's next epoch or hold; after a data-plane failure, within a deadline
        (the coordinator names the lost peer, or the failure stands)."""
        if not self._announced:
            seconds = 2 * self.client.start.heartbeat_deadline + 5.0 if failure else math.inf
            with trio.move_on_after(seconds):
                while not self._announced:
                    self._announced_event = trio.Event()
                    await self._announced_event.wait()
            if not self._announced:
                assert failure is not None
                raise failure
        return self._announced.pop(0)

    async def _supervise(
        self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        message: StartRun | Hold = self.client.start  # type: ignore[assignment]
        status: trio.TaskStatus[None] | None = task_status
        while True:
            if isinstance(message, Hold):
                log.warning("rank %d holds: %s", self.rank, message.reason)
                self._held.set()
                message = await self._next_announcement(None)
                self._held = trio.Event()
                continue
            status, failure = await self._run_epoch(message, status)
            message = await self._next_announcement(failure)

    async def _run_epoch(
        self, start: StartRun, status: trio.TaskStatus[None] | None
    ) -> tuple[trio.TaskStatus[None] | None, BaseException | None]:
        """Run one epoch until the coordinator announces the next; returns a data-plane
        failure that ended it early (the coordinator then decides)."""
        failure: BaseException | None = None
        transport: Transport | None = None
        with trio.CancelScope() as scope:
            try:
                async with trio.open_nursery() as nursery:

                    async def end_on_announcement() -> None:
                        while not self._announced:
                            self._announced_event = trio.Event()
                            await self._announced_event.wait()
                        scope.cancel()

                    nursery.start_soon(end_on_announcement)
                    transport = await self._connect(start)
                    await self._enter(start, transport)
                    async with ActorSystem() as system:
                        epoch = await self._start_actors(system, start, transport)
                        if start.verify:
                            await epoch.optimizer.tell(Verify(start.step - 1, force=True))
                        self._epoch = epoch
                        if not self._announced:
                            self._live.set()
                        if status is not None:
                            status.started()
                            status = None
                        await trio.sleep_forever()
            except Exception as exc:
                if self._announced:
                    # Its actors failed while being stopped for the next epoch: no fault.
                    log.debug("rank %d: epoch %d ended (%r)", self.rank, start.epoch, exc)
                elif status is not None:
                    raise  # the first epoch never started: nothing to recover
                else:
                    failure = exc
                    log.warning(
                        "rank %d: epoch %d ended by %r", self.rank, start.epoch, pick_error(exc)
                    )
            finally:
                # Leave the epoch: stop the step in flight, finish it if every member holds
                # its gradients (apply), else drop them.
                if self._live.is_set():  # never swap an event someone still waits on
                    self._live = trio.Event()
                ending, self._epoch = self._epoch, None
                if ending is not None:
                    ending.compute.remove_hooks()  # the next epoch's compute adds its own
                if self._step_scope is not None:
                    self._step_scope.cancel()
                with trio.CancelScope(shield=True):
                    if transport is not None:
                        transport.abort()
                        if start.apply_barrier and self.client.applied(self.step):
                            await trio.to_thread.run_sync(self._apply_pending)
                        self.optimizer.zero_grad(set_to_none=False)
                        if self._owns_transports:
                            await transport.aclose()
                if ending is not None:
                    ending.ended.set()
        return status, failure

    async def _resume_point(self) -> tuple[int, bytes]:
        """Once the supervisor holds, the next step and the state digest this worker rejoins
        a restarted coordinator with (it picks the majority's newest state)."""
        await self._held.wait()
        digest = await trio.to_thread.run_sync(state_digest, self.model, self.optimizer)
        return self.step, digest.digest

    def _apply_pending(self) -> None:
        step = self.step
        with _OPTIMIZER_STEP_LOCK:
            if self.step == step:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                self.step = step + 1
                log.info("rank %d applied step %d while leaving its epoch", self.rank, step)

    async def _enter(self, start: StartRun, transport: Transport) -> None:
        """Bring every member to the epoch's starting state before its first step."""
        if start.broadcast:
            await self._sync_initial_weights(transport)
        elif start.donor >= 0:
            if self.rank == start.donor:
                for receiver in start.receivers:
                    await self._send_state(transport, start.position(receiver))
            elif self.rank in start.receivers:
                await self._receive_state(transport, start.position(start.donor))
        if self.rank not in start.receivers:
            if start.broadcast:
                self.step = start.step
            elif self.step != start.step:
                raise ProtocolError(
                    f"epoch {start.epoch} starts at step {start.step}, but rank {self.rank} "
                    f"is at step {self.step}",
                    peer="coordinator",
                )
        self.client.begin_epoch(start)
        self.epochs.append((start.epoch, start.step, start.members))
        log.info(
            "rank %d: epoch %d at step %d, ranks %s (position %d of %d)",
            self.rank,
            start.epoch,
            start.step,
            list(start.members),
            start.position(self.rank),
            len(start.members),
        )

    async def _start_actors(
        self, system: ActorSystem, start: StartRun, transport: Transport
    ) -> _Epoch:
        comm = GradCommActor(
            self.model,
            self.buckets,
            transport,
            self.client,
            self.options,
            self.trace,
            start.epoch,
            fold=start.fold,
        )

        def on_bucket(step: int, bucket: int) -> None:
            comm.ready_soon(BucketReady(step, bucket))

        compute = ComputeActor(self.model, self.loss_fn, self.buckets, on_bucket, self.trace)
        optimizer = OptimizerActor(
            self.model,
            self.optimizer,
            self.client,
            self.options,
            self.trace,
            start.epoch,
            self._applied,
            self.check_cost,
            zero_grads=partial(comm.zero_grads, self.optimizer),
        )
        try:
            await system.start(compute)
            await system.start(comm)
            await system.start(optimizer)
        except BaseException:
            compute.remove_hooks()
            raise
        self.client.on_go = comm.tell
        return _Epoch(start, transport, compute, comm, optimizer)

    def _applied(self, step: int) -> None:
        self.step = step + 1

    async def _sync_initial_weights(self, transport: Transport) -> None:
        """Broadcast position 0's parameters and buffers so every replica starts identical."""
        for tensor in list(self.model.parameters()) + list(self.model.buffers()):
            host = tensor.detach().to("cpu").contiguous()
            await broadcast(
                transport, _wire_view(host), root=0, chunk_bytes=self.options.chunk_bytes
            )
            with torch.no_grad():  # never across an await: grad mode is per thread, not per task
                tensor.copy_(host)

    async def _send_state(self, transport: Transport, peer: int) -> None:
        """Send this worker's whole training state to ring position ``peer`` (a joiner)."""
        state = capture_state(self.model, self.optimizer, self.step)
        await transport.send(peer, *StateManifest(manifest(state)).to_wire())
        for index, (_, tensor) in enumerate(state.tensors):
            part = StateTensor(state.step, index, _wire_view(tensor))
            await transport.send(peer, *part.to_wire_bulk())

    async def _receive_state(self, transport: Transport, peer: int) -> None:
        """Receive a healthy member's whole training state and take it over."""
        message = await transport.recv(peer)
        if message.get("kind") != "state_manifest":
            raise ProtocolError(
                f"expected the state manifest, got {message.get('kind')}", peer=peer
            )
        plan = message["manifest"]
        tensors = allocate(plan)
        for index, (name, tensor) in enumerate(tensors):
            got = await transport.recv_into(peer, _wire_view(tensor))
            if got["kind"] != "state" or got["index"] != index:
                raise ProtocolError(
                    f"state transfer: expected tensor {index} ({name}), got {got['kind']} "
                    f"{got.get('index')}",
                    peer=peer,
                )
        state = TrainingState.from_manifest(plan, tensors)
        await trio.to_thread.run_sync(restore_state, self.model, self.optimizer, state)
        self.step = state.step
        log.info("rank %d received the training state at step %d", self.rank, state.step)

    # ------------------------------------------------------------------ the seed's API

    @property
    def rank(self) -> int:
        """This worker's rank (its slot, stable across epochs)."""
        return self._config.rank

    @property
    def transport(self) -> Transport:
        """The current epoch's data plane (its rank is this worker's ring position)."""
        if self._epoch is None:
            raise RuntimeError("no epoch is running")
        return self._epoch.transport

    @property
    def dist_config(self) -> DistributedConfig:
        """This worker's rank, world size and coordinator address."""
        return self._config

    @property
    def world_size(self) -> int:
        """Number of workers training together now (the current epoch's members)."""
        start = self._epoch.start if self._epoch is not None else self.client.start
        return len(start.members) if start is not None else self._config.world_size

    @property
    def position(self) -> int:
        """This worker's ring position in the current epoch (its data shard)."""
        start = self._epoch.start if self._epoch is not None else self.client.start
        return start.position(self.rank) if start is not None else self.rank

    @property
    def is_coordinator(self) -> bool:
        """Whether this worker is rank 0, the one that reports for the group."""
        return self._config.rank == 0

    @property
    def optimizer_actor(self) -> OptimizerActor:
        """The current epoch's optimizer actor."""
        if self._epoch is None:
            raise RuntimeError("no epoch is running")
        return self._epoch.optimizer

    @property
    def reached_max_steps(self) -> bool:
        """Whether ``max_steps`` optimizer steps have been taken."""
        return self.options.max_steps is not None and self.step >= self.options.max_steps

    async def train_batch(self, batch: Any) -> float:
        """One optimizer step on this worker's ``batch``; returns its mean loss.

        A batch that is a tensor, or a tuple/list of tensors, is split along dimension 0 into
        ``accumulation_steps`` micro-batches. The identical-weights check of this step finishes
        during the next one (or in `verified`); a divergence fails the next call. If the
        membership changes meanwhile, the step runs again with the new members. If instead the
        step was completed without this call (applied while leaving an epoch, or received with
        a peer's state), it returns this worker's loss of it, or nan if none was computed.
        """
        step = self.step
        while True:
            try:
                return await self._attempt(batch, step)
            except _StepAborted:
                if self.step > step:  # the step is done: never run this batch on a later one
                    return self._last_loss if self._last_loss_step == step else math.nan
                continue

    async def _attempt(self, batch: Any, step: int, position: int | None = None) -> float:
        """Run ``step`` once in the live epoch; raises _StepAborted if the epoch ends, or if
        the worker is no longer at ``step`` (or ring ``position``) when the epoch is live."""
        if self.reached_max_steps:
            raise RuntimeError(f"max_steps={self.options.max_steps} already reached")
        await self._live.wait()
        if self.step != step or position not in (None, self.position):
            raise _StepAborted
        epoch = self._epoch
        assert epoch is not None
        started = time.perf_counter()
        loss = math.nan
        scope = trio.CancelScope()
        try:
            with scope:
                self._step_scope = scope
                state = epoch.comm.begin_step(step)
                micro_batches = _split(batch, self.options.accumulation_steps)
                total = 0.0
                # Once every bucket is agreed, the compute needs nothing from the coordinator:
                # its messages (the last step's commit) wait until the compute is done.
                with self.client.reads_deferred() if epoch.comm.cache_ready else nullcontext():
                    for index, micro in enumerate(micro_batches):
                        last = index == len(micro_batches) - 1
                        total += await epoch.compute.ask(Backward(step, micro, last))
                loss = total / len(micro_batches)
                self._last_loss, self._last_loss_step = loss, step
                with self.trace.span("grad-wait", actor="trainer", step=step):
                    await state.all_reduced.wait()
                if state.error is not None:
                    raise state.error
                if epoch.start.apply_barrier:
                    # A cached all-reduce may finish before the previous step is committed;
                    # the coordinator takes this step's report only after that commit.
                    await self.client.wait_commit(step - 1)
                    await self.client.reduced(step, epoch.start.epoch)
                    with self.trace.span("apply-wait", actor="trainer", step=step):
                        await self.client.wait_apply(step)
                await epoch.optimizer.ask(OptimizerStep(step))
                if self.options.verify_overlap:
                    await epoch.optimizer.tell(Verify(step))
                else:
                    await epoch.optimizer.ask(Verify(step, wait=True))
        except Exception as exc:
            if scope.cancel_called:  # the epoch ended under the step
                raise _StepAborted from exc
            if _broken_by_a_peer(exc):
                # A peer's failure broke the epoch (its links, then its actors): the
                # supervisor decides. A new epoch reruns the step; none within its deadline
                # fails the trainer, cancelling this task.
                await epoch.ended.wait()
                raise _StepAborted from exc
            raise
        finally:
            self._step_scope = None
        if scope.cancelled_caught or self.step != step + 1:
            raise _StepAborted
        self.losses.append((step, loss))
        self.step_seconds.append(time.perf_counter() - started)
        return loss

    async def _resync(self, order: ResyncOrder) -> None:
        """Copy the source rank's parameters and optimizer state to the diverged ranks."""
        epoch = self._epoch
        if epoch is None:
            return
        start = epoch.start
        rank = self.rank
        if rank != order.source and rank not in order.targets:
            return
        tensors = [tensor for _, tensor in named_state(self.model, self.optimizer)]
        log.warning(
            "step %d: re-syncing ranks %s from rank %d",
            order.step,
            list(order.targets),
            order.source,
        )
        for index, tensor in enumerate(tensors):
            if rank == order.source:
                host = tensor.detach().to("cpu").contiguous()
                part = StateTensor(order.step, index, _wire_view(host))
                for target in order.targets:
                    await epoch.transport.send(start.position(target), *part.to_wire_bulk())
            else:
                host = torch.empty(tensor.shape, dtype=tensor.dtype)
                source = start.position(order.source)
                message = await epoch.transport.recv_into(source, _wire_view(host))
                if (message["kind"], message["step"], message["index"]) != (
                    StateTensor.KIND,
                    order.step,
                    index,
                ):
                    raise ProtocolError(
                        f"re-sync of step {order.step}: expected state tensor {index}, got "
                        f"{message['kind']} {message.get('index')}",
                        peer=order.source,
                    )
                with torch.no_grad():
                    tensor.copy_(host)

    async def verified(self) -> None:
        """Wait until every step taken so far is committed: all ranks' digests agreed."""
        while True:
            await self._live.wait()
            with trio.CancelScope() as scope:
                self._step_scope = scope
                await self.client.wait_commit(self.step - 1)
            self._step_scope = None
            if not scope.cancelled_caught:
                return

    async def finish(self) -> None:
        """Tell the coordinator this worker is done, and wait for the run's end; after a
        membership change, take part in the new epoch's check and say it again."""
        while not self.client.done.is_set():
            await self._live.wait()
            epoch = self._epoch
            assert epoch is not None
            with trio.CancelScope() as scope:
                self._step_scope = scope
                await self.client.wait_commit(self.step - 1)
                await self.client.finished(self.step, epoch.start.epoch)
                await self.client.done.wait()
            self._step_scope = None

    async def fit(
        self,
        dataset: BatchSource,
        batch_size: int,
        *,
        steps: int | None = None,
        seed: int = 0,
        prefetch: int = 4,
        on_step: Callable[[int, float], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[tuple[int, float]]:
        """Train on this worker's shard of ``dataset`` through the data loader actor.

        Runs ``steps`` optimizer steps (default: until ``max_steps``), epoch after epoch.
        Step s's batch for the worker at ring position p is a pure function of (s, p), so a
        step dropped by a membership change is rerun on the data its new position owns.
        ``on_step(step, loss)`` is called after each step; ``should_stop()`` returning True
        ends training after the step in flight. Returns this call's (step, loss) pairs.
        """
        if steps is None and self.options.max_steps is None:
            raise ValueError("fit needs steps= or TrainerOptions(max_steps=...)")
        history: list[tuple[int, float]] = []
        slots = self._config.world_size
        async with ActorSystem() as system:
            loader: DataLoaderActor | None = None
            while not self.reached_max_steps and (steps is None or len(history) < steps):
                if should_stop is not None and should_stop():
                    break
                await self._live.wait()
                step, position = self.step, self.position
                fault_point("data", step)
                if loader is None or loader.expects != (step, position):
                    if loader is not None:
                        await loader.stop()
                    loader = DataLoaderActor(
                        dataset,
                        batch_size,
                        position,
                        slots,
                        seed=seed,
                        prefetch=prefetch,
                        position=LoaderPosition.at_step(step, len(dataset), slots, batch_size),
                    )
                    loader.expects = (step, position)
                    await system.start(loader)
                    for _ in range(prefetch):
                        await loader.tell(LoadNext())
                with self.trace.span("load", actor="data-loader", step=step):
                    _, batch = await loader.batches.receive()
                await loader.tell(LoadNext())
                loader.expects = (step + 1, position)
                try:
                    loss = await self._attempt(batch, step, position)
                except _StepAborted:
                    loader.expects = None
                    if self.step > step:  # done without this attempt finishing
                        done = self._last_loss if self._last_loss_step == step else math.nan
                        history.append((step, done))
                    continue
                history.append((step, loss))
                if on_step is not None:
                    on_step(step, loss)
            if loader is not None:
                await loader.stop()
        return history

    def summary(self) -> dict[str, Any]:
        """Final step and loss, the digest of this rank's state after its last step (None before
        the first), the throughput and the membership epochs it saw."""
        seconds = sum(self.step_seconds)
        digest = state_digest(self.model, self.optimizer).digest if self.step_seconds else None
        return {
            "rank": self._config.rank,
            "world_size": self._config.world_size,
            "final_step": self.step,
            "first_loss": self.losses[0][1] if self.losses else None,
            "final_loss": self.losses[-1][1] if self.losses else None,
            "digest": digest.hex() if digest is not None else None,
            "steps_per_second": len(self.step_seconds) / seconds if seconds else None,
            "median_step_seconds": sorted(self.step_seconds)[len(self.step_seconds) // 2]
            if self.step_seconds
            else None,
            "epochs": [{"epoch": e, "step": s, "members": list(m)} for e, s, m in self.epochs],
            "hash_cpu_seconds": self.check_cost.hash_cpu_seconds,
            "digests": self.check_cost.digests,
        }


def _broken_by_a_peer(error: BaseException) -> bool:
    """Whether a step failed because its epoch's links or actors went away (a peer died or
    left), not by an error of its own (the loss function, a bad batch)."""
    leaf = pick_error(error)
    while isinstance(leaf, ActorFailed) and leaf.__cause__ is not None:
        leaf = pick_error(leaf.__cause__)
    return isinstance(leaf, ProtocolError | ActorStopped)


def _wire_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as the wire can carry it: bool (no RFC 8746 tag) as its uint8 bytes."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


def _split(batch: Any, parts: int) -> list[Any]:
    if parts == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        return _split_tensor(batch, parts)
    if isinstance(batch, tuple | list):
        columns = [_split_tensor(item, parts) for item in batch]
        return [type(batch)(column[i] for column in columns) for i in range(parts)]
    raise TypeError(
        f"cannot split a {type(batch).__name__} into micro-batches: pass a tensor or a tuple"
    )


def _split_tensor(tensor: torch.Tensor, parts: int) -> Sequence[torch.Tensor]:
    if tensor.shape[0] % parts:
        raise ValueError(
            f"batch of {tensor.shape[0]} does not split into {parts} equal micro-batches"
        )
    return tensor.chunk(parts)
