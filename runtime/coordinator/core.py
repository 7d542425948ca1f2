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
Malformed wire input raises :class:`~runtime.errors.ProtocolError` in the ``from_wire`` parsers,
before an event exists.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self

import xxhash

from runtime.errors import ProtocolError
from runtime.protocol.wire import Field, register_message, validate_message

__all__ = [
    "ParamSpec",
    "Signature",
    "BucketSpec",
    "RunState",
    # messages, coordinator -> worker
    "StartRun",
    "Go",
    "Apply",
    "Commit",
    "Hold",
    "ResyncOrder",
    "Shutdown",
    "AbortRun",
    "JoinRefused",
    "Message",
    "message_from_wire",
    # events
    "Joined",
    "Ready",
    "Reduced",
    "Digest",
    "StepDone",
    "Heartbeat",
    "Tick",
    "Disconnected",
    "Finished",
    "Malformed",
    "Event",
    "event_from_wire",
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
]

ParamSpec = tuple[str, tuple[int, ...], str, bool]
"""One parameter of a model signature: (name, shape, dtype name, requires_grad)."""
Signature = tuple[ParamSpec, ...]
"""A model's parameters in registration order."""
BucketSpec = tuple[tuple[tuple[int, ...], str], ...] | str
"""A gradient bucket's layout, ((shape, dtype name), ...), or a hash string of it."""

_MAX_WORLD = 1 << 16
_MAX_ITEMS = 1 << 20
_MAX_INT = 2**63 - 1
_MAX_NAME = 1024
_MAX_DTYPE = 64
_MAX_HASH = 256
_MAX_DIGEST = 64
_MAX_DIMS = 32
_MAX_REASON = 4096

_STEP = Field(int, min=0, max=_MAX_INT)
_BUCKET = Field(int, min=0, max=_MAX_INT)
_REASON = Field(str, max_len=_MAX_REASON)

_EPOCH = Field(int, min=0, max=_MAX_INT)

# worker -> coordinator
register_message(
    "join",
    host=Field(str, max_len=256),
    port=Field(int, min=1, max=65535),
    params=Field(list, max_len=_MAX_ITEMS, items=list),
    step=Field(int, min=0, max=_MAX_INT, required=False),
    digest=Field(bytes, max_len=_MAX_DIGEST, required=False),
    epoch=Field(int, min=0, max=_MAX_INT, required=False),
    fold=Field(bool, required=False),
)
register_message(
    "ready",
    epoch=_EPOCH,
    step=_STEP,
    bucket=_BUCKET,
    spec=Field((list, str), max_len=_MAX_ITEMS),
    cached=Field(bool, required=False),
)
_CACHED = Field(str, required=False, max_len=_MAX_HASH)
register_message("reduced", epoch=_EPOCH, step=_STEP, cached=_CACHED)
register_message(
    "digest",
    epoch=_EPOCH,
    step=_STEP,
    digest=Field(bytes, max_len=_MAX_DIGEST),
    tensors=Field((list, bytes), max_len=_MAX_ITEMS, items=list),
    names=Field(list, required=False, max_len=_MAX_ITEMS, items=str),
    cached=_CACHED,
)
register_message("step_done", epoch=_EPOCH, step=_STEP, cached=_CACHED)
register_message("heartbeat")
register_message("finished", epoch=_EPOCH, step=_STEP)
# coordinator -> worker
register_message(
    "start_run",
    addresses=Field(list, max_len=_MAX_WORLD, items=list),
    ring=Field(list, max_len=_MAX_WORLD, items=int),
    step=_STEP,
    digest_interval=Field(int, min=1, max=_MAX_INT),
    heartbeat_deadline=Field(float, min=0),
    epoch=_EPOCH,
    members=Field(list, max_len=_MAX_WORLD, items=int),
    donor=Field(int, min=-1, max=_MAX_WORLD),
    receivers=Field(list, max_len=_MAX_WORLD, items=int),
    broadcast=Field(bool),
    apply_barrier=Field(bool),
    fold=Field(bool, required=False),
)
register_message(
    "go", epoch=_EPOCH, step=_STEP, bucket=_BUCKET, seq=Field(int, min=0, max=_MAX_INT)
)
register_message("apply", epoch=_EPOCH, step=_STEP)
register_message("commit", epoch=_EPOCH, step=_STEP)
register_message("hold", epoch=_EPOCH, step=_STEP, reason=_REASON)
register_message(
    "resync",
    step=_STEP,
    source=Field(int, min=0, max=_MAX_WORLD),
    targets=Field(list, max_len=_MAX_WORLD, items=int),
)
register_message("shutdown", reason=_REASON)
register_message("abort", reason=_REASON)
register_message("join_refused", reason=_REASON)


