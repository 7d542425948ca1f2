"""Every message kind of the paramsync wire protocol, declared once, and the closed kind table.

Each kind is a frozen dataclass (a `paramsync.runtime.protocol.schema.WireMessage`) whose fields
carry their schema: type, range, length, nesting, whether the field may be absent. The one generic
codec of `paramsync.runtime.protocol.schema` encodes and decodes all of them; :data:`KINDS`, built
explicitly at the end of this module, is the set of kinds a frame may carry (no import adds one).
The kinds, by who sends them:

- the connection handshake (`paramsync.runtime.protocol.handshake`): `Hello`, `Challenge`, `Auth`,
  `Welcome`, `Refusal`;
- the TCP rendezvous (`paramsync.runtime.transport.tcp`): `RdvJoin`, `RdvTable`;
- the shared-memory plane (`paramsync.runtime.transport.shm`): `ShmHello`, `ShmOffer`, `ShmMapped`,
  `ShmReady`, `ShmStep`;
- collectives (`paramsync.runtime.collectives.ring`): `Coll`; training-state transfer
  (`paramsync.actors.train.trainer`): `StateManifest`, `StateTensor`;
- the coordinator protocol, coordinator -> worker: `StartRun`, `Go`, `Apply`, `Commit`, `Hold`,
  `ResyncOrder`, `Shutdown`, `AbortRun`, `JoinRefused` (:func:`message_from_wire`);
  worker -> coordinator: `Joined`, `Ready`, `Reduced`, `Digest`, `StepDone`, `Heartbeat`,
  `Finished` (:func:`event_from_wire`; their ``rank``, and ``now`` where they have one, are
  the receiver's, never on the wire);
- the coordinator tree, a host's sub-coordinator -> the root: `HostJoined`, `HostReady`,
  `HostReduced`, `HostDigest`, `HostStepDone`, `HostFinished`, `HostLost`, `HostAbort`,
  `HostTensors` (:func:`host_event_from_wire`; their ``host`` is the root's index of the
  connection); the root answers with the coordinator -> worker kinds, which each host fans
  out, and asks for the per-tensor digests of a step whose digests disagree with
  `DigestQuery` (:func:`root_message_from_wire`, the host's side).

`docs/protocol.md` describes the frames; `tests/test_wire.py` pins their bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from paramsync.runtime.errors import ProtocolError
from paramsync.runtime.protocol.schema import (
    MAX_INT,
    Bool,
    Bytes,
    Either,
    Float,
    Int,
    Invalid,
    Map,
    Record,
    Seq,
    Spread,
    Str,
    Tensor,
    WireMessage,
    build_checked,
    check_envelope,
    check_item,
    decode,
    decode_as,
    local,
    schema,
    wire,
)

if TYPE_CHECKING:  # only the tensor fields' annotations name it: the coordinator runs without
    import torch

__all__ = [
    "ParamSpec",
    "Signature",
    "BucketSpec",
    "CALL_PREFIX",
    "MeshLayout",
    "ParallelLayout",
    "LAYOUT",
    "DATA_PARALLEL_DIM",
    "GroupRanks",
    "GroupPeers",
    "MAX_DIGEST",
    "NONCE_SIZE",
    "SALT_SIZE",
    # handshake
    "Hello",
    "Challenge",
    "Auth",
    "Welcome",
    "Refusal",
    # rendezvous, shared memory, collectives, state transfer
    "RdvJoin",
    "RdvTable",
    "ShmHello",
    "ShmOffer",
    "ShmMapped",
    "ShmReady",
    "ShmStep",
    "Coll",
    "StateManifest",
    "StateTensor",
    # coordinator -> worker
    "StartRun",
    "Go",
    "Apply",
    "Commit",
    "Hold",
    "ResyncOrder",
    "Shutdown",
    "AbortRun",
    "JoinRefused",
    "CoordinatorMessage",
    # worker -> coordinator
    "Joined",
    "Ready",
    "Reduced",
    "Digest",
    "StepDone",
    "Heartbeat",
    "Finished",
    "WorkerReport",
    # host -> root (the coordinator tree)
    "MEMBER_JOIN",
    "MemberJoin",
    "MEMBERS_MASK",
    "DIGEST_GROUP",
    "DigestGroup",
    "TENSOR_GROUP",
    "TensorGroup",
    "HostJoined",
    "HostReady",
    "HostReduced",
    "HostDigest",
    "HostStepDone",
    "HostFinished",
    "HostLost",
    "HostAbort",
    "HostTensors",
    "HostStall",
    "HostReport",
    "HOST_KINDS",
    "host_event_from_wire",
    # root -> host (the coordinator tree)
    "DigestQuery",
    "RootMessage",
    "ROOT_KINDS",
    "root_message_from_wire",
    # the closed tables and the codec bound to them
    "KINDS",
    "COORDINATOR_KINDS",
    "WORKER_KINDS",
    "validate_message",
    "decode_message",
    "message_from_wire",
    "event_from_wire",
    "normalize_signature",
    "packed_size",
]

ParamSpec = tuple[str, tuple[int, ...], str, bool]
"""One parameter of a model signature: (name, shape, dtype name, requires_grad)."""
Signature = tuple[ParamSpec, ...]
"""A model's parameters in registration order."""
BucketSpec = tuple[tuple[tuple[int, ...], str], ...] | str
"""A gradient bucket's layout, ((shape, dtype name), ...), or a hash string of it."""
MeshLayout = tuple[tuple[str, ...], tuple[int, ...]]
"""A device mesh: (dimension names, their sizes), row-major
(`paramsync.runtime.collectives.mesh`)."""
GroupRanks = tuple[str, tuple[int, ...]]
"""A named process group: (name, its world ranks)."""

DATA_PARALLEL_DIM = "dp"
"""The layout dimension whose replicas hold the same shard (compared by the digest check)."""


