"""C-DP-002: `DataParallelCoordinator`, one process with one replica per (CPU) device.

Property tests over device counts 1-4, batch sizes and random trainable subsets: after every
step every replica's trainable weights are bitwise identical, the frozen ones unchanged, and the
run equals one replica training the whole batch within float tolerance.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paramsync.actors import DataParallelCoordinator
from paramsync.actors.multidevice import ReplicaDivergedError, ReplicaError, TooFewSamplesError
from paramsync.actors.multidevice.sharding import shard_sizes, split_batch

LAYERS = 3


def build(seed: int, trainable: tuple[bool, ...]) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12), torch.nn.Tanh(),
        torch.nn.Linear(12, 2),
    )  # fmt: skip
    linears = [model[0], model[2], model[4]]
    for layer, train in zip(linears, trainable):
        layer.weight.requires_grad_(train)
        layer.bias.requires_grad_(train)
    return model


def loss_fn(model: torch.nn.Module, shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = shard
    return torch.nn.functional.mse_loss(model(x), y)


def adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9
    )


def frozen_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


@given(samples=st.integers(1, 40), devices=st.integers(1, 6))
def test_shards_are_balanced_contiguous_and_in_order(samples: int, devices: int) -> None:
    if samples < devices:
        with pytest.raises(TooFewSamplesError, match=f"{samples} samples.*{devices} devices"):
            shard_sizes(samples, devices)
        return
    sizes = shard_sizes(samples, devices)
    assert sum(sizes) == samples and len(sizes) == devices
    assert max(sizes) - min(sizes) <= 1
    batch = (torch.arange(samples), torch.arange(samples) * 2)
    shards = split_batch(batch, devices)
    assert [len(x) for x, _ in shards] == sizes
    assert torch.equal(torch.cat([x for x, _ in shards]), batch[0])
    assert torch.equal(torch.cat([y for _, y in shards]), batch[1])


def test_fewer_samples_than_devices_is_refused_not_a_fallback() -> None:
    with DataParallelCoordinator(lambda: build(0, (True,) * 3), adam, loss_fn, ["cpu"] * 3) as dp:
        with pytest.raises(TooFewSamplesError, match="2 samples cannot be split over 3 devices"):
            dp.train_batch_parallel((torch.randn(2, 6), torch.randn(2, 2)))
        assert dp.step == 0


def test_batch_fields_must_hold_the_same_samples() -> None:
    with DataParallelCoordinator(lambda: build(0, (True,) * 3), adam, loss_fn, ["cpu"] * 2) as dp:
        with pytest.raises(ValueError, match="batch field 1 has 3 samples"):
            dp.train_batch_parallel((torch.randn(4, 6), torch.randn(3, 2)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    devices=st.integers(1, 4),
    extra=st.integers(0, 9),
    trainable=st.tuples(*[st.booleans()] * LAYERS).filter(any),
    seed=st.integers(0, 2**16),
    optimizer=st.sampled_from([adam, sgd]),
    concurrent=st.booleans(),
)
def test_replicas_stay_identical_and_match_one_replica_on_the_whole_batch(
    devices: int,
    extra: int,
    trainable: tuple[bool, ...],
    seed: int,
    optimizer: object,
    concurrent: bool,
) -> None:
    """C-DP-002 with either update: one replica after another on the last thread to arrive (CPU
    replicas by default), or every replica at once on its own thread (the CUDA path)."""
    size = devices + extra
    factory = lambda: build(seed, trainable)  # noqa: E731
    dp = DataParallelCoordinator(
        factory,
        optimizer,  # type: ignore[arg-type]
        loss_fn,
        ["cpu"] * devices,
        concurrent_update=concurrent,
    )
    one = DataParallelCoordinator(factory, optimizer, loss_fn, ["cpu"])  # type: ignore[arg-type]
    try:
        frozen = frozen_state(dp.primary_pipeline)
        generator = torch.Generator().manual_seed(seed)
        for step in range(1, 7):
            batch = (
                torch.randn(size, 6, generator=generator),
                torch.randn(size, 2, generator=generator),
            )
            result = dp.train_batch_parallel(batch)
            reference = one.train_batch_parallel(batch)
            assert result.step == step and result.checked
            assert sum(result.shard_sizes) == size and len(result.losses) == devices
            assert max(result.shard_sizes) - min(result.shard_sizes) <= 1
            assert result.loss == pytest.approx(reference.loss, rel=1e-4, abs=1e-6)
            named = [dict(m.named_parameters()) for m in dp.replicas]
            for name in dp.trainable_names:
                for other in named[1:]:
                    assert torch.equal(other[name], named[0][name]), (step, name)
            for replica in dp.replicas:
                for name, value in frozen_state(replica).items():
                    assert torch.equal(value, frozen[name]), (step, name)
            for mine, theirs in zip(
                dp.primary_pipeline.parameters(), one.primary_pipeline.parameters()
            ):
                torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    finally:
        dp.close()
        one.close()


def test_only_trainable_gradients_exist_and_frozen_ones_stay_none() -> None:
    with DataParallelCoordinator(
        lambda: build(1, (False, True, False)), adam, loss_fn, ["cpu"] * 2
    ) as dp:
        dp.train_batch_parallel((torch.randn(5, 6), torch.randn(5, 2)))
        assert dp.trainable_names == ("2.weight", "2.bias")
        for replica in dp.replicas:
            for name, param in replica.named_parameters():
                assert (param.grad is not None) == (name in dp.trainable_names), name


def test_a_diverged_replica_is_named_with_the_entry_that_differs() -> None:
    with DataParallelCoordinator(
        lambda: build(2, (True, True, False)), adam, loss_fn, ["cpu"] * 3
    ) as dp:
        batch = (torch.randn(6, 6), torch.randn(6, 2))
        dp.train_batch_parallel(batch)
        with torch.no_grad():
            dp.replicas[2][4].weight.add_(1e-3)  # a frozen weight, changed behind its back
        with pytest.raises(
            ReplicaDivergedError, match=r"replica 2 on cpu .*after step 2.*4\.weight"
        ):
            dp.train_batch_parallel(batch)


def test_the_check_runs_at_its_interval() -> None:
    with DataParallelCoordinator(
        lambda: build(3, (True,) * 3), adam, loss_fn, ["cpu"] * 2, check_interval=3
    ) as dp:
        batch = (torch.randn(4, 6), torch.randn(4, 2))
        assert [dp.train_batch_parallel(batch).checked for _ in range(6)] == [
            False, False, True, False, False, True
        ]  # fmt: skip


def test_a_failing_replica_is_named() -> None:
    def failing(model: torch.nn.Module, shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if shard[0].shape[0] == 2:
            raise RuntimeError("boom")
        return loss_fn(model, shard)

    with DataParallelCoordinator(lambda: build(4, (True,) * 3), adam, failing, ["cpu"] * 3) as dp:
        with pytest.raises(
            ReplicaError, match=r"replica 2 on cpu failed in forward/backward.*boom"
        ):
            dp.train_batch_parallel((torch.randn(8, 6), torch.randn(8, 2)))  # shards 3, 3, 2


def test_each_replica_runs_on_its_own_persistent_thread_with_one_intra_op_thread() -> None:
    seen: list[tuple[int, int, int]] = []
    lock = threading.Lock()

    def recording(model: torch.nn.Module, shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with lock:
            seen.append((shard[0].shape[0], threading.get_ident(), torch.get_num_threads()))
        return loss_fn(model, shard)

    main_threads = torch.get_num_threads()
    with DataParallelCoordinator(lambda: build(5, (True,) * 3), adam, recording, ["cpu"] * 3) as dp:
        for _ in range(3):
            dp.train_batch_parallel((torch.randn(9, 6), torch.randn(9, 2)))
    idents = {ident for _, ident, _ in seen}
    assert len(idents) == 3 and threading.get_ident() not in idents
    assert {threads for _, _, threads in seen} == {1}
    assert torch.get_num_threads() == main_threads


def test_a_factory_sharing_weights_between_replicas_is_refused() -> None:
    base = build(6, (True,) * 3)
    with pytest.raises(ValueError, match=r"replica 1's parameter '0.weight' is replica 0's"):
        DataParallelCoordinator(lambda: base, adam, loss_fn, ["cpu"] * 2)
    with pytest.raises(ValueError, match="deep-copy a shared base"):
        DataParallelCoordinator(
            lambda: torch.nn.Sequential(base, torch.nn.Linear(2, 2)), adam, loss_fn, ["cpu"] * 2
        )


def test_replica_zero_initial_state_reaches_every_replica() -> None:
    with DataParallelCoordinator(
        lambda: build(torch.seed() % 1000, (True,) * 3), adam, loss_fn, ["cpu"] * 2
    ) as dp:  # unseeded factories: the replicas still start identical
        for mine, theirs in zip(dp.replicas[0].parameters(), dp.replicas[1].parameters()):
            assert torch.equal(mine, theirs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_replicas_match_cpu_within_tolerance() -> None:
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] * (
        2 if torch.cuda.device_count() == 1 else 1
    )
    factory = lambda: build(7, (False, True, True))  # noqa: E731
    batch = (torch.randn(11, 6), torch.randn(11, 2))
    with (
        DataParallelCoordinator(factory, adam, loss_fn, devices) as dp,
        DataParallelCoordinator(factory, adam, loss_fn, ["cpu"]) as one,
    ):
        for _ in range(5):
            dp.train_batch_parallel(batch)
            one.train_batch_parallel(batch)
        for replica in dp.replicas[1:]:
            for mine, theirs in zip(replica.parameters(), dp.replicas[0].parameters()):
                assert torch.equal(mine, theirs)
        for mine, theirs in zip(
            dp.primary_pipeline.parameters(), one.primary_pipeline.parameters()
        ):
            torch.testing.assert_close(mine.cpu(), theirs, rtol=1e-4, atol=1e-5)


def test_a_closed_pool_leaves_the_process_thread_count_as_it_found_it() -> None:
    """torch's intra-op thread count is process-wide: the replica threads set theirs, and the
    pool puts the count it found back when it closes (a leak changed later code's arithmetic)."""
    from paramsync.actors.multidevice.threads import ReplicaThreads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pool = ReplicaThreads(2, intra_op_threads=1)
        jobs = [torch.get_num_threads] * 2
        assert pool.run(jobs, phase="count", devices=["cpu", "cpu"]) == [1, 1]
        pool.close()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