# --------------------------------------------------------------------------- validation


def _bad(label: str, detail: str, peer: object) -> ProtocolError:
    return ProtocolError(f"{label} {detail}", peer=peer)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_seq(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray)


def _norm_int(value: Any, label: str, peer: object, lo: int = 0, hi: int = _MAX_INT) -> int:
    if not _is_int(value) or not lo <= value <= hi:
        raise _bad(label, f"must be an int in [{lo}, {hi}], got {value!r:.64}", peer)
    return int(value)


def _norm_str(value: Any, label: str, peer: object, max_len: int) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        raise _bad(label, f"must be a non-empty string of at most {max_len} characters", peer)
    return value


def _norm_shape(value: Any, label: str, peer: object) -> tuple[int, ...]:
    if not _is_seq(value) or len(value) > _MAX_DIMS:
        raise _bad(label, f"must be a list of at most {_MAX_DIMS} dimensions", peer)
    return tuple(_norm_int(dim, f"{label}[{i}]", peer, 0, 2**40) for i, dim in enumerate(value))


def _norm_signature(value: Any, label: str, peer: object) -> Signature:
    if not _is_seq(value) or len(value) > _MAX_ITEMS:
        raise _bad(label, "must be a list of [name, shape, dtype, requires_grad]", peer)
    params = []
    for i, item in enumerate(value):
        where = f"{label}[{i}]"
        if not _is_seq(item) or len(item) != 4:
            raise _bad(where, "must be [name, shape, dtype, requires_grad]", peer)
        name, shape, dtype, requires_grad = item
        if not isinstance(requires_grad, bool):
            raise _bad(where, "requires_grad must be a bool", peer)
        params.append(
            (
                _norm_str(name, f"{where} name", peer, _MAX_NAME),
                _norm_shape(shape, f"{where} shape", peer),
                _norm_str(dtype, f"{where} dtype", peer, _MAX_DTYPE),
                requires_grad,
            )
        )
    return tuple(params)


def _norm_spec(value: Any, label: str, peer: object) -> BucketSpec:
    if isinstance(value, str):
        return _norm_str(value, label, peer, _MAX_HASH)
    if not _is_seq(value) or len(value) > _MAX_ITEMS:
        raise _bad(label, "must be a hash string or a list of [shape, dtype]", peer)
    spec = []
    for i, item in enumerate(value):
        if not _is_seq(item) or len(item) != 2:
            raise _bad(f"{label}[{i}]", "must be [shape, dtype]", peer)
        spec.append(
            (
                _norm_shape(item[0], f"{label}[{i}] shape", peer),
                _norm_str(item[1], f"{label}[{i}] dtype", peer, _MAX_DTYPE),
            )
        )
    return tuple(spec)


def _norm_bytes(value: Any, label: str, peer: object, max_len: int) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview) or len(value) > max_len:
        raise _bad(label, f"must be a byte string of at most {max_len} bytes", peer)
    return bytes(value)


