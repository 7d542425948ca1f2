"""Fuzz a live paramsync deployment: hostile peers against a coordinator or a worker listener.

`HostileMachine` (built by `hostile_machine`) is a hypothesis `RuleBasedStateMachine` that
plays up to ``peers`` connections against the listener at ``host:port``:

- without the secret, as strangers: raw bytes before any handshake (every frame of
  `paramsync.runtime.testing.strategies`, valid and hostile), hellos and forged proofs;
- with the secret, also as authenticated but misbehaving members: handshakes claiming ranks
  (free, taken, out of range, another group or world size), then frames that are forged (a
  wrong tag, a flipped bit, a bad trailer, none), malformed, hostile CBOR, or valid reports
  from a peer that never joined. It never sends a genuine join (``join``, ``rdv_join``): a
  peer that joins is a member, and what a member may do to its own run is no fault.

After every step it checks that

- the target still answers a legitimate peer's hello with its challenge within ``deadline``;
- the target process's resident memory stays within ``memory_bound`` bytes of what it held
  when the run began (read from ``/proc`` when the target runs on this host as this user);
- nothing it did was wrong: it admitted no peer it must refuse (a stranger, another group or
  world size, a rank outside the run, a rank one of our open connections holds), it hung up
  on every complete frame it must refuse (a forged tag, a malformed item) instead of acting on
  it, and it answered no report from a peer that never joined with anything but a refusal.

`fuzz` runs the machine for a bounded number of examples and seconds and returns a `Summary`;
`check_deployment` is the pytest entry point (it raises `DeploymentFault` on a failure, with
the minimal reproducing example hypothesis shrank to); ``paramsync fuzz`` is the command line.

Only loopback targets are fuzzed unless the caller names its own hosts (`check_target`): the
machine opens connections and sends hostile bytes, which must never reach a host by mistake.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import re
import socket
import struct
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import cbor2
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure
from hypothesis.reporting import with_reporter
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from paramsync.runtime.errors import ProtocolError
from paramsync.runtime.protocol.frame_auth import FrameOpener, FrameSealer, frame_session
from paramsync.runtime.protocol.handshake import DialerHandshake, Identity
from paramsync.runtime.protocol.messages import WORKER_KINDS
from paramsync.runtime.protocol.wire import (
    PREFIX_SIZE,
    TAG_SIZE,
    TRAILER_SIZE,
    encode_frame_bytes,
)
from paramsync.runtime.testing.process_watch import PROBE_SOURCE, listening_pid, process_memory
from paramsync.runtime.testing.strategies import (
    Frame,
    hostile_frames,
    seal_modes,
    spoil,
    valid_frames,
)

__all__ = [
    "DEFAULT_GROUP",
    "Deployment",
    "DeploymentFault",
    "HostileMachine",
    "Summary",
    "check_deployment",
    "check_target",
    "fuzz",
    "hostile_machine",
]

DEFAULT_GROUP = "paramsync"
"""The group name a run uses unless told otherwise
(`paramsync.runtime.transport.tcp.DEFAULT_GROUP`)."""
JOIN_KINDS = frozenset({"join", "rdv_join"})
"""Kinds the machine never sends genuinely sealed: they make a peer a member of the run."""
REPORT_KINDS = tuple(sorted(set(WORKER_KINDS) - JOIN_KINDS))
"""What a member reports to its coordinator, a join aside."""
REFUSALS = frozenset({"refuse", "join_refused"})
"""What a target may say to a peer it refuses, before hanging up."""
QUIET = frozenset({"heartbeat"})
"""What a target may say to anyone at any time."""
STRANGER_SECRET = b"paramsync-fuzz: not the run's secret"
"""The secret strangers hold (one, so its scrypt stretching is paid once)."""
_MAX_REPLY = 1 << 20
_REASONS_SHOWN = 20
_GLANCE = 0.02
"""Seconds the machine waits for an answer that may not come (a frame the target may wait on,
a report it may ignore); what comes later is read after the next step's probe (`_sweep`)."""


class DeploymentFault(AssertionError):
    """The target did something wrong; the message says what, after which step."""


