"""The worker's side of the coordinator protocol as a sans-I/O state machine (pure).

:class:`WorkerProtocol` is fed events (`paramsync.actors.client.events`: the coordinator's decoded
messages, the trainer's requests, the link's fate) and returns actions: messages to send
(`Send`, always one of the message dataclasses of `paramsync.runtime.coordinator.core`, never a
hand-built dict) and results for the trainer. It opens no socket, starts no task and reads no
clock: `paramsync.actors.client.client.CoordinatorClient` is the trio shell that moves the bytes,
runs the timers and redials.

Every transition is a row of one of three tables (`paramsync.runtime.protocol.state_machine`):
`COORDINATOR_TABLE` (what the coordinator may send in each phase), `TRAINER_TABLE` (what the
trainer may ask in each phase) and `LINK_TABLE` (the link lost, to rejoin or for good). Each
row names the phase, the event, the handler and the phase it leads to: the handler runs, then
the row moves the phase (a handler that raises leaves it as it was); no handler sets the phase.
A coordinator message that is not in its phase's table is a :class:`ProtocolError` naming the
coordinator, the message kind, its step and epoch, and the phase; a trainer request that is
not in its table is a :class:`LocalProtocolError` (this worker's own bug, not the peer's).
`COORDINATOR_TRANSITIONS` and `TRAINER_TRANSITIONS` list, per phase, the events it allows.

Epochs decide within a transition: a run order (go, commit, apply) of an older epoch than the
newest one announced raced a membership change and is dropped; one of a newer epoch is a
protocol error; a report of an older epoch is dropped here, as the coordinator would drop it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

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
    Report,
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
from paramsync.runtime.coordinator.events import Message, agreement_hash, spec_hash
from paramsync.runtime.errors import ParamsyncError, ProtocolError
from paramsync.runtime.protocol.messages import (
    AbortRun,
    Apply,
    Commit,
    Digest,
    Finished,
    Go,
    Heartbeat,
    Hold,
    Joined,
    JoinRefused,
    ParallelLayout,
    Ready,
    Reduced,
    ResyncOrder,
    Shutdown,
    Signature,
    StartRun,
    StepDone,
)
from paramsync.runtime.protocol.state_machine import Row, Table

__all__ = [
    "Phase",
    "WorkerProtocol",
    "LocalProtocolError",
    "EpochRegression",
    "COORDINATOR_TABLE",
    "TRAINER_TABLE",
    "LINK_TABLE",
    "COORDINATOR_TRANSITIONS",
    "TRAINER_TRANSITIONS",
]

COORDINATOR = "coordinator"
"""How errors name the peer of this protocol."""


class LocalProtocolError(ParamsyncError):
    """This worker's trainer asked for something its protocol state forbids (a bug here, not
    the coordinator's)."""


class EpochRegression(ProtocolError):
    """A restarted coordinator opened an epoch that is not after the one this worker held:
    rejoining it again cannot help."""


class Phase(enum.Enum):
    """Where the worker's conversation with the coordinator is."""

    UNJOINED = "unjoined"
    """Nothing sent yet."""
    JOINING = "joining"
    """Join sent; waiting for the run's start."""
    RUNNING = "running"
    """An epoch is announced; the trainer runs it."""
    HOLDING = "holding"
    """The coordinator said hold: no epoch runs until the next start."""
    LOST = "lost"
    """The coordinator is gone (link broke or went silent); the trainer holds its state."""
    REJOINING = "rejoining"
    """Join sent to a (restarted) coordinator with the state held; waiting for its start."""
    ENDED = "ended"
    """The run is over for this worker (shut down, aborted, refused, or lost for good)."""


# --------------------------------------------------------------------------- the events

_REPORTS = ("ready", "folded", "reduced", "digest", "step_done", "finished")
_RUN_ENDS = ("shutdown", "abort", "join_refused")

LOST = "lose the link, to rejoin"
"""The link broke or went silent and the shell will dial the coordinator again."""
LOST_FOR_GOOD = "lose the link for good"
"""The link broke and the shell gives up: the run is over for this worker."""

