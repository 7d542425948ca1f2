"""Which checkpoint a resume may take: only a committed one, and only of its own run.

Security review rows 7 and 8: periodic checkpoints held states whose digest check had not yet
committed, so ``--resume`` could restart from a state written just before an abort for
divergence; and checkpoints carried no run id, so a stale higher-step file from another run won
silently.

* Every checkpoint records its run id and whether its state was committed (all ranks' digests
  agreed); `load_latest_valid(committed_only=True)` skips uncommitted ones, and a store bound
  to a run id skips (with a warning naming both ids) or refuses (`load`, `CheckpointError`
  naming both ids) another run's; a directory holding only other runs' checkpoints is an error,
  not a silent fresh start.
* `CommittedCheckpoints` writes an offered state only once its step is committed: a state
  offered before an abort for divergence never reaches the disk.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import trio
import trio.lowlevel
import trio.testing

from paramsync.actors.state.checkpoint import (
    CheckpointError,
    CheckpointStore,
    checkpoint_name,
    checkpoint_record,
)
from paramsync.actors.state.training_state import TrainingState
from paramsync.actors.train.checkpointing import CommittedCheckpoints


def state(step: int, value: float | None = None) -> TrainingState:
    return TrainingState(
        step, [("x", torch.full((3,), float(step if value is None else value)))], {}
    )


def test_a_checkpoint_records_its_run_id_and_whether_it_was_committed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, run_id="run-a")
    committed = store.save(state(2), committed=True)
    pending = store.save(state(4), committed=False)
    assert checkpoint_record(committed) == (2, "run-a", True)
    assert checkpoint_record(pending) == (4, "run-a", False)


def test_resume_takes_the_newest_committed_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path, keep=5, run_id="run-a")
    store.save(state(2), committed=True)
    store.save(state(4), committed=True)
    store.save(state(6, value=-1.0), committed=False)  # written just before an abort
    with caplog.at_level(logging.WARNING, logger="paramsync.checkpoint"):
        resumed = store.load_latest_valid(committed_only=True)
    assert resumed is not None and resumed.step == 4
    assert "not committed" in caplog.text and checkpoint_name(6) in caplog.text


def test_a_checkpoint_of_another_run_is_refused_naming_both_ids(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ours = CheckpointStore(tmp_path, keep=5, run_id="run-a")
    ours.save(state(2), committed=True)
    stale = CheckpointStore(tmp_path, keep=5, run_id="run-b").save(state(9), committed=True)
    with caplog.at_level(logging.WARNING, logger="paramsync.checkpoint"):
        resumed = ours.load_latest_valid(committed_only=True)
    assert resumed is not None and resumed.step == 2
    assert "run-a" in caplog.text and "run-b" in caplog.text
    with pytest.raises(CheckpointError, match=r"run 'run-b'.*run 'run-a'"):
        ours.load(stale)
    with pytest.raises(CheckpointError, match=r"run-b"):
        ours.load()  # the latest by name is the other run's: refused, not taken


def test_a_directory_of_other_runs_only_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    CheckpointStore(tmp_path, run_id="run-b").save(state(9), committed=True)
    with pytest.raises(CheckpointError, match=r"run-c.*run-b|run-b.*run-c"):
        CheckpointStore(tmp_path, run_id="run-c").load_latest_valid(committed_only=True)


def test_pruning_keeps_only_this_runs_checkpoints_in_count(tmp_path: Path) -> None:
    CheckpointStore(tmp_path, run_id="run-b").save(state(90), committed=True)
    ours = CheckpointStore(tmp_path, keep=2, run_id="run-a")
    for step in (1, 2, 3):
        ours.save(state(step), committed=True)
    # Another run's stale file neither counts against ours nor gets deleted by us.
    assert [s for s, _ in ours.checkpoints()] == [2, 3, 90]
    assert ours.load_latest_valid(committed_only=True).step == 3  # type: ignore[union-attr]


def test_the_run_id_is_recorded_in_the_directory(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt", run_id="run-a")
    assert store.recorded_run_id() is None
    store.record_run_id()
    assert CheckpointStore(tmp_path / "ckpt").recorded_run_id() == "run-a"
    with pytest.raises(ValueError, match="run id"):
        CheckpointStore(tmp_path, run_id="bad id\n")


async def test_only_committed_states_reach_the_disk(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=5, run_id="run-a")
    committed: dict[int, trio.Event] = {}

    async def wait_commit(step: int) -> None:
        await committed.setdefault(step, trio.Event()).wait()

    writer = CommittedCheckpoints(store, wait_commit)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer.run)
            writer.offer(state(2))  # after step 1
            writer.offer(state(4))  # after step 3
            await trio.testing.wait_all_tasks_blocked()
            assert store.checkpoints() == []  # nothing is committed yet
            committed.setdefault(1, trio.Event()).set()
            await writer.wait_written(2)
            # Step 3's check never commits: the run aborts for divergence.
            nursery.cancel_scope.cancel()
    assert [s for s, _ in store.checkpoints()] == [2]
    resumed = store.load_latest_valid(committed_only=True)
    assert resumed is not None and resumed.step == 2
    assert checkpoint_record(store.checkpoints()[0][1]).committed


async def test_flush_writes_every_committed_offer(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=5, run_id="run-a")

    async def wait_commit(step: int) -> None:
        await trio.lowlevel.checkpoint()

    writer = CommittedCheckpoints(store, wait_commit)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer.run)
            writer.offer(state(2))
            writer.offer(state(4))
            await writer.flush()
            nursery.cancel_scope.cancel()
    assert [s for s, _ in store.checkpoints()] == [2, 4]
