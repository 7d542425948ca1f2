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

Buffers travel grouped by dtype, one flat tensor (one collective) per dtype per step. Buffers
on a device (`paramsync.runtime.transport.device_ops.DeviceOps` says which) are gathered there
and reduced there when the transport runs the collective on the device; otherwise the flat
tensor goes to a pinned host buffer and back by copies ordered with events (purpose
``"buffers"``), never by a device synchronize.
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
from paramsync.runtime.transport.capabilities import NativeCollectives
from paramsync.runtime.transport.device_ops import DeviceOps, context_device_ops, host_ready

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
    device_ops: DeviceOps | None = None,
) -> None:
    """Make ``buffers`` identical on every rank of ``transport`` as ``mode`` says, in place.

    Every rank must call it with the same buffers (names, shapes, dtypes, order), as every
    collective; the buffers may live on any device (copied through the host where the
    transport cannot reduce them there). A ``"local"`` mode, or no buffers, sends nothing.
    ``device_ops``: the device operations (default: the context's).
    """
    mode = check_buffer_sync(mode)
    if mode == "local" or not buffers:
        return
    ops = device_ops or context_device_ops()
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in buffers:
        groups.setdefault(buffer.dtype, []).append(buffer)
    for dtype, members in groups.items():
        device = _device_of(ops, members)
        gathered: torch.Tensor | None = None
        if device is None:
            flat = torch.cat([b.detach().reshape(-1).to("cpu") for b in members])
        else:
            gathered = torch.cat([b.detach().reshape(-1) for b in members])
            if isinstance(transport, NativeCollectives) and transport.native_accepts(
                _wire(gathered)
            ):
                flat, gathered = gathered, None  # reduced on the device: no host copy
            else:
                flat = ops.pinned_empty(gathered.numel(), dtype)
                stream = ops.current_stream(device)
                await host_ready(ops, ops.copy_to_host(gathered, flat, stream, "buffers"))
        if _averaged(mode, dtype):
            await all_reduce(
                transport,
                flat,
                "avg",
                chunk_bytes=chunk_bytes,
                threaded_min_bytes=threaded_min_bytes,
            )
        else:
            # ``flat`` is this call's own copy, committed below only once the broadcast
            # verified every part: it may take the parts in place
            await broadcast(transport, _wire(flat), root=0, chunk_bytes=chunk_bytes, in_place=True)
        if device is not None and gathered is not None:
            # on the current stream: the copies into the buffers below are ordered after it
            ops.copy_to_device(flat, gathered, ops.current_stream(device), "buffers")
            flat = gathered
        offset = 0
        with torch.no_grad():  # never across an await: grad mode is per thread, not per task
            for buffer in members:
                size = buffer.numel()
                buffer.copy_(flat[offset : offset + size].view(buffer.shape))
                offset += size


def _wire(flat: torch.Tensor) -> torch.Tensor:
    """The flat tensor as the collectives carry it: bool as its uint8 bytes."""
    return flat.view(torch.uint8) if flat.dtype == torch.bool else flat


def _device_of(ops: DeviceOps, members: Sequence[torch.Tensor]) -> torch.device | None:
    """The one device ``members`` all live on, as ``ops`` sees them (None: the host, or
    several devices: they go through the host as host tensors)."""
    if not all(ops.on_device(member) for member in members):
        return None
    devices = {member.device for member in members}
    return devices.pop() if len(devices) == 1 else None
