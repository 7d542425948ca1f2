"""The coordinator actor: a thin shell that moves messages for `CoordinatorCore`.

It accepts authenticated worker connections (or is handed in-process links), decodes each
message into a core event, feeds the core, and executes the actions it returns. Every member has
an outbound queue filled synchronously when the core speaks, so all members see the core's
messages in the core's order; a writer task per member drains it. A member that stops reading
until its queue is full is a stalled member, and the run stops naming it.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from paramsync.runtime.coordinator.core import CoordinatorCore
from paramsync.runtime.coordinator.events import (
    Abort,
    Broadcast,
    Disconnected,
    Evict,
    Malformed,
    Message,
    Refuse,
    Report,
    Resync,
    Send,
    Tick,
)
from paramsync.runtime.coordinator.frame_caps import (
    JOINING_KINDS,
    join_cap_refusal,
    join_frame_cap,
    member_frame_cap,
)
from paramsync.runtime.coordinator.run_state import RunState
from paramsync.runtime.coordinator.shell_core import ShellCore
from paramsync.runtime.errors import (
    FrameTooLarge,
    ParamsyncError,
    PeerClosed,
    ProtocolError,
    one_line,
)
from paramsync.runtime.observe.metrics import Metrics
from paramsync.runtime.protocol.handshake import Identity, load_secret
from paramsync.runtime.protocol.limits import kind_max_frame
from paramsync.runtime.protocol.messages import (
    Commit,
    Digest,
    Hold,
    Joined,
    Shutdown,
    Signature,
    StartRun,
    event_from_wire,
)
from paramsync.runtime.protocol.schema import WireMessage
from paramsync.runtime.protocol.wire import DEFAULT_MAX_FRAME
from paramsync.runtime.transport.admission import AdmissionGate, HandshakeTicket
from paramsync.runtime.transport.link import Link
from paramsync.runtime.transport.tcp import DEFAULT_GROUP, accept
from paramsync.runtime.transport.tls import TlsConfig

__all__ = ["Coordinator", "CoordinatorOptions", "RunFailed"]

log = logging.getLogger("paramsync.coordinator")

_QUEUE = 1024
_FLUSH_SECONDS = 5.0
_HEARTBEAT: tuple[str, dict[str, Any]] = ("heartbeat", {})
_STALL_PREFIX = "stall:"
"""How the core's `Report` of a stalled step begins (`paramsync.runtime.coordinator.clock`)."""


class RunFailed(ParamsyncError):
    """The coordinator aborted the run; the message is the core's reason."""


MAX_RUN_ID = 128
"""The longest run id a ``start_run`` carries."""


@dataclass(frozen=True)
class CoordinatorOptions:
    """How the coordinator checks the run."""

    digest_interval: int = 1
    resync: bool = False
    heartbeat_deadline: float = 10.0
    start_step: int = 0
    min_workers: int | None = None
    """Elastic runs: keep training while at least this many workers remain (None: all)."""
    rejoin_seconds: float = 60.0
    """Below min_workers, wait this long for joiners before stopping the run."""
    rendezvous_seconds: float = 5.0
    """Elastic runs: start with min_workers or more once nobody joined for this long."""
    stall_seconds: float = 60.0
    """Report what a step waits for (ranks and phase) after this long without progress."""
    stall_deadline: float | None = None
    """Then drop the stalled ranks (elastic) or stop the run (None: report only)."""
    cache_by_spec: bool = False
    """A cached bucket report may name any spec the members agreed on in the epoch, not only
    the one agreed at its bucket: for callers whose calls do not repeat at the same place
    every step (a torch.distributed group, `paramsync.actors.torch_backend`). The members' reports
    are compared either way; a trainer keeps the stricter rule."""
    idle_stalls: bool = True
    """Whether a step in which no member has reported anything counts towards a stall. A
    torch.distributed group may sit idle between calls for as long as its program likes; only
    a call some members made and others did not is a stall there."""
    run_id: str | None = None
    """The run's id, sent to every worker in each ``start_run`` (workers record it in their
    checkpoints). None: a random one, chosen when the coordinator is made; never derived from
    the secret."""


