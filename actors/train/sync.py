"""`SyncTrainer`: the distributed trainer for synchronous training scripts.

A script that is not written for trio (the usual torchrun script) still gets paramsync: the
trainer's trio loop runs in a background thread that this object owns, and every call crosses
into it. Errors from the run (an abort, a lost peer) surface from the call that meets them.

    with SyncTrainer(model, optimizer, loss_fn) as trainer:    # reads RANK, WORLD_SIZE, ...
        for batch in batches:
            loss = trainer.train_batch(batch)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch
import trio

from paramsync.actors.state.digest import Scheduler
from paramsync.actors.train.run import trainer_from_env
from paramsync.actors.train.trainer import DistributedTrainer, LossFn, TrainerOptions
from paramsync.runtime.config import DistributedConfig
from paramsync.runtime.coordinator.service import CoordinatorOptions
from paramsync.runtime.errors import pick_error

__all__ = ["SyncTrainer"]

T = TypeVar("T")


class SyncTrainer:
    """A `DistributedTrainer` driven from synchronous code (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        *,
        options: TrainerOptions | None = None,
        coordinator_options: CoordinatorOptions | None = None,
        overrides: Mapping[str, object] | None = None,
        secret: bytes | str | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        self._args = (model, optimizer, loss_fn)
        self._kwargs: dict[str, Any] = {
            "scheduler": scheduler,
            "options": options,
            "coordinator_options": coordinator_options,
            "overrides": overrides,
            "secret": secret,
        }
        self._trainer: DistributedTrainer | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._release: trio.Event | None = None
        self._error: BaseException | None = None
        self._reported = False
        """Whether a call already raised the run's error (leaving then raises it no more)."""
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SyncTrainer:
        self._thread = threading.Thread(target=self._run, name="paramsync-trio", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._trainer is None:
            self._thread.join()
            assert self._error is not None
            raise self._error
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._thread is None:
            return
        if self._release is not None and self._token is not None and self._thread.is_alive():
            try:
                trio.from_thread.run_sync(self._release.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join()
        if self._error is not None and exc is None and not self._reported:
            self._reported = True
            raise self._error

    def _run(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._release = trio.Event()
            async with trainer_from_env(*self._args, **self._kwargs) as trainer:
                self._trainer = trainer
                self._ready.set()
                await self._release.wait()

        try:
            trio.run(main)
        except BaseException as exc:
            self._error = pick_error(exc)
        finally:
            self._ready.set()

    def _call(self, fn: Any, *args: Any) -> Any:
        if self._trainer is None or self._token is None:
            raise RuntimeError("use SyncTrainer inside a `with` block")
        if self._error is not None:
            raise self._ended()
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except (trio.RunFinishedError, trio.Cancelled):
            # The run ended while this call waited in it (an abort, a lost rank): its
            # cancellation is no error of the call's; the run's own error is.
            raise self._ended() from None

    def _ended(self) -> BaseException:
        """The run's error, once its thread is done (a call that raises it reports it)."""
        if self._thread is not None:
            self._thread.join()
        self._reported = True
        return self._error or RuntimeError("the trainer's run has ended")

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` in the trainer's trio thread and return its result (an
        async method of `trainer`; what `train_batch` and the DDP-shaped wrapper,
        `paramsync.actors.train.ddp_wrapper`, cross into it with). Errors of the run surface
        here."""
        result: T = self._call(fn, *args)
        return result

    def train_batch(self, batch: Any) -> float:
        """One optimizer step on this worker's ``batch``; returns its mean loss."""
        assert self._trainer is not None
        return self._call(self._trainer.train_batch, batch)

    def join(self) -> int:
        """This worker's data has ended: take part in steps with zero gradients until every
        worker's has (see `DistributedTrainer.join`); returns how many steps it took so."""
        assert self._trainer is not None
        result: int = self._call(self._trainer.join)
        return result

    def verified(self) -> None:
        """Block until every step so far passed the identical-weights check."""
        assert self._trainer is not None
        self._call(self._trainer.verified)

    @property
    def trainer(self) -> DistributedTrainer:
        """The underlying async trainer (use it only from its own thread)."""
        if self._trainer is None:
            raise RuntimeError("use SyncTrainer inside a `with` block")
        return self._trainer

    @property
    def reached_max_steps(self) -> bool:
        """Whether ``max_steps`` optimizer steps have been taken."""
        return self.trainer.run.reached_max_steps

    @property
    def is_coordinator(self) -> bool:
        """Whether this worker is rank 0."""
        return self.trainer.is_coordinator

    @property
    def world_size(self) -> int:
        """Number of workers training together."""
        return self.trainer.world_size

    @property
    def dist_config(self) -> DistributedConfig:
        """This worker's rank, world size and coordinator address."""
        return self.trainer.dist_config

    def summary(self) -> dict[str, Any]:
        """Final step and loss, digest and throughput (see `DistributedTrainer.summary`)."""
        return self.trainer.summary()

    def state_dict(self) -> dict[str, Any]:
        """The trained model's plain ``state_dict`` (see `DistributedTrainer.state_dict`)."""
        return self.trainer.state_dict()

    def save_safetensors(self, path: str | os.PathLike[str]) -> Path:
        """Write `state_dict` to a safetensors file (`DistributedTrainer.save_safetensors`)."""
        return self.trainer.save_safetensors(path)
