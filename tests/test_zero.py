"""ZeRO-1 (`paramsync.actors.parallel.zero`): bitwise equal to plain data parallelism (ring
all-reduce average of one flat gradient buffer + the same optimizer on the whole model) for SGD with
momentum, Adam and AdamW, dp = 2, 3, 4, on both collective paths, over TCP once; the optimizer state
per rank about 1/dp of the whole; the gathered state and digest equal plain DP's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import trio
from conftest import open_group, run_in_group, run_ranks

from paramsync.actors.parallel.zero import ZeroRedundancyOptimizer, padded_length
from paramsync.actors.state.digest import state_digest
from paramsync.runtime.collectives.mesh import init_device_mesh
from paramsync.runtime.collectives.ring import all_reduce, reduce_scatter
from paramsync.runtime.parallel.config import ParallelismConfig
from paramsync.runtime.transport.base import Transport

Factory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

FACTORIES: dict[str, Factory] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05),
}


def make_model(width: int) -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(
        torch.nn.Linear(7, width), torch.nn.Tanh(), torch.nn.Linear(width, 3)
    )


def backward(model: torch.nn.Module, rank: int, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(5, 7, generator=generator) * (rank + 1)
    y = torch.randn(5, 3, generator=generator)
    loss = torch.nn.functional.mse_loss(model(x), y)
    model.zero_grad(set_to_none=True)
    loss.backward()


async def plain_dp(
    transport: Transport,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: range,
    small_bytes: int,
) -> None:
    """The reference: average the flat gradient buffer (padded like ZeRO's) with the ring's
    all-reduce, then step the optimizer on the whole model."""
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    for step in steps:
        backward(model, transport.rank, step)
        flat = torch.zeros(padded_length(numel, transport.world_size))
        flat[:numel] = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        await all_reduce(transport, flat, "avg", small_bytes=small_bytes)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))  # type: ignore[union-attr]
            offset += p.numel()
        optimizer.step()


async def zero_dp(
    transport: Transport, model: torch.nn.Module, zero: ZeroRedundancyOptimizer, steps: range
) -> None:
    for step in steps:
        backward(model, transport.rank, step)
        await zero.step()


def assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, entry in want["state"].items():
        assert got["state"][index].keys() == entry.keys(), index
        for key, value in entry.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


def compare(kind: str, dp: int, name: str, width: int, small_bytes: int, steps: int = 6) -> None:
    factory = FACTORIES[name]

    async def rank_fn(transport: Transport) -> None:
        reference = make_model(width)
        reference_opt = factory(list(reference.parameters()))
        await plain_dp(transport, reference, reference_opt, range(steps), small_bytes)
        model = make_model(width)
        zero = ZeroRedundancyOptimizer(
            model.parameters(), transport, factory, small_bytes=small_bytes
        )
        await zero_dp(transport, model, zero, range(steps))
        for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(mine, theirs), f"rank {transport.rank}: parameters differ"
        assert_same_state(await zero.state_dict(), reference_opt.state_dict())
        assert await zero.consolidated_digest(model) == state_digest(reference, reference_opt)

    run_in_group(kind, dp, rank_fn)


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("dp", [2, 3, 4])
@pytest.mark.parametrize("path", ["ring", "direct"])
def test_bitwise_equal_to_plain_data_parallelism(path: str, dp: int, name: str) -> None:
    """width 10: 113 parameters, padded to 114 (dp 3) and 116 (dp 4); the ring path is forced
    with small_bytes=0, the direct path is all-reduce's own for a buffer this small."""
    compare("inproc", dp, name, 10, 0 if path == "ring" else 1 << 15)


def test_bitwise_equal_over_tcp_on_a_large_model() -> None:
    """~20k parameters (80 KB: all-reduce's ring path by default), dp 3 over TCP, AdamW."""
    compare("tcp", 3, "adamw", 2000, 1 << 15, steps=5)


def test_on_the_dp_groups_of_a_mesh() -> None:
    """World of 6 as pp=1 x dp=3 x tp=2 (`ParallelismConfig`'s mesh): each tp column is its own
    model and ZeRO-1 runs on the rank's dp group, bitwise plain DP on that group."""
    config = ParallelismConfig(dp_size=3, tp_size=2, memory_optimization="zero1")

    async def rank_fn(world: Transport) -> None:
        async with await init_device_mesh(world, config.mesh_names(), config.mesh_shape()) as mesh:
            dp = mesh.group("dp")
            width = 9 + mesh.coordinate("tp")  # the two columns hold different models
            factory = FACTORIES["adamw"]
            reference = make_model(width)
            reference_opt = factory(list(reference.parameters()))
            await plain_dp(dp, reference, reference_opt, range(5), 0)
            model = make_model(width)
            zero = ZeroRedundancyOptimizer(model.parameters(), dp, factory, small_bytes=0)
            await zero_dp(dp, model, zero, range(5))
            for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
                assert torch.equal(mine, theirs)
            assert_same_state(await zero.state_dict(), reference_opt.state_dict())

    run_in_group("inproc", config.world_size, rank_fn)


def test_dp2_equals_per_parameter_all_reduce() -> None:
    """With two ranks every sum is a + b == b + a: any bucket layout gives the same bits."""

    async def rank_fn(transport: Transport) -> None:
        reference = make_model(10)
        reference_opt = FACTORIES["adam"](list(reference.parameters()))
        for step in range(5):
            backward(reference, transport.rank, step)
            for p in reference.parameters():
                await all_reduce(transport, p.grad, "avg", small_bytes=0)  # type: ignore[arg-type]
            reference_opt.step()
        model = make_model(10)
        zero = ZeroRedundancyOptimizer(model.parameters(), transport, FACTORIES["adam"])
        await zero_dp(transport, model, zero, range(5))
        for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(mine, theirs)

    run_in_group("inproc", 2, rank_fn)


def test_unrotated_reduce_scatter_sums_in_another_order() -> None:
    """Why ZeRO rotates its buffer: on 3 ranks reduce_scatter sums segment 0 as (x1 + x2) + x0,
    all_reduce as (x0 + x1) + x2; with x0 = 1 and x1 = x2 = 2**-24 those differ in the last
    bit, and the rotated reduce-scatter (segment 1 at position 0) gives all_reduce's bits."""
    tiny = 2.0**-24
    values = [1.0, tiny, tiny]

    async def rank_fn(transport: Transport) -> tuple[torch.Tensor, ...]:
        x = torch.full((3,), values[transport.rank])
        reduced = await all_reduce(transport, x.clone(), "sum", small_bytes=0)
        plain = await reduce_scatter(transport, x.clone(), "sum")
        rotated = await reduce_scatter(transport, torch.roll(x, -1), "sum")
        return reduced, plain, rotated

    results = run_in_group("inproc", 3, rank_fn)
    reduced = results[0][0]
    assert reduced[0].item() == 1.0  # (1 + 2**-24) rounds to 1, then again
    assert results[0][1].item() == 1.0 + 2.0**-23 != reduced[0].item()
    for rank, (_, _, rotated) in enumerate(results):
        assert torch.equal(rotated, reduced[(rank + 1) % 3 : (rank + 1) % 3 + 1])


@pytest.mark.parametrize("dp", [2, 4])
def test_optimizer_state_per_rank_is_a_dp_th(dp: int) -> None:
    """Adam keeps two moments per element: per rank 2 * ceil(n/dp) floats and one step count,
    against 2 * n floats and one step per parameter tensor for the whole model."""
    width = 500

    async def rank_fn(transport: Transport) -> tuple[int, int]:
        model = make_model(width)
        zero = ZeroRedundancyOptimizer(model.parameters(), transport, FACTORIES["adam"])
        await zero_dp(transport, model, zero, range(1))
        full = FACTORIES["adam"](list(make_model(width).parameters()))
        for p in full.param_groups[0]["params"]:
            p.grad = torch.zeros_like(p)
        full.step()
        full_bytes = sum(
            v.numel() * v.element_size()
            for state in full.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )
        return zero.optimizer_state_bytes(), full_bytes

    results = run_in_group("inproc", dp, rank_fn)
    numel = sum(p.numel() for p in make_model(width).parameters())
    for shard_bytes, full_bytes in results:
        assert full_bytes == 2 * numel * 4 + 4 * 4  # 4 parameter tensors, each a float step
        assert shard_bytes == 2 * padded_length(numel, dp) // dp * 4 + 4
        assert shard_bytes <= full_bytes / dp + 8 * dp


def test_load_state_dict_resumes_bitwise() -> None:
    """Three steps of plain DP, its optimizer state loaded into ZeRO on every rank, two more
    steps each: the same parameters and state as five steps of plain DP."""

    async def rank_fn(transport: Transport) -> None:
        factory = FACTORIES["adamw"]
        reference = make_model(10)
        reference_opt = factory(list(reference.parameters()))
        await plain_dp(transport, reference, reference_opt, range(3), 0)
        model = make_model(10)
        model.load_state_dict(reference.state_dict())
        zero = ZeroRedundancyOptimizer(model.parameters(), transport, factory, small_bytes=0)
        zero.load_state_dict(reference_opt.state_dict())
        await plain_dp(transport, reference, reference_opt, range(3, 5), 0)
        await zero_dp(transport, model, zero, range(3, 5))
        for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(mine, theirs)
        assert_same_state(await zero.state_dict(), reference_opt.state_dict())

    run_in_group("inproc", 3, rank_fn)


def test_bad_parameters_are_refused_by_index() -> None:
    async def main() -> None:
        async with open_group("inproc", 1) as (transport,):
            mixed = [torch.zeros(3), torch.zeros(3, dtype=torch.float64)]
            with pytest.raises(ValueError, match=r"parameter 1 is torch\.float64"):
                ZeroRedundancyOptimizer(mixed, transport, FACTORIES["adam"])
            with pytest.raises(ValueError, match="at least one parameter"):
                ZeroRedundancyOptimizer([], transport, FACTORIES["adam"])
            param = torch.zeros(4, requires_grad=True)
            zero = ZeroRedundancyOptimizer([param], transport, FACTORIES["adam"])
            param.grad = torch.zeros(4).to_sparse()
            with pytest.raises(ValueError, match="parameter 0's gradient"):
                await zero.step()

    trio.run(main)


def test_a_rank_of_one_steps_like_the_plain_optimizer() -> None:
    async def main() -> None:
        async with open_group("inproc", 1) as transports:
            await run_ranks(transports, lambda t: _single(t))

    async def _single(transport: Transport) -> None:
        reference = make_model(10)
        reference_opt = FACTORIES["sgd-momentum"](list(reference.parameters()))
        model = make_model(10)
        zero = ZeroRedundancyOptimizer(model.parameters(), transport, FACTORIES["sgd-momentum"])
        for step in range(5):
            backward(reference, 0, step)
            reference_opt.step()
        await zero_dp(transport, model, zero, range(5))
        for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(mine, theirs)

    trio.run(main)