class _Member:
    def __init__(self, rank: int, link: Link) -> None:
        self.rank = rank
        self.link = link
        self.outbox_send, self.outbox = trio.open_memory_channel[Message | None](_QUEUE)
        self.flushed = trio.Event()
        self.evicted = False
        self.reading = trio.CancelScope()
        """Around the member's reader: cancelled when the member is dropped, so that a
        member that sends nothing (a stalled one) does not keep its connection open."""

    def drop(self, message: Message | None = None) -> None:
        """Stop serving this member: tell it ``message`` (best effort), then close its link
        (its reader stops waiting; `Coordinator._serve_member` flushes the queue, within
        `_FLUSH_SECONDS`, and closes it)."""
        self.evicted = True
        try:
            if message is not None:
                self.outbox_send.send_nowait(message)
            self.outbox_send.send_nowait(None)
        except (trio.WouldBlock, trio.ClosedResourceError):
            pass
        self.reading.cancel()


class _RankClaim:
    """One connection's claim on a rank, made atomically when its handshake is admitted.

    The listener's ``admit`` runs once the dialer has proven the secret; the welcome is sent
    after it, and the member is registered only once the handshake returns, so between the two
    a second dialer claiming the same rank would see it free (issue 18, row 9: both were
    welcomed, the run hung). The claim reserves the rank in the same step as the check, and
    `release` frees the reservation when the handshake ends: failed, or succeeded (then the
    caller registers the member before its next checkpoint, so the rank is never free between).
    """

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator
        self.rank: int | None = None

    def admit(self, peer: Identity) -> str | None:
        """The admission policy: the rank in range, neither a member nor reserved; reserves it."""
        coordinator = self._coordinator
        if not 0 <= peer.rank < coordinator.world_size:
            return f"rank {peer.rank} is outside 0..{coordinator.world_size - 1}"
        if peer.rank in coordinator._members or peer.rank in coordinator._reserved:
            return f"rank {peer.rank} is already taken"
        coordinator._reserved.add(peer.rank)
        self.rank = peer.rank
        return None

    def release(self) -> None:
        """Free the reservation (idempotent)."""
        if self.rank is not None:
            self._coordinator._reserved.discard(self.rank)
            self.rank = None


