"""Which samples each rank reads: the distributed sampler of the data loader actor."""

from __future__ import annotations

import torch

__all__ = ["shard"]


def shard(dataset_len: int, rank: int, world_size: int, seed: int, epoch: int = 0) -> list[int]:
    """Rank ``rank``'s share of a seeded permutation of ``range(dataset_len)``.

    Same as ``DistributedSampler(shuffle=True, drop_last=True, seed=seed)`` after
    ``set_epoch(epoch)``: the shares are disjoint, equally long (``dataset_len // world_size``)
    and together cover all but the last ``dataset_len % world_size`` permuted indices.
    """
    for name, value in (
        ("dataset_len", dataset_len),
        ("rank", rank),
        ("world_size", world_size),
        ("seed", seed),
        ("epoch", epoch),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if dataset_len < 0:
        raise ValueError(f"dataset_len must be non-negative, got {dataset_len}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
    if epoch < 0:
        raise ValueError(f"epoch must be non-negative, got {epoch}")
    gen = torch.Generator()
    gen.manual_seed(seed + epoch)
    perm = torch.randperm(dataset_len, generator=gen).tolist()
    total = (dataset_len // world_size) * world_size
    return perm[rank:total:world_size]
