"""The checked maps of recently decoded control frames, by their bytes (sans-I/O).

Decoding a frame is a pure function of its item's bytes: the same bytes always decode to the
same map, pass or fail the same checks (`paramsync.runtime.protocol.wire.decode_item`: the
kind's size cap, the CBOR decoder's refusals, every field's type and range). A coordinator
hears the same bytes many times a step: a report carries no rank (the rank is the link's), so
every worker of a healthy run sends byte-identical ``ready``, ``digest`` and ``step_done``
frames, and every host the same ``host_digest``. `DecodeMemo` keeps the last few distinct
items of the hot report kinds that decoded and passed every check; an item whose bytes equal
a kept one (compared whole) is answered with a fresh copy of its map, checked values included,
without decoding or checking it again. Anything else (a new item, one that fails a check, a
frame with a tag or a bulk tensor, a kind not listed) goes through the full decoder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paramsync.runtime.protocol.schema import CheckedItem

__all__ = ["DecodeMemo", "MEMO_KINDS", "MEMO_MAX_ITEM", "MEMO_ENTRIES"]

MEMO_KINDS = frozenset(
    {
        # worker -> coordinator (and a host's sub-coordinator)
        "ready",
        "reduced",
        "digest",
        "step_done",
        "finished",
        # host -> root
        "host_ready",
        "host_reduced",
        "host_digest",
        "host_step_done",
        "host_finished",
        # root -> host, coordinator -> worker
        "go",
        "apply",
        "commit",
    }
)
"""The kinds whose items are kept: the per-step reports and answers, whose fields are plain
values (ints, text, bytes and lists of them), never a map or a tensor."""

MEMO_MAX_ITEM = 4096
"""The longest item kept, in bytes (a digest report listing its tensor names fits)."""

MEMO_ENTRIES = 64
"""How many distinct items are kept; the memo starts afresh when it is full."""


def _copy(value: list[Any]) -> list[Any]:
    """A copy of the list ``value`` and of the lists within it (their other elements are
    plain values, shared)."""
    return [_copy(element) if type(element) is list else element for element in value]


def _copy_rows(value: list[list[Any]]) -> list[list[Any]]:
    """`_copy` of a list of lists of plain values (a host's digest groups)."""
    return [row.copy() for row in value]


def _copier(value: list[Any]) -> Callable[[list[Any]], list[Any]]:
    """The cheapest copy of ``value`` whole: `list.copy` for a list of plain values,
    `_copy_rows` for a list of such lists, else `_copy`."""
    if not any(type(element) is list for element in value):
        return list.copy
    rows = all(
        type(row) is list and not any(type(element) is list for element in row) for row in value
    )
    return _copy_rows if rows else _copy


_set_item = dict.__setitem__
"""Sets an entry of a fresh `CheckedItem` (its checked values are given after)."""


class DecodeMemo:
    """Item bytes -> the map they decoded to and its checked values, for `MEMO_KINDS` (bounded by
    `MEMO_ENTRIES` and `MEMO_MAX_ITEM`). Safe to share between threads: a lookup and an
    insertion are single dict operations, and a kept map is never handed out itself."""

    def __init__(self) -> None:
        self._items: dict[bytes, tuple[dict[str, Any], Any, Any, tuple[tuple[str, Any], ...]]] = {}

    def __len__(self) -> int:
        return len(self._items)

    def get(self, data: bytes) -> CheckedItem | None:
        """A fresh copy of the map ``data`` decoded to (its lists copied too, so a caller
        may change it), or None when ``data`` is not kept."""
        kept = self._items.get(data)
        if kept is None:
            return None
        item, spec, values, nested = kept
        fresh = CheckedItem(item)
        for key, copy in nested:
            _set_item(fresh, key, copy(item[key]))
        fresh.checked_spec, fresh.checked_values = spec, values
        return fresh

    def keep(self, data: bytes, item: dict[str, Any]) -> None:
        """Keep ``item``, which ``data`` decoded to and which passed every check, if its kind
        is listed, ``data`` is short enough and ``item`` is a `CheckedItem` still unchanged."""
        if (
            len(data) > MEMO_MAX_ITEM
            or type(item) is not CheckedItem
            or item.checked_spec is None
            or item.get("kind") not in MEMO_KINDS
        ):
            return
        if len(self._items) >= MEMO_ENTRIES:
            self._items.clear()
        nested = tuple((k, _copier(v)) for k, v in item.items() if type(v) is list)
        kept = dict(item)  # its own copy: what the caller does with ``item`` changes nothing here
        for key, _ in nested:
            kept[key] = _copy(item[key])
        self._items[data] = (kept, item.checked_spec, item.checked_values, nested)

    def clear(self) -> None:
        self._items.clear()
