"""Buffers in lockstep (issue 14): `TrainerOptions.buffer_sync` and the digest over buffers.

* `sync_buffers` over both transports: ``"broadcast"`` copies position 0's buffers everywhere,
  ``"average"`` averages floating-point buffers and broadcasts integer and bool ones,
  ``"local"`` sends nothing; a bad mode is refused by name.
* Against torch DDP itself (gloo, one process per rank, `tests/ddp_reference.py`): a BatchNorm
  model whose ranks see different batch statistics ends, after 4 steps on 2 and 3 workers, with
  DDP's weights and buffers: ``"broadcast"`` as DDP's ``broadcast_buffers=True`` (every rank
  holds DDP rank 0's buffers), ``"local"`` as ``broadcast_buffers=False`` (rank r holds DDP rank
  r's), ``"average"`` as DDP with the per-rank buffers averaged after each step by hand.
* C-DDP-001 (hypothesis): after every step every rank's whole-state digest (parameters,
  buffers, optimizer state) agrees and is the one it reported, and in the two synchronized
  modes every buffer is bitwise identical, for random models with and without buffers
  (BatchNorm with and without affine or running statistics, custom float and integer buffers
  updated in forward), buffer modes, world sizes, optimizers and both transports.
* Entering a live-rejoin epoch, the joiner takes the donor's buffers and scheduler, and a
  member whose buffers a dropped step moved takes position 0's (unless buffers are local).
* The digest really covers buffers in training: with the buffer sync switched off in a mode
  that promises identical buffers, the run aborts naming the buffer; in ``"local"`` mode the
  buffers differ and the run goes on.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio
from conftest import TRANSPORT_KINDS, open_group
from ddp_reference import PER_RANK, bn_batches, bn_model, bn_optimizer, mse, shard
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch import nn

import paramsync.actors.train.state_moves as state_moves_module
from paramsync.actors.client.client import RunAborted
from paramsync.actors.state.digest import state_digest
from paramsync.actors.train.buffer_sync import sync_buffers
from paramsync.actors.train.state_moves import enter_epoch
from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions
from paramsync.actors.train.training_run import TrainingRun
from paramsync.actors.train.worker import train_in_process
from paramsync.runtime.config import DistributedConfig
from paramsync.runtime.protocol.messages import StartRun
from paramsync.runtime.transport.tcp import TcpTransport

RUN_SECONDS = 30.0
DDP_SECONDS = 180.0
"""Deadline for the gloo reference processes (each imports torch) on a loaded 2-core machine."""


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaves(inner)]
    return [error]


# --------------------------------------------------------------------------- sync_buffers


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
async def test_sync_buffers_modes(kind: str) -> None:
    n = 3

    def buffers(rank: int) -> list[torch.Tensor]:
        return [
            torch.full((2, 3), float(rank + 1)),  # float32
            torch.tensor([rank * 10], dtype=torch.int64),  # a counter
            torch.tensor([rank % 2 == 0, rank == 1]),  # bool
            torch.full((4,), float(rank), dtype=torch.float64),
        ]

    for mode in ("broadcast", "average", "local"):
        held = [buffers(rank) for rank in range(n)]
        async with open_group(kind, n) as transports:
            async with trio.open_nursery() as nursery:
                for rank in range(n):
                    nursery.start_soon(sync_buffers, transports[rank], held[rank], mode)
        for rank in range(n):
            fl, counter, flags, wide = held[rank]
            if mode == "local":
                for got, want in zip(held[rank], buffers(rank)):
                    assert torch.equal(got, want), (mode, rank)
                continue
            # Integer and bool buffers: position 0's, in both modes.
            assert torch.equal(counter, torch.tensor([0]))
            assert torch.equal(flags, torch.tensor([True, False]))
            if mode == "broadcast":
                assert torch.equal(fl, torch.full((2, 3), 1.0))
                assert torch.equal(wide, torch.zeros(4, dtype=torch.float64))
            else:
                assert torch.equal(fl, torch.full((2, 3), 2.0))  # mean of 1, 2, 3
                assert torch.equal(wide, torch.ones(4, dtype=torch.float64))  # mean of 0, 1, 2
            assert fl.shape == (2, 3) and fl.dtype == torch.float32


async def test_sync_buffers_refuses_a_bad_mode_by_name() -> None:
    async with open_group("inproc", 1) as transports:
        with pytest.raises(ValueError, match="buffer_sync must be one of"):
            await sync_buffers(transports[0], [torch.zeros(1)], "mean")  # type: ignore[arg-type]


def test_trainer_options_refuse_a_bad_buffer_mode() -> None:
    assert TrainerOptions().buffer_sync == "broadcast"
    with pytest.raises(ValueError, match="buffer_sync must be one of 'broadcast', 'average'"):
        TrainerOptions(buffer_sync="rank0")  # type: ignore[arg-type]


def test_digest_covers_buffers_unless_left_out() -> None:
    model = bn_model(0)
    before, before_local = state_digest(model), state_digest(model, buffers=False)
    assert any(name.startswith("buffer/norm.") for name, _ in before.tensors)
    assert not any(name.startswith("buffer/") for name, _ in before_local.tensors)
    with torch.no_grad():
        model.norm.running_var[3] += 1e-6
    assert state_digest(model) != before
    assert state_digest(model, buffers=False) == before_local
    model.norm.num_batches_tracked += 1
    changed = [
        name for (name, a), (_, b) in zip(before.tensors, state_digest(model).tensors) if a != b
    ]
    assert changed == ["buffer/norm.running_var", "buffer/norm.num_batches_tracked"]


# --------------------------------------------------------------------------- against torch DDP


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


MODES = ("broadcast", "local", "average")


DDP_WORLD_SIZES = (2, 3)


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """DDP's final state_dict per (world size, mode, rank): one gloo group of the largest size
    computes every size (`ddp_reference`), once for the module."""
    cache: dict[int, dict[tuple[str, int], dict[str, torch.Tensor]]] = {}

    def get(world_size: int) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
        if not cache:
            world_size_run = max(DDP_WORLD_SIZES)
            out = tmp_path_factory.mktemp("ddp")
            port = _free_port()
            script = Path(__file__).with_name("ddp_reference.py")
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        str(script),
                        *map(str, (rank, world_size_run, port, out)),
                        ",".join(MODES),
                    ],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
                for rank in range(world_size_run)
            ]
            try:
                for proc in procs:
                    output, _ = proc.communicate(timeout=DDP_SECONDS)
                    assert proc.returncode == 0, output.decode(errors="replace")
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
            for size in DDP_WORLD_SIZES:
                cache[size] = {
                    (mode, rank): load_file(str(out / f"w{size}-{mode}-rank{rank}.safetensors"))
                    for mode in MODES
                    for rank in range(size)
                }
        return cache[world_size]

    return get


async def train_bn(world_size: int, mode: str) -> list[dict[str, Any]]:
    batches = bn_batches(world_size)

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = bn_model(100 + rank)
        return model, bn_optimizer(model)

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        rank = trainer.dist_config.rank
        for batch in batches:
            await trainer.train_batch(shard(batch, rank))
        await trainer.verified()
        return {"state": trainer.state_dict(), "digest": trainer.run.state_digest().digest}

    with trio.fail_after(RUN_SECONDS):
        return await train_in_process(
            world_size, make_replica, mse, body, options=TrainerOptions(buffer_sync=mode)
        )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world_size", DDP_WORLD_SIZES)
async def test_buffers_and_weights_match_torch_ddp(
    world_size: int, mode: str, ddp_results: Any
) -> None:
    reference = ddp_results(world_size)
    ours = await train_bn(world_size, mode)
    assert PER_RANK > 1  # BatchNorm's batch statistics need more than one sample per rank
    for rank, result in enumerate(ours):
        # broadcast: DDP rank r broadcast rank 0's buffers before each forward, then its own
        # forward moved them; paramsync broadcasts position 0's after each forward, so every
        # rank ends with the buffers DDP's rank 0 ends with (and the next forward would start
        # from them on both).
        want = reference[(mode, 0 if mode == "broadcast" else rank)]
        state = result["state"]
        assert state.keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(
                state[name], value, rtol=1e-5, atol=1e-6, msg=f"{mode} rank {rank} {name}"
            )
        assert result["digest"] == ours[0]["digest"]  # C-DDP-001, buffers included or not
    if mode == "local":  # the buffers really are each rank's own, as DDP's are
        mean = "norm.running_mean"
        assert not torch.allclose(reference[(mode, 0)][mean], reference[(mode, 1)][mean])
        assert not torch.allclose(ours[0]["state"][mean], ours[1]["state"][mean])
    else:
        for rank, result in enumerate(ours):
            for name, value in result["state"].items():
                assert raw(value) == raw(ours[0]["state"][name]), f"{mode} rank {rank} {name}"


async def test_the_digest_catches_buffers_left_unsynchronized(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Switch the per-step buffer sync off while the trainer still promises identical buffers:
    the coordinator's check names the first buffer that differs and stops the run."""

    async def no_sync(*args: Any, **kwargs: Any) -> None:
        return None

    monkeypatch.setattr(state_moves_module, "sync_buffers", no_sync)
    with trio.fail_after(RUN_SECONDS):
        try:
            await train_bn(2, "broadcast")
        except BaseException as exc:
            aborted = [leaf for leaf in leaves(exc) if isinstance(leaf, RunAborted)]
        else:
            pytest.fail("the run did not stop")
    assert aborted, "expected the coordinator to abort the run"
    assert "buffer/norm.running_mean" in str(aborted[0])