_REQUESTS: dict[type, str] = {
    Join: "join",
    ReportReady: "ready",
    ReportFolded: "folded",
    ReportReduced: "reduced",
    ReportDigest: "digest",
    ReportStepDone: "step_done",
    ReportFinished: "finished",
    EnterEpoch: "enter",
    HeartbeatDue: "heartbeat",
}

_Handler = Callable[["WorkerProtocol", Any], list[WorkerAction]]
_Row = Row[Phase, str, _Handler]

_CONNECTED = (Phase.JOINING, Phase.RUNNING, Phase.HOLDING, Phase.REJOINING)


def _describe(message: Message | HeartbeatReceived) -> str:
    """``kind {step s, epoch e}``: a message as errors name it."""
    fields = [
        f"{name} {getattr(message, name)}"
        for name in ("step", "epoch", "bucket")
        if hasattr(message, name)
    ]
    return f"{message.KIND} {{{', '.join(fields)}}}" if fields else message.KIND


# --------------------------------------------------------------------------- the core


class WorkerProtocol:
    """One worker's protocol state: phase, epochs, commits, applies, folded reports.

    ``rank`` is this worker's rank (the messages it builds carry it; the coordinator takes
    it from the authenticated link, so it never travels).
    """

    FOLD_MEMORY: ClassVar[int] = 16
    """How many folded steps to remember before dropping those of older epochs."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.phase = Phase.UNJOINED
        self.epoch = 0
        """The newest epoch the coordinator announced (start or hold)."""
        self.start: StartRun | None = None
        """The start of the epoch last joined or entered."""
        self.fold = False
        """Whether this worker offered, at its join, to fold cached bucket reports."""
        self.signature: Signature = ()
        self.address: tuple[str, int] = ("", 0)
        self.committed = -1
        """The newest step committed in the entered epoch (its baseline before any commit)."""
        self.verified: tuple[int, bytes] | None = None
        """The newest committed state this worker held: (next step, digest) after a step whose
        digest it reported and whose commit came (its digest check passed); None: none yet.
        A rejoin reports its state as committed when it still is this one."""
        self._digests: dict[tuple[int, int], bytes] = {}
        """(epoch, step) -> the digest this worker reported for it, until its commit."""
        self.applied = -1
        """The newest step the coordinator said apply for in the entered epoch."""
        self.last_heard: float | None = None
        """The shell's time of the coordinator's last message (None: nothing yet)."""
        self.stale = 0
        """Messages and reports of an older epoch, dropped (they raced a membership change)."""
        self.lost_reason: str | None = None
        self.mesh: tuple[tuple[str, ...], tuple[int, ...]] | None = None
        self.declared_groups: tuple[tuple[str, tuple[int, ...]], ...] | None = None
        """The process groups this worker declared at its join (``mesh`` or a list)."""
        self.layout: ParallelLayout | None = None
        """This worker's 3D-parallel layout as its joins declare it (None: a flat run)."""
        self._group_agreed: dict[tuple[str, int], Any] = {}
        """(group, bucket) -> the spec agreed within that group in the cache's epoch."""
        self._group_awaiting: dict[tuple[str, int, int], tuple[Any, bool]] = {}
        """(group, step, bucket) -> (spec, cached) of a group ready a go may still answer."""
        self._folded: dict[tuple[int, int], str] = {}
        self._cache_epoch = 0
        """The epoch the response cache below belongs to (a new epoch starts without one)."""
        self._agreed: dict[int, Any] = {}
        """bucket -> the spec this worker reported when its go came: the epoch's agreement."""
        self._agreement: str | None = None
        """The `agreement_hash` of ``_agreed`` (None: not computed since it changed)."""
        self._known: set[str] = set()
        """The `spec_hash` of every spec agreed in the cache's epoch, at any bucket."""
        self.cache_by_spec = False
        """Whether a cached ready may name any spec agreed in the epoch, not only the one
        agreed at its bucket (a torch.distributed group, whose calls do not repeat at the
        same place every step: `paramsync.actors.torch_backend`; the coordinator compares the
        members' reports either way). A trainer's buckets repeat: it keeps the stricter rule."""
        self._awaiting: dict[tuple[int, int], tuple[Any, bool]] = {}
        """(step, bucket) -> (spec, cached) of a ready report a go may still answer."""
        """(epoch, step) -> the agreement its buckets were reduced under without a report."""

    # ------------------------------------------------------------------- observability

    @property
    def digest_interval(self) -> int:
        return self.start.digest_interval if self.start is not None else 1

    @property
    def start_step(self) -> int:
        return self.start.step if self.start is not None else 0

    @property
    def silence_seconds(self) -> float:
        """How long the coordinator may stay silent (inf before a start says)."""
        return self.start.heartbeat_deadline if self.start is not None else float("inf")

    @property
    def groups(self) -> dict[str, tuple[tuple[int, ...], tuple[tuple[str, int], ...]]]:
        """This worker's process groups in the entered epoch (its start's ``groups``): name
        -> (world ranks, their addresses)."""
        if self.start is None:
            return {}
        return {name: (ranks, addresses) for name, ranks, addresses in self.start.groups}

    @property
    def ended(self) -> bool:
        return self.phase is Phase.ENDED

    # ------------------------------------------------------------------- dispatch

    def handle(self, event: WorkerEvent) -> list[WorkerAction]:
        """Feed one event; return the actions to execute, in order.

        Raises ProtocolError (peer: the coordinator) for a coordinator message its phase's
        table does not allow, LocalProtocolError for such a trainer request, TypeError for an
        object that is no event.
        """
        if isinstance(event, Received | HeartbeatReceived):
            return self._receive(event)
        if isinstance(event, ConnectionLost):
            fate = LOST if event.rejoin else LOST_FOR_GOOD
            return self._take(LINK_TABLE.row(self.phase, fate), event)
        if isinstance(event, Tick):
            return self._on_tick(event)
        request = _REQUESTS.get(type(event))
        if request is None:
            raise TypeError(f"not a worker protocol event: {type(event).__name__}")
        row = TRAINER_TABLE.find(self.phase, request)
        if row is None:
            raise LocalProtocolError(
                f"rank {self.rank} asked to send {request} while {self.phase.value} "
                f"(epoch {self.epoch}): not allowed in this phase"
            )
        return self._take(row, event)

    def _receive(self, event: Received | HeartbeatReceived) -> list[WorkerAction]:
        message = event.message if isinstance(event, Received) else event
        row = COORDINATOR_TABLE.find(self.phase, message.KIND)
        if row is None:
            raise self._illegal(message, "not allowed in this phase")
        if event.now is not None:
            heard = self.last_heard
            self.last_heard = event.now if heard is None else max(heard, event.now)
        return self._take(row, message)

    def _take(self, row: _Row, event: Any) -> list[WorkerAction]:
        """Run ``row``'s handler on ``event``, then move to the row's phase (a handler that
        raises leaves the phase as it was)."""
        actions = [] if row.handler is None else row.handler(self, event)
        assert row.target is not None  # every row of the worker's tables names its phase
        self.phase = row.target
        return actions

    def _illegal(self, message: Message | HeartbeatReceived, why: str) -> ProtocolError:
        joining = self.phase in (Phase.JOINING, Phase.REJOINING)
        expect = " (expected the run's start)" if joining else ""
        return ProtocolError(
            f"{_describe(message)} while {self.phase.value} in epoch {self.epoch}: {why}{expect}",
            peer=COORDINATOR,
        )

    # ------------------------------------------------------------------- coordinator

    def _on_start(self, start: StartRun) -> list[WorkerAction]:
        rejoined = self.phase is Phase.REJOINING
        if rejoined and start.epoch <= self.epoch:
            raise EpochRegression(
                f"{_describe(start)} while rejoining in epoch {self.epoch}: the restarted "
                f"coordinator opened epoch {start.epoch}, not after {self.epoch}",
                peer=COORDINATOR,
            )
        self.epoch = start.epoch
        self.lost_reason = None
        actions: list[WorkerAction] = [Started(start, rejoined), *self._enter(EnterEpoch(start))]
        if rejoined:
            actions.append(Announce(start))
        return actions

    def _on_end(self, message: Shutdown | AbortRun | JoinRefused) -> list[WorkerAction]:
        if self.phase in (Phase.JOINING, Phase.REJOINING):
            error: str | None = f"coordinator refused rank {self.rank}: {message.reason}"
        elif isinstance(message, Shutdown):
            clean = message.reason == "finished"
            error = None if clean else f"coordinator ended the run: {message.reason}"
        else:
            error = f"coordinator stopped the run: {message.reason}"
        return [Ended(message, error), Progress()]

    def _epoch_of(self, message: Go | Commit | Apply) -> bool:
        """Whether ``message`` belongs to the announced epoch (False: an older one, dropped);
        a newer one is a protocol error."""
        if message.epoch < self.epoch:
            self.stale += 1
            return False
        if message.epoch > self.epoch:
            raise self._illegal(message, "an epoch that was never announced")
        return True

    def _on_go(self, go: Go) -> list[WorkerAction]:
        if not self._epoch_of(go):
            return []
        self._cache_for(go.epoch)
        if go.group:
            return self._on_group_go(go)
        report = self._awaiting.pop((go.step, go.bucket), None)
        if report is None:
            raise self._illegal(
                go, f"this worker did not report bucket {go.bucket} of step {go.step} ready"
            )
        spec, cached = report
        if not cached:  # negotiated: the spec every member reported is the agreement now
            self._agreed[go.bucket] = spec
            self._known.add(spec_hash(spec))
            self._agreement = None
        return [RunGo(go)]

    def _on_group_go(self, go: Go) -> list[WorkerAction]:
        report = self._group_awaiting.pop((go.group, go.step, go.bucket), None)
        if report is None:
            raise self._illegal(
                go,
                f"this worker did not report bucket {go.bucket} of step {go.step} ready in "
                f"group {go.group!r}",
            )
        spec, cached = report
        if not cached:
            self._group_agreed[(go.group, go.bucket)] = spec
        return [RunGo(go)]

    def _on_commit(self, commit: Commit) -> list[WorkerAction]:
        if not self._epoch_of(commit):
            return []
        self.committed = max(self.committed, commit.step)
        digest = self._digests.get((commit.epoch, commit.step))
        if digest is not None:  # a digest step: every rank's digest agreed with this one
            self.verified = (commit.step + 1, digest)
        self._digests = {k: v for k, v in self._digests.items() if k[1] > commit.step}
        return [Progress()]

    def _on_apply(self, apply: Apply) -> list[WorkerAction]:
        if not self._epoch_of(apply):
            return []
        self.applied = max(self.applied, apply.step)
        return [Progress()]

    def _on_stale_only(self, message: Go | Commit | Apply) -> list[WorkerAction]:
        if message.epoch >= self.epoch:
            raise self._illegal(message, f"epoch {self.epoch} holds and runs no step")
        self.stale += 1
        return []

    def _on_resync(self, order: ResyncOrder) -> list[WorkerAction]:
        if self.rank in order.targets:  # the digest it reported is about to be overwritten
            self._digests.pop((self.epoch, order.step), None)
        return [RunResync(order)]

    def _on_announce(self, message: StartRun | Hold) -> list[WorkerAction]:
        if message.epoch <= self.epoch:
            raise self._illegal(
                message, f"epoch {message.epoch} announced after epoch {self.epoch}"
            )
        self.epoch = message.epoch
        return [Announce(message)]

    # ------------------------------------------------------------------- the link

    def _on_lost(self, event: ConnectionLost) -> list[WorkerAction]:
        """The link of a running or holding worker is lost: it holds until it rejoins."""
        self.lost_reason = event.reason
        hold = Hold(self.applied + 1, self.epoch, f"coordinator lost: {event.reason}")
        return [Announce(hold), Progress()]

    def _on_lost_for_good(self, event: ConnectionLost) -> list[WorkerAction]:
        self.lost_reason = event.reason
        return []

    def _on_tick(self, event: Tick) -> list[WorkerAction]:
        if self.phase not in _CONNECTED:
            return []
        deadline = self.silence_seconds
        if self.last_heard is not None and event.now - self.last_heard < deadline:
            return []
        return [Silent(f"the coordinator sent nothing for {deadline:g} s (heartbeat deadline)")]

    # ------------------------------------------------------------------- the trainer

    def _heartbeat(self, event: HeartbeatDue) -> list[WorkerAction]:
        return [Send(Heartbeat(self.rank, event.now))]

    def _joined(self, event: Join) -> Joined:
        if event.signature is not None:
            self.signature = tuple(event.signature)
        if event.address is not None:
            self.address = event.address
        if event.fold is not None:
            self.fold = event.fold
        if event.mesh is not None or event.groups is not None:
            self.mesh, self.declared_groups = event.mesh, event.groups
        if event.layout is not None:
            self.layout = event.layout
        committed = event.committed
        if committed is None:
            committed = event.step > 0 and self.verified == (event.step, event.digest)
        return Joined(
            self.rank,
            self.signature,
            self.address,
            None,
            event.step,
            event.digest,
            event.epoch,
            self.fold,
            self.mesh,
            self.declared_groups,
            committed,
            self.layout,
        )

    def _join(self, event: Join) -> list[WorkerAction]:
        message = self._joined(event)
        self.last_heard = None
        return [Send(message)]

    def _rejoin(self, event: Join) -> list[WorkerAction]:
        if event.epoch != self.epoch:
            raise LocalProtocolError(
                f"rank {self.rank} rejoins with epoch {event.epoch}, but it last took part in "
                f"epoch {self.epoch}: a rejoin presents the state it holds"
            )
        message = self._joined(event)
        self.last_heard = None
        return [Send(message)]

    def _adopt(self, event: EnterEpoch) -> list[WorkerAction]:
        """A client handed its epoch's start without a join (a tool or test attached to a
        conversation already under way): run that epoch."""
        self.epoch = event.start.epoch
        return self._enter(event)

    def _enter(self, event: EnterEpoch) -> list[WorkerAction]:
        start = event.start
        if start.epoch > self.epoch:
            raise LocalProtocolError(
                f"rank {self.rank} enters epoch {start.epoch}, which the coordinator never "
                f"announced (newest: {self.epoch})"
            )
        self.start = start
        self._digests = {k: v for k, v in self._digests.items() if k[0] == start.epoch}
        self.committed = start.step - 2 if start.verify else start.step - 1
        self.applied = start.step - 1
        return [Progress()]

    def _report(
        self,
        event: ReportReady
        | ReportFolded
        | ReportReduced
        | ReportDigest
        | ReportStepDone
        | ReportFinished,
    ) -> list[WorkerAction]:
        if isinstance(event, ReportFolded):
            if event.epoch == self.epoch and self.phase is Phase.RUNNING:
                self._check_agreement(event)
            self._remember_fold(event)
            return []
        epoch = self.epoch if event.epoch is None else event.epoch
        if epoch > self.epoch:
            raise LocalProtocolError(
                f"rank {self.rank} reports step {event.step} of epoch {epoch}, which the "
                f"coordinator never announced (newest: {self.epoch})"
            )
        if epoch < self.epoch or self.phase is not Phase.RUNNING:
            # An older epoch's report, or no epoch running: the coordinator would drop it.
            self._folded.pop((epoch, event.step), None)
            self.stale += 1
            return []
        if isinstance(event, ReportReady):
            self._note_ready(event)
        elif not isinstance(event, ReportFinished):  # a step's end: no go for it follows
            self._awaiting = {k: v for k, v in self._awaiting.items() if k[0] > event.step}
            self._group_awaiting = {
                k: v for k, v in self._group_awaiting.items() if k[1] > event.step
            }
            if isinstance(event, ReportDigest):
                self._digests[(epoch, event.step)] = bytes(event.digest)
        return [Send(self._message(event, epoch))]

    # ------------------------------------------------------------------- response cache

    def _cache_for(self, epoch: int) -> None:
        """Start ``epoch``'s response cache afresh if it is not the one held."""
        if epoch != self._cache_epoch:
            self._cache_epoch = epoch
            self._agreed, self._awaiting, self._agreement = {}, {}, None
            self._known = set()
            self._group_agreed, self._group_awaiting = {}, {}

    def knows(self, digest: str, epoch: int | None = None) -> bool:
        """Whether the members agreed, at any bucket of the cache's epoch (or ``epoch``), on
        the spec whose `spec_hash` is ``digest`` (`ResponseCache.known` on the coordinator)."""
        if epoch is not None and epoch != self._cache_epoch:
            return False
        return digest in self._known

    def may_cache(self, bucket: int, digest: str, epoch: int) -> bool:
        """Whether a ready of ``bucket`` whose spec hashes to ``digest`` may be reduced at once
        from the response cache: that spec was agreed at that bucket, or (``cache_by_spec``)
        anywhere in the epoch."""
        if epoch != self._cache_epoch:
            return False
        if self.cache_by_spec:
            return digest in self._known  # every bucket's agreement is in it too
        agreed = self._agreed.get(bucket)
        return agreed is not None and spec_hash(agreed) == digest

    def id_bound(self, epoch: int) -> int:
        """One past the highest bucket agreed in ``epoch`` (the coordinator's bound on the
        bucket ids of ready reports held ahead of a step: `ResponseCache.id_bound`)."""
        if epoch != self._cache_epoch or not self._agreed:
            return 0
        return max(self._agreed) + 1

    @property
    def awaiting_go(self) -> frozenset[tuple[int, int]]:
        """(step, bucket) of this epoch's ready reports that a go may still answer."""
        return frozenset(self._awaiting) if self._cache_epoch == self.epoch else frozenset()

    @property
    def agreement(self) -> str:
        """The `agreement_hash` of the buckets agreed in the announced epoch ("none": none)."""
        if self._cache_epoch != self.epoch or not self._agreed:
            return "none"
        if self._agreement is None:
            hashes = {bucket: spec_hash(spec) for bucket, spec in self._agreed.items()}
            self._agreement = agreement_hash(hashes)
        return self._agreement

    def _note_ready(self, event: ReportReady) -> None:
        """Remember a ready report for its go; a cached one must match the agreement."""
        self._cache_for(event.epoch)
        if event.group:
            self._note_group_ready(event)
            return
        if event.cached and not (self.cache_by_spec and self.knows(spec_hash(event.spec))):
            agreed = self._agreed.get(event.bucket)
            if agreed is None:
                raise LocalProtocolError(
                    f"rank {self.rank} reports bucket {event.bucket} of step {event.step} "
                    f"reduced from the response cache, but epoch {event.epoch} agreed on no "
                    f"spec for it"
                )
            if spec_hash(event.spec) != spec_hash(agreed):
                raise LocalProtocolError(
                    f"rank {self.rank} reports bucket {event.bucket} of step {event.step} "
                    f"reduced from the response cache as {spec_hash(event.spec)}, but epoch "
                    f"{event.epoch} agreed on {spec_hash(agreed)}"
                )
        self._awaiting[(event.step, event.bucket)] = (event.spec, event.cached)

    def _note_group_ready(self, event: ReportReady) -> None:
        """A ready within a declared group: the group must be this worker's in the epoch
        (its group table), and a cached one must match the group's agreement."""
        groups = self.groups
        if self.start is not None and self.start.epoch == self.epoch and event.group not in groups:
            raise LocalProtocolError(
                f"rank {self.rank} reports bucket {event.bucket} of step {event.step} ready in "
                f"group {event.group!r}, which is not one of its groups in epoch {self.epoch} "
                f"({sorted(groups)})"
            )
        if event.cached:
            agreed = self._group_agreed.get((event.group, event.bucket))
            if agreed is None or spec_hash(event.spec) != spec_hash(agreed):
                raise LocalProtocolError(
                    f"rank {self.rank} reports bucket {event.bucket} of step {event.step} "
                    f"reduced from group {event.group!r}'s response cache, but epoch "
                    f"{event.epoch} agreed on "
                    f"{'no spec' if agreed is None else spec_hash(agreed)} for it there"
                )
        self._group_awaiting[(event.group, event.step, event.bucket)] = (
            event.spec,
            event.cached,
        )

    def _check_agreement(self, event: ReportFolded) -> None:
        """A folded step must be reduced under the epoch's agreement, as the coordinator
        will check."""
        self._cache_for(event.epoch)
        if event.agreement != self.agreement:
            raise LocalProtocolError(
                f"rank {self.rank} folds step {event.step} under agreement {event.agreement}, "
                f"but epoch {event.epoch} agreed on {self.agreement}"
            )

    def _remember_fold(self, event: ReportFolded) -> None:
        if len(self._folded) > self.FOLD_MEMORY:  # steps that never reported (a new epoch)
            self._folded = {k: v for k, v in self._folded.items() if k[0] == event.epoch}
        self._folded[(event.epoch, event.step)] = event.agreement

    def _message(self, event: WorkerEvent, epoch: int) -> Report:
        rank = self.rank
        if isinstance(event, ReportReady):
            return Ready(
                rank, event.step, event.bucket, event.spec, epoch, event.cached, event.group
            )
        if isinstance(event, ReportFinished):
            return Finished(rank, event.step, epoch)
        assert isinstance(event, ReportReduced | ReportDigest | ReportStepDone)
        cached = self._folded.pop((epoch, event.step), "")
        if isinstance(event, ReportReduced):
            return Reduced(rank, event.step, epoch, cached)
        if isinstance(event, ReportStepDone):
            return StepDone(rank, event.step, epoch, cached)
        if isinstance(event.tensors, bytes | bytearray):
            names = None if event.names is None else tuple(event.names)
            packed = bytes(event.tensors)
            return Digest(
                rank, event.step, event.digest, (), epoch, packed, names, cached, event.algorithm
            )
        return Digest(
            rank,
            event.step,
            event.digest,
            tuple(event.tensors),
            epoch,
            cached=cached,
            algorithm=event.algorithm,
        )


