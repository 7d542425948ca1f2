"""Before a 3D run starts: every rank must declare the same layout, model and pipeline schedule.

A rank started with another ``ParallelismConfig`` (another pp size, another schedule, another
micro-batch count) or another model would build other groups and other action lists: its peers
would hang in a group that never forms, or swap tensors. `check_layout_agreement` all-gathers, over
the world, two SHA-256 digests of what each rank declares: its layout (the mesh, every
`ParallelismConfig` field that changes the arithmetic, the model's shape) and its pipeline
schedule (`paramsync.runtime.parallel.schedules.schedule_digest`, every rank's action list), and
every rank raises the same `LayoutDisagreement` naming which of the two differs and the ranks on
each side. It is the in-band form of the coordinator's layout agreement at the join
(`paramsync.runtime.coordinator.layouts`), for runs without a coordinator.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import cbor2
import torch

from paramsync.actors.parallel.replica_check import digest_tensor
from paramsync.runtime.collectives.ring import all_gather
from paramsync.runtime.errors import ConfigError
from paramsync.runtime.transport.base import Transport

__all__ = ["LayoutDisagreement", "check_layout_agreement", "layout_digest"]


class LayoutDisagreement(ConfigError):
    """The ranks of a run declare different layouts or schedules."""

    def __init__(self, message: str, *, what: str, ranks: list[list[int]]) -> None:
        super().__init__(message)
        self.what = what
        self.ranks = ranks
        """World ranks grouped by what they declare (rank 0's group first)."""


def layout_digest(declared: Mapping[str, Any]) -> bytes:
    """SHA-256 of the canonical CBOR of ``declared`` (plain values: ints, strings, bools, lists,
    maps)."""
    return hashlib.sha256(cbor2.dumps(dict(declared), canonical=True)).digest()


async def check_layout_agreement(world: Transport, layout: bytes, schedule: bytes) -> None:
    """Raise `LayoutDisagreement` on every rank unless all ranks of ``world`` gave the same
    ``layout`` and ``schedule`` digests (32 bytes each). Collective over the world."""
    if world.world_size == 1:
        return
    mine = torch.cat([digest_tensor(layout), digest_tensor(schedule)])
    rows = await all_gather(world, mine)
    half = digest_tensor(layout).numel()
    for what, columns in (("layout", slice(0, half)), ("pipeline schedule", slice(half, None))):
        classes: dict[bytes, list[int]] = {}
        for rank in range(world.world_size):
            key = rows[rank, columns].numpy().tobytes()
            classes.setdefault(key, []).append(rank)
        if len(classes) > 1:
            ranks = list(classes.values())
            sides = "; ".join(f"ranks {members}" for members in ranks)
            raise LayoutDisagreement(
                f"the ranks declare {len(ranks)} different {what}s ({sides} agree among "
                f"themselves): start every rank with the same ParallelismConfig and model",
                what=what,
                ranks=ranks,
            )
