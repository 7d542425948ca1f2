"""`DistributedTrainer`: one worker's data-parallel training loop over its actor graph.

A worker is a trio nursery of actors joined by bounded mailboxes (`actors.graph`): the compute
actor runs forward and backward in a worker thread, the gradient-comm actor negotiates and
all-reduces each gradient bucket while backward goes on, the optimizer actor applies the step
and reports the state digest for the C-DDP-001 check, and the data loader actor feeds batches of
this rank's shard. The trainer builds them for each membership epoch (through an
`ActorFactory`), moves a step through them, and follows the coordinator's epochs.

Besides the parameters, the trainer keeps the model's buffers identical on every rank
(`actors.train.buffer_sync`, ``TrainerOptions.buffer_sync``), steps an optional LR scheduler
right after each optimizer step (its state travels with the training state and is part of the
digest), and exports the trained model (`DistributedTrainer.state_dict`, `save_safetensors`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import trio
from safetensors.torch import save_file

from actors.client.client import CoordinatorClient
from actors.graph.compute import ComputeActor, LossFn
from actors.graph.factory import ActorFactory
from actors.graph.gradcomm import GradCommActor, StepState
from actors.graph.loader import BatchSource, DataLoaderActor, LoaderPosition, LoadNext
from actors.graph.messages import Backward, BucketReady, OptimizerStep, Verify
from actors.graph.optimizer import (
    OPTIMIZER_STEP_LOCK,
    CheckCost,
    OptimizerActor,
    clip_gradients,
    clip_settings,
)
from actors.graph.precision import GradScalerDigests, MixedPrecision
from actors.multidevice import DataParallelCoordinator, ReplicatedOptimizer
from actors.state.buckets import plan_buckets
from actors.state.digest import Scheduler, StateDigest, named_state, state_digest
from actors.train.buffer_sync import BufferSync, sync_buffers
from actors.train.options import TrainerOptions
from actors.train.state_transfer import receive_state, send_state, wire_view
from actors.train.unbound_optimizer import check_can_receive_state
from runtime.actor.base import ActorStopped, ActorSystem
from runtime.collectives.ring import (
    all_reduce,
    broadcast,
)
from runtime.config import DistributedConfig
from runtime.errors import ActorFailed, ProtocolError, pick_error
from runtime.observe.metrics import (
    Metrics,
    MetricsTrace,
    metrics_host_from_env,
    metrics_port_from_env,
    serve_metrics,
)
from runtime.observe.trace import TraceRecorder
from runtime.protocol.messages import Hold, ResyncOrder, StartRun, StateTensor
from runtime.transport.base import Transport

__all__ = [
    "DistributedTrainer",
    "CheckCost",
    "Connect",
    "TrainerOptions",
    "LossFn",
    "OwnStep",
    "Scheduler",
]

log = logging.getLogger("paramsync.trainer")


Connect = Callable[[StartRun], Awaitable[Transport]]
"""Opens an epoch's data plane: a transport whose rank is this worker's ring position."""


@dataclass(frozen=True)
class OwnStep:
    """A step whose forward and backward the caller's own code runs (`begin_own_step`)."""

    step: int
    epoch: _Epoch
    state: StepState
    started: float
    """``time.perf_counter()`` when the step began (begun by the previous step's
    `finish_own_step`: when that one finished)."""

    @property
    def compute(self) -> ComputeActor:
        """The epoch's compute actor, whose gradient hooks the caller's backward fires."""
        return self.epoch.compute


class StartingStateDiffers(RuntimeError):
    """After an epoch's initial broadcast, some members' parameters or buffers differ from
    position 0's (C-DDP-001 before the first step): ``ranks`` differ; ``tensor`` is the first
    differing one on a rank that differs (None on the others)."""

    def __init__(self, epoch: int, step: int, ranks: list[int], tensor: str | None) -> None:
        where = f", first at tensor {tensor!r} on this rank" if tensor is not None else ""
        super().__init__(
            f"epoch {epoch} at step {step}: after the initial broadcast, ranks {ranks} hold "
            f"another state than position 0's{where}: the run cannot start"
        )
        self.epoch, self.step, self.ranks, self.tensor = epoch, step, ranks, tensor


@dataclass
class _CallerGate:
    """Where the caller's own loop is (`actors.train.ddp_wrapper`): a new epoch's entry (its
    state transfer, buffer synchronization and opening check) touches the model and optimizer,
    which the caller's thread also touches between its crossings into the event loop. The
    entry waits until that thread is parked in a crossing, and a crossing does not hand the
    state back while an entry runs."""

    outside: bool = True
    """The caller's thread runs its own code (not inside a crossing)."""
    changed: trio.Event = field(default_factory=trio.Event)
    """Set (and replaced) whenever the caller enters or leaves a crossing."""
    must_apply: int | None = None
    """A step every member was told to apply when its epoch ended: the caller applies it
    before the next epoch may enter."""
    entering: bool = False
    entered: trio.Event = field(default_factory=trio.Event)
    gone: bool = False
    """The caller's loop is over (the trainer is finishing): nothing to wait for."""
    applies: bool = False
    """The caller steps its optimizer itself: a step every member was told to apply is
    applied by the caller when the epoch ends under it, not by the trainer."""


class EarlyTermination(RuntimeError):
    """A member's data ended inside ``join(throw_on_early_termination=True)``: every member
    raises it at the same step, as torch's ``Join`` does."""

    def __init__(self, step: int, joined: int) -> None:
        super().__init__(
            f"step {step}: {joined} rank(s) exhausted their inputs "
            "(join(throw_on_early_termination=True))"
        )
        self.step = step
        self.joined = joined


class _StepAborted(Exception):
    """The step in flight was dropped by a membership change; it runs again in the new epoch."""


