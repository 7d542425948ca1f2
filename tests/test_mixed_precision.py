"""Mixed precision: autocast in the compute actor, and a loss scaler whose overflow decision is
agreed by every rank.

* Parity (as tests/test_trainer.py's): N = 1..4 workers training under bfloat16 autocast on the
  CPU reach, within bfloat16's tolerance, the weights of ONE process training rank 0's initial
  model under the same autocast on the concatenated batch; and bitwise the same weights as each
  other. A float32 run of the same job lands measurably farther from that reference than the
  bfloat16 runs: the workers really computed in bfloat16.
* The loss scaler (float16 autocast; torch runs `GradScaler` on the CPU too, so the code path
  meant for CUDA runs here): parity with a single process stepping through its own scaler.
* Overflow: one rank's batch overflows float16 at one step. Its peers' own gradients are finite,
  yet every rank skips that same step (the decision is taken on the averaged gradients), the
  scale backs off identically everywhere, and the weights match the single-process reference,
  which skipped it too.
* The decision is checked, not assumed: a rank whose scaler decides otherwise (here it alone
  sees an overflow) makes the coordinator abort the run for diverged digests, naming the
  scaler's digest entry when nothing else differs.
* The scaler's state travels with the training state: captured and restored (checkpoints), in a
  live state transfer, and refused when one side has a scaler and the other none.
* Options: bad dtypes and a scaler without float16 are refused up front; a device without the
  dtype's autocast is refused naming it. CUDA tests run only where CUDA is available.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio
from torch import nn

from paramsync.actors.graph.precision import GRAD_SCALER_DIGEST_ENTRY, MixedPrecision
from paramsync.actors.state.checkpoint import CheckpointStore
from paramsync.actors.state.training_state import (
    StateMismatch,
    capture_state,
    restore_state,
    saved_grad_scaler,
)
from paramsync.actors.train.state_moves import receive_training_state, send_training_state
from paramsync.actors.train.state_transfer import receive_state, send_state
from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions
from paramsync.actors.train.worker import train_in_process
from paramsync.runtime.coordinator.service import CoordinatorOptions
from paramsync.runtime.errors import ProtocolError
from paramsync.runtime.transport.base import InProcessTransport

RUN_SECONDS = 60.0
"""Deadline of one whole run: far beyond a healthy run of these tiny models on 2 cores."""

STEPS = 5
PER_RANK = 4
WIDTHS = (6, 16, 4)


# --------------------------------------------------------------------------- helpers


def mlp(seed: int) -> nn.Sequential:
    """A Tanh MLP whose initial weights depend only on ``seed`` (float32 parameters)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(WIDTHS)):
        if i:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x).float() - y) ** 2).mean()


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batches(world_size: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 * seed + world_size)
    n = world_size * PER_RANK
    return [
        (torch.randn(n, WIDTHS[0], generator=gen), torch.randn(n, WIDTHS[-1], generator=gen))
        for _ in range(STEPS)
    ]


def shard(batch: tuple[torch.Tensor, ...], position: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[position * PER_RANK : (position + 1) * PER_RANK] for t in batch)


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def reference(
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype | None,
    scaler: torch.amp.GradScaler | None = None,
    clip: float | None = None,
) -> dict[str, Any]:
    """ONE plain-torch process: rank 0's initial model, a step per whole batch, under
    ``dtype`` autocast (None: float32), through ``scaler`` if given, clipping the gradients'
    norm to ``clip`` (unscaled first, torch's recipe) if given."""
    model = mlp(100)
    optimizer = sgd(model)
    losses, scales = [], []
    for batch in batches:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = mse_loss(model, batch)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            if clip is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        losses.append(float(loss.detach()))
    return {"params": params(model), "losses": losses, "scales": scales}


