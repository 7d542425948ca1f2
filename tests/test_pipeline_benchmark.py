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
    assert set(rows) == {"single", "paramsync-1f1b", "torch-1f1b"}
    for row in rows.values():
        assert row["median_step_seconds"] > 0
    assert rows["paramsync-1f1b"]["ratio_to_torch"] > 0
    assert 0 < rows["paramsync-1f1b"]["fraction_of_ideal"]
    # the same model, data and micro-batches: paramsync's arithmetic is the single process's
    assert rows["paramsync-1f1b"]["loss"] == rows["single"]["loss"]
    assert rows["torch-1f1b"]["loss"] == pytest.approx(rows["single"]["loss"], rel=1e-5)
