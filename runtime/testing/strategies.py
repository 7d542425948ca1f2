"""Hypothesis strategies for paramsync's wire protocol: messages, frames and tensors.

Everything here is drawn from the one declaration of the protocol: the message classes of
`paramsync.runtime.protocol.messages` (``KINDS``) and the field types of
`paramsync.runtime.protocol.schema`, so a new kind or field is covered without touching this module.

Valid by construction:

- `wire_value` (a field type's values as they travel), `wire_fields` (a kind's field map,
  its invariants kept), `instances` (a message object built as a sender builds it);
- `valid_frames` (whole frames of every kind, ready for a socket);
- `tensors` (every dtype the wire carries, every shape up to a size, arbitrary bit patterns).

Hostile: `hostile_frames` draws a `Frame` that a receiver must refuse (or wait on without
harm): truncated, oversized, an unknown kind, a wrong version, garbage, and hostile CBOR (deep
nesting, huge announced lengths, forbidden tags, typed arrays where none may be). On an
authenticated connection, `seal_modes` says how the frame's authentication tag is spoiled
(a wrong tag, a flipped bit, none at all).

Use them in your own tests::

    from hypothesis import given
    from paramsync.runtime.testing.strategies import hostile_frames

    @given(hostile_frames())
    def test_my_proxy_passes_refusals(frame): ...

torch is imported only when a tensor is drawn (a coordinator's tests never need it).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import cbor2
from hypothesis import strategies as st

from paramsync.runtime.protocol import messages
from paramsync.runtime.protocol.schema import (
    PROTOCOL_VERSION,
    Bool,
    Bytes,
    Either,
    Float,
    Int,
    Map,
    Record,
    Seq,
    Spread,
    Str,
    Tensor,
    WireField,
    WireType,
    schema,
)
from paramsync.runtime.protocol.wire import MAX_DEPTH, PREFIX_SIZE, TAG_SIZE

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPE_NAMES",
    "Frame",
    "SEAL_MODES",
    "frame_bytes",
    "hostile_frames",
    "instances",
    "key_types",
    "layouts",
    "random_tensor",
    "seal_modes",
    "spoil",
    "tensors",
    "valid_frames",
    "wire_fields",
    "wire_value",
]

DTYPE_NAMES = (
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
    "bfloat16",
)
"""Every element type a tensor travels as (torch's names; `paramsync.runtime.protocol.wire`'s
tags)."""


def random_tensor(dtype: torch.dtype | str, shape: Sequence[int], seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, -0.0, subnormals included) of ``dtype`` (a torch
    dtype or its name) and ``shape``; the same seed gives the same bits."""
    import torch

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    assert isinstance(dtype, torch.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(tuple(shape))


def tensors(
    dtypes: Sequence[str] = DTYPE_NAMES, *, max_dims: int = 2, max_side: int = 3
) -> st.SearchStrategy[torch.Tensor]:
    """Tensors of every dtype in ``dtypes`` (default: all the wire carries) and every shape of
    at most ``max_dims`` dimensions of at most ``max_side`` elements each (0-d and empty
    tensors included), holding arbitrary bit patterns."""
    return st.builds(
        random_tensor,
        st.sampled_from(tuple(dtypes)),
        st.lists(st.integers(0, max_side), max_size=max_dims).map(tuple),
        st.integers(0, 100),
    )


def wire_value(ftype: WireType) -> st.SearchStrategy[Any]:
    """Valid values of ``ftype`` as they travel (lists, not tuples)."""
    if isinstance(ftype, Bool):
        return st.booleans()
    if isinstance(ftype, Int):
        high = ftype.hi if ftype.hi is not None else 2**64 - 1
        return st.integers(ftype.lo, high)
    if isinstance(ftype, Float):
        return st.floats(min_value=ftype.lo, allow_nan=False)
    if isinstance(ftype, Str):
        return st.text(min_size=ftype.min_len, max_size=min(ftype.max_len, 40))
    if isinstance(ftype, Bytes):
        return st.binary(max_size=min(ftype.max_len, 64))
    if isinstance(ftype, Seq):
        return st.lists(wire_value(ftype.item), max_size=min(ftype.max_len, 4))
    if ftype is messages.LAYOUT:
        return layouts()
    if isinstance(ftype, Record):  # Spread included: its elements as a list
        return st.tuples(*(wire_value(part) for _, part in ftype.parts)).map(list)
    if isinstance(ftype, Either):
        return st.one_of(*(wire_value(option) for option in ftype.options))
    if isinstance(ftype, Tensor):
        return tensors()
    if isinstance(ftype, Map):
        return st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**63 - 1), max_size=3)
    raise TypeError(f"no strategy for {ftype!r}")


