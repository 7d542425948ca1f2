"""Hostile inputs against a live training run: every attack refused, logged, and training on.

A coordinator daemon (``python -m paramsync.runtime.cli.main coordinator``) and two workers of the
built-in LM job train as separate processes. While they train, this process attacks the
coordinator's port with strangers and impostors, one kind of attack at a time:

============== ==============================================================================
attack         what the attacker does
============== ==============================================================================
connect_close  connects and closes without a word
http_garbage   sends an HTTP request (its first 8 bytes announce a 405 MB head)
framed_garbage a well-formed frame prefix followed by random bytes
oversized      a frame prefix that announces 4 GiB
wrong_secret   a real dialer holding another secret (the dialer proves first: its auth is refused)
forged_auth    a stranger holding no secret that sends a random proof as its auth
offline_guess  one hello, then a hang-up: the reply is searched offline for anything to test
               a dictionary of secrets against (issue 18 row 2); the dictionary holds the
               run's secret, as it would a weak one, so any verifier in the reply recovers it
taken_rank     a dialer with the right secret claiming rank 0, which a worker holds
replay         the hello and auth recorded from a taken_rank session, replayed verbatim
slow_drip      a valid hello, one byte every 100 ms (cut at the handshake deadline)
flood          ``--flood`` connections opened at once and held open
============== ==============================================================================

Two more attacks need a rank that is free, so they run against a second coordinator daemon with
no workers (world size 2 + ``--duplicate-trials``), after the training run (issue 18, rows 3
and 9):

============== ==============================================================================
slow_holders   ``--holders`` connections from eight loopback addresses (127.0.0.2-9) that send
               the first bytes of a hello and hold, reopening whenever they are cut; once every
               slot has been held for a while, real dialers (the workers' `dial_with_retry`,
               from 127.0.0.1) join a rank, drop it and rejoin it: the time each took
spread_holders the same with every holder from an address of its own (127.0.1.1, 127.0.1.2,
               ...; issue 31 row 7): one slot each, so only their shares (not their counts)
               tell them from the workers; the joins must take under 5 s. (96 addresses of
               one IPv6 /64 count as one source: tests/test_admission_sources.py, as loopback
               IPv6 has one address)
duplicate_rank ``--duplicate-trials`` trials of two dialers holding the secret and claiming one
               free rank, their auths sent back to back: how many trials welcomed both
============== ==============================================================================

Online guessing (issue 39 row 2, `guessing`; ``--guessing-only`` runs it alone, in about 20 s):
a guesser thread from 127.0.0.2 tries a small dictionary (``--guessing-words`` wrong secrets,
over and over) as fast as it is let in, for ``--guessing-seconds``, against a coordinator daemon
and against a worker's listener (rank 0 of ``paramsync allreduce``, its rendezvous listener);
meanwhile a legitimate dialer holding the secret from 127.0.0.3 is admitted every 0.5 s and
hangs up. Reported: the proofs each target checked a second (the guess rate), the connections
it refused at once (throttled), and the legitimate dialer's admission times.

The run-id and artefact scan (issue 39 row 1, `artefact_scan`; ``--artefact-scan-only`` runs it
alone, in about 30 s): a two-node-shaped launch on this host's network address (node 0 with the
coordinator, node 1; one rank each, the LM demo job with checkpoints every 5 steps, traces,
summaries, logs at INFO, metrics endpoints scraped; ``PARAMSYNC_KEYLOG_FILE`` unset), then every
file it wrote searched for every value the project computes from the secret: the secret, the
scrypt-stretched key under each salt the run's listeners sent (each listener of its processes
probed with a hello while it runs) and under version 3's constant salt, SHA-256 of each, the
version-3 run id, raw, hex and base64, and a key log line
(`paramsync.runtime.testing.artefact_scan`). Reported: files, bytes, values and forms searched,
hits per value (must be 0), and the random run id both ranks recorded.

The key log read against a captured run (issue 39 row 10, `keylog_run`; ``--keylog-run`` runs it
alone, in about 40 s): ``paramsync launch --nproc 3`` of the LM demo job (a coordinator and
three workers, 20 steps, ``PARAMSYNC_KEYLOG_FILE`` set, ``PARAMSYNC_SHM=0`` so the data plane is
TCP) in a fresh network namespace, every packet of its loopback captured by a raw socket opened
in the namespace by a process of its own (`paramsync.runtime.testing.captured_run`); the TCP
streams rebuilt from the capture, and every frame tag of every connection checked with the key
log by section 8's reader, run out of docs/protocol.md (`paramsync.runtime.testing.keylog_check`).
Reported: connections (to the coordinator, between workers), frames, tags verified, key log
lines, the capture's packets and kernel drops (must be 0), and each failure (must be none: a
connection without a key log line, a tag that does not verify, a key log line no captured
connection used). Skipped, with the reason, without root or network namespaces.
``--keylog-dir DIR`` keeps the capture (``run.pcap``, which Wireshark opens), the key log and the
run's log.

Relay attacks (issue 18 row 1): an on-path relay on 127.0.0.1 that holds no secret
(`paramsync.runtime.testing.relay.FrameRelay`) passes the handshake through, then attacks the frames
after it. Every attack must be refused by frame authentication, naming the peer:

============== ==============================================================================
relay_abort    on a live run (a daemon and two workers, worker 0 dialing through the relay):
               an ``abort`` slipped in toward worker 0 after ``--relay-after`` genuine frames
               from the coordinator; the forged reason must reach no process
inject_abort   between two ranks: an ``abort`` after ``--relay-after`` genuine frames
flip_bulk      one byte flipped in a bulk part of the TCP ring's all-reduce (threads, and trio
               tasks): refused, and never reduced into the receiver's tensor
drop           a frame dropped from ten step signals
replay         a frame sent twice
reorder        two frames swapped
============== ==============================================================================

The second review (issue 31 rows 2-6, `second_review`; ``--no-second-review`` skips it,
``--second-review-only`` runs it alone, in about a minute): each row against a coordinator
daemon of its own, while a legitimate dialer from 127.0.0.250 times the daemon's answer to its
hello every 50 ms (the worst: how long the event loop was blocked) and the daemon's memory is
read from /proc (VmRSS before and after, the peak: VmHWM restarted before the attack):

============== ==============================================================================
row 2          authenticated as the free rank 1, one 60 MiB (``--second-review-mib``) frame:
               a bulk ``coll`` or an inline ``digest`` (200,000 names) with a random tag (what
               a relay without the secret can send), the digest or an inline ``coll`` with
               its valid tag (a peer holding the secret); the daemon must hang up
row 3          a hello holding a 4-byte typed array: refused, torch never imported
row 4          rank 0 of a two-member elastic run sends 30 early ``ready`` reports for step 1
               with 65,000-entry and with 20,000-entry specs: both far more than the run's
               one-tensor model needs, refused from the frame's prefix by its frame cap
               (`paramsync.runtime.coordinator.frame_caps`): dropped, the refusal naming rank 0
row 5          authenticated as rank 1, one heartbeat, quiet (``--heartbeat-deadline 1``):
               the real rank 1, dialing at once and again, is admitted at the deadline
row 6          an elastic run kept alive by rank 0; 20 times rank 1 joins and goes silent
               past the heartbeat deadline, keeping its end open: each told ``abort`` and
               closed, the daemon's descriptors (/proc/PID/fd) the same after as before
============== ==============================================================================

After each, a legitimate worker dials the attacked (or a free) rank: its admission latency.

Attempts connect from 127.0.0.11-18 in turn (`ATTACK_SOURCES`), so the cap per source address
does not refuse them before the global cap would. Each attempt's local address is what the
coordinator logs as the peer, so every attempt is
matched with the coordinator's log line naming it, or with the count a rate-limit summary line
gives for its category (the gate logs at most 20 refusal lines a second). Each attack is a phase
of its own, a log window after the previous one, opened by a marker connection (the right
secret, the group ``hostile-phase-<attack>``, refused at admission) that the log shows.

The table says, per attack: attempts, how many got no welcome (refused), how many the log names
one by one, how many it sums up, how many it misses, whether every logged category and reason is
the one expected; then whether training finished (every process exited 0), whether both workers
end with the same state digest, the coordinator's memory, and the daemon's admission totals
(which count the markers and the two workers too).

    python benchmarks/hostile.py --count 200 --json out/hostile.json

`tests/test_hostile_daemon.py` runs the same attacks, a few of each, and asserts on them.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import itertools
import json
import os
import random
import re
import secrets
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import cbor2
import torch
import trio
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from paramsync.runtime.collectives.ring import all_reduce  # noqa: E402
from paramsync.runtime.errors import (  # noqa: E402
    AuthenticationError,
    FrameAuthenticationError,
    HandshakeError,
    ListenerBusy,
    PeerClosed,
    ProtocolError,
    pick_error,
)
from paramsync.runtime.protocol.handshake import (  # noqa: E402
    DialerHandshake,
    Identity,
    new_secret,
)
from paramsync.runtime.protocol.wire import (  # noqa: E402
    HANDSHAKE_MAX_FRAME,
    PROTOCOL_VERSION,
    decode_frame,
    encode_frame_bytes,
    encode_tag_trailer,
)
from paramsync.runtime.testing import artefact_scan, captured_run  # noqa: E402
from paramsync.runtime.testing.keylog_check import check_pcap, document_reader  # noqa: E402
from paramsync.runtime.testing.process_watch import (  # noqa: E402
    PROBE_SOURCE,
    process_descriptors,
    process_memory,
    reset_memory_peak,
)
from paramsync.runtime.testing.relay import (  # noqa: E402
    TO_DIALER,
    TO_LISTENER,
    Attack,
    Drop,
    FlipBulk,
    FrameRelay,
    Inject,
    Replay,
    Swap,
    relayed_pair,
)
from paramsync.runtime.transport.tcp import (  # noqa: E402
    DEFAULT_GROUP,
    Connection,
    TcpTransport,
    dial,
    dial_with_retry,
)

__all__ = [
    "ATTACKS",
    "Attempt",
    "LiveRun",
    "Target",
    "parse_admission_log",
    "run_attacks",
    "slow_holders",
    "duplicate_rank",
    "offline_guess",
    "guess_tester",
    "guess_costs",
    "account",
    "mark_phase",
    "relay_attacks",
    "relay_live_run",
    "ReviewSizes",
    "second_review",
    "print_second_review",
    "guessing",
    "print_guessing",
    "main",
]

LOG_WINDOW = 1.0
"""The gate's log window (`paramsync.runtime.transport.admission`): phases are this far apart, so
each rate-limit summary line counts the refusals of one phase."""
WRONG_SECRET = b"not-the-run's-secret-at-all"
HTTP_REQUEST = b"GET / HTTP/1.1\r\nHost: paramsync\r\n\r\n"
JOB_ARGS = ("--d-model", "32", "--layers", "1", "--batch-size", "4", "--context", "32")
"""The LM job's flags for a small, fast model (about 100 steps/s on 2 cores)."""
CORPUS_BYTES = "200000"

MARKER_GROUP = "hostile-phase-"
_REFUSAL = re.compile(r"refused a connection from (\S+) \[(\w+)\]: (.*)$")
_MARKER = re.compile(rf"group '{MARKER_GROUP}(\w+)' does not match")
_SUMMARY = re.compile(r"refused (\d+) more connections, not logged one by one .*?: (.*)$")
_TOTALS = re.compile(r"admission totals: (.*)$")
_PAIR = re.compile(r"(\w+)=(\d+)")


# ----------------------------------------------------------------------------- the target


@dataclass(frozen=True)
class Target:
    """The coordinator under attack."""

    host: str
    port: int
    world_size: int
    handshake_seconds: float
    max_pending: int
    secret: bytes
    group: str = DEFAULT_GROUP

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port


@dataclass
class Attempt:
    """One hostile connection and what its attacker saw."""

    attack: str
    address: str
    """The attacker's local host:port: the peer the coordinator's log line names."""
    expect: tuple[str, ...]
    """The log categories this attempt may be refused with."""
    text: str
    """A part of the reason the coordinator should log ("" when it varies)."""
    outcome: str
    """What the attacker saw: ``refuse: <reason>``, ``closed``, an error, or ``welcome``."""

    @property
    def refused(self) -> bool:
        return not self.outcome.startswith("welcome")


