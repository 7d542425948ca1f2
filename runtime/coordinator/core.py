"""The coordinator's sans-I/O core: rendezvous, bucket negotiation and step commits (pure).

A coordinator sequences a data-parallel run of ``world_size`` workers. This module is its brain
and nothing else: :class:`CoordinatorCore` is fed events (decoded messages, disconnects, clock
ticks) and returns actions (messages to send, refusals, aborts). It opens no socket, starts no
task and reads no clock, so an actor shell runs it and hypothesis drives it directly.

One run, as the workers see it (worker -> coordinator kinds on the left)::

    join {host, port, params}          -> start_run {addresses, ring, step, ...}  (all joined)
    ready {step, bucket, spec}         -> go {step, bucket, seq}                  (all ready)
    digest {step, digest, tensors}     -> commit {step}   (digest steps: step % interval == 0)
      or step_done {step}              -> commit {step}   (other steps)
    finished {step}                    -> shutdown {reason}                       (all finished)
    heartbeat {}                          (every fraction of heartbeat_deadline, from join on)

The coordinator may instead answer ``join_refused {reason}`` to one worker, ``resync {step,
source, targets}`` before a commit whose digests diverged (``resync=True``), or ``abort
{reason}`` to all. A worker runs its buckets' collectives in ``go`` order (``seq`` grows by one
per ``go``), and sends nothing for step ``s + 1`` before it has received ``commit {s}``.

Every inconsistency is caught as soon as it is observable and becomes an :class:`Abort` whose
reason names the ranks, the step and what differs; ``handle`` never raises on logic errors.
The messages themselves are declared in `runtime.protocol.messages`: malformed wire input
raises :class:`~runtime.errors.ProtocolError` in its ``event_from_wire``, before an event exists.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import xxhash

from runtime.protocol.messages import (
    AbortRun,
    Apply,
    BucketSpec,
    Commit,
    CoordinatorMessage,
    Digest,
    Finished,
    Go,
    Heartbeat,
    Hold,
    Joined,
    JoinRefused,
    ParamSpec,
    Ready,
    Reduced,
    ResyncOrder,
    Shutdown,
    Signature,
    StartRun,
    StepDone,
    message_from_wire,
    normalize_signature,
    packed_size,
)

__all__ = [
    "RunState",
    "Message",
    # events that never travel (the wire's are in runtime.protocol.messages)
    "Tick",
    "Disconnected",
    "Malformed",
    "Event",
    # actions
    "Send",
    "Broadcast",
    "Refuse",
    "Abort",
    "Resync",
    "Evict",
    "Report",
    "Action",
    # helpers and the core
    "dtype_name",
    "model_signature",
    "bucket_spec",
    "spec_hash",
    "agreement_hash",
    "CoordinatorCore",
    # re-exported from runtime.protocol.messages for actors/client, which imports them here
    "AbortRun",
    "Apply",
    "Commit",
    "Go",
    "Hold",
    "JoinRefused",
    "ResyncOrder",
    "Shutdown",
    "Signature",
    "StartRun",
    "message_from_wire",
]

Message = CoordinatorMessage
"""What the coordinator sends a worker."""

_MAX_WORLD = 1 << 16


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Tick:
    """The shell's clock reads ``now`` seconds: time to check heartbeat deadlines."""

    now: float


@dataclass(frozen=True)
class Disconnected:
    """Rank ``rank``'s accepted connection closed or failed."""

    rank: int
    reason: str


@dataclass(frozen=True)
class Malformed:
    """Rank ``rank`` sent something the shell could not parse (``error``: the ProtocolError)."""

    rank: int
    error: str


Event = (
    Joined
    | Ready
    | Reduced
    | Digest
    | StepDone
    | Heartbeat
    | Finished
    | Tick
    | Disconnected
    | Malformed
)
"""What the shell feeds :meth:`CoordinatorCore.handle`."""

# --------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Send:
    """Send ``message`` to rank ``rank``."""

    rank: int
    message: Message


@dataclass(frozen=True)
class Broadcast:
    """Send ``message`` to every member."""

    message: Message


@dataclass(frozen=True)
class Refuse:
    """Refuse the connection whose event was just handled: send ``message``, then close it.

    The run goes on; this rank's accepted connection, if any, is untouched.
    """

    rank: int
    reason: str

    @property
    def message(self) -> JoinRefused:
        return JoinRefused(self.reason)


@dataclass(frozen=True)
class Abort:
    """Stop the run: send ``message`` to every member, close everything."""

    reason: str

    @property
    def message(self) -> AbortRun:
        return AbortRun(self.reason)


@dataclass(frozen=True)
class Resync:
    """Before the commit that follows: ``source_rank`` sends its state to ``targets``.

    Send ``message`` to every rank of ``recipients`` (the source and the targets).
    """

    step: int
    source_rank: int
    targets: tuple[int, ...]

    @property
    def message(self) -> ResyncOrder:
        return ResyncOrder(self.step, self.source_rank, self.targets)

    @property
    def recipients(self) -> tuple[int, ...]:
        return (self.source_rank, *self.targets)


@dataclass(frozen=True)
class Evict:
    """Drop member ``rank`` from the run (elastic runs): tell it ``message``, close its link."""

    rank: int
    reason: str

    @property
    def message(self) -> AbortRun:
        return AbortRun(f"rank {self.rank} was removed from the run: {self.reason}")


@dataclass(frozen=True)
class Report:
    """Log ``text`` (a stall, a membership change): nothing to send."""

    text: str
    level: str = "warning"


Action = Send | Broadcast | Refuse | Abort | Resync | Evict | Report
"""What :meth:`CoordinatorCore.handle` asks the shell to do, in order."""


# --------------------------------------------------------------------------- helpers


def dtype_name(dtype: object) -> str:
    """The dtype string signatures and specs use: ``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def model_signature(named_parameters: Iterable[tuple[str, Any]]) -> Signature:
    """A model's signature from ``model.named_parameters()`` (anything with shape and dtype)."""
    return tuple(
        (name, tuple(int(d) for d in p.shape), dtype_name(p.dtype), bool(p.requires_grad))
        for name, p in named_parameters
    )


