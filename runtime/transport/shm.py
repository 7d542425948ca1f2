"""Shared-memory data plane: all-reduce among ranks that run on one host.

TCP moves every byte through the kernel twice (copy in, copy out) on both ends of every hop; for
ranks on one host that is the wall (BENCHMARKS.md). Here the ranks map one shared segment
instead, and the group's TCP connections carry only tiny step signals.

Segment (one file under ``/dev/shm``, unlinked as soon as every rank has mapped it)::

    header | input[parity 0][rank 0..n-1] | input[parity 1][rank 0..n-1] | result[0] | result[1]

Every input and result area holds ``n`` pieces of ``piece_bytes``. The tensor is cut into the
ring's ``n`` segments (`segment_bounds`); step j handles piece j of every segment. At each step a
rank copies its pieces into its input area, rank q sums segment q's piece over all ranks into
result area q, and every rank copies every result piece out. Rank q sums in the ring's own order
(rank q first, then q+1, ..., cyclically) and averages as the ring does, so the result is
bitwise identical on every rank and to the TCP ring's (NaN payloads aside).

Inputs and results are double-buffered by the parity of the plane's signal count (kept across
all-reduces, the same on every rank), which leaves one all-to-all signal per step: after
reducing step j and copying in step j+1, a rank tells every peer ``shm_step j+1``; once it has
heard ``j+1`` from everyone, all of step j's results and step j+1's inputs are in place. A small
all-reduce (one step, at most `WHOLE_REDUCE_MAX_BYTES`) takes a single signal: every rank copies
its whole tensor in, signals, and sums every segment itself in that segment's ring order (the
same sums, bitwise); an area is written again only two signals later, after every rank has
read it. The signals travel on the group's TCP connections, so a peer that dies is an EOF
(`PeerClosed` naming it) and a silent one a `StallError` after the transport's
``stall_seconds``; nothing spins.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import trio

from paramsync.runtime.config import parse_bool
from paramsync.runtime.errors import CollectiveError, ProtocolError, StallError
from paramsync.runtime.protocol.messages import (
    ShmHello,
    ShmMapped,
    ShmOffer,
    ShmReady,
    decode_message,
)
from paramsync.runtime.protocol.wire import encode_frame_bytes
from paramsync.runtime.transport.capabilities import (
    AllReducePlane,
    BlockingLinkProvider,
    PolledLinkProvider,
    PolledLinkSet,
    SharedMemoryHolder,
)
from paramsync.runtime.transport.segments import SUPPORTED_DTYPES, divide_in_place, segment_bounds

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_STEP_BYTES",
    "HOST_ID_ENV",
    "SHM_MIN_BYTES",
    "SharedMemoryPlane",
    "attach_shared_memory",
    "host_identity",
    "shared_memory_wanted",
]

log = logging.getLogger("paramsync.shm")

SHM_DIR = "/dev/shm"
DEFAULT_MAX_BYTES = 160 << 20
"""Largest segment a group maps (it needs 2(n+1) x the step size, plus a header)."""
DEFAULT_STEP_BYTES = 8 << 20
"""Bytes of each rank's tensor handled per step (fewer steps, fewer signals)."""
WHOLE_REDUCE_MAX_BYTES = 4 << 20
"""All-reduces of at most this many bytes (and one step) take one signal, each rank summing the
whole tensor (`_Steps.run`); larger ones split the sums among the ranks, one signal per step
and one more."""
SHM_MIN_BYTES = 32 * 1024
"""All-reduces of at least this many bytes take the plane: where the one-round path stops
(`SMALL_ALLREDUCE_BYTES`); at 64 and 256 KiB the plane already took 1.5-2.2x less time than the
TCP ring (docs/shared_memory.md)."""
_ALIGN = 64
_MAGIC = b"PSYNCSHM"
_NONCE_BYTES = 16
_NAME = re.compile(r"paramsync-([1-9][0-9]{0,9})-[0-9a-f]{32}")
"""Segment names: ``paramsync-<creator pid>-<32 hex>``. The pid lets a later start reap a segment
whose creator died between creating and unlinking it (`_reap_orphans`)."""


