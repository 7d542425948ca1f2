"""The trainer with its model on a GPU (CUDA-gated: skipped elsewhere; `make gpu-check` runs
these on a machine with one).

Two workers in one trio run, both models on ``cuda:0`` (one GPU is enough: they share it), each
step's backward run by the compute actor on the device, the gradient buckets copied to pinned
host buffers only once the device finished them (C-STREAMSYNC-001: a side stream waits on the
bucket's ready event, the host on the copy's event, nothing synchronizes the device) and
all-reduced over paramsync's own data plane (host-staged: in-process channels, or TCP), the
digest check (C-DDP-001) reading the device state every step. The result must be one CPU
process's training of the whole batch, within float32 tolerance, and the ranks bitwise
identical. `tests/test_device_path.py` runs the same device path on the CPU in every run.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
import torch
import trio
from torch import nn

from paramsync.actors.state.buckets import plan_buckets
from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions
from paramsync.actors.train.worker import train_in_process
from paramsync.runtime.transport.device_ops import (
    CudaDeviceOps,
    DeviceOps,
    device_ops_in_context,
)
from paramsync.runtime.transport.tcp import TcpTransport

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

WORLD, PER_RANK, STEPS = 2, 4, 5
RUN_SECONDS = 60.0
BUCKET_BYTES = 256  # several buckets, each its own host copy


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    n = WORLD * PER_RANK
    return [
        (torch.randn(n, 5, generator=gen), torch.randn(n, 3, generator=gen)) for _ in range(STEPS)
    ]


async def train_on(
    device: torch.device, transport: str, device_ops: DeviceOps | None = None
) -> list[dict[str, torch.Tensor]]:
    """Each rank's parameters (on the host) after `STEPS` steps of ``WORLD`` workers whose
    models live on ``device`` (their device operations ``device_ops``, default CUDA's); rank
    ``r`` starts from other weights than rank 0."""
    if device_ops is not None:
        with device_ops_in_context(device_ops):
            return await train_on(device, transport)
    batches = _batches()

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _model(100 + rank).to(device)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(model(inputs.to(device)), targets.to(device))

    async def body(trainer: DistributedTrainer) -> dict[str, torch.Tensor]:
        rank = trainer.dist_config.rank
        for inputs, targets in batches:
            part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            await trainer.train_batch((inputs[part], targets[part]))
            await trainer.verified()  # this step's digest check passed
        assert all(p.device == device for p in trainer.model.parameters())
        return {name: p.detach().cpu() for name, p in trainer.model.named_parameters()}

    options = TrainerOptions(bucket_bytes=BUCKET_BYTES)
    runs: Any
    with trio.fail_after(RUN_SECONDS):
        if transport == "tcp":
            async with TcpTransport.open_group(WORLD) as transports:
                runs = await train_in_process(
                    WORLD, make_replica, loss_fn, body, options=options, transports=list(transports)
                )
        else:
            runs = await train_in_process(WORLD, make_replica, loss_fn, body, options=options)
    return list(runs)


def reference() -> dict[str, torch.Tensor]:
    """One CPU process training rank 0's initial model on each whole batch."""
    model = _model(100)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for inputs, targets in _batches():
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def check(results: list[dict[str, torch.Tensor]]) -> None:
    expected = reference()
    for rank, params in enumerate(results):
        assert params.keys() == expected.keys()
        for name, value in params.items():
            assert torch.equal(value, results[0][name]), f"rank {rank}: {name} differs"
            torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-5)


class CountingCudaOps(CudaDeviceOps):
    """CUDA's device operations, counting device synchronizes and the bytes copied to the host
    (by purpose)."""

    def __init__(self) -> None:
        self.synchronized = 0
        self.to_host: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def synchronize(self, device: torch.device) -> None:
        with self._lock:
            self.synchronized += 1
        super().synchronize(device)

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor, stream: Any, purpose: str) -> Any:
        with self._lock:
            self.to_host.append((purpose, src.numel() * src.element_size()))
        return super().copy_to_host(src, dst, stream, purpose)


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
async def test_workers_sharing_a_gpu_train_like_one_cpu_process(transport: str) -> None:
    """Training on the GPU is one CPU process's training, and no step synchronizes the device:
    the bytes copied to the host are the gradient buckets, once a step each, and the proof's
    digest lanes (the fold, computed on the GPU: never a state tensor's bytes)."""
    ops = CountingCudaOps()
    check(await train_on(torch.device("cuda", 0), transport, ops))
    assert ops.synchronized == 0
    assert {purpose for purpose, _ in ops.to_host} == {"gradients", "digest"}
    buckets = plan_buckets(list(_model(0).named_parameters()), BUCKET_BYTES)
    sizes = [b.numel * torch.empty((), dtype=b.dtype).element_size() for b in buckets]
    gradients = [n for purpose, n in ops.to_host if purpose == "gradients"]
    assert Counter(gradients) == Counter(sizes * (WORLD * STEPS))
    state_bytes = sum(p.numel() * p.element_size() for p in _model(0).parameters())
    digests = [n for purpose, n in ops.to_host if purpose == "digest"]
    assert len(digests) >= WORLD * STEPS and max(digests) < state_bytes
