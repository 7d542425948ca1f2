"""DistributedTrainer end to end: parity with single-process torch, C-DDP-001, the seed's API.

Every run is a coordinator and N workers in one trio run (`train_in_process`), over in-process
transports unless a test says otherwise, always under a deadline so a hang is a failure.

* Parity (as torch's own DDP tests do it): N workers with B samples each reach the weights (and
  optimizer state) of ONE plain-torch process that trains rank 0's initial model on the
  concatenated N*B batch, for N = 1..4, with and without gradient accumulation, with one bucket
  per parameter and one bucket for everything, with SGD+momentum and Adam. Ranks start from
  different weights, so matching the reference proves rank 0's weights were broadcast.
* C-DDP-001 (hypothesis): after every step all ranks hold bitwise-identical parameters and
  optimizer state, for random world sizes, MLP shapes and dtypes, frozen parameters, bucket
  sizes, accumulation steps and optimizers, over both transports.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import trio
import trio.testing
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from torch import nn

from paramsync.actors.client.client import RunAborted
from paramsync.actors.demo_job.model import CharTransformer
from paramsync.actors.graph.compute import ComputeActor
from paramsync.actors.graph.messages import Backward
from paramsync.actors.state.buckets import plan_buckets
from paramsync.actors.state.digest import state_digest
from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions
from paramsync.actors.train.worker import join_run, train_in_process
from paramsync.runtime.actor.base import ActorSystem
from paramsync.runtime.config import DistributedConfig
from paramsync.runtime.coordinator.service import Coordinator, CoordinatorOptions, RunFailed
from paramsync.runtime.errors import ActorFailed, pick_error
from paramsync.runtime.observe.trace import TraceRecorder
from paramsync.runtime.transport.shm import SharedMemoryPlane
from paramsync.runtime.transport.tcp import TcpTransport
from paramsync.runtime.transport.torch_plane import TorchPlaneTransport

RUN_SECONDS = 30.0
"""Deadline of one whole run: far beyond a healthy run of these tiny models on 2 cores."""

SECRET = "trainer-tests-secret"
BIG_BUCKET = 1 << 20


# --------------------------------------------------------------------------- helpers


def mlp(seed: int, widths: tuple[int, ...] = (5, 7, 3), dtype: torch.dtype = torch.float32):
    """A Tanh MLP whose initial weights depend only on ``seed``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        if i:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers).to(dtype)


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    idx, targets = batch
    return model.loss(idx, targets)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
    "sgd-nesterov": lambda params: torch.optim.SGD(
        params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01
    ),
}


