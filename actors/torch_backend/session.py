"""One torch process group's paramsync session: coordinator, client, mesh, executor.

torch calls a process group's collectives from the user's thread (or autograd's) and expects
a `Work` back at once. Every group of this process runs in one trio loop on a background
thread (`BackendLoop`); a group's `GroupSession` owns, in that loop:

* the group's coordinator, hosted by its rank 0 (its address goes through the group's torch
  store; the shared secret never does: it comes from ``PARAMSYNC_SECRET`` or
  ``PARAMSYNC_SECRET_FILE``), or, when the group spans hosts
  (`paramsync.actors.torch_backend.tree`), the coordinator tree: the root on rank 0, a
  sub-coordinator on each host's first rank, which the host's ranks join;
* a `CoordinatorClient` joined to it, with heartbeats;
* the group's authenticated TCP mesh (shared memory between ranks on one host), and a
  second mesh for point-to-point messages, so a ``send`` never interleaves with a collective;
* the executor: two tasks fed, in the caller's order, by a channel. The *announcer* gives
  each collective a (step, bucket) number and reports its `Call` to the coordinator as a
  ``ready``; the *runner* waits for the coordinator's ``go`` for it (or, for a call the
  members already agreed on at that number, runs it at once and lets the coordinator check
  the report: Horovod's response cache), runs it and completes the caller's future. A call on
  the group's inner torch group (`paramsync.actors.torch_backend.inner`) always waits for the
  go and runs on a worker thread; the group's failure aborts the inner group.

A step ends when an optimizer stepping state this group's ranks hold alike (a DDP module,
DTensor parameters replicated or sharded over it) has stepped
(`paramsync.actors.torch_backend.proof`): its state digest is reported, and the coordinator compares
every rank's (C-DDP-001) and commits the step, one step behind the collectives at most.

Failure: a collective that fails, a coordinator that aborts the run (a rank lost, stalled,
a call that differs, a diverged state) or a lost coordinator fails the call in flight and
every later one with one error naming what happened; nothing waits forever.
"""

from __future__ import annotations

import atexit
import collections
import logging
import math
import os
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import trio

from paramsync.actors.client.client import CoordinatorClient, CoordinatorLost
from paramsync.actors.state.digest import StateDigest
from paramsync.actors.torch_backend.calls import Call
from paramsync.actors.torch_backend.inner import INNER_ENV, InnerGroups
from paramsync.actors.torch_backend.monitored import MonitoredBarrierError
from paramsync.actors.torch_backend.reach import coordinator_reach, local_address, mesh_reach
from paramsync.actors.torch_backend.tree import TreeLayout
from paramsync.runtime.coordinator.events import spec_hash
from paramsync.runtime.coordinator.service import Coordinator, CoordinatorOptions
from paramsync.runtime.coordinator.tree_service import RootCoordinator, SubCoordinator
from paramsync.runtime.errors import ConfigError, ParamsyncError, PeerClosed, plain_or_quoted
from paramsync.runtime.protocol.handshake import Identity
from paramsync.runtime.protocol.messages import Go, StartRun
from paramsync.runtime.transport.base import Transport
from paramsync.runtime.transport.shm import attach_shared_memory
from paramsync.runtime.transport.tcp import DEFAULT_GROUP, TcpTransport, dial_with_retry, form_mesh

__all__ = ["BackendLoop", "GroupSession", "SessionOptions", "BackendError", "backend_loop"]

log = logging.getLogger(__name__)

COORDINATOR_KEY = "paramsync/coordinator"
"""The key, in the group's torch store, under which its rank 0 publishes its coordinator's
address (host and port only)."""


class BackendError(ParamsyncError, RuntimeError):
    """The group cannot run collectives any more: the message says why (the coordinator's
    reason, naming ranks, step and call, when it gave one)."""


