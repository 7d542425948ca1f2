"""Digests folded by host, and the flat verdict on them: C-DDP-001 through the coordinator tree.

A host's sub-coordinator sums its members' digests of a step up by the state they hold
(`summarize`: one `DigestGroup` per distinct digest and algorithm, with a `MEMBERS_MASK` of
the members that hold it), so the root receives one small group per host when the host agrees
with itself, and checks it with no per-rank work. The root commits at once when every group of
every host holds one digest of one algorithm. Otherwise it asks every host for its members'
per-tensor digests (`DigestQuery`); each answers with its `tensor_groups`, which the root
checks against the summary (`check_tensors`), expands back into one report per rank
(`expand`) and hands to the flat coordinator's `digest_verdict` (`tree_verdict`), so a
divergence is named as the flat coordinator names it: the step, the ranks by state, the first
tensor that differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from paramsync.runtime.coordinator.commits import TensorNames, Verdict, digest_verdict
from paramsync.runtime.protocol.messages import (
    Digest,
    DigestGroup,
    StepDone,
    TensorGroup,
    packed_size,
)

__all__ = [
    "unfoldable",
    "full_mask",
    "mask_positions",
    "summarize",
    "tensor_groups",
    "check_cover",
    "check_tensors",
    "expand",
    "tree_verdict",
]


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


# --------------------------------------------------------------------------- member masks


def _to_mask(bits: int, count: int) -> bytes:
    return bits.to_bytes((count + 7) // 8, "little")


def full_mask(count: int) -> bytes:
    """The mask of all ``count`` members of a host (`MEMBERS_MASK`)."""
    return _to_mask((1 << count) - 1, count)


def mask_positions(mask: bytes) -> list[int]:
    """The member positions set in ``mask``, ascending."""
    bits = int.from_bytes(mask, "little")
    return [i for i in range(bits.bit_length()) if bits >> i & 1]


def check_cover(masks: Sequence[bytes], count: int) -> str | None:
    """Why ``masks`` do not split a host's ``count`` members into non-empty disjoint groups
    that cover every one of them (None: they do). O(1) for one group."""
    whole = full_mask(count)
    if len(masks) == 1:
        return None if masks[0] == whole else "its group does not hold exactly its members"
    seen = 0
    for mask in masks:
        if len(mask) != len(whole):
            return f"a group's members mask has {len(mask)} bytes for {count} members"
        bits = int.from_bytes(mask, "little")
        if not bits or bits & seen:
            return "its groups are empty or share members"
        seen |= bits
    return None if seen == (1 << count) - 1 else "its groups do not cover its members"


# --------------------------------------------------------------------------- a host's side


def summarize(
    reports: Mapping[int, Digest | StepDone], members: Sequence[int]
) -> list[DigestGroup]:
    """``reports`` (rank -> its digest, one per member of ``members``, ascending) grouped by
    (digest, algorithm): a `DigestGroup` each, in the order of their first member."""
    bits: dict[tuple[bytes, str], int] = {}
    for position, rank in enumerate(members):
        report = reports[rank]
        assert isinstance(report, Digest), "a digest step's reports are digests"
        key = (report.digest, report.algorithm)
        bits[key] = bits.get(key, 0) | 1 << position
    count = len(members)
    return [(_to_mask(b, count), digest, algorithm) for (digest, algorithm), b in bits.items()]


def tensor_groups(
    reports: Mapping[int, Digest | StepDone], names: TensorNames, members: Sequence[int]
) -> list[TensorGroup]:
    """``reports`` (each `unfoldable`-checked, packed ones named in ``names``) grouped by the
    whole state they hold, per-tensor digests and names included: the answer to a
    `DigestQuery`."""
    bits: dict[tuple[bytes, str, bytes, tuple[str, ...]], int] = {}
    for position, rank in enumerate(members):
        report = reports[rank]
        assert isinstance(report, Digest), "a digest step's reports are digests"
        if report.packed is not None:
            listed = names.get(rank)
            assert listed is not None, "take_step_end named every packed digest"
            key = (report.digest, report.algorithm, report.packed, listed)
        else:
            pairs = report.tensor_digests
            packed = b"".join(digest for _, digest in pairs)
            key = (report.digest, report.algorithm, packed, tuple(name for name, _ in pairs))
        bits[key] = bits.get(key, 0) | 1 << position
    count = len(members)
    return [(_to_mask(b, count), *key) for key, b in bits.items()]


# --------------------------------------------------------------------------- the root's side


def check_tensors(
    groups: Sequence[TensorGroup], summary: Sequence[DigestGroup], count: int
) -> str | None:
    """Why a host's answer ``groups`` does not fit its ``summary`` of the step for its
    ``count`` members (None: it does): the groups split the members, their per-tensor digests
    fit their names, and each member holds the digest and algorithm its summary said."""
    why = check_cover([group[0] for group in groups], count)
    if why is not None:
        return why
    said = {(digest, algo): int.from_bytes(mask, "little") for mask, digest, algo in summary}
    for mask, digest, algorithm, tensors, names in groups:
        if packed_size(tensors, len(names)) is None:
            return f"its {len(tensors)} bytes of per-tensor digests do not fit {len(names)} names"
        bits = int.from_bytes(mask, "little")
        if bits & ~said.get((digest, algorithm), 0):
            return "its per-tensor digests do not match the digests it reported"
    return None


def expand(
    step: int, epoch: int, groups: Iterable[tuple[TensorGroup, Sequence[int]]]
) -> tuple[dict[int, Digest], TensorNames]:
    """One `Digest` per rank of ``groups`` (each with its host's members, ascending), named
    in a fresh `TensorNames`: the flat coordinator's view of the step's digests."""
    reports: dict[int, Digest] = {}
    names = TensorNames()
    for (mask, digest, algorithm, packed, tensor_names), members in groups:
        for position in mask_positions(mask):
            rank = members[position]
            report = Digest(rank, step, digest, (), epoch, packed, tensor_names, "", algorithm)
            names.take(report, epoch)
            reports[rank] = report
    return reports, names


def tree_verdict(
    step: int, epoch: int, groups: Iterable[tuple[TensorGroup, Sequence[int]]], members: int
) -> Verdict:
    """The flat coordinator's verdict on the step from every host's answer (no resync: the
    tree stops the run on a divergence)."""
    reports, names = expand(step, epoch, groups)
    return digest_verdict(step, reports, members, names, resync=False)