class ParallelLayout(NamedTuple):
    """A worker's place in a 3D-parallel run, as its join declares it (field ``layout``).

    ``names`` and ``sizes``: the run's mesh, e.g. ``("pp", "dp", "tp")`` and ``(2, 2, 2)``;
    ``coordinates``: this worker's coordinate on each dimension, which must be its rank's under
    the mesh's one ordering rule (row-major, the last named dimension fastest:
    `paramsync.runtime.collectives.mesh.mesh_coordinates`); ``schedule_digest``: the hash of the
    whole pipeline schedule (every pipeline rank's action list; empty: none), compared as bytes.

    The workers of one (tp, pp, ...) shard are those whose coordinates agree on every dimension
    but `DATA_PARALLEL_DIM` ("dp"): the data-parallel replicas of that shard, whose states the
    coordinator's digest check compares with each other only. A layout without a "dp"
    dimension has one replica per shard.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    coordinates: tuple[int, ...]
    schedule_digest: bytes = b""

    @property
    def shape(self) -> dict[str, int]:
        """Dimension name -> size, in order."""
        return dict(zip(self.names, self.sizes, strict=True))

    @property
    def shard(self) -> tuple[tuple[str, int], ...]:
        """This worker's shard: its (name, coordinate) on every dimension but "dp"."""
        return tuple(
            (name, coordinate)
            for name, coordinate in zip(self.names, self.coordinates, strict=True)
            if name != DATA_PARALLEL_DIM
        )

    def describe_coordinates(self) -> str:
        """``(dp=1, tp=0)``: the coordinates as errors show them."""
        pairs = zip(self.names, self.coordinates, strict=True)
        return "(" + ", ".join(f"{name}={value}" for name, value in pairs) + ")"


GroupPeers = tuple[str, tuple[int, ...], tuple[tuple[str, int], ...]]
"""A rank's process group at rendezvous: (name, its world ranks, their addresses by rank)."""

# --------------------------------------------------------------------------- field types

_MAX_WORLD = 1 << 16
_MAX_ITEMS = 1 << 20
MAX_DIGEST = 64
"""Longest digest (whole-state or per-tensor) a report may carry, in bytes."""
NONCE_SIZE = 32
"""Bytes of a handshake nonce."""
SHARE_SIZE = 32
"""Bytes of a CPace key share (an X25519 u-coordinate,
`paramsync.runtime.protocol.pake.SHARE_SIZE`)."""
SALT_SIZE = 16
"""Bytes of a listener's scrypt salt (`paramsync.runtime.protocol.handshake.PROCESS_SALT`)."""
_SHM_NONCE = 16

COUNT = Int(0, None)
"""A non-negative counter with no bound but CBOR's (op ids, parts, byte counts)."""
STEP = Int(0, MAX_INT)
EPOCH = Int(0, MAX_INT)
BUCKET = Int(0, MAX_INT)
RANK = Int(0, _MAX_WORLD)
RANKS = Seq(RANK, _MAX_WORLD)
HOST = Str(256)
PORT = Int(1, 65535)
REASON = Str(4096, clip=True)
"""A coordinator's reason: a longer one is clipped (ending in "...") when sent."""
SHORT_REASON = Str(1024, clip=True)
NAME = Str(1024, min_len=1)
DTYPE = Str(64, min_len=1)
HASH = Str(256, min_len=1)
SHAPE = Seq(Int(0, 2**40), 32)
DIGEST = Bytes(MAX_DIGEST)
ADDRESS = Record(("host", Str(256, min_len=1)), ("port", PORT))
SIGNATURE = Seq(
    Record(("name", NAME), ("shape", SHAPE), ("dtype", DTYPE), ("requires_grad", Bool())),
    _MAX_ITEMS,
)
"""A model signature: [[name, shape, dtype, requires_grad], ...]."""
BUCKET_SPEC = Either(HASH, Seq(Record(("shape", SHAPE), ("dtype", DTYPE)), _MAX_ITEMS))
"""A bucket's layout, [[shape, dtype], ...], or the hash string of one (`spec_hash`)."""
CALL_PREFIX = "call:"
"""A spec entry whose dtype starts with this names a torch.distributed call rather than a
tensor (its shape is empty): ``[[], "call:allreduce(sum)"], [[4, 3], "float32"]`` is an
all-reduce of one tensor (`paramsync.actors.torch_backend.calls`)."""
CACHED = Str(256)
ALGORITHM = Str(64)
"""A digest algorithm's name (``"xxh3-128"``, ``"fold31x4"``)."""
"""A folding report's response-cache agreement hash (empty: none)."""
GROUP_NAME = Str(256, min_len=1)
"""A process group's name (`paramsync.runtime.coordinator.group_decl` says how a mesh's are
derived)."""
MESH = Record(("names", Seq(Str(256, min_len=1), 16)), ("sizes", Seq(Int(1, _MAX_WORLD), 16)))
"""A device mesh declaration: [names, sizes]."""
GROUP_PEERS = Seq(
    Record(("name", GROUP_NAME), ("ranks", RANKS), ("addresses", Seq(ADDRESS, _MAX_WORLD))),
    _MAX_WORLD,
)
"""A rank's process groups at the start: [[name, ranks, addresses], ...]."""
GROUP_LIST = Seq(Record(("name", GROUP_NAME), ("ranks", RANKS)), _MAX_WORLD)
"""Explicit process groups: [[name, ranks], ...]."""
MAX_LAYOUT_DIMS = 16
"""The most dimensions a parallel layout may name."""


class _Layout(Record):
    """A `ParallelLayout` on the wire, ``[names, sizes, coordinates, schedule_digest]``: one
    size and one coordinate per name, distinct names, each coordinate below its size."""

    def __repr__(self) -> str:
        return f"_Layout{self.parts!r}"

    def check(self, value: Any) -> ParallelLayout:
        if isinstance(value, ParallelLayout):  # a tuple subclass, which Record takes as is
            value = tuple(value)
        names, sizes, coordinates, schedule = super().check(value)
        if not names:
            raise Invalid(" is empty: a layout names at least one dimension", " names")
        if len(set(names)) != len(names):
            raise Invalid(f" {list(names)} repeat a name", " names")
        if len(sizes) != len(names):
            raise Invalid(f" holds {len(sizes)} for {len(names)} names", " sizes")
        if len(coordinates) != len(names):
            raise Invalid(f" holds {len(coordinates)} for {len(names)} names", " coordinates")
        for name, size, coordinate in zip(names, sizes, coordinates, strict=True):
            if coordinate >= size:
                raise Invalid(
                    f" {list(coordinates)} put {name}={coordinate} outside its size {size}",
                    " coordinates",
                )
        return ParallelLayout(names, sizes, coordinates, schedule)


