"""Every packet of a network namespace, captured from outside the processes that send them, into
a pcap file (issue 39 row 10: the key log checked against what was really on the wire).

Run inside the namespace (``ip netns exec NS python -m paramsync.runtime.testing.packet_capture
OUT.pcap``), before the processes it watches start: a raw ``AF_PACKET`` socket (Linux, root)
bound to no interface receives every frame of every interface of the namespace, and each is
appended to ``OUT.pcap`` (the classic libpcap format, Ethernet link type: Wireshark and tcpdump
read it). On loopback the kernel hands a capture each packet twice, leaving and arriving; the
leaving copy is dropped, as libpcap does. The process prints ``capturing`` once its socket is
open, and on SIGTERM or SIGINT drains what the socket still holds, then prints one JSON line:
the packets written and the kernel's count of those it dropped (its receive buffer full), which
a reader must see at 0 before trusting the capture to be whole.

`read_pcap` reads such a file back (and any classic pcap file of the Ethernet link type);
`PcapWriter` writes one (the tests build synthetic captures with it). No third-party code.
"""

from __future__ import annotations

import json
import signal
import socket
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import BinaryIO

__all__ = ["READY_LINE", "SNAPLEN", "CaptureStats", "PcapWriter", "capture", "read_pcap"]

READY_LINE = "capturing"
"""What the capture process prints once its socket receives."""
SNAPLEN = 262_144
"""The most bytes of one packet written (loopback's MTU is 65,536)."""
LINKTYPE_ETHERNET = 1
_MAGIC = 0xA1B2C3D4
_HEADER = struct.Struct("<IHHiIII")
_RECORD = struct.Struct("<IIII")
_ETH_P_ALL = 0x0003
_PACKET_OUTGOING = 4
_SOL_PACKET = 263
_PACKET_STATISTICS = 6
_RECEIVE_BUFFER = 64 << 20
_SO_RCVBUFFORCE = 33  # Linux; Python names no constant for it


@dataclass(frozen=True)
class CaptureStats:
    """What a capture process reports when it stops."""

    packets: int
    """Packets written to the file."""
    kernel_drops: int
    """Packets the kernel dropped before the capture read them (its buffer was full)."""
    truncated: int
    """Packets longer than `SNAPLEN`, written cut (a reader cannot reassemble them)."""


class PcapWriter:
    """A classic pcap file of the Ethernet link type, written record by record."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        stream.write(_HEADER.pack(_MAGIC, 2, 4, 0, 0, SNAPLEN, LINKTYPE_ETHERNET))

    def write(self, frame: bytes, timestamp: float, original_length: int | None = None) -> None:
        """One packet: ``frame`` (at most `SNAPLEN` bytes) and the length it had on the wire."""
        seconds = int(timestamp)
        micros = int((timestamp - seconds) * 1e6)
        length = len(frame) if original_length is None else original_length
        self.stream.write(_RECORD.pack(seconds, micros, len(frame), length))
        self.stream.write(frame)


def read_pcap(path: Path) -> Iterator[tuple[float, bytes]]:
    """Each packet of the classic pcap file at ``path``: (timestamp, Ethernet frame). Raises
    ValueError for another format or link type, a cut record, or a packet written truncated."""
    with open(path, "rb") as stream:
        header = stream.read(_HEADER.size)
        if len(header) != _HEADER.size or _HEADER.unpack(header)[0] != _MAGIC:
            raise ValueError(f"{path}: not a little-endian classic pcap file")
        linktype = _HEADER.unpack(header)[6]
        if linktype != LINKTYPE_ETHERNET:
            raise ValueError(f"{path}: link type {linktype}, expected Ethernet (1)")
        index = 0
        while record := stream.read(_RECORD.size):
            if len(record) != _RECORD.size:
                raise ValueError(f"{path}: packet {index}: its record header is cut")
            seconds, micros, included, original = _RECORD.unpack(record)
            frame = stream.read(included)
            if len(frame) != included:
                raise ValueError(f"{path}: packet {index}: cut at {len(frame)} of {included} bytes")
            if included != original:
                raise ValueError(
                    f"{path}: packet {index}: {original} bytes on the wire, {included} captured"
                )
            yield seconds + micros / 1e6, frame
            index += 1


def capture(out: Path) -> CaptureStats:
    """Capture every interface of this process's network namespace into ``out`` until SIGTERM
    or SIGINT, then drain the socket; prints `READY_LINE` first."""
    stopping: list[bool] = []

    def stop(_signum: int, _frame: FrameType | None) -> None:
        stopping.append(True)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, _RECEIVE_BUFFER)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER)
    sock.settimeout(0.1)
    buffer = bytearray(SNAPLEN)
    view = memoryview(buffer)
    packets = truncated = 0
    print(READY_LINE, flush=True)
    with open(out, "wb") as stream:
        writer = PcapWriter(stream)
        draining = False
        while True:
            if not draining and stopping:
                draining = True
                sock.setblocking(False)
            try:
                length, address = sock.recvfrom_into(buffer, 0, socket.MSG_TRUNC)
            except (TimeoutError, BlockingIOError, InterruptedError):
                if draining:
                    break
                continue
            interface, packet_type = address[0], address[2]
            if interface == "lo" and packet_type == _PACKET_OUTGOING:
                continue  # seen again arriving
            kept = min(length, SNAPLEN)
            truncated += kept < length
            writer.write(bytes(view[:kept]), time.time(), length)
            packets += 1
    _received, dropped = struct.unpack("II", sock.getsockopt(_SOL_PACKET, _PACKET_STATISTICS, 8))
    sock.close()
    return CaptureStats(packets=packets, kernel_drops=dropped, truncated=truncated)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m paramsync.runtime.testing.packet_capture OUT.pcap", file=sys.stderr)
        return 2
    stats = capture(Path(args[0]))
    print(json.dumps(stats.__dict__), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
