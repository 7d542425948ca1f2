"""A data plane on torch.distributed process groups (``data_plane = "torch"``).

`TorchPlaneTransport` is a `Transport` whose bulk data goes through a torch.distributed process
group: gloo for CPU tensors and, when a CUDA device is given, NCCL for that device's tensors
(the NCCL path is written for torch's API but untested here: this project's machines have no
GPU). Paramsync's coordinator keeps everything else (sequencing, agreement checks, the
C-DDP-001 digest, membership, epochs); each epoch gets a group of its own, built by
`connect_torch_transport` (processes: a fresh ``TCPStore`` hosted by the epoch's position 0,
keyed by the run and the epoch, as torchft makes a group per quorum) or `create_local_group`
(ranks in one process: a ``HashStore``), and destroyed by `TorchPlaneTransport.aclose`.

- Collectives (all-reduce, broadcast, all-gather, reduce-scatter, barrier) run natively on the
  group (`paramsync.runtime.transport.capabilities.NativeCollectives`):
  `paramsync.runtime.collectives.ring` hands them over. Each has a deadline (gloo's per-operation
  timeout, ``collective_seconds``: past it gloo closes the group's connections and the call is a
  `StallError`) and an abort path (`TorchPlaneTransport.abort` fails every call in flight at once;
  the blocked thread is left to gloo's deadline). A peer whose end is gone (its goodbye, or a broken
  connection) fails a collective that has not finished 2 s later as a `PeerClosed` naming it: a peer
  that closed without joining never hangs the survivors until the deadline (gloo keeps an in-process
  peer's connections open after its group is dropped, so they would wait for it).
- Frames (control messages, state transfer, point-to-point tensors) travel as torch.distributed
  point-to-point sends of uint8 tensors: an int64 length, then the frame's bytes (one CBOR item
  and its bulk, exactly the bytes a TCP transport sends: nothing is pickled, torch's object
  collectives are never used). gloo sends only once the receiver has posted a matching
  receive, so one thread per peer keeps a receive posted and queues what arrives (up to
  ``inbox_frames`` frames: the buffering a socket gives).
- Subgroups (`TorchPlaneTransport.open_subgroup`, which
  `paramsync.runtime.collectives.groups.new_group` calls on a torch-plane world): a subset of the
  ranks gets a gloo communicator of its own (and an NCCL one when the transport has a device),
  formed through the epoch's store under a prefix named by the group, so it is itself a
  `TorchPlaneTransport` with native collectives, frames, deadlines, abort and the close handshake.
  Before forming, the members check over the store that they all create the same group (same name,
  same ranks), and a member that creates another is a `ProtocolError` naming it. A subgroup belongs
  to its parent's epoch: aborting the parent aborts it and closing the parent closes it first.
- Closing is a handshake: a closing rank sends each peer a goodbye (length -1), which the
  peer's receiving thread answers with its own; once every thread has its goodbye (or a dead
  peer's connection error) the group is dropped and its connections close. A peer that dies
  is a `PeerClosed` naming it (gloo sees the connection close).

torch's gloo and TCPStore do not authenticate their peers; paramsync's handshake protects the
coordinator link and, in `connect_torch_transport`, the exchange of the store's port, not the
store or gloo's own connections. Use this data plane on networks you trust, as torch.distributed
itself requires.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import trio
from torch._C._distributed_c10d import AllgatherOptions

from paramsync.runtime.config import DATA_PLANES, check_data_plane
from paramsync.runtime.errors import (
    CollectiveError,
    PeerClosed,
    ProtocolError,
    StallError,
    one_line,
)
from paramsync.runtime.protocol.wire import DEFAULT_MAX_FRAME, decode_frame, encode_frame
from paramsync.runtime.transport.base import Transport, land_tensor
from paramsync.runtime.transport.capabilities import NativeCollectives
from paramsync.runtime.transport.device_ops import DeviceOps, context_device_ops
from paramsync.runtime.transport.segments import SUPPORTED_DTYPES, divide_in_place

__all__ = [
    "DATA_PLANES",
    "DEFAULT_COLLECTIVE_SECONDS",
    "GLOO_DTYPES",
    "TorchPlaneTransport",
    "check_data_plane",
    "connect_torch_transport",
    "create_local_group",
    "open_local_group",
]


DEFAULT_COLLECTIVE_SECONDS = 300.0
"""A collective's deadline (the TCP transport's stall deadline)."""

Group = Any
"""A torch.distributed backend: ``ProcessGroupGloo`` (frames, CPU collectives) or
``ProcessGroupNCCL`` (CUDA collectives); torch's stubs lack their point-to-point methods."""

