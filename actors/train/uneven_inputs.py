"""`uneven_inputs`: torch DDP's ``join()`` for the user's own loop
(`DistributedDataParallel.join`, `paramsync.actors.train.ddp_wrapper`).

Inside it every step first counts the ranks that still have data (`OwnLoop.use_join`); a rank
whose loop ended takes part in the others' steps with zero gradients (`DistributedTrainer.join`)
until every rank's loop has ended, or, with ``throw_on_early_termination``, every rank raises
`EarlyTermination` at the step where the first one ran out (`OwnLoop.join_and_raise`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from paramsync.actors.train.optimizer_binding import OptimizerBinding
from paramsync.actors.train.step_tracker import StepTracker
from paramsync.actors.train.trainer_link import TrainerLink

__all__ = ["uneven_inputs"]


@contextmanager
def uneven_inputs(
    link: TrainerLink,
    steps: StepTracker,
    binding: OptimizerBinding,
    *,
    divide_by_initial_world_size: bool = True,
    enable: bool = True,
    throw_on_early_termination: bool = False,
) -> Iterator[None]:
    """The user's loop runs inside, with torch DDP ``join()``'s arguments and meaning (the
    average always divides by the whole world)."""
    if not enable:
        yield
        return
    if not divide_by_initial_world_size:
        raise ValueError(
            "join(divide_by_initial_world_size=False) is not supported: the average "
            "divides by the whole world while ranks have joined"
        )
    trainer = link.trainer
    binding.flush_skipped()

    async def use(enabled: bool) -> None:
        trainer.own_loop.use_join(enabled, throw_on_early_termination=throw_on_early_termination)

    link.run(use, True)
    try:
        yield
        binding.flush_skipped()
        if steps.own is not None:
            raise RuntimeError(
                f"rank {trainer.run.rank}, step {steps.own.step}: the join context ended in "
                "the middle of a step (a forward without its optimizer step)"
            )
        link.run(trainer.own_loop.join_and_raise if throw_on_early_termination else trainer.join)
    finally:
        link.run(use, False)