def clone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def optimizer_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """Every optimizer-state tensor, keyed by parameter name and state key."""
    names = {id(p): name for name, p in model.named_parameters()}
    out = {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"{names[id(param)]}/{key}"] = value.detach().clone()
    return out


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def leaves(error: BaseException) -> list[BaseException]:
    """Every leaf exception of a (nested) exception group."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaves(inner)]
    return [error]


async def run_expecting_failure(coro: Callable[[], Any], seconds: float = RUN_SECONDS):
    """Await ``coro()`` under a deadline; return the exception it raised (fail if none)."""
    with trio.fail_after(seconds):
        try:
            await coro()
        except BaseException as exc:
            if isinstance(exc, trio.TooSlowError):
                raise
            return exc
    pytest.fail("the run did not fail")


def split(batch: tuple[torch.Tensor, ...], rank: int, per_rank: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[rank * per_rank : (rank + 1) * per_rank] for t in batch)


def reference_training(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batches: list[tuple[torch.Tensor, ...]],
) -> list[float]:
    """Plain single-process torch: one step per whole batch."""
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


# --------------------------------------------------------------------------- parity


STEPS = 5
PER_RANK = 4


async def check_parity(
    world_size: int,
    make_model: Callable[[int], nn.Module],
    optimizer_name: str,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batches: list[tuple[torch.Tensor, ...]],
    options: TrainerOptions,
    *,
    rtol: float,
    atol: float,
) -> None:
    initial: dict[int, dict[str, torch.Tensor]] = {}

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = make_model(rank)
        initial[rank] = clone_state(model)
        return model, OPTIMIZERS[optimizer_name](model.parameters())

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        rank = trainer.dist_config.rank
        # Trainer.open broadcast rank 0's weights before handing us the trainer.
        started = clone_state(trainer.model)
        losses = []
        for batch in batches:
            losses.append(await trainer.train_batch(split(batch, rank, PER_RANK)))
        return {
            "started": started,
            "losses": losses,
            "params": clone_state(trainer.model),
            "optim": optimizer_tensors(trainer.model, trainer.run.optimizer),
        }

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(world_size, make_replica, loss_fn, body, options=options)

    if world_size > 1:  # the ranks really did start from different weights ...
        assert any(not torch.equal(initial[0][k], initial[1][k]) for k in initial[0])
    for rank, result in enumerate(results):  # ... and every one trained from rank 0's
        for name, value in result["started"].items():
            assert torch.equal(value, initial[0][name]), f"rank {rank} {name} not broadcast"

    reference = make_model(0)
    ref_optimizer = OPTIMIZERS[optimizer_name](reference.parameters())
    ref_losses = reference_training(reference, ref_optimizer, loss_fn, batches)
    ref_params = clone_state(reference)
    ref_optim = optimizer_tensors(reference, ref_optimizer)

    for rank, result in enumerate(results):
        assert result["params"].keys() == ref_params.keys()
        for name, value in ref_params.items():
            torch.testing.assert_close(
                result["params"][name], value, rtol=rtol, atol=atol, msg=f"rank {rank} {name}"
            )
        assert result["optim"].keys() == ref_optim.keys()
        for name, value in ref_optim.items():
            torch.testing.assert_close(
                result["optim"][name], value, rtol=rtol, atol=atol, msg=f"rank {rank} {name}"
            )
        # Bitwise agreement between ranks (C-DDP-001), not just closeness to the reference.
        for name, value in result["params"].items():
            assert raw(value) == raw(results[0]["params"][name]), f"rank {rank} {name} differs"
    # Each rank's loss is the mean over its shard: their mean is the whole batch's loss.
    mean_losses = [sum(r["losses"][s] for r in results) / world_size for s in range(STEPS)]
    assert mean_losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-6)


def regression_batches(world_size: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(1234 + world_size)
    n = world_size * PER_RANK
    return [
        (
            torch.randn(n, 5, generator=gen, dtype=dtype),
            torch.randn(n, 3, generator=gen, dtype=dtype),
        )
        for _ in range(STEPS)
    ]


@pytest.mark.parametrize("optimizer_name", ["sgd-momentum", "adam"])
@pytest.mark.parametrize("bucket_bytes", [1, BIG_BUCKET], ids=["bucket-per-param", "one-bucket"])
@pytest.mark.parametrize("accumulation_steps", [1, 2], ids=["no-accum", "accum2"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
async def test_parity_with_single_process_torch_mlp(
    world_size: int, accumulation_steps: int, bucket_bytes: int, optimizer_name: str
) -> None:
    options = TrainerOptions(bucket_bytes=bucket_bytes, accumulation_steps=accumulation_steps)
    await check_parity(
        world_size,
        lambda rank: mlp(100 + rank),
        optimizer_name,
        mse_loss,
        regression_batches(world_size),
        options,
        rtol=1e-4,
        atol=2e-5,
    )


@pytest.mark.parametrize("world_size", [2, 3])
async def test_parity_float64_is_tight(world_size: int) -> None:
    """In float64 the only difference is summation order: agreement to ~1e-12."""
    options = TrainerOptions(bucket_bytes=64, accumulation_steps=2)
    await check_parity(
        world_size,
        lambda rank: mlp(7 + rank, dtype=torch.float64),
        "sgd-nesterov",
        mse_loss,
        regression_batches(world_size, torch.float64),
        options,
        rtol=1e-10,
        atol=1e-12,
    )


@pytest.mark.parametrize("bucket_bytes", [1, BIG_BUCKET], ids=["bucket-per-param", "one-bucket"])
async def test_parity_char_transformer_with_tied_embeddings(bucket_bytes: int) -> None:
    vocab, context, world_size = 11, 8, 2

    def make_model(rank: int) -> nn.Module:
        return CharTransformer(vocab, 16, 2, 1, context, tie_weights=True, seed=rank)

    gen = torch.Generator().manual_seed(5)
    n = world_size * PER_RANK
    batches = [
        (
            torch.randint(0, vocab, (n, context), generator=gen),
            torch.randint(0, vocab, (n, context), generator=gen),
        )
        for _ in range(STEPS)
    ]
    options = TrainerOptions(bucket_bytes=bucket_bytes, accumulation_steps=2)
    # SGD, not Adam: the key projection's bias gets a gradient that is zero but for rounding
    # (softmax ignores a per-query constant), and Adam divides that noise by its own size, so
    # those elements would differ from the reference by what the CPU's kernels round, not by
    # anything paramsync does (on one AVX-512 machine, 2.4e-5 after 5 steps).
    await check_parity(
        world_size, make_model, "sgd-momentum", lm_loss, batches, options, rtol=1e-4, atol=2e-5
    )

    # The tie survives training (one tensor, synchronized once).
    model = make_model(0)
    names = [name for name, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "head.weight" not in names


# --------------------------------------------------------------------------- C-DDP-001


class MixedMLP(nn.Module):
    """Linear layers with their own dtypes (cast in between) and some frozen parameters."""

    def __init__(
        self,
        widths: tuple[int, ...],
        dtypes: tuple[torch.dtype, ...],
        frozen: tuple[tuple[bool, bool], ...],
        seed: int,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(
            nn.Linear(a, b).to(dtype) for a, b, dtype in zip(widths, widths[1:], dtypes)
        )
        for layer, (weight_frozen, bias_frozen) in zip(self.layers, frozen):
            layer.weight.requires_grad_(not weight_frozen)
            layer.bias.requires_grad_(not bias_frozen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i:
                x = torch.tanh(x)
            x = layer(x.to(layer.weight.dtype))
        return x.float()


@st.composite
def ddp_cases(draw: st.DrawFn) -> dict[str, Any]:
    depth = draw(st.integers(1, 3))
    widths = tuple(draw(st.lists(st.integers(1, 6), min_size=depth + 1, max_size=depth + 1)))
    dtypes = tuple(draw(st.sampled_from([torch.float32, torch.float64])) for _ in range(depth))
    frozen = tuple((draw(st.booleans()), draw(st.booleans())) for _ in range(depth))
    if all(w and b for w, b in frozen):  # at least one trainable parameter
        frozen = ((frozen[0][0], False), *frozen[1:])
    accumulation = draw(st.integers(1, 3))
    return {
        "world_size": draw(st.integers(1, 4)),
        "widths": widths,
        "dtypes": dtypes,
        "frozen": frozen,
        "bucket_bytes": draw(st.sampled_from([1, 8, 40, 100, 400, BIG_BUCKET])),
        "accumulation": accumulation,
        "per_rank": accumulation * draw(st.integers(1, 3)),
        "optimizer": draw(st.sampled_from(sorted(OPTIMIZERS))),
        "transport": draw(st.sampled_from(["inproc", "tcp"])),
        "steps": draw(st.integers(2, 4)),
        "seed": draw(st.integers(0, 2**16)),
    }


def snapshot(trainer: DistributedTrainer) -> dict[str, Any]:
    model, optimizer = trainer.model, trainer.run.optimizer
    digest = state_digest(model, optimizer)
    tensors = {f"param/{k}": raw(v) for k, v in model.named_parameters()}
    tensors.update({f"optim/{k}": raw(v) for k, v in optimizer_tensors(model, optimizer).items()})
    return {
        "digest": digest.digest,
        "tensors": tensors,
        "reported": trainer.supervisor.live_epoch().optimizer.last_digest,
    }


async def run_ddp_case(case: dict[str, Any]) -> None:
    n = case["world_size"]
    gen = torch.Generator().manual_seed(case["seed"])
    batches = [
        (
            torch.randn(n * case["per_rank"], case["widths"][0], generator=gen),
            torch.randn(n * case["per_rank"], case["widths"][-1], generator=gen),
        )
        for _ in range(case["steps"])
    ]
    initial: dict[int, dict[str, torch.Tensor]] = {}

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = MixedMLP(case["widths"], case["dtypes"], case["frozen"], seed=case["seed"] + rank)
        initial[rank] = clone_state(model)
        return model, OPTIMIZERS[case["optimizer"]](model.parameters())

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        rank = trainer.dist_config.rank
        trainable = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
        bucketed = [name for bucket in trainer.run.buckets for name in bucket.names]
        assert sorted(bucketed) == sorted(trainable), "buckets must hold exactly the trainable"
        for bucket in trainer.run.buckets:
            assert len({dict(trainer.model.named_parameters())[n].dtype for n in bucket.names}) == 1
        history = []
        for batch in batches:
            await trainer.train_batch(split(batch, rank, case["per_rank"]))
            await trainer.verified()  # the step's digest check is done (it overlaps the next)
            history.append(snapshot(trainer))
        frozen = {
            name: p.detach().clone()
            for name, p in trainer.model.named_parameters()
            if not p.requires_grad
        }
        return {"history": history, "frozen": frozen, "step": trainer.step}

    options = TrainerOptions(
        bucket_bytes=case["bucket_bytes"], accumulation_steps=case["accumulation"]
    )
    with trio.fail_after(RUN_SECONDS):
        if case["transport"] == "tcp":
            async with TcpTransport.open_group(n) as transports:
                results = await train_in_process(
                    n, make_replica, mse_loss, body, options=options, transports=list(transports)
                )
        else:
            results = await train_in_process(n, make_replica, mse_loss, body, options=options)

    for rank, result in enumerate(results):
        assert result["step"] == case["steps"]
        for step, (mine, ref) in enumerate(zip(result["history"], results[0]["history"])):
            assert mine["digest"] == ref["digest"], f"rank {rank} diverged at step {step}"
            assert mine["reported"] == mine["digest"], "the trainer reported another digest"
            assert mine["tensors"].keys() == ref["tensors"].keys()
            for name, value in mine["tensors"].items():
                assert value == ref["tensors"][name], f"rank {rank} step {step}: {name} differs"
        # Frozen parameters: broadcast from rank 0 once, never touched by training.
        for name, value in result["frozen"].items():
            assert raw(value) == raw(initial[0][name]), f"rank {rank}: frozen {name} changed"
            # ... and never got optimizer state either.
            assert not any(k.startswith(f"optim/{name}/") for k in result["history"][-1]["tensors"])


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=ddp_cases())
def test_c_ddp_001_ranks_bitwise_identical_after_every_step(case: dict[str, Any]) -> None:
    note(repr(case))
    trio.run(run_ddp_case, case)


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
async def test_c_ddp_001_fixed_case_both_transports(transport: str) -> None:
    """One deterministic case per transport, so both always run whatever hypothesis draws."""
    await run_ddp_case(
        {
            "world_size": 3,
            "widths": (4, 6, 5, 2),
            "dtypes": (torch.float32, torch.float64, torch.float32),
            "frozen": ((False, True), (True, False), (False, False)),
            "bucket_bytes": 40,
            "accumulation": 2,
            "per_rank": 4,
            "optimizer": "adam",
            "transport": transport,
            "steps": 3,
            "seed": 9,
        }
    )


@pytest.mark.parametrize("threaded", [True, False], ids=["threaded", "event-loop"])
async def test_the_shared_memory_plane_trains_identically_threaded_or_not(threaded: bool) -> None:
    """Buckets above the plane's threshold all-reduce through shared memory, on a worker thread
    or in the event loop as `threaded_shared_memory` says; either way the ranks stay bitwise
    identical and end with the weights of the same run over the TCP ring."""
    world_size, steps = 3, 3
    widths = (32, 96, 64, 8)  # 9.5k parameters: a 38 KiB bucket, above the 32 KiB threshold
    planes: list[object] = []
    calls: list[bool] = []
    original = SharedMemoryPlane.all_reduce

    async def counted(self: SharedMemoryPlane, *args: Any) -> None:
        calls.append(self.threaded)
        await original(self, *args)

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(rank, widths=widths)
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        planes.append(trainer.supervisor.live_epoch().transport.shared_memory)  # type: ignore[attr-defined]
        rank = trainer.dist_config.rank
        for step in range(steps):
            gen = torch.Generator().manual_seed(step)
            batch = (torch.randn(6, widths[0], generator=gen), torch.randn(6, 8, generator=gen))
            await trainer.train_batch(split(batch, rank, 2))
        await trainer.verified()
        return snapshot(trainer)

    finals = []
    for shared_memory in (True, False):
        options = TrainerOptions(threaded_shared_memory=threaded)
        with trio.fail_after(RUN_SECONDS):
            async with TcpTransport.open_group(
                world_size, shared_memory=shared_memory
            ) as transports:
                SharedMemoryPlane.all_reduce = counted  # type: ignore[method-assign]
                try:
                    results = await train_in_process(
                        world_size,
                        make_replica,
                        mse_loss,
                        body,
                        options=options,
                        transports=list(transports),
                    )
                finally:
                    SharedMemoryPlane.all_reduce = original  # type: ignore[method-assign]
        assert all(result["digest"] == results[0]["digest"] for result in results)
        finals.append(results[0]["tensors"])
    assert calls == [threaded] * (world_size * steps)  # the first run only, one bucket a step
    assert all(plane.threaded == threaded for plane in planes[:world_size])  # type: ignore[attr-defined]
    assert planes[world_size:] == [None] * world_size
    assert finals[0] == finals[1]  # bitwise the ring's weights


# --------------------------------------------------------------------------- response cache


async def test_buckets_are_negotiated_once_per_epoch_then_reduced_from_the_cache() -> None:
    """With the response cache only the first step waits for gos (one per bucket); every
    later step reduces its buckets at once, in the first step's order, and (every member
    folding) reports them only in its step report: no ready message after the first step. The
    ranks stay bitwise identical and end with exactly the weights of the same run negotiating
    every step."""
    world_size, steps = 3, 4

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(rank, widths=(4, 6, 5, 2))
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        gos: list[int] = []
        forward = trainer.run.client.on_go
        assert forward is not None

        async def count(go: Any) -> None:
            gos.append(go.step)
            await forward(go)

        readies: list[int] = []
        report = trainer.run.client.ready

        async def count_ready(step: int, *args: Any, **kwargs: Any) -> None:
            readies.append(step)
            await report(step, *args, **kwargs)

        trainer.run.client.on_go = count
        trainer.run.client.ready = count_ready  # type: ignore[method-assign]
        assert trainer.run.client.start is not None
        assert trainer.run.client.start.fold == trainer.run.options.response_cache
        rank = trainer.dist_config.rank
        for step in range(steps):
            gen = torch.Generator().manual_seed(step)
            batch = (torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen))
            await trainer.train_batch(split(batch, rank, 2))
        await trainer.verified()
        return {
            "gos": gos,
            "readies": readies,
            "state": snapshot(trainer),
            "buckets": len(trainer.run.buckets),
        }

    finals = []
    for response_cache in (True, False):
        options = TrainerOptions(bucket_bytes=1, response_cache=response_cache)
        with trio.fail_after(RUN_SECONDS):
            results = await train_in_process(
                world_size, make_replica, mse_loss, body, options=options
            )
        buckets = results[0]["buckets"]
        assert buckets == 6  # one per parameter
        for result in results:
            if response_cache:
                assert result["gos"] == result["readies"] == [0] * buckets
            else:
                assert result["gos"] == result["readies"] == sorted(list(range(steps)) * buckets)
            assert result["state"] == results[0]["state"]
        finals.append(results[0]["state"]["tensors"])
    assert finals[0] == finals[1]


async def test_gradients_replaced_between_steps_are_copied_then_bound_again() -> None:
    """Gradients live in the buckets' flat buffers; a caller that drops them between steps
    (zero_grad(set_to_none=True)) gets the copying path for that step and the same weights."""
    world_size, steps = 2, 3

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(rank, widths=(4, 6, 2))
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    def body(drop: bool) -> Callable[[DistributedTrainer], Any]:
        async def run(trainer: DistributedTrainer) -> dict[str, Any]:
            rank = trainer.dist_config.rank
            for step in range(steps):
                if drop:
                    trainer.model.zero_grad(set_to_none=True)
                gen = torch.Generator().manual_seed(step)
                batch = (torch.randn(4, 4, generator=gen), torch.randn(4, 2, generator=gen))
                await trainer.train_batch(split(batch, rank, 2))
            await trainer.verified()
            return snapshot(trainer)

        return run

    finals = []
    for drop in (False, True):
        with trio.fail_after(RUN_SECONDS):
            results = await train_in_process(world_size, make_replica, mse_loss, body(drop))
        assert results[1] == results[0]
        finals.append(results[0]["tensors"])
    assert finals[0] == finals[1]


async def test_after_each_step_every_gradient_is_zero_and_still_its_buckets_view() -> None:
    """The optimizer actor zeroes the gradients as ``zero_grad(set_to_none=False)`` does (a
    bucket in one fill): the trainable ones stay views of their bucket, and a gradient the
    user put on a frozen parameter the optimizer holds is zeroed too."""
    world_size = 2

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(rank, widths=(4, 6, 2))
        model[0].bias.requires_grad_(False)
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    async def body(trainer: DistributedTrainer) -> list[str]:
        rank = trainer.dist_config.rank
        params = dict(trainer.model.named_parameters())
        frozen = params["0.bias"]
        seen: list[str] = []
        for step in range(3):
            frozen.grad = torch.ones_like(frozen)
            gen = torch.Generator().manual_seed(step)
            batch = (torch.randn(4, 4, generator=gen), torch.randn(4, 2, generator=gen))
            await trainer.train_batch(split(batch, rank, 2))
            for name, param in params.items():
                assert param.grad is not None and not param.grad.any(), (step, name)
                if name != "0.bias":
                    assert param.grad._base is not None, (step, name)  # the bucket's view
                    seen.append(name)
        await trainer.verified()
        return sorted(set(seen))

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(world_size, make_replica, mse_loss, body)
    assert results[0] == results[1] == ["0.weight", "2.bias", "2.weight"]


async def test_backward_hands_over_buckets_as_they_finish_and_the_last_with_its_return() -> None:
    """Every bucket is announced once a step. Those finished while backward still runs leave
    the backward thread at once (their all-reduce overlaps the rest of backward); the last one
    is announced when backward returns, with no hand-over of its own."""
    model = mlp(0, widths=(4, 6, 6, 2))
    buckets = plan_buckets(list(model.named_parameters()), bucket_bytes=1)  # one per param
    announced: list[tuple[int, int]] = []
    handed_over: list[int] = []
    compute = ComputeActor(
        model,
        mse_loss,
        buckets,
        lambda step, bucket: announced.append((step, bucket)),
        TraceRecorder.disabled(),
    )
    token = compute._token

    class CountingToken:
        def run_sync_soon(self, fn: Callable[..., Any], *args: Any) -> None:
            handed_over.append(args[1])
            token.run_sync_soon(fn, *args)

    compute._token = CountingToken()  # type: ignore[assignment]
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 4, generator=gen), torch.randn(4, 2, generator=gen))
    async with ActorSystem() as system:
        await system.start(compute)
        for step in range(2):
            announced.clear()
            handed_over.clear()
            await compute.ask(Backward(step, batch, True))
            await trio.testing.wait_all_tasks_blocked()
            assert sorted(announced) == [(step, b.index) for b in buckets]
            assert len(handed_over) == len(buckets) - 1
            last = announced[-1][1]
            assert last not in handed_over  # the last came with backward's return
        await compute.ask(Backward(2, batch, False))  # an accumulation step: no announcement
        await trio.testing.wait_all_tasks_blocked()
        assert len(announced) == len(buckets)
    compute.remove_hooks()


# --------------------------------------------------------------------------- frozen params


async def test_only_trainable_parameters_are_bucketed_and_frozen_ones_never_change() -> None:
    world_size = 3
    initial: dict[int, dict[str, torch.Tensor]] = {}

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(rank, widths=(4, 6, 6, 2))
        model[0].weight.requires_grad_(False)  # the first layer's weight and
        model[2].bias.requires_grad_(False)  # a bias in the middle are frozen
        initial[rank] = clone_state(model)
        return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5)

    gen = torch.Generator().manual_seed(3)
    batches = [
        (torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)) for _ in range(4)
    ]

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        rank = trainer.dist_config.rank
        names = sorted(name for bucket in trainer.run.buckets for name in bucket.names)
        for batch in batches:
            await trainer.train_batch(split(batch, rank, 2))
            for name in ("0.weight", "2.bias"):  # checked after every step
                param = dict(trainer.model.named_parameters())[name]
                assert raw(param) == raw(initial[0][name])
                assert param.grad is None
        return (
            names,
            clone_state(trainer.model),
            optimizer_tensors(trainer.model, trainer.run.optimizer),
        )

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(
            world_size, make_replica, mse_loss, body, options=TrainerOptions(bucket_bytes=1)
        )
    assert not torch.equal(initial[0]["0.weight"], initial[1]["0.weight"])
    for names, params, optim in results:
        assert names == ["0.bias", "2.weight", "4.bias", "4.weight"]
        for name in ("0.weight", "2.bias"):
            assert raw(params[name]) == raw(initial[0][name])
            assert not any(key.startswith(f"{name}/") for key in optim)
        for name in ("0.bias", "2.weight", "4.weight", "4.bias"):
            assert not torch.equal(params[name], initial[0][name]), f"{name} did not train"


# --------------------------------------------------------------------------- the seed's API


def tiny_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp(rank, widths=(3, 4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def tiny_batch(seed: int, n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=gen), torch.randn(n, 2, generator=gen)


async def test_api_surface_max_steps_rank_world_size_and_config() -> None:
    world_size = 3

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        rank = trainer.dist_config.rank
        seen = {
            "config": trainer.dist_config,
            "world_size": trainer.world_size,
            "is_coordinator": trainer.is_coordinator,
            "reached_before": trainer.run.reached_max_steps,
        }
        for step in range(3):
            assert not trainer.run.reached_max_steps
            await trainer.train_batch(tiny_batch(10 * step + rank))
        seen["reached_after"] = trainer.run.reached_max_steps
        with pytest.raises(RuntimeError, match="max_steps=3"):
            await trainer.train_batch(tiny_batch(99))
        seen["step"] = trainer.step
        seen["losses"] = list(trainer.run.history.losses)
        return seen

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(
            world_size, tiny_replica, mse_loss, body, options=TrainerOptions(max_steps=3)
        )
    for rank, seen in enumerate(results):
        assert seen["config"] == DistributedConfig(world_size, rank)
        assert seen["world_size"] == world_size
        assert seen["is_coordinator"] is (rank == 0)
        assert seen["reached_before"] is False
        assert seen["reached_after"] is True
        assert seen["step"] == 3  # the refused 4th batch took no step
        assert [step for step, _ in seen["losses"]] == [0, 1, 2]


def test_trainer_options_validation() -> None:
    for bad in (
        {"accumulation_steps": 0},
        {"bucket_bytes": 0},
        {"max_steps": -1},
        {"digest_interval": 0},
    ):
        with pytest.raises(ValueError):
            TrainerOptions(**bad)
    assert TrainerOptions(max_steps=0).max_steps == 0


async def test_max_steps_zero_takes_no_step() -> None:
    async def body(trainer: DistributedTrainer) -> Any:
        assert trainer.run.reached_max_steps
        with pytest.raises(RuntimeError):
            await trainer.train_batch(tiny_batch(0))
        return trainer.summary()

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(
            2, tiny_replica, mse_loss, body, options=TrainerOptions(max_steps=0)
        )
    for summary in results:
        assert summary["final_step"] == 0
        assert summary["final_loss"] is None
        assert summary["digest"] is None
        assert summary["steps_per_second"] is None
        assert summary["median_step_seconds"] is None


class RecordingDataset:
    """len() samples of (x, y); records which indices each batch() call drew."""

    def __init__(self, size: int) -> None:
        gen = torch.Generator().manual_seed(42)
        self.x = torch.randn(size, 3, generator=gen)
        self.y = torch.randn(size, 2, generator=gen)
        self.drawn: list[list[int]] = []

    def __len__(self) -> int:
        return self.x.shape[0]

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        self.drawn.append(list(indices))
        return self.x[indices], self.y[indices]


async def test_fit_trains_on_disjoint_shards_through_the_loader() -> None:
    world_size, batch_size, size = 2, 3, 14  # 7 per rank: 2 batches per epoch, 1 dropped

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        dataset = RecordingDataset(size)
        calls: list[tuple[int, float]] = []
        history = await trainer.fit(
            dataset,
            batch_size,
            steps=5,
            seed=3,
            prefetch=2,
            on_step=lambda step, loss: calls.append((step, loss)),
        )
        return {"history": history, "calls": calls, "drawn": dataset.drawn, "step": trainer.step}

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(world_size, tiny_replica, mse_loss, body)
    epoch0 = []
    for result in results:
        assert result["step"] == 5
        assert [s for s, _ in result["history"]] == [0, 1, 2, 3, 4]
        assert result["calls"] == result["history"]
        assert all(math.isfinite(loss) for _, loss in result["history"])
        assert all(len(batch) == batch_size for batch in result["drawn"])
        epoch0.append({i for batch in result["drawn"][:2] for i in batch})
    assert not epoch0[0] & epoch0[1], "ranks drew overlapping samples in one epoch"


async def test_fit_stops_at_max_steps_and_on_should_stop() -> None:
    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        dataset = RecordingDataset(40)
        first = await trainer.fit(dataset, 2, steps=2)
        stop_after = trainer.step + 1
        second = await trainer.fit(dataset, 2, should_stop=lambda: trainer.step >= stop_after)
        third = await trainer.fit(dataset, 2)  # until max_steps
        fourth = await trainer.fit(dataset, 2)  # already there: no step
        return [len(first), len(second), len(third), len(fourth), trainer.step]

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(
            2, tiny_replica, mse_loss, body, options=TrainerOptions(max_steps=6)
        )
    assert results == [[2, 1, 3, 0, 6]] * 2


async def test_fit_needs_steps_or_max_steps() -> None:
    async def body(trainer: DistributedTrainer) -> str:
        with pytest.raises(ValueError, match="max_steps"):
            await trainer.fit(RecordingDataset(8), 2)
        return "ok"

    with trio.fail_after(RUN_SECONDS):
        assert await train_in_process(1, tiny_replica, mse_loss, body) == ["ok"]


async def test_summary_fields() -> None:
    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        empty = trainer.summary()
        losses = [
            await trainer.train_batch(tiny_batch(s + 5 * trainer.dist_config.rank))
            for s in range(3)
        ]
        await trainer.verified()
        summary = trainer.summary()
        return {
            "empty": empty,
            "summary": summary,
            "losses": losses,
            "digest": state_digest(trainer.model, trainer.run.optimizer).digest.hex(),
        }

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(2, tiny_replica, mse_loss, body)
    for rank, result in enumerate(results):
        empty, summary = result["empty"], result["summary"]
        assert empty["final_step"] == 0 and empty["final_loss"] is None and empty["digest"] is None
        assert {
            "rank",
            "world_size",
            "final_step",
            "first_loss",
            "final_loss",
            "digest",
            "steps_per_second",
            "median_step_seconds",
        } <= set(summary)
        assert summary["first_loss"] == result["losses"][0]
        assert summary["rank"] == rank
        assert summary["world_size"] == 2
        assert summary["final_step"] == 3
        assert summary["final_loss"] == result["losses"][-1]
        assert summary["digest"] == result["digest"] == results[0]["digest"]
        assert summary["steps_per_second"] > 0
        assert 0 < summary["median_step_seconds"] < RUN_SECONDS
        # The check's own cost: every step is checked (the last one's report may still be in
        # flight when the summary is taken), and hashing takes CPU time.
        assert 2 <= summary["digests"] <= 4
        assert summary["hash_cpu_seconds"] > 0


async def test_summary_right_after_the_last_step_describes_the_final_state() -> None:
    """A report saying final_step 3 must carry the digest of the weights after step 3. The
    step's digest check overlaps the next step, so right after the last train_batch the
    recorded digest is still step 1's; lm_job writes exactly this summary (before the session
    ends and waits for verification), so its --summary-json digest is stale."""

    async def body(trainer: DistributedTrainer) -> tuple[Any, str]:
        for step in range(3):
            await trainer.train_batch(tiny_batch(step))
        summary = trainer.summary()
        return summary, state_digest(trainer.model, trainer.run.optimizer).digest.hex()

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(2, tiny_replica, mse_loss, body)
    for summary, final in results:
        assert summary["final_step"] == 3
        assert summary["digest"] == final, "summary() reports the digest of an earlier step"


async def test_digest_interval_agreed_with_the_coordinator() -> None:
    """Both sides set to 2: odd steps end with step_done instead of a digest check; the run
    still verifies and the summary's digest (of the state now) agrees across ranks."""
    digests: dict[int, list[str | None]] = {}

    async def body(trainer: DistributedTrainer) -> list[str | None]:
        seen = []
        for step in range(4):
            await trainer.train_batch(tiny_batch(step))
            await trainer.verified()
            seen.append(trainer.summary()["digest"])
        digests[trainer.dist_config.rank] = seen
        return seen

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(
            2,
            tiny_replica,
            mse_loss,
            body,
            options=TrainerOptions(digest_interval=2),
            coordinator_options=CoordinatorOptions(digest_interval=2),
        )
    seen = results[0]
    assert all(digest is not None for digest in seen)
    assert len(set(seen)) == len(seen)  # every step changed the state
    assert results[1] == results[0]