# --------------------------------------------------------------------------- C-DDP-001


class RandomNet(nn.Module):
    """Linear layers with, after each hidden one, nothing or a BatchNorm of some kind; maybe
    custom buffers that forward updates (a float64 moving mean of the input, an int32 count)."""

    NORMS = ("none", "bn", "bn-no-affine", "bn-no-stats")

    def __init__(
        self, widths: tuple[int, ...], norms: tuple[str, ...], custom: bool, seed: int
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(widths)):
            layers.append(nn.Linear(a, b))
            if i < len(widths) - 2:
                norm = norms[i]
                if norm == "bn":
                    layers.append(nn.BatchNorm1d(b))
                elif norm == "bn-no-affine":
                    layers.append(nn.BatchNorm1d(b, affine=False, momentum=0.5))
                elif norm == "bn-no-stats":
                    layers.append(nn.BatchNorm1d(b, track_running_stats=False))
                layers.append(nn.Tanh())
        self.body = nn.Sequential(*layers)
        self.custom = custom
        if custom:
            self.register_buffer("input_mean", torch.zeros(widths[0], dtype=torch.float64))
            self.register_buffer("calls", torch.zeros((), dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.custom:
            with torch.no_grad():
                self.input_mean.mul_(0.5).add_(x.detach().mean(0).double(), alpha=0.5)
                self.calls += 1
        return self.body(x)


OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


@st.composite
def buffer_cases(draw: st.DrawFn) -> dict[str, Any]:
    depth = draw(st.integers(1, 3))
    widths = tuple(draw(st.lists(st.integers(1, 5), min_size=depth + 1, max_size=depth + 1)))
    accumulation = draw(st.integers(1, 2))
    return {
        "world_size": draw(st.integers(1, 3)),
        "widths": widths,
        "norms": tuple(draw(st.sampled_from(RandomNet.NORMS)) for _ in range(depth)),
        "custom": draw(st.booleans()),
        "mode": draw(st.sampled_from(MODES)),
        "accumulation": accumulation,
        "per_rank": accumulation * draw(st.integers(2, 3)),  # BatchNorm needs 2 per micro-batch
        "bucket_bytes": draw(st.sampled_from([1, 64, 1 << 20])),
        "optimizer": draw(st.sampled_from(sorted(OPTIMIZERS))),
        "transport": draw(st.sampled_from(TRANSPORT_KINDS)),
        "steps": draw(st.integers(2, 3)),
        "seed": draw(st.integers(0, 2**16)),
    }


async def run_buffer_case(case: dict[str, Any]) -> None:
    n, per_rank = case["world_size"], case["per_rank"]
    gen = torch.Generator().manual_seed(case["seed"])
    offsets = torch.arange(n, dtype=torch.float32).repeat_interleave(per_rank)[:, None]
    batches = [
        (
            torch.randn(n * per_rank, case["widths"][0], generator=gen) + offsets,
            torch.randn(n * per_rank, case["widths"][-1], generator=gen),
        )
        for _ in range(case["steps"])
    ]

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = RandomNet(case["widths"], case["norms"], case["custom"], case["seed"] + rank)
        return model, OPTIMIZERS[case["optimizer"]](model.parameters())

    async def body(trainer: DistributedTrainer) -> list[dict[str, Any]]:
        rank = trainer.dist_config.rank
        history = []
        for batch in batches:
            x, y = batch
            await trainer.train_batch(
                (
                    x[rank * per_rank : (rank + 1) * per_rank],
                    y[rank * per_rank : (rank + 1) * per_rank],
                )
            )
            await trainer.verified()
            digest = trainer.run.state_digest()
            history.append(
                {
                    "digest": digest.digest,
                    "names": digest.names,
                    "reported": trainer.supervisor.live_epoch().optimizer.last_digest,
                    "buffers": {k: raw(v) for k, v in trainer.model.named_buffers()},
                    "params": {k: raw(v) for k, v in trainer.model.named_parameters()},
                }
            )
        return history

    options = TrainerOptions(
        buffer_sync=case["mode"],
        accumulation_steps=case["accumulation"],
        bucket_bytes=case["bucket_bytes"],
    )
    with trio.fail_after(RUN_SECONDS):
        if case["transport"] == "tcp":
            async with TcpTransport.open_group(n) as transports:
                results = await train_in_process(
                    n, make_replica, mse, body, options=options, transports=list(transports)
                )
        else:
            results = await train_in_process(n, make_replica, mse, body, options=options)

    has_buffers = any(True for _ in make_replica(0)[0].buffers())
    for rank, history in enumerate(results):
        assert len(history) == case["steps"]
        for step, (mine, ref) in enumerate(zip(history, results[0])):
            assert mine["reported"] == mine["digest"], f"rank {rank} step {step}: other digest"
            assert mine["digest"] == ref["digest"], f"rank {rank} diverged at step {step}"
            assert mine["params"] == ref["params"]
            in_digest = any(name.startswith("buffer/") for name in mine["names"])
            assert in_digest == (has_buffers and case["mode"] != "local")
            if case["mode"] != "local":
                assert mine["buffers"] == ref["buffers"], f"rank {rank} step {step}: buffers"


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=buffer_cases())
def test_c_ddp_001_whole_state_dict_identical_after_every_step(case: dict[str, Any]) -> None:
    note(repr(case))
    trio.run(run_buffer_case, case)


@pytest.mark.parametrize("mode", MODES)
async def test_c_ddp_001_fixed_case_with_every_kind_of_buffer(mode: str) -> None:
    """One deterministic case per mode over TCP, with BatchNorm and custom buffers."""
    await run_buffer_case(
        {
            "world_size": 3,
            "widths": (4, 6, 5, 2),
            "norms": ("bn", "bn-no-affine", "none"),
            "custom": True,
            "mode": mode,
            "accumulation": 2,
            "per_rank": 4,
            "bucket_bytes": 64,
            "optimizer": "adam",
            "transport": "tcp",
            "steps": 3,
            "seed": 5,
        }
    )


# --------------------------------------------------------------------------- epoch entry


def entering_run(rank: int, world_size: int, model: nn.Module, step: int, mode: str) -> TrainingRun:
    """A training run holding just what `enter_epoch` reads (no coordinator)."""
    optimizer = bn_optimizer(model)
    return TrainingRun(
        model=model,
        optimizer=optimizer,
        loss_fn=mse,
        config=DistributedConfig(world_size, rank),
        client=SimpleNamespace(begin_epoch=lambda start: None),  # type: ignore[arg-type]
        options=TrainerOptions(buffer_sync=mode),  # type: ignore[arg-type]
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5),
        step=step,
    )


