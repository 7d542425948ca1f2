"""`StepRunner`: how a trainer runs its own steps (`train_batch`, `join`, `fit`) through the
live epoch's actors, and the phases of a step that the caller's own loop shares
(`paramsync.actors.train.own_step`): the reduction's end, the apply barrier, the optimizer step.

A step runs in the live epoch under a cancel scope the end of the epoch cancels; a step the
epoch ended under is dropped and, as `paramsync.actors.train.lifecycle.attempt_outcome` says, run
again in the next epoch, or not run at all when it was completed without it or the trainer was
rolled back.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import trio

from paramsync.actors.graph.gradcomm import StepState
from paramsync.actors.graph.loader import BatchSource, DataLoaderActor, LoaderPosition, LoadNext
from paramsync.actors.graph.messages import Backward, BucketReady, OptimizerStep, Verify
from paramsync.actors.train.epochs import Epoch, EpochSupervisor
from paramsync.actors.train.lifecycle import StepOutcome, attempt_outcome
from paramsync.actors.train.state_moves import sync_model_buffers
from paramsync.actors.train.training_run import TrainingRun
from paramsync.runtime.actor.base import ActorStopped, ActorSystem
from paramsync.runtime.collectives.ring import all_reduce
from paramsync.runtime.errors import ActorFailed, ProtocolError, pick_error

__all__ = ["AllJoined", "StepAborted", "StepRunner"]

log = logging.getLogger("paramsync.trainer")


class StepAborted(Exception):
    """The step in flight was dropped by a membership change; it runs again in the new epoch."""


class AllJoined(Exception):
    """Every rank's data has ended (``join``): the ranks stop together, before the step."""


