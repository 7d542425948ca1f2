"""The trainer's epoch and step lifecycle as a sans-I/O state machine (pure).

`Lifecycle` is fed what the trainer's trio shell (`paramsync.actors.train.trainer`,
`paramsync.actors.train.epochs`, `paramsync.actors.train.steps`, `paramsync.actors.train.own_step`)
does and answers what may happen next. It opens no socket, starts no task, reads no clock; the shell
keeps the trio events that tasks wait on and sets them from the phases here.

An epoch moves through `EPOCH_TRANSITIONS`: the supervisor takes up the coordinator's start
(``start``) or hold (``hold``), enters the epoch (its data plane, its starting state, its
actors), goes live unless the coordinator announced another epoch meanwhile (``go_live``),
and leaves it (``leave``, then ``left``). The step in flight moves through
`STEP_TRANSITIONS`: begun (or prepared in advance for the caller's own loop), reduced (every
bucket averaged, the buffers synchronized), applied, ended. A trigger that is not in its
table is an `IllegalLifecycleTransition` naming the phase and the trigger (the trainer's own
bug). A step trigger of an epoch the trainer has left is stale: it is dropped and reported
as such (a step task woken just as its epoch ended), as `WorkerProtocol` drops an older
epoch's orders.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from paramsync.runtime.errors import ParamsyncError
from paramsync.runtime.protocol.state_machine import Row, Table

__all__ = [
    "EPOCH_TRANSITIONS",
    "STEP_TRANSITIONS",
    "EpochPhase",
    "EpochTrigger",
    "IllegalLifecycleTransition",
    "Lifecycle",
    "StepOutcome",
    "StepPhase",
    "StepTrigger",
    "attempt_outcome",
    "own_step_outcome",
]


class IllegalLifecycleTransition(ParamsyncError):
    """The trainer was asked to move along a transition that is not in its tables (a bug of
    the trainer's shell, not of a peer)."""

    def __init__(self, phase: EpochPhase | StepPhase, trigger: EpochTrigger | StepTrigger) -> None:
        what = "the epoch" if isinstance(phase, EpochPhase) else "the step"
        super().__init__(f"the trainer cannot {trigger.value} while {what} is {phase.value}")
        self.phase = phase
        self.trigger = trigger


class EpochPhase(enum.Enum):
    """Where the trainer is in its membership epochs."""

    WAITING = "waiting"
    """No epoch: the coordinator's next word (an epoch or a hold) is awaited."""
    HELD = "held"
    """The coordinator said hold: no epoch runs, the state is at rest."""
    ENTERING = "entering"
    """An epoch's data plane opens and its members reach its starting state."""
    LIVE = "live"
    """Steps run."""
    LEAVING = "leaving"
    """The epoch is torn down (a step every member holds is applied, the rest dropped)."""


class EpochTrigger(enum.Enum):
    START = "start an epoch"
    HOLD = "hold"
    GO_LIVE = "go live"
    LEAVE = "leave the epoch"
    LEFT = "finish leaving the epoch"


_EP, _ET = EpochPhase, EpochTrigger

EPOCH_TRANSITIONS: Table[EpochPhase, EpochTrigger, None] = Table(
    EpochPhase,
    [
        Row(_EP.WAITING, _ET.START, _EP.ENTERING),
        Row(_EP.WAITING, _ET.HOLD, _EP.HELD),
        Row(_EP.HELD, _ET.START, _EP.ENTERING),
        Row(_EP.HELD, _ET.HOLD, _EP.HELD),
        Row(_EP.ENTERING, _ET.GO_LIVE, _EP.LIVE),
        Row(_EP.ENTERING, _ET.LEAVE, _EP.LEAVING),
        Row(_EP.LIVE, _ET.LEAVE, _EP.LEAVING),
        Row(_EP.LEAVING, _ET.LEFT, _EP.WAITING),
    ],
    refuse=IllegalLifecycleTransition,
)
"""Every legal move of the epoch phase; anything else is an `IllegalLifecycleTransition`."""


class StepPhase(enum.Enum):
    """Where the step in flight is."""

    IDLE = "idle"
    """No step in flight."""
    PREPARED = "prepared"
    """Begun in advance for the caller's own loop, which may take it up or not."""
    RUNNING = "running"
    """Forward and backward, the buckets' all-reduce under way."""
    REDUCED = "reduced"
    """Every bucket averaged into the gradients, the buffers synchronized."""
    APPLIED = "applied"
    """The optimizer step taken and its digest reported."""


class StepTrigger(enum.Enum):
    PREPARE = "prepare a step"
    BEGIN = "begin a step"
    REDUCED = "finish a step's reduction"
    APPLIED = "apply a step"
    END = "end a step"


_SP, _ST = StepPhase, StepTrigger

STEP_TRANSITIONS: Table[StepPhase, StepTrigger, None] = Table(
    StepPhase,
    [
        Row(_SP.IDLE, _ST.PREPARE, _SP.PREPARED),
        Row(_SP.IDLE, _ST.BEGIN, _SP.RUNNING),
        # The prepared step was not taken up (the caller crossed in to begin one): begun again.
        Row(_SP.PREPARED, _ST.BEGIN, _SP.RUNNING),
        # The caller took the prepared step up and its backward ended.
        Row(_SP.PREPARED, _ST.REDUCED, _SP.REDUCED),
        Row(_SP.RUNNING, _ST.REDUCED, _SP.REDUCED),
        Row(_SP.REDUCED, _ST.APPLIED, _SP.APPLIED),
        *(Row(phase, _ST.END, _SP.IDLE) for phase in StepPhase),
    ],
    refuse=IllegalLifecycleTransition,
)
"""Every legal move of the step in flight (in a live epoch); ``end`` is legal from every
phase: a step ends taken, dropped or failed."""


@dataclass
class Lifecycle:
    """The epoch phase, the step in flight and the epoch it belongs to."""

    epoch_phase: EpochPhase = EpochPhase.WAITING
    step_phase: StepPhase = StepPhase.IDLE
    step: int | None = None
    """The step in flight (None when idle)."""
    generation: int = 0
    """How many epochs were started: what a step's events name as their epoch."""
    announced: bool = False
    """The coordinator announced its next word while this epoch entered or ran: it never
    goes live, or stops being live."""

    # -- epochs ------------------------------------------------------------------------------

    def _epoch(self, trigger: EpochTrigger) -> None:
        self.epoch_phase = EPOCH_TRANSITIONS.next(self.epoch_phase, trigger)

    def start(self) -> int:
        """The supervisor takes up an epoch's start; returns its generation."""
        self._epoch(EpochTrigger.START)
        self.generation += 1
        return self.generation

    def hold(self) -> None:
        """The supervisor takes up a hold."""
        self._epoch(EpochTrigger.HOLD)

    def announce(self) -> bool:
        """The coordinator announced its next epoch or a hold; returns whether an epoch was
        live (its steps then stop now, before the supervisor leaves it)."""
        self.announced = True
        return self.epoch_phase is EpochPhase.LIVE

    def took_announcement(self) -> None:
        """The supervisor took up every announcement there was."""
        self.announced = False

    def go_live(self) -> bool:
        """The entered epoch's actors run: whether it goes live (not when the coordinator
        announced its next word meanwhile; the epoch then only waits to be left)."""
        if self.epoch_phase is not EpochPhase.ENTERING:
            raise IllegalLifecycleTransition(self.epoch_phase, EpochTrigger.GO_LIVE)
        if self.announced:
            return False
        self._epoch(EpochTrigger.GO_LIVE)
        return True

    @property
    def live(self) -> bool:
        """Whether steps may run now."""
        return self.epoch_phase is EpochPhase.LIVE and not self.announced

    def leave(self) -> int | None:
        """The supervisor leaves the epoch: returns the step that was in flight (dropped, or
        applied while leaving), None if none was."""
        self._epoch(EpochTrigger.LEAVE)
        dropped = self.step
        self.step_phase, self.step = StepPhase.IDLE, None
        return dropped

    def left(self) -> None:
        self._epoch(EpochTrigger.LEFT)

    # -- the step in flight ------------------------------------------------------------------

    def _step(self, trigger: StepTrigger) -> None:
        self.step_phase = STEP_TRANSITIONS.next(self.step_phase, trigger)

    def begin(self, generation: int, step: int, *, prepared: bool = False) -> bool:
        """Step ``step`` begins in epoch ``generation`` (``prepared``: in advance, for the
        caller's own loop); False: stale, that epoch is no longer live (the end of the epoch
        cancels the step that tried)."""
        if generation != self.generation or not self.live:
            return False
        self._step(StepTrigger.PREPARE if prepared else StepTrigger.BEGIN)
        self.step = step
        return True

    def abandon(self, generation: int) -> None:
        """The caller's own loop begins a step in epoch ``generation``: whatever step it had
        in flight there is over (a prepared one it did not take up, one that failed)."""
        if generation == self.generation and self.step is not None:
            self._step(StepTrigger.END)
            self.step = None

    def _current(self, generation: int, step: int, trigger: StepTrigger) -> bool:
        if generation != self.generation or self.epoch_phase is not EpochPhase.LIVE:
            return False  # stale: its epoch was left under it
        if self.step is None:
            return False  # ended (dropped) under it
        if self.step != step:
            raise IllegalLifecycleTransition(self.step_phase, trigger)
        return True

    def reduced(self, generation: int, step: int) -> bool:
        """Step ``step``'s buckets are all averaged; False: stale (dropped)."""
        if not self._current(generation, step, StepTrigger.REDUCED):
            return False
        self._step(StepTrigger.REDUCED)
        return True

    def applied(self, generation: int, step: int) -> bool:
        """Step ``step`` was applied and its digest reported; False: stale (dropped)."""
        if not self._current(generation, step, StepTrigger.APPLIED):
            return False
        self._step(StepTrigger.APPLIED)
        return True

    def end(self, generation: int, step: int) -> None:
        """Step ``step`` is over (taken, dropped or failed); nothing if it was already."""
        if generation == self.generation and self.step == step:
            self._step(StepTrigger.END)
            self.step = None


class StepOutcome(enum.Enum):
    """What became of a step attempt (`attempt_outcome`, `own_step_outcome`)."""

    TAKEN = "taken"
    """The attempt ran to its end and the trainer moved on to the next step."""
    DONE = "done"
    """The step was completed without the attempt (applied while leaving the epoch, or
    received with a peer's state)."""
    RERUN = "rerun"
    """The epoch ended under it, the trainer is still at the step: run it again."""
    ROLLED_BACK = "rolled back"
    """The trainer was rolled back to an earlier step: the batch is not run."""
    DROPPED = "dropped"
    """The caller's own step was dropped by a membership change (its gradients are lost)."""


def attempt_outcome(step: int, now: int) -> StepOutcome:
    """An attempt at ``step`` was dropped by the end of its epoch; the trainer is at ``now``."""
    if now > step:
        return StepOutcome.DONE
    if now < step:
        return StepOutcome.ROLLED_BACK
    return StepOutcome.RERUN


def own_step_outcome(step: int, now: int, *, ran: bool) -> StepOutcome:
    """The caller's own step ``step`` after its last phase ran (``ran``) or its epoch ended
    under it, the trainer now at ``now``: taken, done without it, or dropped."""
    if ran and now == step + 1:
        return StepOutcome.TAKEN
    return StepOutcome.DONE if now > step else StepOutcome.DROPPED
