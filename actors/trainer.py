"""The worker's actor graph and `DistributedTrainer` (seed 001).

A worker is a trio nursery of actors joined by bounded mailboxes:

- `ComputeActor` runs forward and backward in a worker thread, so the event loop keeps serving
  the network; during the last backward of a step, gradient hooks report each bucket the moment
  all its gradients exist;
- `GradCommActor` packs a ready bucket (pre-averaged over accumulation steps), reports it ready
  to the coordinator, and all-reduces it when the coordinator says go, overlapping the rest of
  backward; buckets run in the coordinator's order on every rank;
- `OptimizerActor` steps the optimizer with the averaged gradients and reports the state digest
  for the C-DDP-001 check, waiting for the coordinator's commit;
- `DataLoaderActor` (in `actors.loader`) feeds batches of this rank's shard.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from runtime.actor import Actor, ActorSystem
from runtime.collectives import (
    DEFAULT_CHUNK_BYTES,
    TRAINING_THREADED_MIN_BYTES,
    all_reduce,
    broadcast,
)
from runtime.config import DistributedConfig
from runtime.coordinator_core import ResyncOrder
from runtime.errors import ProtocolError
from runtime.trace import TraceRecorder
from runtime.transport import Transport
from runtime.wire import Field, register_message

from .buckets import DEFAULT_BUCKET_BYTES, Bucket, plan_buckets
from .client import CoordinatorClient, Go
from .digest import named_state, state_digest
from .loader import BatchSource, DataLoaderActor, LoadNext

__all__ = [
    "DistributedTrainer",
    "ComputeActor",
    "GradCommActor",
    "OptimizerActor",
    "TrainerOptions",
    "LossFn",
]

log = logging.getLogger("paramsync.trainer")

register_message(
    "state",
    step=Field(int, min=0),
    index=Field(int, min=0),
    data=Field(torch.Tensor),
)

_OPTIMIZER_STEP_LOCK = threading.Lock()
"""Optimizer steps of the trainers in one process run one at a time. torch's optimizers are not
safe to step from several threads at once: two threads taking the first AdamW step of two
identical replicas (tied embeddings, identical gradients) disagreed on the tied weight in about
1 run in 12 (tests/test_soak.py reproduces it without paramsync). Only in-process groups run
several trainers in one process, and a step is milliseconds, so the lock costs nothing else."""

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``loss_fn(model, micro_batch) -> scalar loss``: the user's forward pass."""


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
    verify_overlap: bool = True
    """Check step s's digests while step s+1 computes. Turn off when the coordinator re-syncs
    diverged workers (``resync``): a re-sync must not overwrite weights a forward is reading."""

    def __post_init__(self) -> None:
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {self.accumulation_steps}")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {self.max_steps}")
        if self.digest_interval is not None and self.digest_interval < 1:
            raise ValueError(f"digest_interval must be >= 1, got {self.digest_interval}")


# ----------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Backward:
    """Run forward and backward on ``micro_batch``; ``sync`` on the step's last micro-batch."""

    step: int
    micro_batch: Any
    sync: bool


@dataclass(frozen=True)
class BucketReady:
    step: int
    bucket: int


@dataclass(frozen=True)
class OptimizerStep:
    """Apply the averaged gradients of ``step``."""

    step: int


@dataclass(frozen=True)
class Verify:
    """Report ``step``'s state digest and wait for the coordinator's commit."""

    step: int


@dataclass
class _StepState:
    step: int
    reduced: int = 0
    all_reduced: trio.Event = field(default_factory=trio.Event)


# ----------------------------------------------------------------------------- actors