# --------------------------------------------------------------------------- the tables

_P, _W = Phase, WorkerProtocol


def _stay(phase: Phase, events: Iterable[str], handler: _Handler | None) -> list[_Row]:
    """Rows of ``events`` that run ``handler`` and leave ``phase`` as it is."""
    return [Row(phase, event, phase, handler) for event in events]


def _joining(phase: Phase) -> list[_Row]:
    """What the coordinator may answer a join (or a rejoin) with."""
    return [
        Row(phase, "start_run", _P.RUNNING, _W._on_start),
        Row(phase, "heartbeat", phase),
        *(Row(phase, kind, _P.ENDED, _W._on_end) for kind in _RUN_ENDS),
    ]


def _running(phase: Phase, orders: Mapping[str, _Handler]) -> list[_Row]:
    """What the coordinator may send in an announced epoch (``orders``: the handlers of its
    go, commit and apply, which run them or, while holding, only drop them as stale)."""
    return [
        *(Row(phase, kind, phase, handler) for kind, handler in orders.items()),
        Row(phase, "start_run", _P.RUNNING, _W._on_announce),
        Row(phase, "hold", _P.HOLDING, _W._on_announce),
        Row(phase, "heartbeat", phase),
        *(Row(phase, kind, _P.ENDED, _W._on_end) for kind in _RUN_ENDS),
    ]


