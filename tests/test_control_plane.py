"""The coordinator core at scale keeps no state that grows per step.

Drives `benchmarks/control_plane.py`'s simulated run (64 workers through the real events, here
without the CBOR frames) and compares the Python heap after step 100 and after step 300: a core
that kept any per-step history (commits, gos, reports) would grow by at least a few bytes a
step. No timing is asserted here: the per-step targets live in the benchmark.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
import tracemalloc
from pathlib import Path
from types import ModuleType

import pytest

from paramsync.runtime.coordinator.host_driver import HostDriver
from paramsync.runtime.coordinator.root_driver import RootDriver

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "control_plane.py"


def _benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("control_plane_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


control_plane = _benchmark()


def _heap_after(run: object, steps: int) -> int:
    for _ in range(steps):
        run.step()  # type: ignore[attr-defined]
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


@pytest.mark.parametrize(
    "fold", [pytest.param(False, marks=pytest.mark.soak), True], ids=["cached-ready", "folded"]
)
@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
def test_the_heap_stays_flat_over_300_steps_of_64_workers(elastic: bool, fold: bool) -> None:
    run = control_plane.SimulatedRun(
        64, buckets=6, tensors=24, elastic=elastic, wire=False, fold=fold
    )
    tracemalloc.start()
    try:
        at_100 = _heap_after(run, 100)
        at_300 = _heap_after(run, 200)
    finally:
        tracemalloc.stop()
    assert run.core.view.step == 300 and run.core.view.last_commit is not None
    assert run.core.view.last_commit.step == 299
    # 200 steps of 64 workers are 89,600 reports: keeping even one small object per step
    # (a commit record, a go) would add more than 8 KiB.
    assert at_300 - at_100 < 8 * 1024, (at_100, at_300)


def test_a_run_that_keeps_per_step_history_is_caught() -> None:
    """The check can fail: a core that keeps every commit grows past the bound."""
    run = control_plane.SimulatedRun(8, buckets=4, tensors=8, wire=False)
    kept: list[object] = []
    step = run.step

    def step_and_keep() -> float:
        seconds = step()
        kept.append(run.core.view.last_commit)
        return seconds

    run.step = step_and_keep
    tracemalloc.start()
    try:
        at_100 = _heap_after(run, 100)
        at_300 = _heap_after(run, 200)
    finally:
        tracemalloc.stop()
    assert at_300 - at_100 >= 8 * 1024


@pytest.mark.parametrize("fold", [False, True], ids=["cached-ready", "folded"])
def test_the_wire_path_decodes_every_report_and_commits(fold: bool) -> None:
    run = control_plane.SimulatedRun(
        16, buckets=4, tensors=8, digest_interval=2, wire=True, fold=fold
    )
    for _ in range(4):
        assert run.step() >= 0
    assert run.core.view.step == 4 and run.core.view.seq == 4  # one go per bucket, on step 0 only
    assert (
        run.core.view.last_commit is not None and run.core.view.last_commit.digests == ()
    )  # step 3


def test_the_tree_commits_every_step_through_the_shells_drivers_and_exits_1_on_a_miss(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--hosts`: the sub-coordinators and the root driven as the tree's shells drive them
    (`HostDriver`, `RootDriver`), every report decoded as a control link decodes it; a missed
    target is named and makes the exit status 1, met targets 0."""
    run = control_plane.TreeRun(16, 4, buckets=3, tensors=6)
    assert isinstance(run.root, RootDriver) and all(isinstance(h, HostDriver) for h in run.hosts)
    for _ in range(3):
        assert run.step() >= 0
    assert run.root.root.membership.epoch == run.epoch and run.next_step == 3
    argv = ["--workers", "16", "--hosts", "4", "--steps", "3", "--warmup", "1"]
    argv += ["--flat-steps", "1", "--memory-steps", "0", "--buckets", "3", "--tensors", "6"]
    assert control_plane.main([*argv, "--target-ms", "0"]) == 1
    assert "missed: the root at 16 workers on 4 hosts" in capsys.readouterr().out
    control_plane.main([*argv, "--target-ms", "1000", "--target-clock", "cpu"])
    assert "missed: the root" not in capsys.readouterr().out
