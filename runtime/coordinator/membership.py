"""Membership: who joined, who trains in the current epoch, and how epochs follow each other.

:class:`Membership` admits joins (checking the rank, its address, its model against the
reference signature, its process groups and its parallel layout), removes lost ranks, and
opens epochs: the first one (a fresh start, or a restart that elects its donor by the rule of
:func:`resume_plan`: the newest committed or majority state, never one rank's unverified state
over a state others share), and every later one after a loss, a join or a hold. Each epoch is
kept as an :class:`EpochRecord`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from paramsync.runtime.coordinator.events import signature_mismatch
from paramsync.runtime.coordinator.group_decl import (
    Declaration,
    declaration_mismatch,
    declaration_of,
    describe,
)
from paramsync.runtime.coordinator.layouts import AgreedLayout, join_layout_problem
from paramsync.runtime.errors import plain_or_quoted
from paramsync.runtime.protocol.messages import Joined, Signature

__all__ = [
    "COMMITTED",
    "MAJORITY",
    "PLURALITY",
    "EpochRecord",
    "Opening",
    "ResumePlan",
    "resume_plan",
    "Membership",
]


@dataclass(frozen=True)
class EpochRecord:
    """One membership epoch: from step ``step`` on, ``members`` train together."""

    epoch: int
    step: int
    members: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class Opening:
    """An epoch just opened: ``first`` (the run's first), its ``ring`` order by position, and
    whether its members ``fold`` cached bucket reports into step reports (all offered to)."""

    first: bool
    ring: tuple[int, ...]
    fold: bool


State = tuple[int, bytes]
"""A worker's state as its join reports it: (next step, digest)."""

COMMITTED = "committed"
MAJORITY = "majority"
PLURALITY = "plurality"


@dataclass(frozen=True)
class ResumePlan:
    """Restarted workers resume at ``step``: ``donor`` sends its state to ``receivers``;
    ``epoch`` is the latest epoch any of them took part in.

    ``rule`` is how the state was chosen (`COMMITTED`, `MAJORITY` or `PLURALITY`),
    ``holders`` how many of the ``joined`` ranks hold it, ``rolled_back`` the ranks that
    reported a later step and go back to ``step``, ``conflict`` a committed state that
    disagrees with the majority's at the same step (None: none), which the rule resolves for
    the committed one.
    """

    step: int
    donor: int
    receivers: tuple[int, ...]
    epoch: int
    rule: str = MAJORITY
    holders: int = 1
    joined: int = 1
    rolled_back: tuple[int, ...] = ()
    conflict: str | None = None

    def describe(self) -> str:
        """The choice as the coordinator logs it: where, from whom, by which rule, and who
        goes back."""
        if self.rule == COMMITTED:
            why = "committed state"
        else:
            why = f"{self.rule} state ({self.holders} of {self.joined} ranks)"
        text = f"resume at step {self.step} from rank {self.donor}: {why}"
        if self.rolled_back:
            text += f"; ranks {list(self.rolled_back)} roll back to step {self.step}"
        if self.conflict is not None:
            text += f"; {self.conflict}"
        return text


def _best(states: set[State], holders: Mapping[State, list[int]]) -> State:
    """Of ``states``, the one most ranks hold; ties to the lower step, then the lowest rank."""
    return min(states, key=lambda s: (-len(holders[s]), s[0], holders[s][0]))


def resume_plan(joins: Mapping[int, Joined]) -> ResumePlan | None:
    """Where the joined workers resume, by the restart's donor rule (docs/protocol.md,
    "A lost coordinator"): None for a fresh run.

    C is the newest state (step, digest) some rank reports as committed and at least one other
    rank holds too (a claim is corroborated: a lone rank claiming a commit is not trusted,
    since a commit means every member reported that digest), M the state a strict majority of
    the joined ranks holds. The run resumes from whichever of the two is at the
    later step (C when they are at the same one: they agree, or C's commit outranks the
    majority and the plan names the conflict); with neither, from the state most ranks hold,
    ties to the lower step (an unverified step is recomputed rather than trusted), then to the
    lowest rank. So one rank's state, committed by its own word or not, never overrides a
    state two ranks share, and no rank alone makes the others adopt its state.
    Fresh workers (step 0) hold no state: they count among the joined ranks but are no
    candidate and always receive; with no state at all it is a fresh run. The donor is the
    lowest rank holding the chosen state; every other rank receives it, those at a later step
    rolling back.
    """
    ranks = sorted(joins)
    holders: dict[State, list[int]] = {}
    for rank in ranks:
        if joins[rank].step > 0:  # a fresh worker (step 0) holds no state to vote for
            holders.setdefault((joins[rank].step, joins[rank].digest), []).append(rank)
    if not holders:
        return None
    claims = {(j.step, j.digest) for j in joins.values() if j.committed and j.step > 0}
    # Corroborated claims only: a commit was of a digest every member reported.
    claimed = {s for s in claims if len(holders[s]) >= 2}
    lone = sorted(holders[s][0] for s in claims - claimed)
    newest_claim = max((s[0] for s in claimed), default=-1)
    committed = _best({s for s in claimed if s[0] == newest_claim}, holders) if claimed else None
    majority = next((s for s, r in holders.items() if 2 * len(r) > len(ranks)), None)
    conflict = None
    if committed is not None and (majority is None or committed[0] >= majority[0]):
        chosen, rule = committed, COMMITTED
        if majority is not None and majority[0] == committed[0] and majority != committed:
            conflict = (
                f"ranks {holders[majority]} hold another state at step {majority[0]} than the "
                f"committed one of ranks {holders[committed]}: the committed state wins"
            )
    elif majority is not None:
        chosen, rule = majority, MAJORITY
    else:
        chosen, rule = _best(set(holders), holders), PLURALITY
    if lone and len(joins) > 1 and chosen not in {(joins[r].step, joins[r].digest) for r in lone}:
        conflict = f"ranks {lone} claim a committed state no other rank holds: not trusted" + (
            f"; {conflict}" if conflict else ""
        )
    step = chosen[0]
    return ResumePlan(
        step=step,
        donor=holders[chosen][0],
        receivers=tuple(r for r in ranks if r not in holders[chosen]),
        epoch=max(j.epoch for j in joins.values()),
        rule=rule,
        holders=len(holders[chosen]),
        joined=len(ranks),
        rolled_back=tuple(r for r in ranks if joins[r].step > step),
        conflict=conflict,
    )


class Membership:
    """The ranks of a run of ``world_size`` slots and its epochs. ``reference``: the model
    every join must match (else the first join's); ``ring``: the first epoch's ring order."""

    def __init__(
        self, world_size: int, *, ring: tuple[int, ...], reference: Signature | None
    ) -> None:
        self.world_size = world_size
        self.ring = ring
        self.reference = reference
        self.reference_rank: int | None = None
        self.groups: Declaration | None = None
        """The process groups every join declared (the first join's; None: no join yet)."""
        self.groups_rank: int | None = None
        self.layout: AgreedLayout | None = None
        """The parallel layout the first epoch's ranks agreed on (None: none, or not
        started)."""
        self.epoch = 0
        """The membership epoch (0 before the start; grows by one per membership change)."""
        self._members: tuple[int, ...] = ()
        self._member_set: frozenset[int] = frozenset()
        self._addresses: dict[int, tuple[str, int]] = {}
        self._joins: dict[int, Joined] = {}
        self._history: list[EpochRecord] = []

    # ------------------------------------------------------------------- views

    @property
    def members(self) -> tuple[int, ...]:
        """The current epoch's members by ring position."""
        return self._members

    @members.setter
    def members(self, members: tuple[int, ...]) -> None:
        self._members = members
        self._member_set = frozenset(members)

    def is_member(self, rank: int) -> bool:
        """Whether ``rank`` is a member of the current epoch (O(1): every report asks)."""
        return rank in self._member_set

    @property
    def joined(self) -> tuple[int, ...]:
        """Every rank with a live join (members and joiners waiting for an epoch), ascending."""
        return tuple(sorted(self._addresses))

    @property
    def addresses(self) -> Mapping[int, tuple[str, int]]:
        return MappingProxyType(self._addresses)

    @property
    def joins(self) -> Mapping[int, Joined]:
        return MappingProxyType(self._joins)

    @property
    def history(self) -> tuple[EpochRecord, ...]:
        return tuple(self._history)

    def __contains__(self, rank: object) -> bool:
        """Whether ``rank`` has a live join."""
        return rank in self._addresses

    def __len__(self) -> int:
        """The number of live joins."""
        return len(self._addresses)

    def hosts_note(self, ranks: Iterable[int]) -> str:
        """Where ``ranks`` run, for a loss's account: ``"; host H runs ranks 2, 3"`` for each
        host of ``ranks``, with every joined rank on it (the ranks a dead host takes with it),
        or "" when every joined rank is on one host. A host is the address a rank joined
        with (its peers dial it there)."""
        hosts = {address[0] for address in self._addresses.values()}
        if len(hosts) < 2:
            return ""
        notes = []
        for host in dict.fromkeys(self._addresses[r][0] for r in ranks if r in self._addresses):
            on = ", ".join(str(r) for r in self.joined if self._addresses[r][0] == host)
            notes.append(f"; host {plain_or_quoted(host)} runs rank{'s' * (',' in on)} {on}")
        return "".join(notes)

    def survivors(self) -> tuple[int, ...]:
        """The current epoch's members that are still joined, by ring position."""
        return tuple(r for r in self.members if r in self._addresses)

    def joiners(self) -> tuple[int, ...]:
        """Joined ranks that are not members of the current epoch, in join order."""
        return tuple(r for r in self._addresses if r not in self._member_set)

    # ------------------------------------------------------------------- joins

    def check_join(self, event: Joined) -> str | None:
        """Why ``event`` cannot join (None: it can)."""
        rank = event.rank
        if not 0 <= rank < self.world_size:
            return f"rank {rank} is out of range for a world of {self.world_size} ranks"
        if rank in self._addresses:
            return f"rank {rank} has already joined"
        for other, address in self._addresses.items():
            if address == event.address:
                host, port = address
                return f"rank {rank}'s address {plain_or_quoted(host)}:{port} is rank {other}'s"
        if self.reference is not None:
            where = signature_mismatch(event.signature, self.reference)
            if where is not None:
                ref = (
                    "the reference model"
                    if self.reference_rank is None
                    else f"rank {self.reference_rank}'s"
                )
                return f"rank {rank}'s model differs from {ref} {where}"
        groups = self._check_groups(event)
        if groups is not None:
            return groups
        return self._check_layout(event)

    def _check_layout(self, event: Joined) -> str | None:
        """Why ``event``'s parallel layout cannot be taken on its own (None: it can); the
        ranks' agreement is checked once all are in (`layouts.layout_disagreement`). Joins
        after the start never meet a layout: a run with one is static (`CoordinatorCore`
        refuses it elastic), and a static run takes no join once started."""
        return join_layout_problem(event, self.world_size)

    def _check_groups(self, event: Joined) -> str | None:
        """Why ``event``'s process-group declaration cannot be taken (None: it can)."""
        declared = declaration_of(event, self.world_size)
        if isinstance(declared, str):
            return declared
        if self.groups is None:
            return None
        where = declaration_mismatch(declared, self.groups)
        if where is None:
            return None
        return (
            f"rank {event.rank} declares other process groups than rank {self.groups_rank}: "
            f"{where}; rank {event.rank} declares {describe(declared)}, rank "
            f"{self.groups_rank} declares {describe(self.groups)}"
        )

    def admit(self, event: Joined) -> None:
        """Take a join `check_join` accepted; the first one fixes the reference model."""
        if self.reference is None:
            self.reference = event.signature
            self.reference_rank = event.rank
        if self.groups is None:
            declared = declaration_of(event, self.world_size)
            assert not isinstance(declared, str), "admit() takes only joins check_join took"
            self.groups, self.groups_rank = declared, event.rank
        self._addresses[event.rank] = event.address
        self._joins[event.rank] = event

    def remove(self, rank: int) -> None:
        """``rank`` is gone; it stays a member of the current epoch until the next one."""
        del self._addresses[rank]
        self._joins.pop(rank, None)

    # ------------------------------------------------------------------- epochs

    def resume_from(self, epoch: int) -> None:
        """Restarted workers took part in ``epoch``: the next epoch comes after it."""
        self.epoch = max(self.epoch, epoch)

    def open_epoch(self, step: int, members: tuple[int, ...], reason: str) -> Opening:
        """Open the next epoch: ``members`` train together from step ``step`` on."""
        first = self.epoch == 0 or not self._history
        self.epoch += 1
        self.members = members
        if first and len(members) == self.world_size:
            ring = self.ring
        else:
            ring = tuple(range(len(members)))
        fold = all(r in self._joins and self._joins[r].fold for r in members)
        self._history.append(EpochRecord(self.epoch, step, members, reason))
        return Opening(first, ring, fold)

    def hold(self, step: int, reason: str) -> None:
        """Too few remain: an epoch of the survivors that only waits, to resume at ``step``."""
        self.epoch += 1
        self.members = self.survivors()
        self._history.append(EpochRecord(self.epoch, step, self.members, f"hold: {reason}"))