def _reporting(phase: Phase) -> list[_Row]:
    """What the trainer may ask while connected to an epoch (or holding, or rejoining)."""
    return [
        *_stay(phase, _REPORTS, _W._report),
        Row(phase, "enter", phase, _W._enter),
        Row(phase, "heartbeat", phase, _W._heartbeat),
    ]


COORDINATOR_TABLE: Table[Phase, str, _Handler] = Table(
    Phase,
    [
        *_joining(_P.JOINING),
        *_running(_P.RUNNING, {"go": _W._on_go, "commit": _W._on_commit, "apply": _W._on_apply}),
        Row(_P.RUNNING, "resync", _P.RUNNING, _W._on_resync),
        # A hold's epoch runs nothing: only an older epoch's orders may still be on the way.
        *_running(_P.HOLDING, dict.fromkeys(("go", "commit", "apply"), _W._on_stale_only)),
        *_joining(_P.REJOINING),
    ],
    terminal={_P.ENDED},
)
"""(phase, coordinator message kind) -> handler and next phase; a kind its phase does not
list is a ProtocolError naming the coordinator."""

TRAINER_TABLE: Table[Phase, str, _Handler] = Table(
    Phase,
    [
        Row(_P.UNJOINED, "join", _P.JOINING, _W._join),
        Row(_P.UNJOINED, "enter", _P.RUNNING, _W._adopt),
        Row(_P.UNJOINED, "heartbeat", _P.UNJOINED),
        Row(_P.JOINING, "heartbeat", _P.JOINING, _W._heartbeat),
        *_reporting(_P.RUNNING),
        *_reporting(_P.HOLDING),
        *_reporting(_P.REJOINING),
        # Without a link, reports of the step in flight are dropped: the trainer holds, and a
        # restarted coordinator opens a later epoch, whose run drops older reports anyway.
        *_stay(_P.LOST, _REPORTS, _W._report),
        Row(_P.LOST, "join", _P.REJOINING, _W._rejoin),
        Row(_P.LOST, "enter", _P.LOST, _W._enter),
        Row(_P.LOST, "heartbeat", _P.LOST),
        *_stay(_P.ENDED, _REPORTS, None),
        Row(_P.ENDED, "enter", _P.ENDED, _W._enter),
        Row(_P.ENDED, "heartbeat", _P.ENDED),
    ],
    terminal={_P.ENDED},
)
"""(phase, trainer request) -> handler and next phase; a request its phase does not list is
a LocalProtocolError (this worker's own bug)."""

