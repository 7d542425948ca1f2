"""The worker's side of the control link: join, negotiate buckets, report digests, heartbeat.

One task reads the coordinator's messages and routes them: go to the gradient-comm actor (in
the coordinator's order), commits to whoever waits for them, shutdown and abort as errors that
name the coordinator's reason. Another sends heartbeats. Both live in the nursery of whoever
runs `CoordinatorClient.serve`.

The coordinator sends heartbeats too. A link that breaks or stays silent past the heartbeat
deadline means the coordinator is gone; with a ``reconnect`` function the client then holds the
trainer (the step in flight is dropped, the state kept), redials with backoff and rejoins with
the step and digest it holds, so a restarted coordinator resumes the run where every worker
can follow.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import trio

from runtime.coordinator.core import (
    AbortRun,
    Apply,
    Commit,
    Go,
    Hold,
    JoinRefused,
    Message,
    ResyncOrder,
    Shutdown,
    Signature,
    StartRun,
    message_from_wire,
)
from runtime.errors import ParamsyncError, PeerClosed, ProtocolError
from runtime.protocol.wire import validate_message
from runtime.transport.link import Link

__all__ = ["CoordinatorClient", "CoordinatorLost", "RunAborted", "Go", "JoinResult", "Redial"]

log = logging.getLogger("paramsync.worker")


class RunAborted(ParamsyncError):
    """The coordinator stopped the run; the message carries its reason."""


class CoordinatorLost(PeerClosed):
    """The coordinator's link broke or stayed silent past the heartbeat deadline."""


Redial = Callable[[], Awaitable[Link]]
"""Opens a fresh, authenticated link to the coordinator (which may have restarted)."""

ResumePoint = Callable[[], Awaitable[tuple[int, bytes]]]
"""Waits until the trainer holds still; returns its next step and its state digest."""


@dataclass(frozen=True)
class JoinResult:
    """What the coordinator answered to a join: everyone's data-plane address, the step."""

    addresses: list[tuple[str, int]]
    step: int
    start: StartRun


