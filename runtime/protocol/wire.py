"""The CBOR wire protocol's framing: frames, their validation and RFC 8746 tensors (sans-I/O).

A frame is an 8-byte prefix followed by exactly one CBOR data item (RFC 8949)::

    +----------------+----------------+---------------------------------+
    | item length    | bulk length    | CBOR item (a map)               |
    | u32 big-endian | u32 big-endian | {"v": 2, "kind": ..., fields}   |
    +----------------+----------------+---------------------------------+

The item is a map holding the protocol version ``v``, the message ``kind`` and that kind's
fields, as `paramsync.runtime.protocol.messages` declares them (every decoded frame is checked
against that declaration). Tensors are RFC 8746 arrays: tag 40 ``[shape, typed-array]`` where the
typed array is the little-endian tag of the element type around a byte string. When a frame carries
one large tensor (the "bulk"), it is the map's last value, under the key ``data``, and its raw bytes
are the last ``bulk length`` bytes of the item: the sender writes them straight from tensor memory
and the receiver reads them straight into the destination tensor, never through the CBOR codec.

Everything here is pure: functions take bytes and return messages or buffers, so hypothesis can
throw any bytes at them, and transports stay thin shells around them.
"""

from __future__ import annotations

import ctypes
import functools
import io
import math
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import cbor2

from paramsync.runtime.errors import (
    FrameAuthenticationError,
    FrameTooLarge,
    ProtocolError,
    plain_or_quoted,
)
from paramsync.runtime.protocol.decode_memo import MEMO_MAX_ITEM, DecodeMemo
from paramsync.runtime.protocol.limits import (
    SCAN_THRESHOLD,
    check_kind_size,
    count_items,
    peek_kind,
)
from paramsync.runtime.protocol.messages import KINDS, validate_message
from paramsync.runtime.protocol.schema import PROTOCOL_VERSION, is_tensor

if TYPE_CHECKING:
    import torch

    DTYPE_TAGS: dict[torch.dtype, int]

__all__ = [
    "PROTOCOL_VERSION",
    "PREFIX_SIZE",
    "DEFAULT_MAX_FRAME",
    "HANDSHAKE_MAX_FRAME",
    "BFLOAT16_TAG",
    "DTYPE_TAGS",
    "BulkSpec",
    "encode_frame",
    "encode_frame_bytes",
    "parse_prefix",
    "decode_head",
    "decode_item",
    "decode_frame",
    "tensor_buffer",
    "validate_message",
    "check_bulk_destination",
    "landed_as_sent",
    "TAG_SIZE",
    "TRAILER_SIZE",
    "encode_tag_trailer",
    "parse_tag_trailer",
]

_PREFIX = struct.Struct(">II")
PREFIX_SIZE = _PREFIX.size
DEFAULT_MAX_FRAME = 64 * 1024 * 1024
"""Largest CBOR item, bulk excluded, that a receiver allocates for (control messages)."""
HANDSHAKE_MAX_FRAME = 4096
"""Frame cap before a peer has authenticated: garbage cannot make us allocate more."""
TAG_SIZE = 16
"""Bytes of a frame's authentication tag (`paramsync.runtime.protocol.frame_auth`)."""
_TRAILER_HEADER = 0x40 | TAG_SIZE
"""The CBOR head of a 16-byte byte string (0x50): the trailer is a CBOR item of its own."""
TRAILER_SIZE = 1 + TAG_SIZE
"""Bytes after each frame's item on a connection past its handshake: the tag trailer."""
MAX_DEPTH = 16
"""Deepest nesting any message kind needs; deeper input is refused as a nesting bomb."""

BFLOAT16_TAG = 0xBF16
"""paramsync's extension tag (48918) for little-endian bfloat16 typed arrays: RFC 8746 has none."""

_DTYPE_NAME_TAGS = {
    "uint8": 64,
    "int8": 72,
    "int16": 77,
    "int32": 78,
    "int64": 79,
    "float16": 84,
    "float32": 85,
    "float64": 86,
    "bfloat16": BFLOAT16_TAG,
}
"""Element type (torch's name) -> RFC 8746 little-endian typed-array tag (bfloat16: the
extension tag). By name, so that framing and decoding a message without a tensor needs no
torch (the coordinator and the launcher never import it)."""
_TYPED_ARRAY_TAGS = frozenset(_DTYPE_NAME_TAGS.values())


