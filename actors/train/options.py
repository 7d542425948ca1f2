"""`TrainerOptions`: the knobs of one worker's training loop (`paramsync.actors.train.trainer`).

Each field is checked when the options are built; a bad value is a ValueError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paramsync.actors.graph.precision import check_precision_options
from paramsync.actors.state.buckets import DEFAULT_BUCKET_BYTES
from paramsync.actors.state.digest import DigestChoice, Scheduler, check_digest_choice
from paramsync.actors.train.buffer_sync import BufferSync, check_buffer_sync
from paramsync.runtime.collectives.compression import check_comm_options
from paramsync.runtime.collectives.ring import DEFAULT_CHUNK_BYTES, TRAINING_THREADED_MIN_BYTES
from paramsync.runtime.config import DataPlane, check_data_plane
from paramsync.runtime.observe.metrics import check_port
from paramsync.runtime.protocol.messages import ParallelLayout
from paramsync.runtime.transport.torch_plane import DEFAULT_COLLECTIVE_SECONDS

__all__ = ["TrainerOptions", "check_scheduler"]


@dataclass(frozen=True)
class TrainerOptions:
    """Knobs of one worker's training loop."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    accumulation_steps: int = 1
    max_steps: int | None = None
    digest_interval: int | None = None
    """The coordinator sets how often digests are checked; a value here is an expectation:
    joining a run whose coordinator uses another interval is refused (None: follow it)."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    threaded_min_bytes: int = TRAINING_THREADED_MIN_BYTES
    """Buckets from this size all-reduce on blocking-socket threads (see `all_reduce`)."""
    threaded_shared_memory: bool = False
    """Run each shared-memory all-reduce on a worker thread rather than the event loop (see
    `paramsync.runtime.transport.shm.SharedMemoryPlane.all_reduce`): one thread hand-off per bucket
    instead of event-loop wake-ups per step signal. Off: on this project's 2-core machine it made
    the step 1-5 % longer with 2 and 4 workers (BENCHMARKS.md); it may pay where the event loop is
    busier."""
    response_cache: bool = True
    """After an epoch's first step has negotiated every bucket with the coordinator, reduce
    buckets without waiting for its go (see `GradCommActor`); the coordinator still checks
    every report."""
    verify_overlap: bool = True
    """Check step s's digests while step s+1 computes. Turn off when the coordinator re-syncs
    diverged workers (``resync``): a re-sync must not overwrite weights a forward is reading."""
    history_steps: int = 10_000
    """Steps kept in the trainer's ``losses`` and ``step_seconds`` (the newest ones): enough for
    the demo job's whole loss curve up to this many steps, bounded for runs of any length; the
    summary's first loss and throughput cover the whole run whatever this is."""
    find_unused_parameters: bool = False
    """Let a step's backward leave trainable parameters without a gradient (torch DDP's
    option of that name): their gradients reduce as zeros, and a parameter no rank used gets
    no gradient at all for the step (``.grad`` None while the optimizer steps, as in DDP), which
    costs one small extra all-reduce per step. Off: such a step fails naming the parameters.
    Every rank must set it alike."""
    clip_grad_norm: float | None = None
    """Clip the averaged gradients to this total norm before each optimizer step
    (`torch.nn.utils.clip_grad_norm_` over the model's parameters); the norm before clipping
    is kept in ``grad_norms``. None: no clipping (and no norm)."""
    clip_norm_type: float = 2.0
    """The p of the clipping norm (``math.inf``: the largest absolute gradient)."""
    join: bool = False
    """Uneven inputs (torch's ``Join``): every step first counts the ranks that still have
    data, so a rank whose data ended can keep stepping with zero gradients (`join`) until every
    rank's has; gradients stay averaged over all members (DDP's default
    ``divide_by_initial_world_size=True``). Every rank must set it alike."""
    # Gradient compression (torch DDP's comm hooks; `paramsync.runtime.collectives.compression`).
    comm_hook: str = "none"
    """How float32/float64 buckets are averaged: "none" (exact), "fp16" / "bf16" (torch's
    fp16_compress_hook / bf16_compress_hook: half the bytes) or "powersgd" (torch's
    powerSGD_hook with error feedback). Every member must use the same (the coordinator
    checks it with the bucket specs)."""
    powersgd_rank: int = 1
    """PowerSGD's ``matrix_approximation_rank``."""
    powersgd_start_iter: int = 2
    """PowerSGD's ``start_powerSGD_iter``: steps of each epoch averaged exactly before
    compression starts."""

    # -- mixed precision (see `paramsync.actors.graph.precision`)
    autocast_dtype: str | None = None
    """Run the loss function under ``torch.autocast`` of this dtype ("bfloat16": on CPU and
    CUDA; "float16": on CUDA, and on CPU where this torch has it) on the model's device type;
    None: full precision. The parameters, their gradients and the all-reduce stay in the
    parameters' dtype."""
    grad_scaler: bool = False
    """Scale the loss with a ``torch.amp.GradScaler`` (needs ``autocast_dtype="float16"``;
    meant for CUDA, torch runs it on the CPU too). A step whose averaged gradients hold an inf
    or nan is skipped on every rank, and the scale backs off identically; the scaler's state is
    covered by the state digest and carried by checkpoints and state transfers
    (`TrainingRun.grad_scaler`)."""
    grad_scaler_init_scale: float = 2.0**16
    """The loss scaler's initial scale (torch's default)."""
    grad_scaler_growth_interval: int = 2000
    """Steps without an overflow after which the loss scaler doubles its scale (torch's
    default)."""
    grad_scaler_growth_tracker: int = 0
    """Steps without an overflow the loss scaler starts having counted. A run resuming from a
    checkpoint passes its scaler's (`paramsync.actors.state.training_state.saved_grad_scaler`: its
    ``_growth_tracker``, and its ``scale`` as ``grad_scaler_init_scale``)."""

    # -- buffers
    buffer_sync: BufferSync = "broadcast"
    """How the model's buffers (BatchNorm running statistics, any registered buffer) are kept
    identical on every rank, once per step after its forward and backward, before the
    optimizer step (`paramsync.actors.train.buffer_sync`): ``"broadcast"`` ring position 0's (torch
    DDP's ``broadcast_buffers=True``, the default; the buffers each forward starts from are
    DDP's), ``"average"`` the mean of the ranks' floating-point buffers (integer and bool
    buffers such as ``num_batches_tracked`` are broadcast: a mean of counters is meaningless),
    ``"local"`` each rank keeps its own (``broadcast_buffers=False``). The identical-weights
    digest covers the buffers in the first two modes and leaves them out in ``"local"``, where
    they legitimately differ."""

    state_digest: DigestChoice = "auto"
    """The algorithm of the state digest (docs/digest.md): ``"auto"`` folds a state that has a
    tensor on an accelerator on that device (``"fold31x4"``) and hashes a state entirely on the
    CPU with XXH3 (``"xxh3-128"``, the faster there); ``"xxh3"`` or ``"fold"`` forces one. Every
    rank of a run must use the same algorithm (the coordinator refuses a step whose ranks report
    different ones): a run mixing CPU and CUDA ranks forces one."""

    # -- data plane
    data_plane: DataPlane = DataPlane.PARAMSYNC
    """Which data plane carries the bulk data (bucket all-reduces, broadcasts, state transfer,
    point-to-point tensors), a `DataPlane` or its name: ``PARAMSYNC`` (its own TCP ring and
    shared-memory plane) or ``TORCH`` (torch.distributed process groups, a new one each epoch:
    `paramsync.runtime.transport.torch_plane`; gloo on CPU, NCCL for CUDA tensors). The
    coordinator's part (sequencing, agreement, the C-DDP-001 digest, membership, epochs) is the
    same with both.
    Every rank must use the same (``paramsync worker --data-plane``, ``PARAMSYNC_DATA_PLANE``,
    TOML ``data_plane``: `trainer_from_env` reads them)."""
    collective_seconds: float = DEFAULT_COLLECTIVE_SECONDS
    """With ``data_plane=DataPlane.TORCH``: a collective's deadline (a stalled peer fails it)."""

    # -- metrics
    metrics_port: int | None = None
    """Serve this worker's Prometheus metrics at ``http://metrics_host:metrics_port/metrics``
    while the trainer runs (`paramsync.runtime.observe.metrics`; 0: a free port, see
    `DistributedTrainer.metrics_address`). None: off, unless ``paramsync worker
    --metrics-port`` asked for them (``PARAMSYNC_METRICS_PORT``)."""
    metrics_host: str | None = None
    """The address the metrics endpoint listens on (None: ``PARAMSYNC_METRICS_HOST`` or
    127.0.0.1, loopback: the endpoint is unauthenticated)."""

    # -- 3D parallelism
    parallel_layout: ParallelLayout | None = None
    """This worker's place in a 3D-parallel run
    (`paramsync.runtime.parallel.run_layout.parallel_layout`: the mesh, its coordinates, the
    pipeline schedule's digest), declared at its join (`join_run`, `train_in_process`): the
    coordinator refuses a run whose ranks disagree on it and compares state digests within each (tp,
    pp) shard's dp replicas only. None: a flat data-parallel run."""

    def __post_init__(self) -> None:
        check_buffer_sync(self.buffer_sync)
        check_digest_choice(self.state_digest)
        object.__setattr__(self, "data_plane", check_data_plane(self.data_plane))
        if not self.collective_seconds > 0:
            raise ValueError(f"collective_seconds must be positive, got {self.collective_seconds}")
        if self.metrics_port is not None:
            check_port(self.metrics_port, "metrics_port")
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {self.accumulation_steps}")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {self.max_steps}")
        if self.digest_interval is not None and self.digest_interval < 1:
            raise ValueError(f"digest_interval must be >= 1, got {self.digest_interval}")
        if self.history_steps < 1:
            raise ValueError(f"history_steps must be >= 1, got {self.history_steps}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be positive, got {self.clip_grad_norm}")
        if not self.clip_norm_type > 0:
            raise ValueError(f"clip_norm_type must be positive, got {self.clip_norm_type}")
        check_precision_options(
            self.autocast_dtype,
            self.grad_scaler,
            self.grad_scaler_init_scale,
            self.grad_scaler_growth_interval,
            self.grad_scaler_growth_tracker,
        )
        check_comm_options(self.comm_hook, self.powersgd_rank, self.powersgd_start_iter)


def check_scheduler(scheduler: Scheduler | None, optimizer: torch.optim.Optimizer) -> None:
    """Refuse a scheduler the trainer cannot step in lockstep: one of another optimizer, or one
    that needs a metric (each rank's loss differs, so their learning rates would too)."""
    if scheduler is None:
        return
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            "scheduler: ReduceLROnPlateau steps on a metric, which differs from rank to rank; "
            "step it yourself on an all-reduced metric, or pass a schedule of the step count"
        )
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(
            f"scheduler must be a torch.optim.lr_scheduler.LRScheduler, got "
            f"{type(scheduler).__name__}"
        )
    if scheduler.optimizer is not optimizer:
        raise ValueError("scheduler: it schedules another optimizer than the trainer's")
