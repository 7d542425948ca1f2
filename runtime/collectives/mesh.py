"""A device mesh: the world's ranks laid out on named dimensions, a process group along each.

The ordering rule (the only one): ranks fill the mesh in **row-major order, the last named
dimension varying fastest**. With dimensions ``names = (d0, ..., dk)`` and sizes ``(s0, ..., sk)``,
rank r has coordinates ``(c0, ..., ck)`` where

    r = c0 * (s1 * ... * sk) + c1 * (s2 * ... * sk) + ... + ck

as in ``torch.distributed.device_mesh`` (a row-major ``arange(world).view(sizes)``) and in
Megatron's default order, where tp varies fastest, then dp, then pp: ``("pp", "dp", "tp")``.
The group of rank r along dimension d holds the ranks whose coordinates equal r's on every other
dimension. Megatron's parallel_state docstring, 16 ranks with tp=2 and pp=4 (so dp=2), follows:
tp groups [0, 1], [2, 3], ...; dp groups [0, 2], [1, 3], [4, 6], [5, 7], ...; pp groups
[0, 4, 8, 12], [1, 5, 9, 13], ... (`mesh_groups((4, 2, 2), ("pp", "dp", "tp"), "dp")`).

`mesh_groups` and `mesh_coordinates` are pure (`paramsync.runtime.collectives.mesh_layout`,
re-exported here); `init_device_mesh` creates the groups (every rank of the world calls it alike: it
calls `new_group` for every group of every dimension, in names order and in `mesh_groups` order).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import trio

from paramsync.runtime.collectives.mesh_layout import (
    check_layout,
    mesh_coordinates,
    mesh_groups,
    mesh_rank,
)
from paramsync.runtime.errors import CollectiveError
from paramsync.runtime.transport.base import Transport

if TYPE_CHECKING:  # the pure layout functions (the coordinator's) need no groups, nor torch
    from paramsync.runtime.collectives.groups import ProcessGroup

__all__ = [
    "DeviceMesh",
    "init_device_mesh",
    "mesh_coordinates",
    "mesh_rank",
    "mesh_groups",
]


class DeviceMesh:
    """This rank's place in the mesh and its process group along every dimension.

    Made by `init_device_mesh`. ``mesh.group("dp")`` is the group along dp that holds this rank;
    ``mesh.groups("dp")`` all the dp groups (world ranks). Close with ``await mesh.aclose()``.
    """

    @classmethod
    async def create(
        cls, world: Transport, shape: Mapping[str, int], **group_options: Any
    ) -> DeviceMesh:
        """``await DeviceMesh.create(world, {"pp": 4, "dp": 2, "tp": 2})``: `init_device_mesh`."""
        return await init_device_mesh(world, shape, **group_options)

    def __init__(
        self,
        world: Transport,
        names: tuple[str, ...],
        sizes: tuple[int, ...],
        groups: dict[str, ProcessGroup],
    ) -> None:
        self.world = world
        self.names = names
        self.sizes = sizes
        self.rank = world.rank
        self.coordinates = mesh_coordinates(world.rank, sizes)
        self._groups = groups

    @property
    def shape(self) -> dict[str, int]:
        """Dimension name -> size, in order."""
        return dict(zip(self.names, self.sizes, strict=True))

    def coordinate(self, dim: str) -> int:
        """This rank's coordinate along ``dim`` (its rank within ``group(dim)``)."""
        return self.coordinates[self._axis(dim)]

    def group(self, dim: str) -> ProcessGroup:
        """This rank's process group along ``dim``."""
        self._axis(dim)
        return self._groups[dim]

    def groups(self, dim: str) -> list[list[int]]:
        """All the groups along ``dim``, as world ranks (`mesh_groups`)."""
        return mesh_groups(self.sizes, self.names, dim)

    def _axis(self, dim: str) -> int:
        if dim not in self.names:
            raise CollectiveError(f"the mesh has no dimension {dim!r}; it has {list(self.names)}")
        return self.names.index(dim)

    async def aclose(self) -> None:
        """Close every group of this rank (not the world)."""
        for group in self._groups.values():
            await group.aclose()

    async def __aenter__(self) -> DeviceMesh:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"DeviceMesh({self.shape}, rank {self.rank} at {self.coordinates})"


async def init_device_mesh(
    world: Transport,
    names: Sequence[str] | Mapping[str, int],
    sizes: Sequence[int] | None = None,
    **group_options: Any,
) -> DeviceMesh:
    """Lay ``world``'s ranks out on a mesh and create this rank's group along each dimension.

    ``init_device_mesh(world, ("pp", "dp", "tp"), (4, 2, 2))`` or
    ``init_device_mesh(world, {"pp": 4, "dp": 2, "tp": 2})``. Every rank of ``world`` calls it
    alike (collective, like `new_group`); ``group_options`` go to `new_group`. The sizes must
    multiply to the world size.
    """
    if isinstance(names, Mapping):
        if sizes is not None:
            raise CollectiveError("pass the mesh as a mapping of sizes or as names and sizes")
        sizes = tuple(names.values())
        names = tuple(names)
    if sizes is None:
        raise CollectiveError("init_device_mesh needs the sizes of its dimensions")
    sizes_t, names_t = check_layout(sizes, names)
    if math.prod(sizes_t) != world.world_size:
        raise CollectiveError(
            f"a mesh of {dict(zip(names_t, sizes_t, strict=True))} holds {math.prod(sizes_t)} "
            f"ranks, the world has {world.world_size}"
        )
    from paramsync.runtime.collectives.groups import new_group

    groups: dict[str, ProcessGroup] = {}
    try:
        for dim in names_t:
            for ranks in mesh_groups(sizes_t, names_t, dim):
                group = await new_group(world, ranks, **group_options)
                if group is not None:
                    groups[dim] = group
    except BaseException:
        with trio.CancelScope(shield=True):
            for group in groups.values():
                await group.aclose()
        raise
    return DeviceMesh(world, names_t, sizes_t, groups)