class CoordinatorClient:
    """A worker's conversation with the coordinator over one `Link`."""

    def __init__(
        self,
        link: Link,
        rank: int,
        heartbeat_seconds: float = 0.1,
        *,
        redial: Redial | None = None,
        reconnect_seconds: float = 60.0,
    ) -> None:
        self.link = link
        self.rank = rank
        self.heartbeat_seconds = heartbeat_seconds
        self.redial = redial
        """Reconnects to a coordinator that was lost (None: losing it ends the run)."""
        self.reconnect_seconds = reconnect_seconds
        """How long to keep redialing a lost coordinator before giving up."""
        self.resume_point: ResumePoint | None = None
        """Set by the trainer: what to rejoin with after the coordinator was lost."""
        self.reconnects = 0
        """How many times this worker rejoined a lost (restarted) coordinator."""
        self._signature: Signature = ()
        self._address: tuple[str, int] = ("", 0)
        self.fold = False
        """Whether this worker offered, at its join, to fold cached bucket reports."""
        self._folded: dict[tuple[int, int], str] = {}
        """(epoch, step) -> the agreement its buckets were reduced under without a report."""
        self._connected = trio.Event()
        self._connected.set()
        self.on_go: Callable[[Go], Awaitable[None]] | None = None
        self.on_resync: Callable[[ResyncOrder], Awaitable[None]] | None = None
        self.on_epoch: Callable[[StartRun | Hold], None] | None = None
        """Called (synchronously, in order) with every later epoch's start and every hold."""
        self.digest_interval = 1
        self.start_step = 0
        self.start: StartRun | None = None
        self.epoch = 0
        """The newest epoch the coordinator announced; messages of older ones are dropped."""
        self.shutdown_reason: str | None = None
        self.done = trio.Event()
        self._committed = -1
        self._applied = -1
        self._commit_changed = trio.Event()
        self._failure: BaseException | None = None
        self._deferring = 0
        """How many `reads_deferred` blocks are open (reads wait while any is)."""
        self._reads_resumed = trio.Event()
        self._read_wait: trio.CancelScope | None = None
        """The reader's wait for the coordinator's next bytes: cancelled to defer reads."""

    @contextmanager
    def reads_deferred(self) -> Iterator[None]:
        """Leave the coordinator's messages unread during the block; they are read when it
        ends.

        For a worker's forward and backward once its epoch has agreed every bucket: nothing
        in them waits for the coordinator, while reading a message there (a commit, which
        arrives mid-compute) wakes the event loop, whose Python then takes the GIL from the
        compute thread. Read after the compute, the commit is already waiting in the socket
        and costs no wake-up of its own. Heartbeats still leave on time; a link that cannot
        tell whether bytes wait (TLS) is read as before."""
        self._deferring += 1
        if self._read_wait is not None:
            self._read_wait.cancel()
        try:
            yield
        finally:
            self._deferring -= 1
            if not self._deferring:
                self._reads_resumed.set()
                self._reads_resumed = trio.Event()

    async def join(
        self,
        signature: Signature,
        address: tuple[str, int],
        *,
        step: int = 0,
        digest: bytes = b"",
        epoch: int = 0,
        fold: bool | None = None,
    ) -> JoinResult:
        """Send this worker's model signature and data-plane address; wait for the start.

        ``step``, ``digest`` and ``epoch`` describe the state a resuming worker holds (a
        checkpoint, or a coordinator that restarted); a fresh worker sends the defaults.
        ``fold``: offer to fold response-cache reports into step reports (the trainer does,
        with its response cache on); None keeps the last join's offer.
        """
        self._signature, self._address = signature, address
        if fold is not None:
            self.fold = fold
        params = [[name, list(shape), dtype, grad] for name, shape, dtype, grad in signature]
        fields: dict[str, Any] = {
            "host": address[0],
            "port": address[1],
            "params": params,
            "step": step,
            "digest": digest,
            "epoch": epoch,
        }
        if self.fold:
            fields["fold"] = True
        await self.link.send("join", fields)
        # Heartbeats flow from the join on: waiting for slow peers is not silence.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._heartbeats, True)
            message = await self._receive(math.inf)
            nursery.cancel_scope.cancel()
        if isinstance(message, JoinRefused | AbortRun | Shutdown):
            raise RunAborted(f"coordinator refused rank {self.rank}: {message.reason}")
        if not isinstance(message, StartRun):
            raise ProtocolError(
                f"expected the run's start, got {type(message).__name__}", peer="coordinator"
            )
        self.start_step = message.step
        self.digest_interval = message.digest_interval
        # Until the start the deadline is unknown (a short interval is safe); from now on
        # four heartbeats per deadline are enough and cost the training loop nothing.
        self.heartbeat_seconds = max(self.heartbeat_seconds, message.heartbeat_deadline / 4)
        self.start = message
        self.epoch = message.epoch
        self.begin_epoch(message)
        return JoinResult(list(message.addresses), message.step, message)

    def begin_epoch(self, start: StartRun) -> None:
        """Count commits and applies afresh for ``start``'s epoch."""
        self.start = start
        self._committed = start.step - 2 if start.verify else start.step - 1
        self._applied = start.step - 1
        self._wake()

    async def _send(self, kind: str, **fields: Any) -> None:
        """Send on the live link; while the coordinator is being redialed, wait for it."""
        while True:
            await self._connected.wait()
            link = self.link
            try:
                await link.send(kind, fields)
                return
            except PeerClosed:
                if self.redial is None or self.done.is_set():
                    raise
                # The reader notices too (the link is closed under it) and reconnects.
                if link is self.link:
                    self._disconnected()
                with trio.CancelScope(shield=True):
                    await link.aclose()

    async def _receive(self, silence: float) -> Message:
        """The coordinator's next message; its heartbeats are consumed here. More than
        ``silence`` seconds without a byte means the coordinator is lost."""
        while True:
            while self._deferring:
                await self._reads_resumed.wait()
            with trio.move_on_after(silence):
                with trio.CancelScope() as self._read_wait:
                    await self.link.wait_readable()
                self._read_wait = None
                if self._deferring:
                    continue  # deferred while waiting: nothing was read
                raw = await self.link.recv()
                if raw.get("kind") != "heartbeat":
                    return message_from_wire(raw)
                validate_message(raw)
                continue
            raise CoordinatorLost(
                f"the coordinator sent nothing for {silence:g} s (heartbeat deadline)",
                peer="coordinator",
            )

    async def ready(
        self,
        step: int,
        bucket: int,
        spec: Sequence[Any] | str,
        epoch: int = 1,
        *,
        cached: bool = False,
    ) -> None:
        """Report that ``bucket`` of ``step`` is packed and waits for the coordinator's go;
        ``cached``: it does not wait, it is reduced at once under the epoch's agreed spec
        (``spec`` may then be its `spec_hash`)."""
        fields: dict[str, Any] = {
            "epoch": epoch,
            "step": step,
            "bucket": bucket,
            "spec": spec if isinstance(spec, str) else [list(item) for item in spec],
        }
        if cached:
            fields["cached"] = True
        await self._send("ready", **fields)

    def folded(self, step: int, epoch: int, agreement: str) -> None:
        """Note that ``step``'s buckets are reduced from the response cache under
        ``agreement`` without a report each: the step's first report will say so."""
        if len(self._folded) > 16:  # steps that never reported (dropped by a new epoch)
            self._folded = {k: v for k, v in self._folded.items() if k[0] == epoch}
        self._folded[(epoch, step)] = agreement

    def _fold(self, fields: dict[str, Any]) -> dict[str, Any]:
        cached = self._folded.pop((fields["epoch"], fields["step"]), None)
        if cached is not None:
            fields["cached"] = cached
        return fields

    async def reduced(self, step: int, epoch: int) -> None:
        """Report every bucket of ``step`` all-reduced here (elastic runs' apply barrier)."""
        await self._send("reduced", **self._fold({"epoch": epoch, "step": step}))

    async def digest(
        self,
        step: int,
        digest: bytes,
        tensors: list[tuple[str, bytes]] | bytes,
        epoch: int = 1,
        *,
        names: Sequence[str] | None = None,
    ) -> None:
        """Report the state digest after ``step``'s optimizer step. ``tensors``: the per-tensor
        digests as (name, digest) pairs, or packed (concatenated, in the order of ``names``;
        ``names`` None: those of this worker's last digest in the epoch)."""
        fields: dict[str, Any] = self._fold({"epoch": epoch, "step": step, "digest": digest})
        if isinstance(tensors, bytes):
            fields["tensors"] = tensors
            if names is not None:
                fields["names"] = list(names)
        else:
            fields["tensors"] = [[name, value] for name, value in tensors]
        await self._send("digest", **fields)

    async def step_done(self, step: int, epoch: int = 1) -> None:
        """Report ``step`` done on a step without a digest check."""
        await self._send("step_done", **self._fold({"epoch": epoch, "step": step}))

    async def finished(self, step: int, epoch: int | None = None) -> None:
        """Tell the coordinator this worker has taken its last step."""
        await self._send("finished", epoch=self.epoch if epoch is None else epoch, step=step)

    async def wait_commit(self, step: int) -> None:
        """Wait until the coordinator commits ``step`` (every rank agreed)."""
        while self._committed < step:
            if self._failure is not None:
                raise self._failure
            await self._commit_changed.wait()

    def applied(self, step: int) -> bool:
        """Whether the coordinator said apply for ``step`` in the current epoch."""
        return self._applied >= step

    async def wait_apply(self, step: int) -> None:
        """Wait until every member holds ``step``'s reduced gradients (elastic runs)."""
        while self._applied < step:
            if self._failure is not None:
                raise self._failure
            await self._commit_changed.wait()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Route the coordinator's messages and send heartbeats until shutdown; with a
        ``redial``, rejoin a lost coordinator instead of failing."""
        task_status.started()
        while True:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._heartbeats)
                    try:
                        await self._route()
                    finally:
                        nursery.cancel_scope.cancel()
                return
            except* PeerClosed as group:
                if self.redial is None or self.done.is_set():
                    raise
                lost = group.exceptions[0]
            await self._rejoin(lost)

    async def _rejoin(self, lost: BaseException) -> None:
        """Hold the trainer, then redial with backoff and rejoin with the state it holds."""
        assert self.redial is not None
        self._disconnected()
        log.warning("rank %d lost the coordinator (%s); reconnecting", self.rank, lost)
        with trio.CancelScope(shield=True):
            await self.link.aclose()
        if self.on_epoch is not None:
            self.on_epoch(Hold(self._applied + 1, self.epoch, f"coordinator lost: {lost}"))
        step, digest = (0, b"") if self.resume_point is None else await self.resume_point()
        epoch, failure, delay = self.epoch, lost, 0.05
        start: StartRun | None = None
        with trio.move_on_after(self.reconnect_seconds):
            while start is None:
                try:
                    self.link = await self.redial()
                    joined = await self.join(
                        self._signature, self._address, step=step, digest=digest, epoch=epoch
                    )
                    start = joined.start
                except (OSError, ProtocolError) as exc:  # down, busy, or cut off again
                    failure = exc
                    log.info("rank %d: the coordinator is not back yet (%s)", self.rank, exc)
                    with trio.CancelScope(shield=True):
                        await self.link.aclose()
                    await trio.sleep(delay)
                    delay = min(2 * delay, 1.0)
        if start is None:
            raise CoordinatorLost(
                f"the coordinator did not come back within {self.reconnect_seconds:g} s "
                f"(last: {failure})",
                peer="coordinator",
            ) from failure
        if start.epoch <= epoch:
            raise ProtocolError(
                f"the restarted coordinator opened epoch {start.epoch}, not after {epoch}",
                peer="coordinator",
            )
        self.reconnects += 1
        self._connected.set()
        log.warning(
            "rank %d rejoined the coordinator: epoch %d at step %d",
            self.rank,
            start.epoch,
            start.step,
        )
        if self.on_epoch is not None:
            self.on_epoch(start)

    def _disconnected(self) -> None:
        """Make senders wait for the next link (one event for all of them)."""
        if self._connected.is_set():
            self._connected = trio.Event()

    async def _route(self) -> None:
        silence = self.start.heartbeat_deadline if self.start is not None else math.inf
        while True:
            message = await self._receive(silence)
            if isinstance(message, Go):
                if message.epoch != self.epoch:
                    continue  # raced a membership change
                if self.on_go is None:
                    raise ProtocolError("go before the trainer started", peer="coordinator")
                await self.on_go(message)
            elif isinstance(message, Commit):
                if message.epoch == self.epoch:
                    self._committed = max(self._committed, message.step)
                    self._wake()
            elif isinstance(message, Apply):
                if message.epoch == self.epoch:
                    self._applied = max(self._applied, message.step)
                    self._wake()
            elif isinstance(message, StartRun | Hold):
                if message.epoch <= self.epoch:
                    raise ProtocolError(
                        f"epoch {message.epoch} announced after epoch {self.epoch}",
                        peer="coordinator",
                    )
                self.epoch = message.epoch
                if self.on_epoch is None:
                    raise ProtocolError(
                        "a new epoch before the trainer started", peer="coordinator"
                    )
                self.on_epoch(message)
            elif isinstance(message, Shutdown):
                self.done.set()
                self.shutdown_reason = message.reason
                if message.reason != "finished":
                    self._failure = RunAborted(f"coordinator ended the run: {message.reason}")
                    self._wake()
                    raise self._failure
                self._wake()
                return
            elif isinstance(message, AbortRun | JoinRefused):
                self._failure = RunAborted(f"coordinator stopped the run: {message.reason}")
                self._wake()
                self.done.set()
                raise self._failure
            elif isinstance(message, ResyncOrder) and self.on_resync is not None:
                await self.on_resync(message)
            else:
                raise ProtocolError(
                    f"unexpected {type(message).__name__} during the run", peer="coordinator"
                )

    def _wake(self) -> None:
        self._commit_changed.set()
        self._commit_changed = trio.Event()

    async def _heartbeats(self, wait_first: bool = False) -> None:
        if wait_first:
            await trio.sleep(self.heartbeat_seconds)
        while True:
            await self._send("heartbeat")
            await trio.sleep(self.heartbeat_seconds)
