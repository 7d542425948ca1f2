"""Chrome trace-event recording, for viewing a training run in Perfetto or chrome://tracing.

Each process owns one `TraceRecorder` (``pid`` = its rank, say); each actor in it gets its own
track (``tid``), named by a ``thread_name`` metadata event. Spans are complete events
(``"ph": "X"``) timed with ``time.perf_counter_ns``. On Linux that clock is the system-wide
monotonic clock, so with the default ``epoch_ns=0`` the files written by several processes on
one host line up, and `merge_traces` combines them into one view. A disabled recorder
(`TraceRecorder.disabled`) hands out one shared no-op span, so tracing calls can stay in hot
loops.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["Span", "TraceRecorder", "load_trace", "merge_traces"]

_INSTANT_SCOPES = ("t", "p", "g")


class Span:
    """An open span; `set` adds arguments before it closes. Returned by `TraceRecorder.span`."""

    __slots__ = ("_args", "_name", "_recorder", "_start", "_tid")

    def __init__(self, recorder: TraceRecorder, name: str, tid: int, args: dict[str, Any]):
        self._recorder = recorder
        self._name = name
        self._tid = tid
        self._args = args
        self._start = 0

    def set(self, **args: Any) -> None:
        """Attach more arguments (a loss, a byte count) to the event this span records."""
        self._args.update(args)

    def __enter__(self) -> Span:
        self._start = time.perf_counter_ns()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        end = time.perf_counter_ns()
        if exc_type is not None:
            self._args["error"] = exc_type.__name__
        self._recorder.record_span(self._name, self._tid, self._start, end, self._args)


class _NullSpan(Span):
    """The span a disabled recorder returns: records nothing, allocates nothing per call."""

    __slots__ = ()

    def __init__(self) -> None:
        pass

    def set(self, **args: Any) -> None:
        """Ignore the arguments."""

    def __enter__(self) -> Span:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None


_NULL_SPAN = _NullSpan()


class TraceRecorder:
    """Collects trace events of one process; `write` saves them as a Chrome trace JSON file.

    ``pid`` groups the tracks of this process in the viewer (use the rank). Timestamps are
    microseconds since ``epoch_ns`` on the ``time.perf_counter_ns`` clock. After
    ``max_events`` events further ones are dropped and counted in `dropped`.
    """

    def __init__(
        self,
        process_name: str = "paramsync",
        pid: int | None = None,
        *,
        enabled: bool = True,
        epoch_ns: int = 0,
        max_events: int = 1_000_000,
    ) -> None:
        if isinstance(pid, bool) or not isinstance(pid, int | None):
            raise ValueError(f"pid must be an int, got {pid!r}")
        if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 0:
            raise ValueError(f"max_events must be a non-negative int, got {max_events!r}")
        self.process_name = str(process_name)
        self.pid = os.getpid() if pid is None else pid
        self.epoch_ns = int(epoch_ns)
        self.max_events = max_events
        self._enabled = bool(enabled)
        self._events: list[dict[str, Any]] = []
        self._tids: dict[str, int] = {}
        self._lock = threading.Lock()
        self._dropped = 0

    @classmethod
    def disabled(cls, process_name: str = "paramsync", pid: int | None = None) -> TraceRecorder:
        """A recorder whose every call is a cheap no-op."""
        return cls(process_name, pid, enabled=False)

    @property
    def enabled(self) -> bool:
        """Whether calls record anything."""
        return self._enabled

    @property
    def dropped(self) -> int:
        """How many events were discarded because ``max_events`` was reached."""
        return self._dropped

    def __len__(self) -> int:
        return len(self._events)

    def now_us(self) -> float:
        """The current trace timestamp, in microseconds since the epoch."""
        return (time.perf_counter_ns() - self.epoch_ns) / 1000

    def tid(self, actor: str) -> int:
        """The track id of ``actor`` (assigned 1, 2, ... in order of first use)."""
        tid = self._tids.get(actor)
        if tid is None:
            with self._lock:
                tid = self._tids.setdefault(actor, len(self._tids) + 1)
        return tid

    def span(self, name: str, actor: str = "main", **args: Any) -> Span:
        """Context manager timing its body as one complete event on ``actor``'s track.

        Works around ``await``s too: the span covers wall time from enter to exit. An
        exception passing through is noted as ``args["error"]`` and re-raised.
        """
        if not self._enabled:
            return _NULL_SPAN
        return Span(self, name, self.tid(actor), args)

    def complete(
        self, name: str, start_ns: int, end_ns: int, actor: str = "main", **args: Any
    ) -> None:
        """Record a span whose ``perf_counter_ns`` start and end were measured elsewhere."""
        if not self._enabled:
            return
        if end_ns < start_ns:
            raise ValueError(f"span {name!r} ends ({end_ns}) before it starts ({start_ns})")
        self.record_span(name, self.tid(actor), start_ns, end_ns, args)

    def instant(self, name: str, actor: str = "main", scope: str = "t", **args: Any) -> None:
        """Record a moment (``"ph": "i"``); ``scope`` is t(hread), p(rocess) or g(lobal)."""
        if not self._enabled:
            return
        if scope not in _INSTANT_SCOPES:
            raise ValueError(f"instant scope must be one of {_INSTANT_SCOPES}, got {scope!r}")
        event = {"name": name, "ph": "i", "s": scope, "ts": self.now_us(), "pid": self.pid}
        event["tid"] = self.tid(actor)
        if args:
            event["args"] = args
        self._append(event)

    def counter(self, name: str, **values: float) -> None:
        """Record numeric series (``"ph": "C"``), drawn as a chart, e.g. ``counter("loss",
        train=2.31)``. Non-finite or non-numeric values raise ``ValueError``."""
        if not self._enabled:
            return
        if not values:
            raise ValueError(f"counter {name!r} needs at least one value")
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"counter {name!r}: {key}={value!r} is not a number")
            if not math.isfinite(value):
                raise ValueError(f"counter {name!r}: {key}={value!r} is not finite")
        event = {"name": name, "ph": "C", "ts": self.now_us(), "pid": self.pid, "tid": 0}
        event["args"] = dict(values)
        self._append(event)

    def record_span(
        self, name: str, tid: int, start_ns: int, end_ns: int, args: dict[str, Any]
    ) -> None:
        """Record a finished span on the trace's thread ``tid`` (`tid`), as the spans this
        recorder hands out do when they end; `complete` is the same by actor name."""
        event = {
            "name": name,
            "ph": "X",
            "ts": (start_ns - self.epoch_ns) / 1000,
            "dur": (end_ns - start_ns) / 1000,
            "pid": self.pid,
            "tid": tid,
        }
        if args:
            event["args"] = args
        self._append(event)

    def _append(self, event: dict[str, Any]) -> None:
        if len(self._events) >= self.max_events:
            self._dropped += 1
            return
        self._events.append(event)

    def metadata(self) -> list[dict[str, Any]]:
        """The ``"ph": "M"`` events naming this process and each actor's track."""
        meta: list[dict[str, Any]] = [
            _meta("process_name", self.pid, 0, name=self.process_name),
            _meta("process_sort_index", self.pid, 0, sort_index=self.pid),
        ]
        for actor, tid in sorted(self._tids.items(), key=lambda item: item[1]):
            meta.append(_meta("thread_name", self.pid, tid, name=actor))
            meta.append(_meta("thread_sort_index", self.pid, tid, sort_index=tid))
        return meta

    def events(self) -> list[dict[str, Any]]:
        """Metadata events followed by every recorded event (a copy of the list)."""
        return self.metadata() + list(self._events)

    def to_json(self) -> dict[str, Any]:
        """The trace as the JSON object format Perfetto and chrome://tracing open."""
        trace: dict[str, Any] = {"traceEvents": self.events(), "displayTimeUnit": "ms"}
        if self._dropped:
            trace["otherData"] = {"dropped_events": self._dropped}
        return trace

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the trace JSON to ``path`` (atomically, creating directories); returns it."""
        return _write_json(Path(path), self.to_json())

    def clear(self) -> None:
        """Forget recorded events (actor track ids are kept)."""
        self._events = []
        self._dropped = 0


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def _write_json(path: Path, obj: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        json.dump(obj, fh, separators=(",", ":"), default=repr)
    os.replace(tmp, path)
    return path


def load_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a Chrome trace file (object or bare-array form); ``ValueError`` naming
    the file when it is not one."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{os.fspath(path)}: not a JSON trace: {exc}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ValueError(f"{os.fspath(path)}: expected a traceEvents list of objects")
    return events


def merge_traces(
    paths: Iterable[str | os.PathLike[str]],
    out_path: str | os.PathLike[str],
    *,
    rebase: bool = True,
) -> Path:
    """Combine several processes' trace files into one, for a single timeline.

    A pid that an earlier file already used is renumbered (to the next free pid) so that
    processes never share tracks. With ``rebase`` every timestamp is shifted by the same
    amount so the earliest event is at 0 (relative timing between files is kept).
    """
    merged: list[dict[str, Any]] = []
    used: set[int] = set()
    paths = list(paths)
    if not paths:
        raise ValueError("merge_traces needs at least one trace file")
    for path in paths:
        events = load_trace(path)
        pids: set[int] = {e["pid"] for e in events if isinstance(e.get("pid"), int)}
        remap: dict[int, int] = {}
        if pids & used:
            next_pid = max(used | pids) + 1
            for pid in sorted(pids):
                if pid in used:
                    remap[pid] = next_pid
                    next_pid += 1
        for event in events:
            event_pid = event.get("pid")
            if isinstance(event_pid, int) and event_pid in remap:
                event = {**event, "pid": remap[event_pid]}
            merged.append(event)
        used |= {remap.get(p, p) for p in pids}
    if rebase:
        stamps = [
            e["ts"] for e in merged if e.get("ph") != "M" and isinstance(e.get("ts"), int | float)
        ]
        if stamps:
            origin = min(stamps)
            merged = [
                {**e, "ts": e["ts"] - origin}
                if e.get("ph") != "M" and isinstance(e.get("ts"), int | float)
                else e
                for e in merged
            ]
    meta = [e for e in merged if e.get("ph") == "M"]
    rest = [e for e in merged if e.get("ph") != "M"]
    rest.sort(key=lambda e: e.get("ts", 0) if isinstance(e.get("ts"), int | float) else 0)
    return _write_json(Path(out_path), {"traceEvents": meta + rest, "displayTimeUnit": "ms"})
