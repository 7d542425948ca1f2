"""Step ends: the apply barrier, digests and step_done, the digest verdict and the commit.

Every member ends each step with a report: ``reduced`` first in elastic runs (the apply
barrier: once all reduced, ``apply``), then a digest on digest steps (C-DDP-001: every
member's parameters and optimizer state hash the same) or ``step_done`` on the others.
:class:`Commits` checks each report against the step's :class:`StepState`, and once all are
in, :func:`digest_verdict` says whether the step commits, commits after a resync of a
minority, or stops the run naming the ranks and the first tensor that differs. In a run
whose ranks declared a parallel layout (`paramsync.runtime.coordinator.layouts`),
:func:`sharded_verdict` compares each rank only with the data-parallel replicas of its (tp, pp, ...)
shard and names the shard too: different shards hold different weights by design.
:func:`divergence_of` reads a verdict's abort reason back (the step, the ranks grouped by state, the
first tensor), which is how a worker raises a `paramsync.runtime.errors.StateDiverged` from the
reason it was sent.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from paramsync.runtime.coordinator.events import Resync, first_tensor_difference
from paramsync.runtime.coordinator.layouts import Shards
from paramsync.runtime.coordinator.step_state import StepState
from paramsync.runtime.protocol.messages import Commit, Digest, StepDone, packed_size

__all__ = [
    "CommitRecord",
    "TensorNames",
    "Verdict",
    "digest_verdict",
    "divergence_of",
    "mixed_algorithms",
    "sharded_verdict",
    "Commits",
]


@dataclass(frozen=True)
class CommitRecord:
    """Step ``step`` committed in ``epoch`` by ``members``, with digests from ``digests``."""

    step: int
    epoch: int
    members: tuple[int, ...]
    digests: tuple[int, ...]


class TensorNames:
    """Per member: the names of its packed per-tensor digests, as last listed in the epoch (a
    worker lists them once, then sends only the packed bytes)."""

    def __init__(self) -> None:
        self._names: dict[int, tuple[str, ...]] = {}

    def get(self, rank: int) -> tuple[str, ...] | None:
        return self._names.get(rank)

    def take(self, event: Digest, epoch: int) -> str | None:
        """Keep the names of ``event``'s packed digests (listed, or the rank's last ones this
        epoch); why not, if there are none or they do not fit (None: kept)."""
        rank = event.rank
        names = event.names if event.names is not None else self._names.get(rank)
        if names is None:
            return (
                f"step {event.step}: rank {rank} sent packed per-tensor digests without their "
                f"names, and listed none before in epoch {epoch}"
            )
        assert event.packed is not None
        if packed_size(event.packed, len(names)) is None:
            return (
                f"step {event.step}: rank {rank} sent {len(event.packed)} bytes of per-tensor "
                f"digests for the {len(names)} tensors it listed"
            )
        self._names[rank] = names
        return None


@dataclass(frozen=True)
class Verdict:
    """What a digest step's digests decide: commit (after ``resyncs``, if any: one per shard
    whose minority diverged), or stop the run (``abort``: the reason)."""

    resyncs: tuple[Resync, ...] = ()
    abort: str | None = None

    @property
    def resync(self) -> Resync | None:
        """The first resync (a run without layouts has at most one)."""
        return self.resyncs[0] if self.resyncs else None


def _tensor_report(
    reports: Mapping[int, Digest], names: TensorNames, ref: int, ranks: Sequence[int]
) -> str:
    """Where each of ``ranks`` (at most four named) first differs from rank ``ref``."""

    def pairs(rank: int) -> tuple[tuple[str, bytes], ...]:
        return reports[rank].pairs(names.get(rank))

    shown = [
        f"rank {r} first differs from rank {ref} at "
        + first_tensor_difference(pairs(r), pairs(ref))
        for r in ranks[:4]
    ]
    if len(ranks) > 4:
        shown.append(f"{len(ranks) - 4} more")
    return "; ".join(shown)


def digest_verdict(
    step: int,
    reports: Mapping[int, Digest],
    members: int,
    names: TensorNames,
    *,
    resync: bool,
    shard: str | None = None,
) -> Verdict:
    """The verdict on step ``step``'s digests ``reports`` of all ``members`` members.

    Digests of different algorithms are not compared: the step is refused naming each
    algorithm's ranks (`mixed_algorithms`). All equal: commit. A strict majority agrees:
    resync the others from the lowest rank of the majority (``resync``), or abort naming the
    diverging ranks. No majority: abort listing
    every group. An abort names, for each diverging rank, the first tensor that differs.
    ``shard``: the reports are one shard's replicas, named so in an abort (``(tp=1, pp=0)``).
    """
    mixed = mixed_algorithms(step, reports)
    if mixed is not None:
        return Verdict(abort=mixed)
    counts = Counter(d.digest for d in reports.values())
    if len(counts) == 1:
        return Verdict()
    where = f"step {step}" if shard is None else f"step {step}, shard {shard}"
    digests = "parameter digests" if shard is None else "the dp replicas' parameter digests"
    top, votes = counts.most_common(1)[0]
    if votes * 2 > members:
        good = sorted(r for r, d in reports.items() if d.digest == top)
        bad = sorted(r for r, d in reports.items() if d.digest != top)
        if resync:
            return Verdict(resyncs=(Resync(step, good[0], tuple(bad)),))
        head = f"{where}: {digests} diverged: ranks {bad} differ from the majority (ranks {good})"
        return Verdict(abort=f"{head}; {_tensor_report(reports, names, good[0], bad)}")
    groups: dict[bytes, list[int]] = {}
    for rank in sorted(reports):
        groups.setdefault(reports[rank].digest, []).append(rank)
    listing = ", ".join(f"ranks {ranks} have {d.hex()[:12]}" for d, ranks in groups.items())
    ref = min(reports)
    others = [r for r in sorted(reports) if reports[r].digest != reports[ref].digest]
    return Verdict(
        abort=f"{where}: {digests} diverged with no majority: {listing}; "
        f"{_tensor_report(reports, names, ref, others)}"
    )


_WHERE = (
    r"step (?P<step>\d+)(?:, shard [^:]*)?: "
    r"(?:parameter digests|the dp replicas' parameter digests)"
)
_MAJORITY = re.compile(
    _WHERE + r" diverged: ranks \[(?P<bad>[\d, ]*)\] differ from the majority "
    r"\(ranks \[(?P<good>[\d, ]*)\]\)"
)
_NO_MAJORITY = re.compile(
    _WHERE + r" diverged with no majority: (?P<listing>ranks \[[\d, ]*\] have [0-9a-f]+"
    r"(?:, ranks \[[\d, ]*\] have [0-9a-f]+)*)"
)
_GROUP = re.compile(r"ranks \[(?P<ranks>[\d, ]*)\] have")
_FIRST_TENSOR = re.compile(
    r"first differs from rank \d+ at tensor (?P<name>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")"
)


def _ranks(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item.strip()]


def divergence_of(reason: str) -> tuple[int, list[list[int]], str | None] | None:
    """What a `digest_verdict` (or `sharded_verdict`) abort in ``reason`` says: the step, the
    ranks grouped by the state they hold (the majority, or the group of the lowest rank, first)
    and the first differing tensor's name (None when the reason names none, or clipped it).
    None when ``reason`` holds no divergence. A sharded abort of several shards gives the first
    shard's groups."""
    found = _MAJORITY.search(reason)
    if found is not None:
        groups = [_ranks(found["good"]), _ranks(found["bad"])]
    else:
        found = _NO_MAJORITY.search(reason)
        if found is None:
            return None
        groups = [_ranks(group["ranks"]) for group in _GROUP.finditer(found["listing"])]
    first_tensor = None
    named = _FIRST_TENSOR.search(reason, found.end())
    if named is not None:
        try:
            first_tensor = ast.literal_eval(named["name"])
        except (ValueError, SyntaxError):
            first_tensor = None
    return int(found["step"]), groups, first_tensor


