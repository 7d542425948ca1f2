"""The tensor-parallel transformer: `DenseTransformer` split over a tp group by heads and columns.

Built from a `DenseTransformer` of the same shapes by slicing its weights (``from_dense``), with
the same stage list, module names and parameter names, so a shard's name is its dense
parameter's name and every sharded parameter is the dense one's contiguous slice along its
``partition_dim``:

- `ParallelEmbedding` (stage 0): a `VocabParallelEmbedding` of the tokens (one all-reduce) plus
  the replicated position embedding; residual dropout from the default generator.
- `ParallelBlock`: replicated LayerNorms; `ParallelAttention` (the input copied into the tp
  region once, q, k and v column-parallel over this rank's head group, attention over those
  heads with its dropout inside ``rng.fork()``, the output projection row-parallel) and
  `ParallelMLP` (column-parallel fc, GELU, row-parallel out). Each is one all-reduce forward and
  one backward.
- `ParallelHead` (last stage): the replicated final LayerNorm and a column-parallel LM head whose
  logits stay split over the vocabulary; `TensorParallelTransformer.loss` takes
  `vocab_parallel_cross_entropy` of them. With ``tie_weights`` the head's weight IS the
  embedding's shard (both hold the same vocabulary rows).

A pipeline cuts ``stages`` between any two entries (`TensorParallelTransformer.stages`).
"""

from __future__ import annotations

import copy
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from paramsync.actors.parallel.dense_transformer import (
    DenseAttention,
    DenseBlock,
    DenseEmbedding,
    DenseHead,
    DenseMLP,
    DenseTransformer,
    causal_attention,
)
from paramsync.actors.parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from paramsync.actors.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from paramsync.actors.parallel.tensor_parallel.mappings import copy_to_tp_region
from paramsync.actors.parallel.tensor_parallel.random import TensorParallelRNG
from paramsync.runtime.collectives.from_thread import SyncCollectives

M = TypeVar("M", bound=nn.Module)

__all__ = [
    "ParallelAttention",
    "ParallelMLP",
    "ParallelBlock",
    "ParallelEmbedding",
    "ParallelHead",
    "TensorParallelTransformer",
]


def _replica(module: M) -> M:
    """A copy of a module replicated across the tp group (its own parameters, equal to the
    dense ones)."""
    return copy.deepcopy(module)