async def run_job(
    world_size: int,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    options: TrainerOptions,
    *,
    tamper: Callable[[DistributedTrainer], None] | None = None,
    coordinator_options: CoordinatorOptions | None = None,
    verify_each_step: bool = False,
    make_replica: Callable[[int], tuple[nn.Module, torch.optim.Optimizer]] | None = None,
) -> list[dict[str, Any]]:
    """``world_size`` workers (rank r starts from ``mlp(100 + r)``) train one step per batch on
    their shards; each returns its losses, scales and skipped steps, and its final weights.
    ``verify_each_step``: wait for each step's commit (and any re-sync) before recording."""

    def fresh_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(100 + rank)
        return model, sgd(model)

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        if tamper is not None:
            tamper(trainer)
        losses, scales, weights = [], [], []
        for batch in data:
            losses.append(await trainer.train_batch(shard(batch, trainer.supervisor.position)))
            if verify_each_step:
                await trainer.verified()
            scaler = trainer.run.grad_scaler
            scales.append(scaler.get_scale() if scaler is not None else None)
            weights.append(params(trainer.model))
        await trainer.verified()
        return {
            "losses": losses,
            "scales": scales,
            "weights": weights,
            "params": params(trainer.model),
            "skipped": list(trainer.skipped_steps),
            "summary": trainer.summary(),
            "state": capture_state(
                trainer.model,
                trainer.run.optimizer,
                trainer.step,
                grad_scaler=trainer.run.grad_scaler,
            ),
        }

    with trio.fail_after(RUN_SECONDS):
        return await train_in_process(
            world_size,
            make_replica or fresh_replica,
            mse_loss,
            body,
            options=options,
            coordinator_options=coordinator_options,
        )


def first_loss(
    data: list[tuple[torch.Tensor, torch.Tensor]], position: int, dtype: torch.dtype | None
) -> float:
    """The loss of rank 0's initial model on ``position``'s first shard, under ``dtype``
    autocast (None: float32)."""
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        return float(mse_loss(mlp(100), shard(data[0], position)))


def assert_ranks_identical(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        for name, value in result["params"].items():
            assert raw(value) == raw(results[0]["params"][name]), f"rank {rank} {name} differs"


INIT_SCALE = 2.0**8
"""Small enough that these losses' scaled gradients stay finite in float16 for 5 steps."""

SCALED = TrainerOptions(
    autocast_dtype="float16",
    grad_scaler=True,
    grad_scaler_init_scale=INIT_SCALE,
    grad_scaler_growth_interval=2,
)
"""float16 autocast with a loss scaler that doubles its scale every second good step."""


def scaler() -> torch.amp.GradScaler:
    """The single-process reference's scaler, configured as `SCALED`'s."""
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)


# --------------------------------------------------------------------------- options


def test_options_refuse_bad_mixed_precision_settings() -> None:
    with pytest.raises(ValueError, match="autocast_dtype must be one of"):
        TrainerOptions(autocast_dtype="float8")
    with pytest.raises(ValueError, match='needs autocast_dtype="float16"'):
        TrainerOptions(grad_scaler=True)
    with pytest.raises(ValueError, match='needs autocast_dtype="float16"'):
        TrainerOptions(autocast_dtype="bfloat16", grad_scaler=True)
    with pytest.raises(ValueError, match="grad_scaler_init_scale"):
        TrainerOptions(autocast_dtype="float16", grad_scaler=True, grad_scaler_init_scale=0.0)
    with pytest.raises(ValueError, match="grad_scaler_growth_interval"):
        TrainerOptions(autocast_dtype="float16", grad_scaler=True, grad_scaler_growth_interval=0)
    with pytest.raises(ValueError, match="grad_scaler_growth_tracker"):
        TrainerOptions(autocast_dtype="float16", grad_scaler=True, grad_scaler_growth_tracker=-1)
    TrainerOptions(autocast_dtype="float16", grad_scaler=True)  # accepted


