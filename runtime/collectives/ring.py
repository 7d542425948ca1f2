"""Collectives over any `Transport`: ring all-reduce, broadcast, all-gather, reduce-scatter.

Exactness rules, for every world size:
- each element is reduced once, by one rank, in one fixed order, and every other rank receives
  a copy of that result, so all ranks end bitwise identical;
- on every hop the send and the receive run concurrently, so no chunk size can deadlock two
  ranks that both wait for the other to read;
- large tensors stream: a segment travels in parts of ``chunk_bytes`` and a part is forwarded as
  soon as it is reduced, so the 2(n-1) hops of the ring overlap.
Frames carry the collective's id, hop and part; anything else from a peer is a ProtocolError.
A transport that runs collectives natively (`NativeCollectives`: torch.distributed process
groups) gets the tensors it accepts handed over after the same checks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Literal

import torch
import trio

from paramsync.runtime.errors import CollectiveError, ProtocolError, first_error
from paramsync.runtime.transport.base import Transport
from paramsync.runtime.transport.capabilities import (
    BlockingLinkProvider,
    BlockingLinkSet,
    NativeCollectives,
    SharedMemoryHolder,
)
from paramsync.runtime.transport.segments import SUPPORTED_DTYPES, divide_in_place, segment_bounds

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "SMALL_ALLREDUCE_BYTES",
    "THREADED_MIN_BYTES",
    "TRAINING_THREADED_MIN_BYTES",
    "ReduceOp",
    "segment_bounds",
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "barrier",
]

ReduceOp = Literal["sum", "avg"]
DEFAULT_CHUNK_BYTES = 4 << 20
"""Bytes per frame in the ring: small enough to pipeline, large enough to amortise a frame."""
_SEND_FIRST_BYTES = 64 * 1024
THREADED_MIN_BYTES = 256 * 1024
"""From this size the ring runs on OS threads with blocking sockets (when the transport can)."""
TRAINING_THREADED_MIN_BYTES = 16 << 20
"""The same threshold while a compute thread trains (see `all_reduce`): measured with
``benchmarks/ddp.py``, trio-task rings cost the training step less up to large buckets."""
SMALL_ALLREDUCE_BYTES = 32 * 1024
"""At or below this size all-reduce exchanges whole tensors in one round instead of 2(n-1) hops."""


def _check_tensor(
    tensor: torch.Tensor, what: str, transport: Transport | None = None
) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise CollectiveError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise CollectiveError(f"{what} does not support dtype {tensor.dtype}")
    if tensor.device.type != "cpu" and not _native(transport, tensor):
        raise CollectiveError(f"{what} runs on CPU tensors; got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise CollectiveError(f"{what} needs a contiguous tensor (call .contiguous())")
    return tensor.view(-1)


def _native(transport: Transport | None, tensor: torch.Tensor) -> bool:
    """Whether ``transport`` runs this tensor's collectives natively (torch.distributed)."""
    return isinstance(transport, NativeCollectives) and transport.native_accepts(tensor)


def _check_op(op: str) -> None:
    if op not in ("sum", "avg"):
        raise CollectiveError(f"reduce op must be 'sum' or 'avg', got {op!r}")


def _expect(message: dict[str, Any], op_id: int, hop: int, part: int, peer: int) -> None:
    if message["kind"] != "coll":
        raise ProtocolError(
            f"expected collective data (op {op_id}), got a {message['kind']} message", peer=peer
        )
    if (message["op"], message["hop"], message["part"]) != (op_id, hop, part):
        raise ProtocolError(
            f"sent op {message['op']} hop {message['hop']} part {message['part']}, "
            f"expected op {op_id} hop {hop} part {part}: the ranks' collectives are out of step",
            peer=peer,
        )


def _parts(start: int, stop: int, chunk: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + chunk, stop)) for lo in range(start, stop, chunk)]


def _largest(hop_parts: list[list[tuple[int, int]]]) -> int:
    """Elements in the largest part of these hops: the scratch buffer a receiver needs."""
    return max((hi - lo for parts in hop_parts for lo, hi in parts), default=0)