class _AllJoined(Exception):
    """Every rank's data has ended (``join``): the ranks stop together, before the step."""


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

    default_actors: ClassVar[ActorFactory] = ActorFactory()
    """What trainers given no ``actors`` build their actors with: the plain actor classes. A
    seam for harnesses that run a trainer inside a job they do not control (the fault trials'
    `runtime.testing.faulty_daemon` replaces it for its process); nothing else should."""

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
        actors: ActorFactory | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        _check_scheduler(scheduler, optimizer)
        if client.start is None:
            raise ValueError("the client must have joined the run (client.join) first")
        if options.parallel_layout not in (None, client.layout):
            raise ValueError(
                f"the client joined with the parallel layout {client.layout}, but the options "
                f"give {options.parallel_layout}: join with the options' layout"
            )
        if client.fold and not options.response_cache:
            # Its peers would reduce without reports while it waits for a go: a deadlock.
            raise ValueError(
                "the client offered to fold cached bucket reports (join fold=True), but "
                "response_cache is off: join with fold=False"
            )
        self.replicas = _replicas_of(model, optimizer, loss_fn, options, scheduler)
        """The process's devices' replicas when ``optimizer`` is a `ReplicatedOptimizer`
        (hierarchical data parallelism), else None."""
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        """The LR scheduler stepped right after each optimizer step (None: none)."""
        self.loss_fn = loss_fn
        self._config = config
        self.client = client
        self.options = options
        self._throw_on_early_termination = False
        self._caller: _CallerGate | None = None
        """The caller's own loop, when one drives this trainer (`attach_caller`)."""
        self._watched_scaler: torch.amp.GradScaler | None = None
        """A loss scaler of the caller's own loop, covered by the digests (`watch_grad_scaler`)."""
        self.trace = trace
        self.metrics: Metrics | None = None
        """This worker's Prometheus metrics (None: off; `TrainerOptions.metrics_port`)."""
        self.metrics_address: tuple[str, int] | None = None
        """Where they are served, once the trainer started (None: off)."""
        self.actors = actors if actors is not None else type(self).default_actors
        """The constructors of this trainer's actors (see `ActorFactory`)."""
        self.parallel_layout = client.layout
        """The 3D-parallel layout this worker joined with (None: a flat data-parallel run)."""
        self.step = client.start.step
        self.losses: list[tuple[int, float]] = []
        """(step, loss) of the last ``options.history_steps`` steps this worker ran."""
        self.step_seconds: list[float] = []
        """Wall time of the last ``options.history_steps`` steps this worker ran."""
        self.unused_parameters: tuple[str, ...] = ()
        """The parameters no rank gave a gradient in the last step this worker took part in
        (``find_unused_parameters``; the same on every rank)."""
        self.grad_norms: list[tuple[int, float]] = []
        """(step, total gradient norm before clipping) of the last ``options.history_steps``
        steps, with ``clip_grad_norm`` set (the averaged gradients': the same on every rank)."""
        self.joined_steps = 0
        """Steps this worker took part in with zero gradients, its data ended (`join`)."""
        self._first_loss: float | None = None
        self._steps_run = 0
        self._seconds_run = 0.0
        self.check_cost = CheckCost()
        """The identical-weights check's cost to this worker so far (all epochs)."""
        self.epochs: list[tuple[int, int, tuple[int, ...]]] = []
        """(epoch, first step, members) of every epoch this worker took part in."""
        self.states_received = 0
        """How many times a peer's state replaced this worker's (a donor's whole state, a
        re-sync): a state captured before then is not the one a later commit checked."""
        self.buckets = plan_buckets(list(model.named_parameters()), options.bucket_bytes)
        self.precision = MixedPrecision.for_model(
            model,
            options.autocast_dtype,
            options.grad_scaler,
            init_scale=options.grad_scaler_init_scale,
            growth_interval=options.grad_scaler_growth_interval,
            growth_tracker=options.grad_scaler_growth_tracker,
        )
        """Autocast and the loss scaler (None: full precision), from the options."""
        self.skipped_steps: list[int] = []
        """The last ``options.history_steps`` steps the loss scaler skipped (inf or nan in the
        averaged gradients: every rank skips the same ones)."""
        self._skipped_total = 0
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
        self._next_own: OwnStep | None = None
        """The caller's own loop's next step, begun in the event loop as its previous one
        finished (`finish_own_step`), for `prepared_own_step` to hand out without a crossing."""
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
        actors: ActorFactory | None = None,
        scheduler: Scheduler | None = None,
    ) -> AsyncIterator[DistributedTrainer]:
        """Start the worker's supervisor in a nursery of the caller's; yield once the first
        epoch is running (weights synchronized).

        ``client`` must already have joined the run (its coordinator accepted this model) and
        be served (`CoordinatorClient.serve`). Pass the data plane as a fixed ``transport``
        (a run whose membership never changes) or as ``connect``, which opens each epoch's.
        ``actors``: the constructors of its actors (default `default_actors`).
        ``scheduler``: an LR scheduler of ``optimizer`` (torch's ``LRScheduler``), stepped right
        after each optimizer step, as a torch loop calls ``scheduler.step()`` after
        ``optimizer.step()``; its state is part of the training state (live rejoin, the digest).
        """
        options = options or TrainerOptions()
        trace = trace if trace is not None else TraceRecorder.disabled()
        metrics_port = options.metrics_port
        if metrics_port is None:
            metrics_port = metrics_port_from_env()
        metrics = None
        if metrics_port is not None:  # spans feed the metrics (timed even if not traced)
            metrics = Metrics("worker", rank=config.rank)
            trace = MetricsTrace(trace, metrics)
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

        trainer = cls(
            model,
            optimizer,
            loss_fn,
            config,
            client,
            options,
            trace,
            connect,
            actors=actors,
            scheduler=scheduler,
        )
        trainer._owns_transports = transport is None
        trainer.metrics = metrics
        async with trio.open_nursery() as nursery:
            if metrics is not None:
                assert metrics_port is not None
                host = options.metrics_host or metrics_host_from_env()
                trainer.metrics_address = await nursery.start(
                    serve_metrics, metrics, metrics_port, host
                )
                log.info(
                    "rank %d: metrics at http://%s:%d/metrics",
                    config.rank,
                    *trainer.metrics_address,
                )
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
            start = self.client.start
            seconds = (
                2 * start.heartbeat_deadline + 5.0 if failure and start is not None else math.inf
            )
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
                    await self._caller_parked()
                    await self._enter(start, transport)
                    async with ActorSystem() as system:
                        epoch = await self._start_actors(system, start, transport)
                        if start.verify:
                            verify = Verify(start.step - 1, force=True)
                            if self._caller is None:
                                await epoch.optimizer.tell(verify)
                            else:  # hashed before the caller's loop may touch the state
                                await epoch.optimizer.ask(verify)
                        self._caller_released()
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
                            gate = self._caller
                            if gate is not None and gate.applies:
                                gate.must_apply = self.step  # its begin_caller_apply says so
                            else:
                                await trio.to_thread.run_sync(self._apply_pending)
                        self.optimizer.zero_grad(set_to_none=False)
                        if self._owns_transports:
                            await transport.aclose()
                if ending is not None:
                    ending.ended.set()
                self._caller_released()
        return status, failure

    def caller_left(self) -> None:
        """The caller's loop is over: epochs enter without waiting for it."""
        gate = self._caller
        if gate is not None:
            gate.gone = True
            gate.changed.set()

    def attach_caller(self, *, applies: bool) -> None:
        """A caller's own loop drives this trainer from its own thread from now on
        (`actors.train.ddp_wrapper`), crossing into the event loop through `caller_crossing`;
        ``applies``: it steps the optimizer itself. In the event loop."""
        if self._caller is None:
            self._caller = _CallerGate()
        self._caller.applies = applies

    async def caller_crossing(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``await fn(*args)`` for the caller's thread, which is parked meanwhile: a new
        epoch may enter; the result is handed back only once no entry is running."""
        gate = self._caller
        if gate is None:
            return await fn(*args)
        gate.outside = False
        gate.changed.set()
        try:
            return await fn(*args)
        finally:
            with trio.CancelScope(shield=True):
                while gate.entering:
                    await gate.entered.wait()
            gate.outside = True
            gate.changed.set()

    async def _caller_parked(self) -> None:
        """Before a new epoch's entry: wait until the caller's thread is parked in a crossing
        (or its loop is over), and keep it there until `_caller_released`."""
        gate = self._caller
        if gate is None:
            return
        while not gate.gone and (gate.outside or gate.must_apply is not None):
            gate.changed = trio.Event()
            await gate.changed.wait()
        # No await since the check: the caller is still parked, and stays so until released.
        gate.entering, gate.entered = True, trio.Event()

    def _caller_released(self) -> None:
        gate = self._caller
        if gate is not None and gate.entering:
            gate.entering = False
            gate.entered.set()

    async def _resume_point(self) -> tuple[int, bytes]:
        """Once the supervisor holds, the next step and the state digest this worker rejoins
        a restarted coordinator with (its donor rule picks the state the run resumes from)."""
        await self._held.wait()
        digest = await trio.to_thread.run_sync(self._resume_digest)
        return self.step, digest.digest

    def _resume_digest(self) -> StateDigest:
        """The digest a worker rejoins with, here and in `join_run` (no loss scaler entry)."""
        return state_digest(
            self.model,
            self.optimizer,
            self.scheduler,
            buffers=self.options.buffer_sync != "local",
        )

    def state_digest(self) -> StateDigest:
        """The digest of this worker's training state now, as the C-DDP-001 check computes it:
        parameters, buffers (unless kept local), optimizer and LR scheduler state, and the loss
        scaler's state in a mixed-precision run."""
        digest = self._resume_digest()
        scaler = self.precision.scaler if self.precision is not None else None
        return GradScalerDigests(scaler).extend(digest) if scaler is not None else digest

    def _apply_pending(self) -> None:
        step = self.step
        clip = clip_settings(self.options)
        with OPTIMIZER_STEP_LOCK:
            if self.step == step:
                if clip is not None:  # as the optimizer actor would have
                    if self.precision is not None:
                        self.precision.unscale(self.optimizer)  # clip the true gradients
                    self._record_norm(step, clip_gradients(self.model, *clip))
                if self.precision is None:
                    self.optimizer.step()
                elif self.precision.step(self.optimizer):
                    self._skipped(step)
                if self.scheduler is not None:
                    self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=False)
                self.step = step + 1
                log.info("rank %d applied step %d while leaving its epoch", self.rank, step)

    async def _enter(self, start: StartRun, transport: Transport) -> None:
        """Bring every member to the epoch's starting state before its first step."""
        if start.broadcast:
            await self._sync_initial_weights(transport)
            await self._check_starting_state(transport, start)
        elif start.donor >= 0:
            if self.rank == start.donor:
                for receiver in start.receivers:
                    await self._send_state(transport, start.position(receiver))
            elif self.rank in start.receivers:
                await self._receive_state(
                    transport, start.position(start.donor), donor=f"rank {start.donor}"
                )
        if not start.broadcast and self.options.buffer_sync != "local":
            # Buffers a dropped step's forward moved on some ranks only: the epoch's opening
            # check covers them, so every member starts from position 0's.
            await self._sync_buffers(transport, "broadcast")
        if self.replicas is not None:  # the primary may have taken over a peer's state
            self.replicas.adopt_primary_state()
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
        if self.metrics is not None:
            self.metrics.observe_epoch(start.epoch, len(start.members))
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
        comm = self.actors.comm(
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

        compute = self.actors.compute(
            self.model,
            self.loss_fn,
            self.buckets,
            on_bucket,
            self.trace,
            find_unused=self.options.find_unused_parameters,
            on_unused=comm.note_unused,
            precision=self.precision,
            **({"replicas": self.replicas} if self.replicas is not None else {}),
        )
        optimizer = self.actors.optimizer(
            self.model,
            self.optimizer,
            self.client,
            self.options,
            self.trace,
            start.epoch,
            self._applied,
            self.check_cost,
            zero_grads=lambda: comm.zero_grads(self.optimizer),
            precision=self.precision,
            on_skipped=self._skipped,
            scheduler=self.scheduler,
            digest_buffers=self.options.buffer_sync != "local",
        )
        if self._watched_scaler is not None:
            optimizer.digest_grad_scaler(self._watched_scaler)
        try:
            await system.start(compute)
            await system.start(comm)
            await system.start(optimizer)
        except BaseException:
            compute.remove_hooks()
            raise
        self.client.on_go = comm.tell
        return _Epoch(start, transport, compute, comm, optimizer)

    def bind_optimizer(
        self, optimizer: torch.optim.Optimizer, scheduler: Scheduler | None = None
    ) -> None:
        """Step, hash and transfer ``optimizer`` (and ``scheduler``, if given) from now on
        instead of the ones the trainer was built with (`actors.train.ddp_wrapper`: the
        caller's own optimizer, named once it is known). Call it between steps, in the event
        loop."""
        if scheduler is not None:
            _check_scheduler(scheduler, optimizer)
            self.scheduler = scheduler
        self.optimizer = optimizer
        if self._epoch is not None:
            self._epoch.optimizer.optimizer = optimizer
            if scheduler is not None:
                self._epoch.optimizer.scheduler = scheduler

    def watch_grad_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """Cover ``scaler``, a loss scaler the caller's own loop steps, in every state digest
        from now on (`actors.train.ddp_wrapper`): ranks whose scalers decided differently are
        caught at that step. In the event loop, between steps."""
        self._watched_scaler = scaler
        if self._epoch is not None:
            self._epoch.optimizer.digest_grad_scaler(scaler)

    def use_comm_hook(self, comm_hook: str, powersgd_rank: int, powersgd_start_iter: int) -> None:
        """Average the buckets with ``comm_hook`` from now on, in this epoch and the next ones
        (torch DDP's ``register_comm_hook``, `actors.train.ddp_wrapper`): before the first
        step, in the event loop. Every member must choose the same hook (it is part of each
        bucket's spec, which the coordinator checks)."""
        if self.step > 0:
            raise RuntimeError(
                f"rank {self.rank}: the comm hook must be registered before the first step "
                f"(the run is at step {self.step})"
            )
        self.options = dataclasses.replace(
            self.options,
            comm_hook=comm_hook,
            powersgd_rank=powersgd_rank,
            powersgd_start_iter=powersgd_start_iter,
        )
        if self._epoch is not None:
            self._epoch.comm.use_comm_hook(self.options)

    def _applied(self, step: int) -> None:
        self.step = step + 1

    def _skipped(self, step: int) -> None:
        """The loss scaler skipped ``step`` (called in the optimizer step's thread)."""
        self._skipped_total += 1
        self.skipped_steps.append(step)
        if len(self.skipped_steps) > self.options.history_steps:
            del self.skipped_steps[0]

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler (None without ``TrainerOptions(grad_scaler=True)``): pass it as
        ``grad_scaler`` to `capture_state` with the model and optimizer to checkpoint it (a
        resumed run starts its scaler from `saved_grad_scaler`, through the options)."""
        return self.precision.scaler if self.precision is not None else None

    async def _sync_initial_weights(self, transport: Transport) -> None:
        """Broadcast position 0's parameters and buffers so every replica starts identical.

        A receiver lands every tensor in a host buffer of its own (never the live parameter,
        which ``.to("cpu")`` of a CPU tensor would alias) and copies them into the model only
        once all of them arrived and verified: a broadcast that fails changes nothing."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        root = transport.rank == 0
        hosts = []
        for tensor in tensors:
            if root:
                host = tensor.detach().to("cpu").contiguous()
            else:
                host = torch.empty(tensor.shape, dtype=tensor.dtype)
            await broadcast(
                transport,
                wire_view(host),
                root=0,
                chunk_bytes=self.options.chunk_bytes,
                in_place=True,  # ``host`` is this call's own buffer, dropped on failure
            )
            hosts.append(host)
        if root:
            return
        with torch.no_grad():  # never across an await: grad mode is per thread, not per task
            for tensor, host in zip(tensors, hosts, strict=True):
                tensor.copy_(host)

    async def _check_starting_state(self, transport: Transport, start: StartRun) -> None:
        """After a broadcast epoch's initial broadcast, before its first step: every member's
        parameters and buffers hash (per tensor, XXH3-128) to position 0's, or every member
        raises `StartingStateDiffers` naming the ranks that differ (and, on those ranks, the
        first tensor). What a state-transfer epoch's opening check (its digests of the step
        before) gives the coordinator, a broadcast epoch gets here, on its own data plane."""
        mine = state_digest(self.model, None, buffers=True)
        packed = torch.frombuffer(bytearray(mine.packed), dtype=torch.uint8)
        theirs = packed.clone()
        await broadcast(
            transport, theirs, root=0, chunk_bytes=self.options.chunk_bytes, in_place=True
        )
        differs = torch.zeros(transport.world_size, dtype=torch.float64)
        differs[transport.rank] = float(not torch.equal(packed, theirs))
        await all_reduce(transport, differs, "sum", chunk_bytes=self.options.chunk_bytes)
        ranks = [start.members[p] for p in range(len(differs)) if differs[p]]
        if not ranks:
            return
        first = None
        if differs[transport.rank]:
            size = len(mine.packed) // max(1, len(mine.names))
            for index, name in enumerate(mine.names):
                part = slice(index * size, (index + 1) * size)
                if not torch.equal(packed[part], theirs[part]):
                    first = name
                    break
        raise StartingStateDiffers(start.epoch, start.step, ranks, first)

    async def _sync_buffers(self, transport: Transport, mode: BufferSync | None = None) -> None:
        """Make the model's buffers identical across the epoch's members (``mode``, default
        ``options.buffer_sync``)."""
        await sync_buffers(
            transport,
            list(self.model.buffers()),
            mode if mode is not None else self.options.buffer_sync,
            chunk_bytes=self.options.chunk_bytes,
            threaded_min_bytes=self.options.threaded_min_bytes,
        )

    async def _send_state(self, transport: Transport, peer: int) -> None:
        """Send this worker's whole training state to ring position ``peer`` (a joiner)."""
        await send_state(
            transport,
            peer,
            self.model,
            self.optimizer,
            self.step,
            self.scheduler,
            grad_scaler=self.grad_scaler,
        )

    async def _receive_state(self, transport: Transport, peer: int, donor: object = None) -> None:
        """Receive a healthy member's whole training state and take it over; its manifest is
        checked against this model before anything is allocated (`receive_state`)."""
        check_can_receive_state(self.optimizer, self.rank)
        state = await receive_state(
            transport,
            peer,
            self.model,
            self.optimizer,
            donor=donor,
            scheduler=self.scheduler,
            grad_scaler=self.grad_scaler,
        )
        if state.step < self.step:
            log.warning("rank %d rolls back from step %d", self.rank, self.step)
        self.step = state.step
        self.states_received += 1
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
        If the worker was rolled back to an earlier step meanwhile (a restarted coordinator
        resumed from a committed or majority state behind it), the batch is not run and it
        returns nan: the caller feeds the batch of `step` next.
        """
        step = self.step
        while True:
            try:
                return await self._attempt(batch, step)
            except _StepAborted:
                if self.step > step:  # the step is done: never run this batch on a later one
                    return self._last_loss if self._last_loss_step == step else math.nan
                if self.step < step:  # rolled back: never run this batch on an earlier one
                    log.warning(
                        "rank %d: step %d's batch not run: rolled back to step %d",
                        self.rank,
                        step,
                        self.step,
                    )
                    return math.nan
                continue

    async def join(self) -> int:
        """This worker's data has ended (uneven inputs, torch's ``Join``): keep taking part in
        steps with zero gradients until every worker's data has ended; returns how many steps
        it took so. Needs ``TrainerOptions(join=True)`` on every worker.

        Each step of a ``join`` run starts with an all-reduce counting the workers that still
        have data; a joined worker contributes zeros to the step's gradient average, which
        still divides by the number of members (DDP's default,
        ``divide_by_initial_world_size=True``), so the others' steps are those of one process
        whose loss is the sum of the active shards' mean losses over the world size. Every
        worker takes the same optimizer step and the identical-weights check goes on; once
        the count is zero all workers stop at the same step (``max_steps`` ends it too)."""
        if not self.options.join:
            raise RuntimeError(
                "join needs TrainerOptions(join=True) on every worker: without it a worker "
                "cannot step with zero gradients while its peers still train"
            )
        taken = 0
        while not self.reached_max_steps:
            step = self.step
            try:
                await self._attempt(None, step, has_data=False)
            except _AllJoined:
                break
            except _StepAborted:
                if self.step > step:  # done without this attempt finishing
                    taken += 1
                continue
            taken += 1
        return taken

    async def _count_with_data(self, epoch: _Epoch, step: int, has_data: bool) -> int:
        """All-reduce how many members still have data at ``step`` (``join``)."""
        count = torch.tensor([1.0 if has_data else 0.0])
        with self.trace.span("join-count", actor="trainer", step=step):
            await all_reduce(epoch.transport, count, "sum", chunk_bytes=self.options.chunk_bytes)
        return round(float(count[0]))

    async def _attempt(
        self, batch: Any, step: int, position: int | None = None, *, has_data: bool = True
    ) -> float:
        """Run ``step`` once in the live epoch; raises _StepAborted if the epoch ends, or if
        the worker is no longer at ``step`` (or ring ``position``) when the epoch is live.
        Without data (``join``) the step reduces zero gradients, or raises _AllJoined when no
        member has data left."""
        if self.reached_max_steps:
            raise RuntimeError(f"max_steps={self.options.max_steps} already reached")
        if self._live.is_set():  # the usual case: no task switch here (the compute's is one)
            await trio.lowlevel.checkpoint_if_cancelled()
        else:
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
                if self.options.join and not await self._count_with_data(epoch, step, has_data):
                    raise _AllJoined
                state = epoch.comm.begin_step(step)
                if has_data:
                    loss = await self._compute(epoch, batch, step)
                    self._last_loss, self._last_loss_step = loss, step
                else:
                    self._reduce_zeros(epoch, step)
                await self._reduce_and_apply(epoch, state, step)
        except Exception as exc:
            await self._step_failed(exc, scope, epoch)
            raise
        finally:
            self._step_scope = None
        if scope.cancelled_caught or self.step != step + 1:
            raise _StepAborted
        if has_data:
            self._record(step, loss, time.perf_counter() - started)
        else:
            self.joined_steps += 1
        return loss

    async def _reduce_and_apply(self, epoch: _Epoch, state: StepState, step: int) -> None:
        """The rest of ``step`` once its backward has handed its buckets over: wait for their
        all-reduce, synchronize the buffers, apply the optimizer step, report the digest."""
        await self._await_reduced(epoch, state, step)
        await self._apply_reduced(epoch, step)

    async def _await_reduced(self, epoch: _Epoch, state: StepState, step: int) -> None:
        """Wait until every bucket of ``step`` is averaged into the gradients (raising the
        step's error if one was lost), then synchronize the buffers."""
        with self.trace.span("grad-wait", actor="trainer", step=step):
            await state.all_reduced.wait()
        if state.error is not None:
            raise state.error
        self.unused_parameters = state.unused_everywhere
        if self.options.buffer_sync != "local":
            # After every bucket's all-reduce (one collective at a time on the
            # transport), before this step is reported reduced: a step applied while
            # leaving the epoch (`_apply_pending`) has its buffers synchronized too.
            with self.trace.span("buffer-sync", actor="trainer", step=step):
                await self._sync_buffers(epoch.transport)

    async def _apply_barrier(self, epoch: _Epoch, step: int) -> None:
        """Before ``step``'s optimizer step: with the epoch's apply barrier, report the step
        reduced and wait for the coordinator's word to apply it."""
        if epoch.start.apply_barrier:
            # A cached all-reduce may finish before the previous step is committed;
            # the coordinator takes this step's report only after that commit.
            await self.client.wait_commit(step - 1)
            await self.client.reduced(step, epoch.start.epoch)
            with self.trace.span("apply-wait", actor="trainer", step=step):
                await self.client.wait_apply(step)

    async def _apply_reduced(self, epoch: _Epoch, step: int) -> None:
        """Apply ``step``'s averaged gradients through the optimizer actor and report the
        digest (or wait for the check, without ``verify_overlap``)."""
        await self._apply_barrier(epoch, step)
        # Overlapped: the optimizer reports the step's digest as soon as it has applied it,
        # within the same message (its check finishes during the next step).
        overlap = self.options.verify_overlap
        await epoch.optimizer.ask(OptimizerStep(step, verify=overlap))
        norm = epoch.optimizer.grad_norm
        if norm is not None and norm[0] == step:
            self._record_norm(step, norm[1])
        if not overlap:
            await epoch.optimizer.ask(Verify(step, wait=True))

    async def _step_failed(self, exc: Exception, scope: trio.CancelScope, epoch: _Epoch) -> None:
        """A step raised ``exc``: raise _StepAborted if the epoch ended under it (it runs
        again, or is dropped); return if the error is the step's own (the caller re-raises)."""
        if scope.cancel_called:  # the epoch ended under the step
            raise _StepAborted from exc
        if _broken_by_a_peer(exc):
            # A peer's failure broke the epoch (its links, then its actors): the
            # supervisor decides. A new epoch reruns the step; none within its deadline
            # fails the trainer, cancelling this task.
            await epoch.ended.wait()
            raise _StepAborted from exc

    # ------------------------------------------------------------ the user's own loop

    async def begin_own_step(self) -> OwnStep:
        """Start a step whose forward and backward the caller's own code runs, in its own
        thread (torch DDP's shape: `actors.train.ddp_wrapper`): wait for a live epoch and expect
        its buckets. Arm the epoch's compute hooks (``own.compute.expect_backward``) before
        the step's last backward, then call `finish_own_step`."""
        if self.reached_max_steps:
            raise RuntimeError(f"max_steps={self.options.max_steps} already reached")
        self._next_own = None
        await self._live.wait()
        epoch = self._epoch
        assert epoch is not None
        if self.options.join:  # uneven inputs (`use_join`): count who still has data first
            active = await self._count_with_data(epoch, self.step, True)
            if self._throw_on_early_termination and active < self.world_size:
                raise EarlyTermination(self.step, self.world_size - active)
        return OwnStep(self.step, epoch, epoch.comm.begin_step(self.step), time.perf_counter())

    def use_join(self, enabled: bool, *, throw_on_early_termination: bool = False) -> None:
        """The caller's own loop runs inside torch's ``Join`` (`actors.train.ddp_wrapper`'s
        ``join()``) from its next step on: each step first counts the members that still have
        data, and a member whose data ended calls `join` (or, with
        ``throw_on_early_termination``, `join_and_raise`). Every member enables it at the same
        step. In the event loop, between steps."""
        self.options = dataclasses.replace(self.options, join=enabled)
        self._throw_on_early_termination = throw_on_early_termination and enabled
        self._next_own = None

    async def join_and_raise(self) -> None:
        """This member's data ended with ``throw_on_early_termination`` (torch's ``Join``):
        take part in the step's count, so every member learns it, and raise."""
        await self._live.wait()
        epoch = self._epoch
        assert epoch is not None
        await self._count_with_data(epoch, self.step, False)
        raise EarlyTermination(self.step, 1)

    def prepared_own_step(self) -> OwnStep | None:
        """The step `finish_own_step` began for the caller's next forward, if it is still the
        one to run (its epoch live, the trainer at its step); None: call `begin_own_step`.

        Called from the caller's own thread, which saves the crossing into the event loop that
        `begin_own_step` costs: it only reads what the event loop set before the previous
        `finish_own_step` returned. An epoch that ends right after this check ends the step
        as it would end one `begin_own_step` returned (`finish_own_step` drops it)."""
        own, self._next_own = self._next_own, None
        if own is None or not self._live.is_set():
            return None
        if own.epoch is not self._epoch or own.step != self.step or self.reached_max_steps:
            return None
        return own

    def _prepare_own_step(self, epoch: _Epoch) -> None:
        """Begin the caller's next step now, in the event loop, while it waits here anyway
        (see `prepared_own_step`); nothing when no step may follow in this epoch."""
        self._next_own = None
        if self.options.join:  # each step begins with the count (`begin_own_step`)
            return
        if self._live.is_set() and self._epoch is epoch and not self.reached_max_steps:
            state = epoch.comm.begin_step(self.step)
            self._next_own = OwnStep(self.step, epoch, state, time.perf_counter())

    async def finish_own_step(self, own: OwnStep) -> bool:
        """After `reduce_own_step`: apply ``own.step``'s averaged gradients through the
        optimizer actor, as `train_batch` does. Returns whether the step was taken (here, or
        while leaving an epoch); False: the membership changed under it and its gradients
        were dropped, the weights are the new epoch's (torchft's ``should_commit`` False).
        Its own errors propagate."""

        async def finish(epoch: _Epoch) -> None:
            await self._apply_reduced(epoch, own.step)

        return self._own_step_ended(own, await self._own_phase(own, finish))

    def _own_step_ended(self, own: OwnStep, ran: bool) -> bool:
        """The last phase of ``own`` ran (``ran``) or the epoch ended under it: whether the
        step was taken; a taken one is recorded and the next one begun in the event loop."""
        if not ran or self.step != own.step + 1:
            return self._own_step_dropped(own.step)
        self._record(own.step, None, time.perf_counter() - own.started)
        self._prepare_own_step(own.epoch)
        return True

    async def reduce_own_step(self, own: OwnStep) -> bool:
        """The caller's synchronizing backward of ``own.step`` is ending (autograd's final
        callback, `actors.train.ddp_wrapper`): announce what its hooks could not and wait until
        every bucket's average is in the gradients and the buffers are synchronized, as torch
        DDP's reducer finalizes in backward. Returns False when a membership change dropped
        the step (its gradients zeroed)."""

        async def reduce(epoch: _Epoch) -> None:
            epoch.compute.backward_returned(own.step)
            await self._await_reduced(epoch, own.state, own.step)

        if await self._own_phase(own, reduce):
            return True
        self._own_step_dropped(own.step)
        return False

    async def begin_caller_apply(self, own: OwnStep) -> bool:
        """The caller is about to step its own optimizer with ``own.step``'s averaged
        gradients (an optimizer step pre-hook): wait for the previous step's commit and the
        epoch's apply barrier, as the optimizer actor would. False: the step was dropped."""

        async def barrier(epoch: _Epoch) -> None:
            with self.trace.span("commit-wait", actor="optimizer", step=own.step - 1):
                await self.client.wait_commit(own.step - 1)
            await self._apply_barrier(epoch, own.step)

        if await self._own_phase(own, barrier):
            return True
        # The epoch ended under it: a step every member was told to apply is still applied,
        # here by the caller (`_apply_pending` does it for the trainer's own steps).
        gate = self._caller
        return gate is not None and gate.must_apply == own.step == self.step

    def caller_applied(self, own: OwnStep, *, skipped: bool = False) -> None:
        """The caller's thread has stepped its optimizer with ``own.step`` (or skipped the
        step: a loss scaler found inf or nan): count it and hash the state there, as the
        optimizer actor does right after its own step. Called outside the event loop."""
        own.epoch.optimizer.applied_by_caller(own.step, skipped=skipped)
        gate = self._caller
        if gate is not None and gate.must_apply == own.step:
            gate.must_apply = None  # the next crossing lets the next epoch enter

    async def end_caller_apply(self, own: OwnStep) -> bool:
        """After `caller_applied`: report ``own.step``'s digest (C-DDP-001) and, without
        ``verify_overlap``, wait for its check. Returns whether the step was taken."""

        async def report(epoch: _Epoch) -> None:
            await epoch.optimizer.ask(Verify(own.step, wait=not self.options.verify_overlap))

        return self._own_step_ended(own, await self._own_phase(own, report, at=own.step + 1))

    async def _own_phase(
        self,
        own: OwnStep,
        body: Callable[[_Epoch], Awaitable[None]],
        *,
        at: int | None = None,
    ) -> bool:
        """Run one phase of the caller's own step in its epoch, the trainer at step ``at``
        (default ``own.step``; the step after it once applied); False when the epoch ended
        under it (or before it), True when it ran. The step's own errors propagate."""
        epoch = own.epoch
        self._next_own = None
        if self._epoch is not epoch or self.step != (own.step if at is None else at):
            return False
        scope = trio.CancelScope()
        try:
            with scope:
                self._step_scope = scope
                await body(epoch)
        except Exception as exc:
            try:
                await self._step_failed(exc, scope, epoch)
            except _StepAborted:
                return False
            raise
        finally:
            self._step_scope = None
        return not scope.cancelled_caught

    def _own_step_dropped(self, step: int) -> bool:
        """A step of the caller's own loop ended by a membership change: its gradients (some
        maybe backward wrote after the new epoch bound them) must not reach the next step."""
        self.optimizer.zero_grad(set_to_none=False)
        if self.step > step:
            return True  # taken while leaving the epoch, or received with a peer's state
        log.warning(
            "rank %d: step %d dropped by a membership change: its gradients are lost, the "
            "next step starts from the new epoch's state",
            self.rank,
            step,
        )
        return False

    async def _compute(self, epoch: _Epoch, batch: Any, step: int) -> float:
        """Forward and backward of ``batch``'s micro-batches (the buckets go out as backward
        finishes them); returns the mean loss."""
        micro_batches = _split(batch, self.options.accumulation_steps)
        total = 0.0
        # Once every bucket is agreed, the compute needs nothing from the coordinator:
        # its messages (the last step's commit) wait until the compute is done.
        with self.client.reads_deferred() if epoch.comm.cache_ready else nullcontext():
            for index, micro in enumerate(micro_batches):
                last = index == len(micro_batches) - 1
                part = await epoch.compute.ask(Backward(step, micro, last))
                if not isinstance(part, float):
                    raise TypeError(
                        f"step {step}: the compute actor answered a backward with "
                        f"{part!r}, not a loss"
                    )
                total += part
        return total / len(micro_batches)

    def _reduce_zeros(self, epoch: _Epoch, step: int) -> None:
        """A joined worker's step: every bucket goes out holding zeros, and (with
        ``find_unused_parameters``) no parameter counts as used by this worker."""
        epoch.comm.zero_grads(self.optimizer)
        if self.options.find_unused_parameters:
            names = frozenset(name for bucket in self.buckets for name in bucket.names)
            epoch.comm.note_unused(step, names)
        for bucket in self.buckets:
            epoch.comm.ready_soon(BucketReady(step, bucket.index))

    def _record_norm(self, step: int, norm: float) -> None:
        self.grad_norms.append((step, norm))
        if len(self.grad_norms) > self.options.history_steps:
            del self.grad_norms[0]

    def _record(self, step: int, loss: float | None, seconds: float) -> None:
        """Append to the bounded histories; keep the whole run's totals for the summary.
        ``loss`` None: the step's loss is the caller's own (`finish_own_step`)."""
        if loss is not None:
            if self._first_loss is None:
                self._first_loss = loss
            self.losses.append((step, loss))
        self._steps_run += 1
        self._seconds_run += seconds
        if self.metrics is not None:
            self.metrics.observe_step(step, seconds)
        keep = self.options.history_steps
        self.step_seconds.append(seconds)
        if len(self.losses) > keep:
            del self.losses[: len(self.losses) - keep]
        if len(self.step_seconds) > keep:
            del self.step_seconds[: len(self.step_seconds) - keep]

    async def _resync(self, order: ResyncOrder) -> None:
        """Copy the source rank's parameters, optimizer state and loss scaler state to the
        diverged ranks."""
        epoch = self._epoch
        if epoch is None:
            return
        start = epoch.start
        rank = self.rank
        if rank != order.source and rank not in order.targets:
            return
        local = self.options.buffer_sync == "local"
        state = named_state(self.model, self.optimizer, buffers=not local)
        tensors = [tensor for _, tensor in state]
        scaler = self.precision.scaler_tensors() if self.precision is not None else []
        tensors += scaler  # the loss scaler's scale and growth tracker travel last
        log.warning(
            "step %d: re-syncing ranks %s from rank %d",
            order.step,
            list(order.targets),
            order.source,
        )
        received: list[torch.Tensor] = []
        for index, tensor in enumerate(tensors):
            if rank == order.source:
                host = tensor.detach().to("cpu").contiguous()
                part = StateTensor(order.step, index, wire_view(host))
                for target in order.targets:
                    await epoch.transport.send(start.position(target), *part.to_wire_bulk())
            else:
                # Into a buffer of its own; the state changes once every tensor verified.
                host = torch.empty(tensor.shape, dtype=tensor.dtype)
                source = start.position(order.source)
                message = await epoch.transport.recv_into(source, wire_view(host))
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
                received.append(host)
        if rank != order.source:
            with torch.no_grad():
                for tensor, host in zip(tensors, received, strict=True):
                    tensor.copy_(host)
        if scaler and rank != order.source:
            assert self.precision is not None
            self.precision.load_scaler_tensors(scaler)
        if rank != order.source:
            self.states_received += 1
            if self.replicas is not None:
                self.replicas.adopt_primary_state()

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
        self.caller_left()
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
        ends training after the step in flight. With ``TrainerOptions(join=True)`` a worker
        whose steps are done (``steps`` reached, ``should_stop``) then `join`s its peers until
        theirs are too, so ``fit`` returns on every worker at the same step. Returns this call's
        (step, loss) pairs (the steps taken joined are not among them).
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
                if loader is None or loader.expects != (step, position):
                    if loader is not None:
                        await loader.stop()
                    loader = self.actors.loader(
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
                    _, batch = await loader.next_batch()
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
        if self.options.join:  # this worker's steps are done: follow its peers' to their end
            await self.join()
        return history

    def summary(self) -> dict[str, Any]:
        """Final step and loss, the digest of this rank's state after its last step (None before
        the first), the throughput and the membership epochs it saw. First loss and steps per
        second cover the whole run; the median step time the kept history (the last
        ``options.history_steps`` steps)."""
        seconds = self._seconds_run
        stepped = bool(self.step_seconds) or self.joined_steps > 0
        digest = self.state_digest().digest if stepped else None
        return {
            "rank": self._config.rank,
            "world_size": self._config.world_size,
            "final_step": self.step,
            "first_loss": self._first_loss,
            "final_loss": self.losses[-1][1] if self.losses else None,
            "digest": digest.hex() if digest is not None else None,
            "steps_per_second": self._steps_run / seconds if seconds else None,
            "median_step_seconds": sorted(self.step_seconds)[len(self.step_seconds) // 2]
            if self.step_seconds
            else None,
            "epochs": [{"epoch": e, "step": s, "members": list(m)} for e, s, m in self.epochs],
            "hash_cpu_seconds": self.check_cost.hash_cpu_seconds,
            "digests": self.check_cost.digests,
            "skipped_steps": self._skipped_total,
            "final_grad_norm": self.grad_norms[-1][1] if self.grad_norms else None,
            "joined_steps": self.joined_steps,
            "comm_backend": self.options.comm_backend,
        }

    # ------------------------------------------------------------------ export

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained model's ``state_dict()`` (parameters and persistent buffers) as plain,
        contiguous CPU copies under the model's own names, with no wrapper prefix: it loads into
        a fresh instance of the plain module (``load_state_dict``), into torch DDP's
        ``DistributedDataParallel(model).module``, and through DDP's own ``load_state_dict``
        after adding its ``module.`` prefix. Tied weights come out as separate copies of one
        value. Call it between steps (a step in flight is still changing the weights)."""
        return {
            name: tensor.detach().to("cpu", copy=True).contiguous()
            for name, tensor in _export_model(self.model).state_dict().items()
        }

    def save_safetensors(
        self, path: str | os.PathLike[str], metadata: dict[str, str] | None = None
    ) -> Path:
        """Write `state_dict` to a safetensors file at ``path`` (readable by
        ``safetensors.torch.load_file``); its metadata records ``format: pt``, the next step
        (``paramsync_step``) and ``metadata``'s strings. Returns the path."""
        target = Path(path)
        extra = dict(metadata or {})
        for key, value in extra.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(
                    f"safetensors metadata {key!r} must be a str, got {type(value).__name__}"
                )
        extra.update({"format": "pt", "paramsync_step": str(self.step)})
        save_file(self.state_dict(), str(target), metadata=extra)
        return target


def _replicas_of(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    options: TrainerOptions,
    scheduler: Scheduler | None,
) -> DataParallelCoordinator | None:
    """The `DataParallelCoordinator` behind a `ReplicatedOptimizer` (None for any other
    optimizer), after checking that the trainer was given its primary replica and loss function
    and no option this seam does not support; ValueError naming the one that does not fit."""
    if not isinstance(optimizer, ReplicatedOptimizer):
        return None
    replicas = optimizer.coordinator
    if model is not replicas.primary_pipeline:
        raise ValueError(
            "with a ReplicatedOptimizer the model must be its coordinator's primary_pipeline"
        )
    if loss_fn is not replicas.loss_fn:
        raise ValueError("with a ReplicatedOptimizer the loss_fn must be its coordinator's")
    unsupported = {
        "accumulation_steps": options.accumulation_steps != 1,
        "find_unused_parameters": options.find_unused_parameters,
        "autocast_dtype": options.autocast_dtype is not None,
        "grad_scaler": bool(options.grad_scaler),
        "scheduler": scheduler is not None,
    }
    named = [name for name, used in unsupported.items() if used]
    if named:
        raise ValueError(f"{', '.join(named)} not supported with several devices per process")
    return replicas


def _check_scheduler(scheduler: Scheduler | None, optimizer: torch.optim.Optimizer) -> None:
    """Refuse a scheduler the trainer cannot step in lockstep: one of another optimizer, or one
    that needs a metric (each rank's loss differs, so their learning rates would too)."""
    if scheduler is None:
        return
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            "scheduler: ReduceLROnPlateau steps on a metric, which differs from rank to rank; "
            "step it yourself on an all-reduced metric, or pass a schedule of the step count"
        )
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(
            f"scheduler must be a torch.optim.lr_scheduler.LRScheduler, got "
            f"{type(scheduler).__name__}"
        )
    if scheduler.optimizer is not optimizer:
        raise ValueError("scheduler: it schedules another optimizer than the trainer's")


def _export_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module under wrappers whose ``state_dict`` keys carry a prefix (torch DDP and
    DataParallel's ``module.``, ``torch.compile``'s ``_orig_mod.``)."""
    while True:
        if isinstance(
            model, torch.nn.parallel.DistributedDataParallel | torch.nn.parallel.DataParallel
        ):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model


def _broken_by_a_peer(error: BaseException) -> bool:
    """Whether a step failed because its epoch's links or actors went away (a peer died or
    left), not by an error of its own (the loss function, a bad batch)."""
    leaf = pick_error(error)
    while isinstance(leaf, ActorFailed) and leaf.__cause__ is not None:
        leaf = pick_error(leaf.__cause__)
    return isinstance(leaf, ProtocolError | ActorStopped)


def _split(batch: Any, parts: int) -> Sequence[Any]:
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