HOST_ID_ENV = "PARAMSYNC_HOST_ID"
"""Names this rank's host for the shared-memory plane, overriding `host_identity`'s own."""


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def host_identity(environ: Mapping[str, str] | None = None) -> str:
    """Which host this rank runs on, as the shared-memory plane counts hosts.

    ``$PARAMSYNC_HOST_ID`` when set (ranks that give the same one are one host: the user's
    word); else the kernel's boot id, this process's network namespace and the hostname. The
    network namespace is part of it because ranks in different namespaces of one kernel share
    ``/dev/shm`` but are different hosts to whoever set them up (containers, the multi-host
    tests' namespaces): their data goes over the network between them, as between machines."""
    env = os.environ if environ is None else environ
    given = env.get(HOST_ID_ENV, "").strip()
    if given:  # a long one by its hash: the hello's host field holds 512 characters
        return f"id:{given}" if len(given) <= 128 else f"id-sha256:{_sha256(given)}"
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
    except OSError:
        boot = "no-boot-id"
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = "no-netns"
    return f"{boot}/{netns}/{socket.gethostname()}"


def shared_memory_wanted(transport: SharedMemoryHolder) -> bool:
    """The default: on, unless ``PARAMSYNC_SHM`` is false (``0``, ``false``, ``no``, ``off``:
    `paramsync.runtime.config.parse_bool`, which refuses a value that is no boolean) or the
    connections are TLS, which a `BlockingLinkProvider` says by lending no links (who asked for TLS
    gets only the encrypted sockets unless they ask for the plane too)."""
    setting = os.environ.get("PARAMSYNC_SHM", "").strip()
    if setting and not parse_bool(setting, "environment variable PARAMSYNC_SHM"):
        return False
    return not isinstance(transport, BlockingLinkProvider) or transport.supports_blocking


# ------------------------------------------------------------------------------- segment


