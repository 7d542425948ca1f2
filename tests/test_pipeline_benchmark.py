"""benchmarks/pipeline.py: the ideal speedup it measures against, and a tiny run of it that
must train every system and print its columns (no figure is asserted: the machine is shared)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "pipeline.py"


def _module():
    sys.path.insert(0, str(SCRIPT.parent))  # the script imports its sibling allreduce.py
    try:
        spec = importlib.util.spec_from_file_location("pipeline_benchmark", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def test_the_ideal_speedup_is_the_bubble_limit() -> None:
    bench = _module()
    assert bench.ideal_speedup(2, 8) == pytest.approx(16 / 9)  # 1.78x
    assert bench.ideal_speedup(4, 4) == pytest.approx(16 / 7)
    assert bench.ideal_speedup(1, 8) == 1.0


@pytest.mark.soak  # two systems of benchmark processes, about 20 s: make soak
def test_a_quick_run_times_every_system_and_prints_its_columns(tmp_path: Path) -> None:
    out = tmp_path / "pipeline.json"
    command = [sys.executable, str(SCRIPT), "--quick", "--schedules", "1f1b", "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    header = next(line for line in done.stdout.splitlines() if line.startswith("system"))
    for column in ("step", "loss", "speedup", "of ideal", "vs torch"):
        assert column in header
    table = json.loads(out.read_text())
    assert table["ideal_speedup"] == pytest.approx(16 / 9)
    rows = table["systems"]
    assert set(rows) == {"single", "paramsync-1f1b", "torch-1f1b", "limit-1f1b"}
    for row in rows.values():
        assert row["median_step_seconds"] > 0
    assert "of limit" in header
    limit = rows["limit-1f1b"]
    assert len(limit["busy_seconds"]) == 2 and min(limit["busy_seconds"]) > 0
    assert set(limit["stage_costs_seconds"]) == {"0", "1"}
    assert 0 < rows["paramsync-1f1b"]["fraction_of_limit"]
    assert 0 < rows["torch-1f1b"]["fraction_of_limit"]
    assert rows["paramsync-1f1b"]["ratio_to_torch"] > 0
    assert 0 < rows["paramsync-1f1b"]["fraction_of_ideal"]
    # the same model, data and micro-batches: paramsync's arithmetic is the single process's
    assert rows["paramsync-1f1b"]["loss"] == rows["single"]["loss"]
    assert rows["torch-1f1b"]["loss"] == pytest.approx(rows["single"]["loss"], rel=1e-5)


def test_each_schedule_has_its_own_ideal_and_the_simulator_predicts_it_at_unit_costs() -> None:
    bench = _module()
    assert bench.schedule_ideal_speedup("gpipe", 8) == pytest.approx(16 / 9)
    assert bench.schedule_ideal_speedup("1f1b", 8) == pytest.approx(16 / 9)
    assert bench.schedule_ideal_speedup("interleaved_1f1b", 8) == pytest.approx(32 / 17)
    zb_bubble = 1 - bench.schedule_ideal_speedup("zero_bubble", 8) / 2
    assert 0 < zb_bubble < (1 / 9) / 2  # ZB-H1: about a third of 1F1B's 1/9
    unit = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    for schedule in bench.SCHEDULES:
        bubble, speedup = bench.predicted(schedule, 8, unit)
        assert speedup == pytest.approx(bench.schedule_ideal_speedup(schedule, 8))
        assert speedup == pytest.approx(2 * (1 - bubble))
    # a weight pass dearer than the backward it splits shows in the prediction
    _, dear = bench.predicted("zero_bubble", 8, {"F": 1.0, "B": 2.0, "I": 1.0, "W": 2.0})
    assert dear < bench.schedule_ideal_speedup("zero_bubble", 8)


def test_the_limit_is_the_schedule_simulated_with_each_stage_s_measured_costs() -> None:
    """`limit_step`: the rounds' stage costs (medians) placed in the schedule by the simulator,
    plus the optimizer; at unit costs that is the unit model's step, and a slower last stage
    (the loss, the extra input gradient) makes the limit's step longer by the simulator's
    account, not by a formula."""
    bench = _module()
    args = bench.build_parser().parse_args(["--microbatches", "8"])

    def runs(last_forward: float) -> list[dict]:
        costs = {"0": {"F": 1.0, "B": 2.0}, "1": {"F": last_forward, "B": 2.0}}
        return [
            {"stage_costs": costs, "optimizer_seconds": 0.5, "step_seconds": [30.0]},
            {"stage_costs": costs, "optimizer_seconds": 1.5, "step_seconds": [31.0]},
        ]

    unit = bench.limit_step("1f1b", runs(1.0), args)
    assert unit["median_step_seconds"] == pytest.approx(27 + 1.0)  # (m + p - 1)(F + B) + opt
    assert unit["busy_seconds"] == [24.0, 24.0]
    assert unit["simulated_bubble_fraction"] == pytest.approx(1 / 9)
    slower = bench.limit_step("1f1b", runs(1.5), args)
    assert slower["median_step_seconds"] > unit["median_step_seconds"]
    assert slower["busy_seconds"] == [24.0, 28.0]


@pytest.mark.soak  # 40 s of benchmark processes: make soak
def test_a_quick_run_of_zero_bubble_and_interleaved_against_torch(tmp_path: Path) -> None:
    out = tmp_path / "pipeline.json"
    command = [sys.executable, str(SCRIPT), "--quick", "--json", str(out), "--schedules"]
    command += ["zero_bubble", "interleaved_1f1b"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    header = next(line for line in done.stdout.splitlines() if line.startswith("system"))
    for column in ("sim bubble", "sim speedup", "vs torch"):
        assert column in header
    table = json.loads(out.read_text())
    rows = table["systems"]
    assert set(rows) == {
        "single",
        "paramsync-zero_bubble",
        "torch-zero_bubble",
        "paramsync-interleaved_1f1b",
        "torch-interleaved_1f1b",
        "limit-zero_bubble",
        "limit-interleaved_1f1b",
    }
    # every stage's measured kinds: I and W for ZB-H1, F and B on each of the 4 interleaved stages
    assert set(rows["limit-zero_bubble"]["stage_costs_seconds"]["1"]) == {"F", "I", "W"}
    assert set(rows["limit-interleaved_1f1b"]["stage_costs_seconds"]) == {"0", "1", "2", "3"}
    assert set(table["costs_seconds"]) == {"F", "B", "I", "W"}
    for schedule in ("zero_bubble", "interleaved_1f1b"):
        ours, theirs = rows[f"paramsync-{schedule}"], rows[f"torch-{schedule}"]
        assert ours["ratio_to_torch"] > 0
        assert 0 < ours["predicted_bubble_fraction"] < 1
        assert ours["loss"] == rows["single"]["loss"]
        assert theirs["loss"] == pytest.approx(rows["single"]["loss"], rel=1e-5)
    assert rows["paramsync-interleaved_1f1b"]["chunks_per_rank"] == 2
