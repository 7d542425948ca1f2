"""How a flat tensor is cut among the ranks of a group, and the element types summed there.

Both the ring collectives (`paramsync.runtime.collectives.ring`) and the shared-memory plane
(`paramsync.runtime.transport.shm`) split a tensor into the same ``world_size`` contiguous segments
and average the same way; the plane's results are bitwise the ring's only because they share these
definitions. They live here, below both, so the transport layer never imports the collectives above
it.
"""

from __future__ import annotations

import torch

from paramsync.runtime.protocol.wire import DTYPE_TAGS

__all__ = ["SUPPORTED_DTYPES", "segment_bounds", "divide_in_place"]

SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(DTYPE_TAGS)
"""Element types the collectives reduce: every type the wire carries."""


def segment_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``world_size`` contiguous (start, stop) segments.

    The first ``numel % world_size`` segments hold one element more; any length works,
    including 0 and fewer elements than ranks.
    """
    base, extra = divmod(numel, world_size)
    bounds = []
    start = 0
    for index in range(world_size):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def divide_in_place(tensor: torch.Tensor, world_size: int) -> None:
    """Average in place: true division for floats, floor division for integers."""
    if tensor.is_floating_point():
        tensor.div_(world_size)
    else:
        tensor.div_(world_size, rounding_mode="floor")