_IDLE_TIMEOUT = datetime.timedelta(days=7)
"""The group's default timeout, which gloo applies to point-to-point receives: a receive posted
for the next frame of an idle peer must not expire (an expiry closes the connection); frames
have their callers' deadlines and collectives their own."""
_LOST_GRACE = 2.0
"""How long a collective may still finish once a peer's end is gone (a peer that closed after
its part of the collective: the rest arrives in milliseconds) before it fails naming the peer."""
_HEAD_TAG = 1
_BODY_TAG = 2
_GOODBYE = -1
GLOO_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
    }
)
"""The wire's dtypes gloo reduces (not int16: those collectives take the ring over frames)."""


def _gloo_error(exc: BaseException, peer: int | None, what: str) -> Exception:
    """A torch/gloo failure as paramsync's error: a closed connection is PeerClosed, an expired
    deadline StallError (both naming ``peer`` when known), anything else CollectiveError."""
    text = one_line(exc)
    lowered = text.lower()
    if "timed out" in lowered or "timeout" in lowered:
        return StallError(f"{what}: {text}", peer=peer)
    if "closed" in lowered or "reset" in lowered or "broken pipe" in lowered:
        return PeerClosed(f"{what}: {text}", peer=peer)
    return CollectiveError(
        f"{what} failed: {text}" + (f" (peer {peer})" if peer is not None else "")
    )


def _frame_tensor(kind: str, fields: Mapping[str, Any], bulk: torch.Tensor | None) -> torch.Tensor:
    """The frame ``encode_frame`` makes (prefix, CBOR item, bulk), as one uint8 tensor."""
    parts = [memoryview(part).cast("B") for part in encode_frame(kind, fields, bulk)]
    frame = torch.empty(sum(len(part) for part in parts), dtype=torch.uint8)
    view = frame.numpy()
    offset = 0
    for part in parts:
        view[offset : offset + len(part)] = np.frombuffer(part, dtype=np.uint8)
        offset += len(part)
    return frame