def _chunk_elems(tensor: torch.Tensor, chunk_bytes: int) -> int:
    if chunk_bytes < 1:
        raise CollectiveError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return max(1, chunk_bytes // tensor.element_size())


async def _ring(
    transport: Transport,
    flat: torch.Tensor,
    op_id: int,
    bounds: list[tuple[int, int]],
    hops: list[tuple[int, int]],
    chunk: int,
    fold: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    fold_hops: int = 0,
    threaded_min_bytes: int = THREADED_MIN_BYTES,
) -> None:
    """Run the ring on worker threads when the transport lends blocking links (a
    `BlockingLinkProvider` that supports them now: not over TLS) and the tensor is large
    enough to repay a thread hand-off; else on trio tasks."""
    plan = _RingPlan(transport, flat, op_id, bounds, hops, chunk, fold, fold_hops)
    nbytes = flat.numel() * flat.element_size()
    if (
        isinstance(transport, BlockingLinkProvider)
        and nbytes >= threaded_min_bytes
        and transport.supports_blocking
    ):
        async with transport.blocking_links({plan.next, plan.prev}) as io:
            await _ring_threaded(plan, io)
        return
    await _ring_async(transport, plan)


class _RingPlan:
    """One ring schedule, shared by the trio-task and the OS-thread runners.

    Hop k sends segment ``hops[k][0]`` and receives segment ``hops[k][1]``; hop k+1 always
    forwards what hop k received, so a part leaves as soon as it is final. In the first
    ``fold_hops`` hops a part lands in a scratch buffer and ``fold(hop, dest, scratch)`` reduces
    it into place; in later hops it lands in place, uncopied.
    """

    def __init__(
        self,
        transport: Transport,
        flat: torch.Tensor,
        op_id: int,
        bounds: list[tuple[int, int]],
        hops: list[tuple[int, int]],
        chunk: int,
        fold: Callable[[int, torch.Tensor, torch.Tensor], None] | None,
        fold_hops: int,
    ) -> None:
        n = transport.world_size
        self.next, self.prev = (transport.rank + 1) % n, (transport.rank - 1) % n
        self.flat = flat
        self.op_id = op_id
        self.fold = fold
        self.fold_hops = fold_hops
        self.send_parts = [_parts(*bounds[seg], chunk) for seg, _ in hops]
        self.recv_parts = [_parts(*bounds[seg], chunk) for _, seg in hops]
        self.done = [0] * len(hops)  # parts of each hop received and final
        self.scratch = torch.empty(_largest(self.recv_parts[:fold_hops]), dtype=flat.dtype)

    def sends(self) -> Iterator[tuple[int, int, dict[str, int], torch.Tensor]]:
        """(hop, part, header, tensor) of every part this rank sends, in order."""
        for hop, parts in enumerate(self.send_parts):
            for index, (lo, hi) in enumerate(parts):
                fields = {"op": self.op_id, "hop": hop, "part": index}
                yield hop, index, fields, self.flat[lo:hi]

    def ready(self, hop: int, index: int) -> bool:
        """Whether part ``index`` of ``hop`` may leave (what it forwards has arrived)."""
        return hop == 0 or self.done[hop - 1] > index

    def receives(self) -> Iterator[tuple[int, int, int, int, torch.Tensor]]:
        """(hop, part, lo, hi, landing buffer) of every part this rank receives, in order."""
        for hop, parts in enumerate(self.recv_parts):
            for index, (lo, hi) in enumerate(parts):
                land = self.scratch[: hi - lo] if hop < self.fold_hops else self.flat[lo:hi]
                yield hop, index, lo, hi, land

    def landed(
        self, message: dict[str, Any], hop: int, index: int, lo: int, hi: int, land: torch.Tensor
    ) -> None:
        """Check a received part's header, reduce it into place if it is a fold hop."""
        _expect(message, self.op_id, hop, index, self.prev)
        if hop < self.fold_hops:
            assert self.fold is not None
            self.fold(hop, self.flat[lo:hi], land)
        self.done[hop] += 1


async def _ring_threaded(plan: _RingPlan, io: BlockingLinkSet) -> None:
    """Run ``plan`` with a sender and a receiver OS thread.

    Blocking calls move whole parts per system call and release the GIL, so the kernel copies
    out and in run on two cores at once. A failure on either thread aborts the links, which
    wakes the other thread, and the first error surfaces.
    """
    ready = threading.Condition()
    failed: list[BaseException] = []

    def sender() -> None:
        for hop, index, fields, part in plan.sends():
            with ready:
                while not plan.ready(hop, index) and not failed:
                    ready.wait()
                if failed:
                    return
            io.send(plan.next, "coll", fields, part)

    def receiver() -> None:
        for hop, index, lo, hi, land in plan.receives():
            message = io.recv_into(plan.prev, land)
            with ready:
                plan.landed(message, hop, index, lo, hi, land)
                ready.notify_all()

    def guarded(body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except BaseException as exc:
                with ready:
                    failed.append(exc)
                    ready.notify_all()
                io.abort()
                raise

        return run

    try:
        with first_error():
            async with trio.open_nursery() as nursery:
                for body in (sender, receiver):
                    nursery.start_soon(
                        partial(trio.to_thread.run_sync, guarded(body), abandon_on_cancel=True)
                    )
    except BaseException:
        if failed:  # the first thread's error is the cause; the other's is its echo
            raise failed[0] from None
        raise


async def _ring_async(transport: Transport, plan: _RingPlan) -> None:
    """Run ``plan`` with a sender and a receiver trio task."""
    lot = trio.lowlevel.ParkingLot()

    async def sender() -> None:
        for hop, index, fields, part in plan.sends():
            while not plan.ready(hop, index):
                await lot.park()
            await transport.send(plan.next, "coll", fields, part)

    async def receiver() -> None:
        for hop, index, lo, hi, land in plan.receives():
            message = await transport.recv_into(plan.prev, land)
            plan.landed(message, hop, index, lo, hi, land)
            lot.unpark_all()

    with first_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            await receiver()


async def all_reduce(
    transport: Transport,
    tensor: torch.Tensor,
    op: ReduceOp = "sum",
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    small_bytes: int = SMALL_ALLREDUCE_BYTES,
    threaded_min_bytes: int = THREADED_MIN_BYTES,
) -> torch.Tensor:
    """Reduce ``tensor`` across the group in place (sum or average) and return it.

    Large tensors take the ring (reduce-scatter, then all-gather); tensors of at most
    ``small_bytes`` take one all-to-all round, each rank summing in rank order. From
    ``threaded_min_bytes`` the ring runs on two OS threads with blocking sockets (TCP only):
    fastest for a lone all-reduce, but in training the compute thread wants those cores, so
    the trainer raises it. Integer averages round down. When the transport has a
    shared-memory plane attached (`paramsync.runtime.transport.shm`), tensors it accepts go through
    it instead of the ring, with bitwise the ring's result.

    ``tensor`` is the collective's landing buffer: the all-gather hops land their parts in it
    uncopied, before their frame's tag is checked, and the reduce hops leave partial sums, so
    when all-reduce raises ``tensor`` holds unspecified bytes and must be rewritten before
    any use (the trainer drops the step and zeroes the bucket: `paramsync.actors.graph.gradcomm`).
    Never all-reduce live model or optimizer state in place.
    """
    flat = _check_tensor(tensor, "all_reduce", transport)
    _check_op(op)
    chunk = _chunk_elems(flat, chunk_bytes)
    if small_bytes < 0:
        raise CollectiveError(f"small_bytes must be >= 0, got {small_bytes}")
    n = transport.world_size
    op_id = transport.next_op_id()
    if n == 1:
        if op == "avg":
            divide_in_place(flat, 1)
        return tensor
    if isinstance(transport, NativeCollectives) and transport.native_accepts(flat):
        await transport.native_all_reduce(flat, op)
        return tensor
    if flat.numel() * flat.element_size() <= small_bytes:
        await _all_reduce_direct(transport, flat, op, op_id)
        return tensor
    if isinstance(
        transport, SharedMemoryHolder
    ):  # ranks on one host: `paramsync.runtime.transport.shm`
        plane = transport.shared_memory
        if plane is not None and plane.accepts(flat):
            await plane.all_reduce(transport, flat, op, op_id)
            return tensor
    rank = transport.rank
    owned_hop = n - 2  # the reduce-scatter hop after which this rank's segment is complete
    reduce_hops = [((rank - k) % n, (rank - k - 1) % n) for k in range(n - 1)]
    gather_hops = [((rank + 1 - k) % n, (rank - k) % n) for k in range(n - 1)]

    def fold(hop: int, dest: torch.Tensor, part: torch.Tensor) -> None:
        dest.add_(part)
        if op == "avg" and hop == owned_hop:
            divide_in_place(dest, n)

    # One pipeline for both phases: reduce hops fold in, gather hops land in place.
    bounds = segment_bounds(flat.numel(), n)
    await _ring(
        transport,
        flat,
        op_id,
        bounds,
        reduce_hops + gather_hops,
        chunk,
        fold,
        n - 1,
        threaded_min_bytes,
    )
    return tensor


async def _all_reduce_direct(transport: Transport, flat: torch.Tensor, op: str, op_id: int) -> None:
    n, rank = transport.world_size, transport.rank
    gathered = torch.empty((n, flat.numel()), dtype=flat.dtype)
    gathered[rank].copy_(flat)

    async def send_all() -> None:
        for step in range(1, n):
            await transport.send(
                (rank + step) % n, "coll", {"op": op_id, "hop": 0, "part": 0}, flat
            )

    async def receive_all() -> None:
        for step in range(1, n):
            peer = (rank - step) % n
            message = await transport.recv_into(peer, gathered[peer])
            _expect(message, op_id, 0, 0, peer)

    if flat.numel() * flat.element_size() <= _SEND_FIRST_BYTES:
        # Small enough to sit in any socket buffer or channel: sending first cannot block on a
        # peer that is sending too, and saves a task per call (this is the latency path).
        await send_all()
        await receive_all()
    else:
        with first_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_all)
                await receive_all()
    result = gathered[0].clone()
    for peer in range(1, n):
        result.add_(gathered[peer])
    if op == "avg":
        divide_in_place(result, n)
    flat.copy_(result)


async def reduce_scatter(
    transport: Transport,
    tensor: torch.Tensor,
    op: ReduceOp = "sum",
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> torch.Tensor:
    """Reduce ``tensor`` across the group; return this rank's segment of the result.

    Segment r is ``segment_bounds(numel, world_size)[r]`` of the flattened tensor. ``tensor``
    is used as scratch and holds partial sums afterwards.
    """
    flat = _check_tensor(tensor, "reduce_scatter", transport)
    _check_op(op)
    chunk = _chunk_elems(flat, chunk_bytes)
    n, rank = transport.world_size, transport.rank
    op_id = transport.next_op_id()
    bounds = segment_bounds(flat.numel(), n)
    if n > 1 and isinstance(transport, NativeCollectives) and transport.native_accepts(flat):
        return await transport.native_reduce_scatter(flat, op, bounds)
    if n > 1:
        # Shift by one so that rank r ends owning segment r.
        hops = [((rank - 1 - k) % n, (rank - k - 2) % n) for k in range(n - 1)]

        def fold(hop: int, dest: torch.Tensor, part: torch.Tensor) -> None:
            dest.add_(part)
            if op == "avg" and hop == n - 2:
                divide_in_place(dest, n)

        await _ring(transport, flat, op_id, bounds, hops, chunk, fold, n - 1)
    elif op == "avg":
        divide_in_place(flat, 1)
    lo, hi = bounds[rank]
    return flat[lo:hi].clone()


async def all_gather(
    transport: Transport, tensor: torch.Tensor, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> torch.Tensor:
    """Gather every rank's ``tensor`` (same shape and dtype on all ranks).

    Returns a new tensor of shape ``(world_size, *tensor.shape)`` whose row r is rank r's.
    """
    flat = _check_tensor(tensor, "all_gather", transport)
    chunk = _chunk_elems(flat, chunk_bytes)
    n, rank = transport.world_size, transport.rank
    op_id = transport.next_op_id()
    numel = flat.numel()
    out = torch.empty((n * numel,), dtype=flat.dtype, device=flat.device)
    if n > 1 and isinstance(transport, NativeCollectives) and transport.native_accepts(flat):
        await transport.native_all_gather(out, flat)
        return out.view((n, *tensor.shape))
    out[rank * numel : (rank + 1) * numel].copy_(flat)
    if n > 1 and numel:
        hops = [((rank - k) % n, (rank - k - 1) % n) for k in range(n - 1)]
        rows = [(row * numel, (row + 1) * numel) for row in range(n)]
        await _ring(transport, out, op_id, rows, hops, chunk)
    return out.view((n, *tensor.shape))


async def broadcast(
    transport: Transport,
    tensor: torch.Tensor,
    root: int = 0,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    in_place: bool = False,
) -> torch.Tensor:
    """Copy ``root``'s tensor into ``tensor`` on every rank, in place, and return it.

    The data flows along the ring from the root in pipelined parts, so each rank sends it once.

    ``tensor`` changes only once every part has arrived, passed its frame's tag and been
    checked as this collective's (op, hop, part): the parts land in a scratch tensor of
    ``tensor``'s size and are committed with one copy at the end, so a broadcast that fails
    (a forged or altered frame, a peer out of step, a hang-up) leaves ``tensor`` as it was.
    ``tensor`` may then be live model state. ``in_place=True`` lands the parts straight in
    ``tensor`` (no scratch, no copy): for a buffer the caller owns and discards when the
    broadcast raises (its bytes are then unspecified).
    """
    flat = _check_tensor(tensor, "broadcast", transport)
    chunk = _chunk_elems(flat, chunk_bytes)
    n, rank = transport.world_size, transport.rank
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < n:
        raise CollectiveError(f"broadcast root {root!r} is not a rank of a group of {n}")
    op_id = transport.next_op_id()
    if n == 1 or flat.numel() == 0:
        return tensor
    if isinstance(transport, NativeCollectives) and transport.native_accepts(flat):
        await transport.native_broadcast(flat, root)
        return tensor
    position = (rank - root) % n  # 0 for the root, n-1 for the last rank of the chain
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    parts = _parts(0, flat.numel(), chunk)
    if position == 0:
        for index, (lo, hi) in enumerate(parts):
            await transport.send(nxt, "coll", {"op": op_id, "hop": 0, "part": index}, flat[lo:hi])
        return tensor
    received = 0
    lot = trio.lowlevel.ParkingLot()
    # Parts land here; ``tensor`` is written once all of them verified (see the docstring).
    landing = flat if in_place else torch.empty_like(flat)

    async def forward() -> None:
        for index, (lo, hi) in enumerate(parts):
            while received <= index:
                await lot.park()
            await transport.send(
                nxt, "coll", {"op": op_id, "hop": position, "part": index}, landing[lo:hi]
            )

    with first_error():
        async with trio.open_nursery() as nursery:
            if position < n - 1:
                nursery.start_soon(forward)
            for index, (lo, hi) in enumerate(parts):
                message = await transport.recv_into(prv, landing[lo:hi])
                _expect(message, op_id, position - 1, index, prv)
                received += 1
                lot.unpark_all()
    if landing is not flat:
        flat.copy_(landing)
    return tensor


async def barrier(transport: Transport) -> None:
    """Return once every rank of the group has entered the barrier."""
    if transport.world_size > 1 and isinstance(transport, NativeCollectives):
        transport.next_op_id()
        await transport.native_barrier()
        return
    token = torch.zeros(1, dtype=torch.int32)
    await all_reduce(transport, token, "sum")
