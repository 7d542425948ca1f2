"""Collectives over both transports: property tests against a float64 reference, bitwise
agreement between ranks, argument checks, large frames, and ranks that fall out of step.

Every group runs its ranks as tasks of one trio nursery, under a deadline, so a deadlock is a
failure rather than a stuck run. Sizes stay modest for a 2-core machine: most examples are small,
a few reach a few hundred thousand elements.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import trio
from conftest import (
    TRANSPORT_KINDS,
    bitwise_equal,
    open_group,
    run_in_group,
    run_ranks_capture,
)
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from paramsync.runtime.collectives.ring import (
    SMALL_ALLREDUCE_BYTES,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    reduce_scatter,
    segment_bounds,
)
from paramsync.runtime.errors import CollectiveError, ProtocolError
from paramsync.runtime.transport.base import InProcessTransport, Transport

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int32, torch.int64)
REDUCE_DTYPES = FLOAT_DTYPES + INT_DTYPES
COPY_DTYPES = (*REDUCE_DTYPES, torch.uint8, torch.int8, torch.int16)
INT_BOUND = {torch.int32: 2**20, torch.int64: 2**40}  # x8 ranks stays far from overflow
MAX_CHUNK = 2 << 20
MAX_PARTS = 40
LARGE_SETTINGS = settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
"""Frames per segment at most: keeps tiny chunks on tiny tensors, so a run stays fast."""

PROPERTY_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------------------- strategies


@dataclass(frozen=True)
class Case:
    n: int
    dtype: torch.dtype
    numel: int
    chunk_bytes: int
    seed: int
    op: str = "sum"
    small_bytes: int = SMALL_ALLREDUCE_BYTES
    root: int = 0
    two_d: bool = False


EVERYDAY = ("tiny", "small", "medium", "tiny", "small")
LARGE = ("large",)


@st.composite
def numels(draw: st.DrawFn, n: int, large: int, sizes: tuple[str, ...]) -> int:
    """Tiny (often fewer elements than ranks), small, medium or large lengths."""
    size = draw(st.sampled_from(sizes))
    if size == "tiny":
        numel = draw(st.integers(0, 3 * n + 3))
    elif size == "small":
        numel = draw(st.integers(0, 3000))
    elif size == "medium":
        numel = draw(st.integers(3000, 40_000))
    else:
        numel = draw(st.integers(large // 3, large))
    if numel and numel % n == 0 and draw(st.integers(0, 3)):
        numel += 1  # most lengths are not a multiple of the world size
    return numel


@st.composite
def chunk_sizes(draw: st.DrawFn, numel: int, n: int, itemsize: int) -> int:
    """Any chunk from 4 B to 2 MiB (log-uniform), raised so a segment has at most MAX_PARTS."""
    exponent = draw(st.integers(2, 21))
    chunk = min(draw(st.integers(1 << exponent, (2 << exponent) - 1)), MAX_CHUNK)
    segment_bytes = -(-numel // n) * itemsize
    return max(chunk, -(-segment_bytes // MAX_PARTS))


@st.composite
def cases(
    draw: st.DrawFn,
    dtypes: tuple[torch.dtype, ...],
    *,
    reduce: bool,
    large: int = 300_000,
    whole_rows: bool = False,
    sizes: tuple[str, ...] = EVERYDAY,
    min_n: int = 1,
) -> Case:
    """A group, a tensor and the knobs. ``whole_rows``: the ring moves whole tensors (one per
    rank, as all_gather does), not 1/n segments, so the chunk floor is computed on those."""
    n = draw(st.integers(min_n, 8))
    dtype = draw(st.sampled_from(dtypes))
    numel = draw(numels(n, large, sizes))
    itemsize = torch.empty((), dtype=dtype).element_size()
    ring_numel = numel * n if whole_rows else numel
    return Case(
        n=n,
        dtype=dtype,
        numel=numel,
        chunk_bytes=draw(chunk_sizes(ring_numel, n, itemsize)),
        seed=draw(st.integers(0, 2**31 - 1)),
        op=draw(st.sampled_from(("sum", "avg"))) if reduce else "sum",
        small_bytes=draw(st.sampled_from((0, SMALL_ALLREDUCE_BYTES, 1 << 40))),
        root=draw(st.integers(0, n - 1)),
        two_d=draw(st.booleans()),
    )


# --------------------------------------------------------------------------- references


def make_inputs(case: Case) -> list[torch.Tensor]:
    """Distinct data per rank from a seeded generator, exactly representable in the dtype."""
    gen = torch.Generator().manual_seed(case.seed)
    n, numel, dtype = case.n, case.numel, case.dtype
    if dtype.is_floating_point:
        scale = torch.pow(2.0, torch.randint(-6, 7, (numel,), generator=gen).double())
        data = ((torch.rand((n, numel), generator=gen, dtype=torch.float64) * 2 - 1) * scale).to(
            dtype
        )
    elif dtype in INT_BOUND:
        bound = INT_BOUND[dtype]
        data = torch.randint(-bound, bound, (n, numel), generator=gen, dtype=torch.int64).to(dtype)
    else:
        data = torch.randint(0, 256, (n, numel), generator=gen, dtype=torch.int64).to(torch.uint8)
        data = data.view(dtype) if dtype.itemsize == 1 else data.to(dtype)
    tensors = [data[rank].clone() for rank in range(n)]
    if case.two_d and numel % 3 == 0:
        tensors = [t.view(3, numel // 3) for t in tensors]
    return tensors


def check_reduced(result: torch.Tensor, inputs: list[torch.Tensor], op: str) -> None:
    """``result`` is the sum/avg of ``inputs`` within what the dtype's rounding allows.

    Integers are exact (avg is floor division of the exact sum). For floats, any order of n-1
    additions errs by at most (n-1)·u·Σ|x| (u = eps/2); we allow n·eps·Σ|x|, plus one rounding
    of the division for avg, plus a few smallest-normals for results in the subnormal range.
    The inputs are exactly representable, so the float64 reference is (all but) exact.
    """
    n, dtype = len(inputs), inputs[0].dtype
    flat = result.reshape(-1)
    assert result.dtype == dtype
    if not dtype.is_floating_point:
        total = torch.stack([t.reshape(-1).to(torch.int64) for t in inputs]).sum(0)
        if op == "avg":
            total = torch.div(total, n, rounding_mode="floor")
        mismatch = (flat.to(torch.int64) != total).nonzero()
        assert mismatch.numel() == 0, (
            f"{mismatch.numel()} wrong elements, first at {mismatch[0].item()}: "
            f"got {flat[mismatch[0]].item()}, expected {total[mismatch[0]].item()}"
        )
        return
    stack = torch.stack([t.reshape(-1).to(torch.float64) for t in inputs])
    total, magnitude = stack.sum(0), stack.abs().sum(0)
    finfo = torch.finfo(dtype)
    if op == "avg":
        expected = total / n
        tolerance = finfo.eps * magnitude + finfo.eps * expected.abs() + n * finfo.tiny
    else:
        expected = total
        tolerance = n * finfo.eps * magnitude + n * finfo.tiny
    got = flat.to(torch.float64)
    assert torch.isfinite(got).all()
    bad = ((got - expected).abs() > tolerance).nonzero()
    assert bad.numel() == 0, (
        f"{bad.numel()} elements off, first at {bad[0].item()}: got {got[bad[0]].item()}, "
        f"expected {expected[bad[0]].item()} ± {tolerance[bad[0]].item()}"
    )


def check_identical(results: list[torch.Tensor]) -> None:
    for rank, result in enumerate(results[1:], start=1):
        assert bitwise_equal(results[0], result), f"rank {rank} differs from rank 0"


# --------------------------------------------------------------------------- properties


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
@PROPERTY_SETTINGS
@given(case=cases(REDUCE_DTYPES, reduce=True))
def test_all_reduce_matches_reference_and_ranks_agree_bitwise(kind: str, case: Case) -> None:
    check_all_reduce(kind, case)


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
@LARGE_SETTINGS
@given(case=cases(REDUCE_DTYPES, reduce=True, sizes=LARGE, min_n=2))
def test_all_reduce_large_tensors(kind: str, case: Case) -> None:
    check_all_reduce(kind, case)


def check_all_reduce(kind: str, case: Case) -> None:
    note(repr(case))
    inputs = make_inputs(case)
    work = [t.clone() for t in inputs]

    async def rank_fn(transport: Transport) -> torch.Tensor:
        mine = work[transport.rank]
        out = await all_reduce(
            transport,
            mine,
            case.op,  # type: ignore[arg-type]
            chunk_bytes=case.chunk_bytes,
            small_bytes=case.small_bytes,
        )
        assert out is mine  # in place
        await barrier(transport)  # the ranks are still in step, the links still usable
        return out

    results = run_in_group(kind, case.n, rank_fn)
    assert all(r.shape == inputs[0].shape for r in results)
    check_reduced(results[0], inputs, case.op)
    check_identical(results)


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
@PROPERTY_SETTINGS
@given(case=cases(COPY_DTYPES, reduce=False))
def test_broadcast_copies_the_root_to_every_rank(kind: str, case: Case) -> None:
    check_broadcast(kind, case)


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
@LARGE_SETTINGS
@given(case=cases(COPY_DTYPES, reduce=False, sizes=LARGE, min_n=2))
def test_broadcast_large_tensors(kind: str, case: Case) -> None:
    check_broadcast(kind, case)


def check_broadcast(kind: str, case: Case) -> None:
    note(repr(case))
    inputs = make_inputs(case)
    work = [t.clone() for t in inputs]

    async def rank_fn(transport: Transport) -> torch.Tensor:
        mine = work[transport.rank]
        out = await broadcast(transport, mine, case.root, chunk_bytes=case.chunk_bytes)
        assert out is mine
        await barrier(transport)
        return out

    results = run_in_group(kind, case.n, rank_fn)
    for rank, result in enumerate(results):
        assert bitwise_equal(result, inputs[case.root]), f"rank {rank} differs from the root"


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
@PROPERTY_SETTINGS
@given(
    case=cases(COPY_DTYPES, reduce=False, large=50_000, whole_rows=True, sizes=(*EVERYDAY, "large"))
)
def test_all_gather_stacks_every_ranks_tensor(kind: str, case: Case) -> None:
    note(repr(case))
    inputs = make_inputs(case)
    work = [t.clone() for t in inputs]

    async def rank_fn(transport: Transport) -> torch.Tensor:
        out = await all_gather(transport, work[transport.rank], chunk_bytes=case.chunk_bytes)
        await barrier(transport)
        return out

    results = run_in_group(kind, case.n, rank_fn)
    for rank in range(case.n):
        assert bitwise_equal(work[rank], inputs[rank]), "all_gather modified its input"
    assert results[0].shape == (case.n, *inputs[0].shape)
    for row in range(case.n):
        assert bitwise_equal(results[0][row], inputs[row]), f"row {row} is not rank {row}'s"
    check_identical(results)


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
@PROPERTY_SETTINGS
@given(case=cases(REDUCE_DTYPES, reduce=True))
def test_reduce_scatter_gives_each_rank_its_segment(kind: str, case: Case) -> None:
    check_reduce_scatter(kind, case)


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
@LARGE_SETTINGS
@given(case=cases(REDUCE_DTYPES, reduce=True, sizes=LARGE, min_n=2))
def test_reduce_scatter_large_tensors(kind: str, case: Case) -> None:
    check_reduce_scatter(kind, case)


def check_reduce_scatter(kind: str, case: Case) -> None:
    note(repr(case))
    inputs = make_inputs(case)
    work = [t.clone() for t in inputs]

    async def rank_fn(transport: Transport) -> torch.Tensor:
        out = await reduce_scatter(
            transport,
            work[transport.rank],
            case.op,  # type: ignore[arg-type]
            chunk_bytes=case.chunk_bytes,
        )
        await barrier(transport)
        return out

    results = run_in_group(kind, case.n, rank_fn)
    bounds = segment_bounds(case.numel, case.n)
    for rank, (lo, hi) in enumerate(bounds):
        segment = results[rank]
        assert segment.shape == (hi - lo,), f"rank {rank} got {tuple(segment.shape)}"
        check_reduced(segment, [t.reshape(-1)[lo:hi] for t in inputs], case.op)
    assert sum(r.numel() for r in results) == case.numel


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 8),
    delays=st.lists(
        st.lists(st.sampled_from((0.0, 0.001, 0.005)), min_size=8, max_size=8),
        min_size=1,
        max_size=3,
    ),
)
def test_barrier_releases_no_rank_before_all_entered(
    kind: str, n: int, delays: list[list[float]]
) -> None:
    entered = [0] * len(delays)

    async def rank_fn(transport: Transport) -> None:
        for round_, round_delays in enumerate(delays):
            await trio.sleep(round_delays[transport.rank])
            entered[round_] += 1
            await barrier(transport)
            assert entered[round_] == n, f"rank {transport.rank} left round {round_} early"
        # the barriers kept every rank in step: a collective still works afterwards
        value = torch.tensor([transport.rank + 1], dtype=torch.int64)
        await all_reduce(transport, value)
        assert value.item() == n * (n + 1) // 2

    run_in_group(kind, n, rank_fn)


@given(numel=st.integers(0, 10**7), world_size=st.integers(1, 300))
def test_segment_bounds_cover_contiguously_with_sizes_within_one(
    numel: int, world_size: int
) -> None:
    bounds = segment_bounds(numel, world_size)
    assert len(bounds) == world_size
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    for (_, stop), (start, _) in itertools.pairwise(bounds):
        assert stop == start
    sizes = [stop - start for start, stop in bounds]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the longer segments come first
    assert sum(sizes) == numel


# --------------------------------------------------------------------------- argument checks

COLLECTIVES: dict[str, Callable[..., Awaitable[Any]]] = {
    "all_reduce": lambda t, x, **kw: all_reduce(t, x, **kw),
    "reduce_scatter": lambda t, x, **kw: reduce_scatter(t, x, **kw),
    "all_gather": lambda t, x, **kw: all_gather(t, x, **kw),
    "broadcast": lambda t, x, **kw: broadcast(t, x, 0, **kw),
}

BAD_TENSORS = {
    "bool": lambda: torch.zeros(4, dtype=torch.bool),
    "complex64": lambda: torch.zeros(4, dtype=torch.complex64),
    "uint32": lambda: torch.zeros(4, dtype=torch.uint32),
    "non-contiguous": lambda: torch.zeros(4, 6)[:, ::2],
    "transposed": lambda: torch.zeros(4, 6).t(),
    "not-a-tensor": lambda: [1.0, 2.0],
}


def call_on_rank0_then_reduce(
    call: Callable[[Transport], Awaitable[Any]],
) -> tuple[BaseException | None, list[torch.Tensor]]:
    """Rank 0 alone makes ``call`` (which must fail before any I/O), then both ranks
    all_reduce: a refused call must neither block nor put rank 0 out of step."""

    async def main() -> tuple[BaseException | None, list[torch.Tensor]]:
        t0, t1 = InProcessTransport.create_group(2)
        error: BaseException | None = None
        with trio.fail_after(2):
            try:
                await call(t0)
            except Exception as exc:
                error = exc
        values = [torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])]
        results = await run_ranks_capture([t0, t1], lambda t: all_reduce(t, values[t.rank]))
        return error, results

    return trio.run(main)


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
@pytest.mark.parametrize("bad", sorted(BAD_TENSORS))
def test_unsupported_tensors_raise_collective_error(name: str, bad: str) -> None:
    error, results = call_on_rank0_then_reduce(lambda t: COLLECTIVES[name](t, BAD_TENSORS[bad]()))
    assert isinstance(error, CollectiveError), repr(error)
    for result in results:
        assert torch.equal(result, torch.tensor([11.0, 22.0])), repr(result)


@pytest.mark.parametrize("root", [-1, 2, 7, True, 0.0, "0", None])
def test_bad_broadcast_root_raises_collective_error(root: object) -> None:
    error, results = call_on_rank0_then_reduce(
        lambda t: broadcast(t, torch.zeros(3), root)  # type: ignore[arg-type]
    )
    assert isinstance(error, CollectiveError), repr(error)
    assert all(torch.equal(r, torch.tensor([11.0, 22.0])) for r in results), results


@pytest.mark.parametrize("name", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("op", ["max", "mean", "SUM", "", None, 0])
def test_bad_reduce_op_raises_collective_error(name: str, op: object) -> None:
    error, results = call_on_rank0_then_reduce(
        lambda t: COLLECTIVES[name](t, torch.zeros(3), op=op)
    )
    assert isinstance(error, CollectiveError), repr(error)
    assert all(torch.equal(r, torch.tensor([11.0, 22.0])) for r in results), results


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
@pytest.mark.parametrize("numel", [3, 200_000])
@pytest.mark.parametrize("chunk_bytes", [0])
def test_non_positive_chunk_bytes_is_refused_on_every_path_without_an_op_id(
    name: str, numel: int, chunk_bytes: int
) -> None:
    """chunk_bytes is validated like the other arguments: whatever the tensor size (direct or
    ring path), and before the call takes an op id, so the refused rank stays in step."""
    error, results = call_on_rank0_then_reduce(
        lambda t: COLLECTIVES[name](t, torch.zeros(numel), chunk_bytes=chunk_bytes)
    )
    assert isinstance(error, CollectiveError), repr(error)
    assert all(
        isinstance(r, torch.Tensor) and torch.equal(r, torch.tensor([11.0, 22.0])) for r in results
    ), results


def test_single_rank_group_is_identity_for_sum_and_floor_division_for_avg() -> None:
    async def main() -> None:
        (t,) = InProcessTransport.create_group(1)
        x = torch.tensor([-7, 7, 3], dtype=torch.int64)
        assert torch.equal(await all_reduce(t, x.clone(), "avg"), x)
        assert torch.equal(await all_reduce(t, x.clone(), "sum"), x)
        assert torch.equal(await reduce_scatter(t, x.clone(), "avg"), x)
        assert torch.equal(await all_gather(t, x), x.view(1, 3))
        assert torch.equal(await broadcast(t, x.clone(), 0), x)
        await barrier(t)

    trio.run(main)


# --------------------------------------------------------------------------- large frames


HUGE_CHUNK_CALLS: dict[str, Callable[[Transport, torch.Tensor, int], Awaitable[Any]]] = {
    "all_reduce-ring": lambda t, x, c: all_reduce(t, x, chunk_bytes=c, small_bytes=0),
    "all_reduce-direct": lambda t, x, c: all_reduce(t, x, chunk_bytes=c, small_bytes=1 << 40),
    "reduce_scatter": lambda t, x, c: reduce_scatter(t, x, chunk_bytes=c),
    "all_gather": lambda t, x, c: all_gather(t, x, chunk_bytes=c),
    "broadcast": lambda t, x, c: broadcast(t, x, 1, chunk_bytes=c),
}


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
@pytest.mark.parametrize("call", sorted(HUGE_CHUNK_CALLS))
def test_huge_chunk_bytes_does_not_allocate_chunk_sized_buffers(kind: str, call: str) -> None:
    """chunk_bytes bounds a frame; it is not an allocation size: "no chunking" (1 TiB) works
    on a 100k-element tensor like any chunk larger than the tensor."""
    numel, n = 100_000, 2
    inputs = [torch.arange(numel, dtype=torch.float32) + rank for rank in range(n)]

    async def rank_fn(transport: Transport) -> Any:
        x = inputs[transport.rank].clone()
        out = await HUGE_CHUNK_CALLS[call](transport, x, 1 << 40)
        return out

    results = run_in_group(kind, n, rank_fn, seconds=30)
    total = inputs[0] + inputs[1]
    for rank, result in enumerate(results):
        if call.startswith("all_reduce"):
            assert torch.equal(result, total)
        elif call == "reduce_scatter":
            lo, hi = segment_bounds(numel, n)[rank]
            assert torch.equal(result, total[lo:hi])
        elif call == "all_gather":
            assert torch.equal(result, torch.stack(inputs))
        else:
            assert torch.equal(result, inputs[1])


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_8_mib_frames_do_not_deadlock(kind: str) -> None:
    """Two ranks that each send one 8 MiB frame before reading must not wait on each other:
    the frame is larger than any socket buffer, so send and receive must run concurrently."""
    numel = (8 << 20) // 4
    chunk = 8 << 20
    base = torch.arange(numel, dtype=torch.float32) % 4096  # sums stay exact in float32
    inputs = [base + 1000 * rank for rank in range(2)]
    expected = inputs[0] + inputs[1]

    async def rank_fn(transport: Transport) -> None:
        rank = transport.rank
        ring = inputs[rank].clone()
        await all_reduce(transport, ring, chunk_bytes=chunk)  # 4 MiB segments, one frame each
        assert torch.equal(ring, expected)
        direct = inputs[rank].clone()
        await all_reduce(transport, direct, chunk_bytes=chunk, small_bytes=1 << 40)  # 8 MiB
        assert torch.equal(direct, expected)
        bcast = inputs[rank].clone()
        await broadcast(transport, bcast, 1, chunk_bytes=chunk)
        assert torch.equal(bcast, inputs[1])
        gathered = await all_gather(transport, inputs[rank], chunk_bytes=chunk)
        assert torch.equal(gathered, torch.stack(inputs))
        segment = await reduce_scatter(transport, inputs[rank].clone(), chunk_bytes=chunk)
        lo, hi = segment_bounds(numel, 2)[rank]
        assert torch.equal(segment, expected[lo:hi])

    run_in_group(kind, 2, rank_fn, seconds=60)


# --------------------------------------------------------------------------- out of step


def run_out_of_step(kind: str, n: int, programs: list[Callable[[Transport], Awaitable[Any]]]):
    async def main() -> list[Any]:
        async with open_group(kind, n) as transports:
            return await run_ranks_capture(transports, lambda t: programs[t.rank](t), seconds=20)

    return trio.run(main)


def assert_protocol_error(result: object, peer: int | None = None, text: str = "") -> None:
    assert isinstance(result, ProtocolError), (
        f"expected a ProtocolError naming peer {peer}, got {result!r}"
    )
    if peer is not None:
        assert result.peer == peer and f"peer {peer}" in str(result), str(result)
    assert text in str(result), str(result)


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
@pytest.mark.parametrize(
    ("small_bytes", "numel"),
    [(SMALL_ALLREDUCE_BYTES, 64), (0, 64), (0, 300_000)],
    ids=["direct", "ring", "ring-large"],
)
def test_ranks_with_different_op_ids_raise_protocol_error_naming_the_peer(
    kind: str, small_bytes: int, numel: int
) -> None:
    """Rank 0 makes one collective more than rank 1 (an empty broadcast still takes an op id):
    both sides must see a ProtocolError naming the other rank, not hang. (ring-large: over TCP
    a tensor this size takes the worker-thread ring.)"""

    async def ahead(t: Transport) -> None:
        await broadcast(t, torch.empty(0))
        await all_reduce(t, torch.ones(numel), small_bytes=small_bytes)

    async def behind(t: Transport) -> None:
        await all_reduce(t, torch.ones(numel), small_bytes=small_bytes)

    results = run_out_of_step(kind, 2, [ahead, behind])
    assert_protocol_error(results[0], peer=1)
    assert_protocol_error(results[1], peer=0)
    # whoever judges first sees the op ids differ; the other may already see it hang up
    assert any("out of step" in str(r) for r in results), results


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_different_collectives_raise_protocol_error_naming_the_peer(kind: str) -> None:
    """Rank 0 enters a barrier (1 int32) while rank 1 all-reduces 4 float32s."""

    async def in_barrier(t: Transport) -> None:
        await barrier(t)

    async def in_reduce(t: Transport) -> None:
        await all_reduce(t, torch.ones(4))

    results = run_out_of_step(kind, 2, [in_barrier, in_reduce])
    assert_protocol_error(results[0], peer=1)
    assert_protocol_error(results[1], peer=0)


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_reduce_scatter_against_all_reduce_fails_on_the_next_collective(kind: str) -> None:
    """reduce_scatter runs n-1 ring hops and all_reduce 2(n-1): rank 1 still waits for hop 1
    when rank 0's next collective arrives as op 1 hop 0."""
    x = torch.arange(64, dtype=torch.float32)

    async def scatter_first(t: Transport) -> None:
        await reduce_scatter(t, x.clone())
        await all_reduce(t, x.clone(), small_bytes=0)

    async def reduce_first(t: Transport) -> None:
        await all_reduce(t, x.clone(), small_bytes=0)
        await all_reduce(t, x.clone(), small_bytes=0)

    results = run_out_of_step(kind, 2, [scatter_first, reduce_first])
    assert_protocol_error(results[0], peer=1)
    assert_protocol_error(results[1], peer=0)


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_three_ranks_out_of_step_all_fail(kind: str) -> None:
    """On a ring of 3, rank 0 is one op ahead: ranks 0 and 1 receive frames of the wrong op,
    and every rank fails with a ProtocolError naming another rank (the third because its peer
    closed) instead of waiting forever."""

    async def ahead(t: Transport) -> None:
        await broadcast(t, torch.empty(0))
        await all_reduce(t, torch.ones(300), small_bytes=0, chunk_bytes=64)

    async def normal(t: Transport) -> None:
        await all_reduce(t, torch.ones(300), small_bytes=0, chunk_bytes=64)

    results = run_out_of_step(kind, 3, [ahead, normal, normal])
    for rank, result in enumerate(results):
        assert_protocol_error(result)
        assert result.peer in set(range(3)) - {rank}, result
    assert any("out of step" in str(r) for r in results), results