ATTACK_SOURCES = tuple(f"127.0.0.{i}" for i in range(11, 19))
"""The attacks connect from these eight loopback addresses in turn, so the coordinator's cap
per source (8) does not refuse them before the global cap (64) would. Not 127.0.0.1, where the
workers dial from: the failed proofs of ``wrong_secret`` and ``forged_auth`` close their sources
for up to 5 minutes (issue 39 row 2), which must not be the workers'."""
_next_source = itertools.cycle(ATTACK_SOURCES)


async def _open(target: Target) -> tuple[trio.SocketStream, str]:
    source = next(_next_source) if target.host.startswith("127.") else None
    stream = await trio.open_tcp_stream(*target.address, local_address=source)
    host, port = stream.socket.getsockname()[:2]
    return stream, f"{host}:{port}"


async def _answer(conn: Connection, seconds: float) -> str:
    """The coordinator's next word on ``conn``: a message, a hang-up or silence."""
    try:
        with trio.fail_after(seconds):
            message = await conn.recv(HANDSHAKE_MAX_FRAME)
    except PeerClosed:
        return "closed"
    except trio.TooSlowError:
        return "no answer"
    except ProtocolError as exc:
        return f"unreadable answer: {exc}"
    return f"{message['kind']}: {message.get('reason', '')}".rstrip(": ")


async def _send_then_answer(
    target: Target, attack: str, data: bytes, expect: tuple[str, ...], text: str
) -> Attempt:
    stream, where = await _open(target)
    conn = Connection(stream)
    try:
        try:
            await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            return Attempt(attack, where, expect, text, f"closed while sending: {exc}")
        outcome = await _answer(conn, target.handshake_seconds + 2)
    finally:
        await conn.aclose()
    return Attempt(attack, where, expect, text, outcome)


def _me(target: Target, rank: int) -> Identity:
    return Identity(target.group, target.world_size, rank)


# ----------------------------------------------------------------------------- the attacks


async def connect_close(target: Target, index: int) -> list[Attempt]:
    """Connect and close at once."""
    stream, where = await _open(target)
    await stream.aclose()
    return [Attempt("connect_close", where, ("closed",), "closed by the peer", "closed by us")]


async def http_garbage(target: Target, index: int) -> list[Attempt]:
    """An HTTP request: its first 8 bytes read as a prefix announcing a 405 MB head."""
    text = "exceeds this receiver's limit of 4096"
    expect = ("frame_too_large",)
    return [await _send_then_answer(target, "http_garbage", HTTP_REQUEST, expect, text)]


async def framed_garbage(target: Target, index: int) -> list[Attempt]:
    """A valid 8-byte prefix announcing 64 bytes, then 64 random (seeded) bytes."""
    body = random.Random(index).randbytes(64)
    data = struct.pack(">II", len(body), 0) + body
    return [await _send_then_answer(target, "framed_garbage", data, ("malformed",), "")]


async def oversized(target: Target, index: int) -> list[Attempt]:
    """A prefix announcing a 4 GiB item: refused before a byte of it is read or allocated."""
    data = struct.pack(">II", 0xFFFFFFFF, 0)
    text = "frame of 4294967295 bytes exceeds this receiver's limit of 4096"
    return [await _send_then_answer(target, "oversized", data, ("frame_too_large",), text)]


WRONG_AUTH = "authentication failed: wrong shared secret"
THROTTLED = "failed authentications"
"""In the reason of a connection refused by its source's budget of failed proofs."""


async def wrong_secret(target: Target, index: int) -> list[Attempt]:
    """The real dialer's steps (as `paramsync.runtime.transport.tcp.dial` takes them) with another
    secret: the dialer proves first, so its auth is refused and it learns nothing."""
    stream, where = await _open(target)
    conn = Connection(stream)
    dialer = DialerHandshake(WRONG_SECRET, _me(target, index % target.world_size))
    attempt = Attempt("wrong_secret", where, ("authentication", "throttled"), WRONG_AUTH, "")
    try:
        await conn.send(*dialer.hello())
        await conn.send(*dialer.on_challenge(await conn.recv(HANDSHAKE_MAX_FRAME)))
        dialer.on_verdict(await conn.recv(HANDSHAKE_MAX_FRAME))
        attempt.outcome = "welcome: the coordinator admitted a dialer with another secret"
    except ProtocolError as exc:
        attempt.outcome = f"{type(exc).__name__}: {exc}"
    finally:
        await conn.aclose()
    return [attempt]


async def forged_auth(target: Target, index: int) -> list[Attempt]:
    """A stranger with no secret at all answers the challenge with 32 random bytes as its
    proof: the coordinator checks it and refuses."""
    stream, where = await _open(target)
    conn = Connection(stream)
    dialer = DialerHandshake(WRONG_SECRET, _me(target, index % target.world_size))
    attempt = Attempt("forged_auth", where, ("authentication", "throttled"), WRONG_AUTH, "")
    try:
        await conn.send(*dialer.hello())
        challenge = await conn.recv(HANDSHAKE_MAX_FRAME)
        if challenge["kind"] != "challenge":  # refused before the challenge (busy)
            attempt.outcome = f"{challenge['kind']}: {challenge.get('reason', '')}"
            return [attempt]
        forged = random.Random(index)
        share = X25519PrivateKey.from_private_bytes(forged.randbytes(32)).public_key()
        await conn.send("auth", {"share": share.public_bytes_raw(), "proof": forged.randbytes(32)})
        attempt.outcome = await _answer(conn, target.handshake_seconds + 2)
    except ProtocolError as exc:
        attempt.outcome = f"{type(exc).__name__}: {exc}"
    finally:
        await conn.aclose()
    return [attempt]


GUESS_WORDS = 200
"""Words in `offline_guess`'s dictionary before the planted secret (the last one tried)."""


def _transcript(
    label: bytes, version: int, first: bytes, second: bytes, *identities: Identity
) -> bytes:
    """A proof's transcript as docs/protocol.md section 5.1 defines it."""
    out = label + version.to_bytes(2, "big") + first + second
    for ident in identities:
        group = ident.group.encode()
        out += len(group).to_bytes(2, "big") + group
        out += ident.world_size.to_bytes(4, "big") + (ident.rank + 1).to_bytes(4, "big")
    return out


def _version_2_key(secret: bytes) -> bytes:
    """Version 2's handshake key: scrypt under its one constant salt."""
    return hashlib.scrypt(
        secret, salt=b"paramsync/secret/v2", n=2**14, r=8, p=1, maxmem=64 * 2**20, dklen=32
    )


def guess_tester(hello: dict[str, Any], reply: dict[str, Any]) -> Callable[[bytes], bool] | None:
    """What one reply to ``hello`` lets an offline guesser test candidate secrets against:
    a check of a candidate, or None when the reply holds nothing to test against.

    The one verifier a listener's first reply ever held is its proof (protocol version 1:
    HMAC-SHA256 keyed by the raw secret over a transcript the stranger knows, with the
    listener's identity beside it); keyed by the stretched secret too, in case a listener
    sends one under version 2."""
    proof = reply.get("proof")
    if not isinstance(proof, bytes) or not {"group", "world_size", "rank"} <= set(reply):
        return None
    dialer = Identity(hello["group"], hello["world_size"], hello["rank"])
    listener = Identity(reply["group"], reply["world_size"], reply["rank"])
    transcript = _transcript(
        b"paramsync/listener", reply["v"], hello["nonce"], reply["nonce"], dialer, listener
    )

    def check(candidate: bytes) -> bool:
        key = candidate if reply["v"] == 1 else _version_2_key(candidate)
        return hmac.compare_digest(hmac.new(key, transcript, hashlib.sha256).digest(), proof)

    return check


async def offline_guess(target: Target, index: int) -> list[Attempt]:
    """Issue 18 row 2: send one hello as a stranger, keep the reply, hang up; then search the
    reply offline with a dictionary of `GUESS_WORDS` words plus the run's secret (a weak secret
    is in the dictionary). Outcome: what the reply held, and whether the secret fell."""
    stream, where = await _open(target)
    conn = Connection(stream)
    attempt = Attempt("offline_guess", where, ("closed",), "closed by the peer", "")
    kind, hello = DialerHandshake(WRONG_SECRET, _me(target, index % target.world_size)).hello()
    try:
        await conn.send(kind, hello)
        reply = await conn.recv(HANDSHAKE_MAX_FRAME)
    except ProtocolError as exc:
        attempt.outcome = f"{type(exc).__name__}: {exc}"
        return [attempt]
    finally:
        await conn.aclose()
    held = sorted(set(reply) - {"v", "kind"})
    check = guess_tester(hello, reply)
    if check is None:
        attempt.outcome = f"{reply['kind']} {held}: nothing to test guesses against"
        return [attempt]
    words = [f"guess-{index}-{n:06d}".encode() for n in range(GUESS_WORDS)] + [target.secret]
    started = time.perf_counter()
    found = next((n for n, word in enumerate(words, 1) if check(word)), None)
    took = f"{(time.perf_counter() - started) * 1e3:.2f} ms"
    attempt.outcome = (
        f"recovered the secret after {found} guesses in {took} from a {reply['kind']} {held}"
        if found is not None
        else f"{reply['kind']} {held}: {len(words)} guesses in {took}, none right"
    )
    return [attempt]


def guess_costs(guesses: int = 20) -> dict[str, float]:
    """Seconds one offline guess costs an attacker holding a proof, per key: the raw secret
    (protocol version 1) and the scrypt-stretched one (version 2; each guess a fresh scrypt)."""
    transcript = bytes(128)
    started = time.perf_counter()
    for n in range(guesses * 1000):
        hmac.new(n.to_bytes(16, "big"), transcript, hashlib.sha256).digest()
    raw = (time.perf_counter() - started) / (guesses * 1000)
    started = time.perf_counter()
    for n in range(guesses):
        hashlib.scrypt(
            n.to_bytes(16, "big") + b"guess", salt=b"paramsync/secret/v2", n=2**14, r=8, p=1,
            maxmem=64 * 2**20, dklen=32,
        )  # fmt: skip
    stretched = (time.perf_counter() - started) / guesses
    return {"raw_hmac_seconds_per_guess": raw, "scrypt_seconds_per_guess": stretched}


async def replay(target: Target, index: int) -> list[Attempt]:
    """Record a real exchange (the right secret, claiming rank 0, which is taken: refused after
    authentication), then replay its hello and auth bytes on a new connection: the
    coordinator recognises the hello's nonce and refuses the replay by name (a listener that
    never saw it would still fail the recorded proof against its fresh nonce)."""
    attempts = []
    stream, where = await _open(target)
    conn = Connection(stream)
    dialer = DialerHandshake(target.secret, _me(target, 0))
    recorded_hello = encode_frame_bytes(*dialer.hello())
    taken = Attempt("taken_rank", where, ("refused",), "rank 0 is already taken", "")
    try:
        await stream.send_all(recorded_hello)
        challenge = await conn.recv(HANDSHAKE_MAX_FRAME)
        recorded_auth = encode_frame_bytes(*dialer.on_challenge(challenge))
        await stream.send_all(recorded_auth)
        taken.outcome = await _answer(conn, target.handshake_seconds + 2)
    except ProtocolError as exc:
        taken.outcome = f"{type(exc).__name__}: {exc}"
        return [taken]
    finally:
        await conn.aclose()
    attempts.append(taken)

    stream, where = await _open(target)
    conn = Connection(stream)
    replayed = Attempt("replay", where, ("authentication",), "replayed handshake", "")
    try:
        await stream.send_all(recorded_hello)
        replayed.outcome = await _answer(conn, target.handshake_seconds + 2)
        if replayed.outcome.startswith("challenge"):  # a listener that forgot the nonce
            await stream.send_all(recorded_auth)
            replayed.outcome = await _answer(conn, target.handshake_seconds + 2)
    except ProtocolError as exc:
        replayed.outcome = f"{type(exc).__name__}: {exc}"
    finally:
        await conn.aclose()
    attempts.append(replayed)
    return attempts