@pytest.mark.parametrize("mode", MODES)
async def test_a_live_rejoin_epoch_brings_buffers_and_scheduler_into_line(mode: str) -> None:
    """Epoch 2: rank 0 donates its whole state to the joiner rank 2; rank 1's buffers were
    moved by a step dropped when the epoch ended. Entering the epoch, the joiner takes the
    donor's state (buffers and scheduler included) and, unless buffers are local, every member
    takes position 0's buffers, so the epoch's opening digest check agrees."""
    start = StartRun(
        addresses=(("in-process", 1), ("in-process", 2), ("in-process", 3)),
        ring=(0, 1, 2),
        step=5,
        epoch=2,
        donor=0,
        receivers=(2,),
        broadcast=False,
    )
    donor_model = bn_model(0)
    moved = bn_model(0)
    with torch.no_grad():
        moved.norm.running_mean.add_(1.0)
        moved.norm.num_batches_tracked += 1
    trainers = [
        entering_run(0, 3, donor_model, 5, mode),
        entering_run(1, 3, moved, 5, mode),
        entering_run(2, 3, bn_model(7), 0, mode),
    ]
    for _ in range(5):  # the donor's schedule has moved on
        trainers[0].optimizer.step()
        trainers[0].scheduler.step()  # type: ignore[union-attr]
    assert trainers[0].scheduler is not None and trainers[2].scheduler is not None
    async with open_group("inproc", 3) as transports:
        with trio.fail_after(RUN_SECONDS):
            async with trio.open_nursery() as nursery:
                for trainer, transport in zip(trainers, transports):
                    nursery.start_soon(enter_epoch, trainer, start, transport)
    assert [t.step for t in trainers] == [5, 5, 5]
    assert trainers[2].scheduler.state_dict() == trainers[0].scheduler.state_dict()
    donor_state = donor_model.state_dict()
    for name, value in trainers[2].model.state_dict().items():
        assert torch.equal(value, donor_state[name]), f"joiner {name}"
    digests = [t.state_digest() for t in trainers[::2]]
    assert digests[0] == digests[1]
    moved_mean = moved.norm.running_mean
    if mode == "local":
        assert not torch.equal(moved_mean, donor_model.norm.running_mean)
    else:
        for name, value in moved.state_dict().items():
            assert torch.equal(value, donor_state[name]), f"rank 1 {name}"
