"""A small single-device decoder-only transformer, the reference of the parallel models.

The tensor-parallel model (`paramsync.actors.parallel.tensor_parallel.transformer`) is built from
this one by slicing its weights, and parity tests train both on the same data. It is a list of
stages, ``stages = [embedding, block, ..., block, head]``, so a pipeline can cut it between any two,
and attention has separate q, k and v projections so that a head group's shard is a contiguous slice
of each. Attention is written out (no fused kernel) so both models compute alike, and dropout draws
from a `TensorParallelRNG` (inside its ``fork()`` for the attention probabilities, as the
tensor-parallel model does), never from torch's process-wide generator.

Initialisation draws only from a generator seeded with ``seed`` (GPT-2 style: N(0, 0.02), residual
projections scaled by 1/sqrt(2 n_layers), zero biases, unit LayerNorm gains), so every rank builds
bit-identical weights.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # the rng is only called; importing it here would import the tp package
    from paramsync.actors.parallel.tensor_parallel.random import TensorParallelRNG

__all__ = [
    "DenseTransformer",
    "DenseEmbedding",
    "DenseAttention",
    "DenseMLP",
    "DenseBlock",
    "DenseHead",
    "causal_attention",
]


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    n_heads: int,
    rng: TensorParallelRNG | None,
    dropout: float,
    training: bool,
) -> torch.Tensor:
    """Causal multi-head attention of (batch, time, n_heads * head_dim) projections.

    The probabilities' dropout draws inside ``rng.fork()`` (the tensor-parallel region's
    generator): heads are what tensor parallelism splits."""
    b, t, width = q.shape
    head_dim = width // n_heads
    q, k, v = (z.view(b, t, n_heads, head_dim).transpose(1, 2) for z in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
    if rng is not None and dropout > 0.0 and training:
        with rng.fork():
            probs = rng.dropout(probs, dropout, training)
    return (probs @ v).transpose(1, 2).reshape(b, t, width)


def _residual_dropout(
    x: torch.Tensor, rng: TensorParallelRNG | None, p: float, training: bool
) -> torch.Tensor:
    return rng.dropout(x, p, training) if rng is not None else x


class DenseEmbedding(nn.Module):
    """Token plus position embedding (stage 0): ids (batch, time) -> (batch, time, d_model)."""

    def __init__(
        self, vocab_size: int, d_model: int, context: int, rng: TensorParallelRNG | None, p: float
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.rng, self.dropout = rng, p

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2 or idx.shape[1] > self.pos_emb.num_embeddings:
            raise ValueError(
                f"idx must be (batch, time <= {self.pos_emb.num_embeddings}), got "
                f"{tuple(idx.shape)}"
            )
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        return _residual_dropout(x, self.rng, self.dropout, self.training)


class DenseAttention(nn.Module):
    """Causal self-attention with separate q, k (no bias), v projections and an output
    projection."""

    def __init__(self, d_model: int, n_heads: int, rng: TensorParallelRNG | None, p: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q = nn.Linear(d_model, d_model)
        # No key bias: softmax ignores it (q.b_k shifts a query's scores alike), so its gradient
        # is zero up to rounding, which Adam would normalise into noise-driven updates.
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.rng, self.dropout = rng, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = causal_attention(
            self.q(x), self.k(x), self.v(x), self.n_heads, self.rng, self.dropout, self.training
        )
        return self.proj(y)


class DenseMLP(nn.Module):
    """fc (d_model -> 4 d_model), GELU, out (4 d_model -> d_model)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.out = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class DenseBlock(nn.Module):
    """Pre-norm block: x + drop(attn(ln1(x))), then x + drop(mlp(ln2(x)))."""

    def __init__(self, d_model: int, n_heads: int, rng: TensorParallelRNG | None, p: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = DenseAttention(d_model, n_heads, rng, p)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = DenseMLP(d_model, 4 * d_model)
        self.rng, self.dropout = rng, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + _residual_dropout(self.attn(self.ln1(x)), self.rng, self.dropout, self.training)
        h = self.mlp(self.ln2(x))
        return x + _residual_dropout(h, self.rng, self.dropout, self.training)


class DenseHead(nn.Module):
    """Final LayerNorm and the LM head (last stage): (batch, time, d_model) -> logits."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


class DenseTransformer(nn.Module):
    """``stages = [DenseEmbedding, DenseBlock x n_layers, DenseHead]``; ``tie_weights`` shares
    the token embedding with the LM head."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        context: int = 32,
        *,
        tie_weights: bool = False,
        dropout: float = 0.0,
        rng: TensorParallelRNG | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("d_model", d_model),
            ("n_heads", n_heads),
            ("n_layers", n_layers),
            ("context", context),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        if dropout and rng is None:
            raise ValueError("dropout > 0 needs an rng (TensorParallelRNG) to draw masks from")
        self.vocab_size, self.d_model, self.n_heads = vocab_size, d_model, n_heads
        self.n_layers, self.context = n_layers, context
        self.tie_weights, self.dropout, self.seed = tie_weights, dropout, seed
        embedding = DenseEmbedding(vocab_size, d_model, context, rng, dropout)
        blocks = [DenseBlock(d_model, n_heads, rng, dropout) for _ in range(n_layers)]
        head = DenseHead(d_model, vocab_size)
        self.stages = nn.ModuleList([embedding, *blocks, head])
        self._reset_parameters(seed)
        if tie_weights:
            head.head.weight = embedding.tok_emb.weight

    @property
    def hparams(self) -> dict[str, object]:
        """The constructor's shape arguments (without the rng)."""
        return {
            "vocab_size": self.vocab_size,
            "d_model": self.d_model,
            "n_heads": self.n_heads,
            "n_layers": self.n_layers,
            "context": self.context,
            "tie_weights": self.tie_weights,
            "dropout": self.dropout,
            "seed": self.seed,
        }

    @torch.no_grad()
    def _reset_parameters(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        residual = set()
        for stage in self.stages:
            if isinstance(stage, DenseBlock):
                residual |= {id(stage.attn.proj), id(stage.mlp.out)}
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                std = 0.02 / math.sqrt(2 * self.n_layers) if id(module) in residual else 0.02
                module.weight.normal_(0.0, std, generator=gen)
                bias = getattr(module, "bias", None)
                if isinstance(bias, torch.Tensor):
                    bias.zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, time) -> logits (batch, time, vocab_size)."""
        x = idx
        for stage in self.stages:
            x = stage(x)
        return x

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``targets`` (same shape as ``idx``)."""
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, self.vocab_size), targets.reshape(-1))