async def slow_drip(target: Target, index: int, interval: float = 0.1) -> list[Attempt]:
    """A valid hello, one byte every ``interval`` seconds, until the coordinator hangs up."""
    hello = encode_frame_bytes(*DialerHandshake(WRONG_SECRET, _me(target, 0)).hello())
    stream, where = await _open(target)
    text = ""  # cut at the deadline, or evicted for a newcomer once a cap is reached
    attempt = Attempt("slow_drip", where, ("deadline", "evicted"), text, "")
    sent = 0
    broken: list[BaseException] = []  # a hang-up by reset (RST) rather than FIN, either side
    hung_up = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
    try:
        async with trio.open_nursery() as nursery:

            async def drip() -> None:
                nonlocal sent
                try:
                    for byte in hello:
                        await stream.send_all(bytes([byte]))
                        sent += 1
                        await trio.sleep(interval)
                except hung_up as exc:  # the reader below sees the hang-up too
                    broken.append(exc)
                await trio.sleep_forever()

            nursery.start_soon(drip)
            with trio.move_on_after(target.handshake_seconds + 5):
                try:
                    while await stream.receive_some(4096):
                        pass
                except hung_up as exc:
                    broken.append(exc)
            nursery.cancel_scope.cancel()
    finally:
        await stream.aclose()
    attempt.outcome = f"closed after {sent} of {len(hello)} bytes" + (
        f" ({broken[0]})" if broken else ""
    )
    return [attempt]


async def flood(target: Target, count: int) -> list[Attempt]:
    """``count`` connections opened as fast as possible and held open until the coordinator
    closes them (over the cap: at once; within it: at the handshake deadline)."""
    attempts: list[Attempt] = []
    streams: list[trio.SocketStream] = []
    for _ in range(count):
        stream, where = await _open(target)
        streams.append(stream)
        attempts.append(Attempt("flood", where, ("over_cap", "deadline", "evicted"), "", ""))

    async def hold(stream: trio.SocketStream, attempt: Attempt) -> None:
        conn = Connection(stream)
        outcome = "no answer"
        with trio.move_on_after(target.handshake_seconds + 5):
            outcome = await _answer(conn, target.handshake_seconds + 5)
            if outcome.startswith("refuse"):  # the cap's refusal, then the hang-up
                await _answer(conn, 2)
        attempt.outcome = outcome
        await conn.aclose()

    async with trio.open_nursery() as nursery:
        for stream, attempt in zip(streams, attempts):
            nursery.start_soon(hold, stream, attempt)
    return attempts


HOLDER_SOURCES = tuple(f"127.0.0.{i}" for i in range(2, 10))
"""Where the slow holders connect from: eight addresses, none of them the workers' 127.0.0.1."""
SPREAD_JOIN_WITHIN = 5.0
"""What a worker gets to join while holders from as many addresses flood (issue 31 row 7)."""


def spread_sources(count: int) -> tuple[str, ...]:
    """``count`` loopback addresses, none of them the workers' 127.0.0.1: 127.0.1.1, ...,
    127.0.1.250, 127.0.2.1, ... (every 127/8 address routes to loopback on Linux)."""
    return tuple(f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(count))


async def _hold(
    target: Target, source: str, stop: trio.Event, counts: Counter[str], pause: float = 0.05
) -> None:
    """One slow holder that comes back: connect from ``source``, send the first 5 bytes of a
    hello, hold until the listener hangs up (a busy refusal, an eviction or the deadline),
    and connect again ``pause`` seconds later, until ``stop``."""
    hello = encode_frame_bytes(*DialerHandshake(WRONG_SECRET, _me(target, 0)).hello())
    while not stop.is_set():
        try:
            stream = await trio.open_tcp_stream(*target.address, local_address=source)
        except OSError:
            counts["connect_failed"] += 1
            await trio.sleep(pause)
            continue
        counts["connections"] += 1
        try:
            await stream.send_all(hello[:5])
            answer = b""
            with trio.move_on_after(target.handshake_seconds + 5):
                while chunk := await stream.receive_some(4096):
                    answer += chunk
            counts["refused busy" if b"busy" in answer else "cut"] += 1
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            counts["reset"] += 1
        finally:
            await stream.aclose()
        await trio.sleep(pause)


async def _join_rank(target: Target, rank: int) -> tuple[Connection, float]:
    """Dial as ``rank`` the way a worker does (`dial_with_retry`: retrying while the listener
    is busy), also while the rank's previous link is still being closed; (link, seconds)."""
    started = time.monotonic()
    while True:
        try:
            conn, _ = await dial_with_retry(target.address, target.secret, _me(target, rank))
        except HandshakeError as exc:
            if "already taken" not in str(exc):
                raise
            await trio.sleep(0.02)
            continue
        return conn, time.monotonic() - started


async def slow_holders(
    target: Target,
    holders: int,
    *,
    hold_first: float = 2.0,
    ranks: tuple[int, ...] = (0, 1),
    join_within: float | None = None,
    sources: tuple[str, ...] = HOLDER_SOURCES,
) -> dict[str, Any]:
    """``holders`` slow holders from ``sources`` (reconnecting when cut) fill the target's
    slots for ``hold_first`` seconds; then each rank of ``ranks`` joins, and the first drops
    its link and rejoins. Returns the seconds each took (``joins``; None: not within
    ``join_within``, default a quarter of the handshake deadline) and the holders' counts."""
    join_within = target.handshake_seconds / 4 if join_within is None else join_within
    counts: Counter[str] = Counter()
    stop = trio.Event()
    joins: dict[str, float | None] = {}
    links: list[Connection] = []
    async with trio.open_nursery() as nursery:
        for index in range(holders):
            nursery.start_soon(_hold, target, sources[index % len(sources)], stop, counts)
        await trio.sleep(hold_first)
        steps = [(f"join {rank}", rank) for rank in ranks] + [(f"rejoin {ranks[0]}", ranks[0])]
        for name, rank in steps:
            joins[name] = None
            if name.startswith("rejoin"):
                if joins[f"join {rank}"] is None:
                    continue  # never joined: nothing to rejoin
                await links.pop(0).aclose()  # the first rank's link drops
            with trio.move_on_after(join_within):
                conn, joins[name] = await _join_rank(target, rank)
                links.append(conn)
        stop.set()
        nursery.cancel_scope.cancel()
    for conn in links:
        await conn.aclose()
    return {
        "holders": holders,
        "sources": len(sources),
        "hold_first_seconds": hold_first,
        "join_within_seconds": join_within,
        "joins_seconds": joins,
        "all_joined_in_time": all(v is not None for v in joins.values()),
        "holder_counts": dict(counts),
    }


async def _dialer_at_auth(target: Target, rank: int) -> tuple[Connection, bytes]:
    """A dialer with the secret, stopped before its auth: the connection and the auth frame."""
    stream = await trio.open_tcp_stream(*target.address)
    conn = Connection(stream)
    dialer = DialerHandshake(target.secret, _me(target, rank))
    await conn.send(*dialer.hello())
    return conn, encode_frame_bytes(*dialer.on_challenge(await conn.recv(HANDSHAKE_MAX_FRAME)))


async def duplicate_rank(target: Target, trials: int, first_rank: int = 2) -> dict[str, Any]:
    """``trials`` pairs of dialers claiming the same free rank (trial ``i`` claims rank
    ``first_rank + i``: the target needs ``world_size >= first_rank + trials``; ranks 0 and 1
    are left to `slow_holders`), both auths sent back to back; how many trials welcomed
    both, one, or none."""
    outcomes: Counter[str] = Counter()
    refusals: Counter[str] = Counter()
    for trial in range(trials):
        pair = [await _dialer_at_auth(target, first_rank + trial) for _ in range(2)]
        for conn, auth in pair:
            await conn.stream.send_all(auth)
        verdicts: list[str] = []

        async def hear(conn: Connection, into: list[str]) -> None:
            into.append(await _answer(conn, target.handshake_seconds + 2))

        async with trio.open_nursery() as nursery:
            for conn, _ in pair:
                nursery.start_soon(hear, conn, verdicts)
        for conn, _ in pair:
            await conn.aclose()
        outcomes[f"{sum(v.startswith('welcome') for v in verdicts)} welcomed"] += 1
        refusals.update(v for v in verdicts if not v.startswith("welcome"))
    return {
        "trials": trials,
        "outcomes": dict(outcomes),
        "both_welcomed": outcomes["2 welcomed"],
        "refusals": dict(refusals.most_common(3)),
    }


def join_bomb(size: int) -> bytes:
    """Issue 18 row 4: a framed `join` whose ``params`` is an array of ``size`` empty arrays
    (one byte each on the wire, about 72 bytes each once decoded). Sent after a valid
    handshake (it needs a free rank), or handed to `decode_frame` directly."""
    head = b"\xa3\x61v\x02\x64kind\x64join\x66params\x9a" + size.to_bytes(4, "big")
    return struct.pack(">II", len(head) + size, 0) + head + b"\x80" * size


def ip_tag_manifest(tag: int) -> bytes:
    """Issue 18 row 10: a framed `state_manifest` carrying CBOR tag 52 or 54 (an IP address)."""
    value = b"\x0a\x00\x00\x01" if tag == 52 else bytes(16)
    body = cbor2.dumps(
        {
            "v": PROTOCOL_VERSION,
            "kind": "state_manifest",
            "manifest": {"host": cbor2.CBORTag(tag, value)},
        }
    )
    return struct.pack(">II", len(body), 0) + body


def wire_bombs() -> dict[str, dict[str, Any]]:
    """Rows 4 and 10 against the frame decoder in this process: each crafted frame's refusal,
    how long it took and the peak memory it allocated (tracemalloc, a second run)."""
    import tracemalloc

    frames = {
        "join_bomb_16MiB": join_bomb(16 * 2**20),
        "manifest_tag_52": ip_tag_manifest(52),
        "manifest_tag_54": ip_tag_manifest(54),
    }
    results: dict[str, dict[str, Any]] = {}
    for name, frame in frames.items():
        started = time.perf_counter()
        try:
            decode_frame(frame)
            reason = "ACCEPTED"
        except ProtocolError as exc:
            reason = str(exc)
        seconds = time.perf_counter() - started
        tracemalloc.start()
        try:
            try:
                decode_frame(frame)
            except ProtocolError:
                pass
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        results[name] = {"refusal": reason, "seconds": seconds, "peak_bytes": peak}
    return results


# ----------------------------------------------------------------------------- relay attacks

RELAY_SECRET = b"hostile-relay-secret-0123456789"
FORGED_REASON = "forged by an on-path relay holding no secret"
RELAY_SECONDS = 60.0


def _relay_row(attack: Attack, error: BaseException | None, **seen: Any) -> dict[str, Any]:
    """One relay attack's row: whether the relay carried it out, whether frame
    authentication refused it (the error, which names the peer), and what got through."""
    return {
        "carried_out": attack.done,
        "relay": attack.log,
        "refused": isinstance(error, FrameAuthenticationError),
        "error": None if error is None else f"{type(error).__name__}: {error}",
        **seen,
    }


async def _inject_between_ranks(after: int) -> dict[str, Any]:
    attack = Inject(TO_DIALER, after, FORGED_REASON)
    got: list[dict[str, Any]] = []
    error: BaseException | None = None
    with trio.fail_after(RELAY_SECONDS):
        async with relayed_pair(RELAY_SECRET, attack) as (rank0, rank1):
            for step in range(after + 1):
                await rank0.send(1, "commit", {"epoch": 1, "step": step})
            try:
                for _ in range(after + 2):  # the genuine frames, and the forged one among them
                    got.append(await rank1.recv(0))
            except ProtocolError as exc:
                error = exc
    forged = [message for message in got if message["kind"] == "abort"]
    return _relay_row(
        attack, error, genuine_received=len(got) - len(forged), forged_received=forged
    )


async def _flip_bulk(threaded: bool) -> dict[str, Any]:
    attack = FlipBulk(TO_LISTENER, nth=0, offset=1000)
    tensors = [torch.full((1 << 20,), 1.0), torch.full((1 << 20,), 2.0)]
    options = {"chunk_bytes": 1 << 20, "threaded_min_bytes": 0 if threaded else 1 << 40}
    errors: list[BaseException | None] = [None, None]
    with trio.fail_after(RELAY_SECONDS):
        async with relayed_pair(RELAY_SECRET, attack) as ranks:

            async def reduce(rank: int, transport: TcpTransport) -> None:
                try:
                    await all_reduce(transport, tensors[rank], **options)
                except Exception as exc:
                    errors[rank] = pick_error(exc)
                    transport.abort()

            async with trio.open_nursery() as nursery:
                for rank, transport in enumerate(ranks):
                    nursery.start_soon(reduce, rank, transport)
    altered = sorted(set(torch.unique(tensors[0]).tolist()) - {1.0, 3.0})
    return _relay_row(attack, errors[0], reduced_altered_values=altered[:4])


