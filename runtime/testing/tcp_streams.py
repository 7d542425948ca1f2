"""TCP connections rebuilt from captured packets: each direction's bytes in sequence order
(sans-I/O; `paramsync.runtime.testing.packet_capture` writes the packets).

`parse_frame` reads one Ethernet frame (IPv4 or IPv6, TCP; anything else is None) into a
`Segment`. `reassemble` sorts segments into connections and each direction's payload into
place by its sequence number, relative to the initial sequence number of that direction's SYN
(modulo 2**32): segments may come out of order, twice (a retransmission) or overlapping; an
overlap whose bytes differ from what is already in place is a conflict. A connection starts at
a SYN without ACK (the dialer's); a later SYN on the same addresses with another initial
sequence number starts the next connection (a reused port). What cannot be rebuilt whole is
named in the connection's ``problems``: a direction whose SYN was never seen, a hole in the
bytes, a conflict, data past the FIN. Never raises on what the packets say.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Connection", "Direction", "Segment", "parse_frame", "reassemble"]

Address = tuple[str, int]

FIN, SYN, RST, ACK = 0x01, 0x02, 0x04, 0x10
_ETHERTYPE_IPV4, _ETHERTYPE_IPV6, _ETHERTYPE_VLAN = 0x0800, 0x86DD, 0x8100
_TCP = 6
_MODULO = 1 << 32


@dataclass(frozen=True)
class Segment:
    """One TCP segment: where from, where to, its sequence number, flags and payload."""

    source: Address
    destination: Address
    seq: int
    flags: int
    payload: bytes = b""


def parse_frame(frame: bytes) -> Segment | None:
    """The TCP segment an Ethernet frame carries (IPv4, or IPv6 without extension headers);
    None for any other frame (ARP, UDP, ICMP, an IPv4 fragment) or one too short to hold it."""
    if len(frame) < 14:
        return None
    ethertype, offset = struct.unpack_from(">H", frame, 12)[0], 14
    if ethertype == _ETHERTYPE_VLAN and len(frame) >= 18:
        ethertype, offset = struct.unpack_from(">H", frame, 16)[0], 18
    if ethertype == _ETHERTYPE_IPV4 and len(frame) >= offset + 20:
        ihl = (frame[offset] & 0x0F) * 4
        total, fragment, protocol = struct.unpack_from(">H2xHxB", frame, offset + 2)
        if protocol != _TCP or fragment & 0x3FFF or ihl < 20:  # more-fragments, or an offset
            return None
        source = str(ipaddress.IPv4Address(frame[offset + 12 : offset + 16]))
        destination = str(ipaddress.IPv4Address(frame[offset + 16 : offset + 20]))
        tcp, end = offset + ihl, offset + total
    elif ethertype == _ETHERTYPE_IPV6 and len(frame) >= offset + 40:
        payload_length, next_header = struct.unpack_from(">HB", frame, offset + 4)
        if next_header != _TCP:
            return None
        source = str(ipaddress.IPv6Address(frame[offset + 8 : offset + 24]))
        destination = str(ipaddress.IPv6Address(frame[offset + 24 : offset + 40]))
        tcp, end = offset + 40, offset + 40 + payload_length
    else:
        return None
    if end > len(frame) or end < tcp + 20:
        return None
    sport, dport, seq, data_offset, flags = struct.unpack_from(">HHI4xBB", frame, tcp)
    start = tcp + (data_offset >> 4) * 4
    if start > end:
        return None
    return Segment((source, sport), (destination, dport), seq, flags, bytes(frame[start:end]))


@dataclass
class Direction:
    """One direction of a connection: its initial sequence number and its payload pieces."""

    isn: int | None = None
    fin_at: int | None = None
    """The FIN's offset in the stream (its byte count), once seen."""
    pieces: list[tuple[int, bytes]] = field(default_factory=list)
    early: int = 0
    """Segments with payload that came before this direction's SYN was seen."""

    def add(self, segment: Segment) -> None:
        if segment.flags & SYN:
            self.isn = segment.seq
            return
        if self.isn is None:
            self.early += bool(segment.payload)
            return
        offset = (segment.seq - self.isn - 1) % _MODULO
        if segment.payload:
            self.pieces.append((offset, segment.payload))
        if segment.flags & FIN:
            self.fin_at = offset + len(segment.payload)

    def assemble(self, name: str) -> tuple[bytes, list[str]]:
        """The direction's bytes, in order, and what stops them being whole (``name``: how
        the problems call this direction)."""
        problems: list[str] = []
        if self.isn is None:
            if self.early:
                problems.append(f"{name}: {self.early} segments with data, and no SYN seen")
            return b"", problems
        data = bytearray()
        for offset, payload in sorted(self.pieces, key=lambda piece: piece[0]):
            if offset > len(data):
                problems.append(f"{name}: bytes {len(data)}..{offset - 1} never captured")
                data.extend(bytes(offset - len(data)))
            overlap = min(len(data) - offset, len(payload))
            if overlap > 0 and data[offset : offset + overlap] != payload[:overlap]:
                problems.append(
                    f"{name}: a retransmission at byte {offset} differs from the bytes "
                    f"already there"
                )
            data.extend(payload[max(overlap, 0) :])
        if self.fin_at is not None and len(data) > self.fin_at:
            problems.append(f"{name}: {len(data) - self.fin_at} bytes past the FIN")
        return bytes(data), problems


