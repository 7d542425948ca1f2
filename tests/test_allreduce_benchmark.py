"""`benchmarks/allreduce.py` runs end to end, with ``--baseline`` timing another checkout's code
in the same rounds (here this checkout again, so the two must agree on what they time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.soak  # four processes, about 4 s: make soak
def test_the_allreduce_benchmark_times_a_baseline_checkout_beside_this_code(
    tmp_path: Path,
) -> None:
    out = tmp_path / "allreduce.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "allreduce.py"),
        "--systems", "paramsync", "--worlds", "2", "--sizes", "4096",
        "--rounds", "1", "--repeats", "1", "--baseline", str(ROOT), "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["systems"] == ["paramsync", "paramsync@baseline"]
    (row,) = report["rows"]
    assert row["paramsync@baseline"]["samples"] == row["paramsync"]["samples"] == 1
    ratio = row["paramsync@baseline"]["this_over_baseline_busbw"]
    assert ratio == row["paramsync"]["busbw_GBps"] / row["paramsync@baseline"]["busbw_GBps"]
    assert "paramsync: this code's busbw / the baseline's: n=2 4 KiB: x" in done.stdout


def test_the_baseline_must_be_a_checkout(tmp_path: Path) -> None:
    command = [
        sys.executable, str(ROOT / "benchmarks" / "allreduce.py"),
        "--systems", "paramsync", "--baseline", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode != 0
    assert "not a paramsync checkout" in done.stderr