def _norm_tensor_digests(value: Any, label: str, peer: object) -> tuple[tuple[str, bytes], ...]:
    if not _is_seq(value) or len(value) > _MAX_ITEMS:
        raise _bad(label, "must be a list of [name, digest]", peer)
    # Fast path (every step, one entry per tensor): plain lists of [str, bytes] within bounds.
    fast = tuple(
        (item[0], item[1])
        for item in value
        if (type(item) is list or type(item) is tuple)
        and len(item) == 2
        and type(item[0]) is str
        and 0 < len(item[0]) <= _MAX_NAME
        and type(item[1]) is bytes
        and len(item[1]) <= _MAX_DIGEST
    )
    if len(fast) == len(value):
        return fast
    out = []
    for i, item in enumerate(value):
        if not _is_seq(item) or len(item) != 2:
            raise _bad(f"{label}[{i}]", "must be [name, digest]", peer)
        out.append(
            (
                _norm_str(item[0], f"{label}[{i}] name", peer, _MAX_NAME),
                _norm_bytes(item[1], f"{label}[{i}] digest", peer, _MAX_DIGEST),
            )
        )
    return tuple(out)


def _packed_size(packed: bytes, count: int) -> int | None:
    """The size of each of ``count`` digests packed into ``packed``; None if they do not fit
    (sizes 1 to 64 bytes, all equal)."""
    if count == 0:
        return 0 if not packed else None
    size, rest = divmod(len(packed), count)
    return size if not rest and 0 < size <= _MAX_DIGEST else None


def _norm_packed(
    packed: Any, names: Any, label: str, peer: object
) -> tuple[bytes | None, tuple[str, ...] | None]:
    """Normalize packed per-tensor digests and their optional names (checked to fit)."""
    if packed is None:
        if names is not None:
            raise _bad(f"{label} 'names'", "comes only with packed 'tensors' (bytes)", peer)
        return None, None
    packed = _norm_bytes(packed, f"{label} 'tensors'", peer, _MAX_ITEMS)
    if names is None:
        return packed, None
    if not _is_seq(names) or len(names) > _MAX_ITEMS:
        raise _bad(f"{label} 'names'", "must be a list of tensor names", peer)
    if all(type(n) is str and 0 < len(n) <= _MAX_NAME for n in names):
        names = tuple(names)
    else:
        names = tuple(
            _norm_str(n, f"{label} 'names'[{i}]", peer, _MAX_NAME) for i, n in enumerate(names)
        )
    if _packed_size(packed, len(names)) is None:
        raise _bad(
            f"{label} 'tensors'",
            f"holds {len(packed)} bytes, which are not {len(names)} equal digests of 1 to "
            f"{_MAX_DIGEST} bytes (one per name)",
            peer,
        )
    return packed, names


def _norm_address(value: Any, label: str, peer: object) -> tuple[str, int]:
    if not _is_seq(value) or len(value) != 2:
        raise _bad(label, "must be (host, port)", peer)
    return _norm_str(value[0], f"{label} host", peer, 256), _norm_int(
        value[1], f"{label} port", peer, 1, 65535
    )


def _norm_ranks(value: Any, label: str, peer: object) -> tuple[int, ...]:
    if not _is_seq(value):
        raise _bad(label, "must be a list of ranks", peer)
    return tuple(_norm_int(r, f"{label}[{i}]", peer, 0, _MAX_WORLD) for i, r in enumerate(value))


def _expect(message: Mapping[str, Any], kind: str, peer: object = None) -> Mapping[str, Any]:
    """Validate a decoded message against its schema and check that it is a ``kind``."""
    try:
        validate_message(message)
    except ProtocolError as exc:
        raise exc.with_peer(peer) if peer is not None else exc from None
    if message["kind"] != kind:
        raise ProtocolError(
            f"expected a {kind} message, got a {message['kind']} message", peer=peer
        )
    return message


def _clip(reason: str) -> str:
    return reason if len(reason) <= _MAX_REASON else reason[: _MAX_REASON - 3] + "..."


