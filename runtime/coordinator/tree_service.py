"""The coordinator tree's trio shells: `SubCoordinator`, a host's sub-coordinator, and
`RootCoordinator`, the root that sees hosts.

Both are the flat coordinator's shell (`paramsync.runtime.coordinator.service.Coordinator`:
authenticated links, join deadlines and frame caps, an outbox and heartbeats per peer, stalled
peers dropped) around a driver of the tree's sans-I/O cores:

* a `SubCoordinator` listens for its host's workers, which speak the worker protocol and cannot
  tell it from the flat coordinator; it feeds their reports to its `host_fold.HostFold`
  (through `host_driver.HostDriver`), holds one authenticated link to the root (dialled once
  every worker of the host joined), sends the host reports up it with a heartbeat every
  fraction of the heartbeat deadline, and hands the root's answers to its fold, which fans
  them out. The root's link closing, failing, or falling silent past the deadline (once the
  root has spoken) ends the run on the host (`tree_events.RootLost`);
* a `RootCoordinator` listens for the hosts' sub-coordinators (group `host_group(group)`,
  each authenticated with its host index as its rank) and feeds `root_core.RootCore` through
  `root_driver.RootDriver`: a host link closed, failed or silent past the deadline is a lost
  host.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import trio

from paramsync.runtime.coordinator.events import Refuse
from paramsync.runtime.coordinator.frame_caps import member_frame_cap
from paramsync.runtime.coordinator.host_driver import HostDriver
from paramsync.runtime.coordinator.host_fold import HostFold
from paramsync.runtime.coordinator.root_core import RootCore
from paramsync.runtime.coordinator.root_driver import RootDriver
from paramsync.runtime.coordinator.run_state import RunState
from paramsync.runtime.coordinator.service import Coordinator, CoordinatorOptions, RunFailed
from paramsync.runtime.coordinator.tree_events import FromRoot, RootLost, Up
from paramsync.runtime.errors import HandshakeError, PeerClosed, ProtocolError, one_line
from paramsync.runtime.observe.metrics import Metrics
from paramsync.runtime.protocol.handshake import Identity, load_secret
from paramsync.runtime.protocol.messages import (
    ROOT_KINDS,
    Heartbeat,
    HostJoined,
    HostReport,
    host_event_from_wire,
    root_message_from_wire,
)
from paramsync.runtime.protocol.wire import DEFAULT_MAX_FRAME
from paramsync.runtime.transport.link import Link
from paramsync.runtime.transport.tcp import DEFAULT_GROUP, dial_with_retry
from paramsync.runtime.transport.tls import TlsConfig

__all__ = ["RootCoordinator", "SubCoordinator", "host_group", "dial_root"]

log = logging.getLogger("paramsync.coordinator")

_UP_QUEUE = 1024
_FROM_ROOT_KINDS = frozenset({*ROOT_KINDS, Heartbeat.KIND})
ROOT_DIAL_SECONDS = 60.0
"""How long a sub-coordinator dials the root before it gives up on the run."""


def host_group(group: str) -> str:
    """The handshake group of the links from the hosts to the root of run group ``group``: a
    worker that dials the root by mistake is refused (its group is the run's)."""
    return f"{group}/hosts"


async def dial_root(
    root: tuple[str, int], key: bytes, me: Identity, *, tls: TlsConfig | None = None
) -> Link:
    """A sub-coordinator's link to the root at ``root`` (dialing for up to
    `ROOT_DIAL_SECONDS`). A coordinator there that refuses the hosts' group is a flat one
    (``paramsync coordinator`` without ``--tree root``): the refusal says so, and what to
    start instead."""
    try:
        with trio.fail_after(ROOT_DIAL_SECONDS):
            conn, _ = await dial_with_retry(root, key, me, tls=tls)
    except HandshakeError as exc:
        if f"group {me.group!r} does not match" not in str(exc):
            raise
        raise HandshakeError(
            f"{exc} (the coordinator at {root[0]}:{root[1]} is a flat one, not the coordinator "
            "tree's root: start it with `paramsync coordinator --tree root`, or launch the "
            "nodes with --coordinator-kind flat)"
        ) from None
    conn.tensors = False
    return conn


def _heartbeat_period(deadline: float) -> float:
    return max(0.05, deadline / 4)


class SubCoordinator(Coordinator):
    """The sub-coordinator of host ``name`` (the root's index ``index``), whose workers are
    the world ranks ``ranks`` of a run of ``world_size``; ``options`` as the flat
    coordinator's (``min_workers`` below ``world_size``: an elastic run, ``heartbeat_deadline``
    for the workers and the root's link); ``root_name``: the root as its loss is told to the
    workers (e.g. the torch rank that runs it)."""

    def __init__(
        self,
        world_size: int,
        name: str,
        index: int,
        ranks: Sequence[int],
        options: CoordinatorOptions | None = None,
        *,
        secret: bytes | str | None = None,
        group: str = DEFAULT_GROUP,
        metrics: Metrics | None = None,
        root_name: str = "the root coordinator",
    ) -> None:
        options = options or CoordinatorOptions()
        elastic = options.min_workers is not None and options.min_workers < world_size
        fold = HostFold(
            name,
            index,
            ranks,
            world_size=world_size,
            elastic=elastic,
            by_spec=options.cache_by_spec,
            root_name=root_name,
        )
        self.driver = HostDriver(
            fold,
            heartbeat_deadline=options.heartbeat_deadline,
            stall_seconds=options.stall_seconds,
        )
        super().__init__(
            world_size, options, secret=secret, group=group, metrics=metrics, core=self.driver
        )
        self.name = name
        self.index = index
        self._up_send, self._up_receive = trio.open_memory_channel[HostReport](_UP_QUEUE)
        self._root_lost = False

    # ------------------------------------------------------------------ serving

    async def serve_links(  # type: ignore[override]
        self, links: Mapping[int, Link], *, root: Link
    ) -> None:
        """Serve in-process worker ``links`` (one per rank) with the link to the root already
        connected; returns when the run ends (RunFailed if it was aborted here)."""

        async def connected() -> Link:
            return root

        await self._with_uplink(connected, super().serve_links, links)

    async def serve_tcp(  # type: ignore[override]
        self,
        host: str,
        port: int,
        *,
        root: tuple[str, int],
        tls: TlsConfig | None = None,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen at host:port for this host's workers and dial the root at ``root`` (retrying
        for up to `ROOT_DIAL_SECONDS`); run until the run ends."""
        key = load_secret(self._secret)
        me = Identity(host_group(self.group), self.world_size, self.index)

        async def connect() -> Link:
            return await dial_root(root, key, me, tls=tls)

        await self._with_uplink(
            connect, super().serve_tcp, host, port, tls=tls, task_status=task_status
        )

    async def _with_uplink(
        self,
        connect: Callable[[], Awaitable[Link]],
        serve: Callable[..., Awaitable[None]],
        *args: Any,
        **kw: Any,
    ) -> None:
        """Run ``serve(*args, **kw)`` (the workers' side) beside the root's link; its
        `RunFailed` is raised as it is, not in a group."""
        failed: RunFailed | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._uplink, connect)
            try:
                await serve(*args, **kw)
            except RunFailed as exc:
                failed = exc
            nursery.cancel_scope.cancel()
        if failed is not None:
            raise failed

    # ------------------------------------------------------------------ the root's link

    async def _uplink(self, connect: Callable[[], Awaitable[Link]]) -> None:
        """Dial the root once the host has its first report (its join: every worker joined,
        so the root's join deadline runs from a join that is ready), then carry the reports
        up and the root's answers down."""
        first = await self._up_receive.receive()
        try:
            link = await connect()
        except (OSError, ProtocolError, trio.TooSlowError) as exc:
            self._lose_root(f"cannot reach it: {one_line(exc)}")
            return
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._up_writer, link, first)
                await self._down_reader(link)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await link.aclose()

    async def _down_reader(self, link: Link) -> None:
        """The root's messages, to the fold. Before the root's first message (the start)
        it may stay quiet for as long as the other hosts take to join; after it, silence
        past the heartbeat deadline loses the root."""
        deadline = self.options.heartbeat_deadline
        wait = math.inf
        while not self.finished.is_set():
            try:
                with trio.move_on_after(wait) as waiting:
                    item = await link.recv(DEFAULT_MAX_FRAME, kinds=_FROM_ROOT_KINDS)
                if waiting.cancelled_caught:
                    self._lose_root(f"no message from it for {deadline:g} s (heartbeat deadline)")
                    return
                wait = deadline
                if item["kind"] == Heartbeat.KIND:
                    continue
                message = root_message_from_wire(item, peer="the root")
            except (PeerClosed, ProtocolError) as exc:
                self._lose_root(one_line(exc))
                return
            self._apply(self.core.handle(FromRoot(message)))

    async def _up_writer(self, link: Link, first: HostReport) -> None:
        """Send the host reports as the fold makes them (``first`` first), and a heartbeat
        whenever a heartbeat period passed since the last one (reports or not: the root's
        deadline counts only heartbeats)."""
        period = _heartbeat_period(self.options.heartbeat_deadline)
        beat_at = trio.current_time() + period
        message: HostReport | None = first
        while True:
            if message is None:
                with trio.move_on_at(beat_at):
                    message = await self._up_receive.receive()
            try:
                if message is not None:
                    await link.send(*message.to_wire())
                if trio.current_time() >= beat_at:
                    await link.send(Heartbeat.KIND, {})
                    beat_at = trio.current_time() + period
            except PeerClosed as exc:
                self._lose_root(one_line(exc))
                return
            message = None

    def _lose_root(self, reason: str) -> None:
        if self._root_lost or self.finished.is_set():
            return
        self._root_lost = True
        log.error("host %r lost the root coordinator: %s", self.name, reason)
        self._apply(self.core.handle(RootLost(reason)))

    # ------------------------------------------------------------------ actions

    def _apply(self, actions: Sequence[object], source: int | None = None) -> bool:
        """The flat shell's actions, and the fold's own: a report for the root, and the
        root's refusal of the host (each of its workers is refused)."""
        refused = False
        for action in actions:
            if isinstance(action, Up):
                try:
                    self._up_send.send_nowait(action.message)
                except trio.WouldBlock:
                    self._lose_root(f"it stopped reading ({_UP_QUEUE} reports queued)")
            elif isinstance(action, Refuse) and source is None:
                member = self._members.pop(action.rank, None)
                if member is not None:
                    member.drop(action.message)
            else:
                refused = super()._apply([action], source) or refused
        done = self.core.view.state in (RunState.FINISHED, RunState.ABORTED)
        if done and not self.finished.is_set():
            self._finish()
        return refused


class RootCoordinator(Coordinator):
    """The root of a run of ``world_size`` workers on hosts; ``options`` as the flat
    coordinator's (``digest_interval``, ``heartbeat_deadline``, ``start_step``,
    ``min_workers``, ``run_id``). Its peers are the hosts' sub-coordinators."""

    PEER = "host"
    JOIN_KIND = HostJoined
    JOINING_KINDS = frozenset({HostJoined.KIND, Heartbeat.KIND})

    def __init__(
        self,
        world_size: int,
        options: CoordinatorOptions | None = None,
        *,
        secret: bytes | str | None = None,
        group: str = DEFAULT_GROUP,
        metrics: Metrics | None = None,
    ) -> None:
        options = options or CoordinatorOptions()
        self.driver = RootDriver(
            RootCore(
                world_size,
                digest_interval=options.digest_interval,
                heartbeat_deadline=options.heartbeat_deadline,
                start_step=options.start_step,
                min_workers=options.min_workers,
                run_id="",  # set below, once the shell chose the run's id
                by_spec=options.cache_by_spec,
                stall_seconds=options.stall_seconds,
                stall_deadline=options.stall_deadline,
                idle_stalls=options.idle_stalls,
            )
        )
        super().__init__(
            world_size,
            options,
            secret=secret,
            group=host_group(group),
            metrics=metrics,
            core=self.driver,
        )
        self.driver.root.run_id = self.run_id

    @property
    def root(self) -> RootCore:
        return self.driver.root

    def _decode(self, message: dict[str, Any], rank: int) -> object:
        """A host's message: a heartbeat, or a host report (`host_event_from_wire`)."""
        if message.get("kind") == Heartbeat.KIND:
            return Heartbeat(rank=rank, now=trio.current_time())
        return host_event_from_wire(message, host=rank)

    def _member_max_frame(self) -> int:
        """A host's frame carries up to one worker's worth per worker it runs (a digest of
        each diverged state): the flat member cap times the largest host's workers."""
        signature = self.core.view.reference_signature
        if signature is None:
            return DEFAULT_MAX_FRAME
        cap = member_frame_cap(signature, DEFAULT_MAX_FRAME) * self.driver.largest_host
        return min(DEFAULT_MAX_FRAME, cap)
