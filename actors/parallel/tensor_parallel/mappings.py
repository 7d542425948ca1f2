"""The autograd functions that move activations into and out of the tensor-parallel region.

As Megatron's ``tensor_parallel/mappings.py``, over a `SyncCollectives` (the tp group seen from
the compute thread):

- `copy_to_tp_region`: identity forward, all-reduce (sum) of the gradient in backward. Where a
  replicated activation enters column-parallel layers: each rank's weights see only their slice
  of the output, so the input gradient is the sum of every rank's part.
- `reduce_from_tp_region`: all-reduce (sum) forward, identity backward. Where the partial outputs
  of row-parallel layers (or the masked vocabulary-parallel embedding) leave the region.
- `gather_from_tp_region`: all-gather along the last dimension forward, this rank's slice of the
  gradient backward (a column-parallel layer's ``gather_output``).
- `scatter_to_tp_region`: this rank's slice of the last dimension forward, all-gather of the
  gradient backward (a row-parallel layer whose input is not already split).

A column-parallel layer followed by a row-parallel one therefore costs exactly one all-reduce in
forward and one in backward. Every all-reduce works on a fresh contiguous copy, so no tensor that
autograd saved or handed over is modified in place.
"""

from __future__ import annotations

from typing import Any

import torch

from paramsync.runtime.collectives.from_thread import SyncCollectives

__all__ = [
    "copy_to_tp_region",
    "reduce_from_tp_region",
    "gather_from_tp_region",
    "scatter_to_tp_region",
    "split_last_dim",
]


def _reduce(tensor: torch.Tensor, comm: SyncCollectives) -> torch.Tensor:
    if comm.world_size == 1:
        return tensor
    out = tensor.contiguous().clone()
    comm.all_reduce(out)
    return out


def split_last_dim(tensor: torch.Tensor, comm: SyncCollectives) -> torch.Tensor:
    """This rank's equal slice of ``tensor``'s last dimension (a contiguous copy)."""
    size = tensor.shape[-1]
    if size % comm.world_size:
        raise ValueError(
            f"last dimension {size} does not split evenly over a tensor-parallel group of "
            f"{comm.world_size}"
        )
    part = size // comm.world_size
    return tensor[..., comm.rank * part : (comm.rank + 1) * part].contiguous()


def _gather_last_dim(tensor: torch.Tensor, comm: SyncCollectives) -> torch.Tensor:
    if comm.world_size == 1:
        return tensor
    gathered = comm.all_gather(tensor.contiguous())  # (tp, *shape)
    return torch.cat(gathered.unbind(0), dim=-1)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: SyncCollectives) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce(grad, ctx.comm), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: SyncCollectives) -> torch.Tensor:
        return _reduce(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: SyncCollectives) -> torch.Tensor:
        ctx.comm = comm
        return _gather_last_dim(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return split_last_dim(grad, ctx.comm), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: SyncCollectives) -> torch.Tensor:
        ctx.comm = comm
        return split_last_dim(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last_dim(grad, ctx.comm), None


def copy_to_tp_region(x: torch.Tensor, comm: SyncCollectives) -> torch.Tensor:
    """Identity forward; the gradient is all-reduced over the tp group in backward."""
    out: torch.Tensor = _CopyToRegion.apply(x, comm)
    return out


def reduce_from_tp_region(x: torch.Tensor, comm: SyncCollectives) -> torch.Tensor:
    """All-reduce (sum) over the tp group forward; identity backward."""
    out: torch.Tensor = _ReduceFromRegion.apply(x, comm)
    return out


def gather_from_tp_region(x: torch.Tensor, comm: SyncCollectives) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension; backward keeps this rank's slice."""
    out: torch.Tensor = _GatherFromRegion.apply(x, comm)
    return out


def scatter_to_tp_region(x: torch.Tensor, comm: SyncCollectives) -> torch.Tensor:
    """This rank's slice of the last dimension; backward all-gathers the gradient."""
    out: torch.Tensor = _ScatterToRegion.apply(x, comm)
    return out
