"""Transition tables: the one way paramsync writes its state machines (pure).

A `Table` holds `Row`\\ s, each naming a state, an event, the handler that runs (where there
is one) and the state the row leads to. The run's lifecycle on the coordinator
(`paramsync.runtime.coordinator.run_state`), the coordinator's dispatch of events
(`paramsync.runtime.coordinator.core`), the worker's protocol
(`paramsync.actors.client.protocol`) and the trainer's epochs and steps
(`paramsync.actors.train.lifecycle`) are each such a table; their users look a (state, event)
pair up in it, run the row's handler and move to the row's target.

A pair the table does not hold is refused: `Table.row` raises the error its owner builds with
``refuse`` (by default an `IllegalTransition` naming the state and the event), never a silent
change. A table is checked when it is built: no pair appears twice, and no row leaves a
terminal state (a terminal state may keep rows that stay in it: events it absorbs).

A table is also a read-only mapping of (state, event) to the target state, so its users and
tests read it as the plain table it is (``(state, event) in table``, ``table[state, event]``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Generic, TypeVar

from paramsync.runtime.errors import ProtocolError

__all__ = ["Row", "Table", "IllegalTransition", "describe"]

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=Hashable)
H = TypeVar("H")
S_co = TypeVar("S_co", bound=enum.Enum, covariant=True)
E_co = TypeVar("E_co", bound=Hashable, covariant=True)
H_co = TypeVar("H_co", covariant=True)


def describe(value: object) -> str:
    """How errors name a state or an event: an enum's value, a class's name, else ``str``."""
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, type):
        return value.__name__
    return str(value)


class IllegalTransition(ProtocolError):
    """A state machine was fed an event its table does not allow in its state."""

    def __init__(self, state: enum.Enum, event: Hashable, message: str | None = None) -> None:
        text = f"{describe(event)} is not allowed while {describe(state)}"
        super().__init__(text if message is None else message)
        self.state = state
        self.event = event


@dataclass(frozen=True)
class Row(Generic[S_co, E_co, H_co]):
    """One legal transition: in ``state``, ``event`` runs ``handler`` (None: nothing runs)
    and leads to ``target``.

    ``target`` None: the handler moves the state itself, through its owner's own transition
    table (the coordinator's events, whose outcome decides among several states of the run).
    """

    state: S_co
    event: E_co
    target: S_co | None
    handler: H_co | None = None


class Table(Mapping[tuple[S, E], S], Generic[S, E, H]):
    """Every legal (state, event) pair of one state machine, and where each leads.

    ``states``: the enum of the machine's states; ``terminal``: the states nothing leaves;
    ``refuse``: builds the error an illegal pair raises (the owner's own error class).
    Raises ValueError when a pair appears twice or a row leaves a terminal state.
    """

    def __init__(
        self,
        states: type[S],
        rows: Iterable[Row[S, E, H]],
        *,
        terminal: Iterable[S] = (),
        refuse: Callable[[S, E], Exception] = IllegalTransition,
    ) -> None:
        self.states = states
        self.terminal = frozenset(terminal)
        self._refuse = refuse
        by_pair: dict[tuple[S, E], Row[S, E, H]] = {}
        for row in rows:
            pair = (row.state, row.event)
            if pair in by_pair:
                raise ValueError(
                    f"the table holds {describe(row.event)} in {describe(row.state)} twice"
                )
            if row.state in self.terminal and row.target not in (None, row.state):
                raise ValueError(
                    f"terminal state {describe(row.state)} has a way out: "
                    f"{describe(row.event)} leads to {describe(row.target)}"
                )
            by_pair[pair] = row
        self._rows: Mapping[tuple[S, E], Row[S, E, H]] = MappingProxyType(by_pair)

    # -- lookup -------------------------------------------------------------------------------

    def row(self, state: S, event: E) -> Row[S, E, H]:
        """The row of ``event`` in ``state``; the owner's refusal if the table has none."""
        row = self._rows.get((state, event))
        if row is None:
            raise self._refuse(state, event)
        return row

    def find(self, state: S, event: E) -> Row[S, E, H] | None:
        """The row of ``event`` in ``state``, None if the table has none (for an owner whose
        refusal names more than the pair: the message, the rank, the epoch)."""
        return self._rows.get((state, event))

    def next(self, state: S, event: E) -> S:
        """The state ``event`` leads to from ``state`` (a row with a fixed target)."""
        target = self.row(state, event).target
        if target is None:
            raise ValueError(
                f"{describe(event)} in {describe(state)} leaves the state to its handler"
            )
        return target

    def events(self, state: S) -> frozenset[E]:
        """The events ``state`` allows."""
        return frozenset(event for s, event in self._rows if s is state)

    def by_state(self) -> Mapping[S, frozenset[E]]:
        """Every state (terminal ones too) -> the events it allows."""
        return MappingProxyType({state: self.events(state) for state in self.states})

    @property
    def rows(self) -> tuple[Row[S, E, H], ...]:
        return tuple(self._rows.values())

    # -- the mapping of (state, event) to target ------------------------------------------------

    def __getitem__(self, pair: tuple[S, E]) -> S:
        target = self._rows[pair].target
        if target is None:
            raise KeyError(pair)
        return target

    def __iter__(self) -> Iterator[tuple[S, E]]:
        return (pair for pair, row in self._rows.items() if row.target is not None)

    def __len__(self) -> int:
        return sum(1 for row in self._rows.values() if row.target is not None)

    def __contains__(self, pair: object) -> bool:
        row = self._rows.get(pair)  # type: ignore[call-overload]
        return row is not None and row.target is not None