CRAFTED = {
    "wrong-hop": ("coll", {"op": 0, "hop": 1, "part": 0}, torch.ones(32), "hop 1"),
    "wrong-part": ("coll", {"op": 0, "hop": 0, "part": 3}, torch.ones(32), "part 3"),
    "wrong-op": ("coll", {"op": 5, "hop": 0, "part": 0}, torch.ones(32), "op 5"),
    "wrong-size": ("coll", {"op": 0, "hop": 0, "part": 0}, torch.ones(33), ""),
    "wrong-dtype": ("coll", {"op": 0, "hop": 0, "part": 0}, torch.ones(32).double(), ""),
    "wrong-kind": ("refuse", {"reason": "nope"}, None, ""),
}


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
@pytest.mark.parametrize("crafted", sorted(CRAFTED))
def test_an_unexpected_frame_in_the_ring_raises_protocol_error(kind: str, crafted: str) -> None:
    """Rank 1 runs a 2-rank ring all-reduce of 64 float32 (segments of 32); "rank 0" sends a
    frame that is not hop 0 part 0 of op 0 with 32 float32s."""
    msg_kind, fields, bulk, text = CRAFTED[crafted]

    async def rogue(t: Transport) -> None:
        await t.send(1, msg_kind, fields, bulk)
        await trio.sleep(0.5)  # let rank 1 judge the frame before this rank closes

    async def honest(t: Transport) -> None:
        await all_reduce(t, torch.ones(64), small_bytes=0)

    results = run_out_of_step(kind, 2, [rogue, honest])
    assert_protocol_error(results[1], peer=0, text=text)
