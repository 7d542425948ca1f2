"""The fold digest ("fold31x4"): per-tensor digests computed with torch ops on the tensors' own
device, in exact integer arithmetic, so CPU and CUDA give the same bits for the same bytes.

docs/digest.md specifies it. Each entry (a named tensor) is the sequence of its header's
16-bit words followed by its data's 16-bit words (the bytes of the tensor in logical element
order, little-endian pairs, zero-padded to an even count); each of four lanes is

    lane_l = sum_i word_i * base_l ** i  (mod 2**31 - 1)

with ``base_l = 7 ** EXPONENTS[l]``, a primitive root. The entry's digest is the four lanes as
little-endian 32-bit words (16 bytes). Every product and sum is an int64 below 2**63, and integer
addition is associative, so the reduction order, kernel and device cannot change a bit.

The data's lanes are computed on the device in one pass over the state (`FoldLayout`), the
header's on the host once per layout; ``fold(header || data) = fold(header) + base ** h *
fold(data)`` joins them, ``h`` the header's word count. Only the lanes (32 bytes a tensor)
cross to the host, through `DeviceReadback`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from paramsync.runtime.transport.device_ops import DeviceOps, context_device_ops

__all__ = [
    "BASES",
    "EXPONENTS",
    "FOLD_NAME",
    "LANES",
    "MAX_WORDS",
    "MODULUS",
    "DeviceReadback",
    "DIGEST_PURPOSE",
    "FoldLayout",
    "entry_header",
    "fold_digests",
    "fold_words",
    "pack_lanes",
    "words_of",
]

FOLD_NAME = "fold31x4"
"""The algorithm's name in a digest report."""
MODULUS = 2**31 - 1
"""The prime every lane is reduced by."""
EXPONENTS = (13, 17, 19, 23)
"""The first four exponents above 12 coprime to ``MODULUS - 1``: each ``7 ** k`` is a
primitive root, and ``gcd(17 - 13, MODULUS - 1) == 2`` (docs/digest.md, the guarantees)."""
BASES = tuple(pow(7, k, MODULUS) for k in EXPONENTS)
"""Each lane's base: ``7 ** k mod MODULUS`` for k in `EXPONENTS`."""
LANES = len(BASES)
MAX_WORDS = MODULUS - 1
"""The most words (header and data) an entry may hold: positions below ``MODULUS - 1`` have
distinct keys (the bases' order). Above it (a tensor of about 4 GiB) the fold refuses."""

_COLUMNS = 256
"""Words per row of the device computation: a row's products sum below 2**55."""
_BLOCK_ROWS = 4096
"""Rows reduced per block: the (rows, columns, lanes) int64 products stay at 32 MiB."""
_BATCH_BYTES = 1 << 26
"""Tensors are concatenated into batches of about this many bytes (one larger tensor is a
batch of its own)."""


def entry_header(name: str, shape: Sequence[int], dtype: torch.dtype) -> bytes:
    """The header of an entry: ``name|[d0, d1]|torch.float32|`` in UTF-8 (the XXH3 path's
    seed text)."""
    return f"{name}|{list(shape)}|{dtype}|".encode()


def words_of(data: bytes) -> list[int]:
    """``data`` as unsigned 16-bit little-endian words, a zero byte appended to an odd count."""
    if len(data) % 2:
        data += b"\0"
    return np.frombuffer(data, dtype="<u2").astype(np.int64).tolist()


def fold_words(words: Sequence[int], start: int = 0) -> tuple[int, ...]:
    """The lanes of ``words`` placed from position ``start`` on (plain Python integers: the
    reference the device computation must agree with)."""
    lanes = []
    for base in BASES:
        key = pow(base, start, MODULUS)
        total = 0
        for word in words:
            total = (total + word * key) % MODULUS
            key = key * base % MODULUS
        lanes.append(total)
    return tuple(lanes)


def pack_lanes(lanes: Sequence[int]) -> bytes:
    """An entry's digest: its lanes as little-endian unsigned 32-bit words."""
    return np.asarray(lanes, dtype="<u4").tobytes()