@dataclass(frozen=True)
class SessionOptions:
    """How a group session runs."""

    timeout_seconds: float = 1800.0
    """torch's ``timeout`` for the group: joining, forming the meshes, and a collective that
    makes no progress for this long (the coordinator then names the ranks it waits for)."""
    heartbeat_deadline: float = 10.0
    """Seconds of silence after which the coordinator declares a rank lost."""
    response_cache: bool = True
    """Run a call at once, without waiting for a go, when the members agreed on the same call
    at the same place of an earlier step (the coordinator still checks every report)."""
    host: str = "127.0.0.1"
    """The address rank 0's coordinator listens on."""
    inner: str = "native"
    """The inner torch group kind (`paramsync.actors.torch_backend.inner`): part of the group's
    signature at joining, so ranks that asked for different kinds are refused, named."""


@dataclass(eq=False)
class _Op:
    call: Call
    run: Callable[[Transport], Awaitable[None]]
    future: torch.futures.Future[Any]
    result: Any
    p2p: bool = False
    step: int = -1
    bucket: int = -1
    cached: bool = False
    in_backward: bool = False
    op_id: int = 0
    inner: Callable[[], None] | None = None
    """The call on the group's inner torch group (run on a worker thread), instead of ``run``
    on paramsync's mesh."""
    own_verdict: bool = False
    """A point-to-point call whose `MonitoredBarrierError` fails the call only (a monitored
    barrier's verdict), not the group."""


@dataclass(eq=False)
class _StepEnd:
    digest: StateDigest


@dataclass(eq=False)
class _Close:
    done: threading.Event = field(default_factory=threading.Event)


