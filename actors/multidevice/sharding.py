"""Splitting one mini-batch into one shard per device (C-DP-002's precondition and balance).

A batch is a tensor or a tuple of tensors sharing their first dimension; it is split along that
dimension into contiguous shards whose sizes differ by at most one (the first ``len % n`` shards
take one sample more). Fewer samples than devices is refused: there is no silent fall-back to
fewer devices.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["TooFewSamplesError", "batch_size", "shard_sizes", "split_batch"]

Batch = torch.Tensor | tuple[torch.Tensor, ...]


class TooFewSamplesError(ValueError):
    """A batch holds fewer samples than there are devices (C-DP-002's precondition)."""

    def __init__(self, samples: int, devices: int) -> None:
        super().__init__(
            f"a batch of {samples} samples cannot be split over {devices} devices: C-DP-002 "
            f"needs at least one sample per device (pass a batch of at least {devices} samples, "
            "or fewer devices)"
        )
        self.samples = samples
        self.devices = devices


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch`` (its first dimension); ValueError naming the field
    whose first dimension differs, or a batch that is neither a tensor nor a tuple of them."""
    tensors = _tensors(batch)
    size = tensors[0].shape[0]
    for index, tensor in enumerate(tensors[1:], start=1):
        if tensor.shape[0] != size:
            raise ValueError(
                f"batch field {index} has {tensor.shape[0]} samples along dimension 0, "
                f"field 0 has {size}: every field must hold the same samples"
            )
    return int(size)


def shard_sizes(samples: int, devices: int) -> list[int]:
    """The shard sizes for ``samples`` over ``devices``: differing by at most one, the larger
    first; TooFewSamplesError when ``samples < devices``."""
    if devices < 1:
        raise ValueError(f"cannot shard over {devices} devices: need at least one")
    if samples < devices:
        raise TooFewSamplesError(samples, devices)
    base, extra = divmod(samples, devices)
    return [base + (1 if index < extra else 0) for index in range(devices)]


def split_batch(batch: Any, devices: int) -> list[Any]:
    """``batch`` split along dimension 0 into one contiguous shard per device, in device order
    (each field a tensor view; a tuple batch gives tuple shards)."""
    sizes = shard_sizes(batch_size(batch), devices)
    if isinstance(batch, torch.Tensor):
        return list(torch.split(batch, sizes))
    fields = [torch.split(tensor, sizes) for tensor in batch]
    return [tuple(field[index] for field in fields) for index in range(devices)]


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        tensors = [batch]
    elif isinstance(batch, tuple | list) and batch:
        tensors = list(batch)
    else:
        raise TypeError(
            f"a batch must be a tensor or a non-empty tuple of tensors, not {type(batch).__name__}"
        )
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"batch field {index} is a {type(tensor).__name__}, not a tensor")
        if tensor.dim() == 0:
            raise ValueError(f"batch field {index} is a scalar: it has no sample dimension")
    return tensors