class TorchPlaneTransport(NativeCollectives):
    """One rank of an epoch's torch.distributed group (see the module docstring).

    Build it inside the trio run that uses it (its receiving threads hand frames to that run);
    `create_local_group` and `connect_torch_transport` do. ``group``: the gloo process group
    (frames, CPU collectives); ``device_group`` and ``device``: an NCCL group and the CUDA
    device whose tensors it reduces (None: CPU only). ``keep``: objects to keep alive as long
    as the group (the store). ``store`` and ``host``: the epoch's store and the address gloo's
    connections bind to, for `open_subgroup` (None: this transport makes no subgroups).
    ``device_ops``: how the NCCL collectives' completion is waited for
    (`paramsync.runtime.transport.device_ops`; default: the context's).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        group: Group,
        *,
        device_group: Group | None = None,
        device: torch.device | None = None,
        collective_seconds: float = DEFAULT_COLLECTIVE_SECONDS,
        close_seconds: float = 10.0,
        max_frame: int = DEFAULT_MAX_FRAME,
        inbox_frames: int = 8,
        keep: Sequence[object] = (),
        store: dist.Store | None = None,
        host: str | None = None,
        device_ops: DeviceOps | None = None,
    ) -> None:
        super().__init__(rank, world_size)
        if not collective_seconds > 0 or not close_seconds > 0:
            raise ValueError(
                f"collective_seconds and close_seconds must be positive, got "
                f"{collective_seconds!r} and {close_seconds!r}"
            )
        if (device_group is None) != (device is None or device.type != "cuda"):
            raise ValueError("pass device_group (NCCL) exactly when device is a CUDA device")
        self._group: Group | None = group
        self._device_group = device_group
        self.device = device
        """The CUDA device whose tensors reduce through NCCL (None: CPU only)."""
        self._device_ops = device_ops or context_device_ops()
        """How the NCCL collectives' completion is waited for (an event on the device)."""
        self.collective_seconds = collective_seconds
        self.close_seconds = close_seconds
        self.max_frame = max_frame
        self.inbox_frames = inbox_frames
        self._keep: list[object] = list(keep)
        self._store = store
        self._host = host
        self._subgroups: list[TorchPlaneTransport] = []
        self._pair_counts: dict[int, int] = {}
        """Per peer, how many subgroups holding it this rank has opened (`open_subgroup`)."""
        """The subgroups made by `open_subgroup`: aborted and closed with this transport."""
        self._token = trio.lowlevel.current_trio_token()
        self._lock = threading.Lock()
        """Guards posting (sends to one peer leave in the order posted) and the state below."""
        self._closed = False
        self._said_goodbye: set[int] = set()
        self._gone: dict[int, Exception] = {}
        """Peers whose end is gone (goodbye or a broken connection), with the reason."""
        self._ended: dict[int, Exception] = {}
        """Peers whose last frame this rank has received: each later receive raises this."""
        self._goodbyes: list[Any] = []
        self._lost = trio.Event()
        """Set once a peer's end is gone (see `_wait`)."""
        self._waits: set[trio.CancelScope] = set()
        self._inflight: set[Any] = set()
        """Operations whose wait was abandoned (cancelled, aborted) and may still run: the
        group outlives them (see `aclose`)."""
        self._inbox_send: dict[int, trio.MemorySendChannel[torch.Tensor | Exception]] = {}
        self._inbox: dict[int, trio.MemoryReceiveChannel[torch.Tensor | Exception]] = {}
        self._peers = [peer for peer in range(world_size) if peer != rank]
        self._pumps: list[threading.Thread] = []
        self._release: threading.Thread | None = None
        """The thread that drops the group once `aclose` has closed it (joined by `aclose` for
        up to ``close_seconds``, and by the interpreter before it exits)."""
        for peer in self._peers:
            send, receive = trio.open_memory_channel[torch.Tensor | Exception](inbox_frames)
            self._inbox_send[peer], self._inbox[peer] = send, receive
        for peer in self._peers:
            # Not a daemon: the interpreter joins it before it finalizes. A daemon thread
            # still inside gloo then (or taking the GIL back from it) is torn down by a forced
            # unwind through C++, which aborts the process ("terminate called without an
            # active exception"). It ends on its peer's goodbye or a broken connection.
            pump = threading.Thread(
                target=self._pump,
                args=(peer,),
                name=f"paramsync-torch-recv-{rank}<-{peer}",
                daemon=False,
            )
            pump.start()
            self._pumps.append(pump)

    # ------------------------------------------------------------------ frames

    def _live_group(self, peer: int | None) -> Group:
        group = self._group
        if self._closed or group is None:
            raise PeerClosed(f"rank {self.rank}'s torch transport is closed", peer=peer)
        return group

    def _post_goodbye(self, peer: int) -> None:
        """Tell ``peer`` this end is closing (once); never blocks. Call with the lock held."""
        group = self._group
        if peer in self._said_goodbye or group is None:
            return
        self._said_goodbye.add(peer)
        if peer in self._gone and not isinstance(self._gone[peer], _Goodbye):
            return  # its connection is broken: nothing to tell
        try:
            head = torch.tensor([_GOODBYE], dtype=torch.int64)
            self._goodbyes.append((group.send([head], peer, _HEAD_TAG), head))
        except RuntimeError:
            pass  # the connection is already gone: the peer's thread sees that instead

    def _pump(self, peer: int) -> None:
        """Keep a receive posted for ``peer``'s next frame; queue each frame for `recv`."""
        group = self._group
        assert group is not None
        head = torch.empty(1, dtype=torch.int64)
        delivering = True
        while True:
            try:
                group.recv([head], peer, _HEAD_TAG).wait()
                length = int(head.item())
                if length == _GOODBYE:
                    end: Exception = _Goodbye("closed its end", peer=peer)
                    break
                if not 0 < length <= self.max_frame:
                    end = ProtocolError(
                        f"announced a frame of {length} bytes (at most {self.max_frame})",
                        peer=peer,
                    )
                    break
                body = torch.empty(length, dtype=torch.uint8)
                group.recv([body], peer, _BODY_TAG).wait()
            except RuntimeError as exc:
                end = _gloo_error(exc, peer, "receiving a frame")
                break
            if delivering:
                delivering = self._deliver(peer, body)
        with self._lock:
            self._gone.setdefault(peer, end)
            if isinstance(end, _Goodbye):
                self._post_goodbye(peer)  # the peer's thread waits for this end's goodbye
        try:
            trio.from_thread.run_sync(self._lost.set, trio_token=self._token)
        except trio.RunFinishedError:
            pass
        if delivering:
            self._deliver(peer, end)

    def _deliver(self, peer: int, item: torch.Tensor | Exception) -> bool:
        """Queue ``item`` for `recv` (waiting while the inbox is full); False once nobody will
        read it (this end closed, or its trio run ended)."""
        try:
            trio.from_thread.run(self._inbox_send[peer].send, item, trio_token=self._token)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.RunFinishedError):
            return False
        return True

    async def send(
        self, peer: int, kind: str, fields: Mapping[str, Any], bulk: torch.Tensor | None = None
    ) -> None:
        self.check_peer(peer)
        self._live_group(peer)
        frame = _frame_tensor(kind, fields, bulk)
        head = torch.tensor([frame.numel()], dtype=torch.int64)
        with self._lock:  # both parts posted at once: frames to a peer leave in posting order
            group = self._live_group(peer)
            if peer in self._gone:
                raise PeerClosed(f"its end is gone: {self._gone[peer].args[0]}", peer=peer)
            try:
                works = [
                    group.send([head], peer, _HEAD_TAG),
                    group.send([frame], peer, _BODY_TAG),
                ]
            except RuntimeError as exc:
                raise _gloo_error(exc, peer, f"sending a {kind} frame") from None
        await self._wait(works, peer, f"sending a {kind} frame")

    async def _receive_frame(self, peer: int) -> dict[str, Any]:
        self.check_peer(peer)
        if peer in self._ended:
            raise self._ended[peer]
        self._live_group(peer)
        try:
            item = await self._inbox[peer].receive()
        except (trio.ClosedResourceError, trio.EndOfChannel):
            raise PeerClosed(f"rank {self.rank}'s torch transport is closed", peer=peer) from None
        if isinstance(item, Exception):
            self._ended[peer] = item
            raise item
        try:
            return decode_frame(item.numpy().data, self.max_frame)  # type: ignore[arg-type]
        except ProtocolError as exc:
            raise exc.with_peer(peer) from None

    async def recv(self, peer: int) -> dict[str, Any]:
        return await self._receive_frame(peer)

    async def recv_into(self, peer: int, out: torch.Tensor) -> dict[str, Any]:
        self.check_destination(out)
        return land_tensor(await self._receive_frame(peer), out, peer)

    # ------------------------------------------------------------------ waiting

    async def _wait(self, works: list[Any], peer: int | None, what: str) -> None:
        """Wait for ``works`` on a thread; `abort` or a failure ends the wait at once. A
        collective (``peer`` None) also ends once a peer's end is gone (its goodbye or a broken
        connection) and the collective has not finished within ``_LOST_GRACE`` seconds of it:
        a `PeerClosed` naming that peer (a peer that closed after its part finishes in time)."""

        def run() -> None:
            for work in works:
                work.wait()

        failed: list[RuntimeError] = []
        lost: list[int] = []

        async def wait_works(done: trio.CancelScope) -> None:
            try:
                await trio.to_thread.run_sync(run, abandon_on_cancel=True)
            except RuntimeError as exc:
                failed.append(exc)
            done.cancel()

        async def watch_peers(done: trio.CancelScope) -> None:
            await self._lost.wait()
            await trio.sleep(min(_LOST_GRACE, self.collective_seconds))
            lost.extend(sorted(self._gone))
            done.cancel()

        self._inflight.update(works)
        with trio.CancelScope() as scope:
            self._waits.add(scope)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(wait_works, nursery.cancel_scope)
                    if peer is None:
                        nursery.start_soon(watch_peers, nursery.cancel_scope)
            finally:
                self._waits.discard(scope)
        if scope.cancelled_caught:
            raise PeerClosed(f"{what}: rank {self.rank}'s torch transport was aborted", peer=peer)
        if lost:  # the works are abandoned: they end at gloo's deadline, or with the group
            also = f" (so are ranks {lost[1:]})" if lost[1:] else ""
            raise PeerClosed(
                f"{what}: its end is gone ({_reason(self._gone[lost[0]])}){also}", peer=lost[0]
            )
        self._inflight.difference_update(works)
        if failed:
            if peer is None and self._gone:
                peer = min(self._gone)
            raise _gloo_error(failed[0], peer, what) from None

    # ------------------------------------------------------------------ collectives

    def native_accepts(self, tensor: torch.Tensor) -> bool:
        if tensor.dtype not in SUPPORTED_DTYPES:
            return False
        if tensor.device.type == "cpu":
            return tensor.dtype in GLOO_DTYPES
        return self._device_group is not None and tensor.device == self.device

    def _collective_group(self, tensor: torch.Tensor, what: str) -> Group:
        group = self._live_group(None)
        if tensor.device.type != "cpu":
            if self._device_group is None or tensor.device != self.device:
                raise CollectiveError(
                    f"{what}: this torch transport has no group for {tensor.device}"
                )
            return self._device_group
        return group

    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.collective_seconds)

    async def _collective(
        self, tensor: torch.Tensor, what: str, issue: Callable[[Any], Any]
    ) -> None:
        """Issue one collective (in program order, on the trio thread: every rank issues in
        the same order) and wait for it within its deadline."""
        group = self._collective_group(tensor, what)
        try:
            work = issue(group)
        except RuntimeError as exc:
            raise _gloo_error(exc, None, what) from None
        if group is self._device_group:
            await self._wait_device(work, what)
        else:
            await self._wait([work], None, what)

    async def _wait_device(self, work: Any, what: str) -> None:
        """NCCL (untested here): order the current stream after the collective (a stream wait),
        then wait within the deadline for an event recorded there after it (that event alone,
        queried, else waited for on a thread; never a device synchronize); past the deadline,
        abort the NCCL group."""
        work.wait()
        ops = self._device_ops
        assert self.device is not None
        done = ops.record_event(ops.current_stream(self.device))
        if ops.query(done):
            return
        with trio.move_on_after(self.collective_seconds) as deadline:
            await self._wait([_EventWork(ops, done)], None, what)
        if deadline.cancelled_caught:
            self.abort()
            raise StallError(f"{what}: no result within {self.collective_seconds:g} s")

    async def native_all_reduce(self, flat: torch.Tensor, op: str) -> None:
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
        options.timeout = self._timeout()
        await self._collective(flat, "all_reduce", lambda g: g.allreduce([flat], options))
        if op == "avg":
            divide_in_place(flat, self.world_size)

    async def native_broadcast(self, flat: torch.Tensor, root: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = root
        options.rootTensor = 0
        options.timeout = self._timeout()
        await self._collective(flat, "broadcast", lambda g: g.broadcast([flat], options))

    async def native_all_gather(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        options = AllgatherOptions()
        options.timeout = self._timeout()
        await self._collective(flat, "all_gather", lambda g: g._allgather_base(out, flat, options))

    async def native_reduce_scatter(
        self, flat: torch.Tensor, op: str, bounds: list[tuple[int, int]]
    ) -> torch.Tensor:
        # An all-reduce, then this rank's slice: gloo's reduce-scatter needs every segment
        # non-empty, and the ring's contract (``flat`` is scratch afterwards) allows it.
        await self.native_all_reduce(flat, op)
        lo, hi = bounds[self.rank]
        return flat[lo:hi].clone()

    async def native_barrier(self) -> None:
        options = dist.BarrierOptions()
        options.timeout = self._timeout()
        token = torch.zeros(1)
        await self._collective(token, "barrier", lambda g: g.barrier(options))

    # ------------------------------------------------------------------ subgroups

    async def open_subgroup(
        self, ranks: Sequence[int], name: str, *, parent: str, seconds: float = 60.0
    ) -> TorchPlaneTransport:
        """This rank's transport in a new torch group of ``ranks`` (this transport's ranks,
        sorted, this rank among them), numbered 0..k-1 in that order. Collective among the
        members: each calls it with the same ``ranks`` and ``name``; ``parent`` names this
        transport the same on every rank (`paramsync.runtime.collectives.groups`: "world", or the
        group's name).

        The members first check, through the epoch's store, that they all create ``name``
        over ``ranks``: every two members compare what they create as the n-th subgroup of
        ``parent`` holding both (as TCP groups do over the connection between them), so one
        that creates another group is a `ProtocolError` naming it. Then they
        form a gloo group (and an NCCL one for a CUDA device) under a prefix of the store named
        by ``name``. Not formed within ``seconds``: a `StallError` naming the group. The result
        belongs to this transport (`abort` and `aclose` reach it)."""
        members = tuple(ranks)
        if list(members) != sorted(set(members)) or self.rank not in members:
            raise CollectiveError(
                f"a subgroup needs sorted, distinct ranks holding rank {self.rank}, got "
                f"{list(members)}"
            )
        for rank in members:
            if rank != self.rank:
                self.check_peer(rank)
        store, host = self._store, self._host
        if store is None:
            raise CollectiveError(
                f"rank {self.rank}'s torch transport holds no store to form group {name!r} "
                "through (build it with create_local_group or connect_torch_transport)"
            )
        self._live_group(None)
        position = members.index(self.rank)
        size = len(members)
        counts = {peer: self._pair_counts.get(peer, 0) for peer in members if peer != self.rank}
        for peer, count in counts.items():
            self._pair_counts[peer] = count + 1

        def form() -> tuple[Group, Group | None]:
            _agree(store, parent, self.rank, members, name, counts, seconds)
            scoped = dist.PrefixStore(f"paramsync-group/{name}", store)
            group = _gloo_group(scoped, position, size, host)
            device_group = None
            if self.device is not None and self._device_group is not None:  # pragma: no cover
                device_group = _nccl_group(scoped, position, size, self.collective_seconds)
            return group, device_group

        with trio.move_on_after(seconds) as deadline:
            group, device_group = await trio.to_thread.run_sync(form, abandon_on_cancel=True)
        if deadline.cancelled_caught:
            raise StallError(
                f"group {name!r} (ranks {list(members)}) did not form within {seconds:g} s"
            )
        subgroup = TorchPlaneTransport(
            position,
            size,
            group,
            device_group=device_group,
            device=self.device if device_group is not None else None,
            collective_seconds=self.collective_seconds,
            close_seconds=self.close_seconds,
            max_frame=self.max_frame,
            inbox_frames=self.inbox_frames,
            keep=(store,),
            store=store,
            host=host,
        )
        if self._closed:  # closed while the group formed: it belongs to a closed epoch
            await subgroup.aclose()
            raise PeerClosed(f"rank {self.rank}'s torch transport closed while {name!r} formed")
        self._subgroups.append(subgroup)
        return subgroup

    # ------------------------------------------------------------------ ending

    def abort(self) -> None:
        """Fail every call in flight and every later one at once, and tell the peers this end
        is gone; the group itself is dropped by `aclose`."""
        if self._closed:
            return
        for subgroup in list(self._subgroups):
            subgroup.abort()
        with self._lock:
            self._closed = True
            for peer in self._peers:
                self._post_goodbye(peer)
        for scope in list(self._waits):
            scope.cancel()
        for receive in self._inbox.values():
            receive.close()
        if self._device_group is not None:
            try:
                self._device_group.abort()
            except RuntimeError:
                pass

    async def aclose(self) -> None:
        """Close the handshake with every peer (within ``close_seconds``), then drop the
        group: its connections close once no thread waits on it. Its subgroups close first,
        all at once (each is a peer of the same ranks' subgroups). Safe to call twice."""
        self.abort()
        if self._group is None:
            return
        subgroups, self._subgroups = self._subgroups, []
        if subgroups:
            with trio.CancelScope(shield=True):
                async with trio.open_nursery() as nursery:
                    for subgroup in subgroups:
                        nursery.start_soon(subgroup.aclose)
        pumps = list(self._pumps)

        def finish(limit: float) -> None:
            # A receiving thread ends on its peer's goodbye, which the peer sends once it has
            # this end's: when every thread has ended, every goodbye was delivered.
            end = time.monotonic() + limit
            for pump in pumps:
                pump.join(max(0.0, end - time.monotonic()))

        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(finish, self.close_seconds, abandon_on_cancel=True)
        # Released on a thread of its own (not a daemon, so the interpreter joins it before it
        # finalizes), in a fixed order: every abandoned operation ends (a collective abandoned
        # on a dead peer fails at once, on a silent one at its deadline), every receiving
        # thread ends (they hold the group), then the groups are destroyed, the device group
        # first, and last the store they met through. Waiting happens without the GIL, and a
        # gloo group's destructor then has nothing left to wait for while it holds the GIL.
        # A goodbye a peer never took stays referenced (``_goodbyes``), not freed under gloo.
        held = [self._device_group, self._group, *self._keep]
        pending = list(self._inflight)
        self._group = None
        self._device_group = None
        self._keep.clear()
        self._inflight.clear()
        release = threading.Thread(
            target=_release,
            args=(held, pending, pumps),
            name=f"paramsync-torch-release-{self.rank}",
            daemon=False,
        )
        del held, pending
        release.start()
        self._release = release
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(release.join, self.close_seconds, abandon_on_cancel=True)


def _release(held: list[object], pending: list[Any], pumps: list[threading.Thread]) -> None:
    """Wait (without the GIL) for ``pending`` operations and the receiving threads ``pumps`` to
    end, then drop ``held`` one at a time, in its order."""
    for work in pending:
        try:
            work.wait()
        except RuntimeError:
            pass  # failed as abandoned operations do: it has ended
    pending.clear()
    for pump in pumps:
        pump.join()
    while held:
        held.pop(0)


def _reason(error: Exception) -> str:
    """Why a peer's end is gone, without the peer's name (the caller names it)."""
    return error.reason if isinstance(error, ProtocolError) else one_line(error)


class _Goodbye(PeerClosed):
    """The peer closed its end cleanly (its goodbye arrived after its last frame)."""


class _EventWork:
    """A device event as a waitable: ``wait`` blocks the calling thread until it completes."""

    def __init__(self, ops: DeviceOps, event: Any) -> None:
        self._ops = ops
        self._event = event

    def wait(self) -> None:
        self._ops.wait_host(self._event)


# ---------------------------------------------------------------------- building groups


async def _share_port(bootstrap: Transport, port: torch.Tensor) -> None:
    """Rank 0's ``port`` (one int64) to every rank of ``bootstrap``, as a collective's data
    frame (``coll``) to each in turn: the ring's broadcast, which sits above this layer."""
    op_id = bootstrap.next_op_id()
    fields = {"op": op_id, "hop": 0, "part": 0}
    if bootstrap.rank == 0:
        for peer in range(1, bootstrap.world_size):
            await bootstrap.send(peer, "coll", fields, port)
        return
    message = await bootstrap.recv_into(0, port)
    if message["kind"] != "coll" or message["op"] != op_id:
        raise ProtocolError(
            f"expected the torch store's port (collective {op_id}), got a {message['kind']} "
            "message",
            peer=0,
        )


def _agree(
    store: dist.Store,
    parent: str,
    rank: int,
    members: tuple[int, ...],
    name: str,
    counts: Mapping[int, int],
    seconds: float,
) -> None:
    """Check (blocking) that every member of ``members`` creates group ``name`` over
    ``members``: with each other member ``peer``, this is the ``counts[peer]``-th subgroup of
    ``parent`` holding both, and each of the two writes what it creates under that pair's key,
    then reads the other's. A member that creates another group is a `ProtocolError` naming
    it; one that never says within ``seconds`` a `StallError`."""
    declared = dist.PrefixStore(f"paramsync-group-decl/{parent}", store)
    mine = f"{name}|{','.join(map(str, members))}"

    def key(peer: int, writer: int) -> str:
        return f"{min(rank, peer)}-{max(rank, peer)}/{counts[peer]}/{writer}"

    for peer in counts:
        declared.set(key(peer, rank), mine)
    for peer in counts:
        try:
            declared.wait([key(peer, peer)], datetime.timedelta(seconds=seconds))
        except RuntimeError:
            raise StallError(
                f"group {name!r} (ranks {list(members)}): rank {peer} did not create it within "
                f"{seconds:g} s",
                peer=peer,
            ) from None
        theirs = declared.get(key(peer, peer)).decode(errors="replace")
        if theirs != mine:
            other, _, ranks = theirs.partition("|")
            raise ProtocolError(
                f"creates group {other!r} with ranks [{ranks.replace(',', ', ')}] where rank "
                f"{rank} creates {name!r} with ranks {list(members)}: every rank must call "
                "new_group alike, in the same order",
                peer=peer,
            )


def _gloo_group(store: dist.Store, rank: int, world_size: int, host: str | None) -> Group:
    """A gloo group (blocks until every rank has joined it through ``store``); ``host``: the
    address its connections bind to (None: torch's default, from the host name)."""
    if host is None:
        return dist.ProcessGroupGloo(store, rank, world_size, _IDLE_TIMEOUT)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = _IDLE_TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def _nccl_group(
    store: dist.Store, rank: int, world_size: int, seconds: float
) -> Group:  # pragma: no cover - needs CUDA and NCCL (untested here)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = datetime.timedelta(seconds=seconds)
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world_size, options)


async def create_local_group(
    n: int,
    *,
    prefix: str = "paramsync",
    collective_seconds: float = DEFAULT_COLLECTIVE_SECONDS,
    seconds: float = 60.0,
    close_seconds: float = 10.0,
) -> list[TorchPlaneTransport]:
    """``n`` transports, rank 0 to n-1, of one gloo group whose ranks all live in this process
    (a ``HashStore`` rendezvous, gloo on loopback); for tests and in-process runs. The caller
    closes them. Forming the group takes longer than ``seconds``: a `CollectiveError`.
    ``close_seconds``: how long each rank's `~TorchPlaneTransport.aclose` waits for its threads
    (an operation abandoned on a silent peer ends at its deadline, on a thread left behind)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"group size must be a positive int, got {n!r}")
    store = dist.PrefixStore(prefix, dist.HashStore())
    groups: list[Group | None] = [None] * n

    async def build(rank: int) -> None:
        groups[rank] = await trio.to_thread.run_sync(
            _gloo_group, store, rank, n, "127.0.0.1", abandon_on_cancel=True
        )

    with trio.move_on_after(seconds) as scope:
        async with trio.open_nursery() as nursery:
            for rank in range(n):
                nursery.start_soon(build, rank)
    if scope.cancelled_caught:
        raise CollectiveError(f"a local torch group of {n} did not form within {seconds:g} s")
    made = []
    for rank, group in enumerate(groups):
        assert group is not None
        made.append(
            TorchPlaneTransport(
                rank,
                n,
                group,
                collective_seconds=collective_seconds,
                close_seconds=close_seconds,
                keep=(store,),
                store=store,
                host="127.0.0.1",
            )
        )
    return made


@asynccontextmanager
async def open_local_group(n: int, **kwargs: Any) -> AsyncIterator[list[TorchPlaneTransport]]:
    """`create_local_group` as an async context manager that closes every rank on exit."""
    group = await create_local_group(n, **kwargs)
    try:
        yield group
    finally:
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for transport in group:
                    nursery.start_soon(transport.aclose)


async def connect_torch_transport(
    bootstrap: Transport,
    *,
    store_host: str,
    local_host: str,
    prefix: str,
    seconds: float = 120.0,
    device: torch.device | None = None,
    collective_seconds: float = DEFAULT_COLLECTIVE_SECONDS,
) -> TorchPlaneTransport:
    """Form this epoch's torch group among the ranks of ``bootstrap`` (an authenticated
    paramsync transport among the same ranks, in the same order; the caller closes it).

    Rank 0 hosts a fresh ``TCPStore`` on a free port of ``store_host`` (its own address) and
    broadcasts the port over ``bootstrap``; every rank joins the gloo group (and, for a CUDA
    ``device``, an NCCL one) under ``prefix`` (name it by the run and the epoch, so no rank of
    another epoch can meet it), its connections bound to ``local_host``. Not formed within
    ``seconds``: a `CollectiveError`.
    """
    rank, world_size = bootstrap.rank, bootstrap.world_size
    timeout = datetime.timedelta(seconds=seconds)
    server: dist.TCPStore | None = None
    port = torch.zeros(1, dtype=torch.int64)
    with trio.move_on_after(seconds) as scope:
        if rank == 0:
            server = await trio.to_thread.run_sync(
                partial(
                    dist.TCPStore,
                    store_host,
                    0,
                    world_size,
                    True,
                    timeout,
                    wait_for_workers=False,
                ),
                abandon_on_cancel=True,
            )
            port[0] = server.port
        await _share_port(bootstrap, port)
        if server is None:
            store: dist.Store = await trio.to_thread.run_sync(
                partial(dist.TCPStore, store_host, int(port[0]), world_size, False, timeout),
                abandon_on_cancel=True,
            )
        else:
            store = server
        scoped = dist.PrefixStore(prefix, store)
        group = await trio.to_thread.run_sync(
            _gloo_group, scoped, rank, world_size, local_host, abandon_on_cancel=True
        )
        device_group = None
        if device is not None and device.type == "cuda":  # pragma: no cover - no GPU here
            device_group = _nccl_group(scoped, rank, world_size, collective_seconds)
    if scope.cancelled_caught:
        raise CollectiveError(
            f"rank {rank}: the torch group {prefix!r} of {world_size} did not form within "
            f"{seconds:g} s"
        )
    return TorchPlaneTransport(
        rank,
        world_size,
        group,
        device_group=device_group,
        device=device if device_group is not None else None,
        collective_seconds=collective_seconds,
        keep=(store,),
        store=scoped,
        host=local_host,
    )
