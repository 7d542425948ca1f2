"""Field types and the one generic codec for wire messages declared as frozen dataclasses.

A message kind is a frozen dataclass deriving from :class:`WireMessage`, with a ``KIND`` class
variable (the ``kind`` its frames carry) and one :func:`wire` (or :func:`local`) field per
attribute; the field's :class:`WireType` says which values it takes (type, range, length,
nesting) and how it looks in CBOR. From that declaration alone:

- :func:`encode` turns an instance into the ``(kind, fields)`` pair a frame carries;
- :func:`decode` turns a decoded CBOR map into a validated instance, or raises
  :class:`~paramsync.runtime.errors.ProtocolError` naming the kind, the field (with its path inside
  nested values) and the peer;
- :func:`check_item` checks a map without building an instance (transports that hand maps
  around, such as the ring's data frames).

Fields that never travel (the rank a report came from, the clock at its arrival) are
:func:`local`: the receiver supplies them as keyword arguments of :func:`decode`.
Constraints between fields live in a message's ``invariants`` method, which raises
:class:`Invalid` naming the field.

Which kinds exist is not decided here: `paramsync.runtime.protocol.messages` declares them and
builds the closed kind table this codec is given.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeGuard

from paramsync.runtime.errors import ProtocolError

if TYPE_CHECKING:
    import torch

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_INT",
    "Invalid",
    "WireType",
    "Int",
    "Float",
    "Bool",
    "Str",
    "Bytes",
    "Seq",
    "Record",
    "Either",
    "Spread",
    "Tensor",
    "Map",
    "WireField",
    "wire",
    "local",
    "WireMessage",
    "Schema",
    "schema",
    "encode",
    "decode",
    "decode_as",
    "build_checked",
    "check_item",
    "CheckedItem",
    "check_envelope",
    "is_tensor",
]


def is_tensor(value: object) -> TypeGuard[torch.Tensor]:
    """Whether ``value`` is a ``torch.Tensor``, without importing torch: until something has
    imported it, nothing can be one (the coordinator and the launcher never import it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


PROTOCOL_VERSION = 4
"""The version every frame carries in ``v``; a peer speaking another is refused."""
MAX_INT = 2**63 - 1
"""Upper bound of counters (steps, epochs, sequence numbers): a signed 64-bit integer."""

_MISSING: Any = dataclasses.MISSING


class _Unset:
    """The ``omit`` of a field the encoder always writes."""

    def __repr__(self) -> str:
        return "ALWAYS"


_ALWAYS: Any = _Unset()


class Invalid(Exception):
    """A value does not fit its field type: ``path`` locates it inside the field (``"[2]
    shape[0]"``, or ``"'tensors'"`` when a message's invariants name a whole field) and
    ``detail`` says what is wrong (it starts with ``" "`` or ``"="``)."""

    def __init__(self, detail: str, path: str = "") -> None:
        super().__init__(path + detail)
        self.detail = detail
        self.path = path

    def within(self, prefix: str) -> Invalid:
        return Invalid(self.detail, prefix + self.path)


def _type_name(value: Any) -> str:
    return type(value).__name__


# --------------------------------------------------------------------------- field types


class WireType:
    """What one field (or one element of a nested field) may hold on the wire.

    ``check`` validates a decoded (or locally given) value and returns its normalized Python
    form (lists become tuples); ``encode`` gives the CBOR-ready form of a normalized value;
    ``accepts`` is the cheap CBOR-type test `Either` dispatches on. ``plain``: the value is its
    own CBOR form (``encode`` is the identity). ``normalize``: ``check`` may return another
    value than it was given (a tuple for a list), so a locally built message runs it too.
    """

    name: str = "value"
    plain: bool = True
    normalize: bool = False

    def check(self, value: Any) -> Any:
        raise NotImplementedError

    def encode(self, value: Any) -> Any:
        return value

    def accepts(self, value: Any) -> bool:
        raise NotImplementedError


@dataclass(frozen=True)
class Int(WireType):
    """An integer in ``[lo, hi]`` (``hi`` None: up to CBOR's largest, 2**64 - 1); not a bool."""

    lo: int = 0
    hi: int | None = MAX_INT
    name = "int"

    def check(self, value: Any) -> int:
        if type(value) is not int:
            raise Invalid(f" must be int, got {_type_name(value)}")
        if value < self.lo:
            raise Invalid(f"={value} is below {self.lo}")
        if self.hi is not None and value > self.hi:
            raise Invalid(f"={value} is above {self.hi}")
        return value

    def accepts(self, value: Any) -> bool:
        return type(value) is int


@dataclass(frozen=True)
class Float(WireType):
    """A number at least ``lo`` (an int is taken as a float); travels as a CBOR float."""

    lo: float | None = None
    name = "float"
    plain = False
    normalize = True

    def check(self, value: Any) -> float:
        if type(value) is not float and type(value) is not int:
            raise Invalid(f" must be float, got {_type_name(value)}")
        if self.lo is not None and not value >= self.lo:
            raise Invalid(f"={value} is below {self.lo}")
        return float(value)

    def encode(self, value: Any) -> float:
        return float(value)

    def accepts(self, value: Any) -> bool:
        return type(value) is float or type(value) is int


@dataclass(frozen=True)
class Bool(WireType):
    """True or false (never an integer)."""

    name = "bool"

    def check(self, value: Any) -> bool:
        if type(value) is not bool:
            raise Invalid(f" must be a bool, got {_type_name(value)}")
        return value

    def accepts(self, value: Any) -> bool:
        return type(value) is bool


@dataclass(frozen=True)
class Str(WireType):
    """A text string of ``min_len`` to ``max_len`` characters. ``clip``: the encoder shortens a
    longer one (ending it with "...") instead of sending what the receiver refuses."""

    max_len: int
    min_len: int = 0
    clip: bool = False
    name = "str"

    def __post_init__(self) -> None:
        object.__setattr__(self, "plain", not self.clip)

    def check(self, value: Any) -> str:
        if type(value) is not str:
            raise Invalid(f" must be str, got {_type_name(value)}")
        if len(value) > self.max_len:
            raise Invalid(f" is longer than {self.max_len} characters")
        if len(value) < self.min_len:
            if self.min_len == 1:
                raise Invalid(f" must be a non-empty string of at most {self.max_len} characters")
            raise Invalid(f" is shorter than {self.min_len} characters")
        return value

    def encode(self, value: Any) -> str:
        if self.clip and len(value) > self.max_len:
            return value[: self.max_len - 3] + "..."
        return value

    def accepts(self, value: Any) -> bool:
        return type(value) is str


@dataclass(frozen=True)
class Bytes(WireType):
    """A byte string of at most ``max_len`` bytes (a bytearray or memoryview given locally is
    copied into bytes)."""

    max_len: int
    name = "bytes"
    normalize = True

    def check(self, value: Any) -> bytes:
        if type(value) is not bytes:
            if not isinstance(value, bytes | bytearray | memoryview):
                raise Invalid(f" must be bytes, got {_type_name(value)}")
            value = bytes(value)
        if len(value) > self.max_len:
            raise Invalid(f" is longer than {self.max_len} bytes")
        return value

    def accepts(self, value: Any) -> bool:
        return isinstance(value, bytes | bytearray | memoryview)


@dataclass(frozen=True)
class Seq(WireType):
    """A list of at most ``max_len`` elements of type ``item``; a tuple in Python."""

    item: WireType
    max_len: int
    name = "list"
    plain = False
    normalize = True

    def check(self, value: Any) -> tuple[Any, ...]:
        if type(value) is not list and type(value) is not tuple:
            raise Invalid(f" must be a list, got {_type_name(value)}")
        if len(value) > self.max_len:
            raise Invalid(f" is longer than {self.max_len} items")
        check = self.item.check
        try:
            return tuple([check(element) for element in value])
        except Invalid:
            pass
        for index, element in enumerate(value):  # find the first bad element to name it
            try:
                check(element)
            except Invalid as exc:
                raise exc.within(f"[{index}]") from None
        raise AssertionError("unreachable: an element failed once and passed again")

    def encode(self, value: Any) -> list[Any]:
        if self.item.plain:
            return list(value)
        encode = self.item.encode
        return [encode(element) for element in value]

    def accepts(self, value: Any) -> bool:
        return type(value) is list or type(value) is tuple


class Record(WireType):
    """A fixed-length list whose elements have names and types of their own (a tuple in
    Python): ``Record(("shape", SHAPE), ("dtype", DTYPE))`` is ``[shape, dtype]``."""

    name = "list"
    plain = False
    normalize = True

    def __init__(self, *parts: tuple[str, WireType]) -> None:
        self.parts = parts
        self.shape = "[" + ", ".join(label for label, _ in parts) + "]"
        self._checks = tuple(part.check for _, part in parts)

    def __repr__(self) -> str:
        return f"Record{self.parts!r}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Record) and other.parts == self.parts

    def __hash__(self) -> int:
        return hash(self.parts)

    def check(self, value: Any) -> tuple[Any, ...]:
        if (type(value) is not list and type(value) is not tuple) or len(value) != len(self.parts):
            raise Invalid(f" must be {self.shape}")
        try:
            return tuple([check(element) for check, element in zip(self._checks, value)])
        except Invalid:
            pass
        for (label, part), element in zip(self.parts, value):  # find the bad part to name it
            try:
                part.check(element)
            except Invalid as exc:
                raise exc.within(f" {label}") from None
        raise AssertionError("unreachable: a part failed once and passed again")

    def encode(self, value: Any) -> list[Any]:
        return [part.encode(element) for (_, part), element in zip(self.parts, value)]

    def accepts(self, value: Any) -> bool:
        return type(value) is list or type(value) is tuple


class Either(WireType):
    """One of several types told apart by their CBOR type (the first that ``accepts`` the
    value checks it): ``Either(Str(...), Seq(...))`` is a string or a list."""

    plain = False
    normalize = True

    def __init__(self, *options: WireType) -> None:
        self.options = options
        self.name = " or ".join(option.name for option in options)

    def __repr__(self) -> str:
        return f"Either{self.options!r}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Either) and other.options == self.options

    def __hash__(self) -> int:
        return hash(self.options)

    def _option(self, value: Any) -> WireType:
        for option in self.options:
            if option.accepts(value):
                return option
        raise Invalid(f" must be {self.name}, got {_type_name(value)}")

    def check(self, value: Any) -> Any:
        return self._option(value).check(value)

    def encode(self, value: Any) -> Any:
        return self._option(value).encode(value)

    def accepts(self, value: Any) -> bool:
        return any(option.accepts(value) for option in self.options)


class Spread(Record):
    """A record whose elements travel as separate top-level fields of the message, named by
    their labels: ``address = wire(Spread(("host", HOST), ("port", PORT)))`` is one
    ``(host, port)`` attribute and two wire fields ``host`` and ``port``."""

    def __repr__(self) -> str:
        return f"Spread{self.parts!r}"


@dataclass(frozen=True)
class Tensor(WireType):
    """A tensor (an RFC 8746 typed array; as a message's last field ``data``, maybe the bulk)."""

    name = "tensor"

    def check(self, value: Any) -> torch.Tensor:
        if not is_tensor(value):
            raise Invalid(f" must be tensor, got {_type_name(value)}")
        return value

    def accepts(self, value: Any) -> bool:
        return is_tensor(value)


@dataclass(frozen=True)
class Map(WireType):
    """A map of at most ``max_len`` entries with text keys, checked no deeper (its reader
    validates the contents, such as a state manifest)."""

    max_len: int = 1 << 20
    name = "map"

    def check(self, value: Any) -> dict[str, Any]:
        if type(value) is not dict:
            raise Invalid(f" must be map, got {_type_name(value)}")
        if len(value) > self.max_len:
            raise Invalid(f" is longer than {self.max_len} entries")
        for key in value:
            if type(key) is not str:
                raise Invalid(f" must have text keys, got a {_type_name(key)} key")
        return value

    def accepts(self, value: Any) -> bool:
        return type(value) is dict


# --------------------------------------------------------------------------- fields


@dataclass(frozen=True)
class WireField:
    """How one dataclass attribute travels (kept in the dataclass field's metadata).

    ``key``: the wire field's name (default: the attribute's; several attributes may share a
    key when their types have different CBOR types, the value's type then says which one it
    is). ``optional``: the wire field may be absent (the attribute then takes its default).
    ``omit``: the encoder leaves the field out when the attribute equals this (implies
    ``optional``). ``local``: never travels; the receiver supplies it to `decode`.
    """

    type: WireType | None
    key: str | None = None
    optional: bool = False
    omit: Any = _ALWAYS
    local: bool = False


def wire(
    type_: WireType,
    *,
    default: Any = _MISSING,
    key: str | None = None,
    optional: bool = False,
    omit: Any = _ALWAYS,
) -> Any:
    """Declare a dataclass attribute that travels as wire field ``key`` of type ``type_``."""
    spec = WireField(type_, key, optional or omit is not _ALWAYS, omit)
    return dataclasses.field(default=default, metadata={"wire": spec})


def local(*, default: Any = _MISSING) -> Any:
    """Declare an attribute that never travels: the receiver passes it to `decode`."""
    return dataclasses.field(default=default, metadata={"wire": WireField(None, local=True)})


class WireMessage:
    """Base of every message kind: a frozen dataclass with a ``KIND`` and `wire` fields.

    Building one locally normalizes its container fields (lists become tuples, so an instance
    equals its decoded copy) and checks its invariants; decoding builds it from checked values
    without a second pass. Its ``to_wire``/``from_wire`` are the generic `encode` and `decode`.
    """

    KIND: ClassVar[str]

    def __post_init__(self) -> None:
        spec = schema(type(self))
        if not spec.normalized and spec.invariants is None:
            return
        for name, ftype in spec.normalized:
            value = self.__dict__[name]
            if value is None or (name in spec.nullable and value == spec.nullable[name]):
                continue
            try:
                object.__setattr__(self, name, ftype.check(value))
            except Invalid as exc:
                raise ProtocolError(f"{type(self).__name__}: field {name!r}{exc}") from None
        if spec.invariants is not None:
            try:
                spec.invariants(self)
            except Invalid as exc:
                raise ProtocolError(f"{type(self).__name__}: field {exc}") from None

    def to_wire(self) -> tuple[str, dict[str, Any]]:
        """The ``(kind, fields)`` pair a frame carries (see `encode`)."""
        return encode(self)

    def to_wire_bulk(self, field: str = "data") -> tuple[str, dict[str, Any], torch.Tensor]:
        """The ``(kind, fields, bulk)`` a transport's ``send`` takes: the tensor attribute
        ``field`` travels as the frame's bulk, written from the tensor's memory uncopied."""
        kind, fields = encode(self)
        bulk = fields.pop(field, None)
        if not is_tensor(bulk):
            raise TypeError(f"{type(self).__name__}.{field} is not a tensor")
        return kind, fields, bulk

    @classmethod
    def from_wire(cls, item: Mapping[str, Any], *, peer: object = None, **context: Any) -> Self:
        """Decode ``item`` as this kind (see `decode`); another kind is a ProtocolError."""
        if isinstance(item, Mapping) and item.get("kind") != cls.KIND:
            check_envelope(item, {cls.KIND: cls}, peer, lookup=False)
            raise ProtocolError(
                f"expected a {cls.KIND} message, got a {item.get('kind')} message", peer=peer
            )
        return decode(item, {cls.KIND: cls}, peer=peer, **context)


# One compiled wire field: (attribute, key, type, optional, omit).
_Slot = tuple[str, str, WireType, bool, Any]


@dataclass(frozen=True)
class Schema:
    """A message class's compiled declaration, what `encode` and `decode` walk.

    ``slots``: the wire attributes in declaration order; ``encode_order``: the same in frame
    order (``WIRE_ORDER``), attributes sharing a key with those the encoder may leave out
    first; ``groups``: wire key -> the attributes it may carry; ``required``: the keys a frame
    must hold; ``normalized``: the attributes a local construction normalizes.
    """

    cls: type[WireMessage]
    kind: str
    slots: tuple[_Slot, ...]
    encode_order: tuple[_Slot, ...]
    keys: frozenset[str]
    groups: Mapping[str, tuple[_Slot, ...]]
    required: frozenset[str]
    locals_: tuple[str, ...]
    defaults: Mapping[str, Any]
    normalized: tuple[tuple[str, WireType], ...]
    nullable: Mapping[str, Any]
    invariants: Callable[[Any], None] | None
    plan: tuple[tuple[Any, ...], ...]
    allowed: frozenset[str]
    absent: Mapping[str, Any]


def _keys_of(slot: _Slot) -> list[str]:
    ftype = slot[2]
    return [label for label, _ in ftype.parts] if isinstance(ftype, Spread) else [slot[1]]


def _compile_schema(cls: type) -> Schema:
    """Compile ``cls``'s declaration (a programming error raises TypeError); see `schema`.

    A class may set ``WIRE_ORDER`` (its wire keys in frame order) when its frames list the
    fields in another order than its constructor takes them.
    """
    if not dataclasses.is_dataclass(cls) or not issubclass(cls, WireMessage):
        raise TypeError(f"{cls.__name__} is not a WireMessage dataclass")
    kind = cls.__dict__.get("KIND")
    if not isinstance(kind, str):
        raise TypeError(f"{cls.__name__} declares no KIND")
    slots: list[_Slot] = []
    locals_: list[str] = []
    defaults: dict[str, Any] = {}
    normalized: list[tuple[str, WireType]] = []
    nullable: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("wire")
        if not isinstance(spec, WireField):
            raise TypeError(f"{cls.__name__}.{f.name} is declared with neither wire() nor local()")
        if f.default is not _MISSING:
            defaults[f.name] = f.default
        if spec.local:
            locals_.append(f.name)
            continue
        assert spec.type is not None
        if spec.type.normalize:
            normalized.append((f.name, spec.type))
        if spec.omit is not _ALWAYS:
            nullable[f.name] = spec.omit
        slots.append((f.name, spec.key or f.name, spec.type, spec.optional, spec.omit))
    groups: dict[str, list[_Slot]] = {}
    for slot in slots:
        for key in _keys_of(slot):
            if key in ("v", "kind"):
                raise TypeError(f"{cls.__name__}.{slot[0]}: wire field name {key!r} is reserved")
            groups.setdefault(key, []).append(slot)
    for key, members in groups.items():
        if len(members) > 1 and any(isinstance(s[2], Spread) for s in members):
            raise TypeError(f"{cls.__name__}: spread wire field {key!r} is also another field's")
    order = list(cls.__dict__.get("WIRE_ORDER", groups))
    if sorted(order) != sorted(groups):
        raise TypeError(f"{cls.__name__}.WIRE_ORDER {order} does not list its wire fields")
    encode_order = sorted(slots, key=lambda s: (order.index(_keys_of(s)[0]), s[4] is _ALWAYS))
    required = {key for key, members in groups.items() if not all(s[3] for s in members)}
    return Schema(
        plan=_plan(slots, groups, required),
        allowed=frozenset(groups) | {"v", "kind"},
        absent={slot[0]: defaults.get(slot[0]) for slot in slots},
        cls=cls,
        kind=kind,
        slots=tuple(slots),
        encode_order=tuple(encode_order),
        keys=frozenset(groups),
        groups={key: tuple(members) for key, members in groups.items()},
        required=frozenset(required),
        locals_=tuple(locals_),
        defaults=defaults,
        normalized=tuple(normalized),
        nullable=nullable,
        invariants=getattr(cls, "invariants", None),
    )


schema: Callable[[type], Schema] = functools.cache(_compile_schema)
"""``cls``'s compiled declaration, compiled once per class. (Declared as a plain callable:
mypy does not count a class object as Hashable, which ``functools.cache`` asks of its
arguments.)"""


def _plan(
    slots: list[_Slot], groups: dict[str, list[_Slot]], required: set[str]
) -> tuple[tuple[Any, ...], ...]:
    """What `_fields` does for each wire key, in declaration order: ``(0, key, required, name,
    check)`` for a field of its own, ``(1, key, required, ((accepts, name, check), ...),
    names)`` for attributes sharing a key, ``(2, name, ((label, check), ...))`` for a spread
    record."""
    plan: list[tuple[Any, ...]] = []
    done: set[str] = set()
    for slot in slots:
        name, key, ftype, _optional, _omit = slot
        if isinstance(ftype, Spread):
            plan.append((2, name, tuple((label, part.check) for label, part in ftype.parts)))
        elif key in done:
            continue
        elif len(groups[key]) == 1:
            plan.append((0, key, key in required, name, ftype.check))
        else:
            options = tuple((s[2].accepts, s[0], s[2].check) for s in groups[key])
            names = " or ".join(s[2].name for s in groups[key])
            plan.append((1, key, key in required, options, names))
        done.add(key)
    return tuple(plan)


# --------------------------------------------------------------------------- the codec


def encode(message: WireMessage) -> tuple[str, dict[str, Any]]:
    """The ``(kind, fields)`` a frame carries for ``message``: every wire field in frame
    order, optional ones left out at their ``omit`` value, nested values as CBOR lists."""
    spec = schema(type(message))
    values = message.__dict__
    fields: dict[str, Any] = {}
    for name, key, ftype, _optional, omit in spec.encode_order:
        value = values[name]
        if omit is not _ALWAYS and (value is omit or value == omit):
            continue
        if ftype.plain:
            if key not in fields:
                fields[key] = value
        elif isinstance(ftype, Spread):
            for (label, part), element in zip(ftype.parts, value):
                fields[label] = part.encode(element)
        elif key not in fields:
            fields[key] = ftype.encode(value)
    return spec.kind, fields


def check_envelope(
    item: Any, table: Mapping[str, type], peer: object = None, *, lookup: bool = True
) -> Schema | None:
    """Check a decoded item's version and kind; return its kind's schema (``lookup``). A
    `CheckedItem` unchanged since `check_item` passed it has had both checked: its schema is
    returned at once when ``table`` holds its kind."""
    if type(item) is CheckedItem and lookup:
        checked = item.checked_spec
        if checked is not None and table.get(checked.kind) is checked.cls:
            return checked
    if not isinstance(item, dict):
        raise ProtocolError(f"a frame must hold a CBOR map, got {_type_name(item)}", peer=peer)
    version = item.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        if type(version) is int:
            raise ProtocolError(
                f"unsupported protocol version {version} (this peer speaks {PROTOCOL_VERSION})",
                peer=peer,
            )
        raise ProtocolError("frame has no protocol version field 'v'", peer=peer)
    kind = item.get("kind")
    if not isinstance(kind, str):
        raise ProtocolError("frame has no message kind field 'kind'", peer=peer)
    if not lookup:
        return None
    cls = table.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind[:64]!r}", peer=peer)
    return schema(cls)


