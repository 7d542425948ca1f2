"""Activation checkpointing (`paramsync.actors.parallel.checkpointing`): activations recomputed in
backward with the RNG replayed, so dropout gradients are bitwise the unwrapped model's (global RNG
and an extra tracker's); the bytes held for backward measured with and without."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paramsync.actors.parallel.checkpointing import (
    CheckpointedBlock,
    SavedTensorMeter,
    checkpoint_blocks,
)


class GeneratorTracker:
    """A stand-in for the tensor-parallel RNG tracker: named generators, states as a dict."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {"tensor-parallel": self.generator.get_state()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(states["tensor-parallel"])


class TrackerDropout(nn.Module):
    def __init__(self, p: float, tracker: GeneratorTracker) -> None:
        super().__init__()
        self.p, self.tracker = p, tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(x.shape, generator=self.tracker.generator) >= self.p
        return x * keep / (1 - self.p)


class Block(nn.Module):
    """Pre-norm transformer block with dropout after attention and in the MLP."""

    def __init__(self, d: int, heads: int, dropout: nn.Module) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Transformer(nn.Module):
    def __init__(self, blocks: list[nn.Module], d: int = 32, vocab: int = 50) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make(n_blocks: int = 4, tracker: GeneratorTracker | None = None) -> Transformer:
    torch.manual_seed(7)
    blocks = [
        Block(32, 4, nn.Dropout(0.2) if tracker is None else TrackerDropout(0.2, tracker))
        for _ in range(n_blocks)
    ]
    return Transformer(blocks)


def checkpointed(model: Transformer, **options: Any) -> Transformer:
    wrapped = copy.deepcopy(model)
    wrapped.blocks = checkpoint_blocks(list(wrapped.blocks), **options)
    return wrapped


def grads(model: nn.Module, seed: int, steps: int = 2) -> list[torch.Tensor]:
    """Loss gradients over ``steps`` forward/backward passes (accumulated), seeded."""
    torch.manual_seed(seed)
    idx = torch.randint(0, 50, (4, 16))
    model.zero_grad(set_to_none=True)
    for _ in range(steps):
        loss = F.cross_entropy(model(idx).reshape(-1, 50), idx.roll(-1, 1).reshape(-1))
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("every", [1, 2, 3])
def test_dropout_gradients_equal_the_unwrapped_model(every: int) -> None:
    plain = make()
    wrapped = checkpointed(plain, every=every)
    assert len(wrapped.blocks) == -(-4 // every)
    want, got = grads(plain, 3), grads(wrapped, 3)
    assert len(want) == len(got)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    different = grads(plain, 4)  # another seed: other masks, so the test can tell
    assert not all(torch.equal(a, b) for a, b in zip(want, different, strict=True))


def test_an_rng_tracker_is_replayed_in_the_recomputation() -> None:
    tracker = GeneratorTracker(99)
    plain = make(tracker=tracker)
    tracker.generator.manual_seed(5)
    want = grads(plain, 3)
    after_plain = tracker.generator.get_state()

    wrapped = checkpointed(plain, rng_tracker=tracker)
    for block in wrapped.blocks:  # the deep copy made its own tracker: share the real one
        for module in block.modules():
            if isinstance(module, TrackerDropout):
                module.tracker = tracker
    tracker.generator.manual_seed(5)
    got = grads(wrapped, 3)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    # the recomputation left the tracker where the plain run left it
    assert torch.equal(tracker.generator.get_state(), after_plain)

    unhooked = checkpointed(plain)  # no tracker: the recomputation draws new masks
    for block in unhooked.blocks:
        for module in block.modules():
            if isinstance(module, TrackerDropout):
                module.tracker = tracker
    tracker.generator.manual_seed(5)
    wrong = grads(unhooked, 3)
    assert not all(torch.equal(a, b) for a, b in zip(want, wrong, strict=True))


def saved_bytes(model: Transformer) -> tuple[int, torch.Tensor]:
    torch.manual_seed(3)
    idx = torch.randint(0, 50, (4, 16))
    with SavedTensorMeter(model.parameters()) as meter:
        loss = F.cross_entropy(model(idx).reshape(-1, 50), idx.roll(-1, 1).reshape(-1))
    loss.backward()
    return meter.bytes, loss.detach()


@pytest.mark.parametrize("n_blocks", [2, 4])
def test_checkpointing_holds_fewer_bytes_for_backward(n_blocks: int) -> None:
    plain = make(n_blocks)
    wrapped = checkpointed(plain)
    without, loss_plain = saved_bytes(plain)
    with_, loss_wrapped = saved_bytes(wrapped)
    assert torch.equal(loss_plain, loss_wrapped)
    block_input = 4 * 16 * 32 * 4  # batch x time x d_model float32
    assert with_ < without / 3
    # What remains: one input per block, and the embedding's and head's own saves.
    assert with_ >= n_blocks * block_input
    per_block = (without - with_) / n_blocks
    assert per_block > 10 * block_input  # a block's activations: many times its input
    again, _ = saved_bytes(checkpointed(plain))
    assert again == with_  # deterministic


def test_disabled_and_no_grad_run_plainly() -> None:
    plain = make(2)
    wrapped = checkpointed(plain, enabled=False)
    assert saved_bytes(wrapped)[0] == saved_bytes(plain)[0]
    live = checkpointed(plain)
    plain.eval()
    live.eval()
    idx = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        assert torch.equal(live(idx), plain(idx))


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="every"):
        checkpoint_blocks([nn.Linear(2, 2)], every=0)
    with pytest.raises(TypeError, match="get_states"):
        CheckpointedBlock(nn.Linear(2, 2), rng_tracker=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one block"):
        CheckpointedBlock([])