@functools.cache
def dtype_tags() -> dict[torch.dtype, int]:
    """`DTYPE_TAGS`: element type -> typed-array tag, built (and torch imported) on first use."""
    import torch

    return {getattr(torch, name): tag for name, tag in _DTYPE_NAME_TAGS.items()}


@functools.cache
def _tag_dtypes() -> dict[int, torch.dtype]:
    """Typed-array tag -> element type (torch imported when the first tensor arrives)."""
    return {tag: dtype for dtype, tag in dtype_tags().items()}


def __getattr__(name: str) -> Any:
    # ``DTYPE_TAGS`` keyed by torch dtypes, made when first asked for (PEP 562).
    if name == "DTYPE_TAGS":
        return dtype_tags()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_MULTI_DIM_TAG = 40
_LITTLE_ENDIAN = sys.byteorder == "little"


# --------------------------------------------------------------------------- tensors


def tensor_buffer(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory, without copying it.

    Works for every dtype, bfloat16 included (numpy has no bfloat16). The caller keeps the
    tensor alive while the view is in use.
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor_buffer needs a CPU tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("tensor_buffer needs a contiguous tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    array = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    # The view keeps the array alive, the array keeps the memory alive. (ctypes arrays take
    # attributes; the stubs declare none.)
    array._owner = tensor  # type: ignore[attr-defined]
    return memoryview(array).cast("B")


def _tensor_tag(tensor: torch.Tensor) -> int:
    try:
        return dtype_tags()[tensor.dtype]
    except KeyError:
        raise ProtocolError(f"tensors of dtype {tensor.dtype} cannot travel") from None


def _wire_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The contiguous little-endian CPU tensor whose bytes go on the wire."""
    if tensor.device.type != "cpu":
        raise ValueError(f"move tensors to the CPU before sending (got {tensor.device})")
    tensor = tensor.contiguous()
    if not _LITTLE_ENDIAN and tensor.element_size() > 1:  # pragma: no cover - x86/arm are LE
        import torch

        tensor = tensor.view(torch.uint8).view(-1, tensor.element_size()).flip(1).contiguous()
    return tensor


def _encode_tensor_inline(encoder: Any, tensor: torch.Tensor) -> None:
    tensor = _wire_tensor(tensor.detach())
    tag = _tensor_tag(tensor)
    data = bytes(tensor_buffer(tensor))
    encoder.encode(cbor2.CBORTag(_MULTI_DIM_TAG, [list(tensor.shape), cbor2.CBORTag(tag, data)]))


def _default(encoder: Any, value: Any) -> None:
    if is_tensor(value):
        _encode_tensor_inline(encoder, value)
        return
    if isinstance(value, tuple):
        encoder.encode(list(value))
        return
    raise ProtocolError(f"cannot encode a value of type {type(value).__name__}")


@dataclass(frozen=True)
class BulkSpec:
    """What a frame's bulk tensor is: element type, shape and byte count, not yet read."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


class _Deferred:
    """Placeholder the head decoder leaves where the bulk bytes will go."""

    __slots__ = ("spec",)

    def __init__(self, spec: BulkSpec) -> None:
        self.spec = spec


def _check_shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list | tuple) or len(shape) > 32:
        raise ProtocolError("tensor shape must be an array of at most 32 dimensions")
    dims = []
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < 2**40:
            raise ProtocolError(f"tensor dimension {dim!r} is not a non-negative int")
        dims.append(dim)
    return tuple(dims)


def _tensor_from_bytes(
    dtype: torch.dtype, shape: tuple[int, ...], data: bytes | bytearray | memoryview
) -> torch.Tensor:
    import torch

    itemsize = dtype.itemsize
    numel = math.prod(shape)
    if numel * itemsize != len(data):
        raise ProtocolError(
            f"tensor of shape {list(shape)} and dtype {dtype} needs {numel * itemsize} bytes, "
            f"the typed array has {len(data)}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(data), dtype=dtype)
    if not _LITTLE_ENDIAN and itemsize > 1:  # pragma: no cover
        flat = flat.view(torch.uint8).view(-1, itemsize).flip(1).contiguous().view(dtype)
    return flat.view(shape)


class _NoTensor:
    """Placeholder the decoder leaves where a typed array (or tag 40) stood in a frame that
    may hold no tensor: nothing is built from it (no torch imported), and the frame is refused
    naming the field (`_refuse_tensors`)."""

    __slots__ = ("tag",)

    def __init__(self, tag: int) -> None:
        self.tag = tag


_NO_TENSORS_HERE = (
    "typed arrays are refused here (handshake frames and a coordinator's control links carry "
    "no tensor)"
)


class _TagDecoder:
    """cbor2 tag hook: typed arrays and tag 40 become tensors (with ``tensors`` false, inert
    `_NoTensor` placeholders); every other tag is refused."""

    def __init__(self, bulk_len: int = 0, *, tensors: bool = True) -> None:
        self.bulk_len = bulk_len
        self.tensors = tensors
        self.deferred = 0
        self.refused = 0
        self.seen = 0
        """How many tags the decoder handed this hook."""

    def __call__(self, tag: cbor2.CBORTag, _immutable: bool = False) -> Any:
        self.seen += 1
        if not self.tensors and (tag.tag in _TYPED_ARRAY_TAGS or tag.tag == _MULTI_DIM_TAG):
            self.refused += 1
            return _NoTensor(tag.tag)
        if tag.tag in _TYPED_ARRAY_TAGS:
            if not isinstance(tag.value, bytes):
                raise ProtocolError(f"typed array tag {tag.tag} must wrap a byte string")
            return _TypedArray(_tag_dtypes()[tag.tag], tag.value)
        if tag.tag == _MULTI_DIM_TAG:
            value = tag.value
            if not isinstance(value, list | tuple) or len(value) != 2:
                raise ProtocolError("tag 40 must wrap [shape, typed array]")
            shape = _check_shape(value[0])
            if not isinstance(value[1], _TypedArray):
                raise ProtocolError("tag 40 must wrap a typed array of a supported element type")
            array = value[1]
            if self.bulk_len and not array.data and math.prod(shape) > 0:
                self.deferred += 1
                return _Deferred(BulkSpec(array.dtype, shape, self.bulk_len))
            return _tensor_from_bytes(array.dtype, shape, array.data)
        raise ProtocolError(f"CBOR tag {tag.tag} is not part of the paramsync protocol")


class _TypedArray:
    __slots__ = ("data", "dtype")

    def __init__(self, dtype: torch.dtype, data: bytes) -> None:
        self.dtype = dtype
        self.data = data


def _refuser(tag: int) -> Any:
    def refuse(_decoder: Any, _value: Any = None, _immutable: bool = False) -> Any:
        raise ProtocolError(
            f"CBOR tag {tag} is not part of the paramsync protocol (semantic tags: dates, "
            "bignums, sets, references, IP addresses, ... are refused)"
        )

    return refuse


# Tags cbor2 decodes itself (52/54: IP addresses and networks; 55799: self-described CBOR);
# paramsync messages use none of them.
_SEMANTIC_TAGS = (
    0, 1, 2, 3, 4, 5, 25, 28, 29, 30, 35, 36, 37, 52, 54, 100, 256, 258, 260, 261, 1004, 55799,
)  # fmt: skip
_SEMANTIC_REFUSED = {tag: _refuser(tag) for tag in _SEMANTIC_TAGS}

_PLAIN_TYPES = (int, str, bytes, bool, float, type(None))


def _check_types(item: Any) -> None:
    """Refuse any decoded value whose type is not in the protocol's allow-list: int, str,
    bytes, bool, None, float, list, dict (text or int keys) and tensors (one walk)."""
    stack = [item]
    pop, push = stack.pop, stack.extend
    while stack:
        value = pop()
        kind = type(value)
        if kind in _PLAIN_TYPES:
            continue
        if kind is list:
            push(value)
        elif kind is dict:
            for key in value:
                if type(key) not in _PLAIN_TYPES:
                    raise ProtocolError(f"a map key of type {type(key).__name__} is refused")
            push(value.values())
        elif kind is _Deferred or is_tensor(value):
            continue
        else:
            raise ProtocolError(f"a decoded value of type {kind.__name__} is refused")


def _holds_no_tensor(value: Any) -> _NoTensor | None:
    """The first `_NoTensor` placeholder within a decoded value (None when there is none)."""
    stack = [value]
    while stack:
        value = stack.pop()
        if isinstance(value, _NoTensor):
            return value
        if isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
    return None


def _refuse_tensors(item: Any) -> None:
    """Raise, naming the kind and the field, for a decoded item holding `_NoTensor`s."""
    kind = item.get("kind") if isinstance(item, dict) else None
    what = f"{plain_or_quoted(kind)} message" if isinstance(kind, str) else "a frame"
    fields = item.items() if isinstance(item, dict) else [(None, item)]
    for key, value in fields:
        found = _holds_no_tensor(value)
        if found is not None:
            where = f"field {plain_or_quoted(key)}" if key is not None else "its item"
            raise ProtocolError(
                f"{what}: {where} holds a typed array (CBOR tag {found.tag}): {_NO_TENSORS_HERE}"
            )
    raise ProtocolError(f"{what} holds a typed array: {_NO_TENSORS_HERE}")  # pragma: no cover


def _protocol_cause(exc: BaseException) -> ProtocolError | None:
    """The project's own ProtocolError that cbor2 wrapped (cbor2 6 wraps tag-hook errors)."""
    seen = 0
    cause: BaseException | None = exc
    while cause is not None and seen < 8:
        if isinstance(cause, ProtocolError):
            return cause
        cause = cause.__cause__ or cause.__context__
        seen += 1
    return None


# --------------------------------------------------------------------------- encoding


def _bstr_header(length: int) -> bytes:
    if length < 24:
        return bytes([0x40 | length])
    if length < 2**8:
        return bytes([0x58, length])
    if length < 2**16:
        return b"\x59" + length.to_bytes(2, "big")
    if length < 2**32:
        return b"\x5a" + length.to_bytes(4, "big")
    return b"\x5b" + length.to_bytes(8, "big")


def _item(kind: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}")
    item: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": kind}
    item.update(fields)
    return item


def encode_frame(
    kind: str, fields: Mapping[str, Any], bulk: torch.Tensor | None = None
) -> list[bytes | memoryview]:
    """Encode one message as the buffers of a frame, for ``sendmsg``.

    Small tensors among ``fields`` are encoded inline. ``bulk``, if given, becomes the ``data``
    field: its bytes are not copied, the last buffer is a view of the tensor's own memory, so
    the caller must not modify the tensor until the buffers are sent.
    """
    item = _item(kind, fields)
    if bulk is None or bulk.numel() == 0:
        if bulk is not None:
            item["data"] = bulk
        body = cbor2.dumps(item, default=_default)
        return [_PREFIX.pack(len(body), 0) + body]
    if "data" in fields:
        raise ValueError("pass the bulk tensor as bulk=, not as a 'data' field")
    bulk = _wire_tensor(bulk.detach())
    tag = _tensor_tag(bulk)
    item["data"] = cbor2.CBORTag(_MULTI_DIM_TAG, [list(bulk.shape), cbor2.CBORTag(tag, b"")])
    head = cbor2.dumps(item, default=_default)
    nbytes = bulk.numel() * bulk.element_size()
    head = head[:-1] + _bstr_header(nbytes)
    return [_PREFIX.pack(len(head) + nbytes, nbytes) + head, tensor_buffer(bulk)]


def encode_frame_bytes(
    kind: str, fields: Mapping[str, Any], bulk: torch.Tensor | None = None
) -> bytes:
    """Encode one message as a single bytes object (copies the bulk; for tests and in-process)."""
    return b"".join(bytes(part) for part in encode_frame(kind, fields, bulk))


def encode_tag_trailer(tag: bytes) -> bytes:
    """A frame's authentication tag as the CBOR byte string that follows its item (the frame
    body is then a CBOR sequence, RFC 8742: the message, then its tag)."""
    if len(tag) != TAG_SIZE:
        raise ValueError(f"a frame tag is {TAG_SIZE} bytes, got {len(tag)}")
    return bytes([_TRAILER_HEADER]) + tag


def parse_tag_trailer(trailer: bytes | bytearray | memoryview) -> bytes:
    """The tag a frame's trailer carries; FrameAuthenticationError if the trailer is not a
    16-byte CBOR byte string (a frame without one was slipped in, or bytes went missing)."""
    if len(trailer) != TRAILER_SIZE or trailer[0] != _TRAILER_HEADER:
        got = bytes(trailer[:TRAILER_SIZE]).hex()
        raise FrameAuthenticationError(
            f"frame authentication failed: a frame must end with its {TAG_SIZE}-byte tag as a "
            f"CBOR byte string (0x{_TRAILER_HEADER:02x}...), got {got}"
        )
    return bytes(trailer[1:])


# --------------------------------------------------------------------------- decoding


def parse_prefix(prefix: bytes | bytearray | memoryview, max_frame: int) -> tuple[int, int]:
    """Read a frame prefix: (item length, bulk length), refusing oversized control parts.

    Only the non-bulk part counts against ``max_frame``: bulk bytes go into a destination
    buffer the receiver already owns, whose size it checks in :func:`decode_head`.
    """
    if len(prefix) != PREFIX_SIZE:
        raise ProtocolError(f"frame prefix must be {PREFIX_SIZE} bytes, got {len(prefix)}")
    item_len, bulk_len = _PREFIX.unpack(prefix)
    if item_len == 0:
        raise ProtocolError("frame announces an empty CBOR item")
    if bulk_len > item_len:
        raise ProtocolError(f"frame announces {bulk_len} bulk bytes in a {item_len}-byte item")
    if item_len - bulk_len > max_frame:
        raise FrameTooLarge(
            f"frame of {item_len - bulk_len} bytes exceeds this receiver's limit of {max_frame}"
        )
    return item_len, bulk_len


def _loads_exact(data: bytes, tags: _TagDecoder) -> Any:
    stream = io.BytesIO(data)
    decoder = cbor2.CBORDecoder(
        stream,
        tag_hook=tags,
        semantic_decoders=_SEMANTIC_REFUSED,
        max_depth=MAX_DEPTH,
        allow_indefinite=False,
        allow_duplicate_keys=False,
        strict_hashable_types=True,
    )
    try:
        item = decoder.decode()
    except ProtocolError:
        raise
    except RecursionError:
        raise ProtocolError("CBOR item nests too deeply") from None
    except (cbor2.CBORError, ValueError, TypeError, OverflowError, MemoryError) as exc:
        own = _protocol_cause(exc)
        if own is not None:
            raise own from None
        raise ProtocolError(f"malformed CBOR: {exc}") from None
    if stream.tell() != len(data):
        raise ProtocolError(f"{len(data) - stream.tell()} trailing bytes after the CBOR item")
    if tags.refused:
        _refuse_tensors(item)
    _check_types(item)
    return item


def _check_limits(head: bytes | bytearray | memoryview) -> None:
    """Refuse, before decoding, a head longer than its kind's cap or holding too many items."""
    check_kind_size(head)
    if len(head) > SCAN_THRESHOLD:
        count_items(head)


MEMO = DecodeMemo()
"""The items of the hot report kinds that decoded and passed every check lately, by their
bytes (`paramsync.runtime.protocol.decode_memo`): `decode_item` answers the same bytes again
from it, as a fresh copy."""


def decode_item(item: bytes | bytearray | memoryview, *, tensors: bool = True) -> dict[str, Any]:
    """Decode and validate a complete CBOR item (prefix removed) carrying no bulk.

    With ``tensors`` false, an item holding a typed array (or tag 40) is refused naming its
    kind and field, and nothing is built from it: no tensor, no torch import (the handshake's
    frames, a coordinator's control links). Bytes equal to those of an item of a hot report
    kind decoded lately are answered from `MEMO` (decoding is a pure function of the bytes)."""
    if len(item) <= MEMO_MAX_ITEM:
        data = bytes(item)
        kept = MEMO.get(data)
        if kept is not None:
            return kept
        _check_limits(data)
    else:  # checked before it is copied: a head over its kind's cap is never copied
        _check_limits(item)
        data = bytes(item)
    tags = _TagDecoder(tensors=tensors)
    message = validate_message(_loads_exact(data, tags))
    if not tags.seen:
        MEMO.keep(data, message)
    return message


def decode_head(
    head: bytes | bytearray | memoryview, bulk_len: int, *, tensors: bool = True
) -> tuple[dict[str, Any], BulkSpec | None]:
    """Decode the part of an item before its bulk bytes; say what the bulk is.

    ``head`` is the item minus its last ``bulk_len`` bytes. Returns the validated message,
    whose ``data`` field is still missing, and the bulk's spec (``None`` when ``bulk_len`` is 0).
    With ``tensors`` false (see `decode_item`), a frame with a bulk is refused before its head
    is decoded.
    """
    if bulk_len == 0:
        return decode_item(head, tensors=tensors), None
    _check_limits(head)
    if not tensors:
        kind = peek_kind(head)
        what = f"{kind} frame" if kind is not None else "a frame"
        raise ProtocolError(f"{what} carries a bulk tensor of {bulk_len} bytes: {_NO_TENSORS_HERE}")
    head = bytes(head)
    header = _bstr_header(bulk_len)
    if not head.endswith(header):
        raise ProtocolError("frame's bulk bytes are not the byte string that ends its item")
    tags = _TagDecoder(bulk_len)
    message = _loads_exact(head[: -len(header)] + b"\x40", tags)
    if not isinstance(message, dict) or not message:
        raise ProtocolError("a frame must hold a CBOR map")
    last_key = next(reversed(message))
    deferred = message.get("data")
    if last_key != "data" or not isinstance(deferred, _Deferred) or tags.deferred != 1:
        raise ProtocolError("a frame's bulk bytes must be the typed array of its last field 'data'")
    spec = deferred.spec
    itemsize = spec.dtype.itemsize
    if math.prod(spec.shape) * itemsize != bulk_len:
        raise ProtocolError(
            f"bulk tensor of shape {list(spec.shape)} and dtype {spec.dtype} needs "
            f"{math.prod(spec.shape) * itemsize} bytes, the frame carries {bulk_len}"
        )
    del message["data"]
    validate_message(message, bulk="data")
    return message, spec


def decode_frame(
    frame: bytes, max_frame: int = DEFAULT_MAX_FRAME, *, tensors: bool = True
) -> dict[str, Any]:
    """Decode one whole frame (prefix included) into a validated message.

    A bulk tensor is materialised (copied) into ``message["data"]``. ``tensors`` false: as
    `decode_head`'s (a coordinator's control link: the frame's item is decoded as a
    `paramsync.runtime.transport.tcp.Connection` on such a link decodes it).
    """
    small = type(frame) is bytes and len(frame) <= PREFIX_SIZE + MEMO_MAX_ITEM
    if small and len(frame) > PREFIX_SIZE:
        item_len, bulk_len = _PREFIX.unpack_from(frame)
        if not bulk_len and item_len == len(frame) - PREFIX_SIZE and 0 < item_len <= max_frame:
            return decode_item(frame[PREFIX_SIZE:], tensors=tensors)  # what parse_prefix takes
    view = frame if small else memoryview(frame).cast("B")  # slices of a small one: copies
    if len(view) < PREFIX_SIZE:
        raise ProtocolError(f"frame of {len(view)} bytes is shorter than its prefix")
    item_len, bulk_len = parse_prefix(view[:PREFIX_SIZE], max_frame)
    if len(view) - PREFIX_SIZE != item_len:
        raise ProtocolError(
            f"frame announces a {item_len}-byte item but carries {len(view) - PREFIX_SIZE}"
        )
    if not bulk_len:  # a control frame: its item is its head
        return decode_item(view[PREFIX_SIZE:], tensors=tensors)
    item = view[PREFIX_SIZE:]
    message, spec = decode_head(item[: item_len - bulk_len], bulk_len, tensors=tensors)
    if spec is not None:
        message["data"] = _tensor_from_bytes(spec.dtype, spec.shape, item[item_len - bulk_len :])
    return message


def landed_as_sent(
    spec: BulkSpec | None, out: torch.Tensor, message: Mapping[str, Any]
) -> torch.Tensor:
    """``out`` once a message's tensor has landed in it (`check_bulk_destination` passed): ``out``
    itself, or ``out`` viewed in the sender's shape when that differs (same size, same storage),
    so that a receiver whose messages have shapes can refuse another one."""
    shape = spec.shape if spec is not None else tuple(message["data"].shape)
    return out if tuple(out.shape) == tuple(shape) else out.view(shape)


def check_bulk_destination(
    spec: BulkSpec | None, out: torch.Tensor, peer: object, message: Mapping[str, Any]
) -> None:
    """Refuse a bulk that does not fit the destination the receiver expects.

    Without a bulk, the message must carry an inline ``data`` tensor of the destination's
    dtype and size (an empty tensor travels inline)."""
    if spec is None:
        data = message.get("data")
        if is_tensor(data) and data.dtype == out.dtype and data.numel() == out.numel():
            return
        raise ProtocolError(
            f"{message.get('kind')} message does not carry the expected {out.dtype} tensor "
            f"of {out.numel()} elements",
            peer=peer,
        )
    if spec.dtype != out.dtype or spec.nbytes != out.numel() * out.element_size():
        raise ProtocolError(
            f"sent a {spec.dtype} tensor of shape {list(spec.shape)}, expected {out.dtype} "
            f"with {out.numel()} elements",
            peer=peer,
        )
