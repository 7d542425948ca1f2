"""Device meshes: the ordering rule against Megatron's golden case and torch's row-major
layout, partition and orthogonality of the groups along every dimension, and meshes built over
both transports whose groups all-reduce along every dimension at once."""

from __future__ import annotations

import math

import pytest
import torch
import trio
from conftest import GROUP_KINDS, open_group, run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

from paramsync.runtime.collectives.mesh import (
    DeviceMesh,
    init_device_mesh,
    mesh_coordinates,
    mesh_groups,
    mesh_rank,
)
from paramsync.runtime.collectives.ring import all_reduce
from paramsync.runtime.errors import CollectiveError
from paramsync.runtime.transport.base import Transport

MEGATRON = ((4, 2, 2), ("pp", "dp", "tp"))
"""16 ranks, tp=2, pp=4 (so dp=2), Megatron's default order (tp fastest, then dp, then pp)."""


def test_megatron_golden_case() -> None:
    """Megatron-LM's parallel_state.initialize_model_parallel docstring, 16 GPUs, tp=2, pp=4."""
    sizes, names = MEGATRON
    assert mesh_groups(sizes, names, "dp") == [
        [0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]
    ]  # fmt: skip
    assert mesh_groups(sizes, names, "tp") == [
        [0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]
    ]  # fmt: skip
    assert mesh_groups(sizes, names, "pp") == [
        [0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]
    ]  # fmt: skip
    assert mesh_coordinates(13, sizes) == (3, 0, 1)  # pp 3, dp 0, tp 1
    assert mesh_rank((3, 0, 1), sizes) == 13


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[str, ...]]:
    dims = draw(st.integers(1, 4))
    sizes = tuple(draw(st.lists(st.integers(1, 4), min_size=dims, max_size=dims)))
    names = tuple(draw(st.permutations(["pp", "dp", "tp", "cp"]))[:dims])
    return sizes, names


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_mesh_groups_partition_the_world_and_are_orthogonal(
    layout: tuple[tuple[int, ...], tuple[str, ...]],
) -> None:
    sizes, names = layout
    world = math.prod(sizes)
    grid = torch.arange(world).view(sizes)  # torch's DeviceMesh layout: row-major
    by_dim = {dim: mesh_groups(sizes, names, dim) for dim in names}
    for axis, dim in enumerate(names):
        groups = by_dim[dim]
        # the same groups as torch's row-major layout, in the same order
        expected = grid.movedim(axis, -1).reshape(-1, sizes[axis]).tolist()
        assert groups == expected
        # a partition: every rank exactly once, each group of the dimension's size
        flat = sorted(rank for group in groups for rank in group)
        assert flat == list(range(world))
        assert all(len(group) == sizes[axis] for group in groups)
        for group in groups:
            for position, rank in enumerate(group):
                assert mesh_coordinates(rank, sizes)[axis] == position
    for rank in range(world):
        assert mesh_rank(mesh_coordinates(rank, sizes), sizes) == rank
        mine = {dim: next(set(g) for g in by_dim[dim] if rank in g) for dim in names}
        for a in names:
            for b in names:
                if a != b:  # orthogonal: two dimensions' groups of a rank meet only in it
                    assert mine[a] & mine[b] == {rank}


def test_layout_errors() -> None:
    with pytest.raises(CollectiveError, match="no dimension 'ep'"):
        mesh_groups((2, 2), ("dp", "tp"), "ep")
    with pytest.raises(CollectiveError, match="repeat a name"):
        mesh_groups((2, 2), ("dp", "dp"), "dp")
    with pytest.raises(CollectiveError, match="one size per dimension"):
        mesh_groups((2,), ("dp", "tp"), "dp")
    with pytest.raises(CollectiveError, match="positive int size"):
        mesh_groups((2, 0), ("dp", "tp"), "dp")
    with pytest.raises(CollectiveError, match="not in a mesh of 4 ranks"):
        mesh_coordinates(4, (2, 2))


def test_mesh_size_must_match_the_world() -> None:
    async def main() -> None:
        async with open_group("inproc", 4) as world:
            with pytest.raises(CollectiveError, match="holds 6 ranks, the world has 4"):
                await init_device_mesh(world[0], ("dp", "tp"), (3, 2))

    trio.run(main)


CASES = {
    "inproc": ((2, 2, 2), ("pp", "dp", "tp")),
    "tcp": ((2, 2), ("dp", "tp")),
    "torch": ((2, 2, 2), ("pp", "dp", "tp")),
}


@pytest.mark.parametrize("kind", GROUP_KINDS)
def test_mesh_groups_all_reduce_along_every_dimension_at_once(kind: str) -> None:
    sizes, names = CASES[kind]

    async def rank_fn(world: Transport) -> dict[str, tuple]:
        if kind == "tcp":
            mesh = await init_device_mesh(world, names, sizes, shared_memory=False)
        else:
            mesh = await DeviceMesh.create(world, dict(zip(names, sizes, strict=True)))
        assert isinstance(mesh, DeviceMesh)
        assert mesh.shape == dict(zip(names, sizes, strict=True))
        assert mesh.groups(names[-1]) == mesh_groups(sizes, names, names[-1])
        out: dict[str, tuple] = {}

        async def along(dim: str) -> None:
            group = mesh.group(dim)
            assert group.rank == mesh.coordinate(dim)
            tensor = torch.full((20000,), world.rank, dtype=torch.int64)
            await all_reduce(group, tensor)
            out[dim] = (int(tensor[0]), bool((tensor == tensor[0]).all()), group.world_ranks)

        async with mesh:
            async with trio.open_nursery() as nursery:
                for dim in names:
                    nursery.start_soon(along, dim)
        return out

    async def main() -> list:
        async with open_group(kind, math.prod(sizes)) as world:
            return await run_ranks(world, rank_fn)

    results = trio.run(main)
    for rank, out in enumerate(results):
        for dim in names:
            group = next(g for g in mesh_groups(sizes, names, dim) if rank in g)
            total, uniform, world_ranks = out[dim]
            assert uniform and total == sum(group)
            assert list(world_ranks) == group