@st.composite
def layouts(draw: st.DrawFn) -> list[Any]:
    """A valid parallel layout as it travels: distinct names, one size and one coordinate
    (below its size) per name, a schedule digest."""
    names = draw(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=4, unique=True))
    sizes = draw(st.lists(st.integers(1, 8), min_size=len(names), max_size=len(names)))
    coordinates = [draw(st.integers(0, size - 1)) for size in sizes]
    return [names, sizes, coordinates, draw(st.binary(max_size=messages.MAX_DIGEST))]


def key_types(cls: type) -> dict[str, tuple[tuple[WireType, ...], bool]]:
    """Wire key -> (the types it may hold, whether a frame must carry it)."""
    spec = schema(cls)
    out: dict[str, tuple[tuple[WireType, ...], bool]] = {}
    for _name, key, ftype, optional, _omit in spec.slots:
        if isinstance(ftype, Spread):
            for label, part in ftype.parts:
                out[label] = ((part,), True)
            continue
        types, required = out.get(key, ((), False))
        out[key] = ((*types, ftype), required or not optional)
    return out


def _start_run_fields(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 4))
    address = wire_value(messages.ADDRESS)
    addresses = draw(st.lists(address, min_size=n, max_size=n))
    members = draw(st.lists(st.integers(0, 1 << 16), min_size=n, max_size=n, unique=True))
    donor = draw(st.sampled_from([-1, *members]))
    others = [m for m in members if m != donor]
    receivers = (
        draw(st.lists(st.sampled_from(others), unique=True)) if others and donor >= 0 else []
    )
    fields = {
        "addresses": addresses,
        "ring": draw(st.permutations(list(range(n)))),
        "step": draw(wire_value(messages.STEP)),
        "digest_interval": draw(st.integers(1, 2**63 - 1)),
        "heartbeat_deadline": draw(st.floats(min_value=0.0, allow_nan=False)),
        "epoch": draw(wire_value(messages.EPOCH)),
        "members": members,
        "donor": donor,
        "receivers": receivers,
        "broadcast": draw(st.booleans()),
        "apply_barrier": draw(st.booleans()),
    }
    if draw(st.booleans()):
        fields["fold"] = draw(st.booleans())
    if draw(st.booleans()):
        fields["groups"] = [
            [name, ranks, draw(st.lists(address, min_size=len(ranks), max_size=len(ranks)))]
            for name in draw(
                st.lists(wire_value(messages.GROUP_NAME), min_size=1, max_size=3, unique=True)
            )
            for ranks in [draw(st.lists(st.integers(0, 1 << 16), max_size=4, unique=True))]
        ]
    return fields


def _digest_fields(draw: st.DrawFn) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "epoch": draw(wire_value(messages.EPOCH)),
        "step": draw(wire_value(messages.STEP)),
        "digest": draw(wire_value(messages.DIGEST)),
    }
    if draw(st.booleans()):
        fields["tensors"] = draw(
            wire_value(schema(messages.Digest).groups["tensors"][0][2])  # the pairs
        )
    else:
        count = draw(st.integers(0, 4))
        size = draw(st.integers(1, messages.MAX_DIGEST))
        fields["tensors"] = draw(st.binary(min_size=count * size, max_size=count * size))
        if draw(st.booleans()):
            names = st.text(min_size=1, max_size=12)
            fields["names"] = draw(st.lists(names, min_size=count, max_size=count))
    if draw(st.booleans()):
        fields["cached"] = draw(wire_value(messages.CACHED))
    return fields