LAYOUT = _Layout(
    ("names", Seq(Str(256, min_len=1), MAX_LAYOUT_DIMS)),
    ("sizes", Seq(Int(1, _MAX_WORLD), MAX_LAYOUT_DIMS)),
    ("coordinates", Seq(Int(0, _MAX_WORLD), MAX_LAYOUT_DIMS)),
    ("schedule_digest", Bytes(MAX_DIGEST)),
)
"""A worker's parallel layout: [names, sizes, coordinates, schedule_digest]."""


def packed_size(packed: bytes, count: int) -> int | None:
    """The size of each of ``count`` digests packed into ``packed``; None if they do not fit
    (sizes 1 to `MAX_DIGEST` bytes, all equal)."""
    if count == 0:
        return 0 if not packed else None
    size, rest = divmod(len(packed), count)
    return size if not rest and 0 < size <= MAX_DIGEST else None


def normalize_signature(signature: Any) -> Signature:
    """A model signature checked and normalized to tuples (ProtocolError naming the entry)."""
    try:
        return SIGNATURE.check(signature)
    except Invalid as exc:
        raise ProtocolError(f"signature{exc}") from None


# --------------------------------------------------------------------------- handshake


@dataclass(frozen=True)
class Hello(WireMessage):
    """Dialer -> listener: who the dialer is, and its nonce."""

    KIND: ClassVar[str] = "hello"
    group: str = wire(Str(128))
    world_size: int = wire(Int(1, _MAX_WORLD))
    rank: int = wire(Int(-1, _MAX_WORLD))
    nonce: bytes = wire(Bytes(NONCE_SIZE))


@dataclass(frozen=True)
class Challenge(WireMessage):
    """Listener -> dialer: the listener's nonce, its scrypt salt and its CPace key share, and
    nothing about the listener (the dialer has not proven the secret yet)."""

    KIND: ClassVar[str] = "challenge"
    nonce: bytes = wire(Bytes(NONCE_SIZE))
    salt: bytes = wire(Bytes(SALT_SIZE))
    """The listener's scrypt salt: the dialer stretches the secret with it."""
    share: bytes = wire(Bytes(SHARE_SIZE))


@dataclass(frozen=True)
class Auth(WireMessage):
    """Dialer -> listener: the dialer's CPace key share and its proof of the secret."""

    KIND: ClassVar[str] = "auth"
    share: bytes = wire(Bytes(SHARE_SIZE))
    """The dialer's CPace key share (`paramsync.runtime.protocol.pake`)."""
    proof: bytes = wire(Bytes(64))


@dataclass(frozen=True)
class Welcome(WireMessage):
    """Listener -> dialer: authenticated and admitted; who the listener is, and its proof of
    the secret (the dialer checks it before trusting the rest)."""

    KIND: ClassVar[str] = "welcome"
    group: str = wire(Str(128))
    world_size: int = wire(Int(1, _MAX_WORLD))
    rank: int = wire(Int(-1, _MAX_WORLD))
    proof: bytes = wire(Bytes(64))


@dataclass(frozen=True)
class Refusal(WireMessage):
    """Either side: the handshake is refused (``auth``: a wrong secret; ``busy``: too many
    handshakes in progress, dial again later)."""

    KIND: ClassVar[str] = "refuse"
    reason: str = wire(SHORT_REASON)
    auth: bool = wire(Bool(), default=False, omit=False)
    busy: bool = wire(Bool(), default=False, omit=False)


# --------------------------------------------------------------------------- rendezvous


@dataclass(frozen=True)
class RdvJoin(WireMessage):
    """A member -> rank 0: the address it listens on for its peers."""

    KIND: ClassVar[str] = "rdv_join"
    host: str = wire(HOST)
    port: int = wire(PORT)


@dataclass(frozen=True)
class RdvTable(WireMessage):
    """Rank 0 -> every member: every rank's listen address, by rank."""

    KIND: ClassVar[str] = "rdv_table"
    addresses: tuple[tuple[str, int], ...] = wire(
        Seq(Record(("host", HOST), ("port", Int(0, 65535))), _MAX_WORLD)
    )


# --------------------------------------------------------------------------- shared memory


@dataclass(frozen=True)
class ShmHello(WireMessage):
    """A rank -> rank 0: its host identity and whether it wants the shared-memory plane."""

    KIND: ClassVar[str] = "shm_hello"
    host: str = wire(Str(512))
    want: bool = wire(Bool())


@dataclass(frozen=True)
class ShmOffer(WireMessage):
    """Rank 0 -> a rank: the segment to map (empty ``path``: none, ``reason`` says why)."""

    KIND: ClassVar[str] = "shm_offer"
    path: str = wire(Str(256))
    reason: str = wire(SHORT_REASON)
    size: int = wire(COUNT)
    step_bytes: int = wire(COUNT)
    min_bytes: int = wire(COUNT)
    nonce: bytes = wire(Bytes(_SHM_NONCE))


@dataclass(frozen=True)
class ShmMapped(WireMessage):
    """A rank -> rank 0: whether it mapped the offered segment."""

    KIND: ClassVar[str] = "shm_mapped"
    ok: bool = wire(Bool())
    reason: str = wire(SHORT_REASON)


@dataclass(frozen=True)
class ShmReady(WireMessage):
    """Rank 0 -> every rank: whether the whole group uses the plane."""

    KIND: ClassVar[str] = "shm_ready"
    ok: bool = wire(Bool())
    reason: str = wire(SHORT_REASON)


