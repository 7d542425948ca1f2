"""`DataParallelCoordinator`: one process, one model replica per device, trained in parallel.

Per step (contract C-DP-002):

1. the batch is split along dimension 0 into one shard per device, sizes differing by at most
   one (`paramsync.actors.multidevice.sharding`; fewer samples than devices is an error, never a
   fall-back to fewer devices);
2. every replica runs forward and backward on its shard on its own OS thread, at the same time
   (`paramsync.actors.multidevice.threads`);
3. the trainable gradients are averaged, each weighted by its shard's share of the batch and
   summed in device order (so the result does not depend on which thread finished first;
   element by element the same sums whether one thread sums the whole buffer or each thread a
   slice of it); with a ``loss_fn`` that returns its shard's mean loss this is exactly the
   gradient of the whole batch's mean loss. With every replica on a CUDA device the average is
   taken on replica 0's device, ordered by CUDA events, without a host round trip; otherwise on
   the host (`paramsync.actors.multidevice.averaging`);
4. every replica loads that same averaged gradient and takes its own optimizer step (no weight
   is ever copied from one replica to another after the start);
5. every ``check_interval`` steps each replica's whole state (trainable and frozen parameters,
   buffers, optimizer state) is hashed with the C-DDP-001 digest (`paramsync.actors.state.digest`),
   and a replica whose digest differs from replica 0's raises `ReplicaDivergedError` naming it and
   the first entry that differs.

`train_batch_parallel` runs steps 2-5 as one job per replica thread (one pool round-trip a
step, `paramsync.actors.multidevice.relay`). On CPU replicas steps 3-5 are mostly Python and two
threads running them at once only contend for the GIL, so the thread that finishes its backward last
takes them for every replica, one after another in device order (the result is the same: each
replica's own optimizer, the same averaged gradient); replicas that update at once (CUDA devices, or
CPU ones on an interpreter without a GIL) sum a slice of the average each and step their own
optimizers on their own threads, with barriers between the phases.

On CUDA devices a step queues its work and returns without waiting for the device, as a plain
torch loop does: the host waits only to read each shard's loss (and, when due, for the digest);
the calling thread's stream waits on the replicas' updates, so what it reads next sees them.
Each replica's optimizer is the one ``optimizer_factory`` built, never replaced: torch's foreach
kernels when built with ``foreach=None`` on CUDA, its fused ones with ``fused=True``, its
for-loop with ``foreach=False`` (`update_kernels` says which each replica runs).

Frozen parameters (``requires_grad=False``, a LoRA model's base weights) are never averaged,
copied or sent. At construction replica 0's initial parameters and buffers are loaded into the
others (as torch DDP broadcasts rank 0's at the start), and all digests are checked equal before
the first step.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paramsync.actors.multidevice.averaging import AveragingKind, averaging_kind, make_average
from paramsync.actors.multidevice.relay import UpdateRelay
from paramsync.actors.multidevice.replica import LossFn, Replica
from paramsync.actors.multidevice.sharding import batch_size, shard_sizes, split_batch
from paramsync.actors.multidevice.threads import ReplicaError, ReplicaThreads
from paramsync.actors.state.digest import StateDigest
from paramsync.runtime.errors import StateDiverged

__all__ = ["BatchResult", "DataParallelCoordinator", "ReplicaDivergedError"]

LAYOUT_DIFFERS = "the state's layout"
"""What `ReplicaDivergedError` names when no tensor differs first: the layouts do."""

ModelFactory = Callable[[], torch.nn.Module]
OptimizerFactory = Callable[[torch.nn.Module], torch.optim.Optimizer]


class ReplicaDivergedError(StateDiverged, RuntimeError):
    """After a step, a replica's state digest differs from replica 0's (C-DP-002 broken).

    A `StateDiverged` whose ``ranks`` are replica indices (``[[0], [replica]]``) and whose
    ``first_tensor`` is ``entry`` (None when the state's layout differs)."""

    def __init__(self, step: int, replica: int, device: str, entry: str) -> None:
        when = "before the first step" if step == 0 else f"after step {step}"
        super().__init__(
            f"replica {replica} on {device} diverged from replica 0 {when}: "
            f"its state differs first at {entry!r}",
            step=step,
            ranks=[[0], [replica]],
            first_tensor=None if entry == LAYOUT_DIFFERS else entry,
        )
        self.step = step
        self.replica = replica
        self.device = device
        self.entry = entry


@dataclass(frozen=True)
class BatchResult:
    """One `DataParallelCoordinator.train_batch_parallel` step."""

    step: int
    """The step just taken (1 for the first)."""
    loss: float
    """The batch's mean loss: the shards' losses weighted by their sizes."""
    losses: tuple[float, ...]
    """Each device's shard loss, in device order."""
    shard_sizes: tuple[int, ...]
    """Each device's shard size, in device order."""
    compute_seconds: float
    """Wall time of the parallel forward and backward (on CUDA: until every replica's was
    queued)."""
    averaging_seconds: float
    """Wall time of the weighted gradient average (on CUDA: of queueing it)."""
    update_seconds: float
    """Wall time of the replicas' optimizer steps (on CUDA: of queueing them, and of reading
    the losses) and, when due, the digest check."""
    checked: bool
    """Whether the replicas' digests were checked after this step."""

    @property
    def seconds(self) -> float:
        """The step's whole wall time."""
        return self.compute_seconds + self.averaging_seconds + self.update_seconds


class DataParallelCoordinator:
    """One replica of ``model_factory()`` and one ``optimizer_factory(replica)`` per device in
    ``devices`` (``"cuda:0"``, ``"cuda:1"``…, or several ``"cpu"`` entries), each driven by its
    own OS thread; `train_batch_parallel` trains one batch over all of them (C-DP-002).

    ``loss_fn(model, shard)`` returns the shard's mean loss (a scalar tensor), as for
    `DistributedTrainer`. ``check_interval``: check the replicas' digests every that many steps
    (1: every step; 0: never). ``check_buffers=False`` leaves buffers out of the check, for
    models whose buffers legitimately differ per shard (BatchNorm running statistics).
    ``intra_op_threads``: torch's intra-op threads on each replica's thread.
    ``concurrent_update``: whether the replicas take the averaging, their optimizer steps and
    their digests at once, each on its own thread (True), or one after another on the thread
    that finished its backward last (False); by default at once when a device is a GPU or the
    interpreter runs without a GIL, one after another otherwise (see
    `paramsync.actors.multidevice.relay`; both give the same bits). ``averaging``: where the
    gradients are averaged, ``"device"`` (on replica 0's device, ordered by CUDA events) or
    ``"host"``; by default on the device when every replica is on a CUDA device, on the host
    otherwise (`paramsync.actors.multidevice.averaging`; on CPU replicas ``"device"`` runs the
    same steps with no events, and gives the same bits as ``"host"``).
    """

    def __init__(
        self,
        model_factory: ModelFactory,
        optimizer_factory: OptimizerFactory,
        loss_fn: LossFn,
        devices: Sequence[str | torch.device],
        *,
        check_interval: int = 1,
        check_buffers: bool = True,
        intra_op_threads: int = 1,
        concurrent_update: bool | None = None,
        averaging: AveragingKind | None = None,
    ) -> None:
        if not devices:
            raise ValueError("DataParallelCoordinator needs at least one device")
        if check_interval < 0:
            raise ValueError(f"check_interval must be >= 0, not {check_interval}")
        self.devices = [torch.device(device) for device in devices]
        kind = averaging_kind(self.devices) if averaging is None else averaging
        if kind not in ("host", "device"):
            raise ValueError(f"averaging must be 'host' or 'device', not {averaging!r}")
        if kind == "device" and len({device.type for device in self.devices}) > 1:
            raise ValueError(
                "averaging 'device' needs every replica on CUDA devices or every one on the CPU "
                "(a mix averages on the host)"
            )
        self.averaging: AveragingKind = kind
        self.loss_fn = loss_fn
        self.check_interval = check_interval
        self._step = 0
        models = [model_factory() for _ in self.devices]
        _check_unshared(models)
        reference = models[0].state_dict()
        for model in models[1:]:
            model.load_state_dict(reference)
        self._replicas: list[Replica] = []
        for index, (device, model) in enumerate(zip(self.devices, models)):
            model.to(device)
            optimizer = optimizer_factory(model)
            self._replicas.append(
                Replica(
                    index,
                    device,
                    model,
                    optimizer,
                    check_buffers=check_buffers,
                    stage_on_host=kind == "host",
                )
            )
        first = self._replicas[0]
        names = [name for name, _ in first.trainable]
        for replica in self._replicas[1:]:
            theirs = [name for name, _ in replica.trainable]
            if theirs != names or replica.dtype != first.dtype:
                raise ValueError(
                    f"replica {replica.index}'s trainable parameters differ from replica 0's: "
                    "model_factory must build the same model every time"
                )
        self.trainable_names: tuple[str, ...] = tuple(names)
        self._threads = ReplicaThreads(len(self.devices), intra_op_threads=intra_op_threads)
        self._labels = [str(device) for device in self.devices]
        self._average = make_average(kind, self._replicas)
        self._indices = range(len(self.devices))
        if concurrent_update is None:
            concurrent_update = _gil_free() or any(d.type != "cpu" for d in self.devices)
        self.concurrent_update = concurrent_update
        try:
            self.check()
        except BaseException:
            self._threads.close()
            raise

    # -- the public surface ------------------------------------------------------------------

    @property
    def num_devices(self) -> int:
        return len(self._replicas)

    @property
    def step(self) -> int:
        """Steps taken so far."""
        return self._step

    @property
    def replicas(self) -> list[torch.nn.Module]:
        """Every device's model, in device order."""
        return [replica.model for replica in self._replicas]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [replica.optimizer for replica in self._replicas]

    @property
    def update_kernels(self) -> list[str]:
        """Which of torch's optimizer implementations each replica's optimizer runs
        (``"foreach"``, ``"fused"``, ``"for-loop"``…: `paramsync.actors.multidevice.replica.
        update_kernels`), in device order."""
        return [replica.update_kernels for replica in self._replicas]

    @property
    def primary_pipeline(self) -> torch.nn.Module:
        """The first device's replica (for evaluation and saving)."""
        return self._replicas[0].model

    def digests(self) -> list[StateDigest]:
        """Every replica's C-DDP-001 digest now, computed on the replicas' threads."""
        return self._threads.run(
            [replica.digest for replica in self._replicas], phase="digest", devices=self._labels
        )

    def check(self) -> None:
        """Raise `ReplicaDivergedError` unless every replica's digest equals replica 0's."""
        self._compare(self.digests())

    def train_batch_parallel(self, samples: Any) -> BatchResult:
        """Train one step on ``samples`` (a tensor or tuple of tensors, split along dimension 0
        over the devices): parallel forward and backward, weighted gradient average, every
        replica's optimizer step, and the digest check when due."""
        started = time.perf_counter()
        sizes = shard_sizes(batch_size(samples), self.num_devices)
        shards = split_batch(samples, self.num_devices)
        total = sum(sizes)
        marks: dict[str, float] = {}
        losses, checked = self._run_step(shards, [size / total for size in sizes], marks)
        done = time.perf_counter()
        computed = marks.get("computed", done)
        averaged = marks.get("averaged", done)
        loss = sum(value * size for value, size in zip(losses, sizes)) / total
        return BatchResult(
            step=self._step,
            loss=loss,
            losses=tuple(losses),
            shard_sizes=tuple(sizes),
            compute_seconds=computed - started,
            averaging_seconds=averaged - computed,
            update_seconds=done - averaged,
            checked=checked,
        )

    def close(self) -> None:
        """Stop the replicas' threads."""
        self._threads.close()

    def __enter__(self) -> DataParallelCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the step's phases (public for a multi-process trainer) -------------------------------

    def compute_gradients(self, samples: Any) -> tuple[list[float], list[int]]:
        """Forward and backward of every shard, in parallel: each replica's gradient ends in its
        gradient buffer (and its host copy, when averaged on the host). Returns the shard losses
        and sizes in device order."""
        sizes = shard_sizes(batch_size(samples), self.num_devices)
        shards = split_batch(samples, self.num_devices)
        loss_fn = self.loss_fn
        self._follow_caller()

        def compute(replica: Replica, shard: Any) -> float:
            replica.compute(loss_fn, shard)
            return replica.loss_value()

        jobs = [
            (lambda replica=replica, shard=shard: compute(replica, shard))
            for replica, shard in zip(self._replicas, shards)
        ]
        losses = self._threads.run(jobs, phase="forward/backward", devices=self._labels)
        return losses, sizes

    @property
    def averaged_gradient(self) -> torch.Tensor:
        """The host buffer `average_gradients` writes (trainable parameters, flat, in
        ``trainable_names`` order)."""
        return self._average.host

    def average_gradients(self, weights: Sequence[float]) -> torch.Tensor:
        """``sum(weights[i] * gradient[i])`` over the replicas in device order, into
        `averaged_gradient`: on the host, each replica thread sums one slice of it; on the
        devices, replica 0's thread queues it, and it is then copied to the host buffer."""
        average = self._average
        jobs = [(lambda index=index: average.part(index, weights)) for index in self._indices]
        self._threads.run(jobs, phase="gradient averaging", devices=self._labels)
        return average.on_host()

    def adopt_primary_state(self) -> None:
        """Load the primary replica's parameters, buffers and optimizer state into every other
        replica (after the primary took over a peer's state: a run's initial broadcast, a
        re-sync), then check the digests. Never part of a step."""
        primary = self._replicas[0]
        weights = primary.model.state_dict()
        optimizer_state = primary.optimizer.state_dict()
        for replica in self._replicas[1:]:
            replica.model.load_state_dict(weights)
            # a deep copy: torch's load_state_dict may keep the very tensors it is given
            replica.optimizer.load_state_dict(copy.deepcopy(optimizer_state))
            replica.settle()
        self.check()

    def load_primary_gradient(self, gradient: torch.Tensor) -> None:
        """Write ``gradient`` (flat, host) into the primary replica's trainable ``.grad``."""
        self._replicas[0].load_gradient(gradient)

    def primary_gradient(self) -> torch.Tensor:
        """The primary replica's trainable gradients now, flat, on the host (what a trainer
        all-reduced into them)."""
        return self._replicas[0].gradient_on_host()

    def apply_gradients(self, averaged: torch.Tensor) -> bool:
        """Every replica steps its own optimizer with ``averaged`` (a flat host tensor); then the
        digest check when due. Returns whether it was checked."""
        if averaged.shape != (self._replicas[0].numel,):
            raise ValueError(
                f"an averaged gradient of shape {tuple(averaged.shape)} for "
                f"{self._replicas[0].numel} trainable elements"
            )
        checked = self._run_step(None, None, {}, gradient=averaged)[1]
        for replica in self._replicas:
            # The caller may overwrite ``averaged`` once this returns: every copy out of it must
            # be done (a host wait on each copy's own event; the optimizer steps go on).
            replica.loaded.synchronize()
        return checked

    def _follow_caller(self) -> None:
        """Order every replica's next work after what this thread queued on its own streams,
        and have those streams wait on the replicas' updates."""
        for replica in self._replicas:
            replica.follow(replica.caller_stream())

    def _run_step(
        self,
        shards: Sequence[Any] | None,
        weights: Sequence[float] | None,
        marks: dict[str, float],
        *,
        gradient: torch.Tensor | None = None,
    ) -> tuple[list[float], bool]:
        """One step in a single pool round-trip, one job per replica thread: with ``shards``,
        forward and backward of shard ``i`` on thread ``i`` (``marks["computed"]`` once every
        gradient is ready); with ``weights``, the weighted average into `averaged_gradient`
        (``marks["averaged"]``); then every replica steps its optimizer with ``gradient``
        (default `averaged_gradient`) and, when the check is due, hashes its state; then the
        digest check. The update is taken one replica after another by the thread that arrives
        last, or by every thread at once for its own replica (`concurrent_update`,
        `UpdateRelay`). A failing replica is named with the phase it failed in; the step counts
        as taken once its gradients were computed. Returns the shard losses (empty without
        ``shards``) and whether the digests were checked."""
        average = self._average
        source, after = average.source() if gradient is None else (gradient, None)
        # The fused step's compute has just pointed every .grad at the flat buffer.
        attach = shards is None
        self._follow_caller()
        step = self._step + 1
        due = self.check_interval > 0 and step % self.check_interval == 0
        relay = UpdateRelay(self.num_devices)
        concurrent = self.concurrent_update
        replicas = self._replicas
        loss_fn = self.loss_fn
        computing = "forward/backward"
        phases = [computing if shards is not None else _STEPPING] * self.num_devices
        # The replica each thread works for (the last to arrive works for every one in turn).
        acting = list(self._indices)

        def update_all(index: int) -> list[StateDigest]:
            """Thread ``index``, the last to arrive: the whole update, one replica after
            another in device order (the optimizer steps, then the digests)."""
            if shards is not None:
                marks["computed"] = time.perf_counter()
            if weights is not None:
                phases[index] = "gradient averaging"
                average.whole(weights)
                marks["averaged"] = time.perf_counter()
            for replica in replicas:
                acting[index] = replica.index
                phases[replica.index] = _STEPPING
                replica.apply(source, after, attach=attach)
            if not due:
                return []
            digests = []
            for replica in replicas:
                acting[index] = replica.index
                phases[replica.index] = _HASHING
                digests.append(replica.digest())
            return digests

        def update_own(index: int) -> list[StateDigest] | None:
            """Thread ``index``'s part when every replica updates at once: its slice of the
            average, a barrier, its own replica's step and digest (None if another failed)."""
            replica = replicas[index]
            if shards is not None:
                if not relay.wait_all():
                    return None
                if index == 0:
                    marks["computed"] = time.perf_counter()
            if weights is not None:
                phases[index] = "gradient averaging"
                average.part(index, weights)
                if not relay.wait_all():
                    return None
                if index == 0:
                    marks["averaged"] = time.perf_counter()
            phases[index] = _STEPPING
            replica.apply(source, after, attach=attach)
            if not due:
                return []
            phases[index] = _HASHING
            return [replica.digest()]

        def job(index: int) -> tuple[float, list[StateDigest] | None]:
            try:
                if shards is not None:
                    replicas[index].compute(loss_fn, shards[index])
                if concurrent:
                    digests = update_own(index)
                else:
                    digests = update_all(index) if relay.arrive() else None
                # Read after the update is queued: on CUDA the device is never left idle
                # while the host waits for the loss.
                loss = replicas[index].loss_value() if shards is not None else 0.0
                return loss, digests
            except BaseException:
                relay.abort()
                raise

        jobs = [(lambda index=index: job(index)) for index in self._indices]
        try:
            results = self._threads.run(jobs, phase=computing, devices=self._labels)
        except ReplicaError as error:
            failed = acting[error.replica]
            phase = phases[failed]
            if phase != computing:
                self._step = step  # the replicas were past their gradients: the step was taken
            if failed == error.replica and phase == error.phase:
                raise
            cause = error.__cause__ if error.__cause__ is not None else error
            raise ReplicaError(failed, self._labels[failed], phase, cause) from cause
        self._step = step
        if due:
            digests = [digest for _, part in results if part for digest in part]
            self._compare(digests)
        return ([loss for loss, _ in results] if shards is not None else []), due

    def _compare(self, digests: list[StateDigest]) -> None:
        first = digests[0]
        for index, digest in enumerate(digests[1:], start=1):
            if digest != first:
                entry = next(
                    (
                        name
                        for (name, mine), (_, theirs) in zip(digest.tensors, first.tensors)
                        if mine != theirs
                    ),
                    LAYOUT_DIFFERS,
                )
                raise ReplicaDivergedError(self._step, index, self._labels[index], entry)


_STEPPING = "optimizer step"
_HASHING = "digest"


def _gil_free() -> bool:
    """Whether this interpreter runs Python threads without a GIL (a free-threaded build)."""
    is_gil_enabled = getattr(sys, "_is_gil_enabled", None)
    return is_gil_enabled is not None and not is_gil_enabled()


def _check_unshared(models: list[torch.nn.Module]) -> None:
    """ValueError unless every model and every parameter is a distinct object (a factory that
    returns one module, or wraps one base module, would make the replicas share weights)."""
    owner: dict[int, tuple[int, str]] = {}
    for index, model in enumerate(models):
        for name, param in model.named_parameters():
            seen = owner.setdefault(id(param), (index, name))
            if seen[0] != index:
                raise ValueError(
                    f"replica {index}'s parameter {name!r} is replica {seen[0]}'s {seen[1]!r}: "
                    "model_factory must build a new model each call (deep-copy a shared base)"
                )