def _powers(base: int, count: int) -> torch.Tensor:
    """``base ** i mod MODULUS`` for i below ``count``, int64 (by doubling: log2(count) ops)."""
    table = torch.ones(1, dtype=torch.int64)
    step = base % MODULUS
    while table.numel() < count:
        table = torch.cat((table, table * step % MODULUS))
        step = step * step % MODULUS
    return table[:count]


def _data_words(tensor: torch.Tensor) -> int:
    """The data words of ``tensor``: its bytes, halved, rounded up."""
    return (tensor.numel() * tensor.element_size() + 1) // 2


class FoldLayout:
    """The device-side tables for one layout of a state's tensors on one device: the entries'
    headers, shapes and dtypes, in order. `launch` enqueues the fold of tensors of exactly this
    layout and returns their lanes, (entries, 4) int64 on the device.

    Each entry's data words are zero-padded to whole rows of 256 words (the padding adds nothing
    to a sum); a row's products with its columns' keys are summed and reduced, multiplied by the
    row's key (``base ** (256 * row)``) and reduced, then added into its entry."""

    def __init__(self, headers: Sequence[bytes], tensors: Sequence[torch.Tensor]) -> None:
        device = tensors[0].device if tensors else torch.device("cpu")
        self.device = device
        self._integer_mm = device.type == "cpu"
        self.signature = [(t.shape, t.dtype) for t in tensors]
        self.check(headers, tensors)
        words = [_data_words(t) for t in tensors]
        header_words = [words_of(h) for h in headers]
        rows = [-(-count // _COLUMNS) for count in words]
        self.pads = [r * _COLUMNS * 2 - t.numel() * t.element_size() for r, t in zip(rows, tensors)]
        self.row_entry = torch.repeat_interleave(
            torch.arange(len(rows), dtype=torch.int64), torch.tensor(rows, dtype=torch.int64)
        ).to(device)
        within = torch.cat([torch.arange(r, dtype=torch.int64) for r in rows] or [_EMPTY])
        most = max(rows, default=0)
        self.row_keys = torch.stack(
            [_powers(pow(base, _COLUMNS, MODULUS), most)[within] for base in BASES], dim=1
        ).to(device)
        self.column_keys = torch.stack([_powers(base, _COLUMNS) for base in BASES], dim=1).to(
            device
        )
        self.zeros = torch.zeros(max(self.pads, default=0), dtype=torch.uint8, device=device)
        self.batches = _batches([r * _COLUMNS * 2 for r in rows])
        self.rows = sum(rows)
        # The header's lanes and base ** h, joined with the data's lanes on the host.
        self.header_lanes = np.array([fold_words(head) for head in header_words], dtype=np.int64)
        self.shifts = np.array(
            [[pow(base, len(head), MODULUS) for base in BASES] for head in header_words],
            dtype=np.int64,
        ).reshape(len(headers), LANES)
        self.header_lanes = self.header_lanes.reshape(len(headers), LANES)

    @staticmethod
    def check(headers: Sequence[bytes], tensors: Sequence[torch.Tensor]) -> None:
        """ValueError naming the first entry whose header and data words exceed `MAX_WORDS`."""
        for header, tensor in zip(headers, tensors, strict=True):
            count = (len(header) + 1) // 2 + _data_words(tensor)
            if count > MAX_WORDS:
                raise ValueError(
                    f"{header.decode(errors='replace')}: {count} words, over the fold digest's "
                    f"limit of {MAX_WORDS} (use the xxh3 state digest for this state)"
                )

    def fits(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` have this layout's shapes and dtypes, in order, on its device."""
        return len(tensors) == len(self.signature) and all(
            t.shape == shape and t.dtype == dtype and t.device == self.device
            for t, (shape, dtype) in zip(tensors, self.signature)
        )

    def launch(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Enqueue the fold of ``tensors``' data words on their device: (entries, 4) int64
        lanes, each below ``MODULUS``."""
        lanes = torch.zeros(len(tensors), LANES, dtype=torch.int64, device=self.device)
        row = 0
        for first, last in self.batches:
            pieces: list[torch.Tensor] = []
            for index in range(first, last):
                pieces.append(tensors[index].detach().contiguous().view(-1).view(torch.uint8))
                if self.pads[index]:
                    pieces.append(self.zeros[: self.pads[index]])
            if not pieces:
                continue
            flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            grid = flat.view(torch.int16).view(-1, _COLUMNS)
            for start in range(0, grid.shape[0], _BLOCK_ROWS):
                block = grid[start : start + _BLOCK_ROWS]
                at = slice(row + start, row + start + block.shape[0])
                words = block.to(torch.int64).bitwise_and_(0xFFFF)
                # word < 2**16, key < 2**31: a row of 256 products sums below 2**55. The CPU
                # has an int64 matrix product (exact, five times faster); CUDA has none.
                if self._integer_mm:
                    sums = (words @ self.column_keys).remainder_(MODULUS)
                else:
                    sums = (words.unsqueeze(2) * self.column_keys).sum(dim=1).remainder_(MODULUS)
                sums.mul_(self.row_keys[at]).remainder_(MODULUS)
                # At most 2**23 rows an entry, each below 2**31: below 2**54 before the last mod.
                lanes.index_add_(0, self.row_entry[at], sums)
            row += grid.shape[0]
        return lanes.remainder_(MODULUS)

    def entries(self, data_lanes: np.ndarray) -> list[bytes]:
        """Each entry's digest from its data's lanes (as `launch` gave them, on the host): the
        header's lanes joined with the data's, packed."""
        joined = (self.header_lanes + self.shifts * data_lanes) % MODULUS
        packed = joined.astype("<u4").tobytes()
        size = 4 * LANES
        return [packed[i * size : (i + 1) * size] for i in range(len(joined))]


_EMPTY = torch.zeros(0, dtype=torch.int64)


def _batches(sizes: list[int]) -> list[tuple[int, int]]:
    """Consecutive index ranges of ``sizes`` summing to about `_BATCH_BYTES` each."""
    batches: list[tuple[int, int]] = []
    first, total = 0, 0
    for index, size in enumerate(sizes):
        if total and total + size > _BATCH_BYTES:
            batches.append((first, index))
            first, total = index, 0
        total += size
    if first < len(sizes):
        batches.append((first, len(sizes)))
    return batches


DIGEST_PURPOSE = "digest"
"""The purpose a digest's copy to the host is recorded under (`DeviceOps.copy_to_host`)."""


class DeviceReadback:
    """Where a fold's lanes cross from their device to the host, the only device calls of the
    digest path, all through the device-operations seam (`DeviceOps`: the context's, else
    CUDA's): for a result on the device, a pinned host buffer, a non-blocking copy on the
    current stream (purpose ``"digest"``) and the event recorded after it; `result` is read
    once that event has completed (polled, never a stream or device synchronize). A result on
    the host is read as it is."""

    __slots__ = ("_event", "_host", "_ops")

    def __init__(self, result: torch.Tensor, ops: DeviceOps | None = None) -> None:
        self._ops = context_device_ops() if ops is None else ops
        self._event: Any = None
        if not self._ops.on_device(result):
            self._host = result
            return
        pinned = self._ops.pinned_empty(result.numel(), result.dtype)
        self._host = pinned.view(result.shape)
        stream = self._ops.current_stream(result.device)
        self._event = self._ops.copy_to_host(result, self._host, stream, DIGEST_PURPOSE)

    def ready(self) -> bool:
        """Whether the copy has landed on the host."""
        return self._event is None or bool(self._ops.query(self._event))

    def result(self) -> np.ndarray:
        """The lanes on the host, once the copy has landed (waiting for it, polled)."""
        pause = 1e-5
        while not self.ready():
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return self._host.numpy()


def fold_digests(named: Sequence[tuple[str, torch.Tensor]]) -> list[bytes]:
    """Each named tensor's fold digest, computed at once (the tensors all on one device)."""
    tensors = [tensor.detach() for _, tensor in named]
    layout = FoldLayout([entry_header(n, t.shape, t.dtype) for n, t in named], tensors)
    return layout.entries(DeviceReadback(layout.launch(tensors)).result())