def _fields(
    spec: Schema, item: Mapping[str, Any], peer: object, present: str | None
) -> dict[str, Any]:
    """Check ``item``'s fields against ``spec``: the attributes' normalized values (wire
    fields only; absent optional ones left out). ``present``: a key whose value is not in
    ``item`` but counts as present (a bulk tensor still to be read)."""
    kind = spec.kind
    if present is not None and present not in spec.keys:
        raise ProtocolError(f"{kind} message has an unknown field {present!r}", peer=peer)
    if not spec.allowed.issuperset(item):
        for name in item:
            if name not in spec.allowed:
                raise ProtocolError(
                    f"{kind} message has an unknown field {str(name)[:64]!r}", peer=peer
                )
    out: dict[str, Any] = {}
    key: Any = None
    try:
        for step in spec.plan:
            if step[0] == 2:  # a spread record: one wire field per element
                _, name, parts = step
                elements = []
                for key, check in parts:
                    if key not in item:
                        raise ProtocolError(f"{kind} message is missing field {key!r}", peer=peer)
                    elements.append(check(item[key]))
                out[name] = tuple(elements)
                continue
            key = step[1]
            if key not in item:
                if step[2] and key != present:
                    raise ProtocolError(f"{kind} message is missing field {key!r}", peer=peer)
                continue
            value = item[key]
            if step[0] == 0:
                out[step[3]] = step[4](value)
                continue
            for accepts, name, check in step[3]:  # attributes sharing the key: the type picks
                if accepts(value):
                    out[name] = check(value)
                    break
            else:
                raise Invalid(f" must be {step[4]}, got {_type_name(value)}")
    except Invalid as exc:
        raise ProtocolError(f"{kind} message: field {key!r}{exc}", peer=peer) from None
    return out


