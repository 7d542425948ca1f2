"""``make demo-3d`` in small: 4 processes (dp=2 x pp=2) for 3 steps of a tiny model, over TCP,
with the coordinator checking the replicas (and, under ``make soak``, without it: in band).

The demo must exit 0, every rank must have passed the replica check after every step, and the
merged trace must show, for every process, the forwards and backwards of its own pipeline stage
for every micro-batch and the idle time waiting for its peer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paramsync.actors.demo_job.demo3d import main

STEPS = 3
MICRO_BATCHES = 4


@pytest.mark.parametrize(
    "coordinator",
    [
        pytest.param("--coordinator", id="coordinator-checks"),
        pytest.param("--no-coordinator", id="in-band-checks", marks=pytest.mark.soak),
    ],
)
def test_demo3d_runs_checks_every_step_and_traces_every_stage(
    tmp_path: Path, coordinator: str
) -> None:
    out = tmp_path / "demo3d"
    code = main(
        [
            coordinator,
            f"--steps={STEPS}",
            f"--micro-batches={MICRO_BATCHES}",
            f"--out={out}",
            "--worker-args=--d-model 16 --heads 2 --layers 2 --context 16 --batch-size 8 "
            "--corpus-bytes 20000",
        ]
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["steps"] == STEPS
    assert summary["checks_passed"] == STEPS and summary["losses_agree"]
    checker = "coordinator" if coordinator == "--coordinator" else "in band (dp all-gather)"
    assert {rank["checked_by"] for rank in summary["ranks"]} == {checker}
    assert summary["layout"] == {
        "dp": 2,
        "tp": 1,
        "pp": 2,
        "schedule": "1f1b",
        "micro_batches": MICRO_BATCHES,
    }
    shares = summary["time_shares"]
    assert sorted(shares) == ["0", "1", "2", "3"]
    for row in shares.values():
        assert row["compute"] > 0 and row["idle"] > 0 and row["optimizer"] > 0
        assert row["compute"] + row["idle"] + row["optimizer"] <= 1.0 + 1e-9
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    stage_of = {s["rank"]: s["coordinates"]["pp"] for s in summary["ranks"]}
    spans: dict[int, list[str]] = {}
    for event in events:
        if event.get("ph") == "X":
            spans.setdefault(event["pid"], []).append(event["name"])
    assert sorted(spans) == [0, 1, 2, 3]
    for rank, names in spans.items():
        stage = stage_of[rank]
        for mb in range(MICRO_BATCHES):
            assert names.count(f"F s{stage} mb{mb}") == STEPS, (rank, mb)
            assert names.count(f"B s{stage} mb{mb}") == STEPS, (rank, mb)
        assert "idle" in names and names.count("step") == STEPS
        assert names.count("replica check") == STEPS