@st.composite
def wire_fields(draw: st.DrawFn, cls: type) -> dict[str, Any]:
    """A valid field map of ``cls``'s kind, invariants included (without ``v`` and ``kind``)."""
    if cls is messages.StartRun:
        return _start_run_fields(draw)
    if cls is messages.Digest:
        return _digest_fields(draw)
    fields: dict[str, Any] = {}
    for key, (types, required) in key_types(cls).items():
        if required or draw(st.booleans()):
            fields[key] = draw(st.one_of(*(wire_value(t) for t in types)))
    return fields


@st.composite
def instances(draw: st.DrawFn, cls: type) -> Any:
    """A valid ``cls`` message built by its constructor, from attribute values drawn as a
    sender would give them (locals included: a rank, a clock reading)."""
    if cls in (messages.StartRun, messages.Digest):
        fields = draw(wire_fields(cls))
        context: dict[str, Any] = {}
        if cls is messages.Digest:
            context["rank"] = draw(st.integers(0, 1 << 16))
        return cls(**_attributes(cls, fields), **context)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        spec: WireField = f.metadata["wire"]
        if spec.local:
            if f.name in ("rank", "host"):  # a worker's rank, a host's index at the root
                kwargs[f.name] = draw(st.integers(0, 1 << 16))
            elif f.name == "now":
                kwargs[f.name] = draw(st.floats(allow_nan=False))
            continue
        assert spec.type is not None
        if f.default is not dataclasses.MISSING and draw(st.booleans()):
            continue  # the default
        kwargs[f.name] = draw(wire_value(spec.type))
    return cls(**kwargs)


def _attributes(cls: type, fields: dict[str, Any]) -> dict[str, Any]:
    """Constructor arguments from a kind's wire fields (for kinds whose attributes share or
    spread wire keys)."""
    if cls is messages.Digest:
        out = {k: v for k, v in fields.items() if k != "tensors"}
        if isinstance(fields["tensors"], bytes):
            out["packed"] = fields["tensors"]
        else:
            out["tensor_digests"] = fields["tensors"]
        return out
    return dict(fields)


# --------------------------------------------------------------------------- frames


@dataclasses.dataclass(frozen=True)
class Frame:
    """Bytes to put on a connection, and what they are."""

    label: str
    """What the bytes are, in a few words (``valid heartbeat``, ``deep nesting (40)``)."""
    data: bytes
    """The frame: 8-byte prefix, then the CBOR item (no authentication trailer)."""
    kind: str | None = None
    """The message kind the item names (None when it names none of `KINDS`)."""
    complete: bool = True
    """Whether ``data`` is a whole frame: a receiver has everything it announced, so it must
    decide now (False: truncated or announcing more than it carries; a receiver may wait)."""
    valid: bool = False
    """Whether the item is a valid message of ``kind`` (`paramsync.runtime.protocol.messages`)."""


def frame_bytes(item: bytes, bulk_len: int = 0) -> bytes:
    """A frame around an encoded CBOR item: the prefix announcing its length, then the item."""
    return struct.pack(">II", len(item), bulk_len) + item


def _head(kind: str, extra: int, version: int = PROTOCOL_VERSION) -> bytes:
    """The start of a CBOR map of ``2 + extra`` entries: ``v`` and ``kind``, its other entries
    to follow."""
    entries = 2 + extra
    assert entries < 24
    return (
        bytes([0xA0 | entries])
        + cbor2.dumps("v")
        + cbor2.dumps(version)
        + cbor2.dumps("kind")
        + cbor2.dumps(kind)
    )


def _with_raw_field(kind: str, key: str, raw_value: bytes) -> bytes:
    """An item of ``kind`` with one field ``key`` whose value is the raw CBOR ``raw_value``."""
    return _head(kind, 1) + cbor2.dumps(key) + raw_value


_KIND_NAMES = tuple(sorted(messages.KINDS))


