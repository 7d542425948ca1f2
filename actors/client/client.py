"""The worker's side of the control link: a trio shell over `WorkerProtocol`.

The protocol's decisions (what each coordinator message means in each phase, which epoch a
report belongs to, what a rejoin presents) live in the sans-I/O `paramsync.actors.client.protocol`.
This shell moves bytes and runs timers: one task reads the coordinator's messages and feeds
them to the protocol, executing what it returns (go to the gradient-comm actor in the
coordinator's order, commits to whoever waits for them, shutdown and abort as errors that
name the coordinator's reason); another sends heartbeats. Both live in the nursery of
whoever runs `CoordinatorClient.serve`.

The coordinator sends heartbeats too. A link that breaks or stays silent past the heartbeat
deadline means the coordinator is gone; with a ``redial`` function the client then holds the
trainer (the step in flight is dropped, the state kept), redials with exponential backoff and
jitter (`stamina`, so a restarted coordinator is not met by every worker at the same instant)
and rejoins with the step and digest it holds, so a restarted coordinator resumes the run
where every worker can follow.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import stamina
import trio

from paramsync.actors.client.events import (
    Announce,
    ConnectionLost,
    Ended,
    EnterEpoch,
    HeartbeatDue,
    HeartbeatReceived,
    Join,
    Progress,
    Received,
    ReportDigest,
    ReportFinished,
    ReportFolded,
    ReportReady,
    ReportReduced,
    ReportStepDone,
    RunGo,
    RunResync,
    Send,
    Silent,
    Started,
    Tick,
    WorkerAction,
    WorkerEvent,
)
from paramsync.actors.client.protocol import (
    EpochRegression,
    WorkerProtocol,
)
from paramsync.runtime.coordinator.commits import divergence_of
from paramsync.runtime.coordinator.events import Message
from paramsync.runtime.errors import (
    AuthenticationError,
    FrameAuthenticationError,
    InvalidKeyShare,
    ParamsyncError,
    PeerClosed,
    PeerLacksSecret,
    ProofUnanswered,
    ProtocolError,
    ReplayedHandshake,
    StateDiverged,
)
from paramsync.runtime.protocol.messages import (
    Go,
    Hold,
    MeshLayout,
    ParallelLayout,
    ResyncOrder,
    Shutdown,
    Signature,
    StartRun,
    message_from_wire,
)
from paramsync.runtime.protocol.wire import validate_message
from paramsync.runtime.transport.link import Link

__all__ = [
    "CoordinatorClient",
    "CoordinatorLost",
    "RunAborted",
    "RunDiverged",
    "Go",
    "JoinResult",
    "Redial",
    "run_aborted",
]

log = logging.getLogger("paramsync.worker")

REDIAL_FIRST_SECONDS = 0.05
"""The first redial waits this long (plus jitter), doubling up to `REDIAL_MAX_SECONDS`."""
REDIAL_MAX_SECONDS = 1.0
REDIAL_JITTER_SECONDS = 0.25
"""Up to this much random delay on each redial: workers that lost one coordinator at one
instant spread their redials instead of meeting its restart all at once."""


class RunAborted(ParamsyncError):
    """The coordinator stopped the run; the message carries its reason."""


class RunDiverged(RunAborted, StateDiverged):
    """The coordinator stopped the run because the ranks' states diverged (C-DDP-001): a
    `RunAborted` and a `StateDiverged` with the step, the ranks grouped by state (the majority,
    or the lowest rank's group, first) and the first differing tensor read from its reason."""


def run_aborted(reason: str) -> RunAborted:
    """The error a worker raises for the coordinator's abort ``reason``: a `RunDiverged` when
    the reason is a digest verdict's (`paramsync.runtime.coordinator.commits.divergence_of`)."""
    divergence = divergence_of(reason)
    if divergence is None:
        return RunAborted(reason)
    step, ranks, first_tensor = divergence
    return RunDiverged(reason, step=step, ranks=ranks, first_tensor=first_tensor)


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


def _redial_again(exc: Exception) -> bool:
    """Whether a failed redial or rejoin is worth another try: the coordinator is down, busy,
    or cut off again (not: it restarted into an epoch this worker cannot follow)."""
    if isinstance(exc, ExceptionGroup):
        return all(_redial_again(inner) for inner in exc.exceptions)
    return isinstance(exc, OSError | ProtocolError) and not isinstance(
        exc, EpochRegression | PeerLacksSecret
    )


def failed_authentication(exc: BaseException) -> bool:
    """Whether a failed redial means the listener failed authentication: it had this worker's
    proof and then failed its own, refused this worker's, or gave none back (closed, went
    silent, answered out of protocol). An invalid key share or a refusal for admission (a rank
    still taken) is not: no proof failed."""
    if isinstance(exc, ProofUnanswered):
        return True
    return isinstance(exc, AuthenticationError) and not isinstance(
        exc, InvalidKeyShare | ReplayedHandshake | PeerLacksSecret
    )


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
        address: str = "the coordinator's address",
        host_rank: int | None = None,
    ) -> None:
        self.link = link
        self.rank = rank
        self.heartbeat_seconds = heartbeat_seconds
        self.redial = redial
        """Reconnects to a coordinator that was lost (None: losing it ends the run)."""
        self.reconnect_seconds = reconnect_seconds
        """How long to keep redialing a lost coordinator before giving up."""
        self.address = address
        """Where ``redial`` dials (HOST:PORT), as the worker's lines name it."""
        self.host_rank = host_rank
        """The rank whose process hosts the coordinator (None: a process of its own): losing
        the coordinator then means losing that rank, and the error names it."""
        self.resume_point: ResumePoint | None = None
        """Set by the trainer: what to rejoin with after the coordinator was lost."""
        self.reconnects = 0
        """How many times this worker rejoined a lost (restarted) coordinator."""
        self.protocol = WorkerProtocol(rank)
        """The conversation's state and every decision about it (sans-I/O)."""
        self.on_go: Callable[[Go], Awaitable[None]] | None = None
        self.on_resync: Callable[[ResyncOrder], Awaitable[None]] | None = None
        self.on_epoch: Callable[[StartRun | Hold], None] | None = None
        """Called (synchronously, in order) with every later epoch's start and every hold."""
        self.shutdown_reason: str | None = None
        self.done = trio.Event()
        self._commit_changed = trio.Event()
        self._failure: BaseException | None = None
        self._redial_failure: BaseException | None = None
        """Why the last redial or rejoin of a lost coordinator failed."""
        self._deferring = 0
        """How many `reads_deferred` blocks are open (reads wait while any is)."""
        self._reads_resumed = trio.Event()
        self._read_wait: trio.CancelScope | None = None
        """The reader's wait for the coordinator's next bytes: cancelled to defer reads."""

    # ------------------------------------------------------------------- protocol state

    @property
    def failure(self) -> BaseException | None:
        """Why the run ended for this worker (the coordinator's abort, a refusal), if it
        ended on an error."""
        return self._failure

    @property
    def epoch(self) -> int:
        """The newest epoch the coordinator announced; messages of older ones are dropped."""
        return self.protocol.epoch

    @property
    def start(self) -> StartRun | None:
        """The start of the epoch last joined or entered."""
        return self.protocol.start

    @start.setter
    def start(self, start: StartRun | None) -> None:
        self.protocol.start = start

    @property
    def fold(self) -> bool:
        """Whether this worker offered, at its join, to fold cached bucket reports."""
        return self.protocol.fold

    @fold.setter
    def fold(self, fold: bool) -> None:
        self.protocol.fold = fold

    @property
    def digest_interval(self) -> int:
        return self.protocol.digest_interval

    @property
    def layout(self) -> ParallelLayout | None:
        """This worker's 3D-parallel layout as it declared it at its join (None: a flat run)."""
        return self.protocol.layout

    @property
    def start_step(self) -> int:
        return self.protocol.start_step

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

    # ------------------------------------------------------------------- driving the core

    async def _feed(self, event: WorkerEvent, *, joining: bool = False) -> StartRun | None:
        """Feed ``event`` to the protocol and carry out what it returns."""
        return await self._run(self.protocol.handle(event), joining=joining)

    async def _send(self, action: Send) -> None:
        """Send on the live link. A link that breaks under a sender with a ``redial`` drops
        the message: the reader notices the break (the link is closed under it) and the
        protocol holds the trainer, whose step in flight is dropped with it."""
        link = self.link
        try:
            await link.send(*action.message.to_wire())
        except PeerClosed:
            if self.redial is None or self.protocol.ended:
                raise
            with trio.CancelScope(shield=True):
                await link.aclose()

    async def _receive(self, silence: float) -> Message | None:
        """The coordinator's next message; None for a heartbeat (fed to the protocol here).
        After ``silence`` seconds without a byte the protocol is told the time (a `Tick`),
        and says whether the coordinator is lost (`CoordinatorLost` is raised then)."""
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
                if raw.get("kind") != HeartbeatReceived.KIND:
                    return message_from_wire(raw)
                validate_message(raw)
                await self._feed(HeartbeatReceived(trio.current_time()))
                return None
            await self._feed(Tick(trio.current_time()))  # raises CoordinatorLost if silent

    async def _run(self, actions: list[WorkerAction], *, joining: bool = False) -> StartRun | None:
        """Carry out the protocol's actions in order; returns a join's start. ``joining``: a
        (re)join or a loss, where an epoch announced before the trainer listens is not news
        to anyone."""
        started: StartRun | None = None
        for action in actions:
            if isinstance(action, Send):
                await self._send(action)
            elif isinstance(action, Progress):
                self._wake()
            elif isinstance(action, Started):
                started = action.start
            elif isinstance(action, RunGo):
                if self.on_go is None:
                    raise ProtocolError("go before the trainer started", peer="coordinator")
                await self.on_go(action.go)
            elif isinstance(action, RunResync):
                if self.on_resync is None:
                    raise ProtocolError(
                        f"unexpected resync for step {action.order.step} during the run",
                        peer="coordinator",
                    )
                await self.on_resync(action.order)
            elif isinstance(action, Announce):
                if self.on_epoch is not None:
                    self.on_epoch(action.message)
                elif not joining:
                    raise ProtocolError(
                        "a new epoch before the trainer started", peer="coordinator"
                    )
            elif isinstance(action, Silent):
                raise CoordinatorLost(action.reason, peer="coordinator")
            else:
                assert isinstance(action, Ended), action
                self.done.set()
                if isinstance(action.message, Shutdown):
                    self.shutdown_reason = action.message.reason
                if action.error is not None:
                    self._failure = run_aborted(action.error)
                self._wake()
                if self._failure is not None:
                    raise self._failure
        return started

    # ------------------------------------------------------------------- the trainer's API

    async def join(
        self,
        signature: Signature,
        address: tuple[str, int],
        *,
        step: int = 0,
        digest: bytes = b"",
        epoch: int = 0,
        fold: bool | None = None,
        committed: bool | None = None,
        layout: ParallelLayout | None = None,
        mesh: MeshLayout | None = None,
        groups: Sequence[tuple[str, Sequence[int]]] | None = None,
    ) -> JoinResult:
        """Send this worker's model signature and data-plane address; wait for the start.

        ``step``, ``digest`` and ``epoch`` describe the state a resuming worker holds (a
        checkpoint, or a coordinator that restarted); a fresh worker sends the defaults.
        ``fold``: offer to fold response-cache reports into step reports (the trainer does,
        with its response cache on); None keeps the last join's offer. ``committed``: the
        state is a committed one (a checkpoint written once its step was committed); None:
        the protocol says, from the commits this client saw (a rejoin after a lost
        coordinator), which the restart's donor rule trusts over a majority.
        ``layout``: this worker's place in a 3D-parallel run (its mesh, coordinates and
        pipeline schedule digest; `paramsync.runtime.parallel.run_layout.parallel_layout` builds
        it), which the coordinator checks against every other rank's before the run starts, and by
        which it compares digests within each (tp, pp) shard only; None keeps the last join's (a
        flat data-parallel run at the first). ``mesh`` or ``groups``: the process groups this worker
        will negotiate buckets in (`ready`'s ``group``); None keeps the last's.
        """
        declared = None if groups is None else tuple((n, tuple(r)) for n, r in groups)
        join = Join(
            signature,
            address,
            step,
            digest,
            epoch,
            fold,
            mesh=None if mesh is None else (tuple(mesh[0]), tuple(mesh[1])),
            groups=declared,
            committed=committed,
            layout=layout,
        )
        await self._feed(join)
        # Heartbeats flow from the join on: waiting for slow peers is not silence.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._heartbeats, True)
            message = None
            while message is None:
                message = await self._receive(math.inf)
            nursery.cancel_scope.cancel()
        start = await self._feed(Received(message, trio.current_time()), joining=True)
        assert start is not None  # else the protocol raised: a refusal, or no start
        # Until the start the deadline is unknown (a short interval is safe); from now on
        # four heartbeats per deadline are enough and cost the training loop nothing.
        self.heartbeat_seconds = max(self.heartbeat_seconds, start.heartbeat_deadline / 4)
        return JoinResult(list(start.addresses), start.step, start)

    def begin_epoch(self, start: StartRun) -> None:
        """Count commits and applies afresh for ``start``'s epoch."""
        for action in self.protocol.handle(EnterEpoch(start)):
            assert isinstance(action, Progress), action
            self._wake()

    async def ready(
        self,
        step: int,
        bucket: int,
        spec: Sequence[Any] | str,
        epoch: int = 1,
        *,
        cached: bool = False,
        group: str = "",
    ) -> None:
        """Report that ``bucket`` of ``step`` is packed and waits for the coordinator's go;
        ``cached``: it does not wait, it is reduced at once under the epoch's agreed spec
        (``spec`` may then be its `spec_hash`). ``group``: the bucket is reduced within that
        process group (declared at the join), whose members alone negotiate it."""
        await self._feed(ReportReady(step, bucket, spec, epoch, cached, group))

    def folded(self, step: int, epoch: int, agreement: str) -> None:
        """Note that ``step``'s buckets are reduced from the response cache under
        ``agreement`` without a report each: the step's first report will say so."""
        self.protocol.handle(ReportFolded(step, epoch, agreement))

    async def reduced(self, step: int, epoch: int) -> None:
        """Report every bucket of ``step`` all-reduced here (elastic runs' apply barrier)."""
        await self._feed(ReportReduced(step, epoch))

    async def digest(
        self,
        step: int,
        digest: bytes,
        tensors: list[tuple[str, bytes]] | bytes,
        epoch: int = 1,
        *,
        names: Sequence[str] | None = None,
        algorithm: str = "",
    ) -> None:
        """Report the state digest after ``step``'s optimizer step. ``tensors``: the per-tensor
        digests as (name, digest) pairs, or packed (concatenated, in the order of ``names``;
        ``names`` None: those of this worker's last digest in the epoch); ``algorithm``: the
        name of the algorithm that computed them (`StateDigest.algorithm`)."""
        await self._feed(ReportDigest(step, digest, tensors, epoch, names, algorithm))

    async def step_done(self, step: int, epoch: int = 1) -> None:
        """Report ``step`` done on a step without a digest check."""
        await self._feed(ReportStepDone(step, epoch))

    async def finished(self, step: int, epoch: int | None = None) -> None:
        """Tell the coordinator this worker has taken its last step."""
        await self._feed(ReportFinished(step, epoch))

    async def wait_commit(self, step: int) -> None:
        """Wait until the coordinator commits ``step`` (every rank agreed)."""
        while self.protocol.committed < step:
            if self._failure is not None:
                raise self._failure
            await self._commit_changed.wait()

    def applied(self, step: int) -> bool:
        """Whether the coordinator said apply for ``step`` in the current epoch."""
        return self.protocol.applied >= step

    async def wait_apply(self, step: int) -> None:
        """Wait until every member holds ``step``'s reduced gradients (elastic runs)."""
        while self.protocol.applied < step:
            if self._failure is not None:
                raise self._failure
            await self._commit_changed.wait()

    # ------------------------------------------------------------------- serving

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
            except* (PeerClosed, FrameAuthenticationError) as group:
                # A frame that failed authentication closed the link (someone on the path
                # altered or forged it): nothing in it was acted on; like a lost link, the
                # worker redials (a new handshake, new keys) when it may.
                lost = group.exceptions[0]
                held = self.protocol.handle(ConnectionLost(str(lost), self.redial is not None))
                if self.redial is None or self.done.is_set():
                    if self.host_rank is not None and not self.done.is_set():
                        raise self._host_lost(lost) from lost
                    raise
            await self._rejoin(lost, held)

    async def _route(self) -> None:
        while not self.done.is_set():
            message = await self._receive(self.protocol.silence_seconds)
            if message is not None:
                await self._feed(Received(message, trio.current_time()))

    def _host_lost(self, lost: BaseException) -> CoordinatorLost:
        """The error of a coordinator lost with the rank whose process hosted it."""
        error = CoordinatorLost(
            f"rank {self.host_rank} is lost, and the run's coordinator with it (it ran in rank "
            f"{self.host_rank}'s process; {lost}): the run ends"
        )
        error.peer = f"rank {self.host_rank}"
        return error

    async def _rejoin(self, lost: BaseException, held: list[WorkerAction]) -> None:
        """Hold the trainer (``held``: the protocol's answer to the loss), then redial with
        backoff and jitter and rejoin with the state it holds."""
        assert self.redial is not None
        log.warning("rank %d lost the coordinator (%s); reconnecting", self.rank, lost)
        with trio.CancelScope(shield=True):
            await self.link.aclose()
        await self._run(held, joining=True)
        step, digest = (0, b"") if self.resume_point is None else await self.resume_point()
        self._redial_failure = lost
        start: StartRun | None = None
        with trio.move_on_after(self.reconnect_seconds):
            try:
                async for attempt in stamina.retry_context(
                    on=_redial_again,
                    attempts=None,
                    timeout=None,  # the cancel scope above bounds it, on trio's clock
                    wait_initial=REDIAL_FIRST_SECONDS,
                    wait_max=REDIAL_MAX_SECONDS,
                    wait_jitter=REDIAL_JITTER_SECONDS,
                ):
                    with attempt:
                        start = await self._rejoin_once(step, digest)
            except Exception as exc:
                if not _redial_again(exc):
                    raise
                # retries switched off (stamina.set_active(False)): the last failure stands
        failure = self._redial_failure
        if start is None:
            raise CoordinatorLost(
                f"the coordinator did not come back within {self.reconnect_seconds:g} s "
                f"(last: {failure})",
                peer="coordinator",
            ) from failure
        self.reconnects += 1  # the rejoin announced its start to the trainer
        log.warning(
            "rank %d rejoined the coordinator: epoch %d at step %d",
            self.rank,
            start.epoch,
            start.step,
        )

    async def _rejoin_once(self, step: int, digest: bytes) -> StartRun:
        """One redial and rejoin; a failure leaves the protocol lost again, the link closed."""
        try:
            self.link = await self.redial()  # type: ignore[misc]
            joined = await self.join(
                self.protocol.signature,
                self.protocol.address,
                step=step,
                digest=digest,
                epoch=self.epoch,
            )
        except Exception as exc:
            if failed_authentication(exc):
                # One proof is all a listener that fails authentication gets: each would be
                # another guess of the secret for whoever listens at the coordinator's address.
                raise PeerLacksSecret(
                    f"the peer at {self.address} does not know the shared secret ({exc}); this "
                    "worker gives it no further proof and stops"
                ) from exc
            if not _redial_again(exc):
                raise
            self._redial_failure = exc
            log.info("rank %d: the coordinator is not back yet (%s)", self.rank, exc)
            self.protocol.handle(ConnectionLost(str(exc)))
            with trio.CancelScope(shield=True):
                await self.link.aclose()
            raise
        return joined.start

    def _wake(self) -> None:
        self._commit_changed.set()
        self._commit_changed = trio.Event()

    async def _heartbeats(self, wait_first: bool = False) -> None:
        if wait_first:
            await trio.sleep(self.heartbeat_seconds)
        while True:
            await self._feed(HeartbeatDue(trio.current_time()))
            await trio.sleep(self.heartbeat_seconds)
