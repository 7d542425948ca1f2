"""A worker's place in a 3D-parallel run, as it declares it to the coordinator at its join.

`parallel_layout` builds a `ParallelLayout` (declared in `paramsync.runtime.protocol.messages`,
where it travels as the join's ``layout`` field): the run's mesh, e.g. ``{"pp": 2, "dp": 2, "tp":
2}``, the worker's coordinates on it, which are its rank's under the mesh's one ordering rule
(row-major, the last named dimension fastest:
`paramsync.runtime.collectives.mesh.mesh_coordinates`), and the digest of the whole pipeline
schedule (every pipeline rank's action list), which the coordinator only compares as bytes. The
coordinator refuses a run whose ranks disagree on any of it and compares state digests within each
shard's dp replicas only (`paramsync.runtime.coordinator.layouts`).
"""

from __future__ import annotations

from collections.abc import Mapping

from paramsync.runtime.collectives.mesh_layout import mesh_coordinates
from paramsync.runtime.errors import CollectiveError
from paramsync.runtime.protocol.messages import DATA_PARALLEL_DIM, ParallelLayout

__all__ = ["ParallelLayout", "DATA_PARALLEL_DIM", "parallel_layout"]


def parallel_layout(
    rank: int, shape: Mapping[str, int], schedule_digest: bytes = b""
) -> ParallelLayout:
    """Rank ``rank``'s layout on the mesh ``shape`` (dimension name -> size, in the mesh's
    order), with the pipeline schedule's digest (empty: none). CollectiveError for a mesh
    without dimensions, a size that is not a positive int, or a rank outside the mesh."""
    names, sizes = tuple(shape), tuple(shape.values())
    if not names:
        raise CollectiveError("a parallel layout needs at least one mesh dimension")
    for name, size in shape.items():
        if not isinstance(name, str) or not name:
            raise CollectiveError(f"mesh dimension names must be non-empty strings, got {name!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise CollectiveError(
                f"mesh dimension {name!r} needs a positive int size, got {size!r}"
            )
    return ParallelLayout(names, sizes, mesh_coordinates(rank, sizes), bytes(schedule_digest))