class CheckedItem(dict[str, Any]):
    """A decoded map that `check_item` passed whole, with what its fields' checks made of it:
    `decode_as` builds its kind's message from those values instead of checking every field
    a second time. Any change to the map drops them (the next decode checks it again)."""

    __slots__ = ("checked_spec", "checked_values")
    checked_spec: Schema | None
    checked_values: dict[str, Any] | None

    @classmethod
    def of(cls, item: Mapping[str, Any], spec: Schema, values: dict[str, Any]) -> CheckedItem:
        """``item``'s entries, checked as ``spec``'s kind into ``values``."""
        checked = cls(item)  # dict's own constructor: a copy at C speed
        checked.checked_spec, checked.checked_values = spec, values
        return checked

    def _changed(self) -> None:
        self.checked_spec = self.checked_values = None

    def __setitem__(self, key: str, value: Any) -> None:
        self._changed()
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self._changed()
        super().__delitem__(key)

    def __ior__(self, other: Any) -> CheckedItem:  # type: ignore[override,misc]
        self._changed()
        super().update(other)
        return self

    def pop(self, *args: Any) -> Any:
        self._changed()
        return super().pop(*args)

    def popitem(self) -> tuple[str, Any]:
        self._changed()
        return super().popitem()

    def clear(self) -> None:
        self._changed()
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._changed()
        super().update(*args, **kwargs)

    def setdefault(self, key: str, default: Any = None) -> Any:
        self._changed()
        return super().setdefault(key, default)


