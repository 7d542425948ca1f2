"""Gradient clipping by global norm (``TrainerOptions.clip_grad_norm``): after the all-reduce,
before the optimizer step, on the averaged gradients.

* Parity: N workers (1..4) with B samples each reach the weights, the optimizer state and the
  per-step gradient norms of ONE plain-torch process that trains rank 0's initial model on the
  concatenated N*B batch and calls `torch.nn.utils.clip_grad_norm_` before each step, for the
  2-norm and the inf-norm, with and without gradient accumulation. The max norm is small enough
  that every step clips.
* Every rank reports bitwise the same norm (its inputs, the averaged gradients, are identical),
  in ``grad_norms``, the summary and the trace's optimizer spans.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import trio
from test_trainer import (
    OPTIMIZERS,
    PER_RANK,
    RUN_SECONDS,
    STEPS,
    clone_state,
    mlp,
    mse_loss,
    optimizer_tensors,
    raw,
    regression_batches,
    split,
)
from torch import nn

from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions
from paramsync.actors.train.worker import train_in_process
from paramsync.runtime.observe.trace import TraceRecorder

MAX_NORM = 0.05
"""Below every step's gradient norm in these runs: each step really clips."""


def reference_clipped(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, ...]],
    max_norm: float,
    norm_type: float,
) -> list[float]:
    """Plain single-process torch with clipping; returns each step's norm before clipping."""
    norms = []
    for batch in batches:
        optimizer.zero_grad()
        mse_loss(model, batch).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)))
        optimizer.step()
    return norms


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
@pytest.mark.parametrize("accumulation_steps", [1, 2], ids=["no-accum", "accum2"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
async def test_clipping_parity_with_single_process_torch(
    world_size: int, accumulation_steps: int, norm_type: float
) -> None:
    batches = regression_batches(world_size)
    options = TrainerOptions(
        bucket_bytes=64,  # several buckets: the norm spans all of them
        accumulation_steps=accumulation_steps,
        clip_grad_norm=MAX_NORM,
        clip_norm_type=norm_type,
    )

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(rank, widths=(5, 8, 3))
        return model, OPTIMIZERS["sgd-momentum"](model.parameters())

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        rank = trainer.dist_config.rank
        for batch in batches:
            await trainer.train_batch(split(batch, rank, PER_RANK))
        return {
            "params": clone_state(trainer.model),
            "optim": optimizer_tensors(trainer.model, trainer.run.optimizer),
            "norms": list(trainer.grad_norms),
            "summary": trainer.summary()["final_grad_norm"],
        }

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(world_size, make_replica, mse_loss, body, options=options)

    reference = mlp(0, widths=(5, 8, 3))
    ref_optimizer = OPTIMIZERS["sgd-momentum"](reference.parameters())
    ref_norms = reference_clipped(reference, ref_optimizer, batches, MAX_NORM, norm_type)
    assert min(ref_norms) > MAX_NORM, "the test must clip at every step"
    ref_params, ref_optim = clone_state(reference), optimizer_tensors(reference, ref_optimizer)

    for rank, result in enumerate(results):
        assert [step for step, _ in result["norms"]] == list(range(STEPS))
        assert [norm for _, norm in result["norms"]] == pytest.approx(ref_norms, rel=1e-5)
        assert result["summary"] == result["norms"][-1][1]
        for name, value in ref_params.items():
            torch.testing.assert_close(
                result["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}"
            )
        for name, value in ref_optim.items():
            torch.testing.assert_close(
                result["optim"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}"
            )
        # Identical on every rank, bit for bit: the norm and the clipped result.
        assert result["norms"] == results[0]["norms"], f"rank {rank} saw another norm"
        for name, value in result["params"].items():
            assert raw(value) == raw(results[0]["params"][name]), f"rank {rank} {name} differs"


async def test_no_clipping_records_no_norm_and_leaves_gradients_alone() -> None:
    """Without ``clip_grad_norm`` the step is torch's plain one: no norm computed or kept."""
    batches = regression_batches(2)

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(rank)
        return model, OPTIMIZERS["sgd-momentum"](model.parameters())

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        rank = trainer.dist_config.rank
        for batch in batches:
            await trainer.train_batch(split(batch, rank, PER_RANK))
        return {"params": clone_state(trainer.model), "trainer": trainer}

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(2, make_replica, mse_loss, body)
    reference = mlp(0)
    ref_optimizer = OPTIMIZERS["sgd-momentum"](reference.parameters())
    for batch in batches:
        ref_optimizer.zero_grad()
        mse_loss(reference, batch).backward()
        ref_optimizer.step()
    for result in results:
        assert result["trainer"].grad_norms == []
        assert result["trainer"].summary()["final_grad_norm"] is None
        for name, value in clone_state(reference).items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6)


async def test_the_norm_is_in_the_optimizer_span_of_the_trace() -> None:
    traces: dict[int, TraceRecorder] = {}
    batches = regression_batches(2)

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(rank)
        return model, OPTIMIZERS["adam"](model.parameters())

    async def body(trainer: DistributedTrainer) -> list[tuple[int, float]]:
        trainer.supervisor.live_epoch().optimizer.trace = traces.setdefault(
            trainer.run.rank, TraceRecorder()
        )
        rank = trainer.dist_config.rank
        for batch in batches:
            await trainer.train_batch(split(batch, rank, PER_RANK))
        return list(trainer.grad_norms)

    options = TrainerOptions(clip_grad_norm=MAX_NORM)
    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(2, make_replica, mse_loss, body, options=options)
    assert results[0] == results[1] and len(results[0]) == STEPS
    for rank, trace in traces.items():
        spans = [e for e in trace.events() if e.get("name") == "optimizer"]
        traced = {e["args"]["step"]: e["args"]["grad_norm"] for e in spans}
        assert traced == dict(results[rank]), traced


def test_clipping_options_are_checked() -> None:
    with pytest.raises(ValueError, match="clip_grad_norm"):
        TrainerOptions(clip_grad_norm=0.0)
    with pytest.raises(ValueError, match="clip_grad_norm"):
        TrainerOptions(clip_grad_norm=-1.0)
    with pytest.raises(ValueError, match="clip_norm_type"):
        TrainerOptions(clip_grad_norm=1.0, clip_norm_type=0.0)
    assert TrainerOptions(clip_grad_norm=1.0, clip_norm_type=math.inf).clip_norm_type == math.inf
