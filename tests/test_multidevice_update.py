"""The fused step of `DataParallelCoordinator.train_batch_parallel` (forward and backward, the
average, the optimizer steps and the digests in one job per replica thread) and its
`UpdateRelay`: CPU replicas update one at a time in device order on the thread that finished its
backward last; with ``concurrent_update`` each replica updates on its own thread at once, with
the same bits; a failure anywhere ends the step with the failing replica and phase named, never
a hang."""

from __future__ import annotations

import itertools
import sys
import threading
import time

import pytest
import torch

from paramsync.actors.multidevice import DataParallelCoordinator, ReplicaDivergedError, ReplicaError
from paramsync.actors.multidevice.relay import UpdateRelay


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def loss_fn(net: torch.nn.Module, shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(net(shard[0]), shard[1])


def adamw(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(net.parameters(), lr=1e-2)


def batch(size: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(size)
    return torch.randn(size, 4, generator=generator), torch.randn(size, 1, generator=generator)


class Recorded(torch.optim.AdamW):
    """AdamW noting each step's replica, thread and start/end time (and failing on request)."""

    def __init__(self, params, index: int, log: list, fail: bool = False) -> None:
        super().__init__(params, lr=1e-2)
        self.index, self.log, self.fail = index, log, fail

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        started = time.perf_counter()
        if self.fail:
            raise RuntimeError("optimizer exploded")
        time.sleep(0.002)  # long enough that replicas taking it at once would overlap
        result = super().step(closure)
        self.log.append((self.index, threading.get_ident(), started, time.perf_counter()))
        return result


def recorded_factory(log: list, failing: int | None = None):
    built = iter(range(100))

    def make(net: torch.nn.Module) -> torch.optim.Optimizer:
        index = next(built)
        return Recorded(net.parameters(), index, log, fail=index == failing)

    return make


def test_cpu_replicas_update_one_at_a_time_in_device_order_on_the_last_thread_to_arrive() -> None:
    log: list = []
    with DataParallelCoordinator(model, recorded_factory(log), loss_fn, ["cpu"] * 3) as dp:
        assert dp.concurrent_update is False
        pool = {thread.ident for thread in dp._threads._threads}
        for _ in range(3):
            result = dp.train_batch_parallel(batch())
            assert result.checked and result.averaging_seconds >= 0 and result.update_seconds > 0
            step = log[-3:]
            assert [index for index, *_ in step] == [0, 1, 2]
            for (_, _, _, end), (_, _, start, _) in itertools.pairwise(step):
                assert end <= start  # one at a time
            # one replica thread (whichever finished its backward last) took them all
            assert len({ident for _, ident, *_ in step}) == 1
            assert step[0][1] in pool and step[0][1] != threading.get_ident()


def test_concurrent_updates_run_each_replica_on_its_own_thread_with_the_same_bits() -> None:
    log: list = []
    data = batch(11)
    with DataParallelCoordinator(
        model, recorded_factory(log), loss_fn, ["cpu"] * 3, concurrent_update=True
    ) as dp:
        for _ in range(3):
            assert dp.train_batch_parallel(data).checked
        threads = {index: {ident for i, ident, *_ in log if i == index} for index in range(3)}
        assert all(len(idents) == 1 for idents in threads.values())
        assert len(set.union(*threads.values())) == 3
        # the three 2 ms steps overlapped at least once (they run at once, not in turn)
        spans = [(start, end) for _, _, start, end in log]
        assert any(a[0] < b[1] and b[0] < a[1] for a, b in itertools.combinations(spans, 2))
        at_once = dp.digests()[0]
    with DataParallelCoordinator(model, recorded_factory([]), loss_fn, ["cpu"] * 3) as dp:
        for _ in range(3):
            dp.train_batch_parallel(data)
        assert dp.digests()[0] == at_once


@pytest.mark.parametrize("concurrent", [False, True])
def test_a_failing_digest_names_its_replica_and_phase(concurrent: bool) -> None:
    with DataParallelCoordinator(
        model, adamw, loss_fn, ["cpu"] * 3, concurrent_update=concurrent
    ) as dp:
        dp.train_batch_parallel(batch())

        def broken() -> None:
            raise RuntimeError("hasher broke")

        dp._replicas[2].digest = broken  # type: ignore[method-assign]
        with pytest.raises(ReplicaError, match=r"replica 2 on cpu failed in digest.*hasher broke"):
            dp.train_batch_parallel(batch())
        assert dp.step == 2  # every replica had stepped: the step was taken


def test_the_fused_step_equals_the_phases_run_one_by_one() -> None:
    data = batch(7)
    with DataParallelCoordinator(model, adamw, loss_fn, ["cpu"] * 2) as fused:
        for _ in range(3):
            fused.train_batch_parallel(data)
        expected = fused.digests()[0]
    with DataParallelCoordinator(model, adamw, loss_fn, ["cpu"] * 2) as phased:
        for _ in range(3):
            _, sizes = phased.compute_gradients(data)
            phased.average_gradients([size / sum(sizes) for size in sizes])
            phased.apply_gradients(phased.averaged_gradient)
        assert phased.digests()[0] == expected


def test_a_failing_optimizer_step_names_its_replica_and_the_later_ones_never_step() -> None:
    log: list = []
    factory = recorded_factory(log, failing=1)
    with DataParallelCoordinator(model, factory, loss_fn, ["cpu"] * 3) as dp:
        with pytest.raises(
            ReplicaError,
            match=r"replica 1 on cpu failed in optimizer step.*exploded",
        ):
            dp.train_batch_parallel(batch())
        assert dp.step == 1  # past the gradients: the step was taken (replica 0 stepped)
    assert [index for index, *_ in log] == [0]


@pytest.mark.parametrize("concurrent", [False, True])
def test_a_failing_forward_names_its_phase_and_takes_no_step(concurrent: bool) -> None:
    def failing(net: torch.nn.Module, shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if shard[0].shape[0] == 4:
            raise RuntimeError("bad shard")
        return loss_fn(net, shard)

    log: list = []
    factory = recorded_factory(log)
    with DataParallelCoordinator(
        model, factory, failing, ["cpu"] * 2, concurrent_update=concurrent
    ) as dp:
        with pytest.raises(ReplicaError, match=r"replica 1 on cpu failed in forward/backward"):
            dp.train_batch_parallel(batch(9))  # shards 5, 4
        assert dp.step == 0 and log == []  # replica 0 never stepped alone


def test_the_relay_names_one_last_arrival_and_an_abort_releases_every_wait() -> None:
    relay = UpdateRelay(3)
    lasts: list[bool] = []
    threads = [threading.Thread(target=lambda: lasts.append(relay.arrive())) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(lasts) == [False, False, True]

    broken = UpdateRelay(2)
    waits: list[bool] = []
    waiter = threading.Thread(target=lambda: waits.append(broken.wait_all()))
    waiter.start()
    broken.abort()
    waiter.join(timeout=10)
    assert waits == [False] and broken.aborted
    assert broken.wait_all() is False  # the barrier is broken too: no wait for a dead replica
    failed = UpdateRelay(2)
    failed.abort()  # a replica failed before it arrived: the other is never the last
    assert failed.arrive() is False and failed.arrive() is False
    with pytest.raises(ValueError, match="at least one replica"):
        UpdateRelay(0)


def test_a_bit_flipped_in_a_large_frozen_tensor_is_caught_and_named() -> None:
    """A bit flipped in a large frozen tensor of the middle replica (> 64 KiB: its hashing
    releases the GIL) is caught and named."""

    def wide() -> torch.nn.Module:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 200), torch.nn.Tanh(), torch.nn.Linear(200, 1))
        frozen = torch.nn.Linear(200, 100)  # an 80 KB weight, frozen
        frozen.requires_grad_(False)
        net.add_module("frozen", frozen)
        return net

    def forward(net: torch.nn.Module, shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(net[2](net[1](net[0](shard[0]))), shard[1])

    with DataParallelCoordinator(wide, adamw, forward, ["cpu"] * 3) as dp:
        for _ in range(3):
            assert dp.train_batch_parallel(batch()).checked
        with torch.no_grad():
            raw = dp.replicas[1].frozen.weight.view(-1).view(torch.int32)
            raw[-1] ^= 1  # the lowest bit of the last element
        with pytest.raises(ReplicaDivergedError, match=r"replica 1 on cpu .*frozen\.weight"):
            dp.train_batch_parallel(batch())


def test_the_default_update_is_concurrent_only_without_a_gil_or_on_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with DataParallelCoordinator(model, adamw, loss_fn, ["cpu"] * 2) as dp:
        assert dp.concurrent_update is False  # this interpreter has a GIL (or predates the flag)
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: False, raising=False)
    with DataParallelCoordinator(model, adamw, loss_fn, ["cpu"] * 2) as dp:
        assert dp.concurrent_update is True  # a free-threaded build: each thread its own replica
        assert dp.train_batch_parallel(batch()).checked
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: True, raising=False)
    with DataParallelCoordinator(model, adamw, loss_fn, ["cpu"] * 2, concurrent_update=True) as dp:
        assert dp.concurrent_update is True  # an explicit choice wins
