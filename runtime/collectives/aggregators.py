"""Gradient aggregators (seed 002): average a list of local gradients across the group.

`AllReduceAggregator` runs the ring (no central bottleneck); `ParameterServerAggregator` sends
every gradient to rank 0, which sums in rank order and sends the average back (a star). Both
flatten the gradients into one buffer per dtype, so each dtype costs one collective however many
tensors there are, and both return new tensors, bitwise identical on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import trio

from runtime.collectives.ring import DEFAULT_CHUNK_BYTES, _check_op, _expect, all_reduce
from runtime.config import DistributedConfig
from runtime.errors import CollectiveError
from runtime.transport.base import Transport
from runtime.transport.segments import divide_in_place

__all__ = [
    "GradientAggregator",
    "AllReduceAggregator",
    "ParameterServerAggregator",
    "flatten_by_dtype",
    "unflatten_into",
]


@runtime_checkable
class GradientAggregator(Protocol):
    """Anything that turns this rank's gradients into the group's averages."""

    async def aggregate(self, local_grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Return the element-wise average over all ranks of each tensor in ``local_grads``."""
        ...


def flatten_by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    """Concatenate tensors of each dtype into one flat buffer, in list order."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor.detach().reshape(-1))
    return {
        dtype: torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
        for dtype, parts in groups.items()
    }


def unflatten_into(
    tensors: Sequence[torch.Tensor], flats: dict[torch.dtype, torch.Tensor]
) -> list[torch.Tensor]:
    """Split flat buffers back into new tensors shaped like ``tensors``."""
    offsets = dict.fromkeys(flats, 0)
    out = []
    for tensor in tensors:
        start = offsets[tensor.dtype]
        stop = start + tensor.numel()
        out.append(flats[tensor.dtype][start:stop].view(tensor.shape).clone())
        offsets[tensor.dtype] = stop
    return out


def _check_config(config: DistributedConfig, transport: Transport) -> None:
    if (config.world_size, config.rank) != (transport.world_size, transport.rank):
        raise CollectiveError(
            f"config says rank {config.rank} of {config.world_size}, the transport is "
            f"rank {transport.rank} of {transport.world_size}"
        )


class AllReduceAggregator:
    """Averages gradients with the ring all-reduce: reduce-scatter, then all-gather."""

    def __init__(
        self,
        config: DistributedConfig,
        transport: Transport,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        _check_config(config, transport)
        self.config = config
        self.transport = transport
        self.chunk_bytes = chunk_bytes

    async def aggregate(self, local_grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Average ``local_grads`` across the group; returns new tensors, inputs untouched."""
        flats = flatten_by_dtype(local_grads)
        for dtype in sorted(flats, key=str):
            await all_reduce(self.transport, flats[dtype], "avg", chunk_bytes=self.chunk_bytes)
        return unflatten_into(local_grads, flats)


class ParameterServerAggregator:
    """Averages gradients through rank 0: everyone sends, rank 0 reduces and sends back.

    Simple and exact, but rank 0 moves (n-1)x more bytes than anyone in the ring; it is here for
    small groups and as a reference implementation.
    """

    def __init__(self, config: DistributedConfig, transport: Transport, *, root: int = 0) -> None:
        _check_config(config, transport)
        if not 0 <= root < config.world_size:
            raise CollectiveError(f"root {root} is not a rank of a group of {config.world_size}")
        self.config = config
        self.transport = transport
        self.root = root

    async def aggregate(self, local_grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Average ``local_grads`` across the group; returns new tensors, inputs untouched."""
        flats = flatten_by_dtype(local_grads)
        for dtype in sorted(flats, key=str):
            await self._average(flats[dtype])
        return unflatten_into(local_grads, flats)

    async def _average(self, flat: torch.Tensor) -> None:
        transport, root = self.transport, self.root
        n, rank = transport.world_size, transport.rank
        _check_op("avg")
        op_id = transport.next_op_id()
        if n == 1:
            return
        fields = {"op": op_id, "hop": 0, "part": 0}
        if rank != root:
            await transport.send(root, "coll", fields, flat)
            message = await transport.recv_into(root, flat)
            _expect(message, op_id, 1, 0, root)
            return
        received = torch.empty((n, flat.numel()), dtype=flat.dtype)
        received[root].copy_(flat)
        for peer in range(n):
            if peer != root:
                message = await transport.recv_into(peer, received[peer])
                _expect(message, op_id, 0, 0, peer)
        total = received[0].clone()
        for peer in range(1, n):
            total.add_(received[peer])
        divide_in_place(total, n)
        flat.copy_(total)
        async with trio.open_nursery() as nursery:
            for peer in range(n):
                if peer != root:
                    nursery.start_soon(
                        transport.send, peer, "coll", {"op": op_id, "hop": 1, "part": 0}, flat
                    )