def mixed_algorithms(step: int, reports: Mapping[int, Digest]) -> str | None:
    """Why ``reports`` cannot be compared: they name different digest algorithms (one line
    naming each algorithm's ranks); None when they all name the same one."""
    ranks: dict[str, list[int]] = {}
    for rank in sorted(reports):
        ranks.setdefault(reports[rank].algorithm, []).append(rank)
    if len(ranks) < 2:
        return None
    listing = "; ".join(
        f"ranks {members} report {algorithm}" if algorithm else f"ranks {members} name no algorithm"
        for algorithm, members in ranks.items()
    )
    return (
        f"step {step}: the ranks computed their state digests with different algorithms, "
        f"which cannot be compared: {listing} (choose one for every rank: "
        f"TrainerOptions.state_digest, or PARAMSYNC_STATE_DIGEST for the torch backend)"
    )


def sharded_verdict(
    step: int,
    reports: Mapping[int, Digest],
    shards: Shards,
    names: TensorNames,
    *,
    resync: bool,
) -> Verdict:
    """C-DDP-001 per shard: each rank's digest is compared with the other replicas of its
    shard only (`digest_verdict` within each shard, majorities counted there). Any shard that
    cannot commit stops the run, naming every such shard and its ranks; otherwise the shards
    whose minority diverged are resynced (``resync``), each from a replica of its own.
    Reports of different algorithms are refused first, across all shards (`mixed_algorithms`)."""
    mixed = mixed_algorithms(step, reports)
    if mixed is not None:
        return Verdict(abort=mixed)
    by_shard: dict[int, dict[int, Digest]] = {}
    for rank, report in reports.items():
        by_shard.setdefault(shards.of(rank), {})[rank] = report
    resyncs: list[Resync] = []
    aborts: list[str] = []
    for shard in sorted(by_shard):
        replicas = by_shard[shard]
        verdict = digest_verdict(
            step, replicas, len(replicas), names, resync=resync, shard=shards.label(shard)
        )
        resyncs += verdict.resyncs
        if verdict.abort is not None:
            aborts.append(verdict.abort)
    if aborts:
        return Verdict(abort="; ".join(aborts))
    return Verdict(resyncs=tuple(resyncs))


