"""`TrainingRun`: what a worker's trainer and its parts share.

`DistributedTrainer` builds one and passes it to each of its parts: the epoch supervisor
(`paramsync.actors.train.epochs`), the step runner (`paramsync.actors.train.steps`), the caller's
own loop (`paramsync.actors.train.own_step`) and the functions that move the state between ranks
(`paramsync.actors.train.state_moves`). They read and change it in the trainer's event loop (and
the optimizer actor's thread, which moves ``step`` on as it applies a step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paramsync.actors.client.client import CoordinatorClient
from paramsync.actors.graph.compute import LossFn
from paramsync.actors.graph.factory import ActorFactory, context_actors
from paramsync.actors.graph.optimizer import CheckCost
from paramsync.actors.graph.precision import GradScalerDigests, MixedPrecision
from paramsync.actors.multidevice import DataParallelCoordinator
from paramsync.actors.state.buckets import Bucket
from paramsync.actors.state.digest import Scheduler, StateDigest, state_digest
from paramsync.actors.train.history import StepHistory
from paramsync.actors.train.options import TrainerOptions
from paramsync.runtime.config import DistributedConfig
from paramsync.runtime.observe.metrics import Metrics
from paramsync.runtime.observe.trace import TraceRecorder
from paramsync.runtime.transport.device_ops import DeviceOps, context_device_ops

__all__ = ["TrainingRun"]


@dataclass
class TrainingRun:
    """One worker's training: its model replica, optimizer and what steps them, where the run
    is (``step``), how it trains (``options``) and what it kept of its steps."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    """The optimizer the steps apply (the caller's own, once bound: `OwnLoop.bind_optimizer`)."""
    loss_fn: LossFn
    config: DistributedConfig
    """This worker's rank, world size and coordinator address."""
    client: CoordinatorClient
    options: TrainerOptions
    trace: TraceRecorder = field(default_factory=TraceRecorder.disabled)
    actors: ActorFactory = field(default_factory=context_actors)
    """The constructors of the trainer's actors (see `ActorFactory`)."""
    device_ops: DeviceOps = field(default_factory=context_device_ops)
    """The device operations of the gradient and buffer copies (see
    `paramsync.runtime.transport.device_ops`): the context's when the run was made (a state
    capture for a rejoin uses the context's, `capture_state`)."""
    scheduler: Scheduler | None = None
    """The LR scheduler stepped right after each optimizer step (None: none)."""
    replicas: DataParallelCoordinator | None = None
    """The process's devices' replicas when ``optimizer`` is a `ReplicatedOptimizer`
    (hierarchical data parallelism), else None."""
    precision: MixedPrecision | None = None
    """Autocast and the loss scaler (None: full precision), from the options."""
    buckets: list[Bucket] = field(default_factory=list)
    """The gradient buckets the trainable parameters are all-reduced in."""
    step: int = 0
    """The next optimizer step this worker takes."""
    history: StepHistory = field(default_factory=lambda: StepHistory(0))
    """The last ``options.history_steps`` steps' losses, times, gradient norms and skips,
    and the whole run's totals."""
    watched_scaler: torch.amp.GradScaler | None = None
    """A loss scaler of the caller's own loop, covered by the digests (`watch_grad_scaler`)."""
    metrics: Metrics | None = None
    """This worker's Prometheus metrics (None: off; `TrainerOptions.metrics_port`)."""
    unused_parameters: tuple[str, ...] = ()
    """The parameters no rank gave a gradient in the last step this worker took part in
    (``find_unused_parameters``; the same on every rank)."""
    check_cost: CheckCost = field(default_factory=CheckCost)
    """The identical-weights check's cost to this worker so far (all epochs)."""
    epochs: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    """(epoch, first step, members) of every epoch this worker took part in."""
    states_received: int = 0
    """How many times a peer's state replaced this worker's (a donor's whole state, a
    re-sync): a state captured before then is not the one a later commit checked."""

    @property
    def rank(self) -> int:
        """This worker's rank (its slot, stable across epochs)."""
        return self.config.rank

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler (None without ``TrainerOptions(grad_scaler=True)``): pass it as
        ``grad_scaler`` to `capture_state` with the model and optimizer to checkpoint it (a
        resumed run starts its scaler from `saved_grad_scaler`, through the options)."""
        return self.precision.scaler if self.precision is not None else None

    @property
    def reached_max_steps(self) -> bool:
        """Whether ``max_steps`` optimizer steps have been taken."""
        return self.options.max_steps is not None and self.step >= self.options.max_steps

    def resume_digest(self) -> StateDigest:
        """The digest a worker rejoins with, here and in `join_run` (no loss scaler entry)."""
        return state_digest(
            self.model,
            self.optimizer,
            self.scheduler,
            buffers=self.options.buffer_sync != "local",
            algorithm=self.options.state_digest,
        )

    def state_digest(self) -> StateDigest:
        """The digest of this worker's training state now, as the C-DDP-001 check computes it:
        parameters, buffers (unless kept local), optimizer and LR scheduler state, and the loss
        scaler's state in a mixed-precision run."""
        digest = self.resume_digest()
        scaler = self.grad_scaler
        return GradScalerDigests(scaler).extend(digest) if scaler is not None else digest
