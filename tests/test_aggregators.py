"""The seed's gradient aggregators, thin uses of the collectives over one flatten helper: both
return each tensor's average over the ranks, new tensors bitwise identical on every rank, inputs
untouched, one flat buffer per dtype (`paramsync.runtime.collectives.flatten`)."""

from __future__ import annotations

import pytest
import torch
import trio
from conftest import open_group, run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

from paramsync.runtime import AllReduceAggregator, DistributedConfig, GradientAggregator
from paramsync.runtime.collectives.aggregators import ParameterServerAggregator
from paramsync.runtime.collectives.flatten import dtype_groups, flatten, unflatten
from paramsync.runtime.errors import CollectiveError

SHAPES = [(3, 4), (5,), (), (2, 1, 3)]
DTYPES = [torch.float32, torch.float64, torch.float32, torch.float64]


def grads(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(shape, generator=gen, dtype=dtype) for shape, dtype in zip(SHAPES, DTYPES)]


@pytest.mark.parametrize("make", [AllReduceAggregator, ParameterServerAggregator])
@pytest.mark.parametrize("kind", ["inproc", "tcp"])
def test_both_aggregators_average_every_tensor_identically_on_every_rank(
    make: type, kind: str
) -> None:
    n = 3

    async def main() -> list[list[torch.Tensor]]:
        async with open_group(kind, n) as world:

            async def one(transport) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
                aggregator = make(DistributedConfig(n, transport.rank), transport)
                assert isinstance(aggregator, GradientAggregator)
                mine = grads(transport.rank)
                before = [t.clone() for t in mine]
                out = await aggregator.aggregate(mine)
                assert all(torch.equal(a, b) for a, b in zip(mine, before))  # inputs untouched
                return out

            return await run_ranks(world, one)

    results = trio.run(main)
    for index, (shape, dtype) in enumerate(zip(SHAPES, DTYPES)):
        expected = torch.stack([grads(r)[index].double() for r in range(n)]).mean(0)
        for rank in range(n):
            got = results[rank][index]
            assert got.shape == shape and got.dtype == dtype
            assert torch.equal(got, results[0][index])  # bitwise, every rank
            torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
        assert results[0][index].data_ptr() != results[0][(index + 1) % 4].data_ptr()


def test_a_config_that_is_not_the_transports_is_refused() -> None:
    async def main() -> None:
        async with open_group("inproc", 2) as world:
            with pytest.raises(CollectiveError, match="config says rank 1 of 2"):
                AllReduceAggregator(DistributedConfig(2, 1), world[0])
            with pytest.raises(CollectiveError, match="root 2"):
                ParameterServerAggregator(DistributedConfig(2, 0), world[0], root=2)

    trio.run(main)


@settings(max_examples=100, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 4), max_size=3), max_size=6),
    dtypes=st.data(),
)
def test_flatten_and_unflatten_are_inverse_per_dtype(
    shapes: list[list[int]], dtypes: st.DataObject
) -> None:
    kinds = [dtypes.draw(st.sampled_from([torch.float32, torch.int64])) for _ in shapes]
    tensors = [
        torch.arange(int(torch.tensor(s).prod()), dtype=k).reshape(s) for s, k in zip(shapes, kinds)
    ]
    groups = dtype_groups(tensors)
    assert sorted(i for group in groups for i in group) == list(range(len(tensors)))
    for group in groups:
        same = [tensors[i] for i in group]
        assert len({t.dtype for t in same}) == 1 and group == sorted(group)
        flat = flatten(same)
        assert flat.dim() == 1 and flat.numel() == sum(t.numel() for t in same)
        for original, view in zip(same, unflatten(flat, same)):
            assert view.shape == original.shape and torch.equal(view, original)
    assert flatten([]).numel() == 0


def test_flatten_refuses_mixed_dtypes_and_unflatten_a_wrong_size() -> None:
    a, b = torch.zeros(2), torch.zeros(2, dtype=torch.float64)
    with pytest.raises(CollectiveError, match=r"tensor 1 is torch\.float64"):
        flatten([a, b])
    with pytest.raises(CollectiveError, match="does not hold the 1 tensors' 2 elements"):
        unflatten(torch.zeros(3), [a])
