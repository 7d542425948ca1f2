"""benchmarks/tensor_parallel.py: its per-round ratios and medians, the loss check that the
systems compute the same model, and a tiny run of paramsync and torch's tensor parallelism."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "tensor_parallel.py"


def _module():
    spec = importlib.util.spec_from_file_location("tensor_parallel_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(seconds: float, loss: float = 1.0) -> dict:
    return {"step_seconds": seconds, "first_loss": loss, "last_loss": loss}


def test_ratios_are_paired_per_round_and_medians_over_rounds() -> None:
    bench = _module()
    rounds = [
        {"paramsync": _cell(0.05), "torch": _cell(0.10), "dense": _cell(0.08)},
        {"paramsync": _cell(0.09), "torch": _cell(0.06), "dense": _cell(0.12)},
        {"paramsync": _cell(0.06), "torch": _cell(0.08), "dense": _cell(0.09)},
    ]
    table = bench.summarise(rounds)
    assert table["paramsync"]["step_seconds"] == pytest.approx(0.06)
    assert table["torch"]["step_seconds"] == pytest.approx(0.08)
    # per round 0.5, 1.5, 0.75 -> 0.75 (the medians' ratio would be 0.06 / 0.08 = 0.75 too)
    assert table["paramsync"]["ratio_to_torch"] == pytest.approx(0.75)
    # per round 1.6, 1.333, 1.5 -> 1.5 (the medians' ratio: 0.09 / 0.06 = 1.5)
    assert table["paramsync"]["speedup_over_dense"] == pytest.approx(1.5)
    assert "paramsync-shm" not in table


def test_systems_that_compute_another_model_are_refused() -> None:
    bench = _module()
    bench.check_losses([{"dense": _cell(0.1, 2.0), "torch": _cell(0.1, 2.00001)}])
    with pytest.raises(SystemExit, match="torch's first loss"):
        bench.check_losses([{"dense": _cell(0.1, 2.0), "torch": _cell(0.1, 2.5)}])


def test_an_uneven_split_is_refused() -> None:
    bench = _module()
    with pytest.raises(SystemExit, match="does not split over tp=2"):
        bench.main(["--ffn", "7"])


@pytest.mark.soak  # three systems of benchmark processes: make soak
def test_a_tiny_run_times_paramsync_against_torch(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    command = [
        sys.executable, str(SCRIPT), "--rounds", "1", "--steps", "2", "--warmup", "1",
        "--hidden", "16", "--ffn", "32", "--pairs", "1", "--batch", "4",
        "--systems", "paramsync", "torch", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert set(report["table"]) == {"paramsync", "torch"}
    assert report["table"]["paramsync"]["ratio_to_torch"] > 0
    first = report["rounds"][0]
    assert first["paramsync"]["first_loss"] == pytest.approx(first["torch"]["first_loss"], rel=1e-4)
    assert "vs torch" in done.stdout
