"""A conformance suite any `Transport` runs against itself, as trio's ``check_two_way_stream``
checks a stream.

``await check_transport(make_group)`` opens groups of connected transports with
``make_group(n)`` (an async context manager yielding ``n`` transports, rank 0 to n-1, closed on
exit) and checks the contract of `paramsync.runtime.transport.base.Transport` that the collectives
rely on, then every capability of `paramsync.runtime.transport.capabilities` the transports declare.
A transport that breaks the contract fails with a `ConformanceError` saying which check and what was
seen; a hang fails the same way at the check's deadline.

The contract checked:

- control messages between every ordered pair of ranks, in order per pair, with no crosstalk;
- tensors of every supported dtype and of edge shapes (0-d, empty, multi-dimensional) arrive
  with their dtype, shape and bytes; a non-contiguous tensor is sent as its values; `recv_into`
  writes into the destination and returns it as ``data``, and refuses a non-contiguous one
  with a `paramsync.runtime.errors.CollectiveError` before reading, leaving the message for the next
  receive;
- concurrent sends and receives in both directions of every pair, with payloads larger than
  any socket buffer, finish (no deadlock) and arrive intact;
- a peer that is not another rank of the group is a `CollectiveError`; a bulk of another
  dtype or size than the destination, or no bulk at all, is a
  `paramsync.runtime.errors.ProtocolError` naming the sending peer;
- after a peer closes, what it sent still arrives, then receiving is
  `paramsync.runtime.errors.PeerClosed` naming it, and so is sending, soon; a receive pending at the
  close fails the same way, as do calls on a transport after its own close: never a hang;
- all_reduce (sum and avg, on the one-round, ring, threaded-ring and shared-memory paths that
  apply), broadcast from every root, all_gather, reduce_scatter and barrier give exact results,
  bitwise the same on every rank;
- `BlockingLinkProvider`, `PolledLinkProvider`, `PrecodedFrames` and `SharedMemoryHolder`, for
  a transport that declares them, keep the contracts their classes document.

Each check is also a public function ``check_x(make_group, n)`` (listed in `CHECKS`), so a test
can run them one by one.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Literal, TypeVar

import torch
import trio
import trio.testing

from paramsync.runtime.collectives.ring import (
    THREADED_MIN_BYTES,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    reduce_scatter,
)
from paramsync.runtime.errors import (
    CollectiveError,
    PeerClosed,
    ProtocolError,
    StallError,
    pick_error,
)
from paramsync.runtime.protocol.wire import encode_frame_bytes
from paramsync.runtime.transport.base import Transport
from paramsync.runtime.transport.capabilities import (
    AllReducePlane,
    BlockingLinkProvider,
    BlockingLinkSet,
    PolledLinkProvider,
    PolledLinkSet,
    PrecodedFrames,
    SharedMemoryHolder,
)
from paramsync.runtime.transport.segments import SUPPORTED_DTYPES, segment_bounds

__all__ = [
    "CHECKS",
    "ConformanceError",
    "MakeGroup",
    "check_transport",
    "check_pairs",
    "check_tensors",
    "check_concurrent_bulk",
    "check_errors",
    "check_close",
    "check_collectives",
    "check_blocking_links",
    "check_polled_links",
    "check_precoded_frames",
    "check_shared_memory",
]

MakeGroup = Callable[[int], AbstractAsyncContextManager[Sequence[Transport]]]
"""``make_group(n)``: an async context manager yielding ``n`` connected transports, rank 0 to
n-1, and closing them on exit (closing one already closed must be harmless)."""

CHECK_SECONDS = 60.0
"""Deadline of one check: far beyond any healthy transport, even on a loaded 2-core machine."""
LARGE_BYTES = 16 << 20
"""Bulk of the concurrency check: more than a loopback socket's buffers (8 MiB once the kernel
doubles the 4 MiB asked for), so each side must read while it writes."""
_CHUNK_BYTES = 64 << 10
"""Collectives' part size here: small, so a large tensor travels in many parts."""


_T = TypeVar("_T")
ReduceOp = Literal["sum", "avg"]
_OPS: tuple[ReduceOp, ...] = ("sum", "avg")


class ConformanceError(AssertionError):
    """A transport broke the contract: the message names the check and what was seen."""


def _require(condition: object, what: str) -> None:
    if not condition:
        raise ConformanceError(what)


