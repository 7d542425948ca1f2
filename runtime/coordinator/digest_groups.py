"""Digests folded by host, and the flat verdict on them: C-DDP-001 through the coordinator tree.

A host's sub-coordinator groups its members' digests of a step by the state they hold
(`fold_digests`: one `DigestGroup` per distinct digest, algorithm and per-tensor digests, with
the ranks that hold it), so the root receives one group per host when the host agrees with
itself. The root commits at once when every group of every host holds one digest of one
algorithm (`agreed`); otherwise it expands the groups back into one report per rank
(`expand`) and asks the flat coordinator's `digest_verdict`, so a divergence is named as the
flat coordinator names it: the step, the ranks by state, the first tensor that differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from paramsync.runtime.coordinator.commits import TensorNames, Verdict, digest_verdict
from paramsync.runtime.protocol.messages import Digest, DigestGroup

__all__ = ["unfoldable", "fold_digests", "agreed", "expand", "tree_verdict"]


def unfoldable(report: Digest) -> str | None:
    """Why a host cannot fold ``report`` (None: it can): per-tensor digests given as pairs
    of different sizes do not pack into one group's bytes."""
    if report.packed is not None or not report.tensor_digests:
        return None
    sizes = {len(digest) for _, digest in report.tensor_digests}
    if len(sizes) == 1 and 0 not in sizes:
        return None
    return (
        f"step {report.step}: rank {report.rank}'s per-tensor digests have sizes "
        f"{sorted(sizes)} bytes, which a host coordinator cannot pack into one group "
        "(every per-tensor digest of a rank must have one size, 1 to 64 bytes)"
    )


def fold_digests(
    reports: Mapping[int, Digest], names: TensorNames, last_listed: tuple[str, ...] | None
) -> tuple[list[DigestGroup], tuple[str, ...] | None]:
    """Group ``reports`` (rank -> its digest, each `unfoldable`-checked, packed ones named in
    ``names``) by the state they hold, ranks ascending in each group; a group lists its
    tensor names unless they are ``last_listed``. Returns the groups and the names listed
    last after them."""
    by_state: dict[tuple[bytes, str, bytes, tuple[str, ...]], list[int]] = {}
    for rank in sorted(reports):
        report = reports[rank]
        if report.packed is not None:
            listed = names.get(rank)
            assert listed is not None, "take_step_end named every packed digest"
            key = (report.digest, report.algorithm, report.packed, listed)
        else:
            pairs = report.tensor_digests
            key = (
                report.digest,
                report.algorithm,
                b"".join(digest for _, digest in pairs),
                tuple(name for name, _ in pairs),
            )
        holders = by_state.get(key)
        if holders is None:
            by_state[key] = [rank]
        else:
            holders.append(rank)
    groups: list[DigestGroup] = []
    for (digest, algorithm, packed, tensor_names), ranks in by_state.items():
        lists = tensor_names != last_listed
        groups.append((tuple(ranks), digest, algorithm, packed, lists, tensor_names))
        last_listed = tensor_names
    return groups, last_listed


def agreed(groups: Iterable[DigestGroup]) -> bool:
    """Whether every group holds one digest of one algorithm (the step commits)."""
    first: tuple[bytes, str] | None = None
    for group in groups:
        state = (group[1], group[2])
        if first is None:
            first = state
        elif state != first:
            return False
    return True


def expand(
    step: int, epoch: int, groups: Iterable[tuple[DigestGroup, tuple[str, ...]]]
) -> tuple[dict[int, Digest], TensorNames]:
    """One `Digest` per rank of ``groups`` (each with the tensor names it stands for), named
    in a fresh `TensorNames`: the flat coordinator's view of the step's digests."""
    reports: dict[int, Digest] = {}
    names = TensorNames()
    for (ranks, digest, algorithm, packed, _, _), tensor_names in groups:
        for rank in ranks:
            report = Digest(rank, step, digest, (), epoch, packed, tensor_names, "", algorithm)
            names.take(report, epoch)
            reports[rank] = report
    return reports, names


def tree_verdict(
    step: int, epoch: int, groups: list[tuple[DigestGroup, tuple[str, ...]]], members: int
) -> Verdict:
    """The flat coordinator's verdict on the step, from every host's groups: commit at once
    when they agree, else `digest_verdict` on the expanded reports (no resync: the tree
    stops the run on a divergence)."""
    if agreed(group for group, _ in groups):
        return Verdict()
    reports, names = expand(step, epoch, groups)
    return digest_verdict(step, reports, members, names, resync=False)
