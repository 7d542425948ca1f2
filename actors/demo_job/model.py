"""A small character-level decoder-only transformer language model in plain torch.

Small on purpose: with the defaults (d_model 128, 4 heads, 2 layers, context 64) one training
step on a 16 x 64 batch takes tens of milliseconds on one CPU core, so a coordinator and four
workers can train it visibly on a laptop. Initialisation draws only from a seeded
``torch.Generator``, so every rank builds bit-identical weights from the same seed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CausalSelfAttention", "Block", "CharTransformer"]


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees only positions <= t."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, time, d_model) -> (batch, time, d_model)."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_heads, c // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, time, d_model) -> (batch, time, d_model)."""
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharTransformer(nn.Module):
    """Decoder-only transformer over a character vocabulary.

    ``tie_weights`` shares the token embedding with the output projection (fewer parameters
    to synchronise). ``seed`` fixes the initial weights independently of torch's global RNG.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 128,
        n_heads: int = 4,
        n_layers: int = 2,
        context: int = 64,
        *,
        tie_weights: bool = True,
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
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_layers = n_layers
        self.context = context
        self.tie_weights = tie_weights
        self.seed = seed
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.tok_emb.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Re-draw every weight from ``seed`` (GPT-2 style: N(0, 0.02), residual outputs
        scaled by 1/sqrt(2 * n_layers), zero biases, unit LayerNorm gains)."""
        gen = torch.Generator().manual_seed(seed)
        blocks = [block for block in self.blocks if isinstance(block, Block)]
        residual = {id(b.attn.proj) for b in blocks} | {id(b.out) for b in blocks}
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.head and self.tie_weights:
                    continue
                std = 0.02 / math.sqrt(2 * self.n_layers) if id(module) in residual else 0.02
                module.weight.normal_(0.0, std, generator=gen)
                bias = getattr(module, "bias", None)
                if isinstance(bias, torch.Tensor):
                    bias.zero_()

    @property
    def hparams(self) -> dict[str, Any]:
        """The constructor arguments, to rebuild the same model elsewhere."""
        return {
            "vocab_size": self.vocab_size,
            "d_model": self.d_model,
            "n_heads": self.n_heads,
            "n_layers": self.n_layers,
            "context": self.context,
            "tie_weights": self.tie_weights,
            "seed": self.seed,
        }

    def num_parameters(self) -> int:
        """Number of distinct trainable scalars (a tied matrix counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, time) int64 -> next-token logits (batch, time, vocab_size)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, time), got shape {tuple(idx.shape)}")
        t = idx.shape[1]
        if not 1 <= t <= self.context:
            raise ValueError(f"sequence length {t} is outside 1..context ({self.context})")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats) of ``targets`` (same shape as ``idx``)."""
        if targets.shape != idx.shape:
            raise ValueError(
                f"targets shape {tuple(targets.shape)} != idx shape {tuple(idx.shape)}"
            )
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, self.vocab_size), targets.reshape(-1))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend ``idx`` (batch, time) by sampling ``max_new_tokens`` tokens; temperature 0
        means greedy. The window slides when the text outgrows the context."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.context :])[:, -1, :]
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