def _spec_wire(spec: BucketSpec) -> list[Any] | str:
    return spec if isinstance(spec, str) else [[list(shape), dtype] for shape, dtype in spec]


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class StartRun:
    """An epoch starts: its members, their data-plane addresses and the ring, the first step.

    ``members[p]`` is the worker at ring position ``p`` (its data-plane rank in this epoch) and
    ``addresses[p]`` its listen address; ``ring`` orders the positions. Before the step:
    ``broadcast``: position 0's weights go to everyone (a fresh run); ``donor`` >= 0: that worker
    sends its whole training state to ``receivers`` (joiners, laggards); then, unless
    ``broadcast``, every member reports the digest of step ``step - 1`` (the state it starts
    from) and waits for its commit. ``apply_barrier``: an elastic run, where the optimizer waits
    for ``apply`` so no step is ever applied with a partly reduced gradient. ``fold``: every
    member joined offering to fold; once a bucket spec is agreed, members send no ``ready`` for
    buckets they reduce from the response cache, and say so in their step report instead.
    """

    KIND: ClassVar[str] = "start_run"
    addresses: tuple[tuple[str, int], ...]
    ring: tuple[int, ...]
    step: int = 0
    digest_interval: int = 1
    heartbeat_deadline: float = 10.0
    epoch: int = 1
    members: tuple[int, ...] = ()
    donor: int = -1
    receivers: tuple[int, ...] = ()
    broadcast: bool = True
    apply_barrier: bool = False
    fold: bool = False

    def __post_init__(self) -> None:
        if not self.members:
            object.__setattr__(self, "members", tuple(range(len(self.addresses))))

    @property
    def verify(self) -> bool:
        """Whether members report the digest of ``step - 1`` before the first step."""
        return not self.broadcast and self.step > 0

    def position(self, worker: int) -> int:
        """The ring position (data-plane rank) of ``worker`` in this epoch."""
        return self.members.index(worker)

    def to_wire(self) -> tuple[str, dict[str, Any]]:
        fields = {
            "addresses": [[host, port] for host, port in self.addresses],
            "ring": list(self.ring),
            "step": self.step,
            "digest_interval": self.digest_interval,
            "heartbeat_deadline": float(self.heartbeat_deadline),
            "epoch": self.epoch,
            "members": list(self.members),
            "donor": self.donor,
            "receivers": list(self.receivers),
            "broadcast": self.broadcast,
            "apply_barrier": self.apply_barrier,
        }
        if self.fold:
            fields["fold"] = True
        return self.KIND, fields

    @classmethod
    def from_wire(cls, message: Mapping[str, Any]) -> StartRun:
        _expect(message, cls.KIND)
        label = "start_run message: field"
        addresses = tuple(
            _norm_address(a, f"{label} 'addresses'[{i}]", None)
            for i, a in enumerate(message["addresses"])
        )
        ring = _norm_ranks(message["ring"], f"{label} 'ring'", None)
        if sorted(ring) != list(range(len(addresses))):
            raise ProtocolError(f"{label} 'ring' is not a permutation of the ranks")
        members = _norm_ranks(message["members"], f"{label} 'members'", None)
        if len(members) != len(addresses) or len(set(members)) != len(members):
            raise ProtocolError(f"{label} 'members' must list one distinct worker per address")
        receivers = _norm_ranks(message["receivers"], f"{label} 'receivers'", None)
        donor = message["donor"]
        if receivers and donor not in members:
            raise ProtocolError(f"{label} 'donor' {donor} is not a member")
        if not set(receivers) <= set(members) or donor in receivers:
            raise ProtocolError(f"{label} 'receivers' must be members other than the donor")
        return cls(
            addresses,
            ring,
            message["step"],
            message["digest_interval"],
            float(message["heartbeat_deadline"]),
            message["epoch"],
            members,
            donor,
            receivers,
            message["broadcast"],
            message["apply_barrier"],
            message.get("fold", False),
        )


@dataclass(frozen=True)
class Go:
    """Every rank is ready: run bucket ``bucket`` of ``step`` now; ``seq`` orders all Gos."""

    KIND: ClassVar[str] = "go"
    step: int
    bucket: int
    seq: int
    epoch: int = 1

    def to_wire(self) -> tuple[str, dict[str, Any]]:
        return self.KIND, {
            "epoch": self.epoch,
            "step": self.step,
            "bucket": self.bucket,
            "seq": self.seq,
        }

    @classmethod
    def from_wire(cls, message: Mapping[str, Any]) -> Go:
        _expect(message, cls.KIND)
        return cls(message["step"], message["bucket"], message["seq"], message["epoch"])