def test_a_device_without_the_autocast_dtype_is_refused_naming_it() -> None:
    on_meta = nn.Linear(3, 2, device="meta")
    with pytest.raises(ValueError, match="no bfloat16 autocast on 'meta'"):
        MixedPrecision.for_model(on_meta, "bfloat16")
    assert MixedPrecision.for_model(mlp(0), None) is None
    cpu = MixedPrecision.for_model(mlp(0), "bfloat16")
    assert cpu is not None and (cpu.device_type, cpu.dtype, cpu.scaler) == (
        "cpu",
        torch.bfloat16,
        None,
    )


def test_float16_on_cpu_is_accepted_only_where_torch_has_it() -> None:
    """This torch has float16 CPU autocast: accepted, and it really computes in float16."""
    with torch.autocast("cpu", dtype=torch.float16):
        has_it = (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16
    if not has_it:
        with pytest.raises(ValueError, match=r'no float16 autocast on .cpu. \(use "bfloat16"\)'):
            MixedPrecision.for_model(mlp(0), "float16")
        return
    precision = MixedPrecision.for_model(mlp(0), "float16", grad_scaler=True)
    assert precision is not None and precision.scaler is not None
    assert precision.scaler.is_enabled() and precision.scaler.get_scale() == 2.0**16
    with precision.autocast():
        assert mlp(0)(torch.ones(1, WIDTHS[0])).dtype == torch.float16


def test_unscale_before_the_step_is_not_undone_by_it() -> None:
    """What clipping by norm needs: the true gradients before the step, unscaled once."""
    precision = MixedPrecision.for_model(mlp(0), "float16", grad_scaler=True, init_scale=8.0)
    assert precision is not None and precision.scaler is not None
    batch = batches(1)[0]
    plain, scaled = mlp(0), mlp(0)
    with precision.autocast():
        mse_loss(plain, batch).backward()
        loss = mse_loss(scaled, batch)
    precision.scaled(loss).backward()
    optimizer = torch.optim.SGD(scaled.parameters(), lr=0.1)
    precision.unscale(optimizer)
    for a, b in zip(plain.parameters(), scaled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-5)
    after_unscale = [p.grad.clone() for p in scaled.parameters()]
    expected = [p.detach() - 0.1 * g for p, g in zip(scaled.parameters(), after_unscale)]
    assert precision.step(optimizer) is False
    for param, want in zip(scaled.parameters(), expected):
        torch.testing.assert_close(param.detach(), want)


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
async def test_bfloat16_autocast_parity_with_single_process_torch(world_size: int) -> None:
    data = batches(world_size)
    results = await run_job(world_size, data, TrainerOptions(autocast_dtype="bfloat16"))
    want = reference(data, torch.bfloat16)
    assert_ranks_identical(results)
    for rank, result in enumerate(results):
        for name, value in want["params"].items():
            torch.testing.assert_close(
                result["params"][name], value, rtol=2e-2, atol=2e-3, msg=f"rank {rank} {name}"
            )
        assert result["skipped"] == [] and result["scales"] == [None] * STEPS
    mean_losses = [sum(r["losses"][s] for r in results) / world_size for s in range(STEPS)]
    assert mean_losses == pytest.approx(want["losses"], rel=2e-2, abs=1e-3)
    # The workers did compute in bfloat16: each rank's first loss (from rank 0's initial
    # weights, on its shard) is exactly the bfloat16 autocast loss, not the float32 one.
    for rank, result in enumerate(results):
        assert result["losses"][0] == first_loss(data, rank, torch.bfloat16), f"rank {rank}"
        assert result["losses"][0] != first_loss(data, rank, None), f"rank {rank}"


@pytest.mark.parametrize(
    ("world_size", "accumulation_steps"), [(1, 1), (3, 1), (2, 2)], ids=["1", "3", "2-accum2"]
)
async def test_float16_with_grad_scaler_parity_with_single_process_torch(
    world_size: int, accumulation_steps: int
) -> None:
    """With accumulation, every micro-batch's loss is scaled by the same scale (it changes only
    at the optimizer step) and the accumulated gradients are averaged as usual."""
    data = batches(world_size, seed=1)
    options = dataclasses.replace(SCALED, accumulation_steps=accumulation_steps)
    results = await run_job(world_size, data, options)
    want = reference(data, torch.float16, scaler())
    assert_ranks_identical(results)
    for rank, result in enumerate(results):
        assert result["scales"] == want["scales"], f"rank {rank}"
        assert result["skipped"] == [] and result["summary"]["skipped_steps"] == 0
        for name, value in want["params"].items():
            torch.testing.assert_close(
                result["params"][name], value, rtol=1e-2, atol=1e-3, msg=f"rank {rank} {name}"
            )
    # growth_interval=2: the scale doubled after every second step without an overflow.
    assert want["scales"] == [2.0**8, 2.0**9, 2.0**9, 2.0**10, 2.0**10]


# --------------------------------------------------------------------------- overflow


OVERFLOW_STEP = 2


def poisoned(world_size: int, position: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The job's batches with one target of ``position``'s shard at `OVERFLOW_STEP` so far off
    that the (float32) loss is inf and its gradients overflow float16 in backward."""
    data = batches(world_size, seed=2)
    x, y = data[OVERFLOW_STEP]
    y = y.clone()
    y[position * PER_RANK, 0] = 1e30
    data[OVERFLOW_STEP] = (x, y)
    return data


def local_gradients_finite(
    weights: dict[str, torch.Tensor], batch: tuple[torch.Tensor, ...], scale: float
) -> bool:
    """Whether one rank's own scaled gradients on ``batch`` (from ``weights``) are finite: what
    a local overflow decision would look at."""
    model = mlp(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    with torch.autocast("cpu", dtype=torch.float16):
        loss = mse_loss(model, batch)
    (loss * scale).backward()
    return all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())


@pytest.mark.parametrize("world_size", [2, 3])
async def test_an_overflow_on_one_rank_is_skipped_by_every_rank_alike(world_size: int) -> None:
    data = poisoned(world_size, position=world_size - 1)
    results = await run_job(world_size, data, SCALED)

    want = reference(data, torch.float16, scaler())
    # The reference skipped the poisoned step: the scale backed off there and nowhere else.
    assert want["scales"] == [2.0**8, 2.0**9, 2.0**8, 2.0**8, 2.0**9]
    assert not math.isfinite(want["losses"][OVERFLOW_STEP])
    for rank, result in enumerate(results):
        # Only the last rank's own data overflowed: the others' local loss and gradients were
        # finite, so a local decision would have stepped there.
        poisoned_rank = rank == world_size - 1
        assert math.isfinite(result["losses"][OVERFLOW_STEP]) != poisoned_rank, result["losses"]
        local = local_gradients_finite(
            result["weights"][OVERFLOW_STEP - 1],
            shard(data[OVERFLOW_STEP], rank),
            result["scales"][OVERFLOW_STEP - 1],
        )
        assert local != poisoned_rank, f"rank {rank}"
        assert result["skipped"] == [OVERFLOW_STEP], f"rank {rank}"
        assert result["summary"]["skipped_steps"] == 1
        assert result["scales"] == want["scales"], f"rank {rank}"
        # The skipped step left the weights as they were.
        before, after = result["weights"][OVERFLOW_STEP - 1], result["weights"][OVERFLOW_STEP]
        assert all(raw(before[name]) == raw(after[name]) for name in before), f"rank {rank}"
        for name, value in want["params"].items():
            torch.testing.assert_close(
                result["params"][name], value, rtol=1e-2, atol=1e-3, msg=f"rank {rank} {name}"
            )
    assert_ranks_identical(results)


async def test_clipping_sees_the_unscaled_gradients_and_an_overflow_still_skips() -> None:
    """clip_grad_norm with the scaler: the averaged gradients are unscaled before their norm is
    taken (torch's recipe); the poisoned step is skipped all the same."""
    data = poisoned(2, position=1)
    options = dataclasses.replace(SCALED, clip_grad_norm=0.05)
    results = await run_job(2, data, options)
    want = reference(data, torch.float16, scaler(), clip=0.05)
    assert want["scales"] == [2.0**8, 2.0**9, 2.0**8, 2.0**8, 2.0**9]
    assert_ranks_identical(results)
    for rank, result in enumerate(results):
        assert result["skipped"] == [OVERFLOW_STEP] and result["scales"] == want["scales"]
        norm = result["summary"]["final_grad_norm"]
        assert norm is not None and 0.05 < norm < 100, norm  # an unscaled norm, clipped
        for name, value in want["params"].items():
            torch.testing.assert_close(
                result["params"][name], value, rtol=1e-2, atol=1e-3, msg=f"rank {rank} {name}"
            )
    unclipped = reference(data, torch.float16, scaler())["params"]
    assert max(float((unclipped[k] - want["params"][k]).abs().max()) for k in unclipped) > 1e-2


async def test_a_worker_without_data_from_the_start_steps_with_the_scaler() -> None:
    """Uneven inputs (join): rank 1 has no data at all, so it never scales a loss, yet it takes
    every step through its scaler with its peer, and their states stay identical."""
    data = batches(2, seed=6)[:3]

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(100 + rank)
        return model, sgd(model)

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        if trainer.run.rank == 0:
            for batch in data:
                await trainer.train_batch(shard(batch, 0))
        await trainer.join()
        await trainer.verified()
        assert trainer.run.grad_scaler is not None
        return {
            "params": params(trainer.model),
            "scale": trainer.run.grad_scaler.get_scale(),
            "step": trainer.step,
        }

    options = dataclasses.replace(SCALED, join=True)
    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(2, make_replica, mse_loss, body, options=options)
    assert [r["step"] for r in results] == [3, 3]
    assert results[0]["scale"] == results[1]["scale"] == 2.0**9
    assert_ranks_identical(results)


def overflow_on_rank_1(step: int) -> Callable[[DistributedTrainer], None]:
    """Make rank 1 alone see an inf among its averaged gradients at ``step``: a rank whose
    overflow decision differs from its peers'."""

    def tamper(trainer: DistributedTrainer) -> None:
        if trainer.run.rank != 1:
            return
        precision = trainer.run.precision
        assert precision is not None
        original = precision.step

        def step_with_local_overflow(optimizer: torch.optim.Optimizer) -> bool:
            if trainer.step == step:
                next(trainer.model.parameters()).grad.view(-1)[0] = math.inf
            return original(optimizer)

        precision.step = step_with_local_overflow  # type: ignore[method-assign]

    return tamper


async def test_a_rank_deciding_alone_to_skip_is_caught_by_the_digest_check() -> None:
    """lr=0 leaves the weights alike whether a step is taken or skipped: only the scaler's
    state tells the ranks apart, and the coordinator names its digest entry."""

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(100 + rank)
        return model, torch.optim.SGD(model.parameters(), lr=0.0)

    tamper = overflow_on_rank_1(1)

    async def body(trainer: DistributedTrainer) -> None:
        tamper(trainer)
        for batch in batches(3, seed=3):
            await trainer.train_batch(shard(batch, trainer.supervisor.position))
        await trainer.verified()

    options = TrainerOptions(autocast_dtype="float16", grad_scaler=True)
    with trio.fail_after(RUN_SECONDS):
        with pytest.raises(BaseException) as caught:
            await train_in_process(3, make_replica, mse_loss, body, options=options)
    text = " ".join(str(leaf) for leaf in leaves(caught.value))
    assert "step 1: parameter digests diverged: ranks [1] differ from the majority" in text, text
    assert f"first differs from rank 0 at tensor {GRAD_SCALER_DIGEST_ENTRY!r}" in text, text


async def test_a_resync_restores_a_lone_skippers_scaler_too() -> None:
    """CoordinatorOptions(resync=True): the rank that skipped alone gets the majority's weights
    and scaler state back, and the run then follows an untampered run's trajectory."""
    data = batches(3, seed=4)
    clean = await run_job(3, data, SCALED, verify_each_step=True)
    healed = await run_job(
        3,
        data,
        SCALED,
        tamper=overflow_on_rank_1(1),
        coordinator_options=CoordinatorOptions(resync=True),
        verify_each_step=True,
    )
    assert healed[1]["skipped"] == [1] and healed[0]["skipped"] == []
    for rank, result in enumerate(healed):
        assert result["scales"][2:] == clean[0]["scales"][2:], f"rank {rank}"
        for name, value in clean[0]["params"].items():
            assert raw(result["params"][name]) == raw(value), f"rank {rank} {name}"


def leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaves(inner)]
    return [error]


# --------------------------------------------------------------------------- state


def trained_scaler() -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    """A model, optimizer and scaler after a few steps, one of them an overflow: the scale and
    growth tracker are off their initial values."""
    model = mlp(5)
    optimizer = sgd(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    for batch in poisoned(1, 0)[:4]:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mse_loss(model, batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    state = scaler.state_dict()
    assert state["scale"] == 2.0**9 and state["_growth_tracker"] == 1, state
    return model, optimizer, scaler


def test_the_scaler_state_is_captured_and_restored_through_a_checkpoint(tmp_path: Any) -> None:
    model, optimizer, scaler = trained_scaler()
    store = CheckpointStore(tmp_path)
    path = store.save(capture_state(model, optimizer, 4, grad_scaler=scaler), committed=True)
    state = store.load(path)
    assert state.meta["grad_scaler"] == scaler.state_dict()

    other = mlp(6)
    other_optimizer = sgd(other)
    fresh = torch.amp.GradScaler("cpu")
    restore_state(other, other_optimizer, state, grad_scaler=fresh)
    assert fresh.state_dict() == scaler.state_dict()
    # The restored scaler scales as the original would.
    loss = torch.tensor(1.5)
    assert float(fresh.scale(loss)) == float(scaler.scale(loss)) == 1.5 * 2.0**9

    with pytest.raises(StateMismatch, match="no enabled grad scaler"):
        restore_state(other, other_optimizer, state)
    restore_state(other, other_optimizer, state, restore_grad_scaler=False)  # ignored
    plain = capture_state(model, optimizer, 4)
    assert plain.meta["grad_scaler"] is None
    with pytest.raises(StateMismatch, match="holds no grad scaler state"):
        restore_state(other, other_optimizer, plain, grad_scaler=torch.amp.GradScaler("cpu"))


async def test_a_run_resumed_from_a_checkpoint_goes_on_with_its_scaler_state(
    tmp_path: Any,
) -> None:
    """Three steps, a checkpoint, then a new run from it (the scaler through the options, from
    `saved_grad_scaler`) for two more: bitwise the weights and the scales of five steps in one
    run. The growth tracker matters: the resumed run's first step doubles the scale."""
    data = batches(2, seed=5)
    whole = await run_job(2, data, SCALED)
    first = await run_job(2, data[:3], SCALED)
    store = CheckpointStore(tmp_path)
    state = store.load(store.save(first[0]["state"], committed=True))
    saved = saved_grad_scaler(state)
    assert saved == {**saved, "scale": 2.0**9, "_growth_tracker": 1}, saved

    def restored(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(100 + rank)
        optimizer = sgd(model)
        restore_state(model, optimizer, state, restore_grad_scaler=False)
        return model, optimizer

    assert saved is not None
    options = dataclasses.replace(
        SCALED,
        grad_scaler_init_scale=saved["scale"],
        grad_scaler_growth_tracker=saved["_growth_tracker"],
    )
    second = await run_job(2, data[3:], options, make_replica=restored)
    assert [r["scales"] for r in second] == [whole[0]["scales"][3:]] * 2
    assert whole[0]["scales"][3] == 2.0**10
    for rank, result in enumerate(second):
        for name, value in whole[0]["params"].items():
            assert raw(result["params"][name]) == raw(value), f"rank {rank} {name}"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("scale", -1.0, "not positive"),
        ("scale", math.inf, "not positive"),
        ("scale", "big", "is not a number"),
        ("_growth_tracker", -2, "_growth_tracker"),
        ("growth_interval", 0, "growth_interval"),
        ("backoff_factor", 1.5, "backoff_factor"),
        ("unknown", 1, "expected keys"),
    ],
)
def test_a_malformed_scaler_state_is_refused_before_anything_changes(
    key: str, value: Any, message: str
) -> None:
    model, optimizer, scaler = trained_scaler()
    state = capture_state(model, optimizer, 4, grad_scaler=scaler)
    state.meta["grad_scaler"][key] = value
    target = torch.amp.GradScaler("cpu", init_scale=3.0)
    other = mlp(6)
    before = params(other)
    with pytest.raises(StateMismatch, match=message):
        restore_state(other, sgd(other), state, grad_scaler=target)
    assert target.get_scale() == 3.0
    assert all(torch.equal(before[name], p) for name, p in other.named_parameters())


async def test_a_live_state_transfer_carries_the_scaler_state() -> None:
    """Through the trainer's own donor and joiner paths, which pass its `grad_scaler`."""
    model, optimizer, scaler = trained_scaler()
    donor = SimpleNamespace(
        model=model, optimizer=optimizer, scheduler=None, step=4, grad_scaler=scaler
    )
    joiner = mlp(6)
    receiver = SimpleNamespace(
        model=joiner,
        optimizer=sgd(joiner),
        scheduler=None,
        step=0,
        rank=1,
        states_received=0,
        grad_scaler=torch.amp.GradScaler("cpu"),
    )
    sending, joining = InProcessTransport.create_group(2, buffer_frames=64)
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_training_state, donor, sending, 1)
            await receive_training_state(receiver, joining, 0)  # type: ignore[arg-type]
    assert receiver.step == 4
    assert receiver.grad_scaler.state_dict() == scaler.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(joiner.parameters(), model.parameters()))


async def test_a_joiner_without_a_scaler_refuses_a_donor_with_one() -> None:
    model, optimizer, scaler = trained_scaler()
    joiner = mlp(6)
    donor, joining = InProcessTransport.create_group(2, buffer_frames=64)
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                partial(send_state, donor, 1, model, optimizer, 4, grad_scaler=scaler)
            )
            with pytest.raises(ProtocolError, match=r"donor 0.*grad scaler") as caught:
                await receive_state(joining, 0, joiner, sgd(joiner))
    assert caught.value.peer == 0


# --------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_autocast_on_cuda_computes_in_the_dtype(dtype: str) -> None:
    model = mlp(0).cuda()
    precision = MixedPrecision.for_model(model, dtype, grad_scaler=dtype == "float16")
    assert precision is not None and precision.device_type == "cuda"
    with precision.autocast():
        out = model(torch.ones(2, WIDTHS[0], device="cuda"))
    assert out.dtype == getattr(torch, dtype)
    if dtype == "float16":
        assert precision.scaler is not None
        optimizer = sgd(model)
        loss = mse_loss(
            model, (torch.ones(2, WIDTHS[0], device="cuda"), torch.zeros(2, 4, device="cuda"))
        )
        precision.scaled(loss).backward()
        next(model.parameters()).grad.view(-1)[0] = math.inf
        assert precision.step(optimizer) is True
        assert precision.scaler.get_scale() == 2.0**15
