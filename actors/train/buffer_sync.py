"""Keeping a model's buffers (BatchNorm running statistics, any registered buffer) in lockstep.

Gradients keep the parameters identical on every rank; buffers are not trained, they are
updated by each rank's own forward passes (a BatchNorm's running mean and variance follow that
rank's batches). `sync_buffers` makes them identical again through the engine's collectives
over the trainer's transport, in one of three modes (`TrainerOptions.buffer_sync`):

* ``"broadcast"`` (the default, torch DDP's ``broadcast_buffers=True``): ring position 0's
  buffers are copied to every rank;
* ``"average"``: floating-point buffers are all-reduced to their mean over the ranks (bitwise
  identical everywhere); integer and bool buffers (``num_batches_tracked``) are broadcast from
  position 0 instead, since a mean of counters is no counter;
* ``"local"`` (DDP's ``broadcast_buffers=False``): nothing is sent; each rank keeps its own.

Buffers travel grouped by dtype, one flat tensor (one collective) per dtype per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import torch

from paramsync.runtime.collectives.ring import (
    DEFAULT_CHUNK_BYTES,
    THREADED_MIN_BYTES,
    all_reduce,
    broadcast,
)
from paramsync.runtime.transport.base import Transport

__all__ = ["BufferSync", "BUFFER_SYNC_MODES", "check_buffer_sync", "sync_buffers"]

BufferSync = Literal["broadcast", "average", "local"]
"""How a trainer keeps buffers identical across ranks (see the module docstring)."""

BUFFER_SYNC_MODES: tuple[str, ...] = get_args(BufferSync)


def check_buffer_sync(mode: object) -> BufferSync:
    """``mode`` if it is a buffer-sync mode; ValueError naming the field and the choices."""
    if mode not in BUFFER_SYNC_MODES:
        raise ValueError(
            f"buffer_sync must be one of {', '.join(repr(m) for m in BUFFER_SYNC_MODES)}, "
            f"got {mode!r}"
        )
    return mode  # type: ignore[return-value]


def _averaged(mode: BufferSync, dtype: torch.dtype) -> bool:
    return mode == "average" and dtype.is_floating_point


async def sync_buffers(
    transport: Transport,
    buffers: Sequence[torch.Tensor],
    mode: BufferSync,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    threaded_min_bytes: int = THREADED_MIN_BYTES,
) -> None:
    """Make ``buffers`` identical on every rank of ``transport`` as ``mode`` says, in place.

    Every rank must call it with the same buffers (names, shapes, dtypes, order), as every
    collective; the buffers may live on any device (they are copied through the host). A
    ``"local"`` mode, or no buffers, sends nothing.
    """
    mode = check_buffer_sync(mode)
    if mode == "local" or not buffers:
        return
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in buffers:
        groups.setdefault(buffer.dtype, []).append(buffer)
    for dtype, members in groups.items():
        flat = torch.cat([b.detach().reshape(-1).to("cpu") for b in members])
        if _averaged(mode, dtype):
            await all_reduce(
                transport,
                flat,
                "avg",
                chunk_bytes=chunk_bytes,
                threaded_min_bytes=threaded_min_bytes,
            )
        else:
            wire = flat.view(torch.uint8) if dtype == torch.bool else flat
            # ``flat`` is this call's own copy, committed below only once the broadcast
            # verified every part: it may take the parts in place
            await broadcast(transport, wire, root=0, chunk_bytes=chunk_bytes, in_place=True)
        offset = 0
        with torch.no_grad():  # never across an await: grad mode is per thread, not per task
            for buffer in members:
                size = buffer.numel()
                buffer.copy_(flat[offset : offset + size].view(buffer.shape))
                offset += size