@dataclass(frozen=True)
class _StepOrder:
    """A coordinator message naming one step of one epoch and nothing else."""

    KIND: ClassVar[str]
    step: int
    epoch: int = 1

    def to_wire(self) -> tuple[str, dict[str, Any]]:
        return self.KIND, {"epoch": self.epoch, "step": self.step}

    @classmethod
    def from_wire(cls, message: Mapping[str, Any]) -> Self:
        _expect(message, cls.KIND)
        return cls(message["step"], message["epoch"])


@dataclass(frozen=True)
class Apply(_StepOrder):
    """Every member holds the fully reduced gradients of ``step``: apply them (elastic runs)."""

    KIND: ClassVar[str] = "apply"


@dataclass(frozen=True)
class Commit(_StepOrder):
    """Step ``step`` is verified and done everywhere: go on with ``step + 1``."""

    KIND: ClassVar[str] = "commit"


@dataclass(frozen=True)
class Hold:
    """Too few workers remain: drop the step in flight, keep the state, wait for an epoch."""

    KIND: ClassVar[str] = "hold"
    step: int
    epoch: int
    reason: str

    def to_wire(self) -> tuple[str, dict[str, Any]]:
        return self.KIND, {"epoch": self.epoch, "step": self.step, "reason": _clip(self.reason)}

    @classmethod
    def from_wire(cls, message: Mapping[str, Any]) -> Hold:
        _expect(message, cls.KIND)
        return cls(message["step"], message["epoch"], message["reason"])


@dataclass(frozen=True)
class ResyncOrder:
    """``source`` sends its parameters and optimizer state (after ``step``) to ``targets``."""

    KIND: ClassVar[str] = "resync"
    step: int
    source: int
    targets: tuple[int, ...]

    def to_wire(self) -> tuple[str, dict[str, Any]]:
        return self.KIND, {"step": self.step, "source": self.source, "targets": list(self.targets)}

    @classmethod
    def from_wire(cls, message: Mapping[str, Any]) -> ResyncOrder:
        _expect(message, cls.KIND)
        return cls(message["step"], message["source"], tuple(message["targets"]))


@dataclass(frozen=True)
class Shutdown:
    """The run is over (``reason`` is "finished" after a clean end): close down."""

    KIND: ClassVar[str] = "shutdown"
    reason: str

    def to_wire(self) -> tuple[str, dict[str, Any]]:
        return self.KIND, {"reason": _clip(self.reason)}

    @classmethod
    def from_wire(cls, message: Mapping[str, Any]) -> Shutdown:
        _expect(message, cls.KIND)
        return cls(message["reason"])


@dataclass(frozen=True)
class AbortRun:
    """The run stopped on an error: ``reason`` says which ranks and what went wrong."""

    KIND: ClassVar[str] = "abort"
    reason: str

    def to_wire(self) -> tuple[str, dict[str, Any]]:
        return self.KIND, {"reason": _clip(self.reason)}

    @classmethod
    def from_wire(cls, message: Mapping[str, Any]) -> AbortRun:
        _expect(message, cls.KIND)
        return cls(message["reason"])


@dataclass(frozen=True)
class JoinRefused:
    """This worker may not join (rank taken or out of range, model differs, run started)."""

    KIND: ClassVar[str] = "join_refused"
    reason: str

    def to_wire(self) -> tuple[str, dict[str, Any]]:
        return self.KIND, {"reason": _clip(self.reason)}

    @classmethod
    def from_wire(cls, message: Mapping[str, Any]) -> JoinRefused:
        _expect(message, cls.KIND)
        return cls(message["reason"])


Message = StartRun | Go | Apply | Commit | Hold | ResyncOrder | Shutdown | AbortRun | JoinRefused
"""What the coordinator sends a worker."""

