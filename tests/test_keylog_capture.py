"""Issue 39 row 10, shown on a run: every frame tag of a captured training run checked with its
key log (`paramsync.runtime.testing.keylog_check`).

The default suite checks the pieces on synthetic input: the pcap file written and read back,
Ethernet/IPv4/IPv6 TCP parsed, TCP streams rebuilt from segments out of order, retransmitted
and overlapping (and what cannot be rebuilt named), and the checker on connections built frame
by frame (a tag that does not verify, a connection without a key log line, a key log line no
connection used, a stream cut inside a frame: each a failure). The soak test runs
``benchmarks/hostile.py``'s key log phase: a coordinator and three workers training in a
network namespace of their own, every packet captured from outside the processes, every tag of
every connection checked.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from paramsync.runtime.protocol.frame_auth import FrameSealer, direction_keys
from paramsync.runtime.protocol.wire import encode_frame_bytes
from paramsync.runtime.testing.captured_run import unavailable_reason
from paramsync.runtime.testing.keylog_check import (
    check_capture,
    check_pcap,
    document_reader,
    parse_key_log,
)
from paramsync.runtime.testing.packet_capture import PcapWriter, read_pcap
from paramsync.runtime.testing.tcp_streams import (
    ACK,
    FIN,
    RST,
    SYN,
    Connection,
    Segment,
    parse_frame,
    reassemble,
)
from paramsync.runtime.transport.keylog import keylog_line

ROOT = Path(__file__).resolve().parent.parent
READER = document_reader(ROOT / "docs" / "protocol.md")
DIALER, LISTENER = ("127.0.0.1", 40000), ("127.0.0.1", 29500)


# ----------------------------------------------------------------------------- packets


def ethernet(segment: Segment, version: int = 4) -> bytes:
    """``segment`` as an Ethernet frame (IPv4 or IPv6, then TCP with a 20-byte header)."""
    tcp = struct.pack(
        ">HHIIBBHHH", segment.source[1], segment.destination[1], segment.seq, 0, 5 << 4,
        segment.flags, 65535, 0, 0,
    ) + segment.payload  # fmt: skip
    src = ipaddress.ip_address(segment.source[0]).packed
    dst = ipaddress.ip_address(segment.destination[0]).packed
    if version == 4:
        ip = struct.pack(">BBHHHBBH", 0x45, 0, 20 + len(tcp), 0, 0x4000, 64, 6, 0) + src + dst
        return bytes(12) + b"\x08\x00" + ip + tcp + bytes(6)  # Ethernet pads short frames
    ip = struct.pack(">IHBB", 6 << 28, len(tcp), 6, 64) + src + dst
    return bytes(12) + b"\x86\xdd" + ip + tcp


def open_and_send(
    dialer_bytes: bytes, listener_bytes: bytes, *, isn_d: int = 1000, isn_l: int = 5000,
    size: int = 7, dialer: tuple[str, int] = DIALER, listener: tuple[str, int] = LISTENER,
) -> list[Segment]:  # fmt: skip
    """A connection's segments in order: the handshake, each side's bytes in ``size`` pieces,
    both FINs."""
    segments = [
        Segment(dialer, listener, isn_d, SYN),
        Segment(listener, dialer, isn_l, SYN | ACK),
    ]
    for source, destination, isn, data in (
        (dialer, listener, isn_d, dialer_bytes),
        (listener, dialer, isn_l, listener_bytes),
    ):
        for at in range(0, len(data), size):
            seq = (isn + 1 + at) % 2**32
            segments.append(Segment(source, destination, seq, ACK, data[at : at + size]))
        segments.append(Segment(source, destination, (isn + 1 + len(data)) % 2**32, FIN | ACK))
    return segments


def test_a_pcap_file_round_trips_and_its_frames_parse(tmp_path: Path) -> None:
    v4 = Segment(("10.0.0.1", 1234), ("10.0.0.2", 80), 7, ACK, b"payload")
    v6 = Segment(("::1", 4321), ("fe80::2", 443), 2**32 - 1, SYN, b"")
    with open(tmp_path / "x.pcap", "wb") as stream:
        writer = PcapWriter(stream)
        writer.write(ethernet(v4), 1.5)
        writer.write(ethernet(v6, 6), 2.25)
        writer.write(bytes(12) + b"\x08\x06" + bytes(28), 3.0)  # ARP
    frames = list(read_pcap(tmp_path / "x.pcap"))
    assert [when for when, _ in frames] == [1.5, 2.25, 3.0]
    assert [parse_frame(frame) for _, frame in frames] == [v4, v6, None]
    with open(tmp_path / "cut.pcap", "wb") as stream:
        PcapWriter(stream).write(ethernet(v4)[:30], 1.0, original_length=80)
    with pytest.raises(ValueError, match="packet 0: 80 bytes on the wire, 30 captured"):
        list(read_pcap(tmp_path / "cut.pcap"))


def test_streams_are_rebuilt_from_segments_out_of_order_retransmitted_and_overlapping() -> None:
    sent, answered = secrets.token_bytes(300), secrets.token_bytes(200)
    segments = open_and_send(sent, answered, isn_d=2**32 - 50)  # wraps past 2**32
    handshake, data = segments[:2], segments[2:]
    shuffled = data[::-1]  # every data segment out of order
    shuffled += data[3:9]  # retransmitted verbatim
    piece = data[5]  # an overlapping retransmission: 3 bytes before it, its own bytes, 4 after
    seq = (piece.seq - 3) % 2**32
    start = (piece.seq - segments[0].seq - 1) % 2**32 - 3
    shuffled.append(Segment(piece.source, piece.destination, seq, ACK, sent[start : start + 14]))
    (connection,) = reassemble(handshake + shuffled)
    assert (connection.dialer, connection.listener) == (DIALER, LISTENER)
    assert connection.established
    assert connection.streams() == (sent, answered, [])


def test_what_cannot_be_rebuilt_is_named() -> None:
    sent = secrets.token_bytes(100)
    segments = open_and_send(sent, b"ok")
    gap = [s for s in segments if not (s.payload and s.payload == sent[14:21])]
    assert reassemble(gap)[0].streams()[2] == [
        "127.0.0.1:40000 -> listener: bytes 14..20 never captured"
    ]
    third = next(s for s in segments if s.payload == sent[14:21])
    differing = Segment(third.source, third.destination, third.seq, ACK, b"X" * 7)
    problems = reassemble([*segments, differing])[0].streams()[2]
    assert problems == [
        "127.0.0.1:40000 -> listener: a retransmission at byte 14 differs from the bytes "
        "already there"
    ]
    (late,) = reassemble(segments[2:])  # the capture began after the SYNs
    assert not late.established
    assert any("no SYN seen" in problem for problem in late.streams()[2])


def test_a_reused_port_is_a_new_connection_and_a_refused_dial_has_no_bytes() -> None:
    first = open_and_send(b"one", b"1", isn_d=10)
    second = open_and_send(b"two", b"2", isn_d=90_000)
    other = ("127.0.0.1", 40001)
    refused = [Segment(other, LISTENER, 5, SYN), Segment(LISTENER, other, 0, RST | ACK)]
    syn_again = [first[0]]  # a retransmitted SYN stays in its connection
    connections = reassemble(first[:1] + syn_again + first[1:] + refused + second)
    assert [c.streams() for c in connections] == [
        (b"one", b"1", []),
        (b"", b"", []),
        (b"two", b"2", []),
    ]
    assert connections[1].reset and not connections[1].established


# ----------------------------------------------------------------------------- the checker


def frames_of_a_connection(frames_each_way: int = 3) -> tuple[bytes, bytes, str]:
    """A connection's two directions, built frame by frame as section 5.4 says, and the line
    `paramsync.runtime.transport.keylog` writes for it."""
    nonce_d, nonce_l, session_key = (secrets.token_bytes(32) for _ in range(3))
    ways = []
    for first, second, key in zip(
        (("hello", {"nonce": nonce_d}), ("challenge", {"nonce": nonce_l})),
        (("auth", {"proof": bytes(32)}), ("welcome", {"proof": bytes(32)})),
        direction_keys(session_key),
        strict=True,
    ):
        data = encode_frame_bytes(*first) + encode_frame_bytes(*second)
        sealer = FrameSealer(key)
        for n in range(frames_each_way):
            frame = encode_frame_bytes("coll", {"op": 1, "hop": 0, "part": n})
            data += frame + sealer.seal([frame])  # the 17-byte trailer
        ways.append(data)
    return ways[0], ways[1], keylog_line(nonce_d, nonce_l, session_key)


def as_connection(to_listener: bytes, to_dialer: bytes, port: int) -> Connection:
    (connection,) = reassemble(
        open_and_send(to_listener, to_dialer, dialer=("127.0.0.1", port), size=1400)
    )
    return connection


def test_the_checker_verifies_every_tag_of_every_connection() -> None:
    a, b = frames_of_a_connection(3), frames_of_a_connection(5)
    connections = [as_connection(a[0], a[1], 40001), as_connection(b[0], b[1], 40002)]
    refused = reassemble([Segment(("127.0.0.1", 40003), LISTENER, 1, SYN)])
    result = check_capture(connections + refused, a[2] + b[2] + a[2], READER)  # a: both ends
    assert result.summary() == {
        "connections": 3, "connections_without_bytes": 1, "connections_verified": 2,
        "frames": 4 + 6 + 4 + 10, "tags_verified": 16, "key_log_lines": 2,
        "by_listener": {"127.0.0.1:29500": 2}, "failures": [], "ok": True,
    }  # fmt: skip


def test_the_checker_fails_on_a_bad_tag_a_missing_line_an_unused_line_and_a_cut_frame() -> None:
    a, b, c = (frames_of_a_connection(2) for _ in range(3))
    tampered = bytearray(a[1])
    tampered[-20] ^= 1  # a byte of the listener's last frame
    connections = [
        as_connection(a[0], bytes(tampered), 40001),
        as_connection(b[0], b[1], 40002),
        as_connection(c[0][:-5], c[1], 40003),
    ]
    result = check_capture(connections, a[2] + c[2] + frames_of_a_connection()[2], READER)
    assert not result.ok and result.verified == 0
    assert (
        result.failures[0]
        == "127.0.0.1:40001 -> 127.0.0.1:29500: the listener's frame 1: the tag does not match"
    )
    assert result.failures[1].startswith(
        "127.0.0.1:40002 -> 127.0.0.1:29500: no key log line for the nonces"
    )
    assert result.failures[2].startswith(
        "127.0.0.1:40003 -> 127.0.0.1:29500: the dialer's stream ends inside a frame"
    )
    assert "matches no captured connection" in result.failures[3] and len(result.failures) == 4
    with pytest.raises(ValueError, match="key log line 2 is not"):
        parse_key_log(a[2] + "PARAMSYNC_FRAME_KEYS 00\n")


def test_check_pcap_reads_a_capture_file(tmp_path: Path) -> None:
    a = frames_of_a_connection(2)
    with open(tmp_path / "run.pcap", "wb") as stream:
        writer = PcapWriter(stream)
        for segment in open_and_send(a[0], a[1], size=1400):
            writer.write(ethernet(segment), 0.0)
    assert check_pcap(tmp_path / "run.pcap", a[2], READER).summary()["tags_verified"] == 4


# ----------------------------------------------------------------------------- a real run


@pytest.mark.soak
@pytest.mark.skipif(unavailable_reason() is not None, reason=f"{unavailable_reason()}")
def test_every_tag_of_a_captured_training_run_verifies_with_the_key_log(tmp_path: Path) -> None:
    """The key log phase of benchmarks/hostile.py: every connection of a real run (a
    coordinator and three workers) found in the capture and every tag verified; then the same
    capture checked with one key log line left out, and with one captured byte flipped, fails
    naming the connection."""
    out, kept = tmp_path / "keylog.json", tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "benchmarks/hostile.py", "--keylog-run", "--keylog-dir", str(kept),
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    row = json.loads(out.read_text())["keylog_run"]
    assert row["exit_code"] == 0 and row["kernel_drops"] == 0 and row["failures"] == []
    assert row["to_coordinator"] == row["workers"] == 3
    assert row["between_workers"] >= 3  # the ring's links at least
    assert row["connections_verified"] == row["connections"] - row["connections_without_bytes"]
    assert row["tags_verified"] >= 100 and row["key_log_lines"] == row["connections_verified"]

    lines = (kept / "keys.log").read_text().splitlines(keepends=True)
    partial = "".join(line for line in lines if line != lines[0])
    missing = check_pcap(kept / "run.pcap", partial, READER)
    assert missing.verified == row["connections_verified"] - 1
    assert len(missing.failures) == 1 and "no key log line for the nonces" in missing.failures[0]

    packets = list(read_pcap(kept / "run.pcap"))
    last = max(i for i, (_, frame) in enumerate(packets) if (s := parse_frame(frame)) and s.payload)
    flipped = bytearray(packets[last][1])
    flipped[-1] ^= 1  # the last byte of the capture's last payload: a trailer's
    with open(tmp_path / "flipped.pcap", "wb") as stream:
        writer = PcapWriter(stream)
        for i, (when, frame) in enumerate(packets):
            writer.write(bytes(flipped) if i == last else frame, when)
    spoiled = check_pcap(tmp_path / "flipped.pcap", "".join(lines), READER)
    assert len(spoiled.failures) == 1 and "the tag does not match" in spoiled.failures[0]
