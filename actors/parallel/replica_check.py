"""C-DDP-001 generalized to 3D parallelism, checked in band over the dp group.

Under dp x tp x pp every (tp, pp) coordinate of the device mesh is one *shard* of the model, and
the dp group of a rank holds every replica of that shard. After each optimizer step all of them
must hold bitwise identical weights and optimizer state. `check_shard_replicas` all-gathers each
replica's 128-bit state digest (`paramsync.actors.state.digest`) over the dp group; on a mismatch it
all-gathers the per-tensor digests too, and every replica raises the same
`ShardReplicasDiverged`, naming the shard (``tp=…, pp=…``), the step, the world ranks that hold
each distinct state and the first tensor that differs. Every member calls it at the same step
(it is a collective), and every member takes the same branch, since all see the same digests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from paramsync.actors.state.digest import StateDigest
from paramsync.runtime.collectives.groups import ProcessGroup
from paramsync.runtime.collectives.ring import all_gather
from paramsync.runtime.errors import StateDiverged
from paramsync.runtime.transport.base import Transport

__all__ = ["ShardReplicasDiverged", "check_shard_replicas", "digest_tensor"]


class ShardReplicasDiverged(StateDiverged, RuntimeError):
    """The replicas of one (tp, pp) shard hold different training states: a `StateDiverged`
    whose ``ranks`` are world ranks grouped by the state they hold (the group of dp rank 0
    first), with the shard's ``tp`` and ``pp``."""

    def __init__(
        self,
        message: str,
        *,
        tp: int,
        pp: int,
        step: int,
        ranks: list[list[int]],
        first_tensor: str | None = None,
    ) -> None:
        super().__init__(message, step=step, ranks=ranks, first_tensor=first_tensor)
        self.tp, self.pp = tp, pp


def digest_tensor(data: bytes) -> torch.Tensor:
    """Bytes (a digest, a multiple of 8 long) as an int64 tensor the collectives carry."""
    if len(data) % 8:
        data = data + bytes(8 - len(data) % 8)
    return torch.frombuffer(bytearray(data), dtype=torch.int64).clone()


def _world_ranks(group: Transport) -> list[int]:
    if isinstance(group, ProcessGroup):
        return list(group.world_ranks)
    return list(range(group.world_size))


async def check_shard_replicas(
    dp_group: Transport | None,
    digest: StateDigest,
    *,
    tp: int,
    pp: int,
    step: int,
    describe: Callable[[str], str] = str,
) -> None:
    """Compare this replica's ``digest`` with its dp group's; raise `ShardReplicasDiverged`
    (on every member) when they differ. ``describe`` turns a digest entry's name into the name
    the error shows (the dense model's parameter name, say). Nothing to compare in a group of
    one."""
    if dp_group is None or dp_group.world_size == 1:
        return
    gathered = await all_gather(dp_group, digest_tensor(digest.digest))
    rows = [bytes(row.numpy().tobytes()) for row in gathered]
    if len(set(rows)) == 1:
        return
    world = _world_ranks(dp_group)
    classes: dict[bytes, list[int]] = {}
    for rank, row in zip(world, rows, strict=True):
        classes.setdefault(row, []).append(rank)
    ranks = list(classes.values())
    first_tensor, described = await _first_differing_tensor(dp_group, digest, describe)
    groups = "; ".join(f"ranks {members}" for members in ranks)
    raise ShardReplicasDiverged(
        f"C-DDP-001: the replicas of shard tp={tp}, pp={pp} diverged after step {step}: "
        f"{len(ranks)} different states ({groups} agree among themselves); "
        f"first differing tensor: {described}",
        tp=tp,
        pp=pp,
        step=step,
        ranks=ranks,
        first_tensor=first_tensor,
    )


async def _first_differing_tensor(
    dp_group: Transport, digest: StateDigest, describe: Callable[[str], str]
) -> tuple[str | None, str]:
    """The name of the first tensor whose digest is not the same on every replica (None when
    no tensor is to blame), and the words the error says for it."""
    packed = digest_tensor(digest.packed)
    sizes = await all_gather(dp_group, torch.tensor([packed.numel()], dtype=torch.int64))
    if len(set(sizes.reshape(-1).tolist())) != 1:
        return None, "the replicas hold different numbers of tensors"
    everyone = await all_gather(dp_group, packed)
    width = 16 // 8  # a 128-bit digest is two int64s
    for index, name in enumerate(digest.names):
        column = everyone[:, index * width : (index + 1) * width]
        if not bool((column == column[0]).all()):
            return describe(name), describe(name)
    return None, "none of the tensors (the parameter-group settings or scheduler differ)"
