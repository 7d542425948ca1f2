"""Parameters a step leaves without a gradient (``TrainerOptions.find_unused_parameters``).

The model is a trunk and head every sample uses plus ``K`` branches; each sample carries a mask
of the branches it uses, and a branch no sample of a micro-batch uses is not computed at all, so
its parameters get no gradient in that backward. Masks are random per step, per rank and (with
gradient accumulation) per micro-batch, so a branch may be used by every rank, by some ranks
only, or by none.

* Parity: N workers (1..4) with B samples each reach the weights and optimizer state of ONE
  plain-torch process that trains rank 0's initial model on the concatenated N*B batch with
  ``optimizer.zero_grad()`` (set_to_none) before each step. There a branch the whole batch
  leaves unused has ``.grad`` None and the optimizer skips it; a branch some shard used gets the
  mean gradient with zeros from the rest: exactly what the distributed step must reproduce
  (the same semantics as torch DDP's). AdamW's weight decay and Adam's moments would move a
  parameter stepped with a zero gradient instead, so matching the reference proves None.
* All ranks agree which parameters no rank used (`DistributedTrainer.unused_parameters`), and
  it is the set the reference left without a gradient.
* C-DDP-001 (hypothesis): after every step all ranks hold bitwise-identical parameters and
  optimizer state, for random models, masks (including none unused), buckets, accumulation
  and optimizers.
* Without the option such a step fails, naming the step and the parameters, and does not hang.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from test_trainer import (
    OPTIMIZERS,
    RUN_SECONDS,
    clone_state,
    optimizer_tensors,
    raw,
    run_expecting_failure,
    snapshot,
)
from torch import nn

from paramsync.actors.graph.compute import UnusedParametersError
from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions
from paramsync.actors.train.worker import train_in_process
from paramsync.runtime.errors import ActorFailed, pick_error
from paramsync.runtime.transport.tcp import TcpTransport

IN, HIDDEN, OUT = 4, 5, 3


class Branchy(nn.Module):
    """Trunk and head always used; ``branches`` used per sample by the batch's mask."""

    def __init__(self, seed: int, branches: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Linear(IN, HIDDEN)
        self.branches = nn.ModuleList(nn.Linear(HIDDEN, OUT) for _ in range(branches))
        self.head = nn.Linear(HIDDEN, OUT)


def branchy_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y, mask = batch
    hidden = torch.tanh(model.trunk(x))
    out = model.head(hidden)
    for k, branch in enumerate(model.branches):
        used = mask[:, k]
        if bool(used.any()):  # an unused branch is not even computed: no gradient at all
            out = out + branch(hidden) * used.unsqueeze(1)
    return ((out - y) ** 2).mean()


def make_batches(
    seed: int, world_size: int, per_rank: int, parts: int, branches: int, steps: int, p: float
) -> list[tuple[torch.Tensor, ...]]:
    """Whole-batch (x, y, mask) per step; each rank's shard is ``parts`` micro-batches, each
    using a random subset of the branches (each branch with probability ``p``)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        n = world_size * per_rank
        chunk = per_rank // parts
        subsets = (torch.rand(n // chunk, branches, generator=gen) < p).float()
        mask = subsets.repeat_interleave(chunk, dim=0)
        out.append((torch.randn(n, IN, generator=gen), torch.randn(n, OUT, generator=gen), mask))
    return out


def shard(batch: tuple[torch.Tensor, ...], rank: int, per_rank: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[rank * per_rank : (rank + 1) * per_rank] for t in batch)


def reference(
    branches: int, optimizer_name: str, batches: list[tuple[torch.Tensor, ...]]
) -> tuple[nn.Module, torch.optim.Optimizer, list[tuple[str, ...]]]:
    """One process on the concatenated batches; also each step's parameters without grad."""
    model = Branchy(0, branches)
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    unused_per_step = []
    for batch in batches:
        optimizer.zero_grad()
        branchy_loss(model, batch).backward()
        unused_per_step.append(
            tuple(sorted(name for name, p in model.named_parameters() if p.grad is None))
        )
        optimizer.step()
    return model, optimizer, unused_per_step


PER_RANK = 4
STEPS = 6
BRANCHES = 4


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd-nesterov"])
@pytest.mark.parametrize("accumulation_steps", [1, 2], ids=["no-accum", "accum2"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
async def test_unused_parameters_parity_with_single_process_torch(
    world_size: int, accumulation_steps: int, optimizer_name: str
) -> None:
    batches = make_batches(
        7 + world_size, world_size, PER_RANK, accumulation_steps, BRANCHES, STEPS, p=0.3
    )
    options = TrainerOptions(
        bucket_bytes=64, accumulation_steps=accumulation_steps, find_unused_parameters=True
    )

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = Branchy(rank, BRANCHES)
        return model, OPTIMIZERS[optimizer_name](model.parameters())

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        rank = trainer.dist_config.rank
        unused = []
        for batch in batches:
            await trainer.train_batch(shard(batch, rank, PER_RANK))
            unused.append(tuple(sorted(trainer.unused_parameters)))
        return {
            "params": clone_state(trainer.model),
            "optim": optimizer_tensors(trainer.model, trainer.run.optimizer),
            "unused": unused,
        }

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(
            world_size, make_replica, branchy_loss, body, options=options
        )

    ref_model, ref_optimizer, ref_unused = reference(BRANCHES, optimizer_name, batches)
    assert any(ref_unused), "the batches must leave some branch unused by every rank"
    if world_size > 1:  # ... and some branch used by one rank but not another
        assert any(
            len({bool(shard(b, r, PER_RANK)[2][:, k].any()) for r in range(world_size)}) == 2
            for b in batches
            for k in range(BRANCHES)
        )
    ref_params, ref_optim = clone_state(ref_model), optimizer_tensors(ref_model, ref_optimizer)
    for rank, result in enumerate(results):
        assert result["unused"] == ref_unused, f"rank {rank} disagrees on the unused parameters"
        for name, value in ref_params.items():
            torch.testing.assert_close(
                result["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}"
            )
        assert result["optim"].keys() == ref_optim.keys(), f"rank {rank}: optimizer state"
        for name, value in ref_optim.items():
            torch.testing.assert_close(
                result["optim"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}"
            )
        for name, value in result["params"].items():
            assert raw(value) == raw(results[0]["params"][name]), f"rank {rank} {name} differs"


@st.composite
def unused_cases(draw: st.DrawFn) -> dict[str, Any]:
    accumulation = draw(st.integers(1, 2))
    return {
        "world_size": draw(st.integers(1, 4)),
        "branches": draw(st.integers(1, 4)),
        "p": draw(st.sampled_from([0.0, 0.4, 1.0])),  # 1.0: nothing unused
        "bucket_bytes": draw(st.sampled_from([1, 60, 200, 1 << 20])),
        "accumulation": accumulation,
        "per_rank": accumulation * draw(st.integers(1, 2)),
        "optimizer": draw(st.sampled_from(sorted(OPTIMIZERS))),
        "steps": draw(st.integers(2, 4)),
        "seed": draw(st.integers(0, 2**16)),
        "transport": draw(st.sampled_from(["inproc", "tcp"])),
    }


async def run_unused_case(case: dict[str, Any]) -> None:
    n, per_rank = case["world_size"], case["per_rank"]
    batches = make_batches(
        case["seed"],
        n,
        per_rank,
        case["accumulation"],
        case["branches"],
        case["steps"],
        case["p"],
    )

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = Branchy(case["seed"] + rank, case["branches"])
        return model, OPTIMIZERS[case["optimizer"]](model.parameters())

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        rank = trainer.dist_config.rank
        history = []
        for batch in batches:
            await trainer.train_batch(shard(batch, rank, per_rank))
            await trainer.verified()  # the step's digest check is done
            history.append((snapshot(trainer), trainer.unused_parameters))
        return {"history": history, "step": trainer.step}

    options = TrainerOptions(
        bucket_bytes=case["bucket_bytes"],
        accumulation_steps=case["accumulation"],
        find_unused_parameters=True,
    )
    with trio.fail_after(RUN_SECONDS):
        if case["transport"] == "tcp":
            async with TcpTransport.open_group(n) as transports:
                results = await train_in_process(
                    n,
                    make_replica,
                    branchy_loss,
                    body,
                    options=options,
                    transports=list(transports),
                )
        else:
            results = await train_in_process(n, make_replica, branchy_loss, body, options=options)

    for rank, result in enumerate(results):
        assert result["step"] == case["steps"]
        for step, ((mine, unused), (ref, ref_unused)) in enumerate(
            zip(result["history"], results[0]["history"])
        ):
            assert unused == ref_unused, f"rank {rank} step {step}: unused {unused}"
            assert mine["digest"] == ref["digest"], f"rank {rank} diverged at step {step}"
            assert mine["reported"] == mine["digest"], "the trainer reported another digest"
            assert mine["tensors"] == ref["tensors"], f"rank {rank} step {step} differs"


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=unused_cases())
def test_c_ddp_001_with_unused_parameters(case: dict[str, Any]) -> None:
    note(repr(case))
    trio.run(run_unused_case, case)


async def test_without_the_option_the_step_fails_naming_the_parameters() -> None:
    """Step 0 uses every branch; step 1 leaves branch 1 unused on rank 1: the step fails with
    the step and that branch's parameters named, and the run does not hang."""

    def batch(step: int, rank: int) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(step)
        mask = torch.ones(2, 2)
        if step == 1 and rank == 1:
            mask[:, 1] = 0.0
        return torch.randn(2, IN, generator=gen), torch.randn(2, OUT, generator=gen), mask

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = Branchy(rank, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    async def body(trainer: DistributedTrainer) -> None:
        for step in range(3):
            await trainer.train_batch(batch(step, trainer.run.rank))

    error = await run_expecting_failure(
        lambda: train_in_process(2, make_replica, branchy_loss, body), seconds=15
    )
    picked = pick_error(error)
    assert isinstance(picked, ActorFailed) and picked.actor == "compute", repr(error)
    cause = picked.__cause__
    assert isinstance(cause, UnusedParametersError), repr(cause)
    assert cause.step == 1
    assert cause.names == ["branches.1.bias", "branches.1.weight"]
    assert "step 1" in str(picked) and "branches.1.weight" in str(picked)
    assert "find_unused_parameters" in str(picked)


async def test_a_parameter_no_rank_uses_keeps_no_gradient_and_no_optimizer_state() -> None:
    """A branch never used anywhere: with the option the run trains; the branch's weights and
    optimizer state are never touched (AdamW would decay them if it saw a zero gradient), and
    after each step its gradient is its zeroed bucket view again."""
    batches = [
        (torch.randn(4, IN), torch.randn(4, OUT), torch.tensor([[1.0, 0.0]] * 4)) for _ in range(3)
    ]

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = Branchy(rank, 2)
        return model, OPTIMIZERS["adamw"](model.parameters())

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        start = clone_state(trainer.model)
        for batch in batches:
            await trainer.train_batch(shard(batch, trainer.run.rank, 2))
            grads = {n: p.grad for n, p in trainer.model.named_parameters()}
            assert all(g is not None and not g.any() for g in grads.values())
        return {
            "start": start,
            "end": clone_state(trainer.model),
            "optim": optimizer_tensors(trainer.model, trainer.run.optimizer),
            "unused": trainer.unused_parameters,
        }

    options = TrainerOptions(bucket_bytes=1, find_unused_parameters=True)
    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(2, make_replica, branchy_loss, body, options=options)
    for result in results:
        assert result["unused"] == ("branches.1.bias", "branches.1.weight")
        for name in ("branches.1.weight", "branches.1.bias"):
            assert torch.equal(result["end"][name], result["start"][name]), name
            assert not any(key.startswith(f"{name}/") for key in result["optim"]), name
        assert not torch.equal(
            result["end"]["branches.0.weight"], result["start"]["branches.0.weight"]
        )


async def test_gradients_set_to_none_between_steps_are_packed_with_zeros_for_unused() -> None:
    """A user who drops the gradients between steps (``zero_grad(set_to_none=True)``) leaves
    them out of the bucket buffers: a bucket is then packed, an unused parameter's missing
    gradient as zeros, and the result still matches the reference."""
    world_size = 2
    batches = make_batches(3, world_size, PER_RANK, 1, BRANCHES, STEPS, p=0.3)

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = Branchy(rank, BRANCHES)
        return model, OPTIMIZERS["adamw"](model.parameters())

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        for batch in batches:
            trainer.run.optimizer.zero_grad(set_to_none=True)
            await trainer.train_batch(shard(batch, trainer.run.rank, PER_RANK))
        return {"params": clone_state(trainer.model)}

    options = TrainerOptions(bucket_bytes=200, find_unused_parameters=True)
    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(
            world_size, make_replica, branchy_loss, body, options=options
        )
    ref_model, _, ref_unused = reference(BRANCHES, "adamw", batches)
    assert any(ref_unused)
    for rank, result in enumerate(results):
        for name, value in clone_state(ref_model).items():
            torch.testing.assert_close(
                result["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}"
            )
