"""Tests for paramsync.actors.demo_job.model: shapes, causality, seeded determinism, and that it
learns."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from paramsync.actors.demo_job.model import CharTransformer


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: these models are tiny, and spare threads only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SMALL = {"vocab_size": 11, "d_model": 32, "n_heads": 4, "n_layers": 2, "context": 16}


def test_forward_shapes_and_loss_near_uniform_at_init() -> None:
    model = CharTransformer(**SMALL)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 11, (3, 16), generator=gen)
    targets = torch.randint(0, 11, (3, 16), generator=gen)
    assert model(idx).shape == (3, 16, 11)
    assert model(idx[:, :5]).shape == (3, 5, 11)
    loss = model.loss(idx, targets)
    assert loss.shape == ()
    assert abs(loss.item() - math.log(11)) < 0.3


def test_causality_future_tokens_do_not_change_earlier_logits() -> None:
    model = CharTransformer(**SMALL).eval()
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 11, (2, 16), generator=gen)
    changed = idx.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % 11
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_same_seed_same_weights_regardless_of_global_rng() -> None:
    torch.manual_seed(123)
    a = CharTransformer(**SMALL, seed=7)
    torch.manual_seed(456)
    b = CharTransformer(**SMALL, seed=7)
    c = CharTransformer(**SMALL, seed=8)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_rebuild_from_hparams_is_identical() -> None:
    a = CharTransformer(**SMALL, tie_weights=False, seed=3)
    b = CharTransformer(**a.hparams)
    assert a.hparams == b.hparams
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_tied_weights_share_one_matrix() -> None:
    tied = CharTransformer(**SMALL, tie_weights=True)
    untied = CharTransformer(**SMALL, tie_weights=False)
    assert tied.head.weight is tied.tok_emb.weight
    assert untied.head.weight is not untied.tok_emb.weight
    assert untied.num_parameters() - tied.num_parameters() == 11 * 32


def test_init_statistics() -> None:
    model = CharTransformer(vocab_size=50, d_model=64, n_heads=4, n_layers=2, context=32)
    assert 0.015 < model.tok_emb.weight.std().item() < 0.025
    assert model.blocks[0].attn.qkv.bias.abs().sum().item() == 0
    assert torch.all(model.ln_f.weight == 1)
    assert model.blocks[0].out.weight.std().item() < 0.015


@pytest.mark.parametrize(
    "kwargs",
    [
        {**SMALL, "vocab_size": 0},
        {**SMALL, "n_heads": 5},
        {**SMALL, "context": True},
        {**SMALL, "d_model": 3.0},
    ],
)
def test_bad_hyperparameters(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        CharTransformer(**kwargs)


def test_bad_inputs() -> None:
    model = CharTransformer(**SMALL)
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="batch, time"):
        model(torch.zeros(16, dtype=torch.long))
    with pytest.raises(ValueError, match="targets shape"):
        model.loss(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long))


def test_loss_falls_with_adam_on_repetitive_text() -> None:
    text = "hello world, " * 40
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    model = CharTransformer(len(chars), d_model=32, n_heads=2, n_layers=1, context=16, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        starts = torch.randint(0, len(data) - 17, (8,), generator=gen)
        x = torch.stack([data[s : s + 16] for s in starts])
        y = torch.stack([data[s + 1 : s + 17] for s in starts])
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 2.0
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]


def test_generate_greedy_is_deterministic_and_slides_window() -> None:
    model = CharTransformer(**SMALL)
    start = torch.zeros(1, 1, dtype=torch.long)
    out = model.generate(start, 20, temperature=0)
    assert out.shape == (1, 21)
    assert torch.equal(out, model.generate(start, 20, temperature=0))
    sampled = model.generate(start, 5, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (1, 6)
    assert int(sampled.max()) < 11
