"""C-DP-002 with LoRA: a peft `get_peft_model` model trains on several CPU devices with only its
adapter gradients averaged; random ranks and targets.

peft initializes LoRA-B at zero, so the first step's LoRA-A gradient is zero on every replica:
parity with one replica on the whole batch is checked over the steps after it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paramsync.actors import DataParallelCoordinator

peft = pytest.importorskip("peft")

TARGETS = ("up", "mid", "down")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.down = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.mid(torch.tanh(self.up(x)))))


def lora_model(seed: int, rank: int, targets: tuple[str, ...]) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets))
    return peft.get_peft_model(Net(), config)


def loss_fn(model: torch.nn.Module, shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = shard
    return torch.nn.functional.cross_entropy(model(x), y)


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    devices=st.integers(1, 4),
    extra=st.integers(0, 12),
    rank=st.integers(1, 8),
    targets=st.sets(st.sampled_from(TARGETS), min_size=1).map(lambda s: tuple(sorted(s))),
    seed=st.integers(0, 2**16),
)
def test_lora_replicas_average_only_adapters_and_match_one_replica(
    devices: int, extra: int, rank: int, targets: tuple[str, ...], seed: int
) -> None:
    size = devices + extra
    factory = lambda: lora_model(seed, rank, targets)  # noqa: E731
    dp = DataParallelCoordinator(factory, adamw, loss_fn, ["cpu"] * devices)
    one = DataParallelCoordinator(factory, adamw, loss_fn, ["cpu"])
    try:
        assert dp.trainable_names and all("lora_" in n for n in dp.trainable_names)
        assert {n.split(".")[-4] for n in dp.trainable_names} == set(targets)
        assert dp.averaged_gradient.numel() == sum(
            p.numel() for p in dp.primary_pipeline.parameters() if p.requires_grad
        )
        base = {
            n: p.detach().clone()
            for n, p in dp.primary_pipeline.named_parameters()
            if not p.requires_grad
        }
        generator = torch.Generator().manual_seed(seed)
        for step in range(1, 8):
            x = torch.randn(size, 8, generator=generator)
            y = torch.randint(0, 3, (size,), generator=generator)
            result = dp.train_batch_parallel((x, y))
            reference = one.train_batch_parallel((x, y))
            assert result.checked
            named = [dict(m.named_parameters()) for m in dp.replicas]
            for name in dp.trainable_names:
                for other in named[1:]:
                    assert torch.equal(other[name], named[0][name]), (step, name)
            for replica in named:
                for name, value in base.items():
                    assert torch.equal(replica[name], value), (step, name)
            if step > 1:
                assert result.loss == pytest.approx(reference.loss, rel=1e-4, abs=1e-6)
                for name, param in one.primary_pipeline.named_parameters():
                    # atol 1e-4 (1 % of lr): Adam divides by sqrt(v), so an element whose
                    # gradient sits near zero turns the shard sum's float reassociation into a
                    # step difference of that order (seen: 2.1e-5 at devices=2, extra=1,
                    # rank=4, targets=('up',), seed=2661); the replicas stay bitwise equal.
                    torch.testing.assert_close(named[0][name], param, rtol=1e-4, atol=1e-4)
        # the adapters moved: LoRA-B left zero after the first step
        assert any(p.abs().sum() > 0 for n, p in named[0].items() if "lora_B" in n)
    finally:
        dp.close()
        one.close()


def test_the_demos_adapter_state_is_only_the_adapters_and_its_digest_sees_every_bit() -> None:
    from paramsync.actors.demo_job.lora_job import adapter_state, digest_of

    model = lora_model(3, 4, ("up", "down"))
    state = adapter_state(model)
    assert state and all("lora_" in name for name in state)
    assert sum(t.numel() for t in state.values()) == sum(
        p.numel() for p in model.parameters() if p.requires_grad
    )
    before = digest_of(state)
    assert digest_of(adapter_state(model)) == before
    target = next(p for p in model.parameters() if p.requires_grad)  # a LoRA tensor
    with torch.no_grad():  # one bit of one element
        target.view(-1)[0] = torch.nextafter(target.view(-1)[0], torch.tensor(1e9))
    assert digest_of(adapter_state(model)) != before
