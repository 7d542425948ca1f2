"""Tests for paramsync.runtime.observe.trace: event format, nesting, per-actor tracks, disabled
mode, merging."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import trio

from paramsync.runtime.observe.trace import TraceRecorder, load_trace, merge_traces


def by_phase(events: list[dict], ph: str) -> list[dict]:
    return [e for e in events if e["ph"] == ph]


def test_write_produces_valid_chrome_trace_json(tmp_path: Path) -> None:
    rec = TraceRecorder("rank0", pid=0)
    with rec.span("step", actor="trainer", step=1):
        time.sleep(0.002)
    rec.instant("checkpoint", actor="trainer", path="x.pt")
    rec.counter("loss", train=2.5)
    out = rec.write(tmp_path / "sub" / "trace.json")
    data = json.loads(out.read_text())
    assert set(data) == {"traceEvents", "displayTimeUnit"}
    assert data["displayTimeUnit"] == "ms"
    events = data["traceEvents"]
    for event in events:
        assert {"name", "ph", "ts", "pid", "tid"} <= set(event)
        assert isinstance(event["ts"], int | float)
    (span,) = by_phase(events, "X")
    assert span["name"] == "step" and span["args"] == {"step": 1}
    assert 2000 <= span["dur"] < 2_000_000  # microseconds
    (inst,) = by_phase(events, "i")
    assert inst["s"] == "t" and inst["args"] == {"path": "x.pt"}
    (ctr,) = by_phase(events, "C")
    assert ctr["args"] == {"train": 2.5}
    names = {(e["name"], e["args"].get("name")) for e in by_phase(events, "M")}
    assert ("process_name", "rank0") in names
    assert ("thread_name", "trainer") in names
    assert not list(tmp_path.glob("sub/.*.tmp"))


def test_timestamps_are_microseconds_since_epoch() -> None:
    epoch = time.perf_counter_ns()
    rec = TraceRecorder("p", pid=1, epoch_ns=epoch)
    with rec.span("a"):
        pass
    (span,) = by_phase(rec.events(), "X")
    elapsed_us = (time.perf_counter_ns() - epoch) / 1000
    assert 0 <= span["ts"] <= elapsed_us
    assert 0 <= rec.now_us() - elapsed_us < 1_000_000


def test_nested_spans_nest_in_time() -> None:
    rec = TraceRecorder("p", pid=1)
    with rec.span("outer", actor="a"):
        time.sleep(0.001)
        with rec.span("inner", actor="a") as inner:
            inner.set(bytes=10)
            time.sleep(0.001)
        time.sleep(0.001)
    spans = {e["name"]: e for e in by_phase(rec.events(), "X")}
    outer, inner_ev = spans["outer"], spans["inner"]
    assert outer["tid"] == inner_ev["tid"]
    assert outer["ts"] < inner_ev["ts"]
    assert inner_ev["ts"] + inner_ev["dur"] < outer["ts"] + outer["dur"]
    assert inner_ev["args"] == {"bytes": 10}


def test_each_actor_gets_its_own_named_track() -> None:
    rec = TraceRecorder("p", pid=3)
    for actor in ["comm", "trainer", "comm", "loader"]:
        with rec.span("work", actor=actor):
            pass
    tids = [e["tid"] for e in by_phase(rec.events(), "X")]
    assert tids == [1, 2, 1, 3]
    thread_names = {
        e["tid"]: e["args"]["name"] for e in rec.metadata() if e["name"] == "thread_name"
    }
    assert thread_names == {1: "comm", 2: "trainer", 3: "loader"}
    assert all(e["pid"] == 3 for e in rec.events())


def test_exception_in_span_is_recorded_and_propagates() -> None:
    rec = TraceRecorder("p", pid=0)
    with pytest.raises(KeyError), rec.span("boom"):
        raise KeyError("x")
    (span,) = by_phase(rec.events(), "X")
    assert span["args"]["error"] == "KeyError"


async def test_span_can_cover_awaits_in_trio_tasks() -> None:
    rec = TraceRecorder("p", pid=0)

    async def actor(name: str) -> None:
        with rec.span("recv", actor=name):
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor, "a")
        nursery.start_soon(actor, "b")
    spans = by_phase(rec.events(), "X")
    assert sorted(e["tid"] for e in spans) == [1, 2]
    assert all(e["dur"] >= 10_000 for e in spans)


def test_disabled_recorder_is_a_cheap_no_op(tmp_path: Path) -> None:
    rec = TraceRecorder.disabled("p", pid=0)
    assert not rec.enabled
    start = time.perf_counter()
    for i in range(20_000):
        with rec.span("step", actor="trainer", i=i) as span:
            span.set(loss=1.0)
    elapsed = time.perf_counter() - start
    rec.instant("x")
    rec.counter("loss", v=float("nan"))  # not even validated when disabled
    rec.complete("c", 0, 1)
    assert len(rec) == 0
    assert rec.span("a") is rec.span("b")  # one shared object, nothing allocated
    assert elapsed < 1.0
    data = json.loads(rec.write(tmp_path / "t.json").read_text())
    assert by_phase(data["traceEvents"], "X") == []


def test_complete_and_validation() -> None:
    rec = TraceRecorder("p", pid=0)
    t0 = time.perf_counter_ns()
    rec.complete("send", t0, t0 + 5000, actor="comm", peer=1)
    (span,) = by_phase(rec.events(), "X")
    assert span["dur"] == 5.0
    with pytest.raises(ValueError, match="before it starts"):
        rec.complete("bad", 10, 5)
    with pytest.raises(ValueError, match="scope"):
        rec.instant("x", scope="q")
    with pytest.raises(ValueError, match="not a number"):
        rec.counter("loss", v="high")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not finite"):
        rec.counter("loss", v=float("inf"))
    with pytest.raises(ValueError, match="at least one"):
        rec.counter("loss")
    with pytest.raises(ValueError, match="pid"):
        TraceRecorder("p", pid="0")  # type: ignore[arg-type]


def test_max_events_drops_and_counts(tmp_path: Path) -> None:
    rec = TraceRecorder("p", pid=0, max_events=3)
    for _ in range(5):
        rec.instant("tick")
    assert len(rec) == 3 and rec.dropped == 2
    data = json.loads(rec.write(tmp_path / "t.json").read_text())
    assert data["otherData"] == {"dropped_events": 2}
    rec.clear()
    assert len(rec) == 0 and rec.dropped == 0


def test_unserialisable_args_are_written_as_repr(tmp_path: Path) -> None:
    rec = TraceRecorder("p", pid=0)
    rec.instant("x", obj=object)
    (inst,) = by_phase(load_trace(rec.write(tmp_path / "t.json")), "i")
    assert inst["args"]["obj"] == repr(object)


def test_merge_combines_processes_on_one_timeline(tmp_path: Path) -> None:
    paths = []
    for rank in range(3):
        rec = TraceRecorder(f"rank{rank}", pid=rank)
        with rec.span("step", actor="trainer"):
            time.sleep(0.001)
        paths.append(rec.write(tmp_path / f"rank{rank}.json"))
    out = merge_traces(paths, tmp_path / "merged.json")
    data = json.loads(out.read_text())
    events = data["traceEvents"]
    spans = by_phase(events, "X")
    assert sorted(e["pid"] for e in spans) == [0, 1, 2]
    assert min(e["ts"] for e in spans) == 0  # rebased
    assert [e["ts"] for e in spans] == sorted(e["ts"] for e in spans)
    # Rank 0 ran first, so it stays first after merging: relative timing is kept.
    assert spans[0]["pid"] == 0 and spans[1]["ts"] >= 1000
    process_names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert process_names == {0: "rank0", 1: "rank1", 2: "rank2"}


def test_merge_renumbers_colliding_pids_and_can_keep_timestamps(tmp_path: Path) -> None:
    a = TraceRecorder("a", pid=7)
    b = TraceRecorder("b", pid=7)
    a.instant("x")
    b.instant("y")
    pa, pb = a.write(tmp_path / "a.json"), b.write(tmp_path / "b.json")
    events = load_trace(merge_traces([pa, pb], tmp_path / "m.json", rebase=False))
    pids = {e["name"]: e["pid"] for e in by_phase(events, "i")}
    assert pids == {"x": 7, "y": 8}
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {7: "a", 8: "b"}
    ts = {e["name"]: e["ts"] for e in by_phase(events, "i")}
    assert ts["x"] == by_phase(a.events(), "i")[0]["ts"]


def test_merge_accepts_bare_arrays_and_rejects_garbage(tmp_path: Path) -> None:
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps([{"name": "x", "ph": "i", "ts": 5, "pid": 1, "tid": 1}]))
    assert len(load_trace(merge_traces([bare], tmp_path / "m.json"))) == 1
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json"):
        merge_traces([bare, bad], tmp_path / "m2.json")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"traceEvents": 3}))
    with pytest.raises(ValueError, match=r"wrong\.json"):
        load_trace(wrong)
    with pytest.raises(ValueError, match="at least one"):
        merge_traces([], tmp_path / "m3.json")