class ParallelAttention(nn.Module):
    """Causal self-attention over this tp rank's group of heads."""

    def __init__(
        self,
        q: ColumnParallelLinear,
        k: ColumnParallelLinear,
        v: ColumnParallelLinear,
        proj: RowParallelLinear,
        n_heads: int,
        comm: SyncCollectives,
        rng: TensorParallelRNG | None,
        dropout: float,
    ) -> None:
        super().__init__()
        if n_heads % comm.world_size:
            raise ValueError(
                f"{n_heads} attention heads do not split over a tensor-parallel group of "
                f"{comm.world_size}"
            )
        self.q, self.k, self.v, self.proj = q, k, v, proj
        self.comm = comm
        self.local_heads = n_heads // comm.world_size
        self.rng, self.dropout = rng, dropout

    @classmethod
    def from_dense(
        cls, dense: DenseAttention, comm: SyncCollectives, rng: TensorParallelRNG | None
    ) -> ParallelAttention:
        """Heads ``rank * h/tp .. (rank + 1) * h/tp`` of ``dense``: rows of q, k and v, columns
        of the output projection."""
        q, k, v = (
            ColumnParallelLinear.from_dense(layer, comm, copy_input=False)
            for layer in (dense.q, dense.k, dense.v)
        )
        proj = RowParallelLinear.from_dense(dense.proj, comm, input_is_parallel=True)
        return cls(q, k, v, proj, dense.n_heads, comm, rng, dense.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp_region(x, self.comm)  # once for q, k and v: one backward all-reduce
        y = causal_attention(
            self.q(x),
            self.k(x),
            self.v(x),
            self.local_heads,
            self.rng,
            self.dropout,
            self.training,
        )
        return self.proj(y)


class ParallelMLP(nn.Module):
    """Column-parallel fc, GELU, row-parallel out."""

    def __init__(self, fc: ColumnParallelLinear, out: RowParallelLinear) -> None:
        super().__init__()
        self.fc, self.out = fc, out

    @classmethod
    def from_dense(cls, dense: DenseMLP, comm: SyncCollectives) -> ParallelMLP:
        """Columns ``rank * 4d/tp ..`` of the hidden layer: rows of fc, columns of out."""
        return cls(
            ColumnParallelLinear.from_dense(dense.fc, comm),
            RowParallelLinear.from_dense(dense.out, comm, input_is_parallel=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class ParallelBlock(nn.Module):
    """A `DenseBlock` split over the tp group (LayerNorms replicated)."""

    def __init__(
        self,
        ln1: nn.Module,
        attn: ParallelAttention,
        ln2: nn.Module,
        mlp: ParallelMLP,
        rng: TensorParallelRNG | None,
        dropout: float,
    ) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = ln1, attn, ln2, mlp
        self.rng, self.dropout = rng, dropout

    @classmethod
    def from_dense(
        cls, dense: DenseBlock, comm: SyncCollectives, rng: TensorParallelRNG | None
    ) -> ParallelBlock:
        return cls(
            _replica(dense.ln1),
            ParallelAttention.from_dense(dense.attn, comm, rng),
            _replica(dense.ln2),
            ParallelMLP.from_dense(dense.mlp, comm),
            rng,
            dense.dropout,
        )

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        # Outside the tp region: the default generator, alike on every tp rank.
        return self.rng.dropout(x, self.dropout, self.training) if self.rng is not None else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.attn(self.ln1(x)))
        return x + self._drop(self.mlp(self.ln2(x)))


class ParallelEmbedding(nn.Module):
    """Vocabulary-parallel token embedding plus the replicated position embedding."""

    def __init__(
        self,
        tok_emb: VocabParallelEmbedding,
        pos_emb: nn.Embedding,
        rng: TensorParallelRNG | None,
        dropout: float,
    ) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = tok_emb, pos_emb
        self.rng, self.dropout = rng, dropout

    @classmethod
    def from_dense(
        cls, dense: DenseEmbedding, comm: SyncCollectives, rng: TensorParallelRNG | None
    ) -> ParallelEmbedding:
        return cls(
            VocabParallelEmbedding.from_dense(dense.tok_emb, comm),
            _replica(dense.pos_emb),
            rng,
            dense.dropout,
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        context = self.pos_emb.num_embeddings
        if idx.dim() != 2 or idx.shape[1] > context:
            raise ValueError(f"idx must be (batch, time <= {context}), got {tuple(idx.shape)}")
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        return self.rng.dropout(x, self.dropout, self.training) if self.rng is not None else x


class ParallelHead(nn.Module):
    """Replicated final LayerNorm and a column-parallel LM head: logits split by vocabulary."""

    def __init__(self, ln_f: nn.Module, head: ColumnParallelLinear) -> None:
        super().__init__()
        self.ln_f, self.head = ln_f, head

    @classmethod
    def from_dense(cls, dense: DenseHead, comm: SyncCollectives) -> ParallelHead:
        return cls(_replica(dense.ln_f), ColumnParallelLinear.from_dense(dense.head, comm))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, time, d_model) -> this rank's logits (batch, time, vocab / tp)."""
        return self.head(self.ln_f(x))


class TensorParallelTransformer(nn.Module):
    """``stages = [ParallelEmbedding, ParallelBlock x n_layers, ParallelHead]`` over one tp
    group; `forward` returns this rank's vocabulary slice of the logits."""

    def __init__(
        self,
        stages: list[nn.Module],
        comm: SyncCollectives,
        vocab_size: int,
        *,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.comm = comm
        self.vocab_size = vocab_size
        self.tie_weights = tie_weights
        if tie_weights:
            embedding, head = stages[0], stages[-1]
            assert isinstance(embedding, ParallelEmbedding) and isinstance(head, ParallelHead)
            head.head.weight = embedding.tok_emb.weight

    @classmethod
    def from_dense(
        cls,
        dense: DenseTransformer,
        comm: SyncCollectives,
        rng: TensorParallelRNG | None = None,
    ) -> TensorParallelTransformer:
        """This tp rank's shard of ``dense`` (sliced, so equal to it); ``rng`` draws its dropout
        (required when ``dense.dropout`` > 0; its tp rank must be ``comm.rank``)."""
        if dense.dropout and rng is None:
            raise ValueError("the dense model has dropout: pass this tp rank's TensorParallelRNG")
        if rng is not None and rng.tp_rank != comm.rank:
            raise ValueError(f"rng is tp rank {rng.tp_rank}'s, this is tp rank {comm.rank}")
        stages: list[nn.Module] = []
        for stage in dense.stages:
            if isinstance(stage, DenseEmbedding):
                stages.append(ParallelEmbedding.from_dense(stage, comm, rng))
            elif isinstance(stage, DenseBlock):
                stages.append(ParallelBlock.from_dense(stage, comm, rng))
            elif isinstance(stage, DenseHead):
                stages.append(ParallelHead.from_dense(stage, comm))
            else:  # pragma: no cover - DenseTransformer holds only these
                raise TypeError(f"no tensor-parallel form of {type(stage).__name__}")
        return cls(stages, comm, dense.vocab_size, tie_weights=dense.tie_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for stage in self.stages:
            x = stage(x)
        return x

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy, from the split logits (never gathered)."""
        return vocab_parallel_cross_entropy(self(idx), targets, self.comm, self.vocab_size).mean()
