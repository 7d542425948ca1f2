"""Every frame tag of a captured run checked with its key log (docs/protocol.md section 5.5;
issue 39 row 10).

The checking is the document's, not paramsync's: `document_reader` runs section 8's Python code
(the frame reader and the tag check, written with cbor2 and cryptography alone) out of
docs/protocol.md, and `check_capture` follows section 5.5's text: for each TCP connection
(`paramsync.runtime.testing.tcp_streams`), the first frame of each direction (``hello``,
``challenge``) names the connection by its nonces, the key log's line with those nonces gives
its two direction keys, and every frame after each direction's second (``auth``, ``welcome``)
must carry a tag that verifies, counted from frame 0, to the last byte of the stream.

The run fails (`CaptureCheck.failures`) on: a connection with bytes that cannot be rebuilt
whole, one without a key log line, a frame whose tag does not verify, bytes left after the last
whole frame, and a key log line that no captured connection used (a connection of the run that
the capture missed). Connections that never carried a byte are counted, not checked: a dial
refused before the listener listened, or a port probe.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paramsync.runtime.testing.packet_capture import read_pcap
from paramsync.runtime.testing.tcp_streams import Connection, parse_frame, reassemble
from paramsync.runtime.transport.keylog import KEYLOG_LABEL

__all__ = [
    "CaptureCheck",
    "check_capture",
    "check_connection",
    "check_pcap",
    "document_reader",
    "parse_key_log",
]

Keys = dict[tuple[str, str], tuple[bytes, bytes]]
_LINE = re.compile(rf"{KEYLOG_LABEL}( [0-9a-f]{{64}}){{4}}")


def document_reader(protocol: Path) -> dict[str, Any]:
    """Section 8's Python code of the protocol document at ``protocol``, executed as written:
    its namespace (``read_frame``, ``TagCheck``, ``direction_key``, ``to_array``, ...)."""
    text = protocol.read_text(encoding="utf-8")
    start = text.index("## 8. Reading a frame")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"```python\n(.*?)```", text[start : end if end >= 0 else None], re.S)
    if len(blocks) != 1:
        raise ValueError(f"{protocol}: section 8 holds {len(blocks)} Python blocks, not one")
    namespace: dict[str, Any] = {}
    exec(compile(blocks[0], f"{protocol} section 8", "exec"), namespace)
    return namespace


def parse_key_log(text: str) -> Keys:
    """The key log's lines: (dialer's nonce, listener's nonce) in hex -> (k_dl, k_ld). Raises
    ValueError naming the first line that is not section 5.5's format."""
    keys: Keys = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not _LINE.fullmatch(line):
            raise ValueError(
                f"key log line {number} is not '{KEYLOG_LABEL} <4 x 64 hex>': {line!r:.80}"
            )
        _, nonce_d, nonce_l, k_dl, k_ld = line.split(" ")
        keys[nonce_d, nonce_l] = (bytes.fromhex(k_dl), bytes.fromhex(k_ld))
    return keys


def check_connection(
    to_listener: bytes,
    to_dialer: bytes,
    keys: Keys,
    reader: dict[str, Any],
    found: set[tuple[str, str]] | None = None,
) -> tuple[int, int]:
    """Check one connection's every tag, both ways: (frames read, tags verified); its nonces
    go into ``found`` once its key log line is found. Raises ValueError saying which direction
    and frame failed, or that no line has the connection's nonces."""
    dialer = _Way("dialer", to_listener, reader)
    listener = _Way("listener", to_dialer, reader)
    hello, challenge = dialer.expect("hello"), listener.expect("challenge")
    nonces = (bytes(hello["nonce"]).hex(), bytes(challenge["nonce"]).hex())
    if nonces not in keys:
        raise ValueError(f"no key log line for the nonces {nonces[0][:16]}.. / {nonces[1][:16]}..")
    if found is not None:
        found.add(nonces)
    dialer.expect("auth")
    listener.expect("welcome")
    tags = dialer.check_rest(keys[nonces][0]) + listener.check_rest(keys[nonces][1])
    return 4 + tags, tags


