"""The caller's own training loop (torch DDP's shape, `paramsync.actors.train.ddp_wrapper`): its
step as an object of its own (`OwnStep`), and `OwnLoop`, the phases the caller's thread crosses into
the event loop for.

A step of the caller's loop is begun (`OwnLoop.begin_own_step`, or prepared in the event loop
as the previous one finished: `OwnLoop.prepared_own_step`), reduced as the caller's
synchronizing backward ends (`reduce_own_step`), and applied, by the trainer's optimizer actor
(`finish_own_step`) or by the caller's own optimizer step (`begin_caller_apply`,
`caller_applied`, `end_caller_apply`). Each phase runs in the step's epoch; one the epoch
ended under reports the step dropped (`paramsync.actors.train.lifecycle.own_step_outcome`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch
import trio

from paramsync.actors.graph.compute import ComputeActor
from paramsync.actors.graph.gradcomm import StepState
from paramsync.actors.graph.messages import Verify
from paramsync.actors.state.digest import Scheduler
from paramsync.actors.train.caller_gate import CallerGate
from paramsync.actors.train.epochs import Epoch, EpochSupervisor
from paramsync.actors.train.lifecycle import StepOutcome, own_step_outcome
from paramsync.actors.train.options import check_scheduler
from paramsync.actors.train.steps import StepAborted, StepRunner
from paramsync.actors.train.training_run import TrainingRun

__all__ = ["EarlyTermination", "OwnLoop", "OwnStep"]

log = logging.getLogger("paramsync.trainer")


@dataclass(frozen=True)
class OwnStep:
    """A step whose forward and backward the caller's own code runs (`begin_own_step`)."""

    step: int
    epoch: Epoch
    state: StepState
    started: float
    """``time.perf_counter()`` when the step began (begun by the previous step's
    `finish_own_step`: when that one finished)."""

    @property
    def compute(self) -> ComputeActor:
        """The epoch's compute actor, whose gradient hooks the caller's backward fires."""
        return self.epoch.compute


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