@dataclass
class Connection:
    """One TCP connection: the dialer (whose SYN opened it), the listener, and both ways."""

    dialer: Address
    listener: Address
    to_listener: Direction = field(default_factory=Direction)
    to_dialer: Direction = field(default_factory=Direction)
    reset: bool = False
    """A RST was seen (either way)."""

    @property
    def established(self) -> bool:
        """Both SYNs seen: the listener answered."""
        return self.to_listener.isn is not None and self.to_dialer.isn is not None

    def streams(self) -> tuple[bytes, bytes, list[str]]:
        """(the dialer's bytes, the listener's bytes, every problem of either direction)."""
        sent, problems = self.to_listener.assemble(f"{_name(self.dialer)} -> listener")
        answered, more = self.to_dialer.assemble(f"{_name(self.listener)} -> dialer")
        return sent, answered, problems + more

    def describe(self) -> str:
        """``dialer -> listener``, each as ``host:port``."""
        return f"{_name(self.dialer)} -> {_name(self.listener)}"

    @property
    def listener_name(self) -> str:
        """The listener as ``host:port`` (``[host]:port`` for IPv6)."""
        return _name(self.listener)


def reassemble(segments: Iterable[Segment]) -> list[Connection]:
    """Every connection the segments belong to, in the order their first segment came."""
    connections: list[Connection] = []
    current: dict[tuple[Address, Address], Connection] = {}
    for segment in segments:
        forward = (segment.source, segment.destination)
        connection = current.get(forward) or current.get((segment.destination, segment.source))
        opening = segment.flags & SYN and not segment.flags & ACK
        if opening and (connection is None or _another_syn(connection, segment)):
            connection = Connection(segment.source, segment.destination)
            connections.append(connection)
            current[forward] = connection
        elif connection is None:  # its SYN was never seen: the dialer is a guess
            connection = Connection(segment.source, segment.destination)
            connections.append(connection)
            current[forward] = connection
        if (segment.source, segment.destination) == (connection.dialer, connection.listener):
            connection.to_listener.add(segment)
        else:
            connection.to_dialer.add(segment)
        connection.reset |= bool(segment.flags & RST)
    return connections


def _another_syn(connection: Connection, segment: Segment) -> bool:
    """A dialer's SYN that opens a new connection on ``connection``'s addresses (not its
    retransmission)."""
    isn = connection.to_listener.isn
    return segment.source != connection.dialer or (isn is not None and isn != segment.seq)


def _name(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