def bucket_spec(tensors: Iterable[Any]) -> BucketSpec:
    """A bucket's spec from its gradient tensors, in bucket order."""
    return tuple((tuple(int(d) for d in t.shape), dtype_name(t.dtype)) for t in tensors)


def _seconds(value: float) -> str:
    return f"{value:.1f}" if abs(value - round(value, 1)) < 1e-9 else f"{value:.3g}"


def spec_hash(spec: BucketSpec | Sequence[Any]) -> str:
    """A bucket spec's short text form, ``"xxh3:"`` and 32 hex digits: what a worker sends in
    a cached ``ready`` instead of the whole spec (one string instead of every shape, on every
    step). Takes a normalized spec or the worker's ``[[dims], dtype]`` list; a hash string is
    its own hash."""
    if isinstance(spec, str):
        return spec
    text = ";".join(f"{','.join(str(d) for d in shape)}:{dtype}" for shape, dtype in spec)
    return "xxh3:" + xxhash.xxh3_128_hexdigest(text.encode())


def agreement_hash(spec_hashes: Mapping[int, str]) -> str:
    """The hash of a whole response-cache agreement, bucket -> `spec_hash`: what a folding
    worker's step report carries for the buckets it reduced without reporting them."""
    text = ";".join(f"{bucket}={spec_hashes[bucket]}" for bucket in sorted(spec_hashes))
    return "xxh3:" + xxhash.xxh3_128_hexdigest(text.encode())


def _spec_text(spec: BucketSpec) -> str:
    if isinstance(spec, str):
        return f"spec {spec!r}"
    return "[" + "; ".join(f"{shape}, {dtype}" for shape, dtype in spec) + "]"


def _signature_mismatch(mine: Signature, ref: Signature) -> str | None:
    """Where ``mine`` first differs from ``ref``: "at parameter 'x': ..." (None if equal)."""
    mine_names = {p[0] for p in mine}
    ref_names = {p[0] for p in ref}
    for index, (m, r) in enumerate(zip(mine, ref)):
        if m[0] != r[0]:
            if r[0] not in mine_names:
                return f"at parameter {r[0]!r}: missing"
            if m[0] not in ref_names:
                return f"at parameter {m[0]!r}: extra parameter"
            return f"at position {index}: parameter {m[0]!r} vs {r[0]!r} (order differs)"
        if m[1] != r[1]:
            return f"at parameter {m[0]!r}: shape {m[1]} vs {r[1]}"
        if m[2] != r[2]:
            return f"at parameter {m[0]!r}: dtype {m[2]} vs {r[2]}"
        if m[3] != r[3]:
            return f"at parameter {m[0]!r}: requires_grad {m[3]} vs {r[3]}"
    if len(mine) < len(ref):
        return f"at parameter {ref[len(mine)][0]!r}: missing"
    if len(mine) > len(ref):
        return f"at parameter {mine[len(ref)][0]!r}: extra parameter"
    return None


def _first_tensor_difference(
    mine: tuple[tuple[str, bytes], ...], ref: tuple[tuple[str, bytes], ...]
) -> str:
    for (m_name, m_digest), (r_name, r_digest) in zip(mine, ref):
        if m_name != r_name:
            return f"tensor {m_name!r} (where it has {r_name!r})"
        if m_digest != r_digest:
            return f"tensor {m_name!r}"
    if len(mine) < len(ref):
        return f"tensor {ref[len(mine)][0]!r} (missing)"
    if len(mine) > len(ref):
        return f"tensor {mine[len(ref)][0]!r} (extra)"
    return "no listed tensor (every per-tensor digest matches)"


# --------------------------------------------------------------------------- the core


class RunState(enum.Enum):
    """Where the run is."""

    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    HOLDING = "holding"
    FINISHED = "finished"
    ABORTED = "aborted"


_DONE = (RunState.FINISHED, RunState.ABORTED)


@dataclass(frozen=True)
class EpochRecord:
    """One membership epoch: from step ``step`` on, ``members`` train together."""

    epoch: int
    step: int
    members: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class CommitRecord:
    """Step ``step`` committed in ``epoch`` by ``members``, with digests from ``digests``."""

    step: int
    epoch: int
    members: tuple[int, ...]
    digests: tuple[int, ...]