_MESSAGES: dict[str, Any] = {
    cls.KIND: cls
    for cls in (StartRun, Go, Apply, Commit, Hold, ResyncOrder, Shutdown, AbortRun, JoinRefused)
}


def message_from_wire(message: Mapping[str, Any]) -> Message:
    """Parse a decoded coordinator -> worker message (the worker's side)."""
    kind = message.get("kind") if isinstance(message, Mapping) else None
    cls = _MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        validate_message(message)  # names a missing version or kind
        raise ProtocolError(f"a {kind} message does not come from the coordinator")
    return cls.from_wire(message)


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Joined:
    """Rank ``rank`` authenticated and announced its model and data-plane listen address.

    ``now`` is the shell's clock at the join (heartbeat baseline); None: the next Tick's.
    ``step`` is the next step the worker would run (0 when fresh; more when it resumes from a
    checkpoint or rejoins a restarted coordinator), ``digest`` its state's digest there
    (empty when fresh) and ``epoch`` the last epoch it took part in (0: none). ``fold``: the
    worker folds its response-cache reports into its step reports when every member does.
    """

    KIND: ClassVar[str] = "join"
    rank: int
    signature: Signature
    address: tuple[str, int]
    now: float | None = None
    step: int = 0
    digest: bytes = b""
    epoch: int = 0
    fold: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "signature", _norm_signature(self.signature, "Joined.signature", self.rank)
        )
        object.__setattr__(
            self, "address", _norm_address(self.address, "Joined.address", self.rank)
        )

    def to_wire(self) -> tuple[str, dict[str, Any]]:
        params = [[n, list(s), d, g] for n, s, d, g in self.signature]
        fields = {
            "host": self.address[0],
            "port": self.address[1],
            "params": params,
            "step": self.step,
            "digest": self.digest,
            "epoch": self.epoch,
        }
        if self.fold:
            fields["fold"] = True
        return self.KIND, fields

    @classmethod
    def from_wire(
        cls, message: Mapping[str, Any], *, rank: int, now: float | None = None
    ) -> Joined:
        _expect(message, cls.KIND, rank)
        sig = _norm_signature(message["params"], "join message: field 'params'", rank)
        return cls(
            rank,
            sig,
            (message["host"], message["port"]),
            now,
            message.get("step", 0),
            bytes(message.get("digest", b"")),
            message.get("epoch", 0),
            message.get("fold", False),
        )


def _prebuilt(cls: type[Any], fields: Iterable[tuple[str, Any]]) -> Any:
    """An instance of the frozen dataclass ``cls`` from fields already normalized (its
    ``__post_init__`` would check them a second time on a hot path)."""
    item = object.__new__(cls)
    for name, value in fields:
        object.__setattr__(item, name, value)
    return item


@dataclass(frozen=True)
class Ready:
    """Rank ``rank``'s gradient bucket ``bucket`` of ``step`` is ready; ``spec`` is its layout.

    ``cached``: the rank did not wait for a go; it reduces the bucket at once because the
    members agreed on this spec for this bucket earlier in the epoch (Horovod's response cache:
    the coordinator still checks the report against that agreement, and the ring refuses a
    peer whose tensor differs)."""

    KIND: ClassVar[str] = "ready"
    rank: int
    step: int
    bucket: int
    spec: BucketSpec
    epoch: int = 1
    cached: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", _norm_spec(self.spec, "Ready.spec", self.rank))

    def to_wire(self) -> tuple[str, dict[str, Any]]:
        fields = {
            "epoch": self.epoch,
            "step": self.step,
            "bucket": self.bucket,
            "spec": _spec_wire(self.spec),
        }
        if self.cached:
            fields["cached"] = True
        return self.KIND, fields

    @classmethod
    def from_wire(cls, message: Mapping[str, Any], *, rank: int) -> Ready:
        _expect(message, cls.KIND, rank)
        spec = _norm_spec(message["spec"], "ready message: field 'spec'", rank)
        return cls._checked(
            rank,
            message["step"],
            message["bucket"],
            spec,
            message["epoch"],
            bool(message.get("cached", False)),
        )

    @classmethod
    def _checked(cls, *args: Any) -> Ready:
        """Build from fields already normalized (skips normalizing the spec a second time)."""
        return _prebuilt(cls, zip(("rank", "step", "bucket", "spec", "epoch", "cached"), args))


