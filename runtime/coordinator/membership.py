"""Membership: who joined, who trains in the current epoch, and how epochs follow each other.

:class:`Membership` admits joins (checking the rank, its address and its model against the
reference signature), removes lost ranks, and opens epochs: the first one (a fresh start, or
a restart that elects the most advanced majority state as donor, :func:`resume_plan`), and
every later one after a loss, a join or a hold. Each epoch is kept as an :class:`EpochRecord`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from runtime.coordinator.events import signature_mismatch
from runtime.coordinator.group_decl import (
    Declaration,
    declaration_mismatch,
    declaration_of,
    describe,
)
from runtime.errors import plain_or_quoted
from runtime.protocol.messages import Joined, Signature

__all__ = ["EpochRecord", "Opening", "ResumePlan", "resume_plan", "Membership"]


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


@dataclass(frozen=True)
class ResumePlan:
    """Restarted workers resume at ``step``: ``donor`` sends its state to ``receivers``;
    ``epoch`` is the latest epoch any of them took part in."""

    step: int
    donor: int
    receivers: tuple[int, ...]
    epoch: int


def resume_plan(joins: Mapping[int, Joined]) -> ResumePlan | None:
    """Where the joined workers resume: None for a fresh run (every worker at step 0); else
    the newest step any reported, whose majority digest's lowest rank is the donor, and every
    rank behind it or with another digest receives its state."""
    top = max(j.step for j in joins.values())
    if top == 0:
        return None
    ahead = [r for r in sorted(joins) if joins[r].step == top]
    votes = Counter(joins[r].digest for r in ahead)
    best = max(votes.values())
    digest = next(joins[r].digest for r in ahead if votes[joins[r].digest] == best)
    donor = next(r for r in ahead if joins[r].digest == digest)
    receivers = tuple(r for r in sorted(joins) if joins[r].step != top or joins[r].digest != digest)
    return ResumePlan(top, donor, receivers, max(j.epoch for j in joins.values()))


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
        self.epoch = 0
        """The membership epoch (0 before the start; grows by one per membership change)."""
        self.members: tuple[int, ...] = ()
        """The current epoch's members by ring position."""
        self._addresses: dict[int, tuple[str, int]] = {}
        self._joins: dict[int, Joined] = {}
        self._history: list[EpochRecord] = []

    # ------------------------------------------------------------------- views

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

    def survivors(self) -> tuple[int, ...]:
        """The current epoch's members that are still joined, by ring position."""
        return tuple(r for r in self.members if r in self._addresses)

    def joiners(self) -> tuple[int, ...]:
        """Joined ranks that are not members of the current epoch, in join order."""
        return tuple(r for r in self._addresses if r not in self.members)

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
        return self._check_groups(event)

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
