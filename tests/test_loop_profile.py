"""benchmarks/loop_profile.py runs a small training and reports every process's event loop."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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


@pytest.mark.soak  # a 30 s profiling run: make soak
def test_loop_profile_says_when_the_run_is_shorter_than_its_window() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "loop_profile.py"), "--world", "2"]
    command += ["--steps", "2", "--window", "60", "61"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "the run ended before the window (60-61 s) closed" in done.stderr
    assert "give it more --steps" in done.stderr