@st.composite
def valid_frames(
    draw: st.DrawFn, kinds: Sequence[str] | None = None, *, tensors: bool = True
) -> Frame:
    """A whole, valid frame of one of ``kinds`` (default: every kind `KINDS` declares); with
    ``tensors`` false, kinds whose fields hold a tensor are left out (torch is never imported)."""
    from paramsync.runtime.protocol.wire import encode_frame_bytes

    names = tuple(kinds) if kinds is not None else _KIND_NAMES
    if not tensors:
        names = tuple(k for k in names if not _holds_tensor(messages.KINDS[k]))
    if not names:
        raise ValueError("valid_frames: no kind left to draw from")
    kind = draw(st.sampled_from(names))
    fields = draw(wire_fields(messages.KINDS[kind]))
    return Frame(f"valid {kind}", encode_frame_bytes(kind, fields), kind, valid=True)


def _holds_tensor(cls: type) -> bool:
    def walk(ftype: WireType) -> bool:
        if isinstance(ftype, Tensor):
            return True
        if isinstance(ftype, Seq):
            return walk(ftype.item)
        if isinstance(ftype, Record):
            return any(walk(part) for _, part in ftype.parts)
        if isinstance(ftype, Either):
            return any(walk(option) for option in ftype.options)
        return False

    return any(walk(t) for types, _ in key_types(cls).values() for t in types)


_FORBIDDEN_TAGS = {
    0: cbor2.dumps("2026-01-01T00:00:00Z"),  # a date/time string
    1: cbor2.dumps(0),  # an epoch date
    2: cbor2.dumps(b"\x01" * 9),  # a bignum
    28: cbor2.dumps(1),  # a shared value (a reference cycle's start)
    29: cbor2.dumps(0),  # a reference to a shared value
    52: cbor2.dumps(b"\x0a\x00\x00\x01"),  # an IPv4 address
    54: cbor2.dumps(bytes(16)),  # an IPv6 address
    258: cbor2.dumps([1, 2]),  # a set
    85: cbor2.dumps(b"\x00\x00\x80\x3f"),  # a bare float32 typed array
    40: cbor2.dumps([[1], cbor2.CBORTag(85, b"\x00\x00\x80\x3f")]),  # an inline tensor
    55799: cbor2.dumps(0),  # the self-described CBOR marker
    999: cbor2.dumps(0),  # a tag nobody declares
}
"""Tags a peer might slip into a field, each with a value it would take."""


def _tag_bytes(tag: int) -> bytes:
    return cbor2.dumps(cbor2.CBORTag(tag, None))[:-1]  # the tag's head only