def _connectable(address: str) -> str:
    """``address`` as a socket connects to it: an IPv4-mapped IPv6 address (``::ffff:a.b.c.d``)
    as its IPv4 form, anything else as it is."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped) if mapped is not None else address


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(_connectable(address).split("%")[0]).is_loopback


def check_target(host: str, allowed_hosts: Sequence[str] = ()) -> str:
    """Refuse to fuzz ``host`` unless it is loopback (an address in 127.0.0.0/8 or ::1, their
    IPv4-mapped forms such as ``::ffff:127.0.0.1``, or a name resolving only to them) or named in
    ``allowed_hosts`` exactly as given: the caller's own hosts, named on purpose. ValueError
    says which rule refused it.

    Returns the address checked, which every connection of the fuzz run then dials: the name
    is resolved once, here, so a resolver that answers differently later (DNS rebinding) never
    turns the hostile traffic elsewhere. An IPv4-mapped address is returned in its IPv4 form; of
    a name's addresses, its first IPv4 one, else its first."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"target host {host!r} does not resolve: {exc}") from None
    addresses = list(dict.fromkeys(_connectable(str(info[4][0])) for info in infos))
    if addresses and (host in allowed_hosts or all(_is_loopback(a) for a in addresses)):
        return next((a for a in addresses if ":" not in a), addresses[0])
    raise ValueError(
        f"target host {host!r} ({', '.join(sorted(addresses))}) is not loopback: fuzzing sends "
        "hostile traffic, so only loopback targets are fuzzed unless you name the host as "
        "your own (--allow-host HOST, or allowed_hosts=[HOST])"
    )