@dataclass(frozen=True)
class _StepReport:
    """A worker's word about one step of one epoch and nothing else (``rank`` from its link)."""

    KIND: ClassVar[str]
    rank: int
    step: int
    epoch: int = 1

    def to_wire(self) -> tuple[str, dict[str, Any]]:
        return self.KIND, {"epoch": self.epoch, "step": self.step}

    @classmethod
    def from_wire(cls, message: Mapping[str, Any], *, rank: int) -> Self:
        _expect(message, cls.KIND, rank)
        return cls(rank, message["step"], message["epoch"])


@dataclass(frozen=True)
class _FoldingReport(_StepReport):
    """A step report that may also say the rank reduced every bucket of the step from the
    response cache (``cached``: the `agreement_hash` it reduced under; empty: it did not)."""

    cached: str = ""

    def to_wire(self) -> tuple[str, dict[str, Any]]:
        kind, fields = super().to_wire()
        if self.cached:
            fields["cached"] = self.cached
        return kind, fields

    @classmethod
    def from_wire(cls, message: Mapping[str, Any], *, rank: int) -> Self:
        _expect(message, cls.KIND, rank)
        return cls(rank, message["step"], message["epoch"], message.get("cached", ""))


@dataclass(frozen=True)
class Reduced(_FoldingReport):
    """Rank ``rank`` holds every bucket of ``step`` fully reduced (elastic runs)."""

    KIND: ClassVar[str] = "reduced"


@dataclass(frozen=True)
class Digest:
    """After the optimizer step of ``step``: a hash of all parameters and optimizer state, and
    per-tensor hashes in a fixed order (to name the first tensor that differs).

    The per-tensor hashes come either as ``tensor_digests`` (name, digest) pairs, or packed:
    ``packed`` holds them concatenated, all of one size, in the order of ``names``; ``names``
    is None when they are the names of this rank's previous digest in the epoch (a worker lists
    them once, not on every step; the core keeps them).
    """

    KIND: ClassVar[str] = "digest"
    rank: int
    step: int
    digest: bytes
    tensor_digests: tuple[tuple[str, bytes], ...] = ()
    epoch: int = 1
    packed: bytes | None = None
    names: tuple[str, ...] | None = None
    cached: str = ""
    """As in a `Reduced` or `StepDone` report: every bucket reduced from the response cache."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "digest", _norm_bytes(self.digest, "Digest.digest", self.rank, _MAX_DIGEST)
        )
        object.__setattr__(
            self,
            "tensor_digests",
            _norm_tensor_digests(self.tensor_digests, "Digest.tensor_digests", self.rank),
        )
        packed, names = _norm_packed(self.packed, self.names, "Digest", self.rank)
        object.__setattr__(self, "packed", packed)
        object.__setattr__(self, "names", names)

    def to_wire(self) -> tuple[str, dict[str, Any]]:
        fields: dict[str, Any] = {"epoch": self.epoch, "step": self.step, "digest": self.digest}
        if self.packed is None:
            fields["tensors"] = [[name, digest] for name, digest in self.tensor_digests]
        else:
            fields["tensors"] = self.packed
            if self.names is not None:
                fields["names"] = list(self.names)
        if self.cached:
            fields["cached"] = self.cached
        return self.KIND, fields

    @classmethod
    def from_wire(cls, message: Mapping[str, Any], *, rank: int) -> Digest:
        _expect(message, cls.KIND, rank)
        tensors = message["tensors"]
        label = "digest message: field"
        if type(tensors) is bytes:
            pairs: tuple[tuple[str, bytes], ...] = ()
            packed, names = _norm_packed(tensors, message.get("names"), label, rank)
        else:
            if "names" in message:
                raise _bad(f"{label} 'names'", "comes only with packed 'tensors' (bytes)", rank)
            pairs = _norm_tensor_digests(tensors, f"{label} 'tensors'", rank)
            packed, names = None, None
        return _prebuilt(  # fields normalized here: skip __post_init__'s second pass
            cls,
            (
                ("rank", rank),
                ("step", message["step"]),
                ("digest", _norm_bytes(message["digest"], "Digest.digest", rank, _MAX_DIGEST)),
                ("tensor_digests", pairs),
                ("epoch", message["epoch"]),
                ("packed", packed),
                ("names", names),
                ("cached", message.get("cached", "")),
            ),
        )

    def pairs(self, names: Sequence[str] | None) -> tuple[tuple[str, bytes], ...]:
        """The per-tensor (name, digest) pairs; ``names``: those of a packed digest."""
        if self.packed is None:
            return self.tensor_digests
        size = None if names is None else _packed_size(self.packed, len(names))
        if names is None or size is None:
            raise ValueError(f"{len(self.packed)} bytes of packed digests do not fit {names!r}")
        return tuple((name, self.packed[i * size : (i + 1) * size]) for i, name in enumerate(names))


@dataclass(frozen=True)
class StepDone(_FoldingReport):
    """Rank ``rank`` finished ``step`` (on steps that carry no digest)."""

    KIND: ClassVar[str] = "step_done"


@dataclass(frozen=True)
class Heartbeat:
    """Rank ``rank`` is alive at the shell's time ``now`` (seconds)."""

    KIND: ClassVar[str] = "heartbeat"
    rank: int
    now: float

    def to_wire(self) -> tuple[str, dict[str, Any]]:
        return self.KIND, {}

    @classmethod
    def from_wire(cls, message: Mapping[str, Any], *, rank: int, now: float) -> Heartbeat:
        _expect(message, cls.KIND, rank)
        return cls(rank, now)