class CoordinatorCore:
    """The coordinator's state machine: feed it events, execute the actions it returns.

    ``world_size`` is the number of worker slots (ranks 0..world_size-1) and the size the run
    starts with; ``signature`` fixes the reference model (else the first worker to join does);
    ``digest_interval``: steps with ``step % digest_interval == 0`` end with digests, others
    with step_done; ``resync``: on diverged digests with a strict majority, resync the minority
    from the lowest good rank instead of aborting; ``heartbeat_deadline``: seconds of silence
    after which a member is lost; ``ring``: the first epoch's ring order; ``start_step``: the
    first step of a fresh run.

    Elastic runs (``min_workers < world_size``): a lost or misbehaving member ends its epoch
    instead of the run. The step in flight is dropped unless every member already holds its
    reduced gradients (``apply`` sent), the survivors form a new epoch, and a joiner enters the
    next epoch after receiving a healthy member's whole state. Below ``min_workers`` the run
    holds for ``rejoin_seconds``, then aborts. ``rendezvous_seconds``: after a restart, start
    with at least ``min_workers`` once no one joined for that long.

    ``stall_seconds``: report (a `Report`) which ranks the step waits for, and in which phase,
    when nothing moved for that long; ``stall_deadline``: then drop them (elastic) or abort.
    """

    def __init__(
        self,
        world_size: int,
        *,
        signature: Iterable[ParamSpec] | None = None,
        digest_interval: int = 1,
        resync: bool = False,
        heartbeat_deadline: float = 10.0,
        ring: Sequence[int] | None = None,
        start_step: int = 0,
        min_workers: int | None = None,
        rejoin_seconds: float = 60.0,
        rendezvous_seconds: float = 5.0,
        stall_seconds: float = 60.0,
        stall_deadline: float | None = None,
    ) -> None:
        if not _is_int(world_size) or not 1 <= world_size <= _MAX_WORLD:
            raise ValueError(f"world_size must be in [1, {_MAX_WORLD}], got {world_size!r}")
        if not _is_int(digest_interval) or digest_interval < 1:
            raise ValueError(f"digest_interval must be a positive int, got {digest_interval!r}")
        if not heartbeat_deadline > 0:
            raise ValueError(f"heartbeat_deadline must be positive, got {heartbeat_deadline!r}")
        if not _is_int(start_step) or start_step < 0:
            raise ValueError(f"start_step must be a non-negative int, got {start_step!r}")
        min_workers = world_size if min_workers is None else min_workers
        if not _is_int(min_workers) or not 1 <= min_workers <= world_size:
            raise ValueError(f"min_workers must be in [1, {world_size}], got {min_workers!r}")
        for name, value in (
            ("rejoin_seconds", rejoin_seconds),
            ("rendezvous_seconds", rendezvous_seconds),
            ("stall_seconds", stall_seconds),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        if stall_deadline is not None and not stall_deadline > 0:
            raise ValueError(f"stall_deadline must be positive, got {stall_deadline!r}")
        ring = tuple(range(world_size)) if ring is None else tuple(ring)
        if sorted(ring) != list(range(world_size)):
            raise ValueError(f"ring {list(ring)} is not a permutation of ranks 0..{world_size - 1}")
        self._n = world_size
        self._min = min_workers
        self._elastic = min_workers < world_size
        self._interval = digest_interval
        self._resync = bool(resync)
        self._deadline = float(heartbeat_deadline)
        self._rejoin = float(rejoin_seconds)
        self._rendezvous = float(rendezvous_seconds)
        self._stall = float(stall_seconds)
        self._stall_deadline = stall_deadline
        self._ring = ring
        self._start_step = start_step
        self._reference: Signature | None = None
        self._reference_rank: int | None = None
        if signature is not None:
            self._reference = normalize_signature(tuple(signature))
        self._state = RunState.RENDEZVOUS
        self._addresses: dict[int, tuple[str, int]] = {}
        self._joins: dict[int, Joined] = {}
        self._last_heartbeat: dict[int, float | None] = {}
        self._members: tuple[int, ...] = ()
        self._epoch = 0
        self._history: list[EpochRecord] = []
        self._recovering = False
        self._step = start_step
        self._applied = False
        self._verifying = False
        self._seq = 0
        self._abort_reason: str | None = None
        self._finished: set[int] = set()
        self._pending: dict[int, dict[int, BucketSpec]] = {}
        self._plain: set[int] = set()
        """Buckets of this step with a report that waits for a go (not from the cache)."""
        self._reported: dict[int, set[int]] = {}
        """Buckets each rank has reported ready for this step."""
        self._fold = False
        """Whether this epoch's members fold cached bucket reports into their step reports."""
        self._tensor_names: dict[int, tuple[str, ...]] = {}
        """Per member: the names of its packed per-tensor digests, as last listed this epoch."""
        self._agreed: dict[int, tuple[BucketSpec, str]] = {}
        """Bucket specs every member agreed on (a go was sent) in this epoch, with their
        `spec_hash`: the response cache. A report marked cached must match the spec or its
        hash; a new epoch starts without one."""
        self._gone: set[int] = set()
        self._reduced: set[int] = set()
        self._done: dict[int, Digest | StepDone] = {}
        self._early: list[Ready] = []
        self._last_commit: CommitRecord | None = None
        self._now: float | None = None
        self._last_join_at: float | None = None
        self._hold_since: float | None = None
        self._progress = 0
        self._stall_seen = -1
        self._stall_since: float | None = None
        self._stall_reports = 0
        self.stale_messages = 0
        """Messages of an earlier epoch, dropped (they raced a membership change)."""

    # ------------------------------------------------------------------- observability

    @property
    def state(self) -> RunState:
        return self._state

    @property
    def step(self) -> int:
        """The step now running (the next one to commit)."""
        return self._step

    @property
    def seq(self) -> int:
        """The seq the next Go will carry (= Gos sent so far, counted from 0)."""
        return self._seq

    @property
    def world_size(self) -> int:
        """The number of worker slots."""
        return self._n

    @property
    def min_workers(self) -> int:
        return self._min

    @property
    def elastic(self) -> bool:
        """Whether the run survives the loss of a member (``min_workers < world_size``)."""
        return self._elastic

    @property
    def epoch(self) -> int:
        """The membership epoch (0 before the start; grows by one per membership change)."""
        return self._epoch

    @property
    def members(self) -> tuple[int, ...]:
        """The current epoch's members by ring position; before the start, the joined ranks."""
        if self._epoch == 0:
            return tuple(sorted(self._addresses))
        return self._members

    @property
    def joined(self) -> tuple[int, ...]:
        """Every rank with a live join (members and joiners waiting for an epoch), ascending."""
        return tuple(sorted(self._addresses))

    @property
    def history(self) -> tuple[EpochRecord, ...]:
        """Every epoch so far: where it started and who was in it."""
        return tuple(self._history)

    @property
    def last_commit(self) -> CommitRecord | None:
        return self._last_commit

    @property
    def addresses(self) -> Mapping[int, tuple[str, int]]:
        return MappingProxyType(dict(self._addresses))

    @property
    def last_heartbeat(self) -> Mapping[int, float | None]:
        """Each member's last heartbeat (or join) time; None: not known until the next Tick."""
        return MappingProxyType(dict(self._last_heartbeat))

    @property
    def abort_reason(self) -> str | None:
        return self._abort_reason

    @property
    def reference_signature(self) -> Signature | None:
        return self._reference

    @property
    def digest_interval(self) -> int:
        return self._interval

    @property
    def applied(self) -> bool:
        """Whether every member holds this step's reduced gradients (``apply`` was sent)."""
        return self._applied

    @property
    def pending_buckets(self) -> Mapping[int, tuple[int, ...]]:
        """Buckets of this step some rank reported ready, not yet sent a Go: bucket -> ranks."""
        return MappingProxyType({b: tuple(sorted(r)) for b, r in self._pending.items()})

    def is_digest_step(self, step: int) -> bool:
        return step % self._interval == 0

    # ------------------------------------------------------------------- dispatch

    def handle(self, event: Event) -> list[Action]:
        """Feed one event; return the actions to execute, in order.

        Inconsistent input becomes an Abort (or, in elastic runs, the loss of the rank that
        sent it), never an exception; once the run is FINISHED or ABORTED every event returns
        []. Raises TypeError only for an object that is no event.
        """
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"not a coordinator event: {type(event).__name__}")
        if self._state in _DONE:
            return []
        return handler(self, event)

    def _abort(self, reason: str) -> list[Action]:
        self._state = RunState.ABORTED
        self._abort_reason = reason
        return [Abort(reason)]

    def _fault(self, rank: int, reason: str) -> list[Action]:
        """``rank`` broke the protocol: drop it from an elastic run, else stop the run."""
        if not self._elastic:
            return self._abort(reason)
        return [Evict(rank, reason), *self._lose(rank, reason)]

    def _observe(self, now: float) -> None:
        self._now = now if self._now is None else max(self._now, now)
        for rank, seen in self._last_heartbeat.items():
            if seen is None:
                self._last_heartbeat[rank] = now

    def _stale(self, epoch: int) -> bool:
        """Whether a run message of ``epoch`` raced a membership change and is to be dropped."""
        if epoch < self._epoch:
            self.stale_messages += 1
            return True
        return False

    # ------------------------------------------------------------------- membership

    def _check_join(self, event: Joined) -> str | None:
        rank = event.rank
        if not 0 <= rank < self._n:
            return f"rank {rank} is out of range for a world of {self._n} ranks"
        if rank in self._addresses:
            return f"rank {rank} has already joined"
        for other, address in self._addresses.items():
            if address == event.address:
                host, port = address
                return f"rank {rank}'s address {host}:{port} is rank {other}'s"
        if self._reference is not None:
            where = _signature_mismatch(event.signature, self._reference)
            if where is not None:
                ref = (
                    "the reference model"
                    if self._reference_rank is None
                    else f"rank {self._reference_rank}'s"
                )
                return f"rank {rank}'s model differs from {ref} {where}"
        return None

    def _on_joined(self, event: Joined) -> list[Action]:
        rank = event.rank
        if self._state is RunState.RUNNING and not self._elastic:
            return [Refuse(rank, f"rank {rank} cannot join: the run has already started")]
        refusal = self._check_join(event)
        if refusal is not None:
            return [Refuse(rank, refusal)]
        if self._reference is None:
            self._reference = event.signature
            self._reference_rank = rank
        self._addresses[rank] = event.address
        self._joins[rank] = event
        self._last_heartbeat[rank] = event.now
        if event.now is not None:
            self._observe(event.now)
        self._last_join_at = event.now if event.now is not None else self._now
        if self._state is RunState.RENDEZVOUS:
            if len(self._addresses) < self._n:
                return []
            return self._first_epoch()
        # An elastic run: the joiner enters a new epoch now, taking a member's state.
        joiners = tuple(r for r in self._addresses if r not in self._members)
        if self._state is RunState.HOLDING and len(self._addresses) < self._min:
            return [
                Report(f"rank {rank} joined; waiting for {self._min - len(self._addresses)} more")
            ]
        return self._next_epoch(f"rank {rank} joined", joiners)

    def _first_epoch(self) -> list[Action]:
        """Everyone is in: the first epoch starts from the most advanced state reported."""
        joins = self._joins
        top = max(j.step for j in joins.values())
        if top == 0:
            # A fresh run: position 0's weights go to everyone.
            return self._start_epoch(
                self._start_step, tuple(sorted(joins)), "the run starts", broadcast=True
            )
        # Resumed workers (a checkpoint, a restarted coordinator): the majority state at the
        # newest step is the donor's; everyone else receives it.
        ahead = [r for r in sorted(joins) if joins[r].step == top]
        votes = Counter(joins[r].digest for r in ahead)
        best = max(votes.values())
        digest = next(joins[r].digest for r in ahead if votes[joins[r].digest] == best)
        donor = next(r for r in ahead if joins[r].digest == digest)
        receivers = tuple(
            r for r in sorted(joins) if joins[r].step != top or joins[r].digest != digest
        )
        self._epoch = max(self._epoch, max(j.epoch for j in joins.values()))
        actions = self._start_epoch(
            top, tuple(sorted(joins)), f"the run resumes at step {top}", donor, receivers
        )
        self._recovering = True  # report the first commit after the restart
        given = f"; rank {donor} sends its state to ranks {list(receivers)}" if receivers else ""
        text = (
            f"the run resumes at step {top} in epoch {self._epoch} with ranks "
            f"{list(sorted(joins))}{given}"
        )
        return [Report(text, "info"), *actions]

    def _start_epoch(
        self,
        step: int,
        members: tuple[int, ...],
        reason: str,
        donor: int = -1,
        receivers: tuple[int, ...] = (),
        *,
        broadcast: bool = False,
    ) -> list[Action]:
        """Open a new epoch of ``members`` at ``step`` and tell them (a StartRun)."""
        first = self._epoch == 0 or not self._history
        self._epoch += 1
        self._members = members
        self._state = RunState.RUNNING
        self._hold_since = None
        broadcast = broadcast or step == 0
        if broadcast:
            donor, receivers = -1, ()
        self._step = step if broadcast or step == 0 else step - 1
        self._verifying = not broadcast and step > 0
        self._applied = self._verifying
        self._pending, self._gone, self._reduced, self._done, self._early = {}, set(), set(), {}, []
        self._plain, self._reported, self._agreed = set(), {}, {}
        self._tensor_names = {}
        self._finished = set()
        self._progress += 1
        ring = self._ring if first and len(members) == self._n else tuple(range(len(members)))
        self._fold = all(r in self._joins and self._joins[r].fold for r in members)
        start = StartRun(
            addresses=tuple(self._addresses[r] for r in members),
            ring=ring,
            step=step,
            digest_interval=self._interval,
            heartbeat_deadline=self._deadline,
            epoch=self._epoch,
            members=members,
            donor=donor,
            receivers=receivers,
            broadcast=broadcast,
            apply_barrier=self._elastic,
            fold=self._fold,
        )
        self._history.append(EpochRecord(self._epoch, step, members, reason))
        self._recovering = not first
        actions: list[Action] = [Broadcast(start)]
        if not first:
            actions.insert(
                0,
                Report(
                    f"epoch {self._epoch} starts at step {step} with ranks {list(members)} "
                    f"({reason})",
                    "info",
                ),
            )
        return actions

    def _resume_step(self) -> int:
        """Where a new epoch starts: after this step if every member holds its gradients."""
        return self._step + 1 if self._applied else self._step

    def _next_epoch(self, reason: str, joiners: tuple[int, ...] = ()) -> list[Action]:
        survivors = tuple(r for r in self._members if r in self._addresses)
        members = tuple(sorted(set(survivors) | set(joiners)))
        step = self._resume_step()
        if not survivors:
            # Nobody holds the run's state any more; joiners cannot be given it.
            return self._abort(f"{reason}: no worker holding the run's state remains")
        return self._start_epoch(step, members, reason, min(survivors), tuple(sorted(joiners)))

    def _lose(self, rank: int, reason: str) -> list[Action]:
        """``rank`` is gone (dead, silent, cut off or evicted)."""
        if rank not in self._addresses:
            return []
        if not self._elastic:
            # A static run ends with its membership as it was (every joined rank a member).
            return self._abort(f"rank {rank} {reason}")
        del self._addresses[rank]
        self._joins.pop(rank, None)
        self._last_heartbeat.pop(rank, None)
        if self._state is RunState.RENDEZVOUS:
            return [Report(f"rank {rank} left before the start: {reason}")]
        if rank not in self._members:
            return [Report(f"joining rank {rank} left: {reason}")]
        lost = f"rank {rank} {reason}"
        head = f"step {self._resume_step()}, epoch {self._epoch}: {lost}"
        survivors = [r for r in self._members if r in self._addresses]
        if len(self._addresses) >= self._min and survivors:
            joiners = tuple(r for r in self._addresses if r not in self._members)
            return [Report(head, "error"), *self._next_epoch(lost, joiners)]
        return [Report(head, "error"), *self._hold(lost)]

    def _hold(self, reason: str) -> list[Action]:
        """Fewer than ``min_workers`` remain: drop the step in flight and wait for joiners."""
        step = self._resume_step()
        self._epoch += 1
        self._members = tuple(r for r in self._members if r in self._addresses)
        self._state = RunState.HOLDING
        self._hold_since = self._now
        self._step = step - 1 if step > 0 else 0
        self._applied = step > 0
        self._verifying = False
        self._pending, self._gone, self._reduced, self._done, self._early = {}, set(), set(), {}, []
        self._plain, self._reported, self._agreed = set(), {}, {}
        self._tensor_names = {}
        text = (
            f"{reason}; {len(self._addresses)} worker(s) remain, min_workers is {self._min}: "
            f"holding at step {step} for up to {_seconds(self._rejoin)} s for joiners"
        )
        self._history.append(EpochRecord(self._epoch, step, self._members, f"hold: {reason}"))
        return [Broadcast(Hold(step, self._epoch, text)), Report(text, "error")]

    def _run_message(self, rank: int, epoch: int, what: str) -> list[Action] | None:
        """The answer to a run message that cannot be taken now (None: go on)."""
        if rank not in self._addresses:
            return [Refuse(rank, f"rank {rank} sent {what} but has not joined")]
        if self._state is RunState.RENDEZVOUS:
            return self._fault(rank, f"rank {rank} sent {what} before the run started")
        if self._stale(epoch):
            return []
        if epoch > self._epoch:
            return self._fault(
                rank, f"rank {rank} sent {what} for epoch {epoch}, but the run is at {self._epoch}"
            )
        if rank not in self._members or self._state is RunState.HOLDING:
            return self._fault(rank, f"rank {rank} sent {what} while not in a running epoch")
        if self._finished:
            return self._fault(
                rank,
                f"rank {rank} sent {what} after ranks {sorted(self._finished)} finished the run "
                f"at step {self._step}",
            )
        return None

    # ------------------------------------------------------------------- buckets

    def _on_ready(self, event: Ready) -> list[Action]:
        rank, step, bucket = event.rank, event.step, event.bucket
        early = self._run_message(rank, event.epoch, f"bucket {bucket} ready for step {step}")
        if early is not None:
            return early
        if step == self._step + 1:
            # Step s+1's backward may finish before step s's digests are in: hold the report
            # until step s commits (no Go for s+1 before that; a cached report, already being
            # reduced, is checked then), keeping the check off the critical path.
            if any(e.rank == rank and e.bucket == bucket for e in self._early):
                return self._fault(rank, f"step {step}: rank {rank} reported bucket {bucket} twice")
            self._early.append(event)
            self._progress += 1
            return []
        if step != self._step or self._verifying:
            return self._fault(
                rank,
                f"rank {rank} reported bucket {bucket} ready for step {step}, "
                f"but the run is at step {self._resume_step()}",
            )
        if rank in self._done or rank in self._reduced or self._applied:
            return self._fault(
                rank,
                f"step {step}: rank {rank} reported bucket {bucket} ready after finishing the step",
            )
        reports = self._pending.get(bucket, {})
        if bucket in self._gone or rank in reports:
            return self._fault(rank, f"step {step}: rank {rank} reported bucket {bucket} twice")
        agreement = self._agreed.get(bucket)
        agreed = None if agreement is None else agreement[0]
        if event.cached:
            # The rank is already reducing: check its report against the epoch's agreement.
            # It may trail a peer's step end (links race), but that peer must have reported
            # the bucket too: its own reports precede its step end on its link.
            if agreed is None:
                return self._fault(
                    rank,
                    f"step {step} bucket {bucket}: rank {rank} reduced it without a go, but the "
                    f"members agreed on no spec for bucket {bucket} in epoch {self._epoch}",
                )
            if event.spec != agreed and event.spec != agreement[1]:
                return self._fault(
                    rank,
                    f"step {step} bucket {bucket}: rank {rank} reduced shapes "
                    f"{_spec_text(event.spec)} without a go, but the members agreed on "
                    f"{_spec_text(agreed)} in epoch {self._epoch}",
                )
            finished = set(self._done) | self._reduced
            without = sorted(r for r in finished if bucket not in self._reported.get(r, ()))
            if without:
                return self._fault(
                    rank,
                    f"step {step}: rank {rank} reported bucket {bucket} ready after ranks "
                    f"{without} finished the step without it",
                )
        else:
            if self._done or self._reduced:
                finished = sorted(set(self._done) | self._reduced)
                return self._fault(
                    rank,
                    f"step {step}: rank {rank} reported bucket {bucket} ready after ranks "
                    f"{finished} finished the step without it",
                )
            self._plain.add(bucket)  # negotiated: the go, if all agree, updates the agreement
        reports = self._pending.setdefault(bucket, {})
        # A cached report matched the agreement (spec or hash): compare peers by the spec.
        reports[rank] = agreed if event.cached else event.spec
        self._reported.setdefault(rank, set()).add(bucket)
        self._progress += 1
        if len(set(reports.values())) > 1:
            return self._abort(f"step {step} bucket {bucket}: {self._spec_groups(reports)}")
        if len(reports) < len(self._members):
            return []
        del self._pending[bucket]
        self._gone.add(bucket)
        if bucket not in self._plain:
            return []  # every member reduced it from the agreement: no go to send
        self._plain.discard(bucket)
        if not event.cached:  # a cached report matched the agreement: it stands as it is
            self._agreed[bucket] = (event.spec, spec_hash(event.spec))
        go = Go(step, bucket, self._seq, self._epoch)
        self._seq += 1
        return [Broadcast(go)]

    def _close_buckets(self, event: Reduced | Digest | StepDone, what: str) -> list[Action] | None:
        """The step's buckets as of ``event``, a rank's first report of its step end: take a
        folded report (``cached``) as each bucket's, then a fault if one is still outstanding
        for the rank (`_unfinished_buckets`)."""
        if event.cached:
            folded = self._fold_reports(event.rank, event.step, event.epoch, event.cached)
            if folded:
                return folded
        return self._unfinished_buckets(event.rank, event.step, what)

    def _fold_reports(self, rank: int, step: int, epoch: int, cached: str) -> list[Action]:
        """A step report says ``rank`` reduced every bucket from the response cache under the
        agreement ``cached``: check that, then take it as a cached report of each bucket."""
        if not self._fold:
            return self._fault(
                rank,
                f"step {step}: rank {rank} folded its bucket reports into its step report, but "
                f"not every member of epoch {self._epoch} joined offering to fold",
            )
        hashes = {bucket: agreement[1] for bucket, agreement in self._agreed.items()}
        expected = agreement_hash(hashes) if hashes else "none"
        if cached != expected:
            return self._fault(
                rank,
                f"step {step}: rank {rank} reduced its buckets from the response cache under "
                f"agreement {cached}, but the members agreed on {expected} in epoch "
                f"{self._epoch}",
            )
        for bucket in sorted(hashes):
            actions = self._on_ready(Ready(rank, step, bucket, hashes[bucket], epoch, cached=True))
            if actions:
                return actions
        return []

    def _unfinished_buckets(self, rank: int, step: int, what: str) -> list[Action] | None:
        """A fault if ``rank`` ends ``step`` (``what``) with a bucket outstanding: one still
        negotiated (no go yet), or one that peers reduced from the cache and it never reported
        (its peers' reports may still be on their way: those are checked as they come)."""
        for bucket in sorted(self._pending):
            reports = self._pending[bucket]
            if bucket in self._plain:
                return self._fault(
                    rank,
                    f"step {step}: rank {rank} {what} while bucket {bucket} is still being "
                    f"negotiated (ready from ranks {sorted(reports)})",
                )
            if rank not in reports:
                return self._fault(
                    rank,
                    f"step {step}: rank {rank} {what} without bucket {bucket}, which ranks "
                    f"{sorted(reports)} reduced",
                )
        return None

    @staticmethod
    def _spec_groups(reports: Mapping[int, BucketSpec]) -> str:
        groups: dict[BucketSpec, list[int]] = {}
        for rank in sorted(reports):
            groups.setdefault(reports[rank], []).append(rank)
        parts = []
        for index, (spec, ranks) in enumerate(groups.items()):
            text = _spec_text(spec)
            if index == 0 and not isinstance(spec, str):
                text = "shapes " + text
            parts.append(f"ranks {ranks} report {text}")
        return ", ".join(parts)

    def _on_reduced(self, event: Reduced) -> list[Action]:
        rank, step = event.rank, event.step
        early = self._run_message(rank, event.epoch, f"reduced for step {step}")
        if early is not None:
            return early
        if not self._elastic:
            return self._fault(rank, f"rank {rank} sent reduced, but the run has no apply barrier")
        if step != self._step or self._verifying:
            return self._fault(
                rank,
                f"rank {rank} sent reduced for step {step}, but the run is at step "
                f"{self._resume_step()}",
            )
        if rank in self._reduced or self._applied:
            return self._fault(rank, f"step {step}: rank {rank} sent reduced twice")
        unfinished = self._close_buckets(event, "sent reduced")
        if unfinished is not None:
            return unfinished
        self._reduced.add(rank)
        self._progress += 1
        if len(self._reduced) < len(self._members):
            return []
        self._applied = True
        return [Broadcast(Apply(step, self._epoch))]

    # ------------------------------------------------------------------- steps

    def _on_step_end(self, event: Digest | StepDone) -> list[Action]:
        rank, step = event.rank, event.step
        what = "a digest" if isinstance(event, Digest) else "step_done"
        early = self._run_message(rank, event.epoch, f"{what} for step {step}")
        if early is not None:
            return early
        if step != self._step:
            return self._fault(
                rank,
                f"rank {rank} sent {what} for step {step}, but the run is at step {self._step}",
            )
        digest_step = self._verifying or self.is_digest_step(step)
        if isinstance(event, Digest) != digest_step:
            expected = "a digest" if digest_step else "step_done"
            kind = "a digest step" if digest_step else "not a digest step"
            return self._fault(
                rank,
                f"rank {rank} sent {what} for step {step}, which is {kind} "
                f"(digest_interval {self._interval}): expected {expected}",
            )
        if rank in self._done:
            return self._fault(rank, f"step {step}: rank {rank} finished the step twice")
        unfinished = self._close_buckets(event, "finished the step")
        if unfinished is not None:
            return unfinished
        if self._elastic and not self._applied:
            return self._fault(
                rank, f"step {step}: rank {rank} sent {what} before every member reduced"
            )
        if isinstance(event, Digest) and event.packed is not None:
            unnamed = self._name_packed(event)
            if unnamed is not None:
                return unnamed
        self._done[rank] = event
        self._progress += 1
        if len(self._done) < len(self._members):
            return []
        if digest_step:
            return self._verdict()
        return self._commit()

    def _commit(self) -> list[Action]:
        commit = Commit(self._step, self._epoch)
        recovered: list[Action] = []
        if self._recovering and not self._verifying:
            self._recovering = False
            recovered.append(
                Report(
                    f"epoch {self._epoch} recovered: step {self._step} committed by ranks "
                    f"{list(self._members)}",
                    "info",
                )
            )
        self._last_commit = CommitRecord(
            self._step,
            self._epoch,
            self._members,
            tuple(sorted(r for r, d in self._done.items() if isinstance(d, Digest))),
        )
        self._step += 1
        self._applied = False
        self._verifying = False
        self._pending = {}
        self._plain = set()
        self._reported = {}
        self._gone = set()
        self._reduced = set()
        self._done = {}
        actions: list[Action] = [Broadcast(commit), *recovered]
        early, self._early = self._early, []
        for event in early:
            actions += self._on_ready(event)
            if self._state is not RunState.RUNNING:
                break
        return actions

    def _verdict(self) -> list[Action]:
        """All digests of this step are in: commit, resync or abort."""
        step = self._step
        reports: dict[int, Digest] = {r: d for r, d in self._done.items() if isinstance(d, Digest)}
        counts = Counter(d.digest for d in reports.values())
        if len(counts) == 1:
            return self._commit()
        size = len(self._members)
        top, votes = counts.most_common(1)[0]
        if votes * 2 > size:
            good = sorted(r for r, d in reports.items() if d.digest == top)
            bad = sorted(r for r, d in reports.items() if d.digest != top)
            if self._resync:
                return [Resync(step, good[0], tuple(bad)), *self._commit()]
            head = (
                f"step {step}: parameter digests diverged: ranks {bad} differ from the majority "
                f"(ranks {good})"
            )
            return self._abort(f"{head}; {self._tensor_report(reports, good[0], bad)}")
        groups: dict[bytes, list[int]] = {}
        for rank in sorted(reports):
            groups.setdefault(reports[rank].digest, []).append(rank)
        listing = ", ".join(f"ranks {ranks} have {d.hex()[:12]}" for d, ranks in groups.items())
        ref = min(reports)
        others = [r for r in sorted(reports) if reports[r].digest != reports[ref].digest]
        return self._abort(
            f"step {step}: parameter digests diverged with no majority: {listing}; "
            f"{self._tensor_report(reports, ref, others)}"
        )

    def _name_packed(self, event: Digest) -> list[Action] | None:
        """Keep the names of a packed digest's tensors (listed, or the rank's last ones this
        epoch); a fault if there are none or they do not fit."""
        rank = event.rank
        names = event.names if event.names is not None else self._tensor_names.get(rank)
        if names is None:
            return self._fault(
                rank,
                f"step {event.step}: rank {rank} sent packed per-tensor digests without their "
                f"names, and listed none before in epoch {self._epoch}",
            )
        assert event.packed is not None
        if packed_size(event.packed, len(names)) is None:
            return self._fault(
                rank,
                f"step {event.step}: rank {rank} sent {len(event.packed)} bytes of per-tensor "
                f"digests for the {len(names)} tensors it listed",
            )
        self._tensor_names[rank] = names
        return None

    def _tensor_report(self, reports: Mapping[int, Digest], ref: int, ranks: Sequence[int]) -> str:
        def pairs(rank: int) -> tuple[tuple[str, bytes], ...]:
            return reports[rank].pairs(self._tensor_names.get(rank))

        shown = [
            f"rank {r} first differs from rank {ref} at "
            + _first_tensor_difference(pairs(r), pairs(ref))
            for r in ranks[:4]
        ]
        if len(ranks) > 4:
            shown.append(f"{len(ranks) - 4} more")
        return "; ".join(shown)

    def _on_finished(self, event: Finished) -> list[Action]:
        rank, step = event.rank, event.step
        if rank not in self._addresses:
            return [Refuse(rank, f"rank {rank} sent finished but has not joined")]
        if self._state is RunState.RENDEZVOUS:
            return self._fault(rank, f"rank {rank} sent finished before the run started")
        if self._stale(event.epoch):
            return []
        if event.epoch > self._epoch or rank not in self._members:
            return self._fault(rank, f"rank {rank} sent finished outside its epoch")
        if self._state is RunState.HOLDING:
            return self._fault(rank, f"rank {rank} sent finished while the run holds")
        if rank in self._finished:
            return self._fault(rank, f"rank {rank} finished the run twice")
        if step != self._step or self._verifying:
            return self._fault(
                rank,
                f"rank {rank} finished the run at step {step}, but the run is at step "
                f"{self._resume_step()}",
            )
        if self._pending or self._gone or self._done or self._early or self._reduced:
            active = set(self._done) | self._reduced | {e.rank for e in self._early}
            for reports in self._pending.values():
                active.update(reports)
            if self._gone:
                active.update(self._members)
            return self._fault(
                rank,
                f"rank {rank} finished the run at step {step}, but ranks {sorted(active)} "
                f"have started step {step}",
            )
        self._finished.add(rank)
        self._progress += 1
        if len(self._finished) < len(self._members):
            return []
        self._state = RunState.FINISHED
        return [Broadcast(Shutdown("finished"))]

    # ------------------------------------------------------------------- liveness

    def _on_heartbeat(self, event: Heartbeat) -> list[Action]:
        self._observe(event.now)
        if event.rank in self._last_heartbeat:
            seen = self._last_heartbeat[event.rank]
            if seen is None or event.now > seen:
                self._last_heartbeat[event.rank] = event.now
        return []

    def _on_tick(self, event: Tick) -> list[Action]:
        now = event.now
        self._observe(now)
        silent = [
            (rank, now - seen)
            for rank, seen in sorted(self._last_heartbeat.items())
            if seen is not None and now - seen > self._deadline
        ]
        actions: list[Action] = []
        if silent:
            if not self._elastic:
                parts = [
                    f"rank {rank} missed heartbeats for {_seconds(gap)} s" for rank, gap in silent
                ]
                return self._abort(f"{'; '.join(parts)} (deadline {_seconds(self._deadline)} s)")
            for rank, gap in silent:
                reason = (
                    f"missed heartbeats for {_seconds(gap)} s "
                    f"(deadline {_seconds(self._deadline)} s)"
                )
                actions += [Evict(rank, reason), *self._lose(rank, reason)]
                if self._state in _DONE:
                    return actions
        if self._state is RunState.HOLDING and self._hold_since is not None:
            if now - self._hold_since > self._rejoin:
                return actions + self._abort(
                    f"only {len(self._addresses)} worker(s) remain (ranks {self.joined}), "
                    f"fewer than min_workers={self._min}, and none joined within "
                    f"{_seconds(self._rejoin)} s"
                )
        if (
            self._state is RunState.RENDEZVOUS
            and self._elastic
            and len(self._addresses) >= self._min
            and self._last_join_at is not None
            and now - self._last_join_at > self._rendezvous
        ):
            return actions + self._first_epoch()
        if self._state is RunState.RUNNING:
            actions += self._check_stall(now)
        return actions

    # ------------------------------------------------------------------- stalls

    def _check_stall(self, now: float) -> list[Action]:
        if self._progress != self._stall_seen or self._stall_since is None:
            self._stall_seen = self._progress
            self._stall_since = now
            self._stall_reports = 0
            return []
        waited = now - self._stall_since
        if self._stall_deadline is not None and waited > self._stall_deadline:
            phase, ranks = self.waiting_for()
            reason = f"stalled for {_seconds(waited)} s in {phase}"
            if not self._elastic:
                return self._abort(
                    f"step {self._resume_step()}: ranks {list(ranks)} {reason} "
                    f"(stall deadline {_seconds(self._stall_deadline)} s)"
                )
            actions: list[Action] = []
            for rank in ranks:
                actions += [Evict(rank, reason), *self._lose(rank, reason)]
                if self._state is not RunState.RUNNING:
                    break
            return actions
        if waited < self._stall * (self._stall_reports + 1):
            return []
        self._stall_reports += 1
        phase, ranks = self.waiting_for()
        return [
            Report(
                f"stall: step {self._resume_step()} (epoch {self._epoch}) has waited "
                f"{_seconds(waited)} s for ranks {list(ranks)} in {phase}"
            )
        ]

    def waiting_for(self) -> tuple[str, tuple[int, ...]]:
        """What the step in flight waits for: a phase and the ranks it waits on."""
        members = self._members
        if self._verifying:
            missing = tuple(r for r in members if r not in self._done)
            return f"the epoch's state transfer and check of step {self._step}", missing
        if self._applied:
            missing = tuple(r for r in members if r not in self._done)
            return "the optimizer step and digest", missing
        if self._reduced:
            missing = tuple(r for r in members if r not in self._reduced)
            return "the all-reduce", missing
        if self._pending:
            bucket = min(self._pending)
            missing = tuple(r for r in members if r not in self._pending[bucket])
            return f"backward (bucket {bucket} not ready)", missing
        if self._done:
            missing = tuple(r for r in members if r not in self._done)
            return "the all-reduce, optimizer step and digest", missing
        if self._gone:
            return "backward or the all-reduce", members
        started = {e.rank for e in self._early}
        return "data loading and forward", tuple(r for r in members if r not in started)

    # ------------------------------------------------------------------- connections

    def _on_disconnected(self, event: Disconnected) -> list[Action]:
        if event.rank not in self._addresses:
            return []
        return self._lose(event.rank, f"disconnected: {event.reason}")

    def _on_malformed(self, event: Malformed) -> list[Action]:
        if event.rank not in self._addresses:
            return [Refuse(event.rank, f"malformed message: {event.error}")]
        reason = f"sent a malformed message: {event.error}"
        if not self._elastic:
            return self._abort(f"rank {event.rank} {reason}")
        return [Evict(event.rank, reason), *self._lose(event.rank, reason)]

    _handlers: ClassVar[dict[type, Any]] = {
        Joined: _on_joined,
        Ready: _on_ready,
        Reduced: _on_reduced,
        Digest: _on_step_end,
        StepDone: _on_step_end,
        Finished: _on_finished,
        Heartbeat: _on_heartbeat,
        Tick: _on_tick,
        Disconnected: _on_disconnected,
        Malformed: _on_malformed,
    }
