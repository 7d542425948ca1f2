"""Transition tables (`paramsync.runtime.protocol.state_machine`): the checks made when a table
is built, the refusal of an illegal pair, and a hypothesis walk over the tables paramsync runs
(the run's lifecycle, the coordinator's dispatch, the worker's protocol, the trainer's epochs
and steps): a legal event moves to its row's target, an illegal one is refused naming the state
and the event, and no walk ever leaves a terminal state.
"""

from __future__ import annotations

import enum
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paramsync.actors.client.protocol import COORDINATOR_TABLE, LINK_TABLE, TRAINER_TABLE
from paramsync.actors.train.lifecycle import (
    EPOCH_TRANSITIONS,
    STEP_TRANSITIONS,
    EpochPhase,
    EpochTrigger,
    IllegalLifecycleTransition,
)
from paramsync.runtime.coordinator.core import EVENTS
from paramsync.runtime.coordinator.run_state import TRANSITIONS
from paramsync.runtime.errors import ProtocolError
from paramsync.runtime.protocol.state_machine import IllegalTransition, Row, Table


class Door(enum.Enum):
    OPEN = "open"
    SHUT = "shut"
    GONE = "gone"


def door(*rows: Row[Door, str, Any]) -> Table[Door, str, Any]:
    return Table(Door, rows, terminal={Door.GONE})


DOOR = door(
    Row(Door.OPEN, "shut", Door.SHUT),
    Row(Door.SHUT, "open", Door.OPEN),
    Row(Door.SHUT, "knock", Door.SHUT, lambda who: f"{who} knocks"),
    Row(Door.OPEN, "burn", Door.GONE),
    Row(Door.GONE, "knock", Door.GONE),
)


def test_a_legal_event_names_its_handler_and_target() -> None:
    row = DOOR.row(Door.SHUT, "knock")
    assert row.handler is not None and row.handler("ann") == "ann knocks"
    assert DOOR.next(Door.SHUT, "open") is Door.OPEN
    assert DOOR[Door.OPEN, "burn"] is Door.GONE and (Door.OPEN, "shut") in DOOR
    assert DOOR.events(Door.SHUT) == {"open", "knock"}
    assert DOOR.by_state() == {
        Door.OPEN: {"shut", "burn"},
        Door.SHUT: {"open", "knock"},
        Door.GONE: {"knock"},
    }
    assert len(DOOR) == 5 and DOOR.find(Door.OPEN, "open") is None


def test_an_illegal_event_is_a_protocol_error_naming_state_and_event() -> None:
    with pytest.raises(IllegalTransition, match="open is not allowed while open") as info:
        DOOR.row(Door.OPEN, "open")
    assert isinstance(info.value, ProtocolError)
    assert (info.value.state, info.value.event) == (Door.OPEN, "open")
    assert (Door.OPEN, "open") not in DOOR


def test_an_owner_refuses_with_its_own_error() -> None:
    def refuse(state: Door, event: str) -> Exception:
        return LookupError(f"the door cannot {event} while {state.value}")

    table: Table[Door, str, Any] = Table(Door, [Row(Door.OPEN, "shut", Door.SHUT)], refuse=refuse)
    with pytest.raises(LookupError, match="cannot open while shut"):
        table.next(Door.SHUT, "open")
    with pytest.raises(IllegalLifecycleTransition, match="cannot go live while the epoch is"):
        EPOCH_TRANSITIONS.next(EpochPhase.WAITING, EpochTrigger.GO_LIVE)


def test_a_terminal_state_has_no_way_out() -> None:
    with pytest.raises(ValueError, match="terminal state gone has a way out: rebuild leads to"):
        door(Row(Door.GONE, "rebuild", Door.OPEN))
    door(Row(Door.GONE, "knock", Door.GONE))  # a terminal state may absorb an event


def test_a_pair_is_listed_once() -> None:
    with pytest.raises(ValueError, match="holds shut in open twice"):
        door(Row(Door.OPEN, "shut", Door.SHUT), Row(Door.OPEN, "shut", Door.OPEN))


def test_a_row_that_leaves_the_state_to_its_handler_has_no_fixed_target() -> None:
    table: Table[Door, str, Any] = Table(Door, [Row(Door.OPEN, "wind", None, print)])
    assert table.row(Door.OPEN, "wind").handler is print
    assert (Door.OPEN, "wind") not in table and len(table) == 0
    with pytest.raises(ValueError, match="leaves the state to its handler"):
        table.next(Door.OPEN, "wind")


TABLES: dict[str, Table[Any, Any, Any]] = {
    "door": DOOR,
    "run state": TRANSITIONS,
    "coordinator events": EVENTS,
    "worker, coordinator messages": COORDINATOR_TABLE,
    "worker, trainer requests": TRAINER_TABLE,
    "worker, link": LINK_TABLE,
    "trainer epochs": EPOCH_TRANSITIONS,
    "trainer steps": STEP_TRANSITIONS,
}


@given(st.sampled_from(sorted(TABLES)), st.data())
def test_a_walk_follows_the_rows_and_never_leaves_a_terminal_state(name: str, data: Any) -> None:
    table = TABLES[name]
    events = sorted({row.event for row in table.rows}, key=repr)
    state = data.draw(st.sampled_from(list(table.states)), label="start")
    for _ in range(data.draw(st.integers(0, 30), label="length")):
        event = data.draw(st.sampled_from(events), label="event")
        row = table.find(state, event)
        if row is None:
            with pytest.raises(Exception) as info:  # each owner refuses with its own error
                table.row(state, event)
            if isinstance(info.value, IllegalTransition):
                assert (info.value.state, info.value.event) == (state, event)
            continue
        assert (row.state, row.event) == (state, event)
        target = state if row.target is None else row.target
        if state in table.terminal:
            assert target is state
        state = target