@dataclass(frozen=True)
class ShmStep(WireMessage):
    """A rank -> its peers: step ``step`` of collective ``op`` is in the segment."""

    KIND: ClassVar[str] = "shm_step"
    op: int = wire(COUNT)
    step: int = wire(COUNT)


# --------------------------------------------------------------------------- data frames


@dataclass(frozen=True)
class Coll(WireMessage):
    """A part of a collective's data: collective ``op``, ring hop ``hop``, part ``part``;
    ``data`` usually travels as the frame's bulk."""

    KIND: ClassVar[str] = "coll"
    op: int = wire(COUNT)
    hop: int = wire(Int(0, 1 << 20))
    part: int = wire(COUNT)
    data: torch.Tensor = wire(Tensor())


P2P_MAX_TAG = (1 << 63) - 1
"""The largest tag a point-to-point message may carry (`paramsync.runtime.collectives.p2p`)."""


@dataclass(frozen=True)
class P2P(WireMessage):
    """A point-to-point message (`paramsync.runtime.collectives.p2p`): ``tag`` chooses the posted
    receive it is for; ``data`` (its dtype and shape included) travels as the frame's bulk."""

    KIND: ClassVar[str] = "p2p"
    tag: int = wire(Int(0, P2P_MAX_TAG))
    data: torch.Tensor = wire(Tensor())


@dataclass(frozen=True)
class GroupAddr(WireMessage):
    """A member of a process group being formed -> every other member, over the parent's
    connections (`paramsync.runtime.collectives.groups`): the group's name and ranks, which must be
    the same on every member, and the address this member listens on for the group's own mesh."""

    KIND: ClassVar[str] = "group_addr"
    name: str = wire(Str(128))
    ranks: tuple[int, ...] = wire(RANKS)
    host: str = wire(HOST)
    port: int = wire(PORT)


@dataclass(frozen=True)
class Probe(WireMessage):
    """A diagnostic message from ``src`` to ``dst`` (the transport conformance suite,
    `paramsync.runtime.testing.transport_conformance`, and debugging tools send it; workers and the
    coordinator never do, and refuse it as any kind they do not expect)."""

    KIND: ClassVar[str] = "probe"
    src: int = wire(COUNT)
    dst: int = wire(COUNT)
    seq: int = wire(COUNT)
    note: str = wire(Str(256))


@dataclass(frozen=True)
class ProbeData(WireMessage):
    """A diagnostic message from ``src`` that may carry a tensor (see `Probe`)."""

    KIND: ClassVar[str] = "probe_data"
    src: int = wire(COUNT)
    seq: int = wire(COUNT)
    data: torch.Tensor | None = wire(Tensor(), default=None, omit=None)


@dataclass(frozen=True)
class StateManifest(WireMessage):
    """A healthy member -> a joiner: the training state about to follow (its reader checks
    the manifest's contents)."""

    KIND: ClassVar[str] = "state_manifest"
    manifest: dict[str, Any] = wire(Map())


@dataclass(frozen=True)
class StateTensor(WireMessage):
    """Tensor ``index`` of the training state after ``step`` (a transfer or a re-sync)."""

    KIND: ClassVar[str] = "state"
    step: int = wire(COUNT)
    index: int = wire(COUNT)
    data: torch.Tensor = wire(Tensor())


# --------------------------------------------------------------------------- coordinator -> worker