class OwnLoop:
    """The trainer's side of the caller's own loop (`DistributedTrainer.own_loop`)."""

    def __init__(self, run: TrainingRun, epochs: EpochSupervisor, steps: StepRunner) -> None:
        self.run = run
        self.epochs = epochs
        self.steps = steps
        self.throw_on_early_termination = False
        self.next_own: OwnStep | None = None
        """The caller's own loop's next step, begun in the event loop as its previous one
        finished (`finish_own_step`), for `prepared_own_step` to hand out without a crossing."""

    # -- the caller's thread -----------------------------------------------------------------

    def attach_caller(self, *, applies: bool) -> None:
        """A caller's own loop drives this trainer from its own thread from now on
        (`paramsync.actors.train.ddp_wrapper`), crossing into the event loop through
        `caller_crossing`; ``applies``: it steps the optimizer itself. In the event loop."""
        if self.epochs.caller is None:
            self.epochs.caller = CallerGate()
        self.epochs.caller.applies = applies

    def caller_left(self) -> None:
        """The caller's loop is over: epochs enter without waiting for it."""
        if self.epochs.caller is not None:
            self.epochs.caller.left()

    async def caller_crossing(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``await fn(*args)`` for the caller's thread, which is parked meanwhile: a new
        epoch may enter; the result is handed back only once no entry is running."""
        gate = self.epochs.caller
        if gate is None:
            return await fn(*args)
        return await gate.crossing(fn, *args)

    # -- what it binds ---------------------------------------------------------------------

    def bind_optimizer(
        self, optimizer: torch.optim.Optimizer, scheduler: Scheduler | None = None
    ) -> None:
        """Step, hash and transfer ``optimizer`` (and ``scheduler``, if given) from now on
        instead of the ones the trainer was built with (`paramsync.actors.train.ddp_wrapper`: the
        caller's own optimizer, named once it is known). Call it between steps, in the event
        loop."""
        if scheduler is not None:
            check_scheduler(scheduler, optimizer)
            self.run.scheduler = scheduler
        self.run.optimizer = optimizer
        if self.epochs.current is not None:
            self.epochs.current.optimizer.optimizer = optimizer
            if scheduler is not None:
                self.epochs.current.optimizer.scheduler = scheduler

    def watch_grad_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """Cover ``scaler``, a loss scaler the caller's own loop steps, in every state digest
        from now on (`paramsync.actors.train.ddp_wrapper`): ranks whose scalers decided differently
        are caught at that step. In the event loop, between steps."""
        self.run.watched_scaler = scaler
        if self.epochs.current is not None:
            self.epochs.current.optimizer.digest_grad_scaler(scaler)

    def use_comm_hook(self, comm_hook: str, powersgd_rank: int, powersgd_start_iter: int) -> None:
        """Average the buckets with ``comm_hook`` from now on, in this epoch and the next ones
        (torch DDP's ``register_comm_hook``, `paramsync.actors.train.ddp_wrapper`): before the first
        step, in the event loop. Every member must choose the same hook (it is part of each
        bucket's spec, which the coordinator checks)."""
        if self.run.step > 0:
            raise RuntimeError(
                f"rank {self.run.rank}: the comm hook must be registered before the first step "
                f"(the run is at step {self.run.step})"
            )
        self.run.options = dataclasses.replace(
            self.run.options,
            comm_hook=comm_hook,
            powersgd_rank=powersgd_rank,
            powersgd_start_iter=powersgd_start_iter,
        )
        if self.epochs.current is not None:
            self.epochs.current.comm.use_comm_hook(self.run.options)

    # -- its steps ---------------------------------------------------------------------------

    async def begin_own_step(self) -> OwnStep:
        """Start a step whose forward and backward the caller's own code runs, in its own
        thread (torch DDP's shape: `paramsync.actors.train.ddp_wrapper`): wait for a live epoch and
        expect its buckets. Arm the epoch's compute hooks (``own.compute.expect_backward``) before
        the step's last backward, then call `finish_own_step`."""
        if self.run.reached_max_steps:
            raise RuntimeError(f"max_steps={self.run.options.max_steps} already reached")
        self.next_own = None
        await self.epochs.live.wait()
        epoch = self.epochs.current
        assert epoch is not None
        if self.run.options.join:  # uneven inputs (`use_join`): count who still has data first
            active = await self.steps.count_with_data(epoch, self.run.step, True)
            if self.throw_on_early_termination and active < self.epochs.world_size:
                raise EarlyTermination(self.run.step, self.epochs.world_size - active)
        step = self.run.step
        step_state = epoch.comm.begin_step(step)
        # Whatever step the caller had in flight is over; a stale begin (the epoch ended
        # during the count) is dropped by the step's first phase.
        self.epochs.lifecycle.abandon(epoch.generation)
        self.epochs.lifecycle.begin(epoch.generation, step)
        return OwnStep(step, epoch, step_state, time.perf_counter())

    def use_join(self, enabled: bool, *, throw_on_early_termination: bool = False) -> None:
        """The caller's own loop runs inside torch's ``Join``
        (`paramsync.actors.train.ddp_wrapper`'s ``join()``) from its next step on: each step first
        counts the members that still have data, and a member whose data ended calls `join` (or,
        with ``throw_on_early_termination``, `join_and_raise`). Every member enables it at the same
        step. In the event loop, between steps."""
        self.run.options = dataclasses.replace(self.run.options, join=enabled)
        self.throw_on_early_termination = throw_on_early_termination and enabled
        self.next_own = None

    async def join_and_raise(self) -> None:
        """This member's data ended with ``throw_on_early_termination`` (torch's ``Join``):
        take part in the step's count, so every member learns it, and raise."""
        await self.epochs.live.wait()
        epoch = self.epochs.current
        assert epoch is not None
        await self.steps.count_with_data(epoch, self.run.step, False)
        raise EarlyTermination(self.run.step, 1)

    def prepared_own_step(self) -> OwnStep | None:
        """The step `finish_own_step` began for the caller's next forward, if it is still the
        one to run (its epoch live, the trainer at its step); None: call `begin_own_step`.

        Called from the caller's own thread, which saves the crossing into the event loop that
        `begin_own_step` costs: it only reads what the event loop set before the previous
        `finish_own_step` returned. An epoch that ends right after this check ends the step
        as it would end one `begin_own_step` returned (`finish_own_step` drops it)."""
        own, self.next_own = self.next_own, None
        if own is None or not self.epochs.live.is_set():
            return None
        if (
            own.epoch is not self.epochs.current
            or own.step != self.run.step
            or self.run.reached_max_steps
        ):
            return None
        return own

    def _prepare_own_step(self, epoch: Epoch) -> None:
        """Begin the caller's next step now, in the event loop, while it waits here anyway
        (see `prepared_own_step`); nothing when no step may follow in this epoch."""
        self.next_own = None
        if self.run.options.join:  # each step begins with the count (`begin_own_step`)
            return
        if (
            self.epochs.live.is_set()
            and self.epochs.current is epoch
            and not self.run.reached_max_steps
        ):
            step = self.run.step
            step_state = epoch.comm.begin_step(step)
            self.epochs.lifecycle.begin(epoch.generation, step, prepared=True)
            self.next_own = OwnStep(step, epoch, step_state, time.perf_counter())

    async def finish_own_step(self, own: OwnStep) -> bool:
        """After `reduce_own_step`: apply ``own.step``'s averaged gradients through the
        optimizer actor, as `train_batch` does. Returns whether the step was taken (here, or
        while leaving an epoch); False: the membership changed under it and its gradients
        were dropped, the weights are the new epoch's (torchft's ``should_commit`` False).
        Its own errors propagate."""

        async def finish(epoch: Epoch) -> None:
            await self.steps.apply_reduced(epoch, own.step)

        return await self._own_step_ended(own, await self._own_phase(own, finish))

    async def _own_step_ended(self, own: OwnStep, ran: bool) -> bool:
        """The last phase of ``own`` ran (``ran``) or the epoch ended under it: whether the
        step was taken; a taken one is recorded and the next one begun in the event loop."""
        self.epochs.lifecycle.end(own.epoch.generation, own.step)
        if own_step_outcome(own.step, self.run.step, ran=ran) is not StepOutcome.TAKEN:
            return await self._own_step_dropped(own)
        self.run.history.record(own.step, None, time.perf_counter() - own.started)
        self._prepare_own_step(own.epoch)
        return True

    async def reduce_own_step(self, own: OwnStep) -> bool:
        """The caller's synchronizing backward of ``own.step`` is ending (autograd's final
        callback, `paramsync.actors.train.ddp_wrapper`): announce what its hooks could not and wait
        until every bucket's average is in the gradients and the buffers are synchronized, as torch
        DDP's reducer finalizes in backward. Returns False when a membership change dropped the step
        (its gradients zeroed)."""

        async def reduce(epoch: Epoch) -> None:
            epoch.compute.backward_returned(own.step)
            await self.steps.await_reduced(epoch, own.state, own.step)

        if await self._own_phase(own, reduce):
            return True
        self.epochs.lifecycle.end(own.epoch.generation, own.step)
        await self._own_step_dropped(own)
        return False

    async def begin_caller_apply(self, own: OwnStep) -> bool:
        """The caller is about to step its own optimizer with ``own.step``'s averaged
        gradients (an optimizer step pre-hook): wait for the previous step's commit and the
        epoch's apply barrier, as the optimizer actor would. False: the step was dropped."""

        async def barrier(epoch: Epoch) -> None:
            with self.run.trace.span("commit-wait", actor="optimizer", step=own.step - 1):
                await self.run.client.wait_commit(own.step - 1)
            await self.steps.apply_barrier(epoch, own.step)

        if await self._own_phase(own, barrier):
            return True
        # The epoch ended under it: a step every member was told to apply is still applied,
        # here by the caller (the supervisor does it for the trainer's own steps).
        gate = self.epochs.caller
        return gate is not None and gate.must_apply == own.step == self.run.step

    def caller_applied(self, own: OwnStep, *, skipped: bool = False) -> None:
        """The caller's thread has stepped its optimizer with ``own.step`` (or skipped the
        step: a loss scaler found inf or nan): count it and hash the state there, as the
        optimizer actor does right after its own step. Called outside the event loop."""
        own.epoch.optimizer.applied_by_caller(own.step, skipped=skipped)
        gate = self.epochs.caller
        if gate is not None and gate.must_apply == own.step:
            gate.must_apply = None  # the next crossing lets the next epoch enter

    async def end_caller_apply(self, own: OwnStep) -> bool:
        """After `caller_applied`: report ``own.step``'s digest (C-DDP-001) and, without
        ``verify_overlap``, wait for its check. Returns whether the step was taken."""

        async def report(epoch: Epoch) -> None:
            wait = not self.run.options.verify_overlap
            await epoch.optimizer.ask(Verify(own.step, wait=wait))
            self.epochs.lifecycle.applied(epoch.generation, own.step)

        return await self._own_step_ended(own, await self._own_phase(own, report, at=own.step + 1))

    async def _own_phase(
        self,
        own: OwnStep,
        body: Callable[[Epoch], Awaitable[None]],
        *,
        at: int | None = None,
    ) -> bool:
        """Run one phase of the caller's own step in its epoch, the trainer at step ``at``
        (default ``own.step``; the step after it once applied); False when the epoch ended
        under it (or before it), True when it ran. The step's own errors propagate."""
        epoch = own.epoch
        self.next_own = None
        if self.epochs.current is not epoch or self.run.step != (own.step if at is None else at):
            return False
        scope = trio.CancelScope()
        try:
            with scope:
                self.epochs.step_scope = scope
                await body(epoch)
        except Exception as exc:
            try:
                await self.steps.step_failed(exc, scope, epoch)
            except StepAborted:
                return False
            raise
        finally:
            self.epochs.step_scope = None
        return not scope.cancelled_caught

    async def _own_step_dropped(self, own: OwnStep) -> bool:
        """A step of the caller's own loop whose epoch ended under it: its gradients (some
        maybe backward wrote after the new epoch bound them) must not reach the next step.

        An epoch a failure ended (a peer's connection lost) is not yet a membership change:
        the coordinator says what follows, a new epoch (the step is dropped, and says so) or
        the run's end (the crossing is then cancelled, and the caller gets the run's error)."""
        step = own.step
        self.run.optimizer.zero_grad(set_to_none=False)
        if own_step_outcome(step, self.run.step, ran=False) is StepOutcome.DONE:
            return True  # taken while leaving the epoch, or received with a peer's state
        await self.epochs.word_after(own.epoch.generation)
        log.warning(
            "rank %d: step %d dropped by a membership change: its gradients are lost, the "
            "next step starts from the new epoch's state",
            self.run.rank,
            step,
        )
        return False