async def test_worker_follows_the_coordinators_digest_interval() -> None:
    """The coordinator announces digest_interval in start_run (the client stores it): a worker
    left at the default must follow it rather than send a digest on a step_done step."""

    async def body(trainer: DistributedTrainer) -> int:
        for step in range(3):
            await trainer.train_batch(tiny_batch(step))
        return trainer.step

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(
            2,
            tiny_replica,
            mse_loss,
            body,
            coordinator_options=CoordinatorOptions(digest_interval=2),
        )
    assert results == [3, 3]


# --------------------------------------------------------------------------- failures


class LossFails(Exception):
    pass


def failing_loss(fail_rank: int, fail_step: int) -> Callable[[nn.Module, Any], torch.Tensor]:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        if model.rank == fail_rank and model.calls == fail_step:
            raise LossFails(f"bad batch on rank {fail_rank}")
        model.calls += 1
        return mse_loss(model, batch)

    return loss_fn


def tagged_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optimizer = tiny_replica(rank)
    model.rank, model.calls = rank, 0
    return model, optimizer


async def test_loss_function_failure_names_the_compute_actor_and_does_not_hang() -> None:
    async def body(trainer: DistributedTrainer) -> None:
        for step in range(5):
            await trainer.train_batch(tiny_batch(step))

    started = trio.current_time()
    error = await run_expecting_failure(
        lambda: train_in_process(3, tagged_replica, failing_loss(1, 2), body), seconds=10
    )
    assert trio.current_time() - started < 10
    picked = pick_error(error)
    assert isinstance(picked, ActorFailed), repr(error)
    assert picked.actor == "compute"
    assert "compute" in str(picked) and "bad batch on rank 1" in str(picked)
    assert isinstance(picked.__cause__, LossFails)