async def _expect_error(
    error: type[BaseException], what: str, call: Callable[[], Awaitable[Any]]
) -> BaseException:
    """Run ``call``; return the ``error`` it raises, fail if it raises nothing or another."""
    try:
        await call()
    except error as exc:
        return exc
    except Exception as exc:
        raise ConformanceError(
            f"{what}: expected {error.__name__}, got {type(exc).__name__}: {exc}"
        ) from exc
    raise ConformanceError(f"{what}: expected {error.__name__}, nothing was raised")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Small integer values (sums of a few stay exact in every dtype, bfloat16 and int8
    included), distinct per seed."""
    gen = torch.Generator().manual_seed(seed)
    low = 0 if dtype == torch.uint8 else -40
    return torch.randint(low, 41, shape, generator=gen).to(dtype)


async def _run_ranks(group: Sequence[_T], fn: Callable[[_T], Awaitable[Any]]) -> list[Any]:
    """``fn(transport)`` on every rank at once; the results by position."""
    results: list[Any] = [None] * len(group)

    async def one(index: int) -> None:
        results[index] = await fn(group[index])

    async with trio.open_nursery() as nursery:
        for index in range(len(group)):
            nursery.start_soon(one, index)
    return results


@asynccontextmanager
async def _group(make_group: MakeGroup, n: int, check: str) -> AsyncIterator[list[Transport]]:
    """A group from ``make_group``, checked for its ranks, with the check's deadline: a hang is
    a `ConformanceError` naming ``check``."""
    with trio.move_on_after(CHECK_SECONDS) as scope:
        async with make_group(n) as made:
            group = list(made)
            _require(len(group) == n, f"{check}: make_group({n}) yielded {len(group)} transports")
            for rank, transport in enumerate(group):
                _require(
                    isinstance(transport, Transport),
                    f"{check}: make_group yielded a {type(transport).__name__}, not a Transport",
                )
                _require(
                    (transport.rank, transport.world_size) == (rank, n),
                    f"{check}: transport {rank} says it is rank {transport.rank} of "
                    f"{transport.world_size}, expected rank {rank} of {n}",
                )
            try:
                yield group
            except BaseExceptionGroup as exc:  # a nursery's: raise what went wrong, plainly
                leaf = _telling(exc)
                if leaf is exc:
                    raise
                raise leaf from None
    if scope.cancelled_caught:
        raise ConformanceError(f"{check}: no result within {CHECK_SECONDS} s (a hang)")


def _telling(group: BaseExceptionGroup) -> BaseException:
    """A ConformanceError among the group's leaves, else `paramsync.runtime.errors.pick_error`'s."""
    matched: BaseException | None = group.split(ConformanceError)[0]
    while isinstance(matched, BaseExceptionGroup):
        matched = matched.exceptions[0]
    return matched if matched is not None else pick_error(group)


def _pairs(n: int) -> list[tuple[int, int]]:
    return [(src, dst) for src in range(n) for dst in range(n) if src != dst]


# ------------------------------------------------------------------------------ point to point


async def check_pairs(make_group: MakeGroup, n: int, count: int = 24) -> None:
    """Every ordered pair exchanges ``count`` numbered messages at once, control messages and
    bulk ones interleaved: each arrives, in order, from its sender only."""

    def bulk(src: int, dst: int, seq: int) -> torch.Tensor | None:
        return None if seq % 3 else torch.full((seq * 37 % 1000 + 1,), float(src * 100 + dst))

    async with _group(make_group, n, "pairs") as group:

        async def send_all(src: int, dst: int) -> None:
            for seq in range(count):
                payload = bulk(src, dst, seq)
                if payload is None:
                    note = f"{src}->{dst} #{seq}"
                    fields = {"src": src, "dst": dst, "seq": seq, "note": note}
                    await group[src].send(dst, "probe", fields)
                else:
                    await group[src].send(dst, "probe_data", {"src": src, "seq": seq}, payload)

        async def recv_all(dst: int, src: int) -> None:
            for seq in range(count):
                message = await group[dst].recv(src)
                expected = bulk(src, dst, seq)
                where = f"pairs: rank {dst}'s message #{seq} from rank {src}"
                if expected is None:
                    _require(
                        message.get("kind") == "probe"
                        and (message["src"], message["dst"], message["seq"]) == (src, dst, seq)
                        and message["note"] == f"{src}->{dst} #{seq}",
                        f"{where} is {message!r}",
                    )
                else:
                    _require(
                        message.get("kind") == "probe_data"
                        and (message["src"], message["seq"]) == (src, seq)
                        and isinstance(message.get("data"), torch.Tensor)
                        and _same(message["data"], expected),
                        f"{where} is not the bulk message sent (kind {message.get('kind')!r})",
                    )

        async with trio.open_nursery() as nursery:
            for src, dst in _pairs(n):
                nursery.start_soon(send_all, src, dst)
                nursery.start_soon(recv_all, dst, src)


_SHAPES: tuple[tuple[int, ...], ...] = ((), (0,), (1,), (7,), (3, 5), (2, 0, 3), (4, 1, 6))


async def check_tensors(make_group: MakeGroup, n: int) -> None:
    """Tensors of every supported dtype and edge shape travel from rank 0 to rank n-1 intact,
    through `recv` (dtype and shape kept) and `recv_into` (written into the destination, which
    comes back as ``data``); a non-contiguous tensor is sent as its values; a non-contiguous
    destination is refused before the message is read."""
    src, dst = 0, n - 1
    cases = [
        (dtype, shape, _values(dtype, shape, index))
        for index, (dtype, shape) in enumerate(
            (dtype, shape) for dtype in sorted(SUPPORTED_DTYPES, key=str) for shape in _SHAPES
        )
    ]
    strided = _values(torch.float32, (6, 8), 99).t()[::2]  # non-contiguous
    async with _group(make_group, n, "tensors") as group:
        sender, receiver = group[src], group[dst]

        async def send_all() -> None:
            for seq, (_, _, tensor) in enumerate(cases):
                await sender.send(dst, "probe_data", {"src": src, "seq": seq}, tensor)
            for seq, (_, _, tensor) in enumerate(cases):
                await sender.send(dst, "probe_data", {"src": src, "seq": seq}, tensor)
            await sender.send(dst, "probe_data", {"src": src, "seq": 0}, strided)
            await sender.send(dst, "probe_data", {"src": src, "seq": 1}, strided)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_all)
            for seq, (dtype, shape, tensor) in enumerate(cases):
                message = await receiver.recv(src)
                data = message.get("data")
                _require(
                    isinstance(data, torch.Tensor) and _same(data, tensor),
                    f"tensors: a {dtype} tensor of shape {list(shape)} arrived through recv as "
                    + (
                        f"a {data.dtype} tensor of shape {list(data.shape)}"
                        if isinstance(data, torch.Tensor)
                        else f"{data!r}"
                    )
                    + " or with other bytes",
                )
                _require(message["seq"] == seq, f"tensors: recv #{seq} got seq {message['seq']}")
            for seq, (dtype, shape, tensor) in enumerate(cases):
                out = torch.full((math.prod(shape),), 7, dtype=dtype)
                address = out.data_ptr()
                message = await receiver.recv_into(src, out)
                _require(
                    message.get("data") is out
                    and out.data_ptr() == address
                    and message["seq"] == seq,
                    f"tensors: recv_into #{seq} of a {dtype} tensor of shape {list(shape)} did "
                    "not return the destination itself as data, or came out of order",
                )
                _require(
                    _same(out, tensor.reshape(-1)),
                    f"tensors: recv_into wrote other values than the {dtype} tensor of shape "
                    f"{list(shape)} sent",
                )
            message = await receiver.recv(src)
            _require(
                _same(message["data"], strided.contiguous()),
                "tensors: a non-contiguous tensor did not arrive as its values",
            )
            bad = torch.zeros(6, 8).t()[:, :3]  # 24 elements, non-contiguous
            await _expect_error(
                CollectiveError,
                "tensors: recv_into a non-contiguous destination",
                lambda: receiver.recv_into(src, bad),
            )
            out = torch.zeros(strided.numel())
            message = await receiver.recv_into(src, out)  # the refused receive read nothing
            _require(
                message["seq"] == 1 and _same(out, strided.reshape(-1)),
                "tensors: refusing a non-contiguous destination consumed the message",
            )


async def check_concurrent_bulk(make_group: MakeGroup, n: int, nbytes: int = LARGE_BYTES) -> None:
    """Every rank sends ``nbytes`` to every other rank while receiving as much from each: no
    deadlock, and each payload lands intact in its destination."""
    numel = nbytes // 4

    def payload(src: int, dst: int) -> torch.Tensor:
        return torch.arange(numel, dtype=torch.int32) * (n * n) + (src * n + dst)

    async with _group(make_group, n, "concurrent bulk") as group:

        async def rank_main(transport: Transport) -> None:
            me = transport.rank
            outs = {peer: torch.empty(numel, dtype=torch.int32) for peer in range(n) if peer != me}

            async def receive(peer: int) -> None:
                message = await transport.recv_into(peer, outs[peer])
                _require(
                    message["seq"] == 0 and _same(outs[peer], payload(peer, me)),
                    f"concurrent bulk: rank {me} received other bytes from rank {peer}",
                )

            async with trio.open_nursery() as nursery:
                for peer in outs:
                    nursery.start_soon(receive, peer)
                    nursery.start_soon(
                        transport.send,
                        peer,
                        "probe_data",
                        {"src": me, "seq": 0},
                        payload(me, peer),
                    )

        await _run_ranks(group, rank_main)


_BAD_PEERS: tuple[Any, ...] = (-1, True, "1", 1.0)


async def check_errors(make_group: MakeGroup, n: int) -> None:
    """Peers that are not another rank are a CollectiveError; a bulk that does not fit the
    destination (dtype, size, none at all) is a ProtocolError naming the sender."""
    async with _group(make_group, n, "errors") as group:
        t0 = group[0]
        for peer in (0, n, *_BAD_PEERS):
            for name, call in (
                ("send to", lambda p=peer: t0.send(p, "welcome", {})),
                ("recv from", lambda p=peer: t0.recv(p)),
                ("recv_into from", lambda p=peer: t0.recv_into(p, torch.empty(1))),
            ):
                await _expect_error(
                    CollectiveError, f"errors: rank 0 of {n} may not {name} peer {peer!r}", call
                )
    mismatches: list[tuple[str, torch.Tensor | None, torch.Tensor]] = [
        ("another dtype", torch.zeros(8, dtype=torch.float32), torch.empty(8, dtype=torch.int32)),
        ("another size", torch.zeros(8), torch.empty(9)),
        ("no bulk", None, torch.empty(8)),
    ]
    for what, bulk, out in mismatches:
        # Each in a fresh group: after a ProtocolError the connection need not be usable.
        async with _group(make_group, n, "errors") as group:
            src, dst = n - 1, 0
            if bulk is None:
                await group[src].send(dst, "welcome", {})
            else:
                await group[src].send(dst, "probe_data", {"src": src, "seq": 0}, bulk)
            error = await _expect_error(
                ProtocolError,
                f"errors: recv_into a destination that the bulk does not fit ({what})",
                functools.partial(group[dst].recv_into, src, out),
            )
            _require(
                getattr(error, "peer", None) == src and f"peer {src}" in str(error),
                f"errors: the ProtocolError for a bulk of {what} does not name peer {src}: "
                f"{error!r}",
            )


async def check_close(make_group: MakeGroup, n: int) -> None:
    """A closed peer is PeerClosed naming it, on receive and (soon) on send; what it sent
    before closing still arrives; receives pending at a close fail rather than hang."""
    async with _group(make_group, n, "close") as group:
        t0, t1 = group[0], group[1]
        await t0.send(1, "refuse", {"reason": "last words"})
        await t0.aclose()
        message = await t1.recv(0)
        _require(
            message.get("reason") == "last words",
            "close: a message sent just before the close was lost",
        )
        error = await _expect_error(
            PeerClosed, "close: recv from a closed peer", lambda: t1.recv(0)
        )
        _require(getattr(error, "peer", None) == 0, f"close: {error!r} does not name peer 0")

        async def send_until_refused() -> None:
            for _ in range(1000):  # TCP may take a few sends to notice the reset
                await t1.send(0, "probe_data", {"src": 1, "seq": 0}, torch.zeros(16384))

        error = await _expect_error(PeerClosed, "close: send to a closed peer", send_until_refused)
        _require(getattr(error, "peer", None) == 0, f"close: {error!r} does not name peer 0")
    async with _group(make_group, n, "close") as group:
        last = group[n - 1]
        failures: dict[str, BaseException | None] = {}

        async def pending(name: str, transport: Transport, peer: int) -> None:
            try:
                await transport.recv(peer)
            except PeerClosed as exc:
                failures[name] = exc
            except Exception as exc:
                raise ConformanceError(
                    f"close: a receive pending at the close ({name}) failed with "
                    f"{type(exc).__name__}: {exc}, not PeerClosed"
                ) from exc
            else:
                raise ConformanceError(f"close: a receive pending at the close ({name}) returned")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pending, "its peer closed", group[0], n - 1)
            nursery.start_soon(pending, "its own transport closed", last, 0)
            await trio.testing.wait_all_tasks_blocked()
            await last.aclose()
        await _expect_error(PeerClosed, "close: recv on a closed transport", lambda: last.recv(0))
        await _expect_error(
            PeerClosed, "close: send on a closed transport", lambda: last.send(0, "welcome", {})
        )
        await last.aclose()  # a second close is harmless


# ------------------------------------------------------------------------------ collectives


def _exact_reduce(inputs: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """The exact sum (or average, rounded once as the collectives document) of ``inputs``."""
    total = torch.stack([t.to(torch.int64) for t in inputs]).sum(0).to(inputs[0].dtype)
    if op == "avg":
        if total.is_floating_point():
            return total.div(len(inputs))
        return total.div(len(inputs), rounding_mode="floor")
    return total


async def _all_reduce_case(
    group: Sequence[Transport], dtype: torch.dtype, numel: int, op: ReduceOp, seed: int
) -> None:
    n = len(group)
    inputs = [_values(dtype, (numel,), seed * 31 + rank) for rank in range(n)]
    expected = _exact_reduce(inputs, op)
    tensors = [t.clone() for t in inputs]

    async def reduce(transport: Transport) -> torch.Tensor:
        return await all_reduce(transport, tensors[transport.rank], op, chunk_bytes=_CHUNK_BYTES)

    returned = await _run_ranks(group, reduce)
    for rank in range(n):
        _require(
            returned[rank] is tensors[rank] and _same(tensors[rank], expected),
            f"collectives: all_reduce {op} of {numel} {dtype} elements is not exact on rank {rank}",
        )


async def check_collectives(make_group: MakeGroup, n: int) -> None:
    """all_reduce, broadcast, all_gather, reduce_scatter and barrier through the transport give
    exact results, the same on every rank, on every path that applies (one round, ring, ring
    on threads when blocking links are lent, shared-memory plane when one is attached)."""
    async with _group(make_group, n, "collectives") as group:
        seed = 0
        for dtype in sorted(SUPPORTED_DTYPES, key=str):
            for numel in (0, 1, n + 1, 3000):
                for op in _OPS:
                    seed += 1
                    await _all_reduce_case(group, dtype, numel, op, seed)
        large = THREADED_MIN_BYTES // 4 + 12345  # past the threaded and plane thresholds
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            for op in _OPS:
                seed += 1
                await _all_reduce_case(group, dtype, large, op, seed)

        for numel in (0, 1, 5000, large):
            for root in range(n):
                inputs = [_values(torch.float64, (numel,), 1000 + rank) for rank in range(n)]

                async def cast(transport: Transport, r: int = root, ins: Any = inputs) -> Any:
                    return await broadcast(
                        transport, ins[transport.rank], r, chunk_bytes=_CHUNK_BYTES
                    )

                await _run_ranks(group, cast)
                for rank in range(n):
                    _require(
                        _same(inputs[rank], _values(torch.float64, (numel,), 1000 + root)),
                        f"collectives: broadcast of {numel} elements from root {root}: rank "
                        f"{rank} does not hold the root's tensor",
                    )

        for shape in ((0,), (3, 5), (large,)):
            inputs = [_values(torch.int32, shape, 2000 + rank) for rank in range(n)]

            async def gather(transport: Transport, ins: Any = inputs) -> torch.Tensor:
                return await all_gather(transport, ins[transport.rank], chunk_bytes=_CHUNK_BYTES)

            stacked = torch.stack(inputs)
            for rank, got in enumerate(await _run_ranks(group, gather)):
                _require(
                    _same(got, stacked),
                    f"collectives: all_gather of shape {list(shape)} on rank {rank} is not "
                    "every rank's tensor in rank order",
                )

        cases: tuple[tuple[int, ReduceOp], ...] = ((n - 1, "sum"), (1001, "avg"), (large, "sum"))
        for numel, op in cases:
            inputs = [_values(torch.int64, (numel,), 3000 + rank) for rank in range(n)]
            expected = _exact_reduce(inputs, op)
            scratch = [t.clone() for t in inputs]

            async def scatter(transport: Transport, s: Any = scratch, o: ReduceOp = op) -> Any:
                return await reduce_scatter(
                    transport, s[transport.rank], o, chunk_bytes=_CHUNK_BYTES
                )

            for rank, got in enumerate(await _run_ranks(group, scatter)):
                lo, hi = segment_bounds(numel, n)[rank]
                _require(
                    _same(got, expected[lo:hi]),
                    f"collectives: reduce_scatter {op} of {numel} elements: rank {rank}'s "
                    "segment is not exact",
                )

        entered: list[int] = []
        left: list[int] = []

        async def enter(transport: Transport) -> None:
            if transport.rank == n - 1:  # the last to come: everyone else already waits
                await trio.testing.wait_all_tasks_blocked()
            entered.append(transport.rank)
            await barrier(transport)
            left.append(len(entered))

        await _run_ranks(group, enter)
        _require(
            left == [n] * n,
            f"collectives: barrier let ranks out before all {n} entered ({left} entered then)",
        )


# ------------------------------------------------------------------------------ capabilities


async def _wake_on_abort(
    links_cm: AbstractAsyncContextManager[Any], block: Callable[[Any], None], check: str
) -> None:
    """Enter ``links_cm``, run ``block(links)`` (which blocks) on a thread, then leave the
    block by cancellation: the lent links must be aborted, waking the thread with PeerClosed."""
    woke = trio.Event()
    token = trio.lowlevel.current_trio_token()
    outcome: list[BaseException | None] = []

    def run(links: Any) -> None:
        try:
            block(links)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)
        finally:
            token.run_sync_soon(woke.set)

    with trio.CancelScope() as scope:
        async with links_cm as links:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    lambda: trio.to_thread.run_sync(run, links, abandon_on_cancel=True)
                )
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
    with trio.move_on_after(10) as waited:
        await woke.wait()
    _require(not waited.cancelled_caught, f"{check}: a thread blocked on lent links stayed blocked")
    _require(
        outcome and isinstance(outcome[0], PeerClosed),
        f"{check}: a thread blocked on aborted links woke with {outcome[0]!r}, not PeerClosed",
    )


async def _still_usable(group: Sequence[Transport], check: str) -> None:
    """Every rank pings its ring neighbour through the trio path, which must work again."""
    n = len(group)

    async def ping(transport: Transport) -> None:
        me = transport.rank
        fields = {"src": me, "dst": (me + 1) % n, "seq": 0, "note": "after"}
        await transport.send((me + 1) % n, "probe", fields)
        message = await transport.recv((me - 1) % n)
        _require(
            message.get("kind") == "probe" and message["src"] == (me - 1) % n,
            f"{check}: after the links came back, rank {me} got {message!r}",
        )

    await _run_ranks(group, ping)


async def check_blocking_links(make_group: MakeGroup, n: int) -> None:
    """A `BlockingLinkProvider` that supports blocking lends links on which OS threads send and
    receive whole bulks (both directions at once), gives the connections back in working order,
    and aborts them (waking a blocked thread) when the block is left by cancellation. One that
    does not support it now refuses with CollectiveError. Nothing to check otherwise."""
    async with _group(make_group, n, "blocking links") as group:
        if not all(isinstance(t, BlockingLinkProvider) for t in group):
            _require(
                not any(isinstance(t, BlockingLinkProvider) for t in group),
                "blocking links: only some ranks of one group declare BlockingLinkProvider",
            )
            return
        providers = [t for t in group if isinstance(t, BlockingLinkProvider)]
        if not all(t.supports_blocking for t in providers):
            t0 = providers[0]
            _require(
                not t0.supports_blocking, "blocking links: ranks disagree on supports_blocking"
            )

            async def lend() -> None:
                async with t0.blocking_links({1}):
                    raise ConformanceError("blocking links: lent although unsupported")

            await _expect_error(CollectiveError, "blocking links while unsupported", lend)
            return
        numel = (3 << 20) // 4 + 7

        def payload(src: int) -> torch.Tensor:
            return torch.arange(numel, dtype=torch.float32) + src

        async def exchange(transport: BlockingLinkProvider) -> None:
            me = transport.rank
            nxt, prv = (me + 1) % n, (me - 1) % n
            out = torch.empty(numel)
            async with transport.blocking_links({nxt, prv}) as links:
                _require(
                    isinstance(links, BlockingLinkSet),
                    f"blocking links: lent a {type(links).__name__}, not a BlockingLinkSet",
                )

                def send() -> None:
                    links.send(nxt, "probe_data", {"src": me, "seq": 0}, payload(me))

                def receive() -> dict[str, Any]:
                    return links.recv_into(prv, out)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(trio.to_thread.run_sync, send)
                    message = await trio.to_thread.run_sync(receive)
            _require(
                message.get("data") is out and message["src"] == prv and _same(out, payload(prv)),
                f"blocking links: rank {me} received other bytes from rank {prv} on a thread",
            )

        await _run_ranks(providers, exchange)
        await _still_usable(group, "blocking links")
        t0 = providers[0]
        await _wake_on_abort(
            t0.blocking_links({1}),
            lambda links: links.recv_into(1, torch.empty(4)),
            "blocking links",
        )
        await _expect_error(
            PeerClosed,
            "blocking links: the transport after its lent links were aborted",
            lambda: t0.recv(1),
        )


async def check_polled_links(make_group: MakeGroup, n: int) -> None:
    """A `PolledLinkProvider` that supports polling lends links on which one thread sends
    pre-encoded frames to every peer and recognises them, decodes any other message, fails a
    silent peer with StallError naming it by the deadline, gives the connections back in
    working order, and aborts them when the block is left by cancellation."""
    async with _group(make_group, n, "polled links") as group:
        if not all(isinstance(t, PolledLinkProvider) for t in group):
            _require(
                not any(isinstance(t, PolledLinkProvider) for t in group),
                "polled links: only some ranks of one group declare PolledLinkProvider",
            )
            return
        providers = [t for t in group if isinstance(t, PolledLinkProvider)]
        if not all(t.supports_polled for t in providers):

            async def lend() -> None:
                async with providers[0].polled_links({1}):
                    raise ConformanceError("polled links: lent although unsupported")

            await _expect_error(CollectiveError, "polled links while unsupported", lend)
            return

        def signal(src: int, seq: int) -> bytes:
            fields = {"src": src, "dst": 0, "seq": seq, "note": "signal"}
            return encode_frame_bytes("probe", fields)

        async def exchange(transport: PolledLinkProvider) -> None:
            me = transport.rank
            peers = {peer for peer in range(n) if peer != me}
            async with transport.polled_links(peers) as links:
                _require(
                    isinstance(links, PolledLinkSet),
                    f"polled links: lent a {type(links).__name__}, not a PolledLinkSet",
                )

                def run() -> list[dict[str, Any] | None]:
                    for peer in sorted(peers):
                        links.send_frame(peer, signal(me, 0))
                        links.send_frame(peer, signal(me, 1))
                    got = []
                    deadline = time.monotonic() + CHECK_SECONDS
                    for peer in sorted(peers):
                        got.append(links.recv_matching(peer, signal(peer, 0), deadline))
                        got.append(links.recv_matching(peer, signal(peer, 0), deadline))
                    return got

                got = await trio.to_thread.run_sync(run)
            for peer, (same, other) in zip(sorted(peers), zip(got[::2], got[1::2])):
                _require(same is None, f"polled links: rank {me} did not recognise its signal")
                _require(
                    other is not None and other["src"] == peer and other["seq"] == 1,
                    f"polled links: rank {me} got {other!r} for another frame from rank {peer}",
                )

        await _run_ranks(providers, exchange)
        await _still_usable(group, "polled links")
        t0 = providers[0]
        async with t0.polled_links({1}) as links:
            started = time.monotonic()
            error = await _expect_error(
                StallError,
                "polled links: waiting on a silent peer",
                lambda: trio.to_thread.run_sync(
                    links.recv_matching, 1, signal(1, 0), time.monotonic() + 0.2
                ),
            )
            _require(
                getattr(error, "peer", None) == 1 and time.monotonic() - started < 10,
                f"polled links: a stall of peer 1 came late or does not name it: {error!r}",
            )
        await _wake_on_abort(
            t0.polled_links({1}),
            lambda links: links.recv_matching(1, signal(1, 0), time.monotonic() + 60),
            "polled links",
        )


async def check_precoded_frames(make_group: MakeGroup, n: int) -> None:
    """A `PrecodedFrames` transport recognises a frame sent with `send_frame` by its bytes (None),
    decodes any other message, in order with ordinary sends, and refuses a bulk message where a
    control one was due with a ProtocolError naming the peer."""
    async with _group(make_group, n, "pre-encoded frames") as group:
        if not all(isinstance(t, PrecodedFrames) for t in group):
            _require(
                not any(isinstance(t, PrecodedFrames) for t in group),
                "pre-encoded frames: only some ranks of one group declare PrecodedFrames",
            )
            return
        framers = [t for t in group if isinstance(t, PrecodedFrames)]
        frame = encode_frame_bytes("probe", {"src": 0, "dst": 0, "seq": 0, "note": "step"})

        async def exchange(transport: PrecodedFrames) -> None:
            me = transport.rank
            peers = [peer for peer in range(n) if peer != me]
            for peer in peers:
                await transport.send_frame(peer, frame)
                await transport.send(peer, "probe_data", {"src": me, "seq": 5})
                await transport.send_frame(peer, frame)
            for peer in peers:
                first = await transport.recv_matching(peer, frame)
                second = await transport.recv_matching(peer, frame)
                third = await transport.recv_matching(peer, frame)
                _require(
                    first is None and third is None,
                    f"pre-encoded frames: rank {me} did not recognise the frame from {peer}",
                )
                _require(
                    second is not None
                    and second.get("kind") == "probe_data"
                    and (second["src"], second["seq"]) == (peer, 5),
                    f"pre-encoded frames: rank {me} got {second!r} from rank {peer}",
                )

        await _run_ranks(framers, exchange)
        await framers[1].send(0, "probe_data", {"src": 1, "seq": 0}, torch.zeros(64))
        error = await _expect_error(
            ProtocolError,
            "pre-encoded frames: a bulk message where a frame was due",
            lambda: framers[0].recv_matching(1, frame),
        )
        _require(getattr(error, "peer", None) == 1, f"pre-encoded frames: {error!r} names no peer")


async def check_shared_memory(make_group: MakeGroup, n: int) -> None:
    """A `SharedMemoryHolder` with a plane attached: the plane is an `AllReducePlane`, ranks
    agree on what it accepts, an all-reduce through it is exact and bitwise the ring's, and
    closing the transport closes the plane and detaches it."""
    async with _group(make_group, n, "shared memory") as group:
        if not all(isinstance(t, SharedMemoryHolder) for t in group):
            _require(
                not any(isinstance(t, SharedMemoryHolder) for t in group),
                "shared memory: only some ranks of one group declare SharedMemoryHolder",
            )
            return
        holders = [t for t in group if isinstance(t, SharedMemoryHolder)]
        planes = [t.shared_memory for t in holders]
        if all(plane is None for plane in planes):
            return  # nothing attached: the ring's paths are checked by check_collectives
        _require(
            all(isinstance(plane, AllReducePlane) and not plane.closed for plane in planes),
            f"shared memory: some ranks hold no open plane: {planes!r}",
        )
        numel = (1 << 20) // 4 + 3
        plane_cases: tuple[tuple[torch.dtype, ReduceOp], ...] = (
            (torch.float32, "sum"),
            (torch.float64, "avg"),
            (torch.int32, "avg"),
        )
        for dtype, op in plane_cases:
            inputs = [_values(dtype, (numel,), 4000 + rank) for rank in range(n)]
            accepted = {plane.accepts(inputs[0]) for plane in planes if plane is not None}
            _require(
                len(accepted) == 1, f"shared memory: ranks disagree on accepting {numel} {dtype}"
            )
            if accepted != {True}:
                continue
            through_plane = [t.clone() for t in inputs]
            through_ring = [t.clone() for t in inputs]

            async def reduce(ts: Any, transport: Transport, o: ReduceOp = op) -> Any:
                return await all_reduce(transport, ts[transport.rank], o)

            await _run_ranks(holders, functools.partial(reduce, through_plane))
            for holder in holders:
                holder.shared_memory = None
            try:
                await _run_ranks(holders, functools.partial(reduce, through_ring))
            finally:
                for holder, plane in zip(holders, planes):
                    holder.shared_memory = plane
            expected = _exact_reduce(inputs, op)
            for rank in range(n):
                _require(
                    _same(through_plane[rank], expected)
                    and _same(through_plane[rank], through_ring[rank]),
                    f"shared memory: all_reduce {op} of {dtype} through the plane on rank {rank} "
                    "is not exact or not bitwise the ring's",
                )
        for holder, plane in zip(holders, planes):
            await holder.aclose()
            _require(
                holder.shared_memory is None and plane is not None and plane.closed,
                f"shared memory: closing rank {holder.rank} left its plane open or attached",
            )


CHECKS: dict[str, Callable[[MakeGroup, int], Awaitable[None]]] = {
    "pairs": check_pairs,
    "tensors": check_tensors,
    "concurrent_bulk": check_concurrent_bulk,
    "errors": check_errors,
    "close": check_close,
    "collectives": check_collectives,
    "blocking_links": check_blocking_links,
    "polled_links": check_polled_links,
    "precoded_frames": check_precoded_frames,
    "shared_memory": check_shared_memory,
}
"""Every check, by name, in the order `check_transport` runs them."""


async def check_transport(make_group: MakeGroup, *, world_sizes: Sequence[int] = (2, 3)) -> None:
    """Run every check in `CHECKS` for each group size in ``world_sizes`` (each at least 2);
    raises `ConformanceError` at the first broken rule."""
    for n in world_sizes:
        if n < 2:
            raise ValueError(f"conformance needs groups of at least 2 ranks, got {n}")
        for check in CHECKS.values():
            await check(make_group, n)