class Commits:
    """The run's step ends and commits: checks each end-of-step report, decides and records
    each commit. ``digest_interval``: steps with ``step % digest_interval == 0`` end with
    digests; ``resync``: diverged digests with a majority resync the minority."""

    def __init__(self, *, digest_interval: int, resync: bool, elastic: bool) -> None:
        self.interval = digest_interval
        self.resync = resync
        self.elastic = elastic
        self.last: CommitRecord | None = None
        self.recovering = False
        """Whether the epoch's first commit is to be reported (it recovers from a change)."""
        self.names = TensorNames()
        self.shards: Shards | None = None
        """The shards of the run's parallel layout (None: no layout, every rank one shard)."""

    def new_epoch(self) -> None:
        """A new epoch (or a hold): the names of packed digests are listed again."""
        self.names = TensorNames()

    def is_digest_step(self, step: int) -> bool:
        return step % self.interval == 0

    def expects_digest(self, state: StepState) -> bool:
        """Whether ``state``'s step ends with digests (a digest step, or an epoch's check)."""
        return state.verifying or self.is_digest_step(state.step)

    def check_reduced(self, state: StepState, rank: int, step: int) -> str | None:
        """Why ``rank``'s ``reduced`` for ``step`` cannot be taken (None: it can)."""
        if not self.elastic:
            return f"rank {rank} sent reduced, but the run has no apply barrier"
        if step != state.step or state.verifying:
            return (
                f"rank {rank} sent reduced for step {step}, but the run is at step "
                f"{state.resume_step}"
            )
        if rank in state.reduced or state.applied:
            return f"step {step}: rank {rank} sent reduced twice"
        return None

    def check_step_end(self, state: StepState, event: Digest | StepDone) -> str | None:
        """Why ``event`` cannot end its rank's step, before its buckets are looked at."""
        rank, step = event.rank, event.step
        what = "a digest" if isinstance(event, Digest) else "step_done"
        if step != state.step:
            return f"rank {rank} sent {what} for step {step}, but the run is at step {state.step}"
        digest_step = self.expects_digest(state)
        if isinstance(event, Digest) != digest_step:
            expected = "a digest" if digest_step else "step_done"
            kind = "a digest step" if digest_step else "not a digest step"
            return (
                f"rank {rank} sent {what} for step {step}, which is {kind} "
                f"(digest_interval {self.interval}): expected {expected}"
            )
        if rank in state.done:
            return f"step {step}: rank {rank} finished the step twice"
        return None

    def take_step_end(self, state: StepState, event: Digest | StepDone, epoch: int) -> str | None:
        """Record ``event`` as its rank's step end once its buckets are closed; why not (the
        apply barrier is not passed, or packed digests have no names that fit)."""
        what = "a digest" if isinstance(event, Digest) else "step_done"
        if self.elastic and not state.applied:
            return f"step {event.step}: rank {event.rank} sent {what} before every member reduced"
        if isinstance(event, Digest) and event.packed is not None:
            unnamed = self.names.take(event, epoch)
            if unnamed is not None:
                return unnamed
        state.end(event.rank, event)
        return None

    def verdict(self, state: StepState, members: int) -> Verdict:
        """The verdict on ``state``'s digests, every member's in."""
        reports = {r: d for r, d in state.done.items() if isinstance(d, Digest)}
        if self.shards is not None:
            return sharded_verdict(state.step, reports, self.shards, self.names, resync=self.resync)
        return digest_verdict(state.step, reports, members, self.names, resync=self.resync)

    def commit(self, state: StepState, epoch: int, members: tuple[int, ...]) -> Commit:
        """Record the commit of ``state``'s step by ``members``; the message that says so."""
        self.last = CommitRecord(
            state.step,
            epoch,
            members,
            tuple(sorted(r for r, d in state.done.items() if isinstance(d, Digest))),
        )
        return Commit(state.step, epoch)

    @staticmethod
    def check_finish(
        state: StepState, rank: int, step: int, members: tuple[int, ...]
    ) -> str | None:
        """Why ``rank`` cannot finish the run at ``step`` (None: it can)."""
        if rank in state.finished:
            return f"rank {rank} finished the run twice"
        if step != state.step or state.verifying:
            return (
                f"rank {rank} finished the run at step {step}, but the run is at step "
                f"{state.resume_step}"
            )
        if state.started:
            return (
                f"rank {rank} finished the run at step {step}, but ranks "
                f"{state.active_ranks(members)} have started step {step}"
            )
        return None
