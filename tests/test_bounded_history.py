"""A worker's per-step histories are bounded (security review row 12).

A trainer's `StepHistory` ``losses`` and ``step_seconds`` grew by one entry per step forever. They
now keep the last `TrainerOptions.history_steps` steps; the summary still reports the first loss,
the final loss and the throughput of the whole run (running totals), and the default bound keeps
the demo job's whole loss curve (its plot reads ``trainer.run.history.losses``) for any run up to
that many steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
from test_trainer import RUN_SECONDS, mse_loss, tiny_batch, tiny_replica

from paramsync.actors.demo_job.job import build_parser
from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions
from paramsync.actors.train.worker import train_in_process

STEPS = 9
KEEP = 4


async def test_histories_keep_the_last_steps_and_the_summary_the_whole_run() -> None:
    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        losses = [await trainer.train_batch(tiny_batch(s)) for s in range(STEPS)]
        await trainer.verified()
        return {
            "losses": losses,
            "kept": list(trainer.run.history.losses),
            "seconds": list(trainer.run.history.step_seconds),
            "summary": trainer.summary(),
        }

    with trio.fail_after(RUN_SECONDS):
        [result] = await train_in_process(
            1, tiny_replica, mse_loss, body, options=TrainerOptions(history_steps=KEEP)
        )
    assert [step for step, _ in result["kept"]] == list(range(STEPS - KEEP, STEPS))
    assert [loss for _, loss in result["kept"]] == result["losses"][-KEEP:]
    assert len(result["seconds"]) == KEEP
    summary = result["summary"]
    assert summary["first_loss"] == result["losses"][0]
    assert summary["final_loss"] == result["losses"][-1]
    assert summary["final_step"] == STEPS
    assert summary["steps_per_second"] > 0
    assert summary["steps_per_second"] < STEPS / sum(result["seconds"])  # all 9 steps' time


def test_the_default_bound_keeps_the_demos_whole_loss_curve() -> None:
    assert TrainerOptions().history_steps >= 10_000
    assert TrainerOptions().history_steps >= build_parser().parse_args([]).steps
    with pytest.raises(ValueError, match="history_steps"):
        TrainerOptions(history_steps=0)