def check_item(
    item: Any, table: Mapping[str, type], *, peer: object = None, present: str | None = None
) -> dict[str, Any]:
    """Check a decoded map's version, kind and fields (types, ranges, lengths) against its
    kind's declaration in ``table``; return its items, for transports that pass maps on (a
    `CheckedItem`, which `decode_as` builds from without checking again; with ``present``,
    the map itself). A kind's invariants between fields are `decode`'s to check.
    ``present``: a field whose value is not in the map yet but counts as present (a bulk
    tensor still to be read)."""
    spec = check_envelope(item, table, peer)
    assert spec is not None
    values = _fields(spec, item, peer, present)
    return item if present is not None else CheckedItem.of(item, spec, values)


def _build(spec: Schema, values: dict[str, Any], context: Mapping[str, Any]) -> Any:
    message = object.__new__(spec.cls)
    attributes = message.__dict__
    attributes.update(spec.absent)
    attributes.update(values)
    for name in spec.locals_:
        if name in context:
            attributes[name] = context[name]
        elif name in spec.defaults:
            attributes[name] = spec.defaults[name]
        else:
            raise TypeError(f"decoding a {spec.kind} message needs {name}=")
    return message


def build_checked(item: Any, table: Mapping[str, type], context: Mapping[str, Any]) -> Any:
    """The message a `CheckedItem` holds, built from the values `check_item` made of its
    fields (``context``: its kind's `local` attributes), when it is unchanged since, its kind
    is in ``table`` and the kind's invariants hold; else None (`decode` then checks it and
    names what is wrong). A shell's decoding of a checked map, without a second pass."""
    if type(item) is not CheckedItem:
        return None
    spec = item.checked_spec
    if spec is None or table.get(spec.kind) is not spec.cls:
        return None
    values = item.checked_values
    assert values is not None
    message = _build(spec, values, context)
    if spec.invariants is not None:
        try:
            spec.invariants(message)
        except Invalid:
            return None
    return message


