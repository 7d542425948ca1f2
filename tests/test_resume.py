"""Checkpoints and ``--resume`` through the real launcher: a stopped run picks up where its last
checkpoint left it and ends with the model a straight run would have."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paramsync.actors.state.checkpoint import CheckpointStore
from paramsync.actors.state.training_state import TrainingState

JOB = ["--batch-size", "4", "--d-model", "16", "--layers", "1", "--heads", "2"]
JOB += ["--context", "16", "--corpus-bytes", "65536", "--no-progress"]


def launch(tmp: Path, name: str, *flags: str) -> dict[str, object]:
    merged = tmp / f"{name}.json"
    env = dict(os.environ, PARAMSYNC_SECRET="resume-test-secret-7Hq2vX9pLm")
    result = subprocess.run(
        [
            *(sys.executable, "-m", "paramsync.runtime.cli.main", "launch", "--nproc", "2"),
            *(
                "--summary-json",
                str(merged),
                "--",
                "-m",
                "paramsync.actors.demo_job.job",
                *JOB,
                *flags,
            ),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(merged.read_text())


@pytest.fixture(scope="module")
def straight_digests(tmp_path_factory: pytest.TempPathFactory) -> set[object]:
    """The digests of a straight 7-step run (deterministic: both tests compare with it)."""
    straight = launch(tmp_path_factory.mktemp("straight"), "straight", "--steps", "7")
    return set(straight["digests"].values())  # type: ignore[attr-defined]


def test_resume_from_a_checkpoint_equals_a_straight_run(
    tmp_path: Path, straight_digests: set[object]
) -> None:
    ckpt = tmp_path / "ckpt"
    first = launch(tmp_path, "first", "--steps", "4", "--checkpoint-dir", str(ckpt))
    assert first["final_step"] == 4 and first["digests_identical"]
    store = CheckpointStore(ckpt)
    assert store.latest() is not None and store.load().step == 4
    resumed = launch(tmp_path, "resumed", "--steps", "7", "--checkpoint-dir", str(ckpt), "--resume")
    assert resumed["final_step"] == 7 and resumed["digests_identical"]
    assert set(resumed["digests"].values()) == straight_digests  # type: ignore[attr-defined]


def test_resume_skips_uncommitted_and_other_runs_checkpoints(
    tmp_path: Path, straight_digests: set[object]
) -> None:
    """Rows 7 and 8 of the security review: the newest files are one written before an abort
    (never committed) and a stale one of another run; the resume takes the newest committed
    checkpoint of its own run and ends where a straight run does."""
    ckpt = tmp_path / "ckpt"
    first = launch(
        tmp_path, "first", "--steps", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"
    )
    assert first["final_step"] == 4 and first["digests_identical"]
    run_id = CheckpointStore(ckpt).recorded_run_id()
    assert run_id
    ours = CheckpointStore(ckpt, keep=10, run_id=run_id)
    good = ours.load_latest_valid(committed_only=True)
    assert good is not None and good.step == 4
    poisoned = [
        (name, tensor + 1.0 if tensor.is_floating_point() else tensor)
        for name, tensor in good.tensors
    ]
    ours.save(TrainingState(6, poisoned, good.meta), committed=False)
    CheckpointStore(ckpt, keep=10, run_id="another-run").save(
        TrainingState(5, poisoned, good.meta), committed=True
    )
    resumed = launch(tmp_path, "resumed", "--steps", "7", "--checkpoint-dir", str(ckpt), "--resume")
    assert resumed["final_step"] == 7 and resumed["digests_identical"]
    assert set(resumed["digests"].values()) == straight_digests  # type: ignore[attr-defined]
