"""How ranks fill a device mesh, as pure functions (no I/O, no trio): the coordinator and the
parallel layouts use them without the groups `paramsync.runtime.collectives.mesh` creates.

The ordering rule (the only one): ranks fill the mesh in **row-major order, the last named
dimension varying fastest** (see `paramsync.runtime.collectives.mesh`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from paramsync.runtime.errors import CollectiveError

__all__ = ["check_layout", "mesh_coordinates", "mesh_groups", "mesh_rank", "strides"]


def check_layout(
    sizes: Sequence[int], names: Sequence[str]
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(sizes, names)`` as tuples, or a `CollectiveError` naming what is wrong with them."""
    sizes, names = tuple(sizes), tuple(names)
    if len(sizes) != len(names) or not names:
        raise CollectiveError(
            f"a mesh needs one size per dimension name, got sizes {list(sizes)} for {list(names)}"
        )
    for name in names:
        if not isinstance(name, str) or not name:
            raise CollectiveError(f"mesh dimension names must be non-empty strings, got {name!r}")
    if len(set(names)) != len(names):
        raise CollectiveError(f"mesh dimension names {list(names)} repeat a name")
    for name, size in zip(names, sizes, strict=True):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise CollectiveError(
                f"mesh dimension {name!r} needs a positive int size, got {size!r}"
            )
    return sizes, names


def strides(sizes: Sequence[int]) -> list[int]:
    """How far apart, in ranks, two neighbours along each dimension are (row-major)."""
    return [math.prod(sizes[index + 1 :]) for index in range(len(sizes))]


def mesh_coordinates(rank: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """Rank ``rank``'s coordinates in a mesh of ``sizes`` (row-major, last varies fastest)."""
    total = math.prod(sizes)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < total:
        raise CollectiveError(f"rank {rank!r} is not in a mesh of {total} ranks")
    return tuple(
        (rank // stride) % size for stride, size in zip(strides(sizes), sizes, strict=True)
    )


def mesh_rank(coordinates: Sequence[int], sizes: Sequence[int]) -> int:
    """The rank at ``coordinates`` in a mesh of ``sizes`` (inverse of `mesh_coordinates`)."""
    if len(coordinates) != len(sizes) or not all(
        0 <= c < s for c, s in zip(coordinates, sizes, strict=True)
    ):
        raise CollectiveError(f"coordinates {list(coordinates)} are not in a mesh of {list(sizes)}")
    return sum(c * stride for c, stride in zip(coordinates, strides(sizes), strict=True))


def mesh_groups(sizes: Sequence[int], names: Sequence[str], dim: str) -> list[list[int]]:
    """Every group along dimension ``dim``: lists of ranks, each sorted, ordered by their lowest
    rank (the other coordinates in row-major order). Pure: no I/O."""
    sizes, names = check_layout(sizes, names)
    if dim not in names:
        raise CollectiveError(f"the mesh has no dimension {dim!r}; it has {list(names)}")
    axis = names.index(dim)
    stride = strides(sizes)[axis]
    groups = []
    for rank in range(math.prod(sizes)):
        if mesh_coordinates(rank, sizes)[axis] == 0:
            groups.append([rank + k * stride for k in range(sizes[axis])])
    return groups
