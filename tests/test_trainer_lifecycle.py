"""The trainer's epoch and step lifecycle (`paramsync.actors.train.lifecycle`): its tables, its
verdicts, and a hypothesis state machine that plays the supervisor, the coordinator's announcements
and the step tasks against it.

The lifecycle is pure, so hypothesis drives it directly (no trio). The machine keeps its own
account of what happened (announcements queued, epochs taken up, the step each task began) and
checks the lifecycle's answers against it: a step begins only in a live epoch and never while
another one runs; leaving an epoch drops the step in flight; a step event of an epoch already
left is stale (dropped, not an error); and every trigger the tables do not allow is an
`IllegalLifecycleTransition` naming the phase and the trigger.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paramsync.actors.train.lifecycle import (
    EPOCH_TRANSITIONS,
    STEP_TRANSITIONS,
    EpochPhase,
    EpochTrigger,
    IllegalLifecycleTransition,
    Lifecycle,
    StepOutcome,
    StepPhase,
    StepTrigger,
    attempt_outcome,
    own_step_outcome,
)


def test_every_epoch_phase_is_reachable_and_has_a_way_out() -> None:
    reached = {EpochPhase.WAITING}
    frontier = [EpochPhase.WAITING]
    while frontier:
        phase = frontier.pop()
        for (source, _), target in EPOCH_TRANSITIONS.items():
            if source is phase and target not in reached:
                reached.add(target)
                frontier.append(target)
    assert reached == set(EpochPhase)
    assert {source for source, _ in EPOCH_TRANSITIONS} == set(EpochPhase)


def test_every_step_phase_can_end() -> None:
    for phase in StepPhase:
        assert STEP_TRANSITIONS[phase, StepTrigger.END] is StepPhase.IDLE


def test_an_illegal_trigger_names_the_phase_and_the_trigger() -> None:
    lifecycle = Lifecycle()
    with pytest.raises(IllegalLifecycleTransition, match="cannot go live while the epoch is"):
        lifecycle.go_live()
    with pytest.raises(
        IllegalLifecycleTransition, match="leave the epoch while the epoch is waiting"
    ):
        lifecycle.leave()
    generation = lifecycle.start()
    assert lifecycle.go_live()
    assert lifecycle.begin(generation, 3)
    with pytest.raises(IllegalLifecycleTransition, match="begin a step while the step is running"):
        lifecycle.begin(generation, 3)
    with pytest.raises(IllegalLifecycleTransition, match="apply a step while the step is running"):
        lifecycle.applied(generation, 3)
    with pytest.raises(IllegalLifecycleTransition) as caught:
        lifecycle.reduced(generation, 4)  # another step than the one in flight
    assert caught.value.phase is StepPhase.RUNNING
    assert caught.value.trigger is StepTrigger.REDUCED


def test_an_announcement_while_entering_keeps_the_epoch_from_going_live() -> None:
    lifecycle = Lifecycle()
    generation = lifecycle.start()
    lifecycle.announce()
    assert not lifecycle.go_live()
    assert not lifecycle.begin(generation, 0)  # stale: the epoch never went live
    assert lifecycle.leave() is None
    lifecycle.left()
    lifecycle.took_announcement()
    assert lifecycle.start() == generation + 1
    assert lifecycle.go_live() and lifecycle.live


@pytest.mark.parametrize(
    ("step", "now", "outcome"),
    [
        (5, 5, StepOutcome.RERUN),
        (5, 6, StepOutcome.DONE),
        (5, 9, StepOutcome.DONE),
        (5, 4, StepOutcome.ROLLED_BACK),
    ],
)
def test_a_dropped_attempt_is_rerun_done_or_rolled_back(
    step: int, now: int, outcome: StepOutcome
) -> None:
    assert attempt_outcome(step, now) is outcome


@pytest.mark.parametrize(
    ("ran", "now", "outcome"),
    [
        (True, 6, StepOutcome.TAKEN),
        (True, 5, StepOutcome.DROPPED),  # its phase ran, but the optimizer step did not land
        (True, 7, StepOutcome.DONE),  # a peer's state moved the trainer past it
        (False, 6, StepOutcome.DONE),  # applied while leaving the epoch
        (False, 5, StepOutcome.DROPPED),
        (False, 3, StepOutcome.DROPPED),
    ],
)
def test_the_caller_s_own_step_is_taken_done_or_dropped(
    ran: bool, now: int, outcome: StepOutcome
) -> None:
    assert own_step_outcome(5, now, ran=ran) is outcome


class LifecycleMachine(RuleBasedStateMachine):
    """The supervisor, the coordinator and the step tasks, in any order the shell allows."""

    def __init__(self) -> None:
        super().__init__()
        self.lifecycle = Lifecycle()
        self.queue: list[str] = []
        """Announcements not yet taken up by the supervisor ("start" or "hold")."""
        self.starts = 0
        self.next_step = 0
        self.in_flight: tuple[int, int, StepPhase] | None = None
        """(generation, step, phase) of the step a task began, as this machine saw it."""
        self.generations_seen: list[int] = [0]

    # -- the coordinator and the supervisor -------------------------------------------------

    @rule(kind=st.sampled_from(["start", "hold"]))
    def coordinator_announces(self, kind: str) -> None:
        was_live = self.lifecycle.epoch_phase is EpochPhase.LIVE
        assert self.lifecycle.announce() == was_live
        self.queue.append(kind)
        assert not self.lifecycle.live

    @precondition(lambda self: self.queue)
    @rule()
    def supervisor_takes_up_the_next_word(self) -> None:
        phase = self.lifecycle.epoch_phase
        kind = self.queue[0]
        trigger = EpochTrigger.START if kind == "start" else EpochTrigger.HOLD
        if (phase, trigger) not in EPOCH_TRANSITIONS:
            with pytest.raises(IllegalLifecycleTransition):
                self.lifecycle.start() if kind == "start" else self.lifecycle.hold()
            assert self.lifecycle.epoch_phase is phase  # an illegal trigger changes nothing
            return
        self.queue.pop(0)
        if kind == "start":
            generation = self.lifecycle.start()
            self.starts += 1
            assert generation == self.starts
            self.generations_seen.append(generation)
        else:
            self.lifecycle.hold()
        if not self.queue:
            self.lifecycle.took_announcement()

    @precondition(lambda self: self.lifecycle.epoch_phase is EpochPhase.ENTERING)
    @rule()
    def supervisor_entered(self) -> None:
        assert self.lifecycle.go_live() == (not self.queue)

    @precondition(lambda self: self.lifecycle.epoch_phase in (EpochPhase.ENTERING, EpochPhase.LIVE))
    @rule()
    def supervisor_leaves(self) -> None:
        dropped = self.lifecycle.leave()
        expected = self.in_flight[1] if self.in_flight is not None else None
        assert dropped == expected
        self.in_flight = None
        assert self.lifecycle.step_phase is StepPhase.IDLE
        self.lifecycle.left()
        assert self.lifecycle.epoch_phase is EpochPhase.WAITING

    @rule(trigger=st.sampled_from(list(EpochTrigger)))
    def an_epoch_trigger_out_of_turn(self, trigger: EpochTrigger) -> None:
        phase = self.lifecycle.epoch_phase
        if (phase, trigger) in EPOCH_TRANSITIONS or trigger is EpochTrigger.GO_LIVE:
            return  # the other rules take the legal ones
        act = {
            EpochTrigger.START: self.lifecycle.start,
            EpochTrigger.HOLD: self.lifecycle.hold,
            EpochTrigger.LEAVE: self.lifecycle.leave,
            EpochTrigger.LEFT: self.lifecycle.left,
        }[trigger]
        with pytest.raises(IllegalLifecycleTransition) as caught:
            act()
        assert caught.value.phase is phase and caught.value.trigger is trigger
        assert phase.value in str(caught.value) and trigger.value in str(caught.value)
        assert self.lifecycle.epoch_phase is phase

    # -- the step tasks ---------------------------------------------------------------------

    @rule(prepared=st.booleans(), stale=st.booleans())
    def a_task_begins_a_step(self, prepared: bool, stale: bool) -> None:
        generation = self.lifecycle.generation - 1 if stale else self.lifecycle.generation
        step = self.next_step
        live = self.lifecycle.live and generation == self.lifecycle.generation
        phase = self.in_flight[2] if self.in_flight is not None else StepPhase.IDLE
        trigger = StepTrigger.PREPARE if prepared else StepTrigger.BEGIN
        if not live:
            assert not self.lifecycle.begin(generation, step, prepared=prepared)
            return
        if (phase, trigger) not in STEP_TRANSITIONS:
            with pytest.raises(IllegalLifecycleTransition):
                self.lifecycle.begin(generation, step, prepared=prepared)
            return
        assert self.lifecycle.begin(generation, step, prepared=prepared)
        self.in_flight = (generation, step, STEP_TRANSITIONS[phase, trigger])

    def _event(self, trigger: StepTrigger, stale: bool) -> None:
        generation = self.lifecycle.generation - 1 if stale else self.lifecycle.generation
        if self.in_flight is None:
            step = self.next_step
        else:
            step = self.in_flight[1]
        act = self.lifecycle.reduced if trigger is StepTrigger.REDUCED else self.lifecycle.applied
        current = (
            self.in_flight is not None
            and generation == self.in_flight[0]
            and self.lifecycle.epoch_phase is EpochPhase.LIVE
        )
        if not current:
            assert not act(generation, step)  # stale: dropped, never an error
            return
        assert self.in_flight is not None
        phase = self.in_flight[2]
        if (phase, trigger) not in STEP_TRANSITIONS:
            with pytest.raises(IllegalLifecycleTransition):
                act(generation, step)
            return
        assert act(generation, step)
        self.in_flight = (generation, step, STEP_TRANSITIONS[phase, trigger])

    @rule(stale=st.booleans())
    def the_step_is_reduced(self, stale: bool) -> None:
        self._event(StepTrigger.REDUCED, stale)

    @rule(stale=st.booleans())
    def the_step_is_applied(self, stale: bool) -> None:
        self._event(StepTrigger.APPLIED, stale)

    @rule()
    def the_step_ends(self) -> None:
        if self.in_flight is None:
            self.lifecycle.end(self.lifecycle.generation, self.next_step)  # nothing to end
            return
        generation, step, phase = self.in_flight
        self.lifecycle.end(generation, step)
        if phase is StepPhase.APPLIED:
            self.next_step += 1
        self.in_flight = None

    # -- what always holds ------------------------------------------------------------------

    @invariant()
    def a_step_runs_only_in_a_live_epoch(self) -> None:
        if self.lifecycle.epoch_phase is not EpochPhase.LIVE:
            assert self.lifecycle.step_phase is StepPhase.IDLE

    @invariant()
    def the_step_in_flight_is_the_one_a_task_began(self) -> None:
        if self.in_flight is None:
            assert self.lifecycle.step is None
            assert self.lifecycle.step_phase is StepPhase.IDLE
        else:
            assert self.lifecycle.step == self.in_flight[1]
            assert self.lifecycle.step_phase is self.in_flight[2]

    @invariant()
    def live_means_no_word_is_pending(self) -> None:
        if self.lifecycle.live:
            assert not self.queue and self.lifecycle.epoch_phase is EpochPhase.LIVE

    @invariant()
    def generations_count_the_epochs_started(self) -> None:
        assert self.lifecycle.generation == self.starts


LifecycleMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None
)
TestLifecycleMachine = LifecycleMachine.TestCase