class ComputeActor(Actor):
    """Forward and backward in a worker thread; hooks announce finished gradient buckets."""

    accepts = (Backward,)

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: LossFn,
        buckets: list[Bucket],
        on_bucket: Callable[[int, int], None],
        trace: TraceRecorder,
    ) -> None:
        super().__init__("compute", mailbox_size=2)
        self.model = model
        self.loss_fn = loss_fn
        self.trace = trace
        self._on_bucket = on_bucket
        self._params = dict(model.named_parameters())
        self._bucket_of = {name: b.index for b in buckets for name in b.names}
        self._pending: list[int] = [len(b.names) for b in buckets]
        self._sizes = [len(b.names) for b in buckets]
        self._sync_step: int | None = None
        self._hooks = [
            self._params[name].register_post_accumulate_grad_hook(self._make_hook(name))
            for name in self._bucket_of
        ]

    def _make_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        bucket = self._bucket_of[name]

        def hook(_param: torch.Tensor) -> None:
            if self._sync_step is None:
                return
            self._pending[bucket] -= 1
            if self._pending[bucket] == 0:
                self._on_bucket(self._sync_step, bucket)

        return hook

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the model."""
        for handle in self._hooks:
            handle.remove()

    async def handle(self, message: object) -> float:
        assert isinstance(message, Backward)
        return await trio.to_thread.run_sync(self._backward, message)

    def _backward(self, message: Backward) -> float:
        if message.sync:
            self._pending = list(self._sizes)
            self._sync_step = message.step
        try:
            with self.trace.span("forward", actor="compute", step=message.step):
                loss = self.loss_fn(self.model, message.micro_batch)
            with self.trace.span("backward", actor="compute", step=message.step):
                loss.backward()
        finally:
            self._sync_step = None
        if message.sync and any(self._pending):
            missing = [i for i, left in enumerate(self._pending) if left]
            raise RuntimeError(
                f"step {message.step}: backward produced no gradient for buckets {missing} "
                "(parameters unused by the loss cannot be synchronized)"
            )
        return float(loss.detach())


class GradCommActor(Actor):
    """Packs ready buckets, negotiates them with the coordinator, all-reduces them."""

    accepts = (BucketReady, Go)

    def __init__(
        self,
        model: torch.nn.Module,
        buckets: list[Bucket],
        transport: Transport,
        client: CoordinatorClient,
        options: TrainerOptions,
        trace: TraceRecorder,
    ) -> None:
        super().__init__("gradient-comm", mailbox_size=2 * len(buckets) + 4)
        self.buckets = buckets
        self.transport = transport
        self.client = client
        self.options = options
        self.trace = trace
        params = dict(model.named_parameters())
        self._params = [[params[name] for name in bucket.names] for bucket in buckets]
        self._flats = [torch.empty(bucket.numel, dtype=bucket.dtype) for bucket in buckets]
        self.current: _StepState | None = None

    def begin_step(self, step: int) -> _StepState:
        """Expect ``len(buckets)`` reductions for ``step``."""
        self.current = _StepState(step)
        if not self.buckets:
            self.current.all_reduced.set()
        return self.current

    async def handle(self, message: object) -> None:
        if isinstance(message, BucketReady):
            await self._ready(message)
        else:
            assert isinstance(message, Go)
            await self._reduce(message)

    async def _ready(self, message: BucketReady) -> None:
        bucket = self.buckets[message.bucket]
        grads = [param.grad for param in self._params[message.bucket]]
        flat = self._flats[message.bucket]
        with self.trace.span("pack", actor="gradient-comm", bucket=bucket.index):
            if grads and grads[0] is not None and grads[0].device.type == "cuda":
                # C-STREAMSYNC-001: gradients must be complete before the host copy.
                torch.cuda.current_stream(grads[0].device).synchronize()
            bucket.pack([g for g in grads if g is not None], flat)
            if self.options.accumulation_steps > 1:
                flat.div_(self.options.accumulation_steps)
        # Step s+1 may report before step s is committed: the coordinator holds the report and
        # says go only after the commit, so the check stays off the critical path.
        await self.client.ready(message.step, bucket.index, bucket.spec())

    async def _reduce(self, go: Go) -> None:
        state = self.current
        if state is None or go.step != state.step:
            raise RuntimeError(f"coordinator said go for step {go.step} outside that step")
        bucket = self.buckets[go.bucket]
        flat = self._flats[go.bucket]
        with self.trace.span(
            "all-reduce", actor="gradient-comm", bucket=go.bucket, bytes=flat.numel() * 4
        ):
            await all_reduce(
                self.transport,
                flat,
                "avg",
                chunk_bytes=self.options.chunk_bytes,
                threaded_min_bytes=self.options.threaded_min_bytes,
            )
        grads = [param.grad for param in self._params[go.bucket]]
        bucket.unpack(flat, [g for g in grads if g is not None])
        state.reduced += 1
        if state.reduced == len(self.buckets):
            state.all_reduced.set()


class OptimizerActor(Actor):
    """Applies the averaged gradients and reports the state digest (C-DDP-001).

    Verification of step s (hashing, reporting, waiting for the commit) runs while step s+1
    computes forward and backward, which only read the weights; the next optimizer step waits
    in the mailbox behind it, so no weight changes before step s is committed everywhere.
    """

    accepts = (OptimizerStep, Verify)

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        client: CoordinatorClient,
        options: TrainerOptions,
        trace: TraceRecorder,
    ) -> None:
        super().__init__("optimizer", mailbox_size=2)
        self.model = model
        self.optimizer = optimizer
        self.client = client
        self.options = options
        self.trace = trace
        self.last_digest: bytes | None = None

    async def handle(self, message: object) -> None:
        if isinstance(message, OptimizerStep):
            with self.trace.span("optimizer", actor="optimizer", step=message.step):
                await trio.to_thread.run_sync(self._apply)
            return
        assert isinstance(message, Verify)
        step = message.step
        if step % self.client.digest_interval == 0:
            with self.trace.span("digest", actor="optimizer", step=step):
                digest = await trio.to_thread.run_sync(state_digest, self.model, self.optimizer)
            self.last_digest = digest.digest
            await self.client.digest(step, digest.digest, digest.tensors)
        else:
            await self.client.step_done(step)
        with self.trace.span("commit-wait", actor="optimizer", step=step):
            await self.client.wait_commit(step)

    def _apply(self) -> None:
        with _OPTIMIZER_STEP_LOCK:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)


# ----------------------------------------------------------------------------- trainer


class DistributedTrainer:
    """Data-parallel training of one model replica, kept identical with its peers.

    Use it as an async context manager inside any trio application (``open``), or from a
    synchronous script through `actors.sync.SyncTrainer`. Each `train_batch` runs one optimizer
    step: forward and backward over ``accumulation_steps`` micro-batches, bucketed all-reduce of
    the trainable gradients (overlapping backward), optimizer step, and the coordinator's
    identical-weights check.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        config: DistributedConfig,
        transport: Transport,
        client: CoordinatorClient,
        system: ActorSystem,
        options: TrainerOptions,
        trace: TraceRecorder,
        start_step: int = 0,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self._config = config
        self.transport = transport
        self.client = client
        self.options = options
        self.trace = trace
        self.step = start_step
        self.losses: list[tuple[int, float]] = []
        self.step_seconds: list[float] = []
        self.buckets = plan_buckets(list(model.named_parameters()), options.bucket_bytes)
        self._system = system
        token = trio.lowlevel.current_trio_token()
        self.comm = GradCommActor(model, self.buckets, transport, client, options, trace)

        def on_bucket(step: int, bucket: int) -> None:
            # Called on the backward thread; waits until the bucket is in the comm actor's
            # mailbox (sized for every bucket of a step, so the wait is one loop turn).
            trio.from_thread.run(self.comm.tell, BucketReady(step, bucket), trio_token=token)

        self.compute = ComputeActor(model, loss_fn, self.buckets, on_bucket, trace)
        self.optimizer_actor = OptimizerActor(model, optimizer, client, options, trace)
        client.on_go = self.comm.tell
        client.on_resync = self._resync

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        config: DistributedConfig,
        transport: Transport,
        client: CoordinatorClient,
        options: TrainerOptions | None = None,
        trace: TraceRecorder | None = None,
    ) -> AsyncIterator[DistributedTrainer]:
        """Start the worker's actors in a nursery of the caller's and sync rank 0's weights.

        ``client`` must already have joined the run (its coordinator accepted this model).
        """
        options = options or TrainerOptions()
        trace = trace if trace is not None else TraceRecorder.disabled()
        if (transport.rank, transport.world_size) != (config.rank, config.world_size):
            raise ValueError("transport and config disagree on rank or world size")
        if options.digest_interval not in (None, client.digest_interval):
            raise ValueError(
                f"this worker expects digest_interval={options.digest_interval}, the "
                f"coordinator checks every {client.digest_interval} steps"
            )
        async with ActorSystem() as system:
            trainer = cls(
                model,
                optimizer,
                loss_fn,
                config,
                transport,
                client,
                system,
                options,
                trace,
                start_step=client.start_step,
            )
            try:
                await trainer._sync_initial_weights()
                await system.start(trainer.compute)
                await system.start(trainer.comm)
                await system.start(trainer.optimizer_actor)
                yield trainer
            finally:
                trainer.compute.remove_hooks()

    async def _sync_initial_weights(self) -> None:
        """Broadcast rank 0's parameters and buffers so every replica starts identical."""
        for tensor in list(self.model.parameters()) + list(self.model.buffers()):
            host = tensor.detach().to("cpu").contiguous()
            await broadcast(self.transport, host, root=0, chunk_bytes=self.options.chunk_bytes)
            with torch.no_grad():  # never across an await: grad mode is per thread, not per task
                tensor.copy_(host)

    # ------------------------------------------------------------------ the seed's API

    @property
    def dist_config(self) -> DistributedConfig:
        """This worker's rank, world size and coordinator address."""
        return self._config

    @property
    def world_size(self) -> int:
        """Number of workers training together."""
        return self._config.world_size

    @property
    def is_coordinator(self) -> bool:
        """Whether this worker is rank 0, the one that reports for the group."""
        return self._config.rank == 0

    @property
    def reached_max_steps(self) -> bool:
        """Whether ``max_steps`` optimizer steps have been taken."""
        return self.options.max_steps is not None and self.step >= self.options.max_steps

    async def train_batch(self, batch: Any) -> float:
        """One optimizer step on this worker's ``batch``; returns its mean loss.

        A batch that is a tensor, or a tuple/list of tensors, is split along dimension 0 into
        ``accumulation_steps`` micro-batches. The identical-weights check of this step finishes
        during the next one (or in `verified`); a divergence fails the next call.
        """
        if self.reached_max_steps:
            raise RuntimeError(f"max_steps={self.options.max_steps} already reached")
        started = time.perf_counter()
        step = self.step
        state = self.comm.begin_step(step)
        micro_batches = _split(batch, self.options.accumulation_steps)
        total = 0.0
        for index, micro in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            total += await self.compute.ask(Backward(step, micro, last))
        with self.trace.span("grad-wait", actor="trainer", step=step):
            await state.all_reduced.wait()
        await self.optimizer_actor.ask(OptimizerStep(step))
        if self.options.verify_overlap:
            await self.optimizer_actor.tell(Verify(step))
        else:
            await self.optimizer_actor.ask(Verify(step))
        loss = total / len(micro_batches)
        self.step += 1
        self.losses.append((step, loss))
        self.step_seconds.append(time.perf_counter() - started)
        return loss

    async def _resync(self, order: ResyncOrder) -> None:
        """Copy the source rank's parameters and optimizer state to the diverged ranks."""
        rank = self._config.rank
        if rank != order.source and rank not in order.targets:
            return
        tensors = [tensor for _, tensor in named_state(self.model, self.optimizer)]
        log.warning(
            "step %d: re-syncing ranks %s from rank %d",
            order.step,
            list(order.targets),
            order.source,
        )
        for index, tensor in enumerate(tensors):
            fields = {"step": order.step, "index": index}
            if rank == order.source:
                host = tensor.detach().to("cpu").contiguous()
                for target in order.targets:
                    await self.transport.send(target, "state", fields, host)
            else:
                host = torch.empty(tensor.shape, dtype=tensor.dtype)
                message = await self.transport.recv_into(order.source, host)
                if (message["kind"], message["step"], message["index"]) != (
                    "state",
                    *fields.values(),
                ):
                    raise ProtocolError(
                        f"re-sync of step {order.step}: expected state tensor {index}, got "
                        f"{message['kind']} {message.get('index')}",
                        peer=order.source,
                    )
                with torch.no_grad():
                    tensor.copy_(host)

    async def verified(self) -> None:
        """Wait until every step taken so far is committed: all ranks' digests agreed."""
        await self.client.wait_commit(self.step - 1)

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
        """Train on this rank's shard of ``dataset`` through the data loader actor.

        Runs ``steps`` optimizer steps (default: until ``max_steps``), epoch after epoch.
        ``on_step(step, loss)`` is called after each step; ``should_stop()`` returning True
        ends training after the step in flight. Returns this call's (step, loss) pairs.
        """
        if steps is None and self.options.max_steps is None:
            raise ValueError("fit needs steps= or TrainerOptions(max_steps=...)")
        loader = DataLoaderActor(
            dataset,
            batch_size,
            self._config.rank,
            self._config.world_size,
            seed=seed,
            prefetch=prefetch,
        )
        await self._system.start(loader)
        for _ in range(prefetch):
            await loader.tell(LoadNext())
        history: list[tuple[int, float]] = []
        while not self.reached_max_steps and (steps is None or len(history) < steps):
            if should_stop is not None and should_stop():
                break
            with self.trace.span("load", actor="data-loader", step=self.step):
                _, batch = await loader.batches.receive()
            await loader.tell(LoadNext())
            loss = await self.train_batch(batch)
            history.append((self.step - 1, loss))
            if on_step is not None:
                on_step(self.step - 1, loss)
        await loader.stop()
        return history

    def summary(self) -> dict[str, Any]:
        """Final step and loss, the digest of this rank's state after its last step (None before
        the first), and the throughput."""
        seconds = sum(self.step_seconds)
        digest = state_digest(self.model, self.optimizer).digest if self.step_seconds else None
        return {
            "rank": self._config.rank,
            "world_size": self._config.world_size,
            "final_step": self.step,
            "first_loss": self.losses[0][1] if self.losses else None,
            "final_loss": self.losses[-1][1] if self.losses else None,
            "digest": digest.hex() if digest is not None else None,
            "steps_per_second": len(self.step_seconds) / seconds if seconds else None,
            "median_step_seconds": sorted(self.step_seconds)[len(self.step_seconds) // 2]
            if self.step_seconds
            else None,
        }


def _split(batch: Any, parts: int) -> list[Any]:
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
