"""Tensor-parallel layers: column- and row-parallel linear, vocabulary-parallel embedding.

As Megatron's ``tensor_parallel/layers.py``, each layer holds one tp rank's shard:

- `ColumnParallelLinear` splits the output features (weight rows, bias): no communication in
  forward, the input gradient all-reduced in backward (`copy_to_tp_region`); ``gather_output``
  concatenates the outputs; ``copy_input=False`` when the caller already copied the input into the
  region once for several layers (attention's q, k and v).
- `RowParallelLinear` splits the input features (weight columns): its input is already split
  (``input_is_parallel``, the column layer's output) or is split here; the partial outputs are
  all-reduced in forward; the bias, replicated, is added once after the reduce.
- `VocabParallelEmbedding` splits the vocabulary (weight rows): ids outside the shard's range
  embed to zero, and the partial embeddings are all-reduced.

Every layer's ``from_dense`` slices the single-device layer's weights, so the shard is exactly
(`torch.equal`) the dense layer's ``weight[shard_rows]`` (or ``[:, shard_cols]``). Sharded
parameters carry ``tensor_model_parallel = True`` and ``partition_dim`` (Megatron's attributes),
which global-norm clipping reads (`paramsync.actors.parallel.grad_clip`); replicated ones (a
row-parallel bias) carry neither.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paramsync.actors.parallel.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
)
from paramsync.runtime.collectives.from_thread import SyncCollectives

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "partition_range",
    "mark_tensor_parallel",
    "is_tensor_parallel",
]


def partition_range(size: int, world_size: int, rank: int, what: str = "dimension") -> slice:
    """The slice of ``size`` that tp rank ``rank`` of ``world_size`` holds (equal parts)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"tp rank {rank} is not in a tensor-parallel group of {world_size}")
    if size % world_size:
        raise ValueError(
            f"{what} of size {size} does not split evenly over a tensor-parallel group of "
            f"{world_size}"
        )
    part = size // world_size
    return slice(rank * part, (rank + 1) * part)


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int) -> nn.Parameter:
    """Mark ``param`` as a tp shard split along ``partition_dim`` (Megatron's attributes)."""
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.partition_dim = partition_dim  # type: ignore[attr-defined]
    return param


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` is a tp shard (each tp rank holds a different part of it)."""
    return bool(getattr(param, "tensor_model_parallel", False))


def _new(shape: tuple[int, ...], dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype or torch.get_default_dtype()))


def _check_comm(comm: SyncCollectives) -> None:
    if not isinstance(comm, SyncCollectives):
        raise TypeError(
            f"tensor-parallel layers need a SyncCollectives (e.g. ThreadCollectives(tp_group)), "
            f"got {type(comm).__name__}"
        )


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with A's rows (output features) split over the tp group."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: SyncCollectives,
        *,
        bias: bool = True,
        gather_output: bool = False,
        copy_input: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_comm(comm)
        self.comm = comm
        self.in_features = in_features
        self.out_features = out_features
        self.gather_output = gather_output
        self.copy_input = copy_input
        self.rows = partition_range(out_features, comm.world_size, comm.rank, "out_features")
        local = self.rows.stop - self.rows.start
        self.weight = mark_tensor_parallel(_new((local, in_features), dtype), 0)
        self.bias = mark_tensor_parallel(_new((local,), dtype), 0) if bias else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's initialisation applied to the shard (``from_dense`` for exact parity)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_dense(
        cls,
        dense: nn.Linear,
        comm: SyncCollectives,
        *,
        gather_output: bool = False,
        copy_input: bool = True,
    ) -> ColumnParallelLinear:
        """This tp rank's shard of ``dense``: ``weight == dense.weight[rows]``."""
        layer = cls(
            dense.in_features,
            dense.out_features,
            comm,
            bias=dense.bias is not None,
            gather_output=gather_output,
            copy_input=copy_input,
            dtype=dense.weight.dtype,
        )
        with torch.no_grad():
            layer.weight.copy_(dense.weight[layer.rows])
            if layer.bias is not None and dense.bias is not None:
                layer.bias.copy_(dense.bias[layer.rows])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp_region(x, self.comm)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tp_region(y, self.comm) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features} (rows {self.rows.start}:"
            f"{self.rows.stop}), tp rank {self.comm.rank} of {self.comm.world_size}"
        )


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with A's columns (input features) split over the tp group."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: SyncCollectives,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_comm(comm)
        self.comm = comm
        self.in_features = in_features
        self.out_features = out_features
        self.input_is_parallel = input_is_parallel
        self.cols = partition_range(in_features, comm.world_size, comm.rank, "in_features")
        local = self.cols.stop - self.cols.start
        self.weight = mark_tensor_parallel(_new((out_features, local), dtype), 1)
        self.bias = _new((out_features,), dtype) if bias else None  # replicated
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's initialisation applied to the shard (``from_dense`` for exact parity)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_dense(
        cls, dense: nn.Linear, comm: SyncCollectives, *, input_is_parallel: bool = True
    ) -> RowParallelLinear:
        """This tp rank's shard of ``dense``: ``weight == dense.weight[:, cols]``, the whole
        bias."""
        layer = cls(
            dense.in_features,
            dense.out_features,
            comm,
            bias=dense.bias is not None,
            input_is_parallel=input_is_parallel,
            dtype=dense.weight.dtype,
        )
        with torch.no_grad():
            layer.weight.copy_(dense.weight[:, layer.cols])
            if layer.bias is not None and dense.bias is not None:
                layer.bias.copy_(dense.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.comm)
        y = reduce_from_tp_region(F.linear(x, self.weight), self.comm)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features} (cols {self.cols.start}:{self.cols.stop}), "
            f"out={self.out_features}, tp rank {self.comm.rank} of {self.comm.world_size}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary (rows) is split over the tp group."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        comm: SyncCollectives,
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_comm(comm)
        self.comm = comm
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.rows = partition_range(num_embeddings, comm.world_size, comm.rank, "vocabulary")
        self.vocab_start, self.vocab_end = self.rows.start, self.rows.stop
        local = self.vocab_end - self.vocab_start
        self.weight = mark_tensor_parallel(_new((local, embedding_dim), dtype), 0)
        with torch.no_grad():
            nn.init.normal_(self.weight)

    @classmethod
    def from_dense(cls, dense: nn.Embedding, comm: SyncCollectives) -> VocabParallelEmbedding:
        """This tp rank's shard of ``dense``: ``weight == dense.weight[rows]``."""
        layer = cls(dense.num_embeddings, dense.embedding_dim, comm, dtype=dense.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(dense.weight[layer.rows])
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"token ids must be int64 or int32, got {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise ValueError(
                f"token ids must lie in 0..{self.num_embeddings - 1}, got "
                f"{int(ids.min())}..{int(ids.max())}"
            )
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(partial, self.comm)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim} (rows {self.vocab_start}:"
            f"{self.vocab_end}), tp rank {self.comm.rank} of {self.comm.world_size}"
        )
