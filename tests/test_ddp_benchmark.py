"""benchmarks/ddp.py: its figures' helpers, and a tiny run of both systems end to end."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "ddp.py"


def _module():
    spec = importlib.util.spec_from_file_location("ddp_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_at_interpolates_between_the_samples_around_a_moment() -> None:
    bench = _module()
    samples = [(10.0, 1.0), (10.5, 2.0), (11.0, 2.5)]
    assert bench._cpu_at(samples, 10.25) == pytest.approx(1.5)
    assert bench._cpu_at(samples, 10.5) == pytest.approx(2.0)
    assert bench._cpu_at(samples, 11.0) == pytest.approx(2.5)
    assert bench._cpu_at(samples, 9.9) is None  # before the first sample: unknown
    assert bench._cpu_at(samples, 11.1) is None


def test_window_cpu_is_the_coordinators_cpu_per_step_over_rank_0s_window() -> None:
    bench = _module()
    samples = [(0.0, 0.0), (1.0, 0.1), (2.0, 0.3), (3.0, 0.4)]
    per_step = bench._window_cpu(samples, {"window": [0.5, 2.5]}, steps=10)
    assert per_step == pytest.approx((0.35 - 0.05) / 10)
    assert bench._window_cpu(samples, {"window": [0.5, 3.5]}, steps=10) is None


def test_round_ratios_pair_each_round_of_one_system_with_the_others() -> None:
    bench = _module()
    ours = [{"step_seconds": [1.0, 3.0, 2.0]}, {"step_seconds": [4.0]}]
    theirs = [{"step_seconds": [1.0, 1.0, 1.0]}, {"step_seconds": [2.0]}]
    assert bench._round_ratios(ours, theirs) == [2.0, 2.0]


def test_a_tiny_run_trains_both_systems_and_reports_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    command = [sys.executable, str(SCRIPT), "--worlds", "2", "--rounds", "1", "--steps", "4"]
    command += ["--warmup", "2", "--layers", "1", "--d-model", "32", "--context", "16"]
    command += ["--corpus-bytes", "200000", "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "paramsync / DDP round by round" in done.stdout
    table = json.loads(out.read_text())
    row = table["rows"][0]
    assert row["world_size"] == 2
    for system in ("ddp", "paramsync"):
        assert row[system]["median_step_seconds"] > 0
    assert row["paramsync"]["coordinator_cpu_seconds_per_step"] is not None