async def _reorder(attack: Attack, genuine: int) -> dict[str, Any]:
    got: list[dict[str, Any]] = []
    error: BaseException | None = None
    with trio.fail_after(RELAY_SECONDS):
        async with relayed_pair(RELAY_SECRET, attack) as (rank0, rank1):
            for step in range(10):
                await rank0.send(1, "commit", {"epoch": 1, "step": step})
            try:
                for _ in range(10):
                    got.append(await rank1.recv(0))
            except ProtocolError as exc:
                error = exc
    steps = [message["step"] for message in got]
    return _relay_row(
        attack, error, steps_received=steps, out_of_place=steps != list(range(genuine))
    )


async def relay_attacks(after: int = 200) -> dict[str, dict[str, Any]]:
    """The relay attacks between two ranks of this process (see the module docstring)."""
    return {
        "inject_abort": await _inject_between_ranks(after),
        "flip_bulk_threads": await _flip_bulk(True),
        "flip_bulk_trio": await _flip_bulk(False),
        "drop": await _reorder(Drop(TO_DIALER, 4), 4),
        "replay": await _reorder(Replay(TO_DIALER, 4), 5),
        "reorder": await _reorder(Swap(TO_DIALER, 4), 4),
    }


async def relay_live_run(workdir: Path, after: int = 200, steps: int = 600) -> dict[str, Any]:
    """A live run whose worker 0 dials the coordinator through a relay that slips an
    ``abort`` in after ``after`` genuine frames toward the worker. Returns how the run ended,
    whether the forged reason reached any process, and worker 0's error."""
    run = LiveRun(workdir, steps=steps)
    attack = Inject(TO_DIALER, after, FORGED_REASON)
    try:
        run.start_coordinator()
        relay = FrameRelay(("127.0.0.1", run.port), attack)
        async with trio.open_nursery() as nursery:
            relay_address = await nursery.start(relay.serve)
            run.start_worker(0, coordinator=relay_address)
            run.start_worker(1)
            outcome = await trio.to_thread.run_sync(run.finish)
            nursery.cancel_scope.cancel()
    finally:
        run.kill()
    texts = {f"rank {rank}": run.worker_output(rank) for rank in range(run.world_size)}
    texts["coordinator"] = outcome.coordinator_log
    named = [line for line in texts["rank 0"].splitlines() if "frame authentication" in line]
    return {
        "after_genuine_frames": after,
        "carried_out": attack.done,
        "relay": attack.log,
        "exit_codes": outcome.exit_codes,
        "finished_ok": outcome.finished_ok,
        "forged_reason_reached": sorted(
            name for name, text in texts.items() if FORGED_REASON in text
        ),
        "refused": bool(named),
        "worker0_error": named[-1].strip()[:400] if named else None,
    }


def _print_relay(relay: dict[str, dict[str, Any]], live: dict[str, Any] | None) -> None:
    for name, row in relay.items():
        seen = {
            k: v for k, v in row.items() if k not in ("carried_out", "relay", "refused", "error")
        }
        verdict = "refused" if row["refused"] else "NOT REFUSED"
        print(f"relay {name:<18} {verdict}: {row['error']} {seen}")
    if live is not None:
        print(
            f"relay_abort on a live run (after {live['after_genuine_frames']} frames): carried out "
            f"{live['carried_out']}, refused {live['refused']}, forged reason reached "
            f"{live['forged_reason_reached'] or 'no process'}, exit codes {live['exit_codes']}; "
            f"worker 0: {live['worker0_error']}"
        )


def relay_ok(relay: dict[str, dict[str, Any]], live: dict[str, Any] | None) -> bool:
    """Whether every relay attack was carried out and refused, with nothing forged acted on."""
    rows_ok = all(
        row["carried_out"]
        and row["refused"]
        and not row.get("forged_received")
        and not row.get("reduced_altered_values")
        for row in relay.values()
    )
    live_ok = live is None or (
        live["carried_out"] and live["refused"] and not live["forged_reason_reached"]
    )
    return rows_ok and live_ok


AttackFn = Callable[[Target, int], Awaitable[list[Attempt]]]

ATTACKS: dict[str, AttackFn] = {
    "connect_close": connect_close,
    "http_garbage": http_garbage,
    "framed_garbage": framed_garbage,
    "oversized": oversized,
    "wrong_secret": wrong_secret,
    "forged_auth": forged_auth,
    "offline_guess": offline_guess,
    "replay": replay,
    "slow_drip": slow_drip,
}
"""Single-connection attacks by name (`flood` takes a count instead)."""


async def run_attacks(
    target: Target, name: str, count: int, concurrency: int
) -> tuple[list[Attempt], float]:
    """``count`` attempts of one attack, at most ``concurrency`` at once; (attempts, seconds)."""
    attempts: list[Attempt] = []
    started = time.monotonic()
    if name == "flood":
        return await flood(target, count), time.monotonic() - started
    limiter = trio.CapacityLimiter(concurrency)
    attack = ATTACKS[name]

    async def one(index: int) -> None:
        async with limiter:
            attempts.extend(await attack(target, index))

    async with trio.open_nursery() as nursery:
        for index in range(count):
            nursery.start_soon(one, index)
    return attempts, time.monotonic() - started


# ----------------------------------------------------------------------------- the log


@dataclass
class AdmissionLog:
    """What the coordinator logged about refused connections, in order."""

    lines: dict[str, list[tuple[str, str]]] = field(default_factory=lambda: defaultdict(list))
    """Remote address -> [(category, reason)] of the lines naming it."""
    order: list[tuple[Any, ...]] = field(default_factory=list)
    """``("line", address, category, reason)``, ``("summary", Counter of categories)`` and
    ``("marker", phase)`` (see `mark_phase`) in log order."""
    totals: dict[str, int] = field(default_factory=dict)


def parse_admission_log(text: str) -> AdmissionLog:
    """Parse the gate's lines (`paramsync.runtime.transport.admission`) out of a daemon's log."""
    log = AdmissionLog()
    for line in text.splitlines():
        if match := _REFUSAL.search(line):
            address, category, reason = match.groups()
            if marker := _MARKER.search(reason):
                log.order.append(("marker", marker.group(1)))
                continue
            log.lines[address].append((category, reason))
            log.order.append(("line", address, category, reason))
        elif match := _SUMMARY.search(line):
            counts = Counter({k: int(v) for k, v in _PAIR.findall(match.group(2))})
            log.order.append(("summary", counts))
        elif match := _TOTALS.search(line):
            log.totals = {k: int(v) for k, v in _PAIR.findall(match.group(1))}
    return log


def phase_of(attack: str) -> str:
    """The phase an attack's attempts run in (a replay records a taken_rank session first)."""
    return {"taken_rank": "replay"}.get(attack, attack)


def account(attempts: list[Attempt], log: AdmissionLog) -> dict[str, dict[str, Any]]:
    """Per attack: tried, refused, logged one by one, summed up, unaccounted, and the logged
    lines whose category or reason was not the one expected.

    Phases start with a marker line (`mark_phase`) and are a log window apart, so a rate-limit
    summary line counts refusals of the phase it appears in; its counts go to that phase's
    attacks by their expected categories. Lines are matched to attempts by address within a
    phase (loopback ports get reused across phases). Without markers, the log is one phase.
    """
    marked = any(entry[0] == "marker" for entry in log.order)
    rows: dict[str, dict[str, Any]] = {}
    owners: dict[tuple[str, str], list[Attempt]] = defaultdict(list)
    for attempt in attempts:
        row = rows.setdefault(
            attempt.attack,
            {"tried": 0, "refused": 0, "logged": 0, "summed_up": 0, "unexpected": []},
        )
        row["tried"] += 1
        row["refused"] += attempt.refused
        phase = phase_of(attempt.attack) if marked else "all"
        owners[(phase, attempt.address)].append(attempt)
    matched: Counter[tuple[str, str]] = Counter()
    current: str | None = None if marked else "all"
    for entry in log.order:
        if entry[0] == "marker":
            current = entry[1]
        elif current is None:
            continue
        elif entry[0] == "line":
            _, address, category, reason = entry
            key = (current, address)
            if matched[key] >= len(owners.get(key, ())):
                continue  # not one of this phase's attempts (a worker, a marker, ...)
            attempt = owners[key][matched[key]]
            matched[key] += 1
            row = rows[attempt.attack]
            row["logged"] += 1
            text = THROTTLED if category == "throttled" else attempt.text
            if category not in attempt.expect or text not in reason:
                row["unexpected"].append(f"{address} [{category}]: {reason}")
        else:
            _share_summary(rows, attempts, current, entry[1])
    for row in rows.values():
        row["unaccounted"] = row["tried"] - row["logged"] - row["summed_up"]
    return rows


def _share_summary(
    rows: dict[str, dict[str, Any]], attempts: list[Attempt], phase: str, counts: Counter[str]
) -> None:
    """Give a summary's counts to the attacks of ``phase`` ("all": any), by expected category."""
    counts = Counter(counts)
    for name, row in rows.items():
        if phase not in ("all", phase_of(name)):
            continue
        expected = next(a.expect for a in attempts if a.attack == name)
        for category in expected:
            take = counts.get(category, 0)
            row["summed_up"] += take
            counts[category] -= take


async def mark_phase(target: Target, phase: str) -> None:
    """Start ``phase`` in the coordinator's log: a connection with the right secret but the
    group ``hostile-phase-<phase>``, refused at admission with a line naming that group."""
    me = Identity(f"{MARKER_GROUP}{phase}", target.world_size, 0)
    try:
        conn, _ = await dial(target.address, target.secret, me)
    except HandshakeError:
        return
    await conn.aclose()  # pragma: no cover - a coordinator that admits any group


# ----------------------------------------------------------------------------- the live run


@dataclass
class RunOutcome:
    """How the training run ended."""

    exit_codes: dict[str, int | None]
    summaries: dict[int, dict[str, Any]]
    coordinator_log: str

    @property
    def finished_ok(self) -> bool:
        return all(code == 0 for code in self.exit_codes.values())

    @property
    def digests(self) -> dict[int, str | None]:
        return {rank: s.get("digest") for rank, s in self.summaries.items()}

    @property
    def digests_identical(self) -> bool:
        values = list(self.digests.values())
        return bool(values) and values[0] is not None and len(set(values)) == 1


