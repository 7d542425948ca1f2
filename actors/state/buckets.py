"""Gradient buckets: which trainable parameters travel together in one all-reduce.

As in torch DDP, parameters are taken in reverse registration order (roughly the order backward
produces their gradients) and packed into buckets of at most ``bucket_bytes``, so the first
bucket is ready early in backward and its all-reduce overlaps the rest of backward. A bucket
never mixes dtypes: it is one flat tensor on the wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paramsync.runtime.coordinator.events import dtype_name

__all__ = ["Bucket", "plan_buckets", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 4 << 20
"""Default bucket size: large enough to amortise a collective and the coordinator's round trip,
small enough to overlap backward (torch DDP uses 25 MiB; on 2 cores fewer, larger buckets won
in ``benchmarks/ddp.py``)."""


@dataclass(frozen=True)
class Bucket:
    """One all-reduce's worth of gradients: parameter names and their sizes, one dtype."""

    index: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        """Elements in the flat buffer."""
        total = 0
        for shape in self.shapes:
            count = 1
            for dim in shape:
                count *= dim
            total += count
        return total

    def spec(self) -> list[list[object]]:
        """What every rank must agree on before this bucket is reduced: shapes and dtype."""
        dtype = dtype_name(self.dtype)
        return [[list(shape), dtype] for shape in self.shapes]

    def pack(self, grads: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Copy ``grads`` (in bucket order) into the flat buffer ``out``; return it."""
        offset = 0
        for grad in grads:
            count = grad.numel()
            out[offset : offset + count].copy_(grad.reshape(-1))
            offset += count
        return out

    def unpack(self, flat: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
        """Copy the flat buffer back into ``grads`` (in bucket order)."""
        offset = 0
        for grad in grads:
            count = grad.numel()
            grad.copy_(flat[offset : offset + count].view_as(grad))
            offset += count


def plan_buckets(
    named_params: Sequence[tuple[str, torch.nn.Parameter]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[Bucket]:
    """Group the trainable parameters into buckets of at most ``bucket_bytes`` (at least one
    parameter each), in reverse registration order. Frozen parameters are left out."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[Bucket] = []
    names: list[str] = []
    shapes: list[tuple[int, ...]] = []
    size = 0
    dtype: torch.dtype | None = None

    def close() -> None:
        nonlocal names, shapes, size
        if names:
            assert dtype is not None
            buckets.append(Bucket(len(buckets), tuple(names), tuple(shapes), dtype))
        names, shapes, size = [], [], 0

    for name, param in reversed(list(named_params)):
        if not param.requires_grad:
            continue
        nbytes = param.numel() * param.element_size()
        if names and (param.dtype != dtype or size + nbytes > bucket_bytes):
            close()
        dtype = param.dtype
        names.append(name)
        shapes.append(tuple(param.shape))
        size += nbytes
    close()
    return buckets