@dataclass(frozen=True)
class Deployment:
    """The listener under test and the bounds it is held to. Making one checks ``host``
    (`check_target`, a ValueError when refused) and pins the address it resolved to: every
    connection dials `ip`, never ``host`` again."""

    host: str
    port: int
    secret: bytes | None = None
    """The run's shared secret: with it the machine also plays authenticated members."""
    group: str = DEFAULT_GROUP
    world_size: int | None = None
    """The run's world size (None: learned from the target with the secret, else 2)."""
    deadline: float = 2.0
    """Seconds within which the target must answer a legitimate hello, and hang up on a
    complete frame it must refuse."""
    memory_bound: int = 64 * 2**20
    """Bytes the target's resident memory may grow by over the whole fuzz run."""
    pid: int | None = None
    """The target's process (None: the process listening at the address, on this host)."""
    peers: int = 3
    """Hostile connections open at once, at most."""
    allowed_hosts: tuple[str, ...] = ()
    """Non-loopback hosts the caller names as its own (`check_target`)."""
    ip: str = field(init=False, default="")
    """The address ``host`` was checked as (`check_target`): the one every connection dials."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ip", check_target(self.host, self.allowed_hosts))

    @property
    def address(self) -> tuple[str, int]:
        """Where every connection goes: the checked address and the port."""
        return self.ip, self.port


@dataclass
class Summary:
    """What a fuzz run did and found."""

    target: str
    examples: int = 0
    """Examples run against the target (a failure's shrinking replays included)."""
    steps: int = 0
    seconds: float = 0.0
    refusals: Counter[str] = field(default_factory=Counter)
    """How the target turned the machine's peers away, by reason (numbers elided)."""
    admitted: int = 0
    """Member handshakes the target welcomed (free ranks claimed with the secret)."""
    worst_response: float = 0.0
    """The slowest answer to a legitimate peer's hello, in seconds."""
    memory_start: int | None = None
    memory_peak: int | None = None
    """The target's resident memory in bytes (None: not readable from here)."""
    memory_bound: int = 0
    failure: str | None = None
    """What the target did wrong, with the minimal reproducing example (None: nothing)."""
    failing: bool = False
    """Whether the machine has seen the target fail (its shrinking is under way)."""
    died_during: list[str] | None = None
    """The steps of the first example after which the target stopped answering."""

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def memory_growth(self) -> int:
        """Bytes the target's memory peaked above its start (0 when not readable)."""
        if self.memory_start is None or self.memory_peak is None:
            return 0
        return self.memory_peak - self.memory_start

    def format(self) -> str:
        """The summary as ``paramsync fuzz`` prints it."""
        mib = 2**20
        lines = [
            f"target            {self.target}",
            f"examples          {self.examples} ({self.steps} steps) in {self.seconds:.1f} s",
            f"worst response    {self.worst_response * 1e3:.1f} ms (a legitimate hello)",
        ]
        if self.memory_start is not None and self.memory_peak is not None:
            lines.append(
                f"memory            {self.memory_start / mib:.1f} MiB at start, peak "
                f"{self.memory_peak / mib:.1f} MiB (+{self.memory_growth / mib:.1f} MiB; bound "
                f"+{self.memory_bound / mib:.0f} MiB)"
            )
        else:
            lines.append("memory            not readable from here (another host or user)")
        lines.append(f"members admitted  {self.admitted} (free ranks claimed with the secret)")
        lines.append(f"refusals by reason ({sum(self.refusals.values())} in all):")
        ranked = self.refusals.most_common()
        for reason, count in ranked[:_REASONS_SHOWN]:
            lines.append(f"  {count:6d}  {reason}")
        if len(ranked) > _REASONS_SHOWN:
            rest = sum(count for _, count in ranked[_REASONS_SHOWN:])
            lines.append(f"  {rest:6d}  ({len(ranked) - _REASONS_SHOWN} more reasons)")
        if self.failure is None:
            lines.append("result            no failure")
        else:
            lines.append("result            FAILURE")
            lines.append(self.failure)
        return "\n".join(lines)


# --------------------------------------------------------------------------- one peer


@dataclass
class _Reply:
    what: str
    """``message``, ``closed``, ``silence`` or ``unreadable``."""
    message: dict[str, Any] | None = None
    detail: str = ""

    @property
    def kind(self) -> str | None:
        return None if self.message is None else str(self.message.get("kind"))

    def describe(self) -> str:
        if self.message is not None:
            reason = self.message.get("reason")
            return f"{self.kind}" + (f" ({reason})" if reason else "")
        return self.what + (f": {self.detail}" if self.detail else "")


class _Peer:
    """One blocking TCP connection to the target, framed by the wire codec."""

    def __init__(self, sock: socket.socket, number: int) -> None:
        self.sock = sock
        self.number = number
        self.phase = "fresh"
        """fresh (nothing sent), hello (challenged), member (authenticated), tainted (sent
        bytes the target may still be waiting on), closed."""
        self.sealer: FrameSealer | None = None
        self.opener: FrameOpener | None = None
        self.rank: int | None = None
        self._buf = b""
        self.eof = False

    def send(self, data: bytes) -> bool:
        """Send ``data``; False if the target had hung up."""
        try:
            self.sock.sendall(data)
        except OSError:
            self.eof = True
            return False
        return True

    def _fill(self, need: int, until: float) -> bool:
        while len(self._buf) < need:
            left = until - time.monotonic()
            if left <= 0:
                return False
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                return False
            except OSError:
                chunk = b""
            if not chunk:
                self.eof = True
                return False
            self._buf += chunk
        return True

    def read(self, seconds: float) -> _Reply:
        """The target's next frame within ``seconds``: a message, ``closed`` or ``silence``."""
        until = time.monotonic() + seconds
        if not self._fill(PREFIX_SIZE, until):
            return _Reply("closed" if self.eof else "silence")
        item_len, bulk_len = struct.unpack(">II", self._buf[:PREFIX_SIZE])
        if item_len > _MAX_REPLY or bulk_len:
            return _Reply("unreadable", detail=f"a reply announcing {item_len} bytes")
        trailer = TRAILER_SIZE if self.opener is not None else 0
        if not self._fill(PREFIX_SIZE + item_len + trailer, until):
            return _Reply("closed" if self.eof else "silence", detail="in the middle of a frame")
        whole = self._buf[: PREFIX_SIZE + item_len]
        tail = self._buf[PREFIX_SIZE + item_len : PREFIX_SIZE + item_len + trailer]
        self._buf = self._buf[PREFIX_SIZE + item_len + trailer :]
        if self.opener is not None:
            try:
                self.opener.open([whole], tail)
            except ProtocolError as exc:
                return _Reply("unreadable", detail=str(exc))
        try:
            message = cbor2.loads(whole[PREFIX_SIZE:])
        except (cbor2.CBORError, ValueError) as exc:
            return _Reply("unreadable", detail=f"undecodable reply: {exc}")
        if not isinstance(message, dict):
            return _Reply("unreadable", detail="a reply that is no map")
        return _Reply("message", message)

    def close(self) -> None:
        self.phase = "closed"
        with contextlib.suppress(OSError):
            self.sock.close()

    def still_open(self) -> bool:
        """Whether the target has not hung up on this connection (buffered replies kept)."""
        if self.eof:
            return False
        self.sock.setblocking(False)
        try:
            chunk = self.sock.recv(65536)
        except BlockingIOError:
            return True
        except OSError:
            chunk = b""
        finally:
            self.sock.setblocking(True)
        if not chunk:
            self.eof = True
            return False
        self._buf += chunk
        return True


def _frame(kind: str, fields: dict[str, Any]) -> bytes:
    return encode_frame_bytes(kind, fields)


def _dial(deployment: Deployment, source: str | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in deployment.ip else socket.AF_INET)
    sock.settimeout(deployment.deadline)
    try:
        if source is not None:
            sock.bind((source, 0))
        sock.connect(deployment.address)
    except OSError:
        sock.close()
        raise
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _probe_source(deployment: Deployment) -> str | None:
    return PROBE_SOURCE if deployment.ip.startswith("127.") else None


def _handshake(
    peer: _Peer, secret: bytes, me: Identity, seconds: float, proof: bytes | None = None
) -> list[_Reply]:
    """Run the dialer's handshake on ``peer`` (with ``proof`` given, send it as the auth
    instead of the real one): every reply, the last a welcome, a refusal or what ended it.
    A welcome makes ``peer`` a member (its frames sealed from then on)."""
    state = DialerHandshake(secret, me)
    peer.send(_frame(*state.hello()))
    first = peer.read(seconds)
    if first.kind != "challenge":
        return [first]
    assert first.message is not None
    try:
        kind, fields = state.on_challenge(first.message)
    except ProtocolError as exc:
        return [first, _Reply("unreadable", detail=f"a challenge the dialer refuses: {exc}")]
    if proof is not None:
        fields = {"proof": proof}
    peer.send(_frame(kind, fields))
    verdict = peer.read(seconds)
    if verdict.kind == "welcome" and proof is None:
        assert verdict.message is not None
        try:
            state.on_verdict(verdict.message)
        except ProtocolError as exc:
            return [first, _Reply("unreadable", detail=f"a welcome without a valid proof: {exc}")]
        session = frame_session(state.session_key(), dialer=True)
        peer.sealer, peer.opener = session.sealer, session.opener
        peer.phase, peer.rank = "member", me.rank
    return [first, verdict]


_NUMBERS = re.compile(r"\d+")


def _reason(reply: _Reply) -> str:
    """A refusal's reason with its numbers and quoted parts elided, for counting by reason."""
    text = reply.describe()
    if "'" in text:
        text = text[: text.index("'")] + "...)"
    return _NUMBERS.sub("N", text)[:90]


def discover_world_size(deployment: Deployment) -> int:
    """The target run's world size: as given, else (with the secret) read from the refusal of a
    claim no run matches, else 2 (any claim gets a stranger its challenge)."""
    if deployment.world_size is not None:
        return deployment.world_size
    if deployment.secret is None:
        return 2
    claim = 1 << 16
    peer = _Peer(_dial(deployment, _probe_source(deployment)), 0)
    try:
        replies = _handshake(
            peer, deployment.secret, Identity(deployment.group, claim, 0), deployment.deadline
        )
    finally:
        peer.close()
    last = replies[-1]
    reason = str(last.message.get("reason", "")) if last.message else last.describe()
    found = re.search(r"world size \d+ does not match this group's (\d+)", reason)
    if found is None:
        raise ValueError(
            f"could not learn the world size of {deployment.host}:{deployment.port} (it "
            f"answered a claim of world size {claim} with: {last.describe()}); pass it "
            "(--world-size) and check the group (--group) and the secret"
        )
    return int(found.group(1))


def probe(deployment: Deployment, world_size: int) -> float:
    """Seconds from a legitimate peer's connect to the target's challenge to its hello;
    DeploymentFault if it does not come within the deadline."""
    state = DialerHandshake(
        deployment.secret or STRANGER_SECRET, Identity(deployment.group, world_size, 0)
    )
    hello = _frame(*state.hello())
    started = time.monotonic()
    try:
        sock = _dial(deployment, _probe_source(deployment))
    except OSError as exc:
        raise DeploymentFault(f"a legitimate peer could not connect to the target: {exc}") from None
    peer = _Peer(sock, -1)
    try:
        peer.send(hello)
        reply = peer.read(deployment.deadline)
    finally:
        peer.close()
    took = time.monotonic() - started
    if reply.kind != "challenge":
        raise DeploymentFault(
            f"the target did not answer a legitimate peer's hello within {deployment.deadline} s "
            f"with its challenge: {reply.describe()}"
        )
    return took


# --------------------------------------------------------------------------- the machine


class HostileMachine(RuleBasedStateMachine):
    """Hostile peers against one live target; `hostile_machine` binds the target."""

    deployment: Deployment
    world_size: int
    summary: Summary
    pid: int | None
    stop_at: float = math.inf
    """When (``time.monotonic``) examples stop acting: later ones are idle and cost nothing,
    so a fixed ``max_examples`` run ends soon after; not while a failure is being shrunk."""

    def __init__(self) -> None:
        super().__init__()
        self.peers: list[_Peer] = []
        self.opened = 0
        self.log: list[str] = ["state = HostileMachine()"]
        self.idle = time.monotonic() > self.stop_at and not self.summary.failing
        if not self.idle:
            self.summary.examples += 1

    # ---------------------------------------------------------------- helpers

    def _pick(self, index: int, phases: Sequence[str] | None = None) -> _Peer | None:
        """One of our connections in ``phases`` (None: there is none). Every rule is always
        enabled and draws the same whatever the target did, so hypothesis replays an example
        choice for choice; a rule with no connection to act on does nothing."""
        peers = [p for p in self.peers if phases is None or p.phase in phases]
        return peers[index % len(peers)] if peers else None

    def _fault(self, text: str) -> DeploymentFault:
        """The fault to raise: shrinking it goes on past ``stop_at``."""
        self.summary.failing = True
        return DeploymentFault(text)

    def _step(self, name: str, **args: Any) -> bool:
        """Count a step and log it as hypothesis would print it (the reproducer of an
        example during which the target died, which cannot be shrunk against a dead target);
        False: the example is idle (time is up), the step does nothing."""
        if self.idle:
            return False
        self.summary.steps += 1
        shown = ", ".join(f"{key}={value!r}" for key, value in args.items())
        self.log.append(f"state.{name}({shown})")
        return True

    def _drop(self, peer: _Peer) -> None:
        peer.close()
        self.peers.remove(peer)

    def _refused(self, peer: _Peer, replies: Sequence[_Reply]) -> None:
        for reply in replies:
            if reply.what != "silence" and reply.kind not in QUIET | {"challenge"}:
                self.summary.refusals[_reason(reply)] += 1

    def _until_hung_up(self, peer: _Peer, why: str) -> None:
        """The target must hang up on ``peer`` within the deadline, saying nothing but a
        refusal first."""
        until = time.monotonic() + self.deployment.deadline
        said: list[_Reply] = []
        while True:
            reply = peer.read(max(0.0, until - time.monotonic()))
            said.append(reply)
            if reply.what in ("closed", "unreadable"):
                break
            if reply.what == "silence":
                raise self._fault(
                    f"the target kept connection {peer.number} open for {self.deployment.deadline}"
                    f" s after {why}: it must hang up (it said: "
                    f"{'; '.join(r.describe() for r in said[:-1]) or 'nothing'})"
                )
            if reply.kind not in REFUSALS | QUIET:
                raise self._fault(
                    f"the target acted on {why}: it answered {reply.describe()} on connection "
                    f"{peer.number} instead of hanging up"
                )
        self._refused(peer, said)
        self._drop(peer)

    def _glance(
        self, peer: _Peer, why: str, allowed: frozenset[str], wait: float = _GLANCE
    ) -> None:
        """Whatever the target says on ``peer`` within ``wait`` seconds must be in ``allowed``
        (or quiet)."""
        said: list[_Reply] = []
        while True:
            reply = peer.read(wait)
            if reply.what == "silence":
                break
            said.append(reply)
            if reply.what in ("closed", "unreadable"):
                self._refused(peer, said)
                self._drop(peer)
                return
            if reply.kind not in allowed | QUIET:
                raise self._fault(
                    f"the target acted on {why}: it answered {reply.describe()} on connection "
                    f"{peer.number}"
                )
        self._refused(peer, said)

    # ---------------------------------------------------------------- rules

    @initialize()
    def start_as_member(self) -> None:
        """With the secret, begin as an authenticated peer of the first free rank (if any), so
        that every example has a member to misbehave with."""
        if self.deployment.secret is None or self.idle:
            return
        self.log.append("state.start_as_member()")
        for rank in range(min(self.world_size, 8)):
            self.opened += 1
            try:
                peer = _Peer(_dial(self.deployment), self.opened)
            except OSError as exc:
                raise self._fault(f"the target refused a TCP connection: {exc}") from None
            me = Identity(self.deployment.group, self.world_size, rank)
            _handshake(peer, self.deployment.secret, me, self.deployment.deadline)
            if peer.phase == "member":
                self.summary.admitted += 1
                self.peers.append(peer)
                return
            peer.close()

    @rule()
    def connect(self) -> None:
        """Open a connection (the target must accept or refuse it; either is fine)."""
        if len(self.peers) >= self.deployment.peers:
            return
        self.opened += 1
        if not self._step("connect"):
            return
        try:
            sock = _dial(self.deployment)
        except OSError as exc:
            raise self._fault(f"the target refused a TCP connection: {exc}") from None
        self.peers.append(_Peer(sock, self.opened))

    @rule(
        pick=st.integers(0, 7),
        rank=st.integers(-1, 9),
        proof=st.binary(min_size=32, max_size=32),
    )
    def stranger_handshake(self, pick: int, rank: int, proof: bytes) -> None:
        """A stranger's hello, then a proof it cannot have: refused, never welcomed."""
        if not self._step("stranger_handshake", pick=pick, rank=rank, proof=proof):
            return
        peer = self._pick(pick, ("fresh",))
        if peer is None:
            return
        me = Identity(self.deployment.group, self.world_size, rank)
        replies = _handshake(peer, STRANGER_SECRET, me, self.deployment.deadline, proof)
        if any(r.kind == "welcome" for r in replies):
            raise self._fault(
                f"the target welcomed a stranger claiming rank {rank} with a made-up proof"
            )
        self._refused(peer, replies)
        self._drop(peer)

    @precondition(lambda self: self.deployment.secret is not None)
    @rule(
        pick=st.integers(0, 7),
        rank=st.integers(-1, 9),
        in_run=st.booleans(),
        group_ok=st.sampled_from((True, True, True, False)),
        world_ok=st.sampled_from((True, True, True, False)),
    )
    def member_handshake(
        self, pick: int, rank: int, in_run: bool, group_ok: bool, world_ok: bool
    ) -> None:
        """A handshake holding the secret, claiming ``rank`` (``in_run``: that rank modulo the
        world size) of the target's group and world size, or not: a claim the run cannot hold
        must be refused, and so must a rank one of our open connections holds."""
        if not self._step(
            "member_handshake",
            pick=pick,
            rank=rank,
            in_run=in_run,
            group_ok=group_ok,
            world_ok=world_ok,
        ):
            return
        assert self.deployment.secret is not None
        peer = self._pick(pick, ("fresh",))
        if peer is None:
            return
        rank = rank % self.world_size if in_run else rank
        group = self.deployment.group if group_ok else f"{self.deployment.group}-not"
        world = self.world_size if world_ok else self.world_size + 1
        holders = [p for p in self.peers if p.phase == "member" and p.rank == rank]
        replies = _handshake(
            peer, self.deployment.secret, Identity(group, world, rank), self.deployment.deadline
        )
        if peer.phase != "member":
            if replies[-1].what == "silence":
                raise self._fault(
                    f"the target gave no verdict within {self.deployment.deadline} s to a "
                    f"handshake holding the secret (claiming rank {rank})"
                )
            self._refused(peer, replies)
            self._drop(peer)
            return
        self.summary.admitted += 1
        if not group_ok or not world_ok or not 0 <= rank < self.world_size:
            raise self._fault(
                f"the target admitted a peer it must refuse: group {group!r}, world size "
                f"{world}, rank {rank} (the run: group {self.deployment.group!r}, world size "
                f"{self.world_size})"
            )
        time.sleep(_GLANCE)  # a holder the target was closing meanwhile: let it finish
        still = [p for p in holders if p.still_open()]
        if still:
            raise self._fault(
                f"the target admitted a second peer as rank {rank} while connection "
                f"{still[0].number} holds that rank"
            )

    @rule(
        pick=st.integers(0, 7),
        frame=st.one_of(valid_frames(tensors=False), hostile_frames()),
    )
    def send_before_auth(self, pick: int, frame: Frame) -> None:
        """One frame, as it is, on a connection that has not authenticated: a complete frame
        that is not the handshake's next is refused (the connection closed)."""
        if not self._step("send_before_auth", pick=pick, frame=frame):
            return
        peer = self._pick(pick, ("fresh", "hello", "tainted"))
        if peer is None:
            return
        phase = peer.phase
        if not peer.send(frame.data):
            self._drop(peer)
            return
        what = f"{frame.label} from connection {peer.number} before authenticating"
        if phase == "tainted" or not frame.complete:
            peer.phase = "tainted"
            self._glance(peer, what, REFUSALS | {"challenge"})
        elif phase == "fresh" and frame.valid and frame.kind == "hello":
            reply = peer.read(self.deployment.deadline)
            if reply.kind == "challenge":
                peer.phase = "hello"
            elif reply.kind in REFUSALS or reply.what == "closed":
                self._refused(peer, [reply])
                self._drop(peer)
            else:
                raise self._fault(f"the target answered {what} with {reply.describe()}")
        else:
            self._until_hung_up(peer, what)

    @precondition(lambda self: self.deployment.secret is not None)
    @rule(
        pick=st.integers(0, 7),
        frame=st.one_of(
            valid_frames(REPORT_KINDS, tensors=False),
            valid_frames(tensors=False),
            hostile_frames(),
        ),
        mode=st.one_of(st.just("sealed"), seal_modes()),
        tag=st.binary(min_size=TAG_SIZE, max_size=TAG_SIZE),
        bit=st.integers(0, 2**16),
    )
    def send_as_member(self, pick: int, frame: Frame, mode: str, tag: bytes, bit: int) -> None:
        """One frame on an authenticated connection, sealed, forged or unsealed
        (`paramsync.runtime.testing.strategies.SEAL_MODES`): a forged or malformed complete frame is
        refused (the connection closed, nothing acted on); a valid report from a peer that
        never joined is refused or ignored."""
        if not self._step("send_as_member", pick=pick, frame=frame, mode=mode, tag=tag, bit=bit):
            return
        peer = self._pick(pick, ("member",))
        if peer is None:
            return
        assert peer.sealer is not None
        if mode == "sealed" and frame.valid and frame.kind in JOIN_KINDS:
            mode = "wrong tag"  # a genuine join would make the machine a member
        trailer = peer.sealer.seal([frame.data]) if mode != "unsealed" else b""
        if not peer.send(spoil(frame.data, trailer, mode, tag=tag, bit=bit)):
            self._drop(peer)
            return
        what = f"{frame.label} ({mode}) from connection {peer.number}, authenticated"
        if not frame.complete or mode == "unsealed":
            peer.phase = "tainted"
            self._glance(peer, what, REFUSALS)
        elif mode == "sealed" and frame.valid:
            self._glance(peer, f"a {frame.kind} from a peer that never joined", REFUSALS)
        else:
            self._until_hung_up(peer, what)

    @precondition(lambda self: self.deployment.secret is not None)
    @rule(pick=st.integers(0, 7), frame=valid_frames(REPORT_KINDS, tensors=False))
    def report_without_joining(self, pick: int, frame: Frame) -> None:
        """A valid, sealed report (``ready``, ``digest``, ``finished``...) from an
        authenticated peer that never joined: refused or ignored, never acted on."""
        if not self._step("report_without_joining", pick=pick, frame=frame):
            return
        peer = self._pick(pick, ("member",))
        if peer is None:
            return
        assert peer.sealer is not None
        if not peer.send(frame.data + peer.sealer.seal([frame.data])):
            self._drop(peer)
            return
        self._glance(peer, f"a {frame.kind} from a peer that never joined", REFUSALS)

    @rule(pick=st.integers(0, 7))
    def hang_up(self, pick: int) -> None:
        """Close one connection without a word."""
        if not self._step("hang_up", pick=pick):
            return
        peer = self._pick(pick)
        if peer is not None:
            self._drop(peer)

    # ---------------------------------------------------------------- checks

    def _sweep(self) -> None:
        """Read what the target said meanwhile on every open connection: refusals only."""
        for peer in list(self.peers):
            if peer.phase in ("member", "tainted") and peer.still_open():
                self._glance(peer, f"what connection {peer.number} sent before", REFUSALS, 0.0)

    @invariant()
    def still_serving(self) -> None:
        """A legitimate peer is answered within the deadline; memory within its bound; what
        the target said meanwhile on our connections is a refusal at most."""
        if self.idle:
            return
        try:
            took = probe(self.deployment, self.world_size)
        except DeploymentFault:
            self.summary.failing = True
            if self.summary.died_during is None:
                self.summary.died_during = list(self.log)
            raise
        self.summary.worst_response = max(self.summary.worst_response, took)
        self._sweep()
        if self.pid is None:
            return
        rss = process_memory(self.pid)
        if rss is None:
            raise self._fault(f"the target process {self.pid} is gone")
        start = self.summary.memory_start or rss
        self.summary.memory_peak = max(self.summary.memory_peak or 0, rss)
        if rss - start > self.deployment.memory_bound:
            raise self._fault(
                f"the target's memory grew by {(rss - start) / 2**20:.1f} MiB, over the bound "
                f"of {self.deployment.memory_bound / 2**20:.1f} MiB"
            )

    def teardown(self) -> None:
        for peer in self.peers:
            peer.close()
        self.peers.clear()


def hostile_machine(deployment: Deployment, summary: Summary | None = None) -> type[HostileMachine]:
    """A `HostileMachine` class bound to ``deployment`` (checked by `check_target` when it was
    made), counting into ``summary``. Run it with hypothesis (``run_state_machine_as_test``, or
    ``Machine.TestCase`` in a unittest/pytest module)."""
    try:
        world_size = discover_world_size(deployment)
        probe(deployment, world_size)
    except (DeploymentFault, OSError) as exc:
        raise ConnectionError(
            f"nothing answers a hello at {deployment.host}:{deployment.port}: {exc}"
        ) from None
    pid = deployment.pid if deployment.pid is not None else listening_pid(*deployment.address)
    if summary is None:
        summary = Summary(f"{deployment.host}:{deployment.port}")
    summary.memory_bound = deployment.memory_bound
    if pid is not None and summary.memory_start is None:
        summary.memory_start = process_memory(pid)
        summary.memory_peak = summary.memory_start
    return type(
        "HostileMachine",
        (HostileMachine,),
        {"deployment": deployment, "world_size": world_size, "summary": summary, "pid": pid},
    )


@contextlib.contextmanager
def _captured(lines: list[str]) -> Iterator[None]:
    with with_reporter(lambda text: lines.append(str(text))):
        yield


def fuzz(
    deployment: Deployment,
    *,
    examples: int = 100,
    seconds: float = 60.0,
    steps: int = 20,
    batch: int = 25,
) -> Summary:
    """Run `HostileMachine` against ``deployment`` for at most ``examples`` examples of at
    most ``steps`` steps each, starting none after ``seconds`` seconds (the shrinking of a
    failure may take longer). Examples run in hypothesis runs of ``batch`` each (time is
    checked between them; within one, examples after the time do nothing). Returns the
    `Summary`; a failure's minimal example (hypothesis's shrunk steps) is in
    ``summary.failure``."""
    if examples < 1 or not math.isfinite(seconds) or seconds <= 0 or steps < 1 or batch < 1:
        raise ValueError(
            f"fuzz: examples ({examples}), steps ({steps}) and batch ({batch}) must be >= 1 "
            f"and seconds ({seconds}) positive and finite"
        )
    summary = Summary(f"{deployment.host}:{deployment.port}")
    machine = hostile_machine(deployment, summary)
    started = time.monotonic()
    machine.stop_at = started + seconds
    while summary.examples < examples and time.monotonic() < machine.stop_at:
        options = settings(
            max_examples=min(batch, examples - summary.examples),
            stateful_step_count=steps,
            deadline=None,
            database=None,
            phases=(Phase.generate, Phase.shrink),
            suppress_health_check=list(HealthCheck),
            print_blob=False,
        )
        lines: list[str] = []
        try:
            with _captured(lines):
                run_state_machine_as_test(machine, settings=options)
        except Exception as exc:  # the target's fault, or the machine could not go on
            summary.failure = _failure_text(summary, exc, lines)
            break
    summary.seconds = time.monotonic() - started
    return summary


def _failure_text(summary: Summary, exc: Exception, lines: list[str]) -> str:
    steps_text = "\n".join(line for line in lines if line.strip())
    notes = "\n".join(getattr(exc, "__notes__", ()))
    what = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, FlakyFailure) and exc.exceptions:
        first = exc.exceptions[0]
        what = (
            f"{type(first).__name__}: {first}\n(the failure did not recur when replayed: the "
            "target's state changed meanwhile, or it fails only now and then)"
        )
    text = f"{what}\nminimal reproducing example:\n{steps_text or notes}"
    if summary.died_during is not None:
        steps_run = "\n".join(summary.died_during)
        text = (
            "the target stopped answering a legitimate peer (did it crash? see its log) "
            f"after these steps:\n{steps_run}\nhypothesis then reported: {text}"
        )
    return text.rstrip()


def check_deployment(
    host: str,
    port: int,
    *,
    secret: bytes | str | None = None,
    examples: int = 50,
    seconds: float = 30.0,
    **options: Any,
) -> Summary:
    """Fuzz the coordinator or worker listening at ``host:port`` with `HostileMachine` and
    raise `DeploymentFault` (an AssertionError: a pytest failure) if it did anything wrong;
    else return the `Summary`. Call it from your own suite, as trio's
    ``check_two_way_stream`` is called::

        def test_my_deployment_survives_hostile_peers(my_coordinator):
            check_deployment("127.0.0.1", my_coordinator.port, secret=SECRET, examples=30)

    ``options`` are `Deployment`'s fields (``deadline``, ``memory_bound``, ``world_size``,
    ``group``, ``pid``, ``peers``, ``allowed_hosts``) and ``steps`` per example."""
    steps = options.pop("steps", 20)
    key = secret.encode() if isinstance(secret, str) else secret
    deployment = Deployment(host, port, key, **options)
    summary = fuzz(deployment, examples=examples, seconds=seconds, steps=steps)
    if summary.failure is not None:
        raise DeploymentFault(summary.format())
    return summary
