"""benchmarks/loop_profile.py runs a small training and reports every process's event loop."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import loop_profile  # noqa: E402


@pytest.mark.soak  # a 30 s profiling run: make soak
def test_loop_profile_reports_each_process_and_the_hot_parts() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "loop_profile.py"), "--world", "2"]
    command += ["--steps", "400", "--window", "5", "8", "--top", "3"]  # the run outlasts 8 s
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("2 workers,") and "steps/s" in lines[0]
    for name in ("coordinator", "rank 0", "rank 1"):
        line = next(line for line in lines if line.startswith(f"  {name}: process "))
        assert float(line.split("event loop ")[1].split(",")[0]) > 0, line
    parts = lines[lines.index("rank 1, parts (ms a step):") + 1 :]
    names = {part.split()[-1] for part in parts[:8]}
    # The plane's copies and sums: split among the ranks, or (a small all-reduce, as here)
    # summed whole by every rank after one signal.
    assert "copy_in" in names and names & {"reduce", "reduce_whole"}, names
    assert any("actor:gradient-comm" in line for line in lines)
    assert any(line.strip().endswith("handle") for line in lines)  # the coordinator's core
    # The contracts' own work: every rank hashes its state (on the optimizer's thread).
    floor = lines[lines.index("the contracts' own work, CPU a step (ms), " + _cores()) + 1 :]
    for name in ("rank 0", "rank 1"):
        line = next(line for line in floor if line.startswith(f"  {name}: "))
        assert "digest " in line and "copy_in " in line, line
    assert any("% of this run's step" in line for line in floor)


def _cores() -> str:
    return f"{os.cpu_count() or 1} cores:"


def test_the_contracts_floor_sums_the_mandated_parts_over_the_processes_and_cores() -> None:
    records = {
        "coordinator": {"parts": {"handle": 2_000_000, "decode_head": 1_000_000, "x": 9}},
        "rank 0": {"parts": {"digest": 4_000_000, "copy_in": 2_000_000, "decode_head": 7}},
        "rank 1": {"parts": {"digest": 4_000_000, "reduce_whole": 3_000_000}},
    }
    names = ["coordinator", "rank 0", "rank 1"]
    per_process, total, floor = loop_profile.contract_floor(records, names, 0.5, 2)
    # ns over the window -> ms a step at 2 steps a window; parts outside the contracts ignored
    assert per_process["coordinator"]["handle"] == 1.0
    assert per_process["coordinator"]["decode_head"] == 0.5
    assert per_process["rank 0"]["digest"] == 2.0 and per_process["rank 0"]["copy_in"] == 1.0
    assert "decode_head" not in per_process["rank 0"]
    assert total == 1.5 + 3.0 + 3.5 and floor == total / 2


@pytest.mark.soak  # a 30 s profiling run: make soak
def test_loop_profile_says_when_the_run_is_shorter_than_its_window() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "loop_profile.py"), "--world", "2"]
    command += ["--steps", "2", "--window", "60", "61"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "the run ended before the window (60-61 s) closed" in done.stderr
    assert "give it more --steps" in done.stderr