class _Way:
    """One direction's bytes, read frame by frame with the document's reader."""

    def __init__(self, name: str, data: bytes, reader: dict[str, Any]) -> None:
        self.name, self.data, self.reader = name, data, reader
        self.stream = io.BytesIO(data)

    def expect(self, kind: str) -> dict[str, Any]:
        """A handshake frame (no trailer) that must be of ``kind``."""
        message = self.read(None)
        if message.get("kind") != kind:
            raise ValueError(f"the {self.name}'s frame is {message.get('kind')!r}, not {kind!r}")
        return message

    def check_rest(self, key: bytes) -> int:
        """Read every later frame to the stream's end, each tag checked: how many."""
        check = self.reader["TagCheck"](key)
        while self.stream.tell() < len(self.data):
            self.read(check)
        return int(check.n)

    def read(self, check: Any) -> dict[str, Any]:
        """One frame; a frame cut by the stream's end is named as such."""
        at, data = self.stream.tell(), self.data
        if len(data) - at < 8:
            raise ValueError(f"the {self.name}'s stream ends {len(data) - at} bytes into a prefix")
        need = 8 + int.from_bytes(data[at : at + 4], "big") + (17 if check is not None else 0)
        if len(data) - at < need:
            raise ValueError(
                f"the {self.name}'s stream ends inside a frame ({len(data) - at} of {need} bytes)"
            )
        try:
            message = self.reader["read_frame"](self.stream, check)
        except ValueError as exc:
            raise ValueError(f"the {self.name}'s {exc}") from exc
        if not isinstance(message, dict):
            raise ValueError(f"the {self.name}'s frame at byte {at} is not a map")
        return message


@dataclass
class CaptureCheck:
    """`check_capture`'s counts, and every failure (the run is verified when there is none)."""

    connections: int = 0
    """TCP connections in the capture."""
    without_bytes: int = 0
    """Of them, those that never carried a byte (refused dials, port probes): not checked."""
    verified: int = 0
    """Connections whose every frame tag verified."""
    frames: int = 0
    tags_verified: int = 0
    key_log_lines: int = 0
    """Distinct lines of the key log (both ends may write a connection's line)."""
    by_listener: dict[str, int] = field(default_factory=dict)
    """Verified connections per listening address (``host:port``)."""
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures and self.verified > 0

    def summary(self) -> dict[str, Any]:
        return {
            "connections": self.connections,
            "connections_without_bytes": self.without_bytes,
            "connections_verified": self.verified,
            "frames": self.frames,
            "tags_verified": self.tags_verified,
            "key_log_lines": self.key_log_lines,
            "by_listener": self.by_listener,
            "failures": self.failures,
            "ok": self.ok,
        }


def check_capture(
    connections: Sequence[Connection], key_log: str, reader: dict[str, Any]
) -> CaptureCheck:
    """Check every tag of every captured connection with ``key_log`` (module doc)."""
    keys = parse_key_log(key_log)
    result = CaptureCheck(connections=len(connections), key_log_lines=len(keys))
    found: set[tuple[str, str]] = set()
    for connection in connections:
        to_listener, to_dialer, problems = connection.streams()
        if not to_listener and not to_dialer and not problems:
            result.without_bytes += 1
            continue
        name = connection.describe()
        if problems:
            result.failures.append(f"{name}: not captured whole: {'; '.join(problems)}")
            continue
        try:
            frames, tags = check_connection(to_listener, to_dialer, keys, reader, found)
        except ValueError as exc:
            result.failures.append(f"{name}: {exc}")
            continue
        result.verified += 1
        result.frames += frames
        result.tags_verified += tags
        listener = connection.listener_name
        result.by_listener[listener] = result.by_listener.get(listener, 0) + 1
    for nonce_d, nonce_l in sorted(set(keys) - found):
        result.failures.append(
            f"the key log's line for the nonces {nonce_d[:16]}.. / {nonce_l[:16]}.. matches no "
            f"captured connection (the capture missed a connection of the run)"
        )
    return result


def check_pcap(pcap: Path, key_log: str, reader: dict[str, Any]) -> CaptureCheck:
    """`check_capture` of every TCP connection in the pcap file ``pcap``."""
    segments = [s for _, frame in read_pcap(pcap) if (s := parse_frame(frame)) is not None]
    return check_capture(reassemble(segments), key_log, reader)
