"""`DistributedTrainer`: one worker's data-parallel training loop over its actor graph.

A worker is a trio nursery of actors joined by bounded mailboxes (`paramsync.actors.graph`): the
compute actor runs forward and backward in a worker thread, the gradient-comm actor negotiates and
all-reduces each gradient bucket while backward goes on, the optimizer actor applies the step and
reports the state digest for the C-DDP-001 check, and the data loader actor feeds batches of this
rank's shard. The trainer builds them for each membership epoch (through an `ActorFactory`), moves a
step through them, and follows the coordinator's epochs.

The trainer builds what its parts share once (`paramsync.actors.train.training_run.TrainingRun`:
the model, the optimizer and what steps them, the next step, the options, what it kept of its
steps) and hands it to its parts, each a module of its own: `paramsync.actors.train.lifecycle`
(the epoch and step lifecycle, a sans-I/O state machine), `paramsync.actors.train.epochs` (the
supervisor that runs the epochs), `paramsync.actors.train.state_moves` (an epoch's entry, state
transfer, re-sync), `paramsync.actors.train.steps` (`train_batch`, `join`, `fit`),
`paramsync.actors.train.own_step` (the caller's own loop, `DistributedTrainer.own_loop`),
`paramsync.actors.train.history` (what it keeps of its steps) and `paramsync.actors.train.options`
(`TrainerOptions`).

Besides the parameters, the trainer keeps the model's buffers identical on every rank
(`paramsync.actors.train.buffer_sync`, ``TrainerOptions.buffer_sync``), steps an optional LR
scheduler right after each optimizer step (its state travels with the training state and is part of
the digest), and exports the trained model (`DistributedTrainer.state_dict`, `save_safetensors`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch
import trio

from paramsync.actors.client.client import CoordinatorClient
from paramsync.actors.graph.compute import LossFn
from paramsync.actors.graph.factory import ActorFactory, context_actors
from paramsync.actors.graph.loader import BatchSource
from paramsync.actors.graph.optimizer import CheckCost
from paramsync.actors.graph.precision import MixedPrecision
from paramsync.actors.multidevice import DataParallelCoordinator, ReplicatedOptimizer
from paramsync.actors.state.buckets import plan_buckets
from paramsync.actors.state.digest import Scheduler
from paramsync.actors.train.epochs import Connect, EpochSupervisor, fixed_connect
from paramsync.actors.train.export import export_state_dict, save_safetensors
from paramsync.actors.train.history import StepHistory
from paramsync.actors.train.options import TrainerOptions, check_scheduler
from paramsync.actors.train.own_step import EarlyTermination, OwnLoop, OwnStep
from paramsync.actors.train.state_moves import StartingStateDiffers
from paramsync.actors.train.steps import StepRunner
from paramsync.actors.train.training_run import TrainingRun
from paramsync.runtime.config import DistributedConfig
from paramsync.runtime.observe.metrics import (
    Metrics,
    MetricsTrace,
    metrics_host_from_env,
    metrics_port_from_env,
    serve_metrics,
)
from paramsync.runtime.observe.trace import TraceRecorder
from paramsync.runtime.transport.base import Transport

__all__ = [
    "DistributedTrainer",
    "CheckCost",
    "Connect",
    "EarlyTermination",
    "TrainerOptions",
    "LossFn",
    "OwnStep",
    "Scheduler",
    "StartingStateDiffers",
]

log = logging.getLogger("paramsync.trainer")


class DistributedTrainer:
    """Data-parallel training of one model replica, kept identical with its peers.

    Use it as an async context manager inside any trio application (``open``), or from a
    synchronous script through `paramsync.actors.train.sync.SyncTrainer`. Each `train_batch` runs
    one optimizer step: forward and backward over ``accumulation_steps`` micro-batches, bucketed
    all-reduce of the trainable gradients (overlapping backward), optimizer step, and the
    coordinator's identical-weights check.

    The trainer lives through membership epochs. A supervisor task opens each epoch's data
    plane, brings a joiner the whole training state, and runs the epoch's actors; when the
    coordinator announces a new epoch (a worker died or joined) it drops the step in flight,
    which `train_batch` then runs again with the new members.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        config: DistributedConfig,
        client: CoordinatorClient,
        options: TrainerOptions,
        trace: TraceRecorder,
        connect: Connect,
        actors: ActorFactory | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        check_scheduler(scheduler, optimizer)
        _check_client(client, options)
        assert client.start is not None
        replicas = _replicas_of(model, optimizer, loss_fn, options, scheduler)
        self.run = TrainingRun(
            model=model,
            optimizer=optimizer,
            loss_fn=loss_fn,
            config=config,
            client=client,
            options=options,
            trace=trace,
            actors=actors if actors is not None else context_actors(),
            scheduler=scheduler,
            replicas=replicas,
            buckets=plan_buckets(list(model.named_parameters()), options.bucket_bytes),
            precision=MixedPrecision.for_model(
                model,
                options.autocast_dtype,
                options.grad_scaler,
                init_scale=options.grad_scaler_init_scale,
                growth_interval=options.grad_scaler_growth_interval,
                growth_tracker=options.grad_scaler_growth_tracker,
            ),
            step=client.start.step,
            history=StepHistory(options.history_steps),
        )
        """What this trainer's parts share: the model, the optimizer and what steps them, the
        next step, the options and what it kept of its steps
        (`paramsync.actors.train.training_run`)."""
        self.metrics_address: tuple[str, int] | None = None
        """Where its Prometheus metrics are served, once the trainer started (None: off)."""
        self.parallel_layout = client.layout
        """The 3D-parallel layout this worker joined with (None: a flat data-parallel run)."""
        self.supervisor = EpochSupervisor(self.run, connect)
        """Runs this trainer's membership epochs (`paramsync.actors.train.epochs`)."""
        self.steps = StepRunner(self.run, self.supervisor)
        """Runs its own steps (`train_batch`, `join`, `fit`)."""
        self.own_loop = OwnLoop(self.run, self.supervisor, self.steps)
        """The trainer's side of a caller's own loop (`paramsync.actors.train.ddp_wrapper`)."""
        client.on_epoch = self.supervisor.announce
        client.on_resync = self.supervisor.resync
        client.resume_point = self.supervisor.resume_point

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        config: DistributedConfig,
        transport: Transport | None,
        client: CoordinatorClient,
        options: TrainerOptions | None = None,
        trace: TraceRecorder | None = None,
        *,
        connect: Connect | None = None,
        actors: ActorFactory | None = None,
        scheduler: Scheduler | None = None,
    ) -> AsyncIterator[DistributedTrainer]:
        """Start the worker's supervisor in a nursery of the caller's; yield once the first
        epoch is running (weights synchronized).

        ``client`` must already have joined the run (its coordinator accepted this model) and
        be served (`CoordinatorClient.serve`). Pass the data plane as a fixed ``transport``
        (a run whose membership never changes) or as ``connect``, which opens each epoch's.
        ``actors``: the constructors of its actors (default: `context_actors`, the plain
        classes unless `actors_in_context` says otherwise).
        ``scheduler``: an LR scheduler of ``optimizer`` (torch's ``LRScheduler``), stepped right
        after each optimizer step, as a torch loop calls ``scheduler.step()`` after
        ``optimizer.step()``; its state is part of the training state (live rejoin, the digest).
        """
        options = options or TrainerOptions()
        trace = trace if trace is not None else TraceRecorder.disabled()
        metrics_port = options.metrics_port
        if metrics_port is None:
            metrics_port = metrics_port_from_env()
        metrics = Metrics("worker", rank=config.rank) if metrics_port is not None else None
        if metrics is not None:  # spans feed the metrics (timed even if not traced)
            trace = MetricsTrace(trace, metrics)
        if options.digest_interval not in (None, client.digest_interval):
            raise ValueError(
                f"this worker expects digest_interval={options.digest_interval}, the "
                f"coordinator checks every {client.digest_interval} steps"
            )
        if connect is None:
            if transport is None:
                raise ValueError("pass a transport or a connect function")
            connect = fixed_connect(transport, config)
        trainer = cls(
            model,
            optimizer,
            loss_fn,
            config,
            client,
            options,
            trace,
            connect,
            actors=actors,
            scheduler=scheduler,
        )
        trainer.supervisor.owns_transports = transport is None
        trainer.run.metrics = trainer.run.history.metrics = metrics
        async with trio.open_nursery() as nursery:
            if metrics is not None:
                assert metrics_port is not None
                host = options.metrics_host or metrics_host_from_env()
                trainer.metrics_address = await nursery.start(
                    serve_metrics, metrics, metrics_port, host
                )
                log.info(
                    "rank %d: metrics at http://%s:%d/metrics",
                    config.rank,
                    *trainer.metrics_address,
                )
            await nursery.start(trainer.supervisor.supervise)
            yield trainer
            nursery.cancel_scope.cancel()

    # ------------------------------------------------------------------ where it stands

    @property
    def model(self) -> torch.nn.Module:
        """The model replica this worker trains."""
        return self.run.model

    @property
    def step(self) -> int:
        """The next optimizer step this worker takes."""
        return self.run.step

    @property
    def unused_parameters(self) -> tuple[str, ...]:
        """The parameters no rank gave a gradient in the last step this worker took part in
        (``find_unused_parameters``; the same on every rank)."""
        return self.run.unused_parameters

    @property
    def dist_config(self) -> DistributedConfig:
        """This worker's rank, world size and coordinator address."""
        return self.run.config

    @property
    def world_size(self) -> int:
        """Number of workers training together now (the current epoch's members)."""
        return self.supervisor.world_size

    @property
    def run_id(self) -> str | None:
        """The run's id as the coordinator tells it (its ``start_run``'s ``run``: random unless
        it was given one); None before the first start, or when it named none."""
        start = self.run.client.start
        return (start.run or None) if start is not None else None

    @property
    def is_coordinator(self) -> bool:
        """Whether this worker is rank 0, the one that reports for the group."""
        return self.run.rank == 0

    # ------------------------------------------------------------------ running steps

    async def train_batch(self, batch: Any) -> float:
        """One optimizer step on this worker's ``batch``; returns its mean loss.

        A batch that is a tensor, or a tuple/list of tensors, is split along dimension 0 into
        ``accumulation_steps`` micro-batches. The identical-weights check of this step finishes
        during the next one (or in `verified`); a divergence fails the next call. If the
        membership changes meanwhile, the step runs again with the new members. If instead the
        step was completed without this call (applied while leaving an epoch, or received with
        a peer's state), it returns this worker's loss of it, or nan if none was computed.
        If the worker was rolled back to an earlier step meanwhile (a restarted coordinator
        resumed from a committed or majority state behind it), the batch is not run and it
        returns nan: the caller feeds the batch of `step` next.
        """
        return await self.steps.train_batch(batch)

    async def join(self) -> int:
        """This worker's data has ended (uneven inputs, torch's ``Join``): keep taking part in
        steps with zero gradients until every worker's data has ended; returns how many steps
        it took so. Needs ``TrainerOptions(join=True)`` on every worker.

        Each step of a ``join`` run starts with an all-reduce counting the workers that still
        have data; a joined worker contributes zeros to the step's gradient average, which
        still divides by the number of members (DDP's default,
        ``divide_by_initial_world_size=True``), so the others' steps are those of one process
        whose loss is the sum of the active shards' mean losses over the world size. Every
        worker takes the same optimizer step and the identical-weights check goes on; once
        the count is zero all workers stop at the same step (``max_steps`` ends it too)."""
        return await self.steps.join()

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
        """Train on this worker's shard of ``dataset`` through the data loader actor.

        Runs ``steps`` optimizer steps (default: until ``max_steps``), epoch after epoch.
        Step s's batch for the worker at ring position p is a pure function of (s, p), so a
        step dropped by a membership change is rerun on the data its new position owns.
        ``on_step(step, loss)`` is called after each step; ``should_stop()`` returning True
        ends training after the step in flight. With ``TrainerOptions(join=True)`` a worker
        whose steps are done (``steps`` reached, ``should_stop``) then `join`s its peers until
        theirs are too, so ``fit`` returns on every worker at the same step. Returns this call's
        (step, loss) pairs (the steps taken joined are not among them).
        """
        return await self.steps.fit(
            dataset,
            batch_size,
            steps=steps,
            seed=seed,
            prefetch=prefetch,
            on_step=on_step,
            should_stop=should_stop,
        )

    async def verified(self) -> None:
        """Wait until every step taken so far is committed: all ranks' digests agreed."""
        epochs = self.supervisor
        while True:
            await epochs.live.wait()
            with trio.CancelScope() as scope:
                epochs.step_scope = scope
                await self.run.client.wait_commit(self.step - 1)
            epochs.step_scope = None
            if not scope.cancelled_caught:
                return

    async def finish(self) -> None:
        """Tell the coordinator this worker is done, and wait for the run's end; after a
        membership change, take part in the new epoch's check and say it again."""
        self.own_loop.caller_left()
        epochs = self.supervisor
        while not self.run.client.done.is_set():
            await epochs.live.wait()
            epoch = epochs.current
            assert epoch is not None
            with trio.CancelScope() as scope:
                epochs.step_scope = scope
                await self.run.client.wait_commit(self.step - 1)
                await self.run.client.finished(self.step, epoch.start.epoch)
                await self.run.client.done.wait()
            epochs.step_scope = None

    # ------------------------------------------------------------------ what it kept

    @property
    def grad_norms(self) -> list[tuple[int, float]]:
        """(step, total gradient norm before clipping) of the last ``options.history_steps``
        steps, with ``clip_grad_norm`` set (the averaged gradients': the same on every rank)."""
        return self.run.history.grad_norms

    @property
    def skipped_steps(self) -> list[int]:
        """The last ``options.history_steps`` steps the loss scaler skipped (inf or nan in the
        averaged gradients: every rank skips the same ones)."""
        return self.run.history.skipped_steps

    def summary(self) -> dict[str, Any]:
        """Final step and loss, the digest of this rank's state after its last step (None before
        the first), the throughput and the membership epochs it saw. First loss and steps per
        second cover the whole run; the median step time the kept history (the last
        ``options.history_steps`` steps)."""
        run = self.run
        history = run.history
        stepped = bool(history.step_seconds) or history.joined_steps > 0
        digest = run.state_digest().digest if stepped else None
        return {
            "rank": run.config.rank,
            "world_size": run.config.world_size,
            "final_step": run.step,
            "first_loss": history.first_loss,
            "final_loss": history.losses[-1][1] if history.losses else None,
            "digest": digest.hex() if digest is not None else None,
            "steps_per_second": history.steps_per_second,
            "median_step_seconds": history.median_step_seconds,
            "epochs": [{"epoch": e, "step": s, "members": list(m)} for e, s, m in run.epochs],
            "hash_cpu_seconds": run.check_cost.hash_cpu_seconds,
            "digests": run.check_cost.digests,
            "skipped_steps": history.skipped_total,
            "final_grad_norm": history.grad_norms[-1][1] if history.grad_norms else None,
            "joined_steps": history.joined_steps,
            "data_plane": run.options.data_plane.value,
        }

    # ------------------------------------------------------------------ export

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained model's ``state_dict()`` as plain, contiguous CPU copies under the
        model's own names, with no wrapper prefix
        (`paramsync.actors.train.export.export_state_dict`). Call it between steps (a step in flight
        is still changing the weights)."""
        return export_state_dict(self.model)

    def save_safetensors(
        self, path: str | os.PathLike[str], metadata: dict[str, str] | None = None
    ) -> Path:
        """Write `state_dict` to a safetensors file at ``path``, its metadata recording the
        next step (`paramsync.actors.train.export.save_safetensors`). Returns the path."""
        return save_safetensors(self.model, self.step, path, metadata)


def _check_client(client: CoordinatorClient, options: TrainerOptions) -> None:
    """Refuse a client that has not joined, or joined unlike what ``options`` say."""
    if client.start is None:
        raise ValueError("the client must have joined the run (client.join) first")
    if options.parallel_layout not in (None, client.layout):
        raise ValueError(
            f"the client joined with the parallel layout {client.layout}, but the options "
            f"give {options.parallel_layout}: join with the options' layout"
        )
    if client.fold and not options.response_cache:
        # Its peers would reduce without reports while it waits for a go: a deadlock.
        raise ValueError(
            "the client offered to fold cached bucket reports (join fold=True), but "
            "response_cache is off: join with fold=False"
        )


def _replicas_of(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    options: TrainerOptions,
    scheduler: Scheduler | None,
) -> DataParallelCoordinator | None:
    """The `DataParallelCoordinator` behind a `ReplicatedOptimizer` (None for any other
    optimizer), after checking that the trainer was given its primary replica and loss function
    and no option this seam does not support; ValueError naming the one that does not fit."""
    if not isinstance(optimizer, ReplicatedOptimizer):
        return None
    replicas = optimizer.coordinator
    if model is not replicas.primary_pipeline:
        raise ValueError(
            "with a ReplicatedOptimizer the model must be its coordinator's primary_pipeline"
        )
    if loss_fn is not replicas.loss_fn:
        raise ValueError("with a ReplicatedOptimizer the loss_fn must be its coordinator's")
    unsupported = {
        "accumulation_steps": options.accumulation_steps != 1,
        "find_unused_parameters": options.find_unused_parameters,
        "autocast_dtype": options.autocast_dtype is not None,
        "grad_scaler": bool(options.grad_scaler),
        "scheduler": scheduler is not None,
    }
    named = [name for name, used in unsupported.items() if used]
    if named:
        raise ValueError(f"{', '.join(named)} not supported with several devices per process")
    return replicas