class _Layout:
    """Where each area of a segment lies, from the group size and the step size."""

    def __init__(self, world_size: int, step_bytes: int) -> None:
        if world_size < 2 or step_bytes < _ALIGN * world_size:
            raise ValueError(f"no layout for {world_size} ranks with {step_bytes}-byte steps")
        self.world_size = world_size
        self.piece_bytes = step_bytes // world_size // _ALIGN * _ALIGN
        self.step_bytes = self.piece_bytes * world_size
        self.header_bytes = -(-(_ALIGN * (world_size + 1)) // 4096) * 4096
        self.inputs_bytes = 2 * world_size * self.step_bytes
        self.size = self.header_bytes + self.inputs_bytes + 2 * self.step_bytes

    @classmethod
    def fitting(cls, world_size: int, max_bytes: int, step_bytes: int) -> _Layout:
        """The largest layout with steps of at most ``step_bytes`` in ``max_bytes``."""
        header = cls(world_size, _ALIGN * world_size).header_bytes
        room = (max_bytes - header) // (2 * (world_size + 1))
        return cls(world_size, min(step_bytes, room))

    def ack_slot(self, rank: int) -> slice:
        """Header bytes where ``rank`` (> 0) writes the nonce back, proving it shares the memory."""
        start = _ALIGN * rank
        return slice(start, start + _NONCE_BYTES)


def _creator_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def _reap_orphans() -> None:
    """Unlink this user's segments whose creator process is gone: rank 0 died between creating
    one and unlinking it. A live creator's segment (a run attaching now) is never touched; a
    pid reused since only delays the reaping. Ranks sharing one /dev/shm from different pid
    namespaces would see each other's creators as dead: they must not share it."""
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return
    uid = os.getuid()
    for entry in entries:
        match = _NAME.fullmatch(entry.name)
        if match is None or _creator_alive(int(match.group(1))):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_uid == uid:
            log.warning(
                "removing %s: its creator (pid %s) died before unlinking it",
                entry.path,
                match.group(1),
            )
            _unlink(entry.path)


def _create_segment(size: int) -> tuple[str, int]:
    """Create a fresh 0600 file in /dev/shm with ``size`` bytes reserved; return (path, fd).

    Orphaned segments of dead creators are reaped first (`_reap_orphans`). The pages are
    allocated now, so running out of /dev/shm fails here rather than as a SIGBUS in the middle
    of a collective."""
    _reap_orphans()
    path = os.path.join(SHM_DIR, f"paramsync-{os.getpid()}-{secrets.token_hex(16)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except BaseException:
        os.close(fd)
        _unlink(path)
        raise
    return path, fd


def _open_segment(path: str, size: int) -> int:
    """Open a segment rank 0 named: a 0600 regular file of ours, of the agreed size."""
    if os.path.dirname(path) != SHM_DIR or not _NAME.fullmatch(os.path.basename(path)):
        raise ValueError(f"{path!r} is not a paramsync segment name")
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        problem = "is not a regular file of this user"
    elif stat.S_IMODE(info.st_mode) != 0o600:
        problem = f"has mode {stat.S_IMODE(info.st_mode):o}, not 600"
    elif info.st_size != size:
        problem = f"holds {info.st_size} bytes, not {size}"
    if problem:
        os.close(fd)
        raise ValueError(f"segment {path} {problem}")
    return fd


def _map(fd: int, size: int) -> mmap.mmap:
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ------------------------------------------------------------------------------- the plane


class SharedMemoryPlane(AllReducePlane):
    """One rank's mapping of its group's segment, and the all-reduce that runs on it.

    Made by `attach_shared_memory`; `paramsync.runtime.collectives.ring.all_reduce` uses it for CPU
    tensors of at least ``min_bytes`` while it is the transport's ``shared_memory``
    (`paramsync.runtime.transport.capabilities.SharedMemoryHolder`).
    """

    def __init__(
        self,
        rank: int,
        layout: _Layout,
        mapping: mmap.mmap,
        min_bytes: int,
        path: str,
        threaded: bool = False,
    ) -> None:
        self.rank = rank
        self.path = path
        """Where the segment was created (unlinked since): for diagnostics."""
        self.world_size = layout.world_size
        self.layout = layout
        self.min_bytes = min_bytes
        self._mapping: mmap.mmap | None = mapping
        self._base: torch.Tensor | None = torch.frombuffer(mapping, dtype=torch.uint8)
        self._views: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self.threaded = threaded
        """Run each all-reduce on a worker thread (see `all_reduce`); False: on the event loop."""
        self._signals = 0
        """Signals exchanged on this plane so far, the same count on every rank: the parity of
        the next one picks the input and result areas its step writes."""

    @property
    def closed(self) -> bool:
        return self._base is None

    def accepts(self, flat: torch.Tensor) -> bool:
        """Whether this all-reduce should run here: open, big enough, a dtype it sums."""
        nbytes = flat.numel() * flat.element_size()
        return not self.closed and nbytes >= self.min_bytes and flat.dtype in SUPPORTED_DTYPES

    def close(self) -> None:
        """Unmap the segment. Views still held elsewhere (an all-reduce being torn down) keep
        the memory mapped until they are gone, so nothing is ever unmapped under a copy."""
        self._base = None
        self._views.clear()
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:  # views still alive: unmapped when they are collected
                pass

    def _typed(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs[parity, rank, piece, elem], results[parity, piece, elem]) as ``dtype``."""
        if self._base is None:
            raise CollectiveError("the shared-memory plane is closed")
        if dtype not in self._views:
            lay, n = self.layout, self.world_size
            elems = lay.piece_bytes // torch.empty((), dtype=dtype).element_size()
            start = lay.header_bytes
            inputs = self._base[start : start + lay.inputs_bytes].view(dtype)
            start += lay.inputs_bytes
            results = self._base[start : start + 2 * lay.step_bytes].view(dtype)
            self._views[dtype] = (inputs.view(2, n, n, elems), results.view(2, n, elems))
        return self._views[dtype]

    async def all_reduce(
        self, transport: SharedMemoryHolder, flat: torch.Tensor, op: str, op_id: int
    ) -> None:
        """Reduce ``flat`` (contiguous, 1-D, CPU) in place across the group.

        By default the copies, sums and step signals run in the event loop: a step's copies
        block it for a few milliseconds at most (torch releases the GIL meanwhile), and a
        lone all-reduce pays no thread hand-off. With ``threaded`` they run on one worker
        thread that holds the group's connections meanwhile (the transport must be a
        `PolledLinkProvider`, else this is a CollectiveError):
        one hand-off per all-reduce instead of a trip through the event loop for every
        signal. That takes CPU off the event loop but, on a 2-core machine under training,
        costs more than it saves (docs/shared_memory.md), hence the default. A failure (or
        cancellation) breaks the transport, as after any failed collective, so the peers fail
        at once rather than at their deadline.
        """
        if flat.dtype not in SUPPORTED_DTYPES:
            raise CollectiveError(f"the shared-memory plane does not sum {flat.dtype}")
        plan = _Steps(self.rank, self.world_size, self._typed(flat.dtype), flat, op, self._signals)
        self._signals += plan.signals  # every rank counts the same (a failure ends the plane)
        try:
            if self.threaded:
                if not isinstance(transport, PolledLinkProvider):
                    raise CollectiveError(
                        f"a threaded shared-memory all-reduce needs polled links, which a "
                        f"{type(transport).__name__} does not lend"
                    )
                peers = {peer for peer in range(self.world_size) if peer != self.rank}
                async with transport.polled_links(peers) as links:
                    await trio.to_thread.run_sync(
                        _run_polled, plan, links, op_id, abandon_on_cancel=True
                    )
                return
            for signal in plan.run():
                await _signal_all(transport, op_id, signal)
        except BaseException:
            transport.abort()
            raise


def _run_polled(plan: _Steps, links: PolledLinkSet, op_id: int) -> None:
    """`SharedMemoryPlane.all_reduce`'s steps on a worker thread."""
    for signal in plan.run():
        _signal_all_polled(links, plan.rank, plan.n, op_id, signal)


class _Steps:
    """One all-reduce's copies and sums, step by step (the signals are the caller's).

    ``first``: the plane's signal count before this all-reduce; step j's signal is the plane's
    signal ``first + j``, whose parity picks the areas the step uses (`SharedMemoryPlane`)."""

    def __init__(
        self,
        rank: int,
        n: int,
        views: tuple[torch.Tensor, torch.Tensor],
        flat: torch.Tensor,
        op: str,
        first: int = 0,
    ) -> None:
        self.rank, self.n, self.flat, self.op, self.first = rank, n, flat, op, first
        self.inputs, self.results = views
        self.cap = self.inputs.shape[-1]
        self.bounds = segment_bounds(flat.numel(), n)
        longest = self.bounds[0][1] - self.bounds[0][0]  # segment 0 is never shorter
        self.steps = max(1, -(-longest // self.cap))
        self.order = [(rank + i) % n for i in range(n)]  # the ring's order for segment `rank`
        self.whole = (
            self.steps == 1 and flat.numel() * flat.element_size() <= WHOLE_REDUCE_MAX_BYTES
        )
        """Every rank sums every segment itself, one signal in all (see `run`)."""

    @property
    def signals(self) -> int:
        """How many signals the all-reduce exchanges."""
        return 1 if self.whole else self.steps + 1

    def run(self) -> Iterator[int]:
        """Do the copies and sums in order, pausing at each signal: yields the step to signal,
        and goes on once the caller has exchanged it with every peer.

        A one-step all-reduce of at most `WHOLE_REDUCE_MAX_BYTES` takes one signal: each rank
        copies its whole tensor in, and after the signal sums every segment itself, in that
        segment's ring order, straight into its tensor. That is n times the additions of the
        split reduction, but half its signals, which is what a small all-reduce waits for."""
        if self.whole:
            self.copy_in(0, own=True)
            yield 0
            self.reduce_whole()
            return
        self.copy_in(0)
        yield 0
        for step in range(self.steps):
            self.reduce(step)
            if step + 1 < self.steps:
                self.copy_in(step + 1)
            yield step + 1
            self.copy_out(step)

    def _piece(self, segment: int, step: int) -> tuple[int, int]:
        lo = self.bounds[segment][0] + step * self.cap
        return lo, max(lo, min(lo + self.cap, self.bounds[segment][1]))

    def _parity(self, step: int) -> int:
        return (self.first + step) % 2

    def copy_in(self, step: int, own: bool = False) -> None:
        """This rank's pieces of ``step`` into its input area: but its own segment's, which
        only it reads (``own``: that one too, for `reduce_whole`)."""
        parity = self._parity(step)
        for segment in self.order if own else self.order[1:]:
            lo, hi = self._piece(segment, step)
            self.inputs[parity, self.rank, segment, : hi - lo].copy_(self.flat[lo:hi])

    def reduce(self, step: int) -> None:
        """Sum this rank's segment's piece over all ranks, in the ring's order, into its
        result piece (and divide, for avg)."""
        lo, hi = self._piece(self.rank, step)
        if hi == lo:
            return
        parity, size = self._parity(step), hi - lo
        peers = [self.inputs[parity, peer, self.rank, :size] for peer in self.order[1:]]
        self._ring_sum(self.flat[lo:hi], peers, self.results[parity, self.rank, :size])

    def reduce_whole(self) -> None:
        """Every segment summed over all ranks' inputs in its own ring order (its rank first,
        then the next ones, cyclically), each into the tensor (and divided, for avg): the sums
        `reduce` makes on every rank, bitwise."""
        inputs, n = self.inputs[self._parity(0)], self.n
        for segment in range(n):
            lo, hi = self._piece(segment, 0)
            if hi == lo:
                continue
            pieces = [inputs[(segment + i) % n, segment, : hi - lo] for i in range(n)]
            self._ring_sum(pieces[0], pieces[1:], self.flat[lo:hi])

    def _ring_sum(self, own: torch.Tensor, peers: list[torch.Tensor], out: torch.Tensor) -> None:
        """``own + peers[0] + peers[1] + ...`` into ``out``, each addition rounded in the dtype
        (the ring's order), divided by n for avg."""
        torch.add(own, peers[0], out=out)
        for piece in peers[1:]:
            out.add_(piece)
        if self.op == "avg":
            divide_in_place(out, self.n)

    def copy_out(self, step: int) -> None:
        """Every segment's result piece of ``step`` into the tensor."""
        parity = self._parity(step)
        for segment in range(self.n):
            lo, hi = self._piece(segment, step)
            self.flat[lo:hi].copy_(self.results[parity, segment, : hi - lo])


async def _signal_all(transport: SharedMemoryHolder, op_id: int, step: int) -> None:
    """Tell every peer this rank reached ``step``, then wait until every peer has too.

    Sending first cannot block: a signal is a few dozen bytes and each peer reads its backlog.
    The signal is encoded once and recognized by its bytes (`PrecodedFrames.recv_matching`);
    anything else is decoded to say what came instead. The waits share one deadline, the
    transport's ``stall_seconds``, and a stall names the first peer still silent."""
    peers = [peer for peer in range(transport.world_size) if peer != transport.rank]
    frame = encode_frame_bytes("shm_step", {"op": op_id, "step": step})
    for peer in peers:
        await transport.send_frame(peer, frame)
    waiting = peers[0]
    with trio.move_on_after(transport.stall_seconds) as scope:
        for waiting in peers:
            message = await transport.recv_matching(waiting, frame)
            if message is not None:
                _expect_step(message, op_id, step, waiting)
    if scope.cancelled_caught:
        raise _no_signal(op_id, step, transport.stall_seconds, waiting)


def _signal_all_polled(links: PolledLinkSet, rank: int, n: int, op_id: int, step: int) -> None:
    """`_signal_all` on a worker thread."""
    peers = [peer for peer in range(n) if peer != rank]
    frame = encode_frame_bytes("shm_step", {"op": op_id, "step": step})
    for peer in peers:
        links.send_frame(peer, frame)
    deadline = time.monotonic() + links.stall_seconds
    for peer in peers:
        try:
            message = links.recv_matching(peer, frame, deadline)
        except StallError:
            raise _no_signal(op_id, step, links.stall_seconds, peer) from None
        if message is not None:
            _expect_step(message, op_id, step, peer)


def _no_signal(op_id: int, step: int, seconds: float, peer: int) -> StallError:
    return StallError(
        f"no signal for step {step} of shared-memory all-reduce op {op_id} within {seconds} s",
        peer=peer,
    )


def _expect_step(message: Mapping[str, Any], op_id: int, step: int, peer: int) -> None:
    if message["kind"] != "shm_step" or (message["op"], message["step"]) != (op_id, step):
        got = (
            f"shm_step op {message['op']} step {message['step']}"
            if message["kind"] == "shm_step"
            else f"a {message['kind']} message"
        )
        raise ProtocolError(
            f"sent {got} during shared-memory all-reduce op {op_id} step {step}: "
            "the ranks' collectives are out of step",
            peer=peer,
        )


# ------------------------------------------------------------------------------- setup


async def attach_shared_memory(
    transport: SharedMemoryHolder,
    *,
    want: bool | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    step_bytes: int = DEFAULT_STEP_BYTES,
    min_bytes: int = SHM_MIN_BYTES,
    host: str | None = None,
    seconds: float = 30.0,
    threaded: bool = False,
) -> SharedMemoryPlane | None:
    """Negotiate a shared-memory plane for the group; every rank calls this at the same point.

    Ranks send position 0 their host identity and whether they want the plane (``want``
    defaults to `shared_memory_wanted`). If all want it and share one host, position 0
    creates the segment and offers its path; the others map it and prove it (a nonce read
    and written back); position 0 unlinks the file, then tells everyone whether all succeeded.
    Returns the plane, also set as ``transport.shared_memory``, or None on every rank (the
    TCP paths stay in use). Position 0's ``max_bytes``, ``step_bytes`` and ``min_bytes`` apply
    to all. A rank silent for ``seconds`` fails the call with a `StallError` naming it.
    ``threaded`` is this rank's own choice (`SharedMemoryPlane.all_reduce`): ranks may differ.
    """
    if not isinstance(transport, SharedMemoryHolder):
        raise CollectiveError(
            f"a {type(transport).__name__} cannot carry a shared-memory plane "
            "(it is no paramsync.runtime.transport.capabilities.SharedMemoryHolder)"
        )
    if transport.shared_memory is not None:  # attaching again replaces the plane
        transport.shared_memory.close()
        transport.shared_memory = None
    if transport.world_size < 2:
        return None
    if want is None:
        want = shared_memory_wanted(transport)
    deadline = trio.current_time() + seconds
    hello = ShmHello(host if host is not None else host_identity(), want)
    if transport.rank == 0:
        plane = await _attach_root(transport, hello, deadline, max_bytes, step_bytes, min_bytes)
    else:
        plane = await _attach_member(transport, hello, deadline)
    if plane is not None:
        plane.threaded = threaded
    transport.shared_memory = plane
    return plane


async def _receive(transport: SharedMemoryHolder, peer: int, kind: str, deadline: float) -> Any:
    """The next message from ``peer``, which must be ``kind``, before ``deadline``."""
    try:
        with trio.fail_at(deadline):
            message = await transport.recv(peer)
    except trio.TooSlowError:
        raise StallError(
            f"no {kind} message before the shared-memory setup deadline", peer=peer
        ) from None
    if message["kind"] != kind:
        raise ProtocolError(
            f"sent a {message['kind']} message during shared-memory setup, expected {kind}",
            peer=peer,
        )
    return decode_message(message, peer=peer)


def _decline_reason(hello: ShmHello, hellos: dict[int, ShmHello]) -> str | None:
    """Why the group cannot use shared memory (None: it can)."""
    unwilling = [0] * (not hello.want) + [p for p, m in hellos.items() if not m.want]
    if unwilling:
        return f"ranks {unwilling} turned shared memory off"
    elsewhere = [p for p, m in hellos.items() if m.host != hello.host]
    if elsewhere:
        return f"ranks {elsewhere} run on another host than rank 0"
    return None


async def _attach_root(
    transport: SharedMemoryHolder,
    hello: ShmHello,
    deadline: float,
    max_bytes: int,
    step_bytes: int,
    min_bytes: int,
) -> SharedMemoryPlane | None:
    n = transport.world_size
    peers = range(1, n)
    hellos = {peer: await _receive(transport, peer, "shm_hello", deadline) for peer in peers}
    reason = _decline_reason(hello, hellos)
    path, mapping, nonce = "", None, secrets.token_bytes(_NONCE_BYTES)
    layout = None
    if reason is None:
        try:
            layout = _Layout.fitting(n, max_bytes, step_bytes)
            path, fd = _create_segment(layout.size)
            mapping = _map(fd, layout.size)
            mapping[: len(_MAGIC) + _NONCE_BYTES] = _MAGIC + nonce
        except (OSError, ValueError) as exc:
            reason = f"rank 0 cannot create a segment in {SHM_DIR}: {exc}"
            if path:
                _unlink(path)
            path = ""
    offer = ShmOffer(
        path=path,
        reason=reason or "",
        size=layout.size if mapping is not None and layout is not None else 0,
        step_bytes=layout.step_bytes if mapping is not None and layout is not None else 0,
        min_bytes=min_bytes,
        nonce=nonce,
    )
    try:
        for peer in peers:
            await transport.send(peer, *offer.to_wire())
        if mapping is None:
            log.info("rank 0: no shared-memory plane: %s", reason)
            return None
        replies = {peer: await _receive(transport, peer, "shm_mapped", deadline) for peer in peers}
    except BaseException:
        if mapping is not None:
            mapping.close()
        raise
    finally:
        if path:
            _unlink(path)  # every rank has mapped it, or failed: nothing left in /dev/shm
    assert layout is not None
    failed = [
        f"rank {peer}: {reply.reason}"
        if not reply.ok
        else f"rank {peer}: its writes are not visible to rank 0"
        for peer, reply in replies.items()
        if not reply.ok or mapping[layout.ack_slot(peer)] != nonce
    ]
    verdict = ShmReady(not failed, "; ".join(failed)[:1024])
    for peer in peers:
        await transport.send(peer, *verdict.to_wire())
    if failed:
        mapping.close()
        log.warning("no shared-memory plane: %s", verdict.reason)
        return None
    return SharedMemoryPlane(0, layout, mapping, min_bytes, path)


async def _attach_member(
    transport: SharedMemoryHolder, hello: ShmHello, deadline: float
) -> SharedMemoryPlane | None:
    rank = transport.rank
    await transport.send(0, *hello.to_wire())
    offer: ShmOffer = await _receive(transport, 0, "shm_offer", deadline)
    if not offer.path:
        log.info("rank %d: no shared-memory plane: %s", rank, offer.reason)
        return None
    mapping, layout, reason = None, None, ""
    try:
        layout = _Layout(transport.world_size, offer.step_bytes)
        if layout.step_bytes != offer.step_bytes or layout.size != offer.size:
            raise ValueError(f"rank 0 offered an inconsistent layout: {offer}")
        mapping = _map(_open_segment(offer.path, layout.size), layout.size)
        if mapping[: len(_MAGIC) + _NONCE_BYTES] != _MAGIC + offer.nonce:
            raise ValueError("the segment does not hold rank 0's nonce: not the same memory")
        mapping[layout.ack_slot(rank)] = offer.nonce
    except (OSError, ValueError) as exc:
        reason = f"cannot map {offer.path}: {exc}"
        if mapping is not None:
            mapping.close()
        mapping = None
    try:
        await transport.send(0, *ShmMapped(mapping is not None, reason[:1024]).to_wire())
        verdict: ShmReady = await _receive(transport, 0, "shm_ready", deadline)
    except BaseException:
        if mapping is not None:
            mapping.close()
        raise
    if mapping is None or not verdict.ok:
        if mapping is not None:
            mapping.close()
        log.warning("rank %d: no shared-memory plane: %s", rank, reason or verdict.reason)
        return None
    assert layout is not None
    return SharedMemoryPlane(rank, layout, mapping, offer.min_bytes, offer.path)