@st.composite
def hostile_frames(draw: st.DrawFn, kinds: Sequence[str] | None = None) -> Frame:
    """A frame a receiver must refuse, or may wait on: one of

    - ``truncated``: a valid frame cut short (the receiver may wait for the rest);
    - ``oversized``: a prefix announcing more than any receiver accepts (up to 4 GiB);
    - ``unknown kind``, ``wrong version``, ``not a map``, ``garbage``;
    - ``deep nesting``: arrays nested past `paramsync.runtime.protocol.wire.MAX_DEPTH` (up to
      10,000);
    - ``huge length``: an array, map, byte or text string announcing up to 2**64 - 1 elements;
    - ``forbidden tag``: a date, bignum, shared reference, IP address, set, typed array,
      self-describe marker or unknown tag as a field's value;
    - ``bad bulk``: a prefix announcing bulk bytes that are not the item's last typed array.

    ``kinds`` (default: all) are the kinds the well-formed parts name.
    """
    names = tuple(kinds) if kinds is not None else _KIND_NAMES
    kind = draw(st.sampled_from(names))
    what = draw(
        st.sampled_from(
            (
                "truncated",
                "oversized",
                "unknown kind",
                "wrong version",
                "not a map",
                "garbage",
                "deep nesting",
                "huge length",
                "forbidden tag",
                "bad bulk",
            )
        )
    )
    if what == "truncated":
        whole = draw(valid_frames(names, tensors=False)).data
        cut = draw(st.integers(1, len(whole) - 1))
        return Frame(f"truncated {kind} ({cut} of {len(whole)} bytes)", whole[:cut], None, False)
    if what == "oversized":
        size = draw(st.integers(64 * 1024 * 1024 + 1, 2**32 - 1))
        return Frame(
            f"oversized ({size} bytes announced)", struct.pack(">II", size, 0), None, False
        )
    if what == "unknown kind":
        name = draw(st.text(min_size=1, max_size=20).filter(lambda k: k not in messages.KINDS))
        return Frame("unknown kind", frame_bytes(_head(name, 0)))
    if what == "wrong version":
        version = draw(st.integers(0, 2**16).filter(lambda v: v != PROTOCOL_VERSION))
        return Frame(f"wrong version {kind}", frame_bytes(_head(kind, 0, version)), kind)
    if what == "not a map":
        item = cbor2.dumps(draw(st.one_of(st.integers(), st.text(max_size=8), st.binary())))
        return Frame("not a map", frame_bytes(item))
    if what == "garbage":
        body = draw(st.binary(min_size=1, max_size=256))
        return Frame("garbage", frame_bytes(body))
    if what == "deep nesting":
        depth = draw(st.integers(MAX_DEPTH + 1, 10_000))
        raw = b"\x81" * depth + b"\x00"
        return Frame(f"deep nesting ({depth})", frame_bytes(_with_raw_field(kind, "x", raw)), kind)
    if what == "huge length":
        major = draw(st.sampled_from((0x40, 0x60, 0x80, 0xA0)))  # bytes, text, array, map
        length = draw(st.integers(2**20, 2**64 - 1))
        raw = bytes([major | 27]) + length.to_bytes(8, "big") + draw(st.binary(max_size=16))
        label = f"huge length ({length} announced)"
        return Frame(label, frame_bytes(_with_raw_field(kind, "x", raw)), kind)
    if what == "forbidden tag":
        tag = draw(st.sampled_from(sorted(_FORBIDDEN_TAGS)))
        key = draw(st.sampled_from(("x", *key_types(messages.KINDS[kind]))))
        raw = _tag_bytes(tag) + _FORBIDDEN_TAGS[tag]
        return Frame(f"forbidden tag {tag}", frame_bytes(_with_raw_field(kind, key, raw)), kind)
    # bad bulk: the prefix claims bulk bytes the item does not end with as a typed array
    item = _head(kind, 0)
    bulk = draw(st.integers(1, len(item)))
    return Frame(
        f"bad bulk ({bulk} of {len(item)})", struct.pack(">II", len(item), bulk) + item, kind
    )


SEAL_MODES = ("sealed", "wrong tag", "flipped bit", "bad trailer", "unsealed")
"""How a frame leaves on an authenticated connection: with its tag (``sealed``), with 16
random bytes as its tag, with one bit of the frame or tag flipped after sealing, with a
trailer that is no 16-byte byte string, or with no trailer at all."""


def seal_modes(*, forged_only: bool = False) -> st.SearchStrategy[str]:
    """One of `SEAL_MODES` (``forged_only``: every one but ``sealed``)."""
    return st.sampled_from(SEAL_MODES[1:] if forged_only else SEAL_MODES)


def spoil(
    frame: bytes, trailer: bytes, mode: str, *, tag: bytes = bytes(TAG_SIZE), bit: int = 0
) -> bytes:
    """``frame`` followed by ``trailer`` (its genuine tag trailer), spoiled as ``mode`` says
    (one of `SEAL_MODES`): ``tag`` is the wrong tag (changed if it happens to be right),
    ``bit`` the bit to flip, counted from the end of the prefix (modulo what follows it)."""
    if mode == "sealed":
        return frame + trailer
    if mode == "unsealed":
        return frame
    if mode == "wrong tag":
        if len(tag) != TAG_SIZE:
            raise ValueError(f"a wrong tag is {TAG_SIZE} bytes too, got {len(tag)}")
        tag = tag if tag != trailer[1:] else bytes(b ^ 1 for b in tag)
        return frame + trailer[:1] + tag
    if mode == "bad trailer":
        return frame + b"\x40" + trailer[1:]  # an empty byte string, then 16 stray bytes
    if mode == "flipped bit":
        whole = bytearray(frame + trailer)
        # never in the prefix: a changed length would make the receiver wait, not decide
        bit %= (len(whole) - PREFIX_SIZE) * 8
        whole[PREFIX_SIZE + bit // 8] ^= 1 << (bit % 8)
        return bytes(whole)
    raise ValueError(f"unknown seal mode {mode!r}; expected one of {', '.join(SEAL_MODES)}")
