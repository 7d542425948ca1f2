"""The run's lifecycle as a table: every legal (state, trigger) pair and the state it leads to.

The coordinator core moves the run only through :func:`next_state`; a pair that is not in
:data:`TRANSITIONS` (a `paramsync.runtime.protocol.state_machine.Table`) is a protocol error
(:class:`IllegalTransition`), never a silent change. FINISHED and ABORTED are terminal: nothing
leaves them.
"""

from __future__ import annotations

import enum

from paramsync.runtime.protocol import state_machine
from paramsync.runtime.protocol.state_machine import Row, Table

__all__ = ["RunState", "Trigger", "TRANSITIONS", "DONE", "IllegalTransition", "next_state"]


class RunState(enum.Enum):
    """Where the run is."""

    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    HOLDING = "holding"
    FINISHED = "finished"
    ABORTED = "aborted"

    # A member is its own singleton: hashed by identity, at C speed (the transition tables
    # are looked up by (state, event type) on every event; Enum's own hash is Python code).
    __hash__ = object.__hash__


class Trigger(enum.Enum):
    """What moves the run from one state to the next."""

    START_EPOCH = "start an epoch"
    """Members are known: a StartRun opens an epoch (the first, or one after a change)."""
    HOLD = "hold"
    """Fewer than min_workers remain: drop the step in flight and wait for joiners."""
    FINISH = "finish"
    """Every member finished the run."""
    ABORT = "abort"
    """The run stops with a reason."""


_R, _T = RunState, Trigger

DONE = frozenset({RunState.FINISHED, RunState.ABORTED})
"""The terminal states: the core ignores every event once the run is in one."""


class IllegalTransition(state_machine.IllegalTransition):
    """The run was asked to move along a transition that is not in the table."""

    def __init__(self, state: RunState, trigger: Trigger) -> None:
        text = f"the run cannot {trigger.value} while it is {state.value}"
        super().__init__(state, trigger, text)
        self.trigger = trigger


TRANSITIONS: Table[RunState, Trigger, None] = Table(
    RunState,
    [
        Row(_R.RENDEZVOUS, _T.START_EPOCH, _R.RUNNING),
        Row(_R.RENDEZVOUS, _T.ABORT, _R.ABORTED),
        Row(_R.RUNNING, _T.START_EPOCH, _R.RUNNING),
        Row(_R.RUNNING, _T.HOLD, _R.HOLDING),
        Row(_R.RUNNING, _T.FINISH, _R.FINISHED),
        Row(_R.RUNNING, _T.ABORT, _R.ABORTED),
        Row(_R.HOLDING, _T.START_EPOCH, _R.RUNNING),
        Row(_R.HOLDING, _T.HOLD, _R.HOLDING),
        Row(_R.HOLDING, _T.ABORT, _R.ABORTED),
    ],
    terminal=DONE,
    refuse=IllegalTransition,
)
"""Every legal transition of the run; anything else is an `IllegalTransition`."""


def next_state(state: RunState, trigger: Trigger) -> RunState:
    """The state ``trigger`` leads to from ``state``; IllegalTransition if there is none."""
    return TRANSITIONS.next(state, trigger)
