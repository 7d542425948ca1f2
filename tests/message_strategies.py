"""Hypothesis strategies derived from the message declarations of `runtime.protocol.messages`.

`wire_value` draws valid CBOR-form values of a field type; `wire_fields` draws a kind's valid
field map (what a frame carries, before the envelope); `instances` draws valid messages of a
kind (a dataclass instance, built the way a sender builds it). Kinds whose fields constrain
each other (`StartRun`, `Digest`) get strategies that respect their invariants.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from hypothesis import strategies as st

from runtime.protocol import messages
from runtime.protocol.schema import (
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

DTYPES = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, -0.0, subnormals included) of the given dtype."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


tensors = st.builds(
    random_tensor,
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 3), max_size=2).map(tuple),
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
        return tensors
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
    for name, key, ftype, optional, _omit in spec.slots:
        if isinstance(ftype, Spread):
            for label, part in ftype.parts:
                out[label] = ((part,), True)
            continue
        types, required = out.get(key, ((), False))
        out[key] = ((*types, ftype), required or not optional)
        del name
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
        context = {"rank": draw(st.integers(0, 1 << 16))} if cls is messages.Digest else {}
        return cls(**_attributes(cls, fields), **context)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        spec: WireField = f.metadata["wire"]
        if spec.local:
            if f.name == "rank":
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
