"""Decoding limits: how large a frame of each message kind may be, and how many CBOR items a
frame may expand into, checked on the raw bytes BEFORE the item is decoded (sans-I/O).

cbor2 decodes a whole item at once, and a one-byte CBOR item (an empty array) becomes a Python
object of about 72 bytes, so an unchecked frame amplifies memory and decode time. Two bounds
stop that: a per-kind frame cap derived from the kind's declared schema (``kind_max_frame``),
enforced from a cheap peek at the item's first map entries (``"v"`` then ``"kind"``,
docs/protocol.md §2), and a bound on the number of items a frame may hold (``count_items``),
scanned only for frames large enough for it to matter.
"""

from __future__ import annotations

import functools
import struct
from typing import Any

from paramsync.runtime.errors import FrameTooLarge, ProtocolError
from paramsync.runtime.protocol.messages import KINDS
from paramsync.runtime.protocol.schema import (
    Bool,
    Bytes,
    Either,
    Float,
    Int,
    Map,
    Record,
    Seq,
    Str,
    Tensor,
    schema,
)

__all__ = [
    "CONTROL_MAX_FRAME",
    "BULK_MAX_FRAME",
    "MAX_ITEMS",
    "SCAN_THRESHOLD",
    "kind_max_frame",
    "peek_kind",
    "PEEK_SIZE",
    "check_kind_size",
    "check_kind_accepted",
    "count_items",
    "INLINE_TENSOR_MAX",
    "BULK_KINDS",
    "check_bulk_kind",
]

CONTROL_MAX_FRAME = 16 * 1024
"""Smallest cap any kind gets: a control message's head fits in a few KiB."""
BULK_MAX_FRAME = 64 * 1024 * 1024
"""Cap of kinds whose declared size is unbounded (a map, an inline tensor) or larger."""
MAX_ITEMS = 1 << 18
"""Most CBOR data items one frame may hold (about 19 MiB of Python objects at worst)."""
SCAN_THRESHOLD = 64 * 1024
"""Heads at most this long skip the item scan: they cannot hold more than this many items."""
INLINE_TENSOR_MAX = 12 * 1024
"""Most bytes a tensor field may take inline (within the head). A tensor of any size travels
as its frame's bulk, outside the head (`paramsync.runtime.protocol.wire`): senders inline only empty
ones, so a kind whose only unbounded field is its tensor gets a control-sized head cap."""

_HEAD = 9  # the longest CBOR head: initial byte + 8-byte argument


def _bound(wtype: Any) -> int | None:
    """Upper bound of a value's encoded size in bytes, or None when the schema sets none."""
    if isinstance(wtype, Int | Float | Bool):
        return _HEAD
    if isinstance(wtype, Str):
        return _HEAD + 4 * wtype.max_len
    if isinstance(wtype, Bytes):
        return _HEAD + wtype.max_len
    if isinstance(wtype, Seq):
        item = _bound(wtype.item)
        return None if item is None else _HEAD + wtype.max_len * item
    if isinstance(wtype, Record):  # Spread too
        total = _HEAD
        for _label, part in wtype.parts:
            size = _bound(part)
            if size is None:
                return None
            total += size
        return total
    if isinstance(wtype, Either):
        sizes = [_bound(option) for option in wtype.options]
        return None if None in sizes else max(sizes)  # type: ignore[type-var]
    if isinstance(wtype, Tensor):
        return _HEAD + INLINE_TENSOR_MAX
    if isinstance(wtype, Map):
        return None
    return None


@functools.cache
def kind_max_frame(kind: str) -> int:
    """Largest CBOR head (bulk bytes excluded) a frame of ``kind`` may announce.

    The sum of the declared fields' bounds, between `CONTROL_MAX_FRAME` and `BULK_MAX_FRAME`.
    """
    spec = schema(KINDS[kind])
    total = 64  # map head, "v", "kind" and the kind's name
    for slot in spec.slots:
        wtype = slot[2]
        size = _bound(wtype)
        if size is None:
            return BULK_MAX_FRAME
        total += size + _HEAD + 4 * len(slot[1])  # value + its key (spread parts: generous)
        if total >= BULK_MAX_FRAME:
            return BULK_MAX_FRAME
    return max(CONTROL_MAX_FRAME, total)


_TEXT_V = b"\x61v"
_TEXT_KIND = b"\x64kind"


