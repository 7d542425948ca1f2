"""The data loader actor: this rank's shard of a dataset, batch by batch, prefetched.

Every rank draws a disjoint, equally long shard of a seeded permutation (torch's
DistributedSampler with ``drop_last``), so the group sees each sample of an epoch at most once
and all ranks take the same number of steps. Each `LoadNext` message builds one batch into a
bounded channel; the trainer keeps ``prefetch`` requests outstanding, so loading overlaps
training and memory stays bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import trio

from paramsync.actors.graph.sampler import shard
from paramsync.runtime.actor.base import Actor

__all__ = ["BatchSource", "DataLoaderActor", "LoadNext", "LoaderPosition"]


class BatchSource(Protocol):
    """A dataset the loader can draw from: a length and a way to stack samples."""

    def __len__(self) -> int: ...

    def batch(self, indices: list[int]) -> Any:
        """Stack the samples at ``indices`` into one batch."""
        ...


@dataclass(frozen=True)
class LoadNext:
    """Build the next batch into the loader's channel."""


@dataclass(frozen=True)
class LoaderPosition:
    """Where the loader is: the epoch and the next batch within it (to resume from)."""

    epoch: int
    batch: int

    @classmethod
    def at_step(cls, step: int, samples: int, world_size: int, batch_size: int) -> LoaderPosition:
        """Where step ``step`` reads when every step takes one batch per rank: a run's data
        position is its step."""
        per_epoch = samples // world_size // batch_size
        return cls(step // per_epoch, step % per_epoch) if per_epoch else cls(0, 0)


class DataLoaderActor(Actor):
    """Loads rank ``rank``'s shard of ``dataset`` in batches of ``batch_size``."""

    accepts = (LoadNext,)

    def __init__(
        self,
        dataset: BatchSource,
        batch_size: int,
        rank: int,
        world_size: int,
        *,
        seed: int = 0,
        prefetch: int = 4,
        position: LoaderPosition | None = None,
    ) -> None:
        super().__init__("data-loader", mailbox_size=prefetch + 1)
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.prefetch = prefetch
        per_rank = len(dataset) // world_size
        self.batches_per_epoch = per_rank // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"a dataset of {len(dataset)} samples gives rank {rank} of {world_size} no full "
                f"batch of {batch_size}"
            )
        self.position = position or LoaderPosition(0, 0)
        self.expects: tuple[int, int] | None = None
        """(step, ring position) of the next batch the trainer will take from the channel."""
        self._indices: list[int] = []
        self._indices_epoch = -1
        self._batch_out, self.batches = trio.open_memory_channel[tuple[LoaderPosition, Any]](
            prefetch + 1
        )

    async def next_batch(self) -> tuple[LoaderPosition, Any]:
        """The next batch from the channel (where it was loaded, the batch), waiting for it;
        the trainer has asked for it with a `LoadNext` before."""
        return await self.batches.receive()

    async def handle(self, message: object) -> None:
        epoch, index = self.position.epoch, self.position.batch
        if self._indices_epoch != epoch:
            self._indices = shard(len(self.dataset), self.rank, self.world_size, self.seed, epoch)
            self._indices_epoch = epoch
        start = index * self.batch_size
        batch = self.dataset.batch(self._indices[start : start + self.batch_size])
        self._batch_out.send_nowait((self.position, batch))
        index += 1
        if index == self.batches_per_epoch:
            epoch, index = epoch + 1, 0
        self.position = LoaderPosition(epoch, index)
