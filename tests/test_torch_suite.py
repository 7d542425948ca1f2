"""A fast subset of torch's own distributed test suite on the paramsync backend.

``make torch-suite`` runs every test of torch's ``DistributedTest._DistTestBase`` that torch
runs for gloo on a CPU-only machine, at world sizes 2, 3 and 4 and its ``*_group`` tests at 8
(tests/torch_suite/run_torch_suite.py, docs/torch_backend_suite.md); here a few of its
tests run through the same runner, each of which must pass (a skip fails too): at world
size 2 all-reduce (plain and coalesced), broadcast, all-gather (plain and coalesced),
reduce-scatter of one tensor, barrier, DDP on CPU, ``new_group()`` and
``destroy_process_group``; at world size 3 all-reduce on a ``new_group()`` of every rank,
reduce-scatter with uneven parts, a ``new_group([1, 2])`` of two of the three ranks, and
``batch_isend_irecv`` with each ``irecv`` posted before its ``isend`` (it hung until torch's
harness timeout; tests/test_torch_backend_edges.py has the same case in ``make test``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "tests" / "torch_suite" / "run_torch_suite.py"

FAST = {
    2: (
        "test_all_reduce_sum",
        "test_all_reduce_coalesced_sum",
        "test_broadcast",
        "test_all_gather",
        "test_all_gather_coalesced_simple",
        "test_reduce_scatter_tensor_cpu",
        "test_barrier",
        "test_DistributedDataParallelCPU",
        "test_destroy_full_group",
    ),
    3: (
        "test_all_reduce_full_group_sum",
        "test_reduce_scatter_v_cpu",
        "test_get_rank_size_group",
        "test_destroy_group",
        "test_batch_isend_irecv_gloo",
    ),
}


@pytest.mark.parametrize(
    "world_size",
    # make test runs the subset on 2 ranks; 3 (an odd ring) with make soak and make torch-suite.
    [pytest.param(n, marks=pytest.mark.soak) if n > 2 else n for n in sorted(FAST)],
)
def test_torch_suite_subset_passes_on_paramsync(world_size: int, tmp_path: Path) -> None:
    tests = FAST[world_size]
    report = tmp_path / "report.json"
    command = [sys.executable, str(RUNNER), "--world-sizes", str(world_size)]
    command += ["--tests", *tests, "--json", str(report), "--log-dir", str(tmp_path)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    log = tmp_path / f"ws{world_size}.log"
    tail = log.read_text()[-4000:] if log.exists() else ""
    assert report.exists(), f"the runner wrote no report:\n{run.stderr}\n{tail}"
    (summary,) = json.loads(report.read_text())["summaries"]
    assert summary["failed"] == {}, f"{run.stdout}\n{tail}"
    assert summary["passed"] == sorted(tests), f"not all passed (skipped?):\n{run.stderr}"
    assert run.returncode == 0, run.stderr