class Coordinator:
    """Sequences one run of ``world_size`` workers around a `CoordinatorCore`."""

    PEER = "rank"
    """What the log lines call a connected peer (a worker's rank; the root: a host's index)."""
    JOIN_KIND: type[WireMessage] = Joined
    """The event whose acceptance ends a peer's join deadline."""
    JOINING_KINDS: frozenset[str] = JOINING_KINDS
    """The only kinds a peer that has not joined may send (`frame_caps.JOINING_KINDS`)."""

    def __init__(
        self,
        world_size: int,
        options: CoordinatorOptions | None = None,
        *,
        secret: bytes | str | None = None,
        group: str = DEFAULT_GROUP,
        metrics: Metrics | None = None,
        core_type: type[CoordinatorCore] = CoordinatorCore,
        core: ShellCore | None = None,
    ) -> None:
        """``core_type``: the class of the core to build, a `CoordinatorCore` or a subclass
        (the fault harness passes one that dies at a commit, `paramsync.runtime.testing.faults`).
        ``core``: a core already built to serve instead (`shell_core.ShellCore`: the coordinator
        tree's drivers, `paramsync.runtime.coordinator.tree_service`)."""
        self.options = options or CoordinatorOptions()
        self.run_id = self.options.run_id or secrets.token_hex(8)
        """This run's id: the options', else a random one (never derived from the secret)."""
        if len(self.run_id) > MAX_RUN_ID:
            raise ValueError(f"a run id has at most {MAX_RUN_ID} characters, got {self.run_id!r}")
        self.metrics = metrics
        """Fed as the run goes (`paramsync.runtime.observe.metrics`; None: off). Serve its registry
        with `paramsync.runtime.observe.metrics.serve_metrics`."""
        self._last_commit_at: float | None = None
        self.core: ShellCore = core or core_type(
            world_size,
            digest_interval=self.options.digest_interval,
            resync=self.options.resync,
            heartbeat_deadline=self.options.heartbeat_deadline,
            start_step=self.options.start_step,
            min_workers=self.options.min_workers,
            rejoin_seconds=self.options.rejoin_seconds,
            rendezvous_seconds=self.options.rendezvous_seconds,
            stall_seconds=self.options.stall_seconds,
            stall_deadline=self.options.stall_deadline,
            cache_by_spec=self.options.cache_by_spec,
            idle_stalls=self.options.idle_stalls,
            run_id=self.run_id,
        )
        self.world_size = world_size
        self.group = group
        self._frame_cap: tuple[Signature, int] | None = None
        """(the reference signature, the largest frame a member may send for it)."""
        self._secret = secret
        self._members: dict[int, _Member] = {}
        self._reserved: set[int] = set()
        """Ranks granted to a handshake that has not yet become a member (`_RankClaim`)."""
        self._active = 0
        self._all_ended = trio.Event()
        self.finished = trio.Event()
        self._stop_reason: str | None = None
        self._stop_deadline: float | None = None
        self.bound_address: tuple[str, int] | None = None
        self.hostile_refused = 0
        self.admission = AdmissionGate("coordinator")
        """Caps pending handshakes and sets their deadline (replace its ``limits`` to tune)."""

    finished: trio.Event
    """Set when the run is over, whichever way."""

    @property
    def state(self) -> RunState:
        """The run's state, as the core sees it."""
        return self.core.view.state

    # ------------------------------------------------------------------ serving

    async def serve_links(self, links: Mapping[int, Link]) -> None:
        """Run with already-connected in-process links, one per rank; returns when the run ends.

        Raises RunFailed with the core's reason if the run was aborted.
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._ticker)
            for rank, link in links.items():
                nursery.start_soon(self._serve_member, rank, link)
            await self._wind_down()
            nursery.cancel_scope.cancel()
        self._raise_if_aborted()

    async def _wind_down(self) -> None:
        """Wait for the run's end, then briefly for members to read their last message."""
        await self.finished.wait()
        with trio.move_on_after(_FLUSH_SECONDS):
            while self._active:
                await self._all_ended.wait()

    async def serve_tcp(
        self,
        host: str,
        port: int,
        *,
        tls: TlsConfig | None = None,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen at host:port, admit authenticated workers and run until the run ends.

        ``task_status.started`` receives the bound address (port 0 picks a free port). A
        connection that fails its handshake is logged and dropped; serving goes on. With
        ``tls``, every worker connection is TLS (`paramsync.runtime.transport.tls`) under the
        handshake.
        """
        key = load_secret(self._secret)
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound_host, bound_port = listeners[0].socket.getsockname()[:2]
        self.bound_address = (bound_host, bound_port)
        me = Identity(self.group, self.world_size, -1)

        async def handle(stream: trio.SocketStream, ticket: HandshakeTicket) -> None:
            claim = _RankClaim(self)
            try:
                with ticket:  # deadline, pending slot; logs and counts a failure
                    conn, peer = await accept(
                        stream, key, me, claim.admit, handshake_seconds=ticket.seconds, tls=tls
                    )
            except (ProtocolError, OSError, trio.BrokenResourceError):
                self.hostile_refused += 1
                if self.metrics is not None:
                    self.metrics.refused.labels(reason="handshake").inc()
                return
            finally:
                claim.release()
            # No checkpoint between the release and _serve_member's registration of the rank.
            conn.tensors = False  # no message to the coordinator holds one: it never imports torch
            await self._serve_member(peer.rank, conn, self.options.heartbeat_deadline)

        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept_loop, listener, nursery, handle)
            nursery.start_soon(self._ticker)
            task_status.started(self.bound_address)
            try:
                await self._wind_down()
            finally:
                nursery.cancel_scope.cancel()
                for listener in listeners:
                    await listener.aclose()
        self._raise_if_aborted()

    async def _accept_loop(self, listener: trio.SocketListener, nursery: Any, handle: Any) -> None:
        await self.admission.serve(listener, nursery, handle)

    def _raise_if_aborted(self) -> None:
        if self._stop_reason is not None:
            raise RunFailed(self._stop_reason)
        if self.core.view.state is RunState.ABORTED:
            raise RunFailed(self.core.view.abort_reason or "aborted")

    def stop(self, reason: str, grace_seconds: float | None = None) -> None:
        """End the run from outside (a signal) after the step in flight is committed.

        Every member is then told ``reason`` (a shutdown); if no commit comes within
        ``grace_seconds`` (default: the heartbeat deadline) the run is aborted instead.
        """
        if self.finished.is_set() or self._stop_reason is not None:
            return
        self._stop_reason = reason
        if self.core.view.state is not RunState.RUNNING:
            self._apply([Abort(reason)])
            return
        grace = self.options.heartbeat_deadline if grace_seconds is None else grace_seconds
        self._stop_deadline = trio.current_time() + grace
        log.warning(
            "stopping after the step in flight (step %d): %s", self.core.view.step, one_line(reason)
        )

    async def _ticker(self) -> None:
        period = max(0.05, min(1.0, self.options.heartbeat_deadline / 4))
        while True:
            await trio.sleep(period)
            now = trio.current_time()
            if self._stop_deadline is not None and now > self._stop_deadline:
                self._stop_deadline = None
                self._apply([Abort(f"{self._stop_reason} (the step in flight did not finish)")])
            self._apply(self.core.handle(Tick(now)))

    # ------------------------------------------------------------------ one member

    async def _serve_member(self, rank: int, link: Link, join_seconds: float = math.inf) -> None:
        """Serve one member's link; a peer that authenticated over the network must send a
        join the core accepts within ``join_seconds`` (whatever it sends before), or its
        connection is closed and its slot freed."""
        member = _Member(rank, link)
        self._members[rank] = member
        self._active += 1
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer, member)
                with member.reading:
                    await self._reader(member, join_seconds)
                # Let the writer deliver what is queued (a refusal, the abort), then stop.
                with trio.move_on_after(_FLUSH_SECONDS):
                    try:
                        member.outbox_send.send_nowait(None)
                    except (trio.WouldBlock, trio.ClosedResourceError):
                        pass
                    await member.flushed.wait()
                nursery.cancel_scope.cancel()
        finally:
            if self._members.get(rank) is member:
                del self._members[rank]
            self._active -= 1
            if not self._active:
                self._all_ended.set()
                self._all_ended = trio.Event()
            with trio.CancelScope(shield=True):
                await link.aclose()

    def _member_max_frame(self) -> int:
        """The largest frame a member may send now: the run's model's need once the
        reference model is known (`frame_caps.member_frame_cap`), else the schema's."""
        signature = self.core.view.reference_signature
        if signature is None:
            return DEFAULT_MAX_FRAME
        if self._frame_cap is None or self._frame_cap[0] is not signature:
            self._frame_cap = (signature, member_frame_cap(signature, DEFAULT_MAX_FRAME))
        return self._frame_cap[1]

    async def _reader(self, member: _Member, join_seconds: float) -> None:
        rank = member.rank
        join_by = trio.current_time() + join_seconds
        joined = False
        while True:
            try:
                if joined:  # no deadline scope per message once the member is in
                    message = await member.link.recv(self._member_max_frame())
                else:  # only what a joining peer sends, at most what a join needs
                    model = self.core.view.reference_signature
                    max_frame = join_frame_cap(model, kind_max_frame(self.JOIN_KIND.KIND))
                    with trio.CancelScope(deadline=join_by) as waiting:
                        try:
                            message = await member.link.recv(max_frame, kinds=self.JOINING_KINDS)
                        except FrameTooLarge as exc:  # from the prefix, unread
                            why = join_cap_refusal(exc.reason, max_frame, model is not None)
                            raise FrameTooLarge(why, peer=exc.peer) from None
                    if waiting.cancelled_caught:
                        log.warning(
                            "%s %d authenticated but sent no join within %g s; dropped",
                            self.PEER,
                            rank,
                            join_seconds,
                        )
                        return
                event = self._decode(message, rank)
            except PeerClosed as exc:
                if not self.finished.is_set():
                    self._apply(self.core.handle(Disconnected(rank, exc.reason)))
                return
            except ProtocolError as exc:
                log.warning("%s %d sent a bad message: %s", self.PEER, rank, one_line(exc))
                reason = exc.reason
                if not joined:
                    reason = f"{self.PEER} {rank} has not joined: {exc.reason}"
                self._apply(self.core.handle(Malformed(rank, reason)), source=rank)
                return
            log.debug("event %r", event)
            if self.metrics is not None:
                refused = self._apply(self._handle_measured(event), source=rank)
            else:
                refused = self._apply(self.core.handle(event), source=rank)
            if refused or member.evicted:
                return
            if not joined and isinstance(event, self.JOIN_KIND):
                # Only a join the core took ends the deadline: any other first frame (a
                # heartbeat) held the rank for ever (issue 31, row 5).
                joined = rank in self.core.view.joined

    def _decode(self, message: dict[str, Any], rank: int) -> object:
        """The event a peer's decoded message is (ProtocolError: it is none)."""
        return event_from_wire(message, rank=rank, now=trio.current_time())

    async def _writer(self, member: _Member) -> None:
        """Drain the member's queue; once the member has heard its first answer (the start),
        whenever the queue stays empty for a heartbeat period, send a heartbeat, so the worker
        can tell a hung or cut-off coordinator from a quiet one."""
        period = math.inf
        try:
            while True:
                kind, fields = _HEARTBEAT
                with trio.move_on_after(period):
                    message = await member.outbox.receive()
                    if message is None:
                        return
                    kind, fields = message.to_wire()
                try:
                    await member.link.send(kind, fields)
                except PeerClosed:
                    return
                period = max(0.05, self.options.heartbeat_deadline / 4)
        except trio.EndOfChannel:
            return
        finally:
            member.flushed.set()

    # ------------------------------------------------------------------ metrics

    def _handle_measured(self, event: Any) -> Sequence[object]:
        """``core.handle(event)``, feeding the metrics: the digest verdict's time (the digest
        that completes a step) and joins into a run already started (rejoins)."""
        metrics = self.metrics
        assert metrics is not None
        running = self.core.view.epoch > 0
        started = time.perf_counter()
        actions = self.core.handle(event)
        if isinstance(event, Digest) and any(
            (isinstance(a, Broadcast) and isinstance(a.message, Commit)) or isinstance(a, Abort)
            for a in actions
        ):
            metrics.digest_check_seconds.observe(time.perf_counter() - started)
        elif (
            isinstance(event, Joined)
            and running
            and not any(isinstance(a, Refuse) for a in actions)
        ):
            metrics.rejoins.inc()
        return actions

    def _observe(self, action: object) -> None:
        """Feed the metrics from one action the core asked for."""
        metrics = self.metrics
        assert metrics is not None
        if isinstance(action, Broadcast | Send):
            message = action.message
            if isinstance(message, Commit):
                now = trio.current_time()
                last, self._last_commit_at = self._last_commit_at, now
                metrics.observe_step(message.step, None if last is None else now - last)
            elif isinstance(message, StartRun):
                metrics.observe_epoch(message.epoch, len(message.members))
                self._last_commit_at = None  # the first step of an epoch has no baseline
            elif isinstance(message, Hold):
                metrics.observe_epoch(message.epoch, len(self.core.view.members))
        elif isinstance(action, Refuse):
            metrics.refused.labels(reason="join").inc()
        elif isinstance(action, Report) and action.text.startswith(_STALL_PREFIX):
            metrics.stalls.inc()

    # ------------------------------------------------------------------ actions

    def _enqueue(self, rank: int, message: Message | None) -> None:
        member = self._members.get(rank)
        if member is None:
            return
        try:
            member.outbox_send.send_nowait(message)
        except trio.WouldBlock:
            del self._members[rank]
            member.drop()  # lost to the core: its connection is closed too
            self._apply(self.core.handle(Disconnected(rank, "stopped reading (outbox full)")))
        except trio.ClosedResourceError:
            pass

    def _apply(self, actions: Sequence[object], source: int | None = None) -> bool:
        """Execute the core's actions; True when the source connection was refused."""
        refused = False
        for action in actions:
            if self.metrics is not None:
                self._observe(action)
            if isinstance(action, Send):
                self._enqueue(action.rank, action.message)
            elif isinstance(action, Broadcast):
                for rank in self.core.view.members:
                    self._enqueue(rank, action.message)
                if self.core.view.state is RunState.FINISHED:
                    self._finish()
                elif self._stop_deadline is not None and isinstance(action.message, Commit):
                    self._stop_deadline = None
                    for rank in self.core.view.members:
                        self._enqueue(rank, Shutdown(self._stop_reason or "stopped"))
                    self._finish()
            elif isinstance(action, Resync):
                for rank in action.recipients:
                    self._enqueue(rank, action.message)
            elif isinstance(action, Refuse):
                log.warning("refused rank %d: %s", action.rank, one_line(action.reason))
                if source == action.rank:
                    member = self._members.pop(action.rank, None)
                    if member is not None:
                        member.outbox_send.send_nowait(action.message)
                        member.outbox_send.send_nowait(None)
                        refused = True
            elif isinstance(action, Evict):
                log.error("removed rank %d from the run: %s", action.rank, one_line(action.reason))
                member = self._members.pop(action.rank, None)
                if member is not None:
                    member.drop(action.message)  # its connection is closed (issue 31, row 6)
            elif isinstance(action, Report):
                level = getattr(logging, action.level.upper(), logging.WARNING)
                log.log(level, "%s", one_line(action.text))
            elif isinstance(action, Abort):
                log.error("run aborted: %s", one_line(action.reason))
                for rank in list(self._members):
                    self._enqueue(rank, action.message)
                self._finish()
            else:
                raise TypeError(f"not a coordinator action: {action!r}")
        return refused

    def _finish(self) -> None:
        for member in list(self._members.values()):
            try:
                member.outbox_send.send_nowait(None)
            except (trio.WouldBlock, trio.ClosedResourceError):
                pass
        self.finished.set()
