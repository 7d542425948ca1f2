"""Where `DataParallelCoordinator` averages the replicas' gradients
(`paramsync.actors.multidevice.averaging`): the kind decided once from the devices, the device
path's steps run on CPU replicas (markers that do nothing) with the same bits as the host path,
the optimizer implementation each replica runs, and on a GPU the CUDA-event ordering: the
average waits on every replica's backward, the caller's stream on every update, and no stream
or device is synchronized in a step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paramsync.actors.multidevice import DataParallelCoordinator
from paramsync.actors.multidevice.averaging import averaging_kind, slices, weighted_sum
from paramsync.actors.multidevice.marker import StreamMarker
from paramsync.actors.multidevice.replica import update_kernels


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Tanh(), torch.nn.Linear(9, 2))
    net[0].bias.requires_grad_(False)  # a frozen parameter: never averaged
    return net


def loss_fn(net: torch.nn.Module, shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(net(shard[0]), shard[1])


def adamw(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)


def sgd(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def batches(count: int, size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 5, generator=generator), torch.randn(size, 2, generator=generator))
        for _ in range(count)
    ]


def test_the_kind_is_decided_once_from_the_devices() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert averaging_kind([cpu, cpu]) == "host"
    assert averaging_kind([gpu, torch.device("cuda", 1)]) == "device"
    assert averaging_kind([gpu, cpu]) == "host"  # a CPU replica: the host takes the average
    with DataParallelCoordinator(model, adamw, loss_fn, ["cpu"] * 2) as dp:
        assert dp.averaging == "host"
    with pytest.raises(ValueError, match="averaging must be 'host' or 'device', not 'gpu'"):
        DataParallelCoordinator(model, adamw, loss_fn, ["cpu"], averaging="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a mix averages on the host"):
        DataParallelCoordinator(model, adamw, loss_fn, ["cpu", "cuda:0"], averaging="device")
    marker = StreamMarker(cpu)  # on the CPU the work is done when the call returns
    assert not marker.on_device
    marker.record(None)
    marker.wait(None)
    marker.synchronize()


@given(length=st.integers(0, 50), parts=st.integers(1, 5), count=st.integers(1, 4))
def test_the_sum_of_every_slice_is_the_whole_sum_bit_for_bit(
    length: int, parts: int, count: int
) -> None:
    generator = torch.Generator().manual_seed(length * 31 + parts)
    sources = [torch.randn(length, generator=generator) for _ in range(count)]
    weights = [float(w) for w in torch.rand(count, generator=generator)]
    whole, sliced = torch.empty(length), torch.empty(length)
    weighted_sum(sources, weights, whole, 0, length)
    for lo, hi in slices(length, parts):
        weighted_sum(sources, weights, sliced, lo, hi)
    assert torch.equal(whole.view(torch.int32), sliced.view(torch.int32))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    devices=st.integers(1, 3),
    concurrent=st.booleans(),
    optimizer=st.sampled_from([adamw, sgd]),
    seed=st.integers(0, 2**16),
)
def test_the_device_path_on_cpu_replicas_gives_the_host_paths_bits(
    devices: int, concurrent: bool, optimizer: object, seed: int
) -> None:
    """The device path's steps (the root sums every replica's buffer, each replica copies the
    root's average after its marker) with markers that do nothing: the same bits as the host
    path, step after step, in the fused step and in the phases run one by one."""
    data = batches(4, devices + 3, seed)
    digests = {}
    for kind in ("host", "device"):
        with DataParallelCoordinator(
            lambda: model(seed),
            optimizer,  # type: ignore[arg-type]
            loss_fn,
            ["cpu"] * devices,
            concurrent_update=concurrent,
            averaging=kind,  # type: ignore[arg-type]
        ) as dp:
            assert dp.averaging == kind
            losses = [dp.train_batch_parallel(batch).loss for batch in data[:2]]
            for batch in data[2:]:
                _, sizes = dp.compute_gradients(batch)
                averaged = dp.average_gradients([size / sum(sizes) for size in sizes])
                assert averaged is dp.averaged_gradient
                dp.apply_gradients(averaged)
            digests[kind] = (losses, dp.digests())
    assert digests["device"] == digests["host"]


def test_each_replica_reports_the_optimizer_kernels_it_runs_as_built() -> None:
    def built(**options: object):
        def make(net: torch.nn.Module) -> torch.optim.Optimizer:
            return torch.optim.AdamW(net.parameters(), lr=1e-3, **options)  # type: ignore[arg-type]

        return make

    with DataParallelCoordinator(model, built(), loss_fn, ["cpu"] * 2) as dp:
        assert dp.update_kernels == ["for-loop", "for-loop"]  # torch's default on the CPU
    with DataParallelCoordinator(model, built(foreach=True), loss_fn, ["cpu"] * 2) as dp:
        assert dp.update_kernels == ["foreach", "foreach"]
        assert dp.optimizers[0].defaults["foreach"] is True  # the user's optimizer, as built
    net = model()
    assert update_kernels(torch.optim.AdamW(net.parameters(), fused=True)) == "fused"
    assert update_kernels(torch.optim.LBFGS(net.parameters())) == "its own"
    mixed = torch.optim.SGD(
        [{"params": [net[0].weight], "foreach": True}, {"params": [net[2].weight]}], lr=0.1
    )
    assert update_kernels(mixed) == "foreach+for-loop"


# ----------------------------------------------------------------------------- on a GPU


def _gpus(count: int = 2) -> list[str]:
    """``count`` replica devices over the GPUs there are (several on one GPU if need be)."""
    return [f"cuda:{index % torch.cuda.device_count()}" for index in range(count)]


class SlowOnReplica:
    """A loss function that holds one replica's stream busy (``torch.cuda._sleep``) before its
    forward: that replica's backward ends long after the others'."""

    def __init__(self, slow: int) -> None:
        self.slow = slow  # the slow replica's shard size

    def __call__(
        self, net: torch.nn.Module, shard: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        if shard[0].shape[0] == self.slow:
            torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning on this replica's stream
        return loss_fn(net, shard)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_device_average_waits_for_every_backward_and_matches_the_host_average() -> None:
    """Replica 1's backward is held back on its stream; the average taken on replica 0's device
    must still include it (its stream waits on replica 1's event), and equal the host path's
    average up to the last bits."""
    data = batches(3, 9, 7)  # shards 5 and 4: the 4-sample shard is replica 1's
    averages = {}
    params = {}
    for kind in ("device", "host"):
        with DataParallelCoordinator(
            model, adamw, SlowOnReplica(slow=4), _gpus(), averaging=kind
        ) as dp:
            assert dp.averaging == kind
            _, sizes = dp.compute_gradients(data[0])
            averages[kind] = dp.average_gradients([s / sum(sizes) for s in sizes]).clone()
            dp.apply_gradients(averages[kind])
            for batch in data[1:]:
                dp.train_batch_parallel(batch)
            first = [p.detach().cpu() for p in dp.replicas[0].parameters()]
            for replica in dp.replicas[1:]:
                for mine, theirs in zip(replica.parameters(), first):
                    assert torch.equal(mine.detach().cpu(), theirs)
            params[kind] = first
    with DataParallelCoordinator(model, adamw, loss_fn, ["cpu"]) as one:
        _, sizes = one.compute_gradients(data[0])
        expected = one.average_gradients([1.0]).clone()
    torch.testing.assert_close(averages["device"], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(averages["device"], averages["host"], rtol=1e-6, atol=1e-7)
    for mine, theirs in zip(params["device"], params["host"]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_step_synchronizes_no_stream_and_the_callers_stream_sees_the_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step on CUDA replicas (device averaging, no digest due) calls no ``synchronize()`` of
    a stream or a device (the host waits on one event only, the loss's); the caller's stream
    waits on the replicas' updates, so parameters read right after the step, with a slow
    optimizer step still queued, are the updated ones."""

    class SlowStep(torch.optim.AdamW):
        @torch.no_grad()
        def step(self, closure=None):  # type: ignore[override]
            torch.cuda._sleep(200_000_000)  # the update lands ~0.1 s after it is queued
            return super().step(closure)

    def slow(net: torch.nn.Module) -> torch.optim.Optimizer:
        return SlowStep([p for p in net.parameters() if p.requires_grad], lr=1e-2)

    data = batches(3, 8, 3)
    with DataParallelCoordinator(model, slow, loss_fn, _gpus(), check_interval=0) as dp:
        assert dp.averaging == "device"
        before = [p.detach().clone() for p in dp.replicas[0].parameters()]

        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError("a stream or device was synchronized during a step")

        with monkeypatch.context() as patch:
            patch.setattr(torch.cuda.Stream, "synchronize", refuse)
            patch.setattr(torch.cuda, "synchronize", refuse)
            dp.train_batch_parallel(data[0])
            seen = [p.detach().cpu() for p in dp.replicas[0].parameters()]  # caller's stream
        torch.cuda.synchronize()
        settled = [p.detach().cpu() for p in dp.replicas[0].parameters()]
        assert all(torch.equal(a, b) for a, b in zip(seen, settled))
        trainable = [p.requires_grad for p in dp.replicas[0].parameters()]
        changed = [not torch.equal(a.cpu(), b) for a, b in zip(before, settled)]
        assert changed == trainable