class LiveRun:
    """A coordinator daemon and ``world_size`` workers of the LM job, as subprocesses."""

    def __init__(
        self,
        workdir: Path,
        *,
        world_size: int = 2,
        steps: int = 1500,
        handshake_seconds: float = 2.0,
        max_pending: int = 64,
        job_args: tuple[str, ...] = JOB_ARGS,
        coordinator_args: tuple[str, ...] = (),
    ) -> None:
        self.workdir = workdir
        self.coordinator_args = coordinator_args
        """More flags for the coordinator daemon (`second_review`: deadlines, --min-workers)."""
        self.world_size = world_size
        self.steps = steps
        self.handshake_seconds = handshake_seconds
        self.max_pending = max_pending
        self.job_args = job_args
        self.secret = secrets.token_hex(16)
        self.env = dict(os.environ, PARAMSYNC_SECRET=self.secret, OMP_NUM_THREADS="1")
        self.env.pop("PARAMSYNC_SECRET_FILE", None)
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.port = 0

    @property
    def coordinator_log_path(self) -> Path:
        return self.workdir / "coordinator.log"

    def target(self) -> Target:
        return Target(
            "127.0.0.1",
            self.port,
            self.world_size,
            self.handshake_seconds,
            self.max_pending,
            self.secret.encode(),
        )

    def start_coordinator(self, timeout: float = 30.0) -> None:
        """Start the daemon and wait until it listens."""
        port_file = self.workdir / "port"
        command = [
            sys.executable, "-m", "paramsync.runtime.cli.main", "coordinator",
            "--world-size", str(self.world_size), "--bind", "127.0.0.1:0",
            "--port-file", str(port_file),
            "--handshake-seconds", str(self.handshake_seconds),
            "--max-pending-handshakes", str(self.max_pending), *self.coordinator_args,
        ]  # fmt: skip
        with open(self.coordinator_log_path, "wb") as log:
            self.coordinator = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while not port_file.exists() or not port_file.read_text().strip():
            if self.coordinator.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not start:\n{self.coordinator_log()}")
            time.sleep(0.05)
        self.port = int(port_file.read_text())

    def start_worker(
        self, rank: int, steps: int | None = None, coordinator: tuple[str, int] | None = None
    ) -> None:
        """Start one worker of the LM job (its stdout: the progress lines of rank 0); it dials
        ``coordinator`` (default: the daemon itself; a relay in `relay_live_run`)."""
        host, port = coordinator or ("127.0.0.1", self.port)
        command = [
            sys.executable, "-m", "paramsync.runtime.cli.main", "worker",
            "--rank", str(rank), "--world-size", str(self.world_size),
            "--coordinator", f"{host}:{port}",
            "--steps", str(steps or self.steps), *self.job_args, "--corpus-bytes", CORPUS_BYTES,
            "--summary-json", str(self.workdir / "summary{rank}.json"),
        ]  # fmt: skip
        with open(self.workdir / f"worker{rank}.out", "wb") as out:
            self.workers[rank] = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )

    def start(self) -> None:
        self.start_coordinator()
        for rank in range(self.world_size):
            self.start_worker(rank)

    def coordinator_log(self) -> str:
        return self.coordinator_log_path.read_text(errors="replace")

    def worker_output(self, rank: int) -> str:
        path = self.workdir / f"worker{rank}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_training(self, timeout: float = 60.0) -> None:
        """Wait until rank 0 reports training progress (10% of the steps done)."""
        deadline = time.monotonic() + timeout
        while "training (" not in self.worker_output(0):
            if time.monotonic() > deadline or any(
                proc.poll() is not None for proc in [self.coordinator, *self.workers.values()]
            ):
                raise RuntimeError(
                    f"training did not start:\n{self.coordinator_log()}\n{self.worker_output(0)}"
                )
            time.sleep(0.05)

    def alive(self) -> bool:
        procs = [self.coordinator, *self.workers.values()]
        return all(proc is not None and proc.poll() is None for proc in procs)

    def coordinator_memory(self, field: str = "VmHWM") -> int | None:
        """The coordinator's resident memory in bytes (Linux, while it runs): ``VmHWM`` the
        high-water mark, ``VmRSS`` now."""
        if self.coordinator is None:
            return None
        return process_memory(self.coordinator.pid, field)

    def reset_memory_peak(self) -> None:
        """Restart the coordinator's ``VmHWM`` from its current RSS (Linux ``clear_refs``)."""
        if self.coordinator is not None:
            reset_memory_peak(self.coordinator.pid)

    def coordinator_descriptors(self) -> int | None:
        """How many file descriptors the coordinator holds open (Linux, while it runs)."""
        if self.coordinator is None:
            return None
        return process_descriptors(self.coordinator.pid)

    def finish(self, timeout: float = 300.0) -> RunOutcome:
        """Wait for every process to exit (killing what is left after ``timeout``)."""
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        named = [("coordinator", self.coordinator)] + [
            (f"rank {rank}", proc) for rank, proc in sorted(self.workers.items())
        ]
        for name, proc in named:
            assert proc is not None
            try:
                codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        self.kill()
        summaries = {}
        for rank in self.workers:
            path = self.workdir / f"summary{rank}.json"
            if path.exists():
                summaries[rank] = json.loads(path.read_text())
        return RunOutcome(codes, summaries, self.coordinator_log())

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the coordinator as an operator would (SIGINT) and wait for it to exit."""
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.send_signal(signal.SIGINT)
            try:
                self.coordinator.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass

    def kill(self) -> None:
        """Kill the processes this run started that still run."""
        for proc in [self.coordinator, *self.workers.values()]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


# ----------------------------------------------------------------------------- guessing

GUESSER_SOURCE = "127.0.0.2"
LEGIT_SOURCE = "127.0.0.3"


async def _dial_from(
    address: tuple[str, int], secret: bytes, me: Identity, source: str
) -> tuple[str, float]:
    """One handshake from ``source`` (`paramsync.runtime.transport.tcp.dial`'s steps): its
    outcome (``welcome``, ``failed proof``, ``throttled``, ``busy`` or the error) and seconds."""
    start = time.perf_counter()
    stream = await trio.open_tcp_stream(*address, local_address=source)
    conn = Connection(stream)
    dialer = DialerHandshake(secret, me)
    try:
        await conn.send(*dialer.hello())
        await conn.send(*dialer.on_challenge(await conn.recv(HANDSHAKE_MAX_FRAME)))
        dialer.on_verdict(await conn.recv(HANDSHAKE_MAX_FRAME))
        outcome = "welcome"
    except ListenerBusy as exc:
        outcome = "throttled" if THROTTLED in str(exc) else "busy"
    except AuthenticationError:
        outcome = "failed proof"
    except (ProtocolError, OSError) as exc:
        outcome = type(exc).__name__
    finally:
        await conn.aclose()
    return outcome, time.perf_counter() - start


def _guess_for(
    address: tuple[str, int], me: Identity, words: int, stop: threading.Event
) -> Counter[str]:
    """The guesser (a thread's trio run): the dictionary's wrong secrets, one handshake each,
    round and round until ``stop``; the outcomes counted."""
    dictionary = [f"Summer20{i % 100:02d}!team{i}".encode() for i in range(words)]
    seen: Counter[str] = Counter()

    async def guess() -> None:
        for word in itertools.cycle(dictionary):
            if stop.is_set():
                return
            outcome, _ = await _dial_from(address, word, me, GUESSER_SOURCE)
            seen[outcome] += 1
            if outcome != "failed proof":
                await trio.sleep(0.001)  # refused before the key exchange: the next at once

    trio.run(guess)
    return seen


async def _guessed_at(
    address: tuple[str, int], secret: bytes, guesser_me: Identity, legit_me: Identity,
    seconds: float, words: int,
) -> dict[str, Any]:  # fmt: skip
    """A guesser thread against ``address`` for ``seconds``; a legitimate dialer meanwhile."""
    stop = threading.Event()
    seen: Counter[str] = Counter()

    def run_guesser() -> None:
        seen.update(_guess_for(address, guesser_me, words, stop))

    admissions: list[float] = []
    refused: Counter[str] = Counter()
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, run_guesser)
        await trio.sleep(0.5)
        while time.perf_counter() - started < seconds:
            began = time.perf_counter()
            while True:  # as `dial_with_retry`: retry while busy
                outcome, _ = await _dial_from(address, secret, legit_me, LEGIT_SOURCE)
                if outcome != "busy":
                    break
                await trio.sleep(0.01)
            if outcome == "welcome":
                admissions.append(time.perf_counter() - began)
            else:
                refused[outcome] += 1
            await trio.sleep(0.5)
        stop.set()
    elapsed = time.perf_counter() - started
    admissions.sort()
    return {
        "seconds": round(elapsed, 2),
        "guesses_checked": seen["failed proof"],
        "guesses_per_second": round(seen["failed proof"] / elapsed, 2),
        "throttled": seen["throttled"],
        "guesser_outcomes": dict(seen),
        "legit_admitted": len(admissions),
        "legit_refused": dict(refused),
        "legit_median_ms": round(admissions[len(admissions) // 2] * 1e3, 1) if admissions else None,
        "legit_max_ms": round(admissions[-1] * 1e3, 1) if admissions else None,
    }


def guessing(workdir: Path, seconds: float = 8.0, words: int = 50) -> dict[str, dict[str, Any]]:
    """Issue 39 row 2: a guesser against a coordinator daemon and against a worker's listener
    (rank 0 of ``paramsync allreduce``), a legitimate dialer meanwhile (module doc)."""
    results: dict[str, dict[str, Any]] = {}
    run = LiveRun(workdir / "coordinator", world_size=2)
    run.workdir.mkdir(parents=True)
    try:
        run.start_coordinator()
        target = run.target()
        results["coordinator"] = trio.run(
            _guessed_at, target.address, target.secret, _me(target, 1), _me(target, 0),
            seconds, words,
        )  # fmt: skip
    finally:
        run.kill()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    worker = subprocess.Popen(
        [
            sys.executable, "-m", "paramsync.runtime.cli.main", "allreduce", "--rank", "0",
            "--world-size", "2", "--coordinator", f"127.0.0.1:{port}",
        ],
        cwd=ROOT, env=run.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not _listening(port):
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the worker's listener did not start")
            time.sleep(0.05)
        me = Identity(DEFAULT_GROUP, 2, 1)
        results["worker listener"] = trio.run(
            _guessed_at, ("127.0.0.1", port), run.secret.encode(), me, me, seconds, words
        )
    finally:
        worker.kill()
        worker.wait()
    for row in results.values():
        row["ok"] = (
            row["legit_admitted"] > 0
            and not row["legit_refused"]
            and (row["legit_max_ms"] or 0) < 1000
            and row["guesses_checked"] <= 16
        )
    return results


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def print_guessing(results: dict[str, dict[str, Any]]) -> None:
    print("online guessing (issue 39 row 2): a guesser from 127.0.0.2, a worker from 127.0.0.3")
    for name, row in results.items():
        print(
            f"  {name}: {row['guesses_checked']} proofs checked in {row['seconds']} s "
            f"({row['guesses_per_second']}/s), {row['throttled']} refused at once; the worker "
            f"admitted {row['legit_admitted']} times, median {row['legit_median_ms']} ms, "
            f"max {row['legit_max_ms']} ms, refused {row['legit_refused'] or 'never'}; "
            f"{'ok' if row['ok'] else 'FAILED'}"
        )


# ----------------------------------------------------------------------------- artefact scan


def artefact_scan_run(workdir: Path, steps: int = 20) -> dict[str, Any]:
    """Issue 39 row 1: a two-node-shaped launch, then every file it wrote searched for every
    function of its secret (module doc); ``ok`` when the run finished and nothing was found."""
    host = artefact_scan.this_hosts_address()
    if host is None:
        return {"skipped": "this host has no address but loopback", "ok": True}
    secret = new_secret().encode()
    run = artefact_scan.run_two_nodes(workdir, secret, host, steps=steps)
    files = run.files()
    values = artefact_scan.secret_functions(secret, run.coordinator, run.salts)
    report = artefact_scan.scan(files, values, workdir)
    run_id = run.checkpoint_dir / "run-id"
    recorded = run_id.read_text().strip() if run_id.exists() else None
    told = sorted(
        set(re.findall(r"checkpoints of run '([^']+)' \(the coordinator's\)", run.log_text))
    )
    return {
        "coordinator": run.coordinator,
        "exit_codes": run.exit_codes,
        "seconds": round(run.seconds, 1),
        "listeners_probed": run.ports_probed,
        "salts": sorted(salt.hex() for salt in run.salts),
        "files": report.files,
        "bytes": report.bytes,
        "kinds_of_file": sorted({p.suffix or p.name for p in files}),
        "values": report.values,
        "forms": report.forms,
        "hits": report.hits,
        "found": report.found,
        "run_id_recorded": recorded,
        "run_ids_told": told,
        "ok": run.exit_codes == [0, 0]
        and bool(run.salts)
        and report.clean
        and recorded is not None
        and told == [recorded],
    }


def print_artefact_scan(row: dict[str, Any]) -> None:
    if "skipped" in row:
        print(f"artefact scan (issue 39 row 1): skipped: {row['skipped']}")
        return
    hits = sum(row["hits"].values())
    print(
        f"artefact scan (issue 39 row 1): a two-node launch at {row['coordinator']} (exit "
        f"{row['exit_codes']}, {row['seconds']} s); {row['files']} files, {row['bytes']} bytes "
        f"searched for {row['values']} values of the secret in {row['forms']} forms (salts of "
        f"{row['listeners_probed']} listeners probed: {len(row['salts'])} distinct); {hits} hits"
        f"{': ' + '; '.join(row['found'][:5]) if hits else ''}; run id {row['run_id_recorded']} "
        f"recorded, told {row['run_ids_told']}; {'ok' if row['ok'] else 'FAILED'}"
    )


# ----------------------------------------------------------------------------- key log run


def keylog_run(workdir: Path, workers: int = 3, steps: int = 20) -> dict[str, Any]:
    """Issue 39 row 10: a captured training run, every tag of every connection checked with
    its key log (module doc); ``ok`` when the run finished, the capture lost nothing, and
    every connection and every key log line checked out."""
    reason = captured_run.unavailable_reason()
    if reason is not None:
        return {"skipped": reason, "ok": True}
    run = captured_run.run_captured(workdir, workers=workers, steps=steps)
    key_log = run.key_log.read_text() if run.key_log.exists() else ""
    check = check_pcap(run.pcap, key_log, document_reader(ROOT / "docs" / "protocol.md"))
    found = re.search(r"coordinator at (\S+)", run.log_text)
    coordinator = found.group(1) if found else None
    to_coordinator = check.by_listener.get(coordinator, 0) if coordinator else 0
    return {
        "command": " ".join(run.command),
        "workers": workers,
        "steps": steps,
        "exit_code": run.exit_code,
        "seconds": round(run.seconds, 1),
        "packets": run.capture.packets,
        "kernel_drops": run.capture.kernel_drops,
        "truncated": run.capture.truncated,
        "pcap_bytes": run.pcap.stat().st_size,
        "coordinator": coordinator,
        "to_coordinator": to_coordinator,
        "between_workers": check.verified - to_coordinator,
        **check.summary(),
        "ok": run.exit_code == 0
        and run.capture.kernel_drops == 0
        and run.capture.truncated == 0
        and check.ok
        and to_coordinator == workers,
    }


def print_keylog_run(row: dict[str, Any]) -> None:
    if "skipped" in row:
        print(f"key log run (issue 39 row 10): skipped: {row['skipped']}")
        return
    print(
        f"key log run (issue 39 row 10): a coordinator and {row['workers']} workers, "
        f"{row['steps']} steps in a network namespace (exit {row['exit_code']}, "
        f"{row['seconds']} s); {row['packets']} packets captured ({row['kernel_drops']} dropped); "
        f"{row['connections']} connections ({row['to_coordinator']} to the coordinator, "
        f"{row['between_workers']} between workers, {row['connections_without_bytes']} without "
        f"bytes), {row['connections_verified']} verified: {row['frames']} frames, "
        f"{row['tags_verified']} tags verified with {row['key_log_lines']} key log lines; "
        f"{'ok' if row['ok'] else 'FAILED: ' + '; '.join(row['failures'][:5])}"
    )


# ----------------------------------------------------------------------------- second review

PROBE_INTERVAL = 0.05
"""A probe starts this often (or as soon as the one before it ends, if it took longer)."""
QUIET_PROBES = 5
"""Probes before each attack: the daemon's quiet handshake latency."""
INLINE_FLOAT = cbor2.CBORTag(40, [[1], cbor2.CBORTag(85, b"\x00\x00\x80\x3f")])
"""A 4-byte float32 tensor as RFC 8746 encodes it (tag 40 around a typed array)."""


@dataclass(frozen=True)
class ReviewSizes:
    """How large `second_review`'s attacks are (the defaults: issue 31's figures)."""

    mib: int = 60
    """Row 2: the frame's size in MiB."""
    frames: int = 2
    """Row 2: frames of each variant, one connection each."""
    hellos: int = 20
    """Row 3: hellos holding a typed array."""
    reports: int = 30
    """Row 4: early ``ready`` reports."""
    entries: tuple[int, ...] = (65_000, 20_000)
    """Row 4: entries of each report's spec, one daemon each."""
    squats: int = 3
    """Row 5: squatted ranks, one after the other."""
    evictions: int = 20
    """Row 6: members evicted."""


async def _probe_once(target: Target) -> float:
    """Seconds from a legitimate dialer's connect to the daemon's answer to its hello (the
    challenge): one trip through the daemon's event loop, and little else."""
    hello = DialerHandshake(target.secret, _me(target, 0)).hello()
    started = time.perf_counter()
    stream = await trio.open_tcp_stream(*target.address, local_address=PROBE_SOURCE)
    conn = Connection(stream)
    conn.tensors = False
    try:
        await conn.send(*hello)
        await conn.recv(HANDSHAKE_MAX_FRAME)
    finally:
        await conn.aclose()
    return time.perf_counter() - started


async def _probe_loop(target: Target, latencies: list[float], failures: list[str]) -> None:
    while True:
        started = trio.current_time()
        try:
            with trio.fail_after(60):
                latencies.append(await _probe_once(target))
        except (ProtocolError, OSError, trio.TooSlowError) as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
        await trio.sleep_until(started + PROBE_INTERVAL)


async def _sample_memory(run: LiveRun, peak: list[int]) -> None:
    while True:
        peak[0] = max(peak[0], run.coordinator_memory("VmRSS") or 0)
        await trio.sleep(0.01)


async def _watched(run: LiveRun, attack: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """Run ``attack`` while a legitimate dialer probes the daemon every `PROBE_INTERVAL` and
    its memory is sampled; the attack's row with the daemon's memory (before, peak, after),
    descriptors and the probes' latencies added."""
    target = run.target()
    quiet = [await _probe_once(target) for _ in range(QUIET_PROBES)]
    run.reset_memory_peak()
    before = run.coordinator_memory("VmRSS") or 0
    fds_before = run.coordinator_descriptors()
    during: list[float] = []
    failures: list[str] = []
    sampled = [before]
    started = time.monotonic()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_probe_loop, target, during, failures)
        nursery.start_soon(_sample_memory, run, sampled)
        row = await attack()
        nursery.cancel_scope.cancel()
    seconds = time.monotonic() - started
    await trio.sleep(0.3)  # what the daemon keeps, not what it frees on its way
    return {
        **row,
        "seconds": seconds,
        "rss_before": before,
        "rss_peak": max(sampled[0], run.coordinator_memory("VmHWM") or 0),
        "rss_after": run.coordinator_memory("VmRSS"),
        "fds_before": fds_before,
        "fds_after": run.coordinator_descriptors(),
        "probe_quiet_median": sorted(quiet)[len(quiet) // 2],
        "probes": len(during),
        "probe_failures": failures[:3],
        "loop_block": max(during, default=None),
        "daemon_alive": run.coordinator is not None and run.coordinator.poll() is None,
    }


async def _admitted_within(target: Target, rank: int, seconds: float = 10.0) -> float | None:
    """Seconds a legitimate worker takes to be welcomed as ``rank`` (retrying while the
    listener is busy or the rank is taken), None if not within ``seconds``; it hangs up."""
    with trio.move_on_after(seconds):
        conn, took = await _join_rank(target, rank)
        await conn.aclose()
        return took
    return None


async def _until_closed(conn: Connection, seconds: float) -> tuple[list[dict[str, Any]], str]:
    """What the daemon sends on ``conn`` until it hangs up (heartbeats left out), and how it
    ended: ``closed`` (by the daemon), ``still open`` after ``seconds``, or an error."""
    said: list[dict[str, Any]] = []
    with trio.move_on_after(seconds):
        try:
            while True:
                message = await conn.recv()
                if message["kind"] != "heartbeat":
                    said.append(message)
        except PeerClosed:
            return said, "closed"
        except ProtocolError as exc:
            return said, f"{type(exc).__name__}: {exc}"
    return said, "still open"


def _told(said: list[dict[str, Any]]) -> str:
    """What the daemon said, the run's start left out."""
    return "; ".join(
        f"{m['kind']}: {m.get('reason', '')}".rstrip(": ") for m in said if m["kind"] != "start_run"
    )


def _join_fields(rank: int) -> dict[str, Any]:
    """A join's fields: a data-plane address of its own, one two-element float32 parameter."""
    return {"host": "127.0.0.1", "port": 9 + rank, "params": [["w", [2], "float32", True]]}


def _row2_frame(nbytes: int, variant: str) -> tuple[bytes, bool]:
    """Row 2's frame of about ``nbytes`` of ``variant`` (`ROW2_VARIANTS`): (the frame, whether
    its tag is to be valid)."""
    fields = {"op": 0, "hop": 0, "part": 0}
    kind, tag = variant.split(", ")
    if kind == "bulk coll":
        frame = encode_frame_bytes("coll", fields, torch.zeros(nbytes // 4))
    elif kind == "inline coll":
        frame = encode_frame_bytes("coll", {**fields, "data": torch.zeros(nbytes // 4)})
    else:  # a digest of 300-character names and 4-byte digests, as a worker lays one out
        count = nbytes // 307
        names = [f"{n:0300d}" for n in range(count)]
        digest = {"epoch": 1, "step": 0, "digest": bytes(32), "tensors": bytes(4 * count)}
        frame = encode_frame_bytes("digest", {**digest, "names": names})
    return frame, tag == "valid tag"


async def _send_after_auth(target: Target, frame: bytes, tagged: bool) -> tuple[str, float]:
    """Authenticate as the free rank 1, send ``frame`` (with its valid tag, or a random one),
    and wait for the daemon to hang up: (what happened, seconds from the send)."""
    conn, _ = await _join_rank(target, 1)  # (while the previous holder's link closes)
    started = time.monotonic()
    try:
        try:
            if tagged:
                await conn.send_frame(frame)
            else:
                await conn.stream.send_all(frame + encode_tag_trailer(secrets.token_bytes(16)))
            said, end = await _until_closed(conn, 60)
        except (PeerClosed, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            said, end = [], f"closed while sending: {exc}"
    finally:
        await conn.aclose()
    return f"{_told(said) or 'nothing said'}; {end}", time.monotonic() - started


async def review_row2(run: LiveRun, sizes: ReviewSizes, variant: str) -> list[dict[str, Any]]:
    """Row 2: an authenticated peer sends a ``sizes.mib`` MiB frame of ``variant`` (a key of
    `ROW2_VARIANTS`), with a random tag (what a relay without the secret can send) or its valid
    one (a peer holding the secret); the daemon must drop the connection and serve on."""
    target = run.target()
    frame, tagged = _row2_frame(sizes.mib * 2**20, variant)

    async def attack() -> dict[str, Any]:
        outcomes, seconds, admitted = [], [], []
        for _ in range(sizes.frames):
            outcome, took = await _send_after_auth(target, frame, tagged)
            outcomes.append(outcome)
            seconds.append(took)
            admitted.append(await _admitted_within(target, 1))
        closed = all(o.endswith("closed") or "closed while sending" in o for o in outcomes)
        return {
            "attempts": sizes.frames,
            "outcome": f"dropped after {max(seconds):.2f} s: {outcomes[0]}",
            "outcomes": outcomes,
            "admission": admitted,
            "ok": closed and None not in admitted,
        }

    return [{"row": "2", "attack": f"{sizes.mib} MiB {variant}", **await _watched(run, attack)}]


ROW2_VARIANTS = (
    "bulk coll, random tag",
    "inline digest, random tag",
    "inline digest, valid tag",
    "inline coll, valid tag",
)


async def review_row3(run: LiveRun, sizes: ReviewSizes) -> list[dict[str, Any]]:
    """Row 3: hellos holding a 4-byte typed array (a stranger's first frame)."""
    target = run.target()
    _, fields = DialerHandshake(target.secret, _me(target, 0)).hello()
    frame = encode_frame_bytes("hello", {**fields, "nonce": INLINE_FLOAT})

    async def attack() -> dict[str, Any]:
        answers = []
        for _ in range(sizes.hellos):
            stream, _where = await _open(target)
            conn = Connection(stream)
            try:
                await stream.send_all(frame)
                answers.append(await _answer(conn, target.handshake_seconds + 2))
            finally:
                await conn.aclose()
        admitted = await _admitted_within(target, 0)
        return {
            "attempts": sizes.hellos,
            "outcome": f"{sum('typed array' in a for a in answers)} refused: {answers[0]}",
            "outcomes": answers,
            "admission": [admitted],
            "ok": all("typed arrays are refused" in a for a in answers) and admitted is not None,
        }

    return [
        {
            "row": "3",
            "attack": f"{len(frame)}-byte hello, 4-byte typed array",
            **await _watched(run, attack),
        }
    ]


async def _member(target: Target, rank: int) -> Connection:
    """Dial as ``rank`` and send a valid join."""
    conn, _ = await dial(target.address, target.secret, _me(target, rank))
    await conn.send("join", _join_fields(rank))
    return conn


async def _start_of(conn: Connection, members: int) -> dict[str, Any]:
    """Read ``conn`` until the start of an epoch of ``members`` members."""
    with trio.fail_after(30):
        while True:
            message = await conn.recv()
            if message["kind"] == "start_run" and len(message["addresses"]) == members:
                return message


async def _heartbeats(conn: Connection) -> None:
    """Heartbeat every 50 ms and read whatever comes, until the connection ends."""
    async with trio.open_nursery() as nursery:

        async def beat() -> None:
            while True:
                await conn.send("heartbeat", {})
                await trio.sleep(0.05)

        nursery.start_soon(beat)
        try:
            while True:
                await conn.recv()
        except ProtocolError:
            nursery.cancel_scope.cancel()


async def review_row4(run: LiveRun, sizes: ReviewSizes, entries: int) -> list[dict[str, Any]]:
    """Row 4: in an elastic run of two members, rank 0 (joined, authenticated) sends
    ``sizes.reports`` early ``ready`` reports for step 1 with ``entries``-entry specs. The
    run must drop it naming the rank; a new rank 0 is then admitted."""
    target = run.target()
    spec = tuple(((i % 7 + 1, 3), "float32") for i in range(entries))
    async with trio.open_nursery() as nursery:
        attacker, member = [await _member(target, rank) for rank in (0, 1)]
        start = await _start_of(attacker, 2)
        nursery.start_soon(_heartbeats, member)
        frames = [
            encode_frame_bytes(
                "ready", {"epoch": start.get("epoch", 1), "step": 1, "bucket": b, "spec": spec}
            )
            for b in range(sizes.reports)
        ]

        async def attack() -> dict[str, Any]:
            sent = 0
            async with trio.open_nursery() as inner:

                async def send_all() -> None:
                    nonlocal sent
                    try:
                        for frame in frames:
                            await attacker.send_frame(frame)
                            sent += 1
                    except (PeerClosed, trio.BrokenResourceError, trio.ClosedResourceError):
                        pass

                inner.start_soon(send_all)
                said, end = await _until_closed(attacker, 30)
                inner.cancel_scope.cancel()
            await attacker.aclose()
            told = _told(said)
            admitted = await _admitted_within(target, 0)
            return {
                "attempts": sent,
                "outcome": f"{told or 'nothing said'}; {end}",
                "admission": [admitted],
                "ok": "rank 0" in told and end == "closed" and admitted is not None,
            }

        row = await _watched(run, attack)
        nursery.cancel_scope.cancel()
    await member.aclose()
    return [
        {"row": "4", "attack": f"{sizes.reports} early readies, {entries:,}-entry specs", **row}
    ]


async def review_row5(run: LiveRun, sizes: ReviewSizes, deadline: float) -> list[dict[str, Any]]:
    """Row 5: authenticate as the free rank 1, send one heartbeat, go quiet (the connection
    held open); the real rank 1 dials at once and again until welcomed."""
    target = run.target()

    async def attack() -> dict[str, Any]:
        admitted: list[float | None] = []
        ends = []
        for _ in range(sizes.squats):
            squatter, _ = await _join_rank(target, 1)
            await squatter.send("heartbeat", {})
            took: list[float | None] = [None]
            async with trio.open_nursery() as nursery:

                async def real(into: list[float | None] = took) -> None:
                    into[0] = await _admitted_within(target, 1, deadline + 10)

                nursery.start_soon(real)
                started = time.monotonic()
                said, end = await _until_closed(squatter, deadline + 10)
                after = time.monotonic() - started
                ends.append(f"{_told(said) or 'nothing said'}; {end} after {after:.2f} s")
            await squatter.aclose()
            admitted.append(took[0])
        return {
            "attempts": sizes.squats,
            "outcome": f"squatter {ends[0]}",
            "outcomes": ends,
            "admission": admitted,
            "ok": None not in admitted
            and all(a <= deadline + 2 for a in admitted if a is not None),
        }

    return [
        {
            "row": "5",
            "attack": f"heartbeat, then quiet (deadline {deadline:g} s)",
            **await _watched(run, attack),
        }
    ]


async def review_row6(run: LiveRun, sizes: ReviewSizes) -> list[dict[str, Any]]:
    """Row 6: an elastic run (--min-workers 1) that rank 0 keeps heartbeating; ``evictions``
    times, rank 1 joins and goes silent past the heartbeat deadline, keeping its end open.
    Each must be told ``abort`` and its connection closed; the daemon's descriptors counted
    before and after."""
    target = run.target()
    stayer = await _member(target, 0)
    await _start_of(stayer, 1)
    held: list[Connection] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_heartbeats, stayer)

        async def attack() -> dict[str, Any]:
            ends, joins = [], []
            for _ in range(sizes.evictions):
                silent, took = await _join_rank(target, 1)
                joins.append(took)
                await silent.send("join", _join_fields(1))
                said, end = await _until_closed(silent, 10)
                ends.append(f"{said[-1]['kind'] if said else 'nothing said'}; {end}")
                held.append(silent)  # its end stays open, as a stalled peer's would
            await trio.sleep(0.3)
            joins.append(await _admitted_within(target, 1))  # a legitimate rank 1, after
            return {
                "attempts": sizes.evictions,
                "outcome": f"{sum(e == 'abort; closed' for e in ends)} told abort and closed",
                "outcomes": ends,
                "admission": joins,
            }

        row = await _watched(run, attack)
        nursery.cancel_scope.cancel()
    for conn in held:
        await conn.aclose()
    await stayer.aclose()
    row["outcome"] += f"; daemon descriptors {row['fds_before']} -> {row['fds_after']}"
    row["ok"] = (
        all(e == "abort; closed" for e in row["outcomes"])
        and row["fds_after"] is not None
        and row["fds_after"] <= row["fds_before"] + 1
    )
    return [{"row": "6", "attack": f"{sizes.evictions} evictions (elastic run)", **row}]


SECOND_REVIEW_DEADLINE = 1.0
"""The heartbeat (and join) deadline of rows 5's and 6's daemons, seconds."""


async def second_review(workdir: Path, sizes: ReviewSizes = ReviewSizes()) -> list[dict[str, Any]]:
    """Issue 31, rows 2-6, each against a coordinator daemon of its own on loopback: the rows
    of `print_second_review`'s table."""
    elastic = ("--min-workers", "1", "--rendezvous-seconds", "0.05", "--rejoin-seconds", "60")
    together = ("--min-workers", "1", "--rendezvous-seconds", "60")  # both start epoch 1
    short = ("--heartbeat-deadline", f"{SECOND_REVIEW_DEADLINE:g}")
    plans: list[
        tuple[str, tuple[str, ...], Callable[[LiveRun], Awaitable[list[dict[str, Any]]]]]
    ] = [
        *[
            (f"row2-{n}", (), lambda run, v=v: review_row2(run, sizes, v))
            for n, v in enumerate(ROW2_VARIANTS)
        ],
        ("row3", (), lambda run: review_row3(run, sizes)),
        *[
            (f"row4-{n}", together, lambda run, n=n: review_row4(run, sizes, n))
            for n in sizes.entries
        ],
        ("row5", short, lambda run: review_row5(run, sizes, SECOND_REVIEW_DEADLINE)),
        ("row6", (*elastic, *short), lambda run: review_row6(run, sizes)),
    ]
    rows: list[dict[str, Any]] = []
    for name, flags, review in plans:
        run = LiveRun(workdir / name, handshake_seconds=10.0, coordinator_args=flags)
        run.workdir.mkdir(parents=True)
        try:
            run.start_coordinator()
            with trio.fail_after(120):
                got = await review(run)
        finally:
            run.kill()
        log = run.coordinator_log()
        for row in got:
            row["daemon_log"] = [
                line[-300:] for line in log.splitlines() if "WARNING" in line or "ERROR" in line
            ][:6]
            print(f"  row {row['row']} {row['attack']}: {row['seconds']:.1f} s", flush=True)
        rows += got
    return rows


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def print_second_review(rows: list[dict[str, Any]]) -> None:
    """The table: row, attack, attempts, outcome, the daemon's RSS (MiB, before / peak /
    after), the worst probe latency during the attack (ms; quiet median beside it), and the
    worst admission of a legitimate worker during or right after it (ms)."""
    print()
    print("| row | attack | attempts | outcome | daemon RSS MiB before / peak / after | "
          "event loop blocked ms (quiet) | admission ms | ok |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        rss = " / ".join(
            "-" if row[k] is None else f"{row[k] / 2**20:.0f}"
            for k in ("rss_before", "rss_peak", "rss_after")
        )
        admission = [a for a in row["admission"]]
        worst = None if None in admission else max(admission, default=None)
        outcome = row["outcome"].replace("|", "/")
        if len(outcome) > 240:
            outcome = outcome[:237] + "..."
        print(
            f"| {row['row']} | {row['attack']} | {row['attempts']} | {outcome} | {rss} | "
            f"{_ms(row['loop_block'])} ({_ms(row['probe_quiet_median'])}) | "
            f"{'not admitted' if None in admission else _ms(worst)} | "
            f"{'yes' if row['ok'] else 'NO'} |"
        )


# ----------------------------------------------------------------------------- main

PHASES = (
    "connect_close",
    "http_garbage",
    "framed_garbage",
    "oversized",
    "wrong_secret",
    "forged_auth",
    "offline_guess",
    "replay",
    "slow_drip",
    "flood",
)
"""The attacks on the training run, in order (each a phase of the log)."""

ADMISSION_PHASES = ("slow_holders", "spread_holders", "duplicate_rank")
"""The attacks on a coordinator with free ranks (`admission_attacks`), after the training run."""


async def admission_attacks(
    target: Target, holders: int, duplicate_trials: int
) -> dict[str, dict[str, Any]]:
    """`ADMISSION_PHASES` against ``target`` (a coordinator whose ranks are free)."""
    results: dict[str, dict[str, Any]] = {}
    for name in ADMISSION_PHASES:
        await mark_phase(target, name)
        started = time.monotonic()
        if name == "slow_holders":
            results[name] = await slow_holders(target, holders)
        elif name == "spread_holders":
            results[name] = await slow_holders(
                target,
                holders,
                sources=spread_sources(holders),
                join_within=SPREAD_JOIN_WITHIN,
            )
        else:
            results[name] = await duplicate_rank(target, duplicate_trials)
        print(f"  {name}: {time.monotonic() - started:.1f} s", flush=True)
        await trio.sleep(LOG_WINDOW + 0.2)
    return results


async def _attack_all(
    target: Target, count: int, flood_count: int, concurrency: int
) -> tuple[list[Attempt], dict[str, float]]:
    attempts: list[Attempt] = []
    seconds: dict[str, float] = {}
    for name in PHASES:
        await mark_phase(target, name)
        if name == "flood":
            got, took = await run_attacks(target, name, flood_count, concurrency)
        elif name == "slow_drip":  # each holds a slot until the deadline: more at once
            got, took = await run_attacks(target, name, count, max(1, target.max_pending // 2))
        else:
            got, took = await run_attacks(target, name, count, concurrency)
        attempts += got
        seconds[name] = took
        print(f"  {name}: {len(got)} attempts in {took:.1f} s", flush=True)
        await trio.sleep(LOG_WINDOW + 0.2)  # the next phase's lines start a new log window
    return attempts, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200, help="attempts of each attack")
    parser.add_argument("--flood", type=int, default=200, help="connections of the flood")
    parser.add_argument("--concurrency", type=int, default=16, help="attempts at once")
    parser.add_argument("--handshake-seconds", type=float, default=2.0)
    parser.add_argument("--max-pending", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8000, help="training steps (must outlast)")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="then train the same run without attacks: compare the final digest and steps/s",
    )
    parser.add_argument(
        "--holders", type=int, default=96, help="slow holders (issue 18 row 3: 64 and 96)"
    )
    parser.add_argument(
        "--duplicate-trials", type=int, default=192, help="pairs of duplicate rank dialers"
    )
    parser.add_argument(
        "--admission-handshake-seconds",
        type=float,
        default=10.0,
        help="the handshake deadline of the coordinator the admission attacks target",
    )
    parser.add_argument(
        "--relay-after", type=int, default=200, help="genuine frames before the relay injects"
    )
    parser.add_argument(
        "--relay-steps", type=int, default=600, help="training steps of the relay's live run"
    )
    parser.add_argument(
        "--relay-only", action="store_true", help="run the relay attacks (issue 18 row 1) only"
    )
    parser.add_argument(
        "--no-second-review",
        action="store_true",
        help="skip the second review's phase (issue 31 rows 2-6, a daemon each)",
    )
    parser.add_argument(
        "--second-review-only", action="store_true", help="run the second review's phase only"
    )
    parser.add_argument(
        "--second-review-mib", type=int, default=60, help="row 2: the frames' size in MiB"
    )
    parser.add_argument(
        "--second-review-evictions", type=int, default=20, help="row 6: members evicted"
    )
    parser.add_argument(
        "--guessing-only", action="store_true", help="run the online guessing phase only"
    )
    parser.add_argument(
        "--guessing-seconds", type=float, default=8.0, help="how long each guesser runs"
    )
    parser.add_argument(
        "--guessing-words", type=int, default=50, help="the guesser's dictionary (wrong secrets)"
    )
    parser.add_argument(
        "--artefact-scan-only",
        action="store_true",
        help="run the run-id and artefact scan only (issue 39 row 1)",
    )
    parser.add_argument(
        "--no-artefact-scan", action="store_true", help="skip the run-id and artefact scan"
    )
    parser.add_argument(
        "--keylog-run",
        action="store_true",
        help="run the captured run checked with its key log only (issue 39 row 10)",
    )
    parser.add_argument(
        "--no-keylog-run", action="store_true", help="skip the captured run and its key log"
    )
    parser.add_argument("--keylog-workers", type=int, default=3, help="workers of the captured run")
    parser.add_argument(
        "--keylog-dir",
        help="keep the captured run's run.pcap, keys.log and launch.log here (with --keylog-run)",
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.keylog_run:
        if args.keylog_dir:
            captured = keylog_run(Path(args.keylog_dir), args.keylog_workers)
        else:
            with tempfile.TemporaryDirectory(prefix="paramsync-keylog-") as tmp:
                captured = keylog_run(Path(tmp), args.keylog_workers)
        print_keylog_run(captured)
        if args.json:
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"keylog_run": captured}, indent=2))
            print(f"wrote {path}")
        return 0 if captured["ok"] else 1
    if args.artefact_scan_only:
        with tempfile.TemporaryDirectory(prefix="paramsync-artefacts-") as tmp:
            scanned = artefact_scan_run(Path(tmp))
        print_artefact_scan(scanned)
        if args.json:
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"artefact_scan": scanned}, indent=2))
            print(f"wrote {path}")
        return 0 if scanned["ok"] else 1
    if args.guessing_only:
        with tempfile.TemporaryDirectory(prefix="paramsync-guessing-") as tmp:
            guessed = guessing(Path(tmp), args.guessing_seconds, args.guessing_words)
        print_guessing(guessed)
        if args.json:
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"guessing": guessed}, indent=2))
            print(f"wrote {path}")
        return 0 if all(row["ok"] for row in guessed.values()) else 1
    sizes = ReviewSizes(mib=args.second_review_mib, evictions=args.second_review_evictions)
    if args.second_review_only:
        print("second review (issue 31 rows 2-6), a coordinator daemon each", flush=True)
        with tempfile.TemporaryDirectory(prefix="paramsync-review-") as tmp:
            review = trio.run(second_review, Path(tmp), sizes)
        print_second_review(review)
        if args.json:
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"second_review": review}, indent=2))
            print(f"wrote {path}")
        return 0 if all(row["ok"] for row in review) else 1

    relay = trio.run(relay_attacks, args.relay_after)
    with tempfile.TemporaryDirectory(prefix="paramsync-relay-") as tmp:
        live = trio.run(relay_live_run, Path(tmp), args.relay_after, args.relay_steps)
    _print_relay(relay, live)
    if args.relay_only:
        if args.json:
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"relay_attacks": relay, "relay_live_run": live}, indent=2))
            print(f"wrote {path}")
        return 0 if relay_ok(relay, live) else 1

    bombs = wire_bombs()
    for name, row in bombs.items():
        print(
            f"{name}: refused in {row['seconds'] * 1e3:.1f} ms, "
            f"peak {row['peak_bytes'] / 2**20:.2f} MiB: {row['refusal']}"
        )
    costs = guess_costs()
    print(
        f"one offline guess against a proof: {costs['raw_hmac_seconds_per_guess'] * 1e6:.1f} us "
        f"keyed by the raw secret (protocol v1), {costs['scrypt_seconds_per_guess'] * 1e3:.1f} "
        f"ms keyed by the scrypt-stretched secret (v2)"
    )
    with tempfile.TemporaryDirectory(prefix="paramsync-hostile-") as tmp:
        run = LiveRun(
            Path(tmp),
            steps=args.steps,
            handshake_seconds=args.handshake_seconds,
            max_pending=args.max_pending,
        )
        try:
            run.start()
            run.wait_training()
            rss_before = run.coordinator_memory()
            print(f"training on 127.0.0.1:{run.port}; attacking", flush=True)
            started = time.monotonic()
            attempts, phase_seconds = trio.run(
                _attack_all, run.target(), args.count, args.flood, args.concurrency
            )
            attack_seconds = time.monotonic() - started
            alive_after = run.alive()
            peak_rss = run.coordinator_memory()
            print("attacks done; waiting for training to finish", flush=True)
            outcome = run.finish()
        finally:
            run.kill()
        baseline: RunOutcome | None = None
        if args.baseline:
            print("training the same run without attacks", flush=True)
            quiet = LiveRun(Path(tmp) / "baseline", steps=args.steps)
            quiet.workdir.mkdir()
            try:
                quiet.start()
                baseline = quiet.finish()
            finally:
                quiet.kill()

        print("admission attacks on a coordinator with free ranks", flush=True)
        free = LiveRun(
            Path(tmp) / "admission",
            world_size=2 + args.duplicate_trials,
            handshake_seconds=args.admission_handshake_seconds,
            max_pending=args.max_pending,
        )
        free.workdir.mkdir()
        try:
            free.start_coordinator()
            admission = trio.run(
                admission_attacks, free.target(), args.holders, args.duplicate_trials
            )
            free.stop()  # a stopped daemon logs its admission totals
            free_log = free.coordinator_log()
        finally:
            free.kill()

        review: list[dict[str, Any]] = []
        if not args.no_second_review:
            print("second review (issue 31 rows 2-6), a coordinator daemon each", flush=True)
            review = trio.run(second_review, Path(tmp) / "review", sizes)
        print("online guessing (issue 39 row 2)", flush=True)
        online = guessing(Path(tmp) / "guessing", args.guessing_seconds, args.guessing_words)
        scanned: dict[str, Any] | None = None
        if not args.no_artefact_scan:
            print("run-id and artefact scan (issue 39 row 1)", flush=True)
            scanned = artefact_scan_run(Path(tmp) / "artefacts")
        captured: dict[str, Any] | None = None
        if not args.no_keylog_run:
            print("the key log against a captured run (issue 39 row 10)", flush=True)
            captured = keylog_run(Path(tmp) / "keylog", args.keylog_workers)

    log = parse_admission_log(outcome.coordinator_log)
    rows = account(attempts, log)
    names = [a for a in ("connect_close", "http_garbage", "framed_garbage", "oversized",
                         "wrong_secret", "forged_auth", "offline_guess", "taken_rank", "replay",
                         "slow_drip", "flood") if a in rows]  # fmt: skip
    header = (
        f"{'attack':<15} {'tried':>6} {'refused':>8} {'logged':>7} {'summed':>7} "
        f"{'missing':>8}  categories as expected"
    )
    print()
    print(header)
    print("-" * len(header))
    for name in names:
        row = rows[name]
        ok = "yes" if not row["unexpected"] else f"no: {row['unexpected'][:2]}"
        print(
            f"{name:<15} {row['tried']:>6} {row['refused']:>8} {row['logged']:>7} "
            f"{row['summed_up']:>7} {row['unaccounted']:>8}  {ok}"
        )
    total_tried = sum(row["tried"] for row in rows.values())
    total_refused = sum(row["refused"] for row in rows.values())
    print("-" * len(header))
    print(f"{'all':<15} {total_tried:>6} {total_refused:>8}")
    print()
    rank0 = outcome.summaries.get(0, {})
    print(f"attack phase: {attack_seconds:.1f} s; every process alive after it: {alive_after}")
    print(f"training finished ok (every exit code 0): {outcome.finished_ok} {outcome.exit_codes}")
    print(f"final digests identical: {outcome.digests_identical} {outcome.digests}")
    print(f"final step {rank0.get('final_step')}, rank 0 {rank0.get('steps_per_second', 0):.1f} "
          f"steps/s over the whole run")  # fmt: skip
    if peak_rss and rss_before:
        print(
            f"coordinator peak RSS: {rss_before / 2**20:.0f} MiB before the attacks, "
            f"{peak_rss / 2**20:.0f} MiB after"
        )
    print(f"daemon admission totals: {log.totals}")
    guessed = [a for a in attempts if a.attack == "offline_guess"]
    recovered = [a for a in guessed if a.outcome.startswith("recovered")]
    print(
        f"offline_guess: the secret recovered from {len(recovered)} of {len(guessed)} replies; "
        f"e.g. {guessed[0].outcome if guessed else None}"
    )
    holding, dupes = admission["slow_holders"], admission["duplicate_rank"]
    spread = admission["spread_holders"]
    for name in ("slow_holders", "spread_holders"):
        row = admission[name]
        print(
            f"{name}: {row['holders']} holders from {row['sources']} addresses; "
            f"joins (s, limit {row['join_within_seconds']:g}): {row['joins_seconds']}; "
            f"holders' connections: {row['holder_counts']}"
        )
    print(
        f"duplicate_rank: {dupes['trials']} trials, both welcomed in {dupes['both_welcomed']}: "
        f"{dupes['outcomes']}"
    )
    print(f"admission daemon totals: {parse_admission_log(free_log).totals}")
    if review:
        print_second_review(review)
    print_guessing(online)
    if scanned is not None:
        print_artefact_scan(scanned)
    if captured is not None:
        print_keylog_run(captured)
    same_as_baseline = None
    if baseline is not None:
        quiet0 = baseline.summaries.get(0, {})
        same_as_baseline = baseline.finished_ok and baseline.digests == outcome.digests
        print(
            f"without attacks: finished ok {baseline.finished_ok}, rank 0 "
            f"{quiet0.get('steps_per_second', 0):.1f} steps/s, the same final digest as the "
            f"attacked run: {same_as_baseline}"
        )

    result = {
        "command": "python benchmarks/hostile.py " + " ".join(argv or sys.argv[1:]),
        "config": vars(args),
        "attacks": {name: rows[name] for name in names},
        "attempts_total": total_tried,
        "refused_total": total_refused,
        "phase_seconds": phase_seconds,
        "attack_seconds": attack_seconds,
        "alive_after_attacks": alive_after,
        "training_finished_ok": outcome.finished_ok,
        "exit_codes": outcome.exit_codes,
        "digests": {str(rank): d for rank, d in outcome.digests.items()},
        "digests_identical": outcome.digests_identical,
        "final_step": rank0.get("final_step"),
        "rank0_steps_per_second": rank0.get("steps_per_second"),
        "coordinator_peak_rss_bytes_before": rss_before,
        "coordinator_peak_rss_bytes_after": peak_rss,
        "daemon_admission_totals": log.totals,
        "baseline": None
        if baseline is None
        else {
            "finished_ok": baseline.finished_ok,
            "digests": {str(rank): d for rank, d in baseline.digests.items()},
            "rank0_steps_per_second": baseline.summaries.get(0, {}).get("steps_per_second"),
            "same_final_digest_as_attacked_run": same_as_baseline,
        },
        "admission_attacks": admission,
        "admission_daemon_totals": parse_admission_log(free_log).totals,
        "wire_bombs": bombs,
        "offline_guess": {
            "replies": len(guessed),
            "secret_recovered": len(recovered),
            "sample_outcome": guessed[0].outcome if guessed else None,
            **costs,
        },
        "relay_attacks": relay,
        "relay_live_run": live,
        "second_review": review,
        "guessing": online,
        "artefact_scan": scanned,
        "keylog_run": captured,
        "sample_attempts": [asdict(a) for a in attempts[:: max(1, len(attempts) // 20)]],
    }
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")
    ok = (
        total_refused == total_tried
        and outcome.finished_ok
        and outcome.digests_identical
        and alive_after
        and same_as_baseline is not False
        and holding["all_joined_in_time"]
        and spread["all_joined_in_time"]
        and dupes["both_welcomed"] == 0
        and not recovered
        and all(row["refusal"] != "ACCEPTED" for row in bombs.values())
        and all(not row["unexpected"] and row["unaccounted"] == 0 for row in rows.values())
        and relay_ok(relay, live)
        and all(row["ok"] for row in review)
        and all(row["ok"] for row in online.values())
        and (scanned is None or scanned["ok"])
        and (captured is None or captured["ok"])
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