def peek_kind(head: bytes | bytearray | memoryview) -> str | None:
    """The message kind named by an item's first entries, without decoding the item.

    A frame's item is a map whose first two entries are ``"v"`` (a small int) and ``"kind"``
    (a text string naming a known kind); None when the head does not open that way (such a
    frame is then held to `CONTROL_MAX_FRAME`, and the decoder names what is wrong with it).
    """
    lead = bytes(memoryview(head).cast("B")[:PEEK_SIZE])  # one copy; the rest is bytes ops
    if not lead or lead[0] >> 5 != 5:
        return None
    pos = 1 + _MAP_ARGUMENT.get(lead[0] & 0x1F, 0)
    if not lead.startswith(_TEXT_V, pos):
        return None
    pos += 2
    if pos >= len(lead) or lead[pos] > 0x17:  # "v": a small unsigned int
        return None
    pos += 1
    if not lead.startswith(_TEXT_KIND, pos):
        return None
    pos += 5
    if pos >= len(lead) or lead[pos] >> 5 != 3 or lead[pos] & 0x1F >= 24:
        return None
    length, pos = lead[pos] & 0x1F, pos + 1
    kind = lead[pos : pos + length].decode("utf-8", errors="replace")
    return kind if kind in KINDS else None


_MAP_ARGUMENT = {24: 1, 25: 2, 26: 4, 27: 8}
"""A CBOR map head's extra argument bytes, by its additional information."""


PEEK_SIZE = 48
"""Bytes of a head that `peek_kind` needs at most (map head, "v", its value, "kind", name)."""


def check_kind_size(
    head: bytes | bytearray | memoryview, head_len: int | None = None
) -> str | None:
    """Peek the kind of a frame's head and refuse a head longer than that kind's cap (a head
    that does not open with ``"v"`` and a known ``"kind"``: longer than `CONTROL_MAX_FRAME`).

    ``head`` may be only the head's first `PEEK_SIZE` bytes when ``head_len`` gives the
    announced length, so a reader refuses an oversized head before reading it."""
    size = len(head) if head_len is None else head_len
    kind = peek_kind(head)
    cap = CONTROL_MAX_FRAME if kind is None else kind_max_frame(kind)
    if size > cap:
        what = "a frame not led by 'v' and a known 'kind'" if kind is None else f"{kind} frame"
        raise FrameTooLarge(f"{what} of {size} bytes exceeds the {cap}-byte cap of its kind")
    return kind


def check_kind_accepted(head: bytes | bytearray | memoryview, kinds: frozenset[str]) -> str:
    """Peek the kind of a frame's head (its first `PEEK_SIZE` bytes suffice) and refuse it
    unless it is one of ``kinds``: a read that accepts only some kinds (a coordinator before the
    peer has joined) refuses any other before its head is read."""
    kind = peek_kind(head)
    if kind is None or kind not in kinds:
        what = "a frame not led by 'v' and a known 'kind'" if kind is None else f"a {kind} frame"
        raise ProtocolError(f"sent {what} where only {', '.join(sorted(kinds))} is accepted")
    return kind


BULK_KINDS = frozenset(
    kind
    for kind, cls in KINDS.items()
    if any(slot[1] == "data" and isinstance(slot[2], Tensor) for slot in schema(cls).slots)
)
"""The kinds that may carry a bulk (a tensor field ``data``): any other frame that announces
bulk bytes is refused from its prefix and the peek at its kind, before they are read."""


def check_bulk_kind(kind: str | None, bulk_len: int) -> None:
    """Refuse a frame that announces ``bulk_len`` > 0 bulk bytes but whose head (peeked:
    `peek_kind`) does not name a kind that carries one."""
    if bulk_len and kind not in BULK_KINDS:
        what = "a frame not led by 'v' and a known 'kind'" if kind is None else f"a {kind} frame"
        raise ProtocolError(f"{what} announces {bulk_len} bulk bytes; its kind carries none")


_ARG = {
    24: struct.Struct(">B"),
    25: struct.Struct(">H"),
    26: struct.Struct(">I"),
    27: struct.Struct(">Q"),
}


def count_items(head: bytes | bytearray | memoryview, limit: int = MAX_ITEMS) -> int:
    """Count the CBOR data items of ``head`` (one definite-length item and what it nests),
    refusing more than ``limit`` of them before anything is decoded.

    Strings are skipped by their length, so the scan costs one step per item. Malformed or
    truncated input stops the scan; the decoder then names the problem.
    """
    view = memoryview(head).cast("B") if not isinstance(head, bytes) else head
    end = len(view)
    pos = 0
    count = 0
    pending = 1  # items still to read
    while pending and pos < end:
        pending -= 1
        count += 1
        if count > limit:
            raise ProtocolError(f"frame holds more than {limit} CBOR data items")
        initial = view[pos]
        major, info = initial >> 5, initial & 0x1F
        pos += 1
        if info < 24:
            arg = info
        elif info <= 27:
            fmt = _ARG[info]
            if pos + fmt.size > end:
                break
            (arg,) = fmt.unpack_from(view, pos)
            pos += fmt.size
        else:
            break  # indefinite lengths and reserved values: the decoder refuses them
        if major == 2 or major == 3:
            pos += arg
        elif major == 4:
            pending += arg
        elif major == 5:
            pending += 2 * arg
        elif major == 6:
            pending += 1
        if pending > limit:
            raise ProtocolError(f"frame announces more than {limit} CBOR data items")
    return count
