"""Tagged point-to-point over both transports and over process groups: random matched programs
(blocking and non-blocking) complete under a deadline with every tensor delivered to its own
receive; the Megatron case (two sends to one peer, other shapes) never swaps; a wrong tag, dtype
or shape is a ProtocolError naming the peer, after which the link stays in step."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
import trio
import trio.testing
from conftest import GROUP_KINDS, TRANSPORT_KINDS, open_group, run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paramsync.runtime.collectives.groups import new_group
from paramsync.runtime.collectives.p2p import irecv, isend, recv, recv_on_links, send, send_on_links
from paramsync.runtime.collectives.ring import all_reduce
from paramsync.runtime.errors import CollectiveError, ProtocolError
from paramsync.runtime.transport.base import Transport

SETTINGS = {
    "inproc": settings(
        max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    ),
    "tcp": settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow]),
    "torch": settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow]),
}
MAX_WORLD = {"inproc": 6, "tcp": 3, "torch": 3}
SHAPES = ((), (0,), (3,), (2, 5), (40000,), (7, 3, 2))
DTYPES = (torch.float32, torch.int64, torch.float16, torch.uint8)


@dataclass(frozen=True)
class Message:
    index: int
    src: int
    dst: int
    tag: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def payload(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.index)
        values = torch.randint(0, 100, self.shape, generator=generator)
        return values.to(self.dtype)


@st.composite
def programs(draw: st.DrawFn, max_world: int) -> tuple[int, list[Message], int, bool, bool]:
    """A world size, matched messages among its ranks, a seed, blocking or not, and whether
    the program runs in a process group (group ranks 0..n-1 = world ranks 1..n of n+1)."""
    n = draw(st.integers(2, max_world))
    count = draw(st.integers(1, 12))
    messages = []
    for index in range(count):
        src = draw(st.integers(0, n - 1))
        dst = draw(st.integers(0, n - 2))
        dst = dst + 1 if dst >= src else dst
        tag = draw(st.integers(0, 3))
        shape = draw(st.sampled_from(SHAPES))
        dtype = draw(st.sampled_from(DTYPES))
        messages.append(Message(index, src, dst, tag, shape, dtype))
    seed = draw(st.integers(0, 2**16))
    blocking = draw(st.booleans())
    in_group = draw(st.booleans())
    return n, messages, seed, blocking, in_group


def _posting_order(incoming: list[Message], rng: random.Random) -> list[Message]:
    """Incoming messages in a random order, except that messages from one peer with one tag
    keep their send order (receives of one tag match in posting order)."""
    shuffled = incoming[:]
    rng.shuffle(shuffled)
    queues: dict[tuple[int, int], list[Message]] = {}
    for message in incoming:
        queues.setdefault((message.src, message.tag), []).append(message)
    return [queues[(m.src, m.tag)].pop(0) for m in shuffled]


async def _run_program(
    transport: Transport, messages: list[Message], seed: int, blocking: bool
) -> dict[int, torch.Tensor]:
    rank = transport.rank
    outgoing = [m for m in messages if m.src == rank]
    incoming = [m for m in messages if m.dst == rank]
    received = {m.index: torch.empty(m.shape, dtype=m.dtype) for m in incoming}
    rng = random.Random(seed * 131 + rank)
    if blocking:
        # one sender task sends in program order; one receiver task per peer receives, in
        # that peer's send order, with blocking calls
        async def send_all() -> None:
            for m in outgoing:
                await send(transport, m.payload(), m.dst, m.tag)

        async def receive_from(src: int) -> None:
            for m in incoming:
                if m.src == src:
                    await recv(transport, received[m.index], src, m.tag)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_all)
            for src in {m.src for m in incoming}:
                nursery.start_soon(receive_from, src)
    else:
        # everything posted at once, receives in a random order (the Megatron shape)
        async with trio.open_nursery() as nursery:
            handles = [
                irecv(nursery, transport, received[m.index], m.src, m.tag)
                for m in _posting_order(incoming, rng)
            ]
            for m in outgoing:
                isend(nursery, transport, m.payload(), m.dst, m.tag)
        for handle in handles:
            assert handle.done
            await handle.wait()
    return received


@pytest.mark.parametrize("kind", GROUP_KINDS)
def test_random_matched_programs_complete_and_deliver(kind: str) -> None:
    @SETTINGS[kind]
    @given(programs(MAX_WORLD[kind]))
    def check(program: tuple[int, list[Message], int, bool, bool]) -> None:
        n, messages, seed, blocking, in_group = program

        async def in_a_group(world: Transport) -> dict[int, torch.Tensor] | None:
            group = await new_group(world, range(1, n + 1), shared_memory=False)
            if group is None:
                return None
            async with group:
                return await _run_program(group, messages, seed, blocking)

        async def main() -> list[dict[int, torch.Tensor]]:
            if not in_group:
                async with open_group(kind, n) as world:
                    return await run_ranks(
                        world, lambda t: _run_program(t, messages, seed, blocking), seconds=30
                    )
            async with open_group(kind, n + 1) as world:
                return (await run_ranks(world, in_a_group, seconds=30))[1:]

        results = trio.run(main)
        for m in messages:
            got = results[m.dst][m.index]
            assert got.dtype == m.dtype and got.shape == torch.Size(m.shape)
            assert torch.equal(got, m.payload()), f"message {m} was not delivered intact"

    check()


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_megatron_case_two_sends_to_one_peer_are_not_swapped(kind: str) -> None:
    """Sends of shape (3, 4) tag 1 then (8,) tag 2; the receiver posts tag 2 first."""

    async def rank_fn(t: Transport) -> tuple[torch.Tensor, torch.Tensor] | None:
        if t.rank == 0:
            async with trio.open_nursery() as nursery:
                isend(nursery, t, torch.ones(3, 4), 1, tag=1)
                isend(nursery, t, torch.arange(8.0), 1, tag=2)
            return None
        second, first = torch.empty(8), torch.empty(3, 4)
        async with trio.open_nursery() as nursery:
            h2 = irecv(nursery, t, second, 0, tag=2)
            h1 = irecv(nursery, t, first, 0, tag=1)
        return await h1.wait(), await h2.wait()

    async def main() -> list:
        async with open_group(kind, 2) as world:
            return await run_ranks(world, rank_fn)

    first, second = trio.run(main)[1]
    assert torch.equal(first, torch.ones(3, 4))
    assert torch.equal(second, torch.arange(8.0))


async def _mismatch(kind: str, sent: torch.Tensor, sent_tag: int, want: torch.Tensor, tag: int):
    """Rank 0 sends ``sent``; rank 1 receives into ``want`` (error expected), then both
    exchange a well-matched message to show the link is still in step."""

    async def rank_fn(t: Transport) -> object:
        if t.rank == 0:
            await send(t, sent, 1, sent_tag)
            await send(t, torch.tensor([42]), 1, 9)
            return None
        try:
            await recv(t, want, 0, tag)
        except ProtocolError as exc:
            error = exc
        else:
            error = None
        after = torch.empty(1, dtype=torch.int64)
        await recv(t, after, 0, 9)
        return error, int(after)

    async with open_group(kind, 2) as world:
        return (await run_ranks(world, rank_fn))[1]


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_wrong_tag_dtype_or_shape_is_a_protocol_error_naming_the_peer(kind: str) -> None:
    cases = [
        (torch.ones(3), 5, torch.empty(3), 7, ["tag 5", "expected tag 7"]),
        (torch.ones(3), 7, torch.empty(3, dtype=torch.float64), 7, ["torch.float32", "float64"]),
        (torch.ones(2, 3), 7, torch.empty(3, 2), 7, ["shape [2, 3]", "shape [3, 2]"]),
        (torch.ones(40000), 7, torch.empty(40001), 7, ["shape [40000]", "shape [40001]"]),
    ]
    for sent, sent_tag, want, tag, phrases in cases:
        error, after = trio.run(_mismatch, kind, sent, sent_tag, want, tag)
        assert isinstance(error, ProtocolError), (sent, sent_tag, want, tag)
        assert error.peer == "rank 0"
        for phrase in phrases:
            assert phrase in str(error)
        assert after == 42, "the link fell out of step after the refused message"


SIGNATURES = st.tuples(
    st.integers(0, 3),
    st.sampled_from(((3,), (2, 5), (5, 2), (10,), (4000,))),
    st.sampled_from(DTYPES),
)


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_any_tag_dtype_or_shape_mismatch_is_refused_and_a_match_delivered(kind: str) -> None:
    @SETTINGS[kind]
    @given(SIGNATURES, SIGNATURES)
    def check(sent_sig: tuple, want_sig: tuple) -> None:
        (sent_tag, sent_shape, sent_dtype), (tag, shape, dtype) = sent_sig, want_sig
        sent = torch.arange(math.prod(sent_shape)).view(sent_shape).to(sent_dtype)
        want = torch.empty(shape, dtype=dtype)
        error, after = trio.run(_mismatch, kind, sent, sent_tag, want, tag)
        assert after == 42
        if sent_sig == want_sig:
            assert error is None and torch.equal(want, sent)
        else:
            assert isinstance(error, ProtocolError) and error.peer == "rank 0"
            assert f"tag {sent_tag}" in str(error)

    check()


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_blocking_receives_in_another_order_than_the_tags_are_refused(kind: str) -> None:
    """FIFO pairing would swap these silently; a receive of another tag refuses instead."""

    async def rank_fn(t: Transport) -> object:
        if t.rank == 0:
            await send(t, torch.ones(3, 4), 1, tag=1)
            await send(t, torch.ones(8), 1, tag=2)
            return None
        with pytest.raises(ProtocolError, match=r"sent tag 1 .* expected tag 2"):
            await recv(t, torch.empty(8), 0, tag=2)
        return "refused"

    async def main() -> list:
        async with open_group(kind, 2) as world:
            return await run_ranks(world, rank_fn)

    assert trio.run(main)[1] == "refused"


@pytest.mark.parametrize("kind", GROUP_KINDS)
def test_p2p_in_a_group_names_group_and_world_rank_and_runs_beside_another_groups_all_reduce(
    kind: str,
) -> None:
    async def rank_fn(t: Transport) -> object:
        pipe = await new_group(t, [1, 2], shared_memory=False)  # group ranks 0, 1
        data = await new_group(t, [0, 1, 2], shared_memory=False)
        out: dict[str, object] = {}

        async def pipeline() -> None:
            assert pipe is not None
            if pipe.rank == 0:
                await send(pipe, torch.arange(30000.0), 1, tag=4)
                await send(pipe, torch.ones(2), 1, tag=5)
            else:
                buffer = torch.empty(30000)
                await recv(pipe, buffer, 0, tag=4)
                out["pipe"] = buffer
                try:
                    await recv(pipe, torch.empty(2), 0, tag=6)
                except ProtocolError as exc:
                    out["error"] = exc

        async def reduce() -> None:
            assert data is not None
            tensor = torch.full((50000,), float(t.rank))
            await all_reduce(data, tensor)
            out["sum"] = float(tensor[0])

        async with trio.open_nursery() as nursery:
            if pipe is not None:
                nursery.start_soon(pipeline)
            if data is not None:
                nursery.start_soon(reduce)
        for group in (pipe, data):
            if group is not None:
                await group.aclose()
        return out

    async def main() -> list:
        async with open_group(kind, 4) as world:
            return await run_ranks(world, rank_fn)

    results = trio.run(main)
    assert torch.equal(results[2]["pipe"], torch.arange(30000.0))
    error = results[2]["error"]
    assert isinstance(error, ProtocolError)
    assert error.peer == "group rank 0 (world rank 1)"
    assert "tag 5" in str(error) and "expected tag 6" in str(error)
    assert all(results[rank]["sum"] == 3.0 for rank in (0, 1, 2))


def test_argument_errors() -> None:
    async def main() -> None:
        async with open_group("inproc", 2) as world:
            t = world[0]
            with pytest.raises(CollectiveError, match="tag must be an int"):
                await send(t, torch.ones(2), 1, tag=-1)
            with pytest.raises(CollectiveError, match="contiguous CPU tensor"):
                await send(t, torch.ones(4, 4).t(), 1, tag=0)
            with pytest.raises(CollectiveError, match="cannot talk to peer 0"):
                await recv(t, torch.ones(2), 0, tag=0)
            with pytest.raises(CollectiveError, match="does not support dtype"):
                await send(t, torch.ones(2, dtype=torch.complex64), 1, tag=0)

    trio.run(main)


def test_a_send_cancelled_before_its_turn_does_not_block_later_sends() -> None:
    async def main() -> list[int]:
        async with open_group("inproc", 2) as world:
            a, b = world
            received = []
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    for index in range(8):  # fill the channel (8 frames)
                        isend(nursery, a, torch.tensor([index]), 1, tag=0)
                    with trio.CancelScope() as scope:
                        async with trio.open_nursery() as inner:
                            isend(inner, a, torch.tensor([99]), 1, tag=0)  # blocks in send
                            isend(inner, a, torch.tensor([98]), 1, tag=0)  # waits its turn
                            await trio.testing.wait_all_tasks_blocked()
                            scope.cancel()
                    isend(nursery, a, torch.tensor([100]), 1, tag=0)
                    for _ in range(9):
                        out = torch.empty(1, dtype=torch.int64)
                        await recv(b, out, 0, tag=0)
                        received.append(int(out))
            return received

    assert trio.run(main) == [0, 1, 2, 3, 4, 5, 6, 7, 100]


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_recv_routed_lands_the_bulk_where_the_route_says(kind: str) -> None:
    """The transport hook under p2p: the route sees the head (kind, tag, dtype, shape) before
    the bulk, and the bulk lands in the tensor it returns, or in a fresh one for None."""

    async def main() -> None:
        async with open_group(kind, 2) as (a, b):
            out = torch.empty(5000)
            seen = []

            def route(head: dict, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
                seen.append((head["kind"], head["tag"], dtype, tuple(shape)))
                return out

            with trio.fail_after(10):
                await a.send(1, "p2p", {"tag": 3}, torch.arange(5000.0))
                message = await b.recv_routed(0, route)
                assert message["data"] is out and torch.equal(out, torch.arange(5000.0))
                assert seen == [("p2p", 3, torch.float32, (5000,))]

                await a.send(1, "p2p", {"tag": 4}, torch.arange(6.0).view(2, 3))
                message = await b.recv_routed(0, lambda *_: None)
                assert torch.equal(message["data"], torch.arange(6.0).view(2, 3))

                await a.send(1, "p2p", {"tag": 5}, torch.ones(4))
                with pytest.raises(ProtocolError, match=r"expected torch\.float32 with 5 elements"):
                    await b.recv_routed(0, lambda *_: torch.empty(5))

    trio.run(main)


def test_on_lent_links_threads_exchange_tagged_messages_and_refuse_a_wrong_tag() -> None:
    """`send_on_links` / `recv_on_links` from OS threads over TCP connections lent by
    `blocking_links`: the tensors arrive in order under their tags; a message of another tag
    is a ProtocolError naming the peer and both tags, another size or shape one naming both."""
    sent = [torch.arange(6, dtype=torch.float32).reshape(2, 3) + i for i in range(3)]

    async def main() -> list[object]:
        async with open_group("tcp", 2) as (a, b):
            got = [torch.empty(2, 3) for _ in sent]
            async with a.blocking_links({1}) as la, b.blocking_links({0}) as lb:

                def receive() -> None:
                    for i, out in enumerate(got):
                        recv_on_links(lb, b, out, 0, tag=10 + i)

                def send_all() -> None:
                    for i, tensor in enumerate(sent):
                        send_on_links(la, a, tensor, 1, tag=10 + i)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(trio.to_thread.run_sync, receive)
                    nursery.start_soon(trio.to_thread.run_sync, send_all)
                assert all(torch.equal(x, y) for x, y in zip(sent, got, strict=True))
                errors: list[object] = []

                def wrong(tag: int, out: torch.Tensor) -> None:
                    send_on_links(la, a, sent[0], 1, tag=5)
                    try:
                        recv_on_links(lb, b, out, 0, tag=tag)
                    except ProtocolError as exc:
                        errors.append(exc)

                await trio.to_thread.run_sync(wrong, 6, torch.empty(2, 3))
                # The same size in another shape: refused too, the message read whole.
                await trio.to_thread.run_sync(wrong, 5, torch.empty(3, 2))
                after = torch.empty(2, 3)

                def in_step() -> None:
                    send_on_links(la, a, sent[1], 1, tag=7)
                    recv_on_links(lb, b, after, 0, tag=7)

                await trio.to_thread.run_sync(in_step)
                assert torch.equal(after, sent[1])
                await trio.to_thread.run_sync(wrong, 5, torch.empty(7))
                return errors

    errors = trio.run(main)
    assert len(errors) == 3
    assert "sent tag 5" in str(errors[0]) and "expected tag 6" in str(errors[0])
    assert "shape [2, 3]" in str(errors[1]) and "shape [3, 2]" in str(errors[1])
    assert "rank 0" in str(errors[1])
    assert "rank 0" in str(errors[0]) and "elements" in str(errors[2])