def _invariants(spec: Schema, message: Any, peer: object) -> None:
    assert spec.invariants is not None
    try:
        spec.invariants(message)
    except Invalid as exc:
        raise ProtocolError(f"{spec.kind} message: field {exc}", peer=peer) from None


def decode(item: Any, table: Mapping[str, type], *, peer: object = None, **context: Any) -> Any:
    """Build the message a decoded CBOR map holds, its kind looked up in ``table``.

    Checks the version, the kind, that no field is unknown or missing, every field's type and
    range, and the kind's invariants; a failure is a ProtocolError naming the kind, the field
    and ``peer``. ``context`` supplies the kind's `local` attributes (such as ``rank``).
    """
    spec = check_envelope(item, table, peer)
    assert spec is not None
    return decode_as(spec, item, peer, context)


def decode_as(
    spec: Schema, item: Mapping[str, Any], peer: object, context: Mapping[str, Any]
) -> Any:
    """`decode` for an item whose envelope was checked and whose kind is ``spec``'s."""
    if type(item) is CheckedItem and item.checked_spec is spec:
        values = item.checked_values  # checked whole by `check_item`, unchanged since
        assert values is not None
    else:
        values = _fields(spec, item, peer, None)
    message = _build(spec, values, context)
    if spec.invariants is not None:
        _invariants(spec, message, peer)
    return message
