"""benchmarks/digest.py: a tiny run times every way of hashing after real optimizer steps (the
runs in make soak; the refusal of too few steps in the default suite)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "digest.py"


@pytest.mark.soak
def test_a_tiny_run_times_each_way_of_hashing(tmp_path: Path) -> None:
    out = tmp_path / "digest.json"
    command = [sys.executable, str(SCRIPT), "--steps", "6", "--d-model", "16", "--layers", "1"]
    command += ["--context", "8", "--batch-size", "2", "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    seconds = result["median_cpu_seconds"]
    assert set(seconds) == {"hasher", "fresh", "bytes only", "optimizer step"}
    assert all(value >= 0 for value in seconds.values())
    assert seconds["optimizer step"] > 0
    # Each parameter and AdamW's three state tensors for it (two moments and the step).
    assert result["tensors"] > 0 and result["tensors"] % 4 == 0
    assert result["state_bytes"] > 0
    assert "hasher" in done.stdout


def test_too_few_steps_are_refused() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "2"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode != 0
    assert "--steps must be at least 3" in done.stderr


@pytest.mark.soak
def test_the_device_mode_times_the_trainers_digest_against_its_step(tmp_path: Path) -> None:
    """What make gpu-check's row (c) reads, here on the CPU (XXH3, nothing copied through the
    device operations)."""
    out = tmp_path / "digest.json"
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--params", "200k"]
    command += ["--steps", "3", "--batch-size", "2", "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert 150_000 <= result["params"] <= 250_000
    assert result["algorithm"] == "xxh3-128"
    assert result["step_seconds"] > 0 and result["digest_seconds"] > 0
    assert result["host_bytes"] == 0
    assert "% of the step" in done.stdout
