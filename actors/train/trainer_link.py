"""`TrainerLink`: how `DistributedDataParallel` (`paramsync.actors.train.ddp_wrapper`) reaches its
trainer from the user's thread: the trainer, and the crossing that runs an async function of
it in the trainer's trio loop while the user's thread is parked
(`OwnLoop.caller_crossing`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paramsync.actors.train.trainer import DistributedTrainer

__all__ = ["TrainerLink"]


class TrainerLink:
    """The wrapper's trainer and its way into the trainer's event loop (none until attached)."""

    def __init__(self) -> None:
        self.attached: DistributedTrainer | None = None
        self.cross: Callable[..., Any] | None = None
        """Runs an async function of the trainer in its trio loop, from the user's thread."""

    @property
    def trainer(self) -> DistributedTrainer:
        """The attached trainer."""
        if self.attached is None:
            raise RuntimeError("DistributedDataParallel: the wrapper has no run (closed)")
        return self.attached

    def attach(self, trainer: DistributedTrainer, cross: Callable[..., Any]) -> None:
        """From now on run the loop's crossings into ``trainer``'s event loop with ``cross``
        (``trio.from_thread.run``'s shape)."""
        self.attached, self.cross = trainer, cross

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``await fn(*args)`` in the trainer's event loop, this thread parked meanwhile
        (`OwnLoop.caller_crossing`)."""
        assert self.cross is not None
        return self.cross(self.trainer.own_loop.caller_crossing, fn, *args)

    def attach_caller(self, *, applies: bool) -> None:
        """Tell the trainer a loop in this thread drives it (its epochs then enter only while
        the loop is parked in a crossing), and whether that loop steps the optimizer
        (``applies``)."""
        trainer = self.trainer

        async def attach() -> None:
            trainer.own_loop.attach_caller(applies=applies)

        self.run(attach)