class StepRunner:
    """Runs a worker's steps on its `TrainingRun`, in the epochs its supervisor keeps live."""

    def __init__(self, run: TrainingRun, epochs: EpochSupervisor) -> None:
        self.run = run
        self.epochs = epochs
        self._last: tuple[int, float] = (-1, math.nan)
        """(step, loss) of the last step this worker computed a loss for."""

    def loss_of(self, step: int) -> float:
        """This worker's loss of ``step`` if it computed the last one it ran, else nan."""
        return self._last[1] if self._last[0] == step else math.nan

    async def train_batch(self, batch: Any) -> float:
        """`DistributedTrainer.train_batch`."""
        step = self.run.step
        while True:
            try:
                return await self.attempt(batch, step)
            except StepAborted:
                outcome = attempt_outcome(step, self.run.step)
                if outcome is StepOutcome.DONE:  # never run this batch on a later step
                    return self.loss_of(step)
                if outcome is StepOutcome.ROLLED_BACK:  # nor on an earlier one
                    log.warning(
                        "rank %d: step %d's batch not run: rolled back to step %d",
                        self.run.rank,
                        step,
                        self.run.step,
                    )
                    return math.nan

    async def join(self) -> int:
        """`DistributedTrainer.join`."""
        if not self.run.options.join:
            raise RuntimeError(
                "join needs TrainerOptions(join=True) on every worker: without it a worker "
                "cannot step with zero gradients while its peers still train"
            )
        taken = 0
        while not self.run.reached_max_steps:
            step = self.run.step
            try:
                await self.attempt(None, step, has_data=False)
            except AllJoined:
                break
            except StepAborted:
                if self.run.step > step:  # done without this attempt finishing
                    taken += 1
                continue
            taken += 1
        return taken

    async def count_with_data(self, epoch: Epoch, step: int, has_data: bool) -> int:
        """All-reduce how many members still have data at ``step`` (``join``)."""
        count = torch.tensor([1.0 if has_data else 0.0])
        with self.run.trace.span("join-count", actor="trainer", step=step):
            await all_reduce(
                epoch.transport, count, "sum", chunk_bytes=self.run.options.chunk_bytes
            )
        return round(float(count[0]))

    async def attempt(
        self, batch: Any, step: int, position: int | None = None, *, has_data: bool = True
    ) -> float:
        """Run ``step`` once in the live epoch; raises StepAborted if the epoch ends, or if
        the worker is no longer at ``step`` (or ring ``position``) when the epoch is live.
        Without data (``join``) the step reduces zero gradients, or raises AllJoined when no
        member has data left."""
        if self.run.reached_max_steps:
            raise RuntimeError(f"max_steps={self.run.options.max_steps} already reached")
        if self.epochs.live.is_set():  # the usual case: no task switch here (the compute's is one)
            await trio.lowlevel.checkpoint_if_cancelled()
        else:
            await self.epochs.live.wait()
        if self.run.step != step or position not in (None, self.epochs.position):
            raise StepAborted
        epoch = self.epochs.current
        assert epoch is not None
        started = time.perf_counter()
        loss = math.nan
        scope = trio.CancelScope()
        try:
            with scope:
                self.epochs.step_scope = scope
                if self.run.options.join and not await self.count_with_data(epoch, step, has_data):
                    raise AllJoined
                step_state = epoch.comm.begin_step(step)
                if not self.epochs.lifecycle.begin(epoch.generation, step):
                    raise StepAborted  # the epoch ended as the step began
                if has_data:
                    loss = await self._compute(epoch, batch, step)
                    self._last = (step, loss)
                else:
                    self._reduce_zeros(epoch, step)
                await self._reduce_and_apply(epoch, step_state, step)
        except Exception as exc:
            await self.step_failed(exc, scope, epoch)
            raise
        finally:
            self.epochs.step_scope = None
            self.epochs.lifecycle.end(epoch.generation, step)
        if scope.cancelled_caught or self.run.step != step + 1:
            raise StepAborted
        if has_data:
            self.run.history.record(step, loss, time.perf_counter() - started)
        else:
            self.run.history.joined_steps += 1
        return loss

    async def _reduce_and_apply(self, epoch: Epoch, step_state: StepState, step: int) -> None:
        """The rest of ``step`` once its backward has handed its buckets over: wait for their
        all-reduce, synchronize the buffers, apply the optimizer step, report the digest."""
        await self.await_reduced(epoch, step_state, step)
        await self.apply_reduced(epoch, step)

    async def await_reduced(self, epoch: Epoch, step_state: StepState, step: int) -> None:
        """Wait until every bucket of ``step`` is averaged into the gradients (raising the
        step's error if one was lost), then synchronize the buffers."""
        with self.run.trace.span("grad-wait", actor="trainer", step=step):
            await step_state.all_reduced.wait()
        if step_state.error is not None:
            raise step_state.error
        self.run.unused_parameters = step_state.unused_everywhere
        if self.run.options.buffer_sync != "local":
            # After every bucket's all-reduce (one collective at a time on the
            # transport), before this step is reported reduced: a step applied while
            # leaving the epoch (`_apply_pending`) has its buffers synchronized too.
            with self.run.trace.span("buffer-sync", actor="trainer", step=step):
                await sync_model_buffers(self.run, epoch.transport)
        self.epochs.lifecycle.reduced(epoch.generation, step)

    async def apply_barrier(self, epoch: Epoch, step: int) -> None:
        """Before ``step``'s optimizer step: with the epoch's apply barrier, report the step
        reduced and wait for the coordinator's word to apply it."""
        if epoch.start.apply_barrier:
            # A cached all-reduce may finish before the previous step is committed;
            # the coordinator takes this step's report only after that commit.
            await self.run.client.wait_commit(step - 1)
            await self.run.client.reduced(step, epoch.start.epoch)
            with self.run.trace.span("apply-wait", actor="trainer", step=step):
                await self.run.client.wait_apply(step)

    async def apply_reduced(self, epoch: Epoch, step: int) -> None:
        """Apply ``step``'s averaged gradients through the optimizer actor and report the
        digest (or wait for the check, without ``verify_overlap``)."""
        await self.apply_barrier(epoch, step)
        # Overlapped: the optimizer reports the step's digest as soon as it has applied it,
        # within the same message (its check finishes during the next step).
        overlap = self.run.options.verify_overlap
        await epoch.optimizer.ask(OptimizerStep(step, verify=overlap))
        norm = epoch.optimizer.grad_norm
        if norm is not None and norm[0] == step:
            self.run.history.record_norm(step, norm[1])
        if not overlap:
            await epoch.optimizer.ask(Verify(step, wait=True))
        self.epochs.lifecycle.applied(epoch.generation, step)

    async def step_failed(self, exc: Exception, scope: trio.CancelScope, epoch: Epoch) -> None:
        """A step raised ``exc``: raise StepAborted if the epoch ended under it (it runs
        again, or is dropped); return if the error is the step's own (the caller re-raises)."""
        if scope.cancel_called:  # the epoch ended under the step
            raise StepAborted from exc
        if _broken_by_a_peer(exc):
            # A peer's failure broke the epoch (its links, then its actors): the
            # supervisor decides. A new epoch reruns the step; none within its deadline
            # fails the trainer, cancelling this task.
            await epoch.ended.wait()
            raise StepAborted from exc

    async def _compute(self, epoch: Epoch, batch: Any, step: int) -> float:
        """Forward and backward of ``batch``'s micro-batches (the buckets go out as backward
        finishes them); returns the mean loss."""
        micro_batches = _split(batch, self.run.options.accumulation_steps)
        total = 0.0
        # Once every bucket is agreed, the compute needs nothing from the coordinator:
        # its messages (the last step's commit) wait until the compute is done.
        with self.run.client.reads_deferred() if epoch.comm.cache_ready else nullcontext():
            for index, micro in enumerate(micro_batches):
                last = index == len(micro_batches) - 1
                part = await epoch.compute.ask(Backward(step, micro, last))
                if not isinstance(part, float):
                    raise TypeError(
                        f"step {step}: the compute actor answered a backward with "
                        f"{part!r}, not a loss"
                    )
                total += part
        return total / len(micro_batches)

    def _reduce_zeros(self, epoch: Epoch, step: int) -> None:
        """A joined worker's step: every bucket goes out holding zeros, and (with
        ``find_unused_parameters``) no parameter counts as used by this worker."""
        epoch.comm.zero_grads(self.run.optimizer)
        if self.run.options.find_unused_parameters:
            names = frozenset(name for bucket in self.run.buckets for name in bucket.names)
            epoch.comm.note_unused(step, names)
        for bucket in self.run.buckets:
            epoch.comm.ready_soon(BucketReady(step, bucket.index))

    async def fit(
        self,
        dataset: BatchSource,
        batch_size: int,
        *,
        steps: int | None = None,
        seed: int = 0,
        prefetch: int = 4,
        on_step: Callable[[int, float], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[tuple[int, float]]:
        """`DistributedTrainer.fit`."""
        if steps is None and self.run.options.max_steps is None:
            raise ValueError("fit needs steps= or TrainerOptions(max_steps=...)")
        history: list[tuple[int, float]] = []
        slots = self.run.config.world_size
        async with ActorSystem() as system:
            loader: DataLoaderActor | None = None
            while not self.run.reached_max_steps and (steps is None or len(history) < steps):
                if should_stop is not None and should_stop():
                    break
                await self.epochs.live.wait()
                step, position = self.run.step, self.epochs.position
                if loader is None or loader.expects != (step, position):
                    if loader is not None:
                        await loader.stop()
                    loader = self.run.actors.loader(
                        dataset,
                        batch_size,
                        position,
                        slots,
                        seed=seed,
                        prefetch=prefetch,
                        position=LoaderPosition.at_step(step, len(dataset), slots, batch_size),
                    )
                    loader.expects = (step, position)
                    await system.start(loader)
                    for _ in range(prefetch):
                        await loader.tell(LoadNext())
                with self.run.trace.span("load", actor="data-loader", step=step):
                    _, batch = await loader.next_batch()
                await loader.tell(LoadNext())
                loader.expects = (step + 1, position)
                try:
                    loss = await self.attempt(batch, step, position)
                except StepAborted:
                    loader.expects = None
                    if self.run.step > step:  # done without this attempt finishing
                        done = self.loss_of(step)
                        history.append((step, done))
                    continue
                history.append((step, loss))
                if on_step is not None:
                    on_step(step, loss)
            if loader is not None:
                await loader.stop()
        if self.run.options.join:  # this worker's steps are done: follow its peers' to their end
            await self.join()
        return history


def _broken_by_a_peer(error: BaseException) -> bool:
    """Whether a step failed because its epoch's links or actors went away (a peer died or
    left), not by an error of its own (the loss function, a bad batch)."""
    leaf = pick_error(error)
    while isinstance(leaf, ActorFailed) and leaf.__cause__ is not None:
        leaf = pick_error(leaf.__cause__)
    return isinstance(leaf, ProtocolError | ActorStopped)


def _split(batch: Any, parts: int) -> Sequence[Any]:
    if parts == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        return _split_tensor(batch, parts)
    if isinstance(batch, tuple | list):
        columns = [_split_tensor(item, parts) for item in batch]
        return [type(batch)(column[i] for column in columns) for i in range(parts)]
    raise TypeError(
        f"cannot split a {type(batch).__name__} into micro-batches: pass a tensor or a tuple"
    )


def _split_tensor(tensor: torch.Tensor, parts: int) -> Sequence[torch.Tensor]:
    if tensor.shape[0] % parts:
        raise ValueError(
            f"batch of {tensor.shape[0]} does not split into {parts} equal micro-batches"
        )
    return tensor.chunk(parts)
