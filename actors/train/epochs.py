"""`EpochSupervisor`: the trio shell that runs a trainer's membership epochs.

A supervisor task opens each epoch's data plane, brings its members to the epoch's starting
state (`paramsync.actors.train.state_moves.enter_epoch`), runs the epoch's actors, and when the
coordinator announces a new epoch or a hold, ends the live one: it stops the step in flight,
applies it if every member was told to, and drops it otherwise. Which moves are legal is
`paramsync.actors.train.lifecycle.Lifecycle`'s to say; this module performs them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from paramsync.actors.graph.compute import ComputeActor
from paramsync.actors.graph.gradcomm import GradCommActor
from paramsync.actors.graph.messages import BucketReady, Verify
from paramsync.actors.graph.optimizer import (
    OPTIMIZER_STEP_LOCK,
    OptimizerActor,
    clip_gradients,
    clip_settings,
)
from paramsync.actors.train.caller_gate import CallerGate
from paramsync.actors.train.lifecycle import Lifecycle
from paramsync.actors.train.state_moves import enter_epoch, resync
from paramsync.actors.train.training_run import TrainingRun
from paramsync.runtime.actor.base import ActorSystem
from paramsync.runtime.config import DistributedConfig
from paramsync.runtime.errors import pick_error
from paramsync.runtime.protocol.messages import Hold, ResyncOrder, StartRun
from paramsync.runtime.transport.base import Transport

__all__ = ["Connect", "Epoch", "EpochSupervisor", "fixed_connect"]

log = logging.getLogger("paramsync.trainer")

Connect = Callable[[StartRun], Awaitable[Transport]]
"""Opens an epoch's data plane: a transport whose rank is this worker's ring position."""


def fixed_connect(transport: Transport, config: DistributedConfig) -> Connect:
    """The data plane of a run whose membership never changes: ``transport`` for every epoch
    (a membership change is a RuntimeError)."""
    if (transport.rank, transport.world_size) != (config.rank, config.world_size):
        raise ValueError("transport and config disagree on rank or world size")

    async def connect(start: StartRun) -> Transport:
        if start.epoch != 1 and transport.world_size != len(start.members):
            raise RuntimeError("a fixed transport cannot follow a membership change")
        return transport

    return connect


@dataclass
class Epoch:
    """A live membership epoch: its start, its data plane and its actors."""

    start: StartRun
    transport: Transport
    compute: ComputeActor
    comm: GradCommActor
    optimizer: OptimizerActor
    generation: int
    """The lifecycle's number of this epoch (what its steps' events name)."""
    ended: trio.Event = field(default_factory=trio.Event)
    """Set once the epoch is torn down (the supervisor then decides what comes next)."""


class EpochSupervisor:
    """Runs one worker's epochs, one after the other, as the coordinator announces them,
    on its `TrainingRun`."""

    def __init__(self, run: TrainingRun, connect: Connect) -> None:
        self.run = run
        self.connect = connect
        self.owns_transports = True
        """Close each epoch's transport at its end (not a fixed one the caller passed in)."""
        self.lifecycle = Lifecycle()
        self.current: Epoch | None = None
        """The live epoch (None between epochs)."""
        self.live = trio.Event()
        """Set while an epoch is live (replaced, never cleared, when it stops being so)."""
        self.held = trio.Event()
        """Set while the supervisor holds: no epoch live, the state at rest."""
        self.step_scope: trio.CancelScope | None = None
        """The cancel scope of the step (or wait) in flight: the end of its epoch cancels it."""
        self.caller: CallerGate | None = None
        """The caller's own loop, when one drives the trainer (`OwnLoop.attach_caller`)."""
        self._announced: list[StartRun | Hold] = []
        self._announced_event = trio.Event()
        self.announced_in = 0
        """The generation of the epoch during (or after) which the coordinator last
        announced its next word (a new epoch or a hold)."""
        self._word = trio.Event()

    def live_epoch(self) -> Epoch:
        """The live epoch (its data plane, its actors); RuntimeError between epochs."""
        if self.current is None:
            raise RuntimeError("no epoch is running")
        return self.current

    @property
    def world_size(self) -> int:
        """Number of workers training together now (the current epoch's members)."""
        start = self.current.start if self.current is not None else self.run.client.start
        return len(start.members) if start is not None else self.run.config.world_size

    @property
    def position(self) -> int:
        """This worker's ring position in the current epoch (its data shard)."""
        start = self.current.start if self.current is not None else self.run.client.start
        return start.position(self.run.rank) if start is not None else self.run.rank

    def announce(self, message: StartRun | Hold) -> None:
        """The coordinator announced a new epoch or a hold: end the live epoch now."""
        self._announced.append(message)
        self._announced_event.set()
        self.announced_in = self.lifecycle.generation
        self._word.set()
        self._word = trio.Event()
        # Before the epoch's actors go: nothing more runs in it, and whatever they fail
        # with next belongs to the dropped step, which then reruns.
        self.lifecycle.announce()
        if self.live.is_set():
            self.live = trio.Event()
        if self.step_scope is not None:
            self.step_scope.cancel()
        epoch = self.current
        if epoch is not None:
            epoch.transport.abort()  # wake collective threads blocked on dead peers

    async def word_after(self, generation: int) -> None:
        """Wait until the coordinator announced what follows epoch ``generation`` (a new epoch
        or a hold: the membership changed). A run that ends instead (aborted, its coordinator
        lost) cancels the wait with everything else."""
        while self.announced_in < generation:
            await self._word.wait()

    async def resync(self, order: ResyncOrder) -> None:
        """The coordinator's re-sync order: copy the source rank's state to the diverged ranks
        over the live epoch's data plane (`paramsync.actors.train.state_moves.resync`)."""
        epoch = self.current
        if epoch is not None:
            await resync(self.run, epoch.start, epoch.transport, order)

    async def _next_announcement(self, failure: BaseException | None) -> StartRun | Hold:
        """The coordinator's next epoch or hold; after a data-plane failure, within a deadline
        (the coordinator names the lost peer, or the failure stands)."""
        if not self._announced:
            start = self.run.client.start
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
        message = self._announced.pop(0)
        if not self._announced:
            self.lifecycle.took_announcement()
        return message

    async def supervise(
        self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the epochs the coordinator announces, from the client's first start on."""
        message: StartRun | Hold = self.run.client.start  # type: ignore[assignment]
        status: trio.TaskStatus[None] | None = task_status
        while True:
            if isinstance(message, Hold):
                log.warning("rank %d holds: %s", self.run.rank, message.reason)
                self.lifecycle.hold()
                self.held.set()
                message = await self._next_announcement(None)
                self.held = trio.Event()
                continue
            status, failure = await self._run_epoch(message, status)
            message = await self._next_announcement(failure)

    async def _run_epoch(
        self, start: StartRun, status: trio.TaskStatus[None] | None
    ) -> tuple[trio.TaskStatus[None] | None, BaseException | None]:
        """Run one epoch until the coordinator announces the next; returns a data-plane
        failure that ended it early (the coordinator then decides)."""
        run = self.run
        failure: BaseException | None = None
        transport: Transport | None = None
        generation = self.lifecycle.start()
        with trio.CancelScope() as scope:
            try:
                async with trio.open_nursery() as nursery:

                    async def end_on_announcement() -> None:
                        while not self._announced:
                            self._announced_event = trio.Event()
                            await self._announced_event.wait()
                        scope.cancel()

                    nursery.start_soon(end_on_announcement)
                    transport = await self.connect(start)
                    if self.caller is not None:
                        await self.caller.parked()
                    await enter_epoch(run, start, transport)
                    async with ActorSystem() as system:
                        epoch = await self._start_actors(system, start, transport, generation)
                        if start.verify:
                            verify = Verify(start.step - 1, force=True)
                            if self.caller is None:
                                await epoch.optimizer.tell(verify)
                            else:  # hashed before the caller's loop may touch the state
                                await epoch.optimizer.ask(verify)
                        self._caller_released()
                        self.current = epoch
                        if self.lifecycle.go_live():
                            self.live.set()
                        if status is not None:
                            status.started()
                            status = None
                        await trio.sleep_forever()
            except Exception as exc:
                if self._announced:
                    # Its actors failed while being stopped for the next epoch: no fault.
                    log.debug("rank %d: epoch %d ended (%r)", run.rank, start.epoch, exc)
                elif status is not None:
                    raise  # the first epoch never started: nothing to recover
                else:
                    failure = exc
                    log.warning(
                        "rank %d: epoch %d ended by %r", run.rank, start.epoch, pick_error(exc)
                    )
            finally:
                # Leave the epoch: stop the step in flight, finish it if every member holds
                # its gradients (apply), else drop them.
                self.lifecycle.leave()
                if self.live.is_set():  # never swap an event someone still waits on
                    self.live = trio.Event()
                ending, self.current = self.current, None
                if ending is not None:
                    ending.compute.remove_hooks()  # the next epoch's compute adds its own
                if self.step_scope is not None:
                    self.step_scope.cancel()
                with trio.CancelScope(shield=True):
                    if transport is not None:
                        transport.abort()
                        if start.apply_barrier and run.client.applied(run.step):
                            gate = self.caller
                            if gate is not None and gate.applies:
                                gate.must_apply = run.step  # its begin_caller_apply says so
                            else:
                                await trio.to_thread.run_sync(self._apply_pending)
                        run.optimizer.zero_grad(set_to_none=False)
                        if self.owns_transports:
                            await transport.aclose()
                if ending is not None:
                    ending.ended.set()
                self._caller_released()
                self.lifecycle.left()
        return status, failure

    def _caller_released(self) -> None:
        if self.caller is not None:
            self.caller.released()

    async def resume_point(self) -> tuple[int, bytes]:
        """Once the supervisor holds, the next step and the state digest this worker rejoins
        a restarted coordinator with (its donor rule picks the state the run resumes from)."""
        await self.held.wait()
        digest = await trio.to_thread.run_sync(self.run.resume_digest)
        return self.run.step, digest.digest

    def _apply_pending(self) -> None:
        """Apply the step every member was told to apply, as its epoch ends (in a thread)."""
        run = self.run
        step = run.step
        clip = clip_settings(run.options)
        with OPTIMIZER_STEP_LOCK:
            if run.step == step:
                if clip is not None:  # as the optimizer actor would have
                    if run.precision is not None:
                        run.precision.unscale(run.optimizer)  # clip the true gradients
                    run.history.record_norm(step, clip_gradients(run.model, *clip))
                if run.precision is None:
                    run.optimizer.step()
                elif run.precision.step(run.optimizer):
                    run.history.skipped(step)
                if run.scheduler is not None:
                    run.scheduler.step()
                run.optimizer.zero_grad(set_to_none=False)
                run.step = step + 1
                log.info("rank %d applied step %d while leaving its epoch", run.rank, step)

    async def _start_actors(
        self, system: ActorSystem, start: StartRun, transport: Transport, generation: int
    ) -> Epoch:
        run = self.run
        comm = run.actors.comm(
            run.model,
            run.buckets,
            transport,
            run.client,
            run.options,
            run.trace,
            start.epoch,
            fold=start.fold,
            device_ops=run.device_ops,
        )

        def on_bucket(step: int, bucket: int) -> None:
            comm.ready_soon(BucketReady(step, bucket))

        compute = run.actors.compute(
            run.model,
            run.loss_fn,
            run.buckets,
            on_bucket,
            run.trace,
            find_unused=run.options.find_unused_parameters,
            on_unused=comm.note_unused,
            precision=run.precision,
            on_gradients=comm.gradients_done,
            **({"replicas": run.replicas} if run.replicas is not None else {}),
        )

        def applied(step: int) -> None:
            run.step = step + 1

        optimizer = run.actors.optimizer(
            run.model,
            run.optimizer,
            run.client,
            run.options,
            run.trace,
            start.epoch,
            applied,
            run.check_cost,
            zero_grads=lambda: comm.zero_grads(run.optimizer),
            precision=run.precision,
            on_skipped=run.history.skipped,
            scheduler=run.scheduler,
            digest_buffers=run.options.buffer_sync != "local",
            digest_algorithm=run.options.state_digest,
        )
        if run.watched_scaler is not None:
            optimizer.digest_grad_scaler(run.watched_scaler)
        try:
            await system.start(compute)
            await system.start(comm)
            await system.start(optimizer)
        except BaseException:
            compute.remove_hooks()
            raise
        run.client.on_go = comm.tell
        return Epoch(start, transport, compute, comm, optimizer, generation)