@dataclass(frozen=True)
class Finished(_StepReport):
    """Rank ``rank`` ran all its steps; ``step`` is the first step it will not run."""

    KIND: ClassVar[str] = "finished"


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

_WIRE_EVENTS = (Joined, Ready, Reduced, Digest, StepDone, Heartbeat, Finished)


def event_from_wire(message: Mapping[str, Any], *, rank: int, now: float) -> Event:
    """Parse a decoded worker -> coordinator message from authenticated rank ``rank``.

    Raises ProtocolError naming the kind and field when the message does not fit.
    """
    kind = message.get("kind") if isinstance(message, Mapping) else None
    if kind == Joined.KIND:
        return Joined.from_wire(message, rank=rank, now=now)
    if kind == Heartbeat.KIND:
        return Heartbeat.from_wire(message, rank=rank, now=now)
    for cls in (Ready, Reduced, Digest, StepDone, Finished):
        if kind == cls.KIND:
            return cls.from_wire(message, rank=rank)
    try:
        validate_message(message)
    except ProtocolError as exc:
        raise exc.with_peer(rank) from None
    raise ProtocolError(f"a {kind} message is not for the coordinator", peer=rank)


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

# The core itself is composed of parts that import the messages above (runtime/coordinator/
# machine.py and the modules it names); it and its records are re-exported from here, on first
# use, so that existing imports keep working without an import cycle.
_REEXPORTS = {
    "CoordinatorCore": "runtime.coordinator.machine",
    "RunState": "runtime.coordinator.run_state",
    "EpochRecord": "runtime.coordinator.membership",
    "CommitRecord": "runtime.coordinator.commits",
}


if TYPE_CHECKING:
    from runtime.coordinator.commits import CommitRecord as CommitRecord
    from runtime.coordinator.machine import CoordinatorCore as CoordinatorCore
    from runtime.coordinator.membership import EpochRecord as EpochRecord
    from runtime.coordinator.run_state import RunState as RunState


def __getattr__(name: str) -> Any:
    module = _REEXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
