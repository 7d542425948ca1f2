"""The torchft comparison's plumbing: benchmarks/ddp.py --torchft and benchmarks/faults_torchft.py.

torchft is a benchmark-only dependency (the ``bench`` extra): the package never imports it, and
the runs that need it skip with the reason when it is missing. The figure extraction is checked
on made-up logs; one short torchft run checks that the torchft column trains the same job as
torch DDP. The kill and nudge trials themselves are soak tests.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def _load(name: str):
    """A benchmark script as a module, under its own name (the scripts import each other so)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _needs_torchft():
    peer = _load("torchft_peer")
    if not peer.available():
        pytest.skip(peer.missing_reason())
    return peer


def test_the_package_never_imports_torchft() -> None:
    importers = []
    for package in ("runtime", "actors"):
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            if "torchft" not in text:
                continue
            for node in ast.walk(ast.parse(text, str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                else:
                    continue
                if any(name == "torchft" or name.startswith("torchft.") for name in names):
                    importers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert importers == []


def test_torchft_is_a_pinned_benchmark_extra() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["bench"] == ["torchft==0.2.0"]
    assert not any(dep.startswith("torchft") for dep in project["dependencies"])
    assert "torchft==0.2.0" in (ROOT / "constraints.txt").read_text().split()


def test_kill_points_cover_every_phase_and_refuse_none() -> None:
    faults = _load("faults_torchft")
    points = faults.kill_points(12)
    assert len(points) == 12
    assert {phase for phase, _ in points} == set(faults.PHASES)
    assert all(2 <= step <= 5 for _, step in points)
    assert len({step for _, step in points}) > 1  # varied steps, not one
    with pytest.raises(ValueError, match="trials must be at least 1"):
        faults.kill_points(0)


def _progress(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_torchft_figures_from_the_workers_progress_logs(tmp_path: Path) -> None:
    faults = _load("faults_torchft")
    (tmp_path / "killed-at").write_text("100.0")
    done = {"event": "done", "digest": "same", "t": 130.0, "step": 40}
    for tag in ("rank0", "rank1"):
        _progress(
            tmp_path / f"progress-{tag}.jsonl",
            [
                {"t": 98.5, "step": 2, "committed": True, "participants": 3},
                {"t": 99.0, "step": 3, "committed": True, "participants": 3},
                {"t": 100.5, "event": "hook-error", "step": 4, "error": "AssertionError()"},
                {"t": 100.6, "step": 4, "committed": False, "participants": 3},
                {"t": 105.2, "step": 4, "committed": True, "participants": 2},
                {"t": 105.7, "step": 5, "committed": True, "participants": 2},
                done,
            ],
        )
    _progress(
        tmp_path / "progress-rejoined.jsonl",
        [
            {"t": 104.0, "event": "ready"},
            {"t": 108.0, "step": 20, "committed": True, "participants": 3},
            done,
        ],
    )
    procs = {
        "rank0": SimpleNamespace(returncode=0),
        "rank1": SimpleNamespace(returncode=0),
        "rank2": SimpleNamespace(returncode=-9),
        "rejoined": SimpleNamespace(returncode=0),
    }
    figures = faults.torchft_figures("allreduce", 4, tmp_path, procs, 1.0)
    assert figures["problems"] == []
    assert figures["detection_seconds"] == pytest.approx(5.2)
    assert figures["steps_lost"] == 1
    assert figures["hook_errors"] == 2
    assert figures["rejoin_seconds"] == pytest.approx(8.0)
    assert figures["rejoin_from_ready_seconds"] == pytest.approx(4.0)
    assert figures["identical"] is True
    # Commits 0.5, 6.2 (across the kill) and 0.5 s apart: a step takes 0.5 s; the 5.2 s from
    # the kill to the next commit cost 4.7 s beyond the step that commit takes anyway.
    assert figures["median_step_seconds"] == pytest.approx(0.5)
    assert figures["time_lost_steps"] == pytest.approx(9.4)

    # A different final state on the restarted worker is reported, not averaged away.
    _progress(tmp_path / "progress-rejoined.jsonl", [{**done, "digest": "other"}])
    figures = faults.torchft_figures("allreduce", 4, tmp_path, procs, 1.0)
    assert figures["identical"] is False
    assert any("never committed" in p for p in figures["problems"])
    assert any("final states differ" in p for p in figures["problems"])


def test_paramsync_figures_from_the_coordinators_log() -> None:
    faults = _load("faults_torchft")
    log = "\n".join(
        [
            "2026-01-01 10:00:00,000 INFO paramsync.daemon: coordinator listening",
            "2026-01-01 10:00:05,050 INFO paramsync.coordinator: epoch 2 starts at step 3 with "
            "ranks [0, 1] (rank 2 disconnected)",
            "2026-01-01 10:00:05,200 INFO paramsync.coordinator: epoch 2 recovered: step 3 "
            "committed by ranks [0, 1]",
            "2026-01-01 10:00:12,000 INFO paramsync.coordinator: epoch 3 starts at step 400 "
            "with ranks [0, 1, 2] (rank 2 joined)",
            "2026-01-01 10:00:12,300 INFO paramsync.coordinator: epoch 3 recovered: step 400 "
            "committed by ranks [0, 1, 2]",
        ]
    )
    result = SimpleNamespace(
        coordinator_log=log,
        recovery_seconds=0.2,
        detection_seconds=0.05,
        resumed_at=3,
        digests={0: "d", 1: "d", 2: "d"},
        problems=[],
        exit_codes={},
        elapsed_seconds=20.0,
        summaries={0: {"median_step_seconds": 0.02}, 1: {"median_step_seconds": 0.04}},
    )
    figures = faults.paramsync_figures("backward", 3, result)
    assert figures["median_step_seconds"] == pytest.approx(0.03)
    assert figures["time_lost_steps"] == pytest.approx((0.2 - 0.03) / 0.03)
    assert figures["detection_seconds"] == pytest.approx(0.2)
    assert figures["steps_lost"] == 1  # resumed at the step it was killed in: rerun
    assert figures["rejoin_seconds"] == pytest.approx(7.3)
    assert figures["rejoin_from_join_seconds"] == pytest.approx(0.3)
    assert figures["identical"] is True and figures["problems"] == []
    result.resumed_at = 4  # every member held the step's gradients: nothing rerun
    assert faults.paramsync_figures("optimizer", 3, result)["steps_lost"] == 0


def _data_parallel_reference(bench, flags: list[str], world: int, steps: int) -> list[float]:
    """Rank 0's losses under exact data parallelism, in this process: every rank's replica from
    the same seed, each step the ranks' gradients averaged before one optimizer step."""
    import torch

    threads = torch.get_num_threads()  # _setup sets one thread, as each worker runs
    ranks = [
        bench._setup(bench.build_parser().parse_args([*flags, "--rank", str(r), "--world", "2"]))
        for r in range(world)
    ]
    model, optimizer, _, _ = ranks[0]
    losses = []
    for step in range(steps):
        grads = []
        for rank, (_, _, batch, _) in enumerate(ranks):
            optimizer.zero_grad()
            inputs, targets = batch(step)
            loss = model.loss(inputs, targets)
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            if rank == 0:
                losses.append(float(loss.detach()))
        for param, *each in zip(model.parameters(), *grads):
            param.grad = torch.stack(each).mean(0)
        optimizer.step()
    torch.set_num_threads(threads)
    return losses


def test_the_torchft_column_is_exact_data_parallelism() -> None:
    """Two torchft replica groups and a lighthouse (ddp.py's torchft system) train the job as
    exact data parallelism does: rank 0's loss curve is the in-process reference's."""
    _needs_torchft()
    bench = _load("ddp")
    flags = ["--model", "mlp", "--steps", "4", "--warmup", "1", "--corpus-bytes", "65536"]
    args = bench.build_parser().parse_args(flags)
    torchft = bench._launch(bench.TORCHFT, 2, args)
    assert len(torchft["step_seconds"]) == 4
    assert torchft["losses"] == pytest.approx(
        _data_parallel_reference(bench, flags, 2, 5), rel=1e-5
    )
    runs = {(system, 2): [torchft] for system in ("ddp", "paramsync", bench.LIMIT)}
    runs[(bench.TORCHFT, 2)] = [torchft]
    row = bench._summarise(runs, [2])[0]
    assert row["torchft_ratio_rounds"] == [1.0]  # paramsync's slot holds the same run
    assert row[bench.TORCHFT]["final_loss"] == torchft["losses"][-1]


@pytest.mark.soak
def test_a_torchft_kill_and_rejoin_trial_ends_identical() -> None:
    _needs_torchft()
    faults = _load("faults_torchft")
    trial = faults.torchft_trial("optimizer", 2, heartbeat_timeout_ms=1000)
    assert trial["problems"] == []
    assert trial["identical"] is True
    assert trial["detection_seconds"] is not None and trial["rejoin_seconds"] is not None


@pytest.mark.soak
def test_the_nudge_stops_paramsync_naming_rank_and_tensor_and_torchft_runs_on() -> None:
    _needs_torchft()
    faults = _load("faults_torchft")
    ours = faults.nudge("paramsync")
    for report in ours["reports"].values():
        assert report["outcome"] == "stopped"
        assert f"step {faults.NUDGE_STEP}" in report["error"]
        assert "ranks [1] differ from the majority" in report["error"]
        assert f"'param/{report['tensor']}'" in report["error"]
    theirs = faults.nudge("torchft")
    assert all(r["outcome"] == "finished" for r in theirs["reports"].values())
    assert theirs["nudged_max_abs_diff"][faults.NUDGE_RANK] > 0
    assert theirs["digests_equal"] is False
