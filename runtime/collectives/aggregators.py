"""Gradient aggregators (seed 002): average a list of local gradients across the group.

Thin uses of the collectives. `AllReduceAggregator` runs
`paramsync.runtime.collectives.ring.all_reduce` (no central bottleneck); `ParameterServerAggregator`
sends every gradient to rank 0 with point-to-point messages (`paramsync.runtime.collectives.p2p`),
which sums in rank order and sends the average back (a star). Both flatten the gradients into one
buffer per dtype (`paramsync.runtime.collectives.flatten`), so each dtype costs one collective
however many tensors there are, and both return new tensors, bitwise identical on every rank.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
import trio

from paramsync.runtime.collectives.flatten import dtype_groups, flatten, unflatten
from paramsync.runtime.collectives.p2p import recv, send
from paramsync.runtime.collectives.ring import DEFAULT_CHUNK_BYTES, all_reduce
from paramsync.runtime.config import DistributedConfig
from paramsync.runtime.errors import CollectiveError
from paramsync.runtime.transport.base import Transport
from paramsync.runtime.transport.segments import divide_in_place

__all__ = [
    "GradientAggregator",
    "AllReduceAggregator",
    "ParameterServerAggregator",
]

TO_ROOT, FROM_ROOT = 0, 1
"""`ParameterServerAggregator`'s point-to-point tags: the gradients going in, the average out."""


@runtime_checkable
class GradientAggregator(Protocol):
    """Anything that turns this rank's gradients into the group's averages."""

    async def aggregate(self, local_grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Return the element-wise average over all ranks of each tensor in ``local_grads``."""
        ...


async def _average_by_dtype(
    local_grads: Sequence[torch.Tensor], average: Callable[[torch.Tensor], Awaitable[object]]
) -> list[torch.Tensor]:
    """New tensors holding ``average`` of ``local_grads``: one flat buffer per dtype, the dtypes
    in name order (every rank the same), each result a tensor of its own."""
    out: list[torch.Tensor | None] = [None] * len(local_grads)
    groups = dtype_groups(local_grads)
    for indices in sorted(groups, key=lambda group: str(local_grads[group[0]].dtype)):
        tensors = [local_grads[index] for index in indices]
        flat = flatten(tensors)
        await average(flat)
        for index, view in zip(indices, unflatten(flat, tensors), strict=True):
            out[index] = view.clone()
    return [tensor for tensor in out if tensor is not None]


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
        return await _average_by_dtype(
            local_grads,
            lambda flat: all_reduce(self.transport, flat, "avg", chunk_bytes=self.chunk_bytes),
        )


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
        return await _average_by_dtype(local_grads, self._average)

    async def _average(self, flat: torch.Tensor) -> None:
        """The star, in point-to-point messages (`paramsync.runtime.collectives.p2p`): every rank
        sends ``flat`` to the root under `TO_ROOT`; the root sums them in rank order, divides, and
        sends the average back under `FROM_ROOT`."""
        transport, root = self.transport, self.root
        n, rank = transport.world_size, transport.rank
        if n == 1:
            return
        if rank != root:
            await send(transport, flat, root, TO_ROOT)
            await recv(transport, flat, root, FROM_ROOT)
            return
        received = torch.empty((n, flat.numel()), dtype=flat.dtype)
        received[root].copy_(flat)
        async with trio.open_nursery() as nursery:
            for peer in range(n):
                if peer != root:
                    nursery.start_soon(recv, transport, received[peer], peer, TO_ROOT)
        total = received[0].clone()
        for peer in range(1, n):
            total.add_(received[peer])
        divide_in_place(total, n)
        flat.copy_(total)
        async with trio.open_nursery() as nursery:
            for peer in range(n):
                if peer != root:
                    nursery.start_soon(send, transport, flat, peer, FROM_ROOT)