async def test_loss_failure_on_one_process_stops_its_peers_over_tcp() -> None:
    """Each worker on its own (as separate processes would be): rank 1's loss fails; rank 1
    reports the compute actor, the coordinator aborts naming rank 1, the others stop too."""
    world_size = 3
    coordinator = Coordinator(world_size, secret=SECRET)
    outcome: dict[str, BaseException | None] = {}

    async def worker(rank: int, address: tuple[str, int]) -> None:
        model, optimizer = tagged_replica(rank)
        config = DistributedConfig(world_size, rank, f"{address[0]}:{address[1]}")
        try:
            async with join_run(
                model, optimizer, failing_loss(1, 2), config, secret=SECRET
            ) as trainer:
                for step in range(5):
                    await trainer.train_batch(tiny_batch(step))
        except BaseException as exc:
            outcome[f"rank {rank}"] = exc
        else:
            outcome[f"rank {rank}"] = None

    async def serve(task_status: trio.TaskStatus[tuple[str, int]]) -> None:
        try:
            await coordinator.serve_tcp("127.0.0.1", 0, task_status=task_status)
        except BaseException as exc:
            outcome["coordinator"] = exc

    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve)
            for rank in range(world_size):
                nursery.start_soon(worker, rank, address)
    coordinator_error = outcome["coordinator"]
    assert isinstance(coordinator_error, RunFailed) and "rank 1" in str(coordinator_error)
    rank1 = pick_error(outcome["rank 1"])
    assert isinstance(rank1, ActorFailed) and rank1.actor == "compute"
    for rank in (0, 2):
        error = outcome[f"rank {rank}"]
        assert error is not None, f"rank {rank} finished although rank 1 failed"
        assert any(
            isinstance(leaf, RunAborted) and "rank 1" in str(leaf) for leaf in leaves(error)
        ), repr(error)