@dataclass(frozen=True)
class StartRun(WireMessage):
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
    ``members`` left empty means ``0 .. len(addresses) - 1``. ``groups``: when the joins
    declared process groups, each member gets its own start listing its groups in this epoch,
    each as [name, ranks, addresses] (``addresses[i]``: the listen address of world rank
    ``ranks[i]``, from the address table; only ranks that are members of the epoch). ``run``:
    the run's id.
    """

    KIND: ClassVar[str] = "start_run"
    addresses: tuple[tuple[str, int], ...] = wire(Seq(ADDRESS, _MAX_WORLD))
    ring: tuple[int, ...] = wire(RANKS)
    step: int = wire(STEP, default=0)
    digest_interval: int = wire(Int(1, MAX_INT), default=1)
    heartbeat_deadline: float = wire(Float(0.0), default=10.0)
    epoch: int = wire(EPOCH, default=1)
    members: tuple[int, ...] = wire(RANKS, default=())
    donor: int = wire(Int(-1, _MAX_WORLD), default=-1)
    receivers: tuple[int, ...] = wire(RANKS, default=())
    broadcast: bool = wire(Bool(), default=True)
    apply_barrier: bool = wire(Bool(), default=False)
    fold: bool = wire(Bool(), default=False, omit=False)
    groups: tuple[GroupPeers, ...] = wire(GROUP_PEERS, default=(), omit=())
    run: str = wire(Str(128), default="", omit="")
    """The run's id, the coordinator's (random unless it was given one; empty: none said):
    what workers record in their checkpoints. Chosen by the coordinator, never derived from
    the secret."""

    def __post_init__(self) -> None:
        if not self.members:
            object.__setattr__(self, "members", tuple(range(len(self.addresses))))
        super().__post_init__()

    def invariants(self) -> None:
        """The ring orders the positions; members, donor and receivers are consistent."""
        if sorted(self.ring) != list(range(len(self.addresses))):
            raise Invalid(" is not a permutation of the ranks", "'ring'")
        if len(self.members) != len(self.addresses) or len(set(self.members)) != len(self.members):
            raise Invalid(" must list one distinct worker per address", "'members'")
        if self.receivers and self.donor not in self.members:
            raise Invalid(f" {self.donor} is not a member", "'donor'")
        if not set(self.receivers) <= set(self.members) or self.donor in self.receivers:
            raise Invalid(" must be members other than the donor", "'receivers'")
        names = [group[0] for group in self.groups]
        if len(set(names)) != len(names):
            raise Invalid(" names a group twice", "'groups'")
        for name, ranks, addresses in self.groups:
            if len(set(ranks)) != len(ranks) or len(addresses) != len(ranks):
                raise Invalid(f" group {name!r} needs distinct ranks, one address each", "'groups'")

    @property
    def verify(self) -> bool:
        """Whether members report the digest of ``step - 1`` before the first step."""
        return not self.broadcast and self.step > 0

    def position(self, worker: int) -> int:
        """The ring position (data-plane rank) of ``worker`` in this epoch."""
        return self.members.index(worker)


@dataclass(frozen=True)
class Go(WireMessage):
    """Every rank is ready: run bucket ``bucket`` of ``step`` now; ``seq`` orders all Gos.

    ``group``: the process group whose members are all ready (sent to them only; ``seq``
    then orders that group's Gos); absent: the world."""

    KIND: ClassVar[str] = "go"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ("epoch", "step", "bucket", "seq", "group")
    step: int = wire(STEP)
    bucket: int = wire(BUCKET)
    seq: int = wire(Int(0, MAX_INT))
    epoch: int = wire(EPOCH, default=1)
    group: str = wire(Str(256), default="", omit="")


@dataclass(frozen=True)
class Apply(WireMessage):
    """Every member holds the fully reduced gradients of ``step``: apply them (elastic runs)."""

    KIND: ClassVar[str] = "apply"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ("epoch", "step")
    step: int = wire(STEP)
    epoch: int = wire(EPOCH, default=1)


@dataclass(frozen=True)
class Commit(WireMessage):
    """Step ``step`` is verified and done everywhere: go on with ``step + 1``."""

    KIND: ClassVar[str] = "commit"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ("epoch", "step")
    step: int = wire(STEP)
    epoch: int = wire(EPOCH, default=1)


@dataclass(frozen=True)
class Hold(WireMessage):
    """Too few workers remain: drop the step in flight, keep the state, wait for an epoch."""

    KIND: ClassVar[str] = "hold"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ("epoch", "step", "reason")
    step: int = wire(STEP)
    epoch: int = wire(EPOCH)
    reason: str = wire(REASON)


@dataclass(frozen=True)
class ResyncOrder(WireMessage):
    """``source`` sends its parameters and optimizer state (after ``step``) to ``targets``."""

    KIND: ClassVar[str] = "resync"
    step: int = wire(STEP)
    source: int = wire(RANK)
    targets: tuple[int, ...] = wire(RANKS)


@dataclass(frozen=True)
class Shutdown(WireMessage):
    """The run is over (``reason`` is "finished" after a clean end): close down."""

    KIND: ClassVar[str] = "shutdown"
    reason: str = wire(REASON)


@dataclass(frozen=True)
class AbortRun(WireMessage):
    """The run stopped on an error: ``reason`` says which ranks and what went wrong."""

    KIND: ClassVar[str] = "abort"
    reason: str = wire(REASON)


@dataclass(frozen=True)
class JoinRefused(WireMessage):
    """This worker may not join (rank taken or out of range, model differs, run started)."""

    KIND: ClassVar[str] = "join_refused"
    reason: str = wire(REASON)


CoordinatorMessage = (
    StartRun | Go | Apply | Commit | Hold | ResyncOrder | Shutdown | AbortRun | JoinRefused
)
"""What the coordinator sends a worker."""


# --------------------------------------------------------------------------- worker -> coordinator


@dataclass(frozen=True)
class Joined(WireMessage):
    """Rank ``rank`` authenticated and announced its model and data-plane listen address.

    ``now`` is the shell's clock at the join (heartbeat baseline); None: the next Tick's.
    ``step`` is the next step the worker would run (0 when fresh; more when it resumes from a
    checkpoint or rejoins a restarted coordinator), ``digest`` its state's digest there
    (empty when fresh) and ``epoch`` the last epoch it took part in (0: none). ``committed``:
    that state is one the coordinator committed (its digest check of the step before
    ``step`` passed, and the worker's state still has the digest it reported there; False
    when absent), which the restart's donor rule trusts over a majority
    (`paramsync.runtime.coordinator.membership.resume_plan`). ``fold``: the
    worker folds its response-cache reports into its step reports when every member does.
    ``mesh`` (names, sizes) or ``groups`` ((name, ranks), ...): the process groups the worker
    will use (`paramsync.runtime.coordinator.group_decl`); every join must declare the same ones.
    ``layout``: the worker's place in a 3D-parallel run (`ParallelLayout`; None: a flat
    data-parallel run), checked by `paramsync.runtime.coordinator.layouts`.
    """

    KIND: ClassVar[str] = "join"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = (
        "host",
        "port",
        "params",
        "step",
        "digest",
        "epoch",
        "committed",
        "fold",
        "mesh",
        "groups",
        "layout",
    )
    rank: int = local()
    signature: Signature = wire(SIGNATURE, key="params")
    address: tuple[str, int] = wire(Spread(("host", Str(256)), ("port", PORT)))
    now: float | None = local(default=None)
    step: int = wire(STEP, default=0, optional=True)
    digest: bytes = wire(DIGEST, default=b"", optional=True)
    epoch: int = wire(EPOCH, default=0, optional=True)
    fold: bool = wire(Bool(), default=False, omit=False)
    mesh: MeshLayout | None = wire(MESH, default=None, omit=None)
    groups: tuple[GroupRanks, ...] | None = wire(GROUP_LIST, default=None, omit=None)
    committed: bool = wire(Bool(), default=False, omit=False)
    layout: ParallelLayout | None = wire(LAYOUT, default=None, omit=None)


@dataclass(frozen=True)
class Ready(WireMessage):
    """Rank ``rank``'s gradient bucket ``bucket`` of ``step`` is ready; ``spec`` is its layout.

    ``cached``: the rank did not wait for a go; it reduces the bucket at once because the
    members agreed on this spec for this bucket earlier in the epoch (Horovod's response cache:
    the coordinator still checks the report against that agreement, and the ring refuses a
    peer whose tensor differs). ``group``: the bucket is reduced within that declared process
    group, negotiated among its members only (absent: the world)."""

    KIND: ClassVar[str] = "ready"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = (
        "epoch",
        "step",
        "bucket",
        "spec",
        "cached",
        "group",
    )
    rank: int = local()
    step: int = wire(STEP)
    bucket: int = wire(BUCKET)
    spec: BucketSpec = wire(BUCKET_SPEC)
    epoch: int = wire(EPOCH, default=1)
    cached: bool = wire(Bool(), default=False, omit=False)
    group: str = wire(Str(256), default="", omit="")


@dataclass(frozen=True)
class Reduced(WireMessage):
    """Rank ``rank`` holds every bucket of ``step`` fully reduced (elastic runs). ``cached``:
    it reduced every bucket from the response cache under that `agreement_hash`."""

    KIND: ClassVar[str] = "reduced"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ("epoch", "step", "cached")
    rank: int = local()
    step: int = wire(STEP)
    epoch: int = wire(EPOCH, default=1)
    cached: str = wire(CACHED, default="", omit="")


@dataclass(frozen=True)
class Digest(WireMessage):
    """After the optimizer step of ``step``: a hash of all parameters and optimizer state, and
    per-tensor hashes in a fixed order (to name the first tensor that differs).

    The per-tensor hashes come either as ``tensor_digests`` (name, digest) pairs, or packed:
    ``packed`` holds them concatenated, all of one size, in the order of ``names``; ``names``
    is None when they are the names of this rank's previous digest in the epoch (a worker lists
    them once, not on every step; the core keeps them). On the wire both are field
    ``tensors``: a list of pairs, or the packed bytes. ``cached``: as in a `Reduced` report.
    ``algorithm``: the name of the algorithm that computed the per-tensor digests
    (``"xxh3-128"`` or ``"fold31x4"``, docs/digest.md; empty: unnamed); the coordinator compares
    digests of one algorithm only.
    """

    KIND: ClassVar[str] = "digest"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = (
        "epoch",
        "step",
        "digest",
        "tensors",
        "names",
        "cached",
        "algorithm",
    )
    rank: int = local()
    step: int = wire(STEP)
    digest: bytes = wire(DIGEST)
    tensor_digests: tuple[tuple[str, bytes], ...] = wire(
        Seq(Record(("name", NAME), ("digest", DIGEST)), _MAX_ITEMS), default=(), key="tensors"
    )
    epoch: int = wire(EPOCH, default=1)
    packed: bytes | None = wire(Bytes(_MAX_ITEMS), default=None, key="tensors", omit=None)
    names: tuple[str, ...] | None = wire(Seq(NAME, _MAX_ITEMS), default=None, omit=None)
    cached: str = wire(CACHED, default="", omit="")
    algorithm: str = wire(ALGORITHM, default="", omit="")

    def invariants(self) -> None:
        """Names come only with packed digests, and the packed bytes split into one equal
        digest per name."""
        if self.names is None:
            return
        if self.packed is None:
            raise Invalid(" comes only with packed 'tensors' (bytes)", "'names'")
        if packed_size(self.packed, len(self.names)) is None:
            raise Invalid(
                f" holds {len(self.packed)} bytes, which are not {len(self.names)} equal "
                f"digests of 1 to {MAX_DIGEST} bytes (one per name)",
                "'tensors'",
            )

    def pairs(self, names: Sequence[str] | None) -> tuple[tuple[str, bytes], ...]:
        """The per-tensor (name, digest) pairs; ``names``: those of a packed digest."""
        if self.packed is None:
            return self.tensor_digests
        size = None if names is None else packed_size(self.packed, len(names))
        if names is None or size is None:
            raise ValueError(f"{len(self.packed)} bytes of packed digests do not fit {names!r}")
        return tuple((name, self.packed[i * size : (i + 1) * size]) for i, name in enumerate(names))


@dataclass(frozen=True)
class StepDone(WireMessage):
    """Rank ``rank`` finished ``step`` (on steps that carry no digest); ``cached``: as in a
    `Reduced` report."""

    KIND: ClassVar[str] = "step_done"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ("epoch", "step", "cached")
    rank: int = local()
    step: int = wire(STEP)
    epoch: int = wire(EPOCH, default=1)
    cached: str = wire(CACHED, default="", omit="")


@dataclass(frozen=True)
class Heartbeat(WireMessage):
    """Rank ``rank`` is alive at the shell's time ``now`` (seconds); the frame is empty."""

    KIND: ClassVar[str] = "heartbeat"
    rank: int = local()
    now: float = local()


@dataclass(frozen=True)
class Finished(WireMessage):
    """Rank ``rank`` ran all its steps; ``step`` is the first step it will not run."""

    KIND: ClassVar[str] = "finished"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ("epoch", "step")
    rank: int = local()
    step: int = wire(STEP)
    epoch: int = wire(EPOCH, default=1)


WorkerReport = Joined | Ready | Reduced | Digest | StepDone | Heartbeat | Finished
"""What a worker sends the coordinator (the coordinator core's wire events)."""


# --------------------------------------------------------------------------- host -> root

MEMBER_JOIN = Record(
    ("rank", RANK),
    ("host", Str(256)),
    ("port", PORT),
    ("step", STEP),
    ("digest", DIGEST),
    ("epoch", EPOCH),
    ("committed", Bool()),
    ("fold", Bool()),
)
"""One worker's join as its host forwards it: [rank, host, port, step, digest, epoch,
committed, fold] (the fields of its `Joined`, the model signature sent once per host)."""

MemberJoin = tuple[int, str, int, int, bytes, int, bool, bool]

MEMBERS_MASK = Bytes(_MAX_WORLD // 8)
"""Some of a host's members in the current epoch, as a bit set over their positions: bit ``i``
(byte ``i // 8``, bit ``i % 8``, least significant first) is the host's ``i``-th member, its
members ranked ascending. One byte string whatever the ranks: the root checks that a host's
groups cover its members by comparing them with its full mask, with no per-rank work."""

DIGEST_GROUP = Record(("members", MEMBERS_MASK), ("digest", DIGEST), ("algorithm", ALGORITHM))
"""The members of one host that hold one state: [members, digest, algorithm]: which of them
(`MEMBERS_MASK`), their whole-state digest and the algorithm of their per-tensor digests."""

DigestGroup = tuple[bytes, bytes, str]

TENSOR_GROUP = Record(
    ("members", MEMBERS_MASK),
    ("digest", DIGEST),
    ("algorithm", ALGORITHM),
    ("tensors", Bytes(_MAX_ITEMS)),
    ("names", Seq(NAME, _MAX_ITEMS)),
)
"""The members of one host that hold one state, tensor by tensor: [members, digest, algorithm,
tensors, names]: as a `DIGEST_GROUP`, with their per-tensor digests packed (one size each) in
the order of ``names``."""

TensorGroup = tuple[bytes, bytes, str, bytes, tuple[str, ...]]


@dataclass(frozen=True)
class HostJoined(WireMessage):
    """Host ``host`` (the root's index of its connection) joins with every local worker:
    ``name`` (its host name, for messages), ``members`` (each worker's join) and the model
    ``signature`` every one of them announced."""

    KIND: ClassVar[str] = "host_join"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ("name", "members", "params")
    host: int = local()
    name: str = wire(Str(256, min_len=1))
    members: tuple[MemberJoin, ...] = wire(Seq(MEMBER_JOIN, _MAX_WORLD))
    signature: Signature = wire(SIGNATURE, key="params")


@dataclass(frozen=True)
class HostReady(WireMessage):
    """Every member of host ``host`` reported bucket ``bucket`` of ``step`` ready with
    ``spec`` (``cached``: every one of them reduces it from the response cache, and ``spec``
    is the agreed spec's hash)."""

    KIND: ClassVar[str] = "host_ready"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ("epoch", "step", "bucket", "spec", "cached")
    host: int = local()
    step: int = wire(STEP)
    bucket: int = wire(BUCKET)
    spec: BucketSpec = wire(BUCKET_SPEC)
    epoch: int = wire(EPOCH)
    cached: bool = wire(Bool(), default=False, omit=False)


@dataclass(frozen=True)
class HostReduced(WireMessage):
    """Every member of host ``host`` holds step ``step``'s reduced gradients (elastic runs).
    ``cached``: some member reduced buckets from the response cache without a ``ready`` each,
    under this `agreement_hash`: every agreed bucket the host did not report is reduced so."""

    KIND: ClassVar[str] = "host_reduced"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ("epoch", "step", "cached")
    host: int = local()
    step: int = wire(STEP)
    epoch: int = wire(EPOCH)
    cached: str = wire(CACHED, default="", omit="")


@dataclass(frozen=True)
class HostDigest(WireMessage):
    """Every member of host ``host`` reported its digest of ``step``: ``groups``, one per
    (digest, algorithm) its members hold (`DIGEST_GROUP`), every member in exactly one;
    ``cached``: as in `HostReduced`. The per-tensor digests stay on the host until the root
    asks for them (`DigestQuery`)."""

    KIND: ClassVar[str] = "host_digest"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ("epoch", "step", "groups", "cached")
    host: int = local()
    step: int = wire(STEP)
    epoch: int = wire(EPOCH)
    groups: tuple[DigestGroup, ...] = wire(Seq(DIGEST_GROUP, _MAX_WORLD))
    cached: str = wire(CACHED, default="", omit="")


@dataclass(frozen=True)
class HostTensors(WireMessage):
    """Host ``host``'s answer to a `DigestQuery` for ``step``: ``groups``, one per state its
    members hold (`TENSOR_GROUP`: digest, algorithm, per-tensor digests and their names),
    every member in exactly one."""

    KIND: ClassVar[str] = "host_tensors"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ("epoch", "step", "groups")
    host: int = local()
    step: int = wire(STEP)
    epoch: int = wire(EPOCH)
    groups: tuple[TensorGroup, ...] = wire(Seq(TENSOR_GROUP, _MAX_WORLD))


@dataclass(frozen=True)
class HostStepDone(WireMessage):
    """Every member of host ``host`` finished ``step`` (a step without a digest check);
    ``cached``: as in `HostReduced`."""

    KIND: ClassVar[str] = "host_step_done"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ("epoch", "step", "cached")
    host: int = local()
    step: int = wire(STEP)
    epoch: int = wire(EPOCH)
    cached: str = wire(CACHED, default="", omit="")


@dataclass(frozen=True)
class HostFinished(WireMessage):
    """Every member of host ``host`` ran all its steps; ``step``: the first it will not run."""

    KIND: ClassVar[str] = "host_finished"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ("epoch", "step")
    host: int = local()
    step: int = wire(STEP)
    epoch: int = wire(EPOCH)


@dataclass(frozen=True)
class HostLost(WireMessage):
    """Host ``host`` lost ``ranks`` of its members (dead, silent or evicted: ``reason``, as
    the flat coordinator words it after "rank r") in ``epoch`` of an elastic run."""

    KIND: ClassVar[str] = "host_lost"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ("epoch", "ranks", "reason")
    host: int = local()
    epoch: int = wire(EPOCH)
    ranks: tuple[int, ...] = wire(RANKS)
    reason: str = wire(REASON)


@dataclass(frozen=True)
class HostAbort(WireMessage):
    """Host ``host`` found what stops the run (a static run's loss or fault, members that
    disagree on a bucket): ``reason``, the flat coordinator's words."""

    KIND: ClassVar[str] = "host_abort"
    host: int = local()
    reason: str = wire(REASON)


@dataclass(frozen=True)
class HostStall(WireMessage):
    """Host ``host`` has had no report from some of its members for ``waited`` seconds while
    others are inside ``step``: ``bucket`` (-1: the step's end) is what it waits in, named
    ``call`` when it is a torch.distributed call (empty: not one), and ``members`` (a
    `MEMBERS_MASK`) those of its members that reported it. Sent only when the host stalls
    (at most once per quarter of the stall time), so the root can tell a stalled step from an
    idle one and name the ranks it waits for."""

    KIND: ClassVar[str] = "host_stall"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = (
        "epoch",
        "step",
        "bucket",
        "members",
        "call",
        "waited",
    )
    host: int = local()
    step: int = wire(STEP)
    epoch: int = wire(EPOCH)
    bucket: int = wire(Int(-1, MAX_INT))
    members: bytes = wire(MEMBERS_MASK)
    call: str = wire(Str(256))
    waited: float = wire(Float(0.0))


HostReport = (
    HostJoined
    | HostReady
    | HostReduced
    | HostDigest
    | HostStepDone
    | HostFinished
    | HostLost
    | HostAbort
    | HostTensors
    | HostStall
)
"""What a host's sub-coordinator sends the root coordinator (the root core's wire events)."""


# --------------------------------------------------------------------------- root -> host


@dataclass(frozen=True)
class DigestQuery(WireMessage):
    """The root -> every host of epoch ``epoch``: the hosts' digests of ``step`` disagree;
    answer with your members' per-tensor digests (`HostTensors`), so the root names the
    diverging ranks and the first tensor that differs. Never sent on to a worker."""

    KIND: ClassVar[str] = "digest_query"
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ("epoch", "step")
    step: int = wire(STEP)
    epoch: int = wire(EPOCH)


RootMessage = CoordinatorMessage | DigestQuery
"""What the root coordinator sends a host's sub-coordinator."""


# --------------------------------------------------------------------------- the kind tables


def _table(*classes: type[WireMessage]) -> Mapping[str, type[WireMessage]]:
    table: dict[str, type[WireMessage]] = {}
    for cls in classes:
        kind = schema(cls).kind  # compiles the declaration: a mistake fails at import
        if kind in table:
            raise TypeError(f"message kind {kind!r} is declared by {table[kind]} and {cls}")
        table[kind] = cls
    return MappingProxyType(table)


COORDINATOR_KINDS = _table(
    StartRun, Go, Apply, Commit, Hold, ResyncOrder, Shutdown, AbortRun, JoinRefused
)
"""The kinds the coordinator sends a worker."""
WORKER_KINDS = _table(Joined, Ready, Reduced, Digest, StepDone, Heartbeat, Finished)
"""The kinds a worker sends the coordinator."""
HOST_KINDS = _table(
    HostJoined,
    HostReady,
    HostReduced,
    HostDigest,
    HostStepDone,
    HostFinished,
    HostLost,
    HostAbort,
    HostTensors,
    HostStall,
)
"""The kinds a host's sub-coordinator sends the root (the root answers with `ROOT_KINDS`)."""
ROOT_KINDS = _table(*COORDINATOR_KINDS.values(), DigestQuery)
"""The kinds the root sends a host: the coordinator's (which the host fans out to its
workers) and the host's own `DigestQuery`."""
KINDS = _table(
    Hello,
    Challenge,
    Auth,
    Welcome,
    Refusal,
    RdvJoin,
    RdvTable,
    ShmHello,
    ShmOffer,
    ShmMapped,
    ShmReady,
    ShmStep,
    Coll,
    P2P,
    GroupAddr,
    Probe,
    ProbeData,
    StateManifest,
    StateTensor,
    *COORDINATOR_KINDS.values(),
    *WORKER_KINDS.values(),
    *HOST_KINDS.values(),
    DigestQuery,
)
"""Every kind a frame may carry, by its ``kind``: the closed set of the protocol."""


def validate_message(item: Any, *, peer: object = None, bulk: str | None = None) -> dict[str, Any]:
    """Check a decoded map against the protocol (version, kind, every field's type and range)
    and return it unchanged; ProtocolError names the kind, the field and ``peer``. ``bulk``:
    the field whose tensor the frame's bulk bytes will fill (present, not yet read)."""
    return check_item(item, KINDS, peer=peer, present=bulk)


def decode_message(item: Any, *, peer: object = None, **context: Any) -> WireMessage:
    """The message of any kind that a decoded map holds (``context``: its `local` fields)."""
    return decode(item, KINDS, peer=peer, **context)


def message_from_wire(item: Mapping[str, Any], *, peer: object = None) -> CoordinatorMessage:
    """Parse a decoded coordinator -> worker message (the worker's side)."""
    message = build_checked(item, COORDINATOR_KINDS, {})
    if message is not None:
        return message
    spec = check_envelope(item, KINDS, peer)
    assert spec is not None
    if spec.kind not in COORDINATOR_KINDS:
        raise ProtocolError(f"a {spec.kind} message does not come from the coordinator", peer=peer)
    return decode_as(spec, item, peer, {})


def root_message_from_wire(item: Mapping[str, Any], *, peer: object = None) -> RootMessage:
    """Parse a decoded root -> host message (a host sub-coordinator's side): a coordinator
    kind or a `DigestQuery`."""
    message = build_checked(item, ROOT_KINDS, {})
    if message is not None:
        return message
    spec = check_envelope(item, KINDS, peer)
    assert spec is not None
    if spec.kind not in ROOT_KINDS:
        raise ProtocolError(f"a {spec.kind} message does not come from the root", peer=peer)
    return decode_as(spec, item, peer, {})


def host_event_from_wire(item: Mapping[str, Any], *, host: int) -> HostReport:
    """Parse a decoded host -> root message from the sub-coordinator of host index ``host``
    (the root's, from the connection). ProtocolError names the kind, the field and the host."""
    message = build_checked(item, HOST_KINDS, {"host": host})
    if message is not None:
        return message
    peer = f"host {host}"
    spec = check_envelope(item, KINDS, peer)
    assert spec is not None
    if spec.kind not in HOST_KINDS:
        raise ProtocolError(f"a {spec.kind} message is not for the root coordinator", peer=peer)
    return decode_as(spec, item, peer, {"host": host})


def event_from_wire(item: Mapping[str, Any], *, rank: int, now: float) -> WorkerReport:
    """Parse a decoded worker -> coordinator message from authenticated rank ``rank``, which
    arrived at the shell's time ``now``. ProtocolError names the kind, field and rank."""
    message = build_checked(item, WORKER_KINDS, {"rank": rank, "now": now})
    if message is not None:
        return message
    spec = check_envelope(item, KINDS, rank)
    assert spec is not None
    if spec.kind not in WORKER_KINDS:
        raise ProtocolError(f"a {spec.kind} message is not for the coordinator", peer=rank)
    return decode_as(spec, item, rank, {"rank": rank, "now": now})