LINK_TABLE: Table[Phase, str, _Handler] = Table(
    Phase,
    [
        Row(_P.RUNNING, LOST, _P.LOST, _W._on_lost),
        Row(_P.HOLDING, LOST, _P.LOST, _W._on_lost),
        Row(_P.LOST, LOST, _P.LOST),
        Row(_P.REJOINING, LOST, _P.LOST),
        # Lost before a first start: there is no state to hold, the run is over.
        Row(_P.UNJOINED, LOST, _P.ENDED, _W._on_lost_for_good),
        Row(_P.JOINING, LOST, _P.ENDED, _W._on_lost_for_good),
        *(
            Row(phase, LOST_FOR_GOOD, _P.ENDED, _W._on_lost_for_good)
            for phase in Phase
            if phase is not _P.ENDED
        ),
        Row(_P.ENDED, LOST, _P.ENDED),
        Row(_P.ENDED, LOST_FOR_GOOD, _P.ENDED),
    ],
    terminal={_P.ENDED},
)
"""(phase, the link's fate) -> handler and next phase: every phase takes both."""

COORDINATOR_TRANSITIONS = COORDINATOR_TABLE.by_state()
"""Phase -> the coordinator message kinds it allows (none: a kind it does not list is a
ProtocolError)."""

TRAINER_TRANSITIONS = TRAINER_TABLE.by_state()
"""Phase -> the trainer requests it allows (a request not listed is a LocalProtocolError)."""