async def test_unused_trainable_parameter_is_an_error_not_a_hang() -> None:
    """A trainable parameter the loss never touches would leave its bucket never ready."""

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 2)})
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((model["used"](x) - y) ** 2).mean()

    async def body(trainer: DistributedTrainer) -> None:
        await trainer.train_batch(tiny_batch(0))

    error = await run_expecting_failure(
        lambda: train_in_process(2, make_replica, loss_fn, body), seconds=10
    )
    picked = pick_error(error)
    assert isinstance(picked, ActorFailed) and picked.actor == "compute"
    assert "no gradient" in str(picked)


# --------------------------------------------------------------------------- torch data plane


@pytest.mark.parametrize(
    ("world_size", "bucket_bytes", "optimizer_name"),
    [(2, 1, "sgd-momentum"), (3, BIG_BUCKET, "adam")],
    ids=["2-ranks-bucket-per-param", "3-ranks-one-bucket"],
)
async def test_parity_with_the_torch_distributed_data_plane(
    world_size: int, bucket_bytes: int, optimizer_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """data_plane="torch": the buckets, the initial broadcast and the step's other collectives
    go through a gloo group, and the run still matches one plain-torch process, bitwise
    identical across ranks."""
    native: list[str] = []
    for name in ("native_all_reduce", "native_broadcast"):
        original = getattr(TorchPlaneTransport, name)

        async def counted(self: Any, *args: Any, _name: str = name, _f: Any = original) -> Any:
            native.append(_name)
            return await _f(self, *args)

        monkeypatch.setattr(TorchPlaneTransport, name, counted)
    options = TrainerOptions(bucket_bytes=bucket_bytes, accumulation_steps=2, data_plane="torch")
    await check_parity(
        world_size,
        lambda rank: mlp(100 + rank),
        optimizer_name,
        mse_loss,
        regression_batches(world_size),
        options,
        rtol=1e-4,
        atol=2e-5,
    )
    buckets = len(plan_buckets(list(mlp(0).named_parameters()), bucket_bytes))
    assert native.count("native_all_reduce") >= world_size * STEPS * buckets
    assert native.count("native_broadcast") >= world_size  # rank 0's weights, at the start