class BackendLoop:
    """The trio loop every paramsync process group of this process runs in (a daemon thread,
    started with the first group)."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="paramsync-backend", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise BackendError(f"the paramsync backend's loop did not start: {self._failure}")

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:
            self._failure = exc
            log.exception("the paramsync backend's loop stopped")
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._ready.set()
            await trio.sleep_forever()

    def run(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``fn(*args)`` in the loop and wait for its result (from another thread)."""
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` in the loop soon (thread-safe, never blocks)."""
        assert self._token is not None
        self._token.run_sync_soon(fn, *args)

    async def start(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Start ``fn`` as a task of the loop's nursery (from within the loop); returns what
        it passes to ``task_status.started``."""
        assert self._nursery is not None
        return await self._nursery.start(fn, *args)

    def stop(self, seconds: float) -> None:
        """Cancel every task of the loop and wait, at most ``seconds``, for its thread to end
        (a task waiting for a worker thread waits for that thread's work to finish)."""
        if self._token is None or not self._thread.is_alive():
            return
        try:
            self._token.run_sync_soon(self._cancel)
        except trio.RunFinishedError:
            return
        self._thread.join(seconds)

    def _cancel(self) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()


_LOOP: BackendLoop | None = None
_LOOP_LOCK = threading.Lock()


def backend_loop() -> BackendLoop:
    """This process's backend loop (started on first use; a fork starts its own)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or not _LOOP._thread.is_alive():
            _LOOP = BackendLoop()
        return _LOOP


def _after_fork() -> None:
    global _LOOP
    _LOOP = None  # the thread did not survive the fork: the child starts its own


os.register_at_fork(after_in_child=_after_fork)

_EXIT_SECONDS = 5.0
"""How long the interpreter's exit waits for the backend loop to wind down."""


_OPEN_SESSIONS: weakref.WeakSet[GroupSession] = weakref.WeakSet()
"""The sessions opened in this process and not yet closed (`_stop_the_loop_at_exit`)."""


def _ended_by_an_uncaught_exception() -> bool:
    """Whether the interpreter is exiting because an exception reached the top of the main
    thread (the default ``sys.excepthook`` records it in ``sys.last_value`` first)."""
    return getattr(sys, "last_value", None) is not None


@atexit.register
def _stop_the_loop_at_exit() -> None:
    """Wind the loop down before the interpreter does.

    A script that ends without ``destroy_process_group`` (torch only warns about it; Lightning
    leaves its group open) has its open groups closed here as ``destroy_process_group`` would,
    so the other ranks hear that this rank finished rather than that it was lost. A process
    ending on an uncaught exception closes nothing: its links just end, and the others name it
    lost, as they would a crash.

    Then the loop stops. Its threads are daemons, which the interpreter freezes where they
    stand when it shuts down; one inside a torch operation then ends the process with
    ``terminate called without an active exception`` (SIGABRT) instead of its exit code."""
    if not _ended_by_an_uncaught_exception():
        for session in list(_OPEN_SESSIONS):
            if session.failure is None:
                session.close()
    loop = _LOOP
    if loop is not None:
        loop.stop(_EXIT_SECONDS)


class GroupSession:
    """One torch process group's coordinator, client, meshes and executor (see the module).

    ``name``: the group's name (torch's group id), part of every handshake's identity;
    ``rank``/``size``: this process's rank in the group and its size; ``secret``: the shared
    secret; ``coordinator``: rank 0's coordinator address (the others learn it from the
    store before the session opens)."""

    def __init__(
        self,
        name: str,
        rank: int,
        size: int,
        secret: bytes,
        options: SessionOptions,
        *,
        launched: bool = False,
    ) -> None:
        self.name = name
        self.launched = launched
        """The coordinator is ``paramsync launch``'s (its handshake group is the default one)."""
        self.rank = rank
        self.size = size
        self.global_ranks: tuple[int, ...] = tuple(range(size))
        """The group's ranks as global ranks (a subgroup's, set by its process group): a
        coordinator's reason, in group ranks, is followed by them."""
        self._secret = secret
        self.options = options
        self.loop = backend_loop()
        self.transport: TcpTransport | None = None
        self.p2p: Transport | None = None
        self.client: CoordinatorClient | None = None
        self.coordinator_address: tuple[str, int] | None = None
        """Where the group's coordinator listens (set when the session opens)."""
        self.coordinator: Coordinator | None = None
        """The flat coordinator this rank hosts (rank 0 of a flat group)."""
        self.layout: TreeLayout | None = None
        """The group's hosts under the coordinator tree (None: a flat coordinator)."""
        self.root: RootCoordinator | None = None
        """The coordinator tree's root this rank hosts (rank 0 of a tree group)."""
        self.sub: SubCoordinator | None = None
        """The sub-coordinator this rank hosts (the first rank of its host, under the tree)."""
        self.inner: InnerGroups | None = None
        """The group's inner torch groups (`paramsync.actors.torch_backend.inner`), aborted
        when the group fails."""
        self.step = 0
        """The step collectives are numbered in (one per optimizer step of a DDP module)."""
        self._bucket = 0
        self._calls = 0
        self._failure: BaseException | None = None
        self._send: trio.MemorySendChannel[Any] | None = None
        self._gos: set[tuple[int, int]] = set()
        self._pending: dict[int, _Op] = {}
        self._inbox: collections.deque[Any] = collections.deque()
        """Items from torch's threads not yet moved into the loop (`_put`, `_drain`)."""
        self._inbox_lock = threading.Lock()
        self._drain_due = False
        """Calls queued and not yet completed, by id (touched in the loop's thread only)."""
        self._go_arrived = trio.Event()
        self._scope: trio.CancelScope | None = None
        self._closed = threading.Event()
        _OPEN_SESSIONS.add(self)

    # ------------------------------------------------------------------ opening

    def host_coordinator(self) -> tuple[str, int]:
        """Rank 0: start the group's coordinator; returns the address it listens on."""
        address: tuple[str, int] = self.loop.run(self._host_coordinator)
        return address

    def _coordinator_options(self) -> CoordinatorOptions:
        """A torch group's coordinator, flat or tree: calls agreed at any place run cached,
        a call some ranks never make is named at the group's timeout, idle is no stall."""
        return CoordinatorOptions(
            heartbeat_deadline=self.options.heartbeat_deadline,
            stall_seconds=min(60.0, self.options.timeout_seconds),
            stall_deadline=self.options.timeout_seconds,
            cache_by_spec=True,
            idle_stalls=False,
        )

    async def _host_coordinator(self) -> tuple[str, int]:
        coordinator = Coordinator(
            self.size, self._coordinator_options(), secret=self._secret, group=self._group()
        )
        self.coordinator = coordinator
        return await self._listen(coordinator, "its coordinator")

    def _group(self) -> str:
        return f"torch:{self.name}"

    async def _listen(self, coordinator: Coordinator, what: str) -> tuple[str, int]:
        """Serve ``coordinator`` (flat or the tree's root) where rank 0's coordinator
        listens; the address the others dial."""
        bind, advertised = await coordinator_reach(self.options.host)
        serve = partial(coordinator.serve_tcp, bind, 0)
        address: tuple[str, int] = await self.loop.start(self._serve_coordinator, serve, what)
        return (address[0] if advertised == bind else advertised), address[1]

    def host_root(self, layout: TreeLayout) -> tuple[str, int]:
        """Rank 0 of a group under the coordinator tree: start its root (whose peers are
        the hosts' sub-coordinators); returns the address it listens on."""
        self.layout = layout
        address: tuple[str, int] = self.loop.run(self._host_root)
        return address

    async def _host_root(self) -> tuple[str, int]:
        root = RootCoordinator(
            self.size, self._coordinator_options(), secret=self._secret, group=self._group()
        )
        self.root = root
        return await self._listen(root, "the coordinator tree's root")

    def host_sub(self, layout: TreeLayout, root: tuple[str, int]) -> tuple[str, int]:
        """The first rank of a host under the coordinator tree: start the host's
        sub-coordinator, which dials the ``root`` once the host's ranks joined; returns the
        address the host's ranks dial."""
        self.layout = layout
        address: tuple[str, int] = self.loop.run(self._host_sub, layout, root)
        return address

    async def _host_sub(self, layout: TreeLayout, root: tuple[str, int]) -> tuple[str, int]:
        sub = SubCoordinator(
            self.size,
            layout.name,
            layout.index,
            layout.ranks,
            self._coordinator_options(),
            secret=self._secret,
            group=self._group(),
            root_name=f"the root coordinator on rank 0 (host {plain_or_quoted(root[0])})",
        )
        self.sub = sub
        if 0 in layout.ranks:  # rank 0's host: listen as its root does
            bind, advertised = await coordinator_reach(self.options.host)
        else:  # where this host reaches the root from, which its ranks reach too
            bind = advertised = await local_address(*root)
        serve = partial(sub.serve_tcp, bind, 0, root=root)
        what = f"the sub-coordinator of host {layout.name!r}"
        address: tuple[str, int] = await self.loop.start(self._serve_coordinator, serve, what)
        return (address[0] if advertised == bind else advertised), address[1]

    async def _serve_coordinator(
        self,
        serve: Callable[..., Awaitable[None]],
        what: str,
        task_status: trio.TaskStatus[tuple[str, int]],
    ) -> None:
        try:
            await serve(task_status=task_status)
        except Exception as exc:  # the members hear it from their clients
            log.warning("group %s: %s stopped: %s", self.name, what, exc)

    def open(self, coordinator: tuple[str, int]) -> None:
        """Join the group's coordinator at ``coordinator``, form the meshes and start the
        executor (blocks until the group can run collectives)."""
        self.coordinator_address = coordinator
        try:
            self.loop.run(self._open, coordinator)
        except trio.TooSlowError:
            raise BackendError(
                f"group {self.name}: rank {self.rank} could not join its coordinator at "
                f"{coordinator[0]}:{coordinator[1]} and its {self.size - 1} peers within "
                f"{self.options.timeout_seconds:g} s"
            ) from None

    async def _open(self, coordinator: tuple[str, int]) -> None:
        started: trio.Event = trio.Event()
        await self.loop.start(self._run, coordinator, started)

    async def _run(
        self,
        coordinator: tuple[str, int],
        started: trio.Event,
        task_status: trio.TaskStatus[None],
    ) -> None:
        me = Identity(
            DEFAULT_GROUP if self.launched else f"torch:{self.name}", self.size, self.rank
        )
        seconds = self.options.timeout_seconds
        with trio.fail_after(seconds):
            conn, _ = await dial_with_retry(coordinator, self._secret, me)
        bind, local_host = mesh_reach(coordinator[0], conn.socket.getsockname()[0])
        listeners = await trio.open_tcp_listeners(0, host=bind)
        port = listeners[0].socket.getsockname()[1]
        client = CoordinatorClient(conn, self.rank)
        # The launcher's coordinator is a trainer's: only calls at an agreed place run cached.
        client.protocol.cache_by_spec = not self.launched
        client.on_go = self._on_go
        self.client = client
        try:
            with trio.fail_after(seconds):
                group = f"torch.distributed group {self.name}"
                signature = (
                    (group, (self.size,), "group", False),
                    # Ranks that asked for different inner groups are refused here, named.
                    (f"{group}: inner torch group ({INNER_ENV})", (), self.options.inner, False),
                )
                joined = await client.join(signature, (local_host, port))
                start = joined.start
                self.transport = await self._mesh(start, listeners[0], "")
                await attach_shared_memory(self.transport, seconds=seconds)
                self.p2p = await self._mesh(start, listeners[0], "/p2p")
            send, receive = trio.open_memory_channel[Any](math.inf)
            self._send = send
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                nursery.start_soon(self._serve_client, client)
                runs_send, runs_receive = trio.open_memory_channel[_Op](math.inf)
                nursery.start_soon(self._announce, client, receive, runs_send)
                nursery.start_soon(self._runner, runs_receive)
                task_status.started()
                started.set()
        except Exception as exc:
            self._fail(exc)
            if not started.is_set():
                raise  # to the opener, through nursery.start
            log.warning("%s", self._failure)
        finally:
            with trio.CancelScope(shield=True):
                for listener in listeners:
                    await listener.aclose()
                if self.transport is not None:
                    await self.transport.aclose()
                if self.p2p is not None:
                    await self.p2p.aclose()
                await client.link.aclose()
            self._closed.set()
            _OPEN_SESSIONS.discard(self)

    async def _mesh(
        self, start: StartRun, listener: trio.SocketListener, suffix: str
    ) -> TcpTransport:
        position = start.position(self.rank)
        ident = Identity(f"torch:{self.name}#{start.epoch}{suffix}", len(start.members), position)
        mesh = await form_mesh(ident, listener, list(start.addresses), self._secret)
        return TcpTransport(position, len(start.members), mesh, secret=self._secret)

    # ------------------------------------------------------------------ the executor

    async def _serve_client(self, client: CoordinatorClient) -> None:
        try:
            await client.serve()
        except Exception as exc:
            self._fail(exc, from_coordinator=True)
            raise

    async def _on_go(self, go: Go) -> None:
        self._gos.add((go.step, go.bucket))
        self._go_arrived.set()
        self._go_arrived = trio.Event()

    async def _announce(
        self,
        client: CoordinatorClient,
        receive: trio.MemoryReceiveChannel[Any],
        runs: trio.MemorySendChannel[_Op],
    ) -> None:
        async for item in receive:
            if isinstance(item, _Close):
                await runs.send(_Op(Call("close", "", ()), _nothing, _done_future(), None))
                await self._finish(client)
                item.done.set()
                return
            if isinstance(item, _StepEnd):
                if self.step > 0:
                    await client.wait_commit(self.step - 1)
                digest = item.digest
                await client.digest(
                    self.step,
                    digest.digest,
                    digest.packed,
                    names=digest.names,
                    algorithm=digest.algorithm,
                )
                self.step += 1
                self._bucket = 0
                continue
            op: _Op = item
            if not op.p2p:
                await self._report(client, op)
            await runs.send(op)

    async def _report(self, client: CoordinatorClient, op: _Op) -> None:
        """Number ``op`` (step, bucket) and report it ready. It runs at once (cached) when
        the members agreed on the very same call before in this epoch, else after the go."""
        protocol, epoch = client.protocol, client.epoch
        op.step, op.bucket = self.step, self._bucket
        self._bucket += 1
        if (
            self.step > 0
            and protocol.committed < self.step - 1
            and op.bucket >= protocol.id_bound(epoch)
        ):
            # The coordinator holds a report ahead of its step only for the buckets agreed
            # so far (a bound against floods): past them, wait for the step before to commit.
            await client.wait_commit(self.step - 1)
        spec = op.call.spec()
        digest = spec_hash(spec)
        # A call on an inner torch group always waits for the go: torch's group cannot refuse
        # another call's bytes, so the members must have agreed on it before it runs.
        op.cached = (
            self.options.response_cache
            and op.inner is None
            and protocol.may_cache(op.bucket, digest, epoch)
        )
        op.op_id = (int(digest[-10:], 16) << 23) | ((self._calls & 0xFFFF) << 7)
        self._calls += 1
        await client.ready(op.step, op.bucket, digest if op.cached else spec, cached=op.cached)

    async def _runner(self, runs: trio.MemoryReceiveChannel[_Op]) -> None:
        async with trio.open_nursery() as p2p:
            await self._run_in_order(runs, p2p)

    async def _run_in_order(self, runs: trio.MemoryReceiveChannel[_Op], p2p: trio.Nursery) -> None:
        """Run the calls in the callers' order: a collective to its end before the next
        call; a point-to-point call (on the p2p mesh) is posted in its turn and completes in
        ``p2p`` meanwhile, so an ``irecv`` posted before its ``isend`` does not hold the
        ``isend`` (nor the peer's) back."""
        async for op in runs:
            if op.call.op == "close":
                return
            try:
                if op.p2p and op.inner is None:
                    assert self.p2p is not None
                    p2p.start_soon(self._complete_p2p, op, op.run(self.p2p))  # posted now
                    continue
                if not op.p2p and not op.cached:
                    while (op.step, op.bucket) not in self._gos:
                        await self._go_arrived.wait()
                self._gos.discard((op.step, op.bucket))  # a go may answer a cached call too
                if op.inner is not None:
                    # Blocks a worker thread, within the inner group's timeout; a failure of
                    # the group meanwhile cancels this wait and aborts the inner group.
                    await trio.to_thread.run_sync(op.inner, abandon_on_cancel=True)
                    self._complete(op)
                    continue
                group = self.p2p if op.p2p else self.transport
                assert group is not None
                if not op.p2p:
                    # The op id carries the call's hash: a peer running another call refuses
                    # this one's frames (before any byte is combined), whatever the cache let
                    # each rank start.
                    group.bind_next_op(op.op_id)
                await op.run(group)
            except Exception as exc:
                await self._fail_with_reason(exc, op)
                raise
            self._complete(op)

    async def _complete_p2p(self, op: _Op, posted: Awaitable[None]) -> None:
        """Complete a posted point-to-point call within the group's timeout; one that cannot
        complete in it (its peer never sends, or never receives) fails the group naming the
        call and the peer."""
        # A monitored barrier bounds its waits by its own timeout, which may be the longer.
        seconds = math.inf if op.own_verdict else self.options.timeout_seconds
        try:
            with trio.fail_after(seconds):
                await posted
        except trio.TooSlowError:
            failure = _p2p_timeout(self, op)
            self._fail(failure, op)
            raise failure from None
        except MonitoredBarrierError as exc:
            if not op.own_verdict:
                raise
            self._complete(op, exc)
            return
        except Exception as exc:
            await self._fail_with_reason(exc, op)
            raise
        self._complete(op)

    async def _fail_with_reason(self, exc: BaseException, op: _Op) -> None:
        """`_fail` for a call's data-plane failure (a peer gone), which usually has the
        coordinator's reason a moment later (the peer's link closed, or its heartbeats
        stopped): wait for it briefly first, so the error names the rank and not only a
        closed socket."""
        client = self.client
        if client is not None:
            with trio.move_on_after(min(2.0, self.options.heartbeat_deadline)):
                await client.done.wait()
        self._fail(exc, op)

    async def _finish(self, client: CoordinatorClient) -> None:
        """Tell the coordinator this rank is done (ending the step in flight first, if it ran
        collectives); wait (bounded) for the run's end, so rank 0's coordinator outlives every
        member's last message."""
        with trio.move_on_after(min(self.options.timeout_seconds, 30.0)):
            if self.step > 0:
                await client.wait_commit(self.step - 1)
            if self._bucket:  # a step with no DDP state in it: the digest of nothing
                empty = StateDigest(None, [])
                await client.digest(self.step, empty.digest, empty.packed, names=())
                await client.wait_commit(self.step)
                self.step += 1
            await client.finished(self.step, None)
            await client.done.wait()
        if self._scope is not None:
            self._scope.cancel()

    # ------------------------------------------------------------------ failure

    def _fail(
        self, exc: BaseException, op: _Op | None = None, *, from_coordinator: bool = False
    ) -> None:
        """Remember why the group broke, and complete ``op`` and every call still pending
        with it; from now on every submission fails at once. ``from_coordinator``: ``exc``
        ended the link to the coordinator."""
        if self._failure is None:
            self._failure = _as_backend_error(self, exc, op, from_coordinator)
            if self.inner is not None:
                self.inner.abort()
        for pending in (
            [op, *self._pending.values()] if op is not None else [*self._pending.values()]
        ):
            if pending is not None:
                self._complete(pending, self._failure)

    def _complete(self, op: _Op, error: BaseException | None = None) -> None:
        """Complete ``op``'s future: its result, or ``error``. A call made inside a backward
        pass (a torch DDP bucket) is completed with its tensors even on an error: torch's
        reducer cannot take a failed future from a Python process group (the process
        crashes), so the error is raised instead by the next call into the group and by the
        next optimizer step (`paramsync.actors.torch_backend.proof`), before any gradient is
        applied."""
        self._pending.pop(id(op), None)
        if op.future.done():
            return
        if error is None or op.in_backward:
            op.future.set_result(op.result)
        else:
            op.future.set_exception(error)

    # ------------------------------------------------------------------ from torch's threads

    def submit(self, op: _Op) -> torch.futures.Future[Any]:
        """Queue ``op`` after everything submitted before it; its future completes when it
        ran (or fails with the group's error)."""
        op.in_backward = torch._C._current_graph_task_id() >= 0
        self._put(op)
        return op.future

    def end_step(self, digest: StateDigest) -> None:
        """The optimizer step of the group's step in flight is done: report ``digest``."""
        self._put(_StepEnd(digest))

    def _put(self, item: Any) -> None:
        """Hand ``item`` to the loop. Items wait in a queue that one wake-up of the loop
        drains whole, so a burst of calls (a backward's buckets) wakes it once; a step's end
        wakes nobody and leaves with the next call (or the close), in order."""
        op = item if isinstance(item, _Op) else None
        if self._failure is not None or self._send is None:
            if op is not None:
                self._complete(op, self._failure or BackendError(f"group {self.name} is not open"))
            return
        self._inbox.append(item)
        if isinstance(item, _StepEnd):
            return
        with self._inbox_lock:
            if self._drain_due:
                return
            self._drain_due = True
        try:
            self.loop.call_soon(self._drain)
        except RuntimeError as exc:  # the loop is gone
            if op is not None:
                self._complete(op, BackendError(f"group {self.name}: {exc}"))

    def _drain(self) -> None:
        """In the loop: move every queued item to the executor, in order."""
        with self._inbox_lock:
            self._drain_due = False
        send = self._send
        assert send is not None
        while self._inbox:
            item = self._inbox.popleft()
            op = item if isinstance(item, _Op) else None
            if self._failure is not None:
                if op is not None:
                    self._complete(op, self._failure)
                continue
            try:
                send.send_nowait(item)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                if op is not None:
                    self._complete(op, BackendError(f"group {self.name} is closed"))
                continue
            if op is not None:
                self._pending[id(op)] = op

    def close(self) -> None:
        """Finish this rank's part of the run (waits, bounded, for the others)."""
        if self._closed.is_set() or self._send is None:
            return
        if self._failure is not None:
            if self._scope is not None:
                self.loop.call_soon(self._scope.cancel)
            return
        closing = _Close()
        self._put(closing)
        closing.done.wait(timeout=min(self.options.timeout_seconds, 30.0) + 5.0)
        self._closed.wait(timeout=10.0)

    @property
    def failure(self) -> BaseException | None:
        return self._failure


async def _nothing(group: Transport) -> None:
    return None


def _done_future() -> torch.futures.Future[Any]:
    future: torch.futures.Future[Any] = torch.futures.Future()
    return future


def _p2p_timeout(session: GroupSession, op: _Op) -> BackendError:
    """The error of a point-to-point call that did not complete within the group's timeout:
    the call, and the peer that did not do its part."""
    peer = op.call.detail.split()[1] if op.call.detail else "?"
    missing = (
        f"rank {peer} sent it nothing"
        if op.call.op == "recv"
        else f"rank {peer} did not receive it"
    )
    return BackendError(
        f"paramsync group {session.name}, rank {session.rank}: {op.call} did not complete "
        f"within the group's timeout of {session.options.timeout_seconds:g} s ({missing})"
    )


def _as_backend_error(
    session: GroupSession, exc: BaseException, op: _Op | None, from_coordinator: bool = False
) -> BackendError:
    """One line for a broken group: the coordinator's reason when it gave one."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    client = session.client
    reason = None
    if client is not None and client.protocol.ended and client.failure is not None:
        reason = str(client.failure)
    where = ""
    if op is not None:
        where = f" in {op.call}" if op.p2p else f" in {op.call} (step {op.step}, call {op.bucket})"
    if reason:
        ranks = list(session.global_ranks)
        if ranks != list(range(len(ranks))):  # a subgroup: its ranks are not the global ones
            reason += f" (the group's ranks {list(range(len(ranks)))} are global ranks {ranks})"
        return BackendError(f"paramsync group {session.name}, rank {session.rank}{where}: {reason}")
    if isinstance(exc, CoordinatorLost) or (from_coordinator and isinstance(exc, PeerClosed)):
        layout = session.layout
        host = "paramsync launch" if session.launched else "rank 0"
        what = "the group's coordinator"
        if layout is not None:  # the tree: this rank's link is to its host's sub-coordinator
            host = f"rank {layout.ranks[0]}"
            what = f"the sub-coordinator of host {layout.name!r} (ranks {list(layout.ranks)})"
        if session.coordinator_address is not None:  # where it ran: a host lost with it
            host += f" (host {plain_or_quoted(session.coordinator_address[0])})"
        return BackendError(
            f"paramsync group {session.name}, rank {session.rank}{where}: {host}, which hosts "
            f"{what}, is gone ({exc})"
        )
    if isinstance(exc, ConfigError | BackendError):
        return BackendError(str(exc))
    text = str(exc) or type(exc).__name__
    return BackendError(
        f"paramsync group {session.name}, rank {session.rank}{where}: {type(exc).__name__}: {text}"
    )
