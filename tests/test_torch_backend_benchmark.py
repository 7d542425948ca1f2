"""benchmarks/torch_backend.py: its summary's ratios, and a quick run of both backends that must
train, all-reduce and print its tables (no figure is asserted: the machine is shared)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "torch_backend.py"


def _module():
    spec = importlib.util.spec_from_file_location("torch_backend_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(steps: list[float], allreduce: dict[int, float]) -> dict:
    return {
        "ddp": {
            "step_seconds": steps,
            "cpu_seconds_per_step": 0.001,
            "losses": [4.0, 3.0],
            "parameters": 10,
        },
        "allreduce": [{"bytes": b, "repeat": 0, "seconds": s} for b, s in allreduce.items()],
    }


def test_the_summary_takes_ratios_round_by_round_and_of_the_medians() -> None:
    bench = _module()
    args = argparse.Namespace(worlds=[2], sizes=[4096], parts=["ddp", "allreduce"])
    runs = {
        ("gloo", 2): [_run([1.0, 1.0, 1.0], {4096: 1.0}), _run([2.0, 2.0, 2.0], {4096: 3.0})],
        ("paramsync", 2): [
            _run([1.5, 1.5, 1.5], {4096: 2.0}),
            _run([2.0, 2.0, 2.0], {4096: 4.0}),
        ],
    }
    table = bench._summarise(runs, ["gloo", "paramsync"], args)
    (ddp,) = table["ddp"]
    assert ddp["paramsync"]["round_ratios"] == [1.5, 1.0]
    assert ddp["paramsync"]["ratio"] == pytest.approx(1.25)  # the median of the rounds' ratios
    assert ddp["gloo"]["median_step_seconds"] == 1.5  # pooled over the rounds' steps
    (allreduce,) = table["allreduce"]
    assert allreduce["gloo"]["seconds"] == 2.0 and allreduce["paramsync"]["seconds"] == 3.0
    assert allreduce["paramsync"]["ratio"] == pytest.approx(1.5)
    assert allreduce["gloo"]["algbw_GBps"] == pytest.approx(4096 / 2.0 / 1e9)
    assert allreduce["gloo"]["busbw_GBps"] == pytest.approx(allreduce["gloo"]["algbw_GBps"])


def test_bad_sizes_and_worlds_are_refused_before_any_run() -> None:
    for flags, message in (
        (["--sizes", "6"], "multiple of 4"),
        (["--worlds", "1"], "at least 2"),
        (["--baseline", str(ROOT / "docs")], "no actors/torch_backend"),
    ):
        done = subprocess.run(
            [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=60
        )
        assert done.returncode != 0 and message in done.stderr, done.stderr


@pytest.mark.soak  # two backends' processes, 20-60 s on the shared 2-core machine: make soak
def test_a_quick_run_trains_and_all_reduces_on_both_backends(tmp_path: Path) -> None:
    out = tmp_path / "torch_backend.json"
    command = [sys.executable, str(SCRIPT), "--quick", "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch DDP, median step" in done.stdout and "dist.all_reduce" in done.stdout
    table = json.loads(out.read_text())
    assert table["systems"] == ["gloo", "paramsync"]
    (ddp,) = table["ddp"]
    for system in ("gloo", "paramsync"):
        assert ddp[system]["median_step_seconds"] > 0
    assert ddp["paramsync"]["ratio"] > 0
    # The same model, batches and optimizer: the backends' losses agree (summation order aside).
    assert ddp["paramsync"]["final_loss"] == pytest.approx(ddp["gloo"]["final_loss"], rel=1e-4)
    assert [row["bytes"] for row in table["allreduce"]] == [4 << 10, 1 << 20]
    for row in table["allreduce"]:
        assert row["paramsync"]["ratio"] > 0 and row["gloo"]["busbw_GBps"] > 0
