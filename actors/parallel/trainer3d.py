"""`Trainer3D`: one process of a dp x tp x pp training run, as a `ParallelismConfig` lays it out.

`Trainer3D.create` (every rank of the world calls it alike):

1. lays the world out on the device mesh ``("pp", "dp", "tp")``, Megatron's order, tensor
   parallel fastest (`paramsync.runtime.collectives.mesh.init_device_mesh`), and the 2-rank
   embedding groups of the first and last pipeline ranks when the embedding is tied;
2. builds this rank's shard of the transformer (`paramsync.actors.parallel.shard_model`): its tp
   slice of every weight, cut into layers, with activation checkpointing of the blocks when asked;
   the pipeline rank keeps its p * v stages' layers
   (`paramsync.actors.parallel.pipeline.PipelineStage`, traced per action by
   `paramsync.actors.parallel.traced_stage`);
3. builds the optimizer over the rank's parameters: plain, or ZeRO-1 over the dp group
   (`paramsync.actors.parallel.zero.ZeroRedundancyOptimizer`) when ``memory_optimization ==
   "zero1"``;
4. generates the rank's action list of the configured schedule
   (`paramsync.runtime.parallel.build_schedule`).

Before any of it, the ranks all-gather digests of their layout (config, model, options) and of
the whole schedule (`paramsync.actors.parallel.layout_check`): a rank started differently is refused
by every rank with an error naming the ranks on each side, instead of hanging in a group that never
forms.

`Trainer3D.train_step` takes this dp replica's batch (every tp and pp rank of the replica gets
the same one), cuts it into the micro-batches, runs the schedule (tensor-parallel collectives run
inside the compute through `paramsync.runtime.collectives.from_thread.ThreadCollectives`; gradients
fold in micro-batch order), and returns the batch's mean loss over every dp replica. Every
``accumulation_steps``-th batch it then steps the optimizer: the accumulated gradients divided by
the number of batches, the tied embedding's gradients summed over its two copies, the dp average (or
ZeRO-1's reduce-scatter), global-norm clipping over the tp and pp groups when ``max_grad_norm`` is
set (each parameter counted once, `paramsync.actors.parallel.grad_clip`), the step. After every
optimizer step the replicas of each (tp, pp) shard compare their state digests over their dp group
(`paramsync.actors.parallel.replica_check`: C-DDP-001 generalized), and a mismatch raises
`ShardReplicasDiverged` naming the shard and the ranks.

A failure in a step (a peer gone, a diverged shard, a compute error) closes every group of this
rank, so that its peers fail too instead of waiting for it, and the trainer refuses more steps.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import asdict, fields
from typing import Any, Protocol, runtime_checkable

import torch
import trio
from torch import nn

from paramsync.actors.parallel.grad_clip import (
    clip_coefficient,
    clip_grad_norm_async,
    counts_for_norm,
)
from paramsync.actors.parallel.layout_check import check_layout_agreement, layout_digest
from paramsync.actors.parallel.pipeline import split_microbatches
from paramsync.actors.parallel.pipeline_grads import new_embedding_group, sum_tied
from paramsync.actors.parallel.replica_check import check_shard_replicas
from paramsync.actors.parallel.shard_model import ModelSpec, ShardModel, build_shard_model
from paramsync.actors.parallel.stages import stage_rank
from paramsync.actors.parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from paramsync.actors.parallel.traced_stage import PIPELINE_TRACK, TracedPipelineStage
from paramsync.actors.parallel.zero import ZeroRedundancyOptimizer
from paramsync.actors.state.digest import StateDigest, StateHasher
from paramsync.runtime.collectives.from_thread import ThreadCollectives
from paramsync.runtime.collectives.groups import ProcessGroup
from paramsync.runtime.collectives.mesh import DeviceMesh, init_device_mesh
from paramsync.runtime.collectives.ring import all_reduce, broadcast
from paramsync.runtime.observe.trace import TraceRecorder
from paramsync.runtime.parallel.config import DataPlane, ParallelismConfig
from paramsync.runtime.parallel.schedules import Schedule, build_schedule, schedule_digest
from paramsync.runtime.transport.base import InProcessTransport, Transport
from paramsync.runtime.transport.capabilities import NativeCollectives
from paramsync.runtime.transport.tcp import TcpTransport
from paramsync.runtime.transport.torch_plane import TorchPlaneTransport, connect_torch_transport

__all__ = ["Trainer3D", "OptimizerFactory", "StepHooks"]

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""Builds the optimizer over a list of tensors: ``lambda ps: torch.optim.SGD(ps, lr=0.1)``."""


@runtime_checkable
class StepHooks(Protocol):
    """What a run around the trainer does at each optimizer step (a coordinator's protocol:
    `paramsync.actors.parallel.coordinated.CoordinatorStepHooks`). ``step`` counts optimizer steps
    from
    0. Every rank of a dp group calls them at the same steps."""

    async def before_reduce(self, step: int, dp_group: Transport, flat_numel: int) -> None:
        """Before the gradients are reduced over ``dp_group`` (``flat_numel`` elements)."""
        ...

    async def after_step(self, step: int, digest: StateDigest) -> None:
        """After the optimizer step, with this rank's shard digest (`Trainer3D.shard_digest`)."""
        ...


class Trainer3D:
    """One rank of a 3D-parallel run. Build with ``await Trainer3D.create(...)``; close with
    ``await trainer.aclose()`` (or ``async with``)."""

    def __init__(
        self,
        *,
        config: ParallelismConfig,
        spec: ModelSpec,
        mesh: DeviceMesh,
        embedding_group: ProcessGroup | None,
        shard: ShardModel,
        stage: TracedPipelineStage,
        schedule: Schedule,
        optimizer: torch.optim.Optimizer | None,
        zero: ZeroRedundancyOptimizer | None,
        max_grad_norm: float | None,
        check_every: int,
        activation_shape: list[tuple[int, ...]],
        hooks: StepHooks | None = None,
        plane: TorchPlaneTransport | None = None,
    ) -> None:
        self.config = config
        self.spec = spec
        self.mesh = mesh
        self.embedding_group = embedding_group
        self.shard = shard
        self.stage = stage
        self.schedule = schedule
        self.optimizer = optimizer
        self.zero = zero
        self.max_grad_norm = max_grad_norm
        self.check_every = check_every
        self._activation_shape = activation_shape
        self.hooks = hooks
        self.plane = plane
        """The torch data plane this trainer formed over its world (``data_plane=DataPlane.TORCH``
        on a paramsync world; None otherwise): its groups live on it, and it closes with them."""
        self.tp = mesh.coordinate("tp")
        self.pp = mesh.coordinate("pp")
        self.dp = mesh.coordinate("dp")
        self.batches = 0
        """Batches trained (each one run of the schedule)."""
        self.optimizer_steps = 0
        self.checks_passed = 0
        """Optimizer steps after which this shard's replicas were compared and agreed (none
        with dp_size 1: a shard without replicas has nothing to compare)."""
        self.last_grad_norm: float | None = None
        self.module = nn.ModuleList(stage.chunks.values())
        """This rank's stages as one module (what its digest covers)."""
        self._hasher = StateHasher()
        self._digest_names = {
            f"param/{name}": f"{shard.dense_names[id(param)]} ({name} here)"
            for name, param in self.module.named_parameters()
        }
        self._norm_mask: torch.Tensor | None = None
        self.broken: BaseException | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    async def create(
        cls,
        world: Transport,
        config: ParallelismConfig,
        spec: ModelSpec,
        optimizer_factory: OptimizerFactory,
        *,
        max_grad_norm: float | None = None,
        check_every: int = 1,
        recv_seconds: float | None = None,
        tracer: TraceRecorder | None = None,
        hooks: StepHooks | None = None,
        **group_options: Any,
    ) -> Trainer3D:
        """This world rank's trainer. Collective: every rank of ``world`` calls it alike.

        ``optimizer_factory`` builds the optimizer (over ZeRO-1's flat shard with ``zero1``);
        ``max_grad_norm`` turns on global-norm clipping; ``check_every`` compares the shard
        replicas every that many optimizer steps (0: never); ``recv_seconds`` bounds a pipeline
        receive's wait; ``tracer`` records every pipeline action (`TracedPipelineStage`);
        ``hooks`` run before each dp reduction and after each optimizer step (`StepHooks`);
        ``group_options`` go to `paramsync.runtime.collectives.groups.new_group`.
        """
        schedule = build_schedule(
            config.pipeline_schedule.value,
            config.pp_size,
            config.num_micro_batches,
            config.virtual_chunks,
        )
        declared = {
            "config": _plain_config(config),
            "model": asdict(spec),
            "max_grad_norm": max_grad_norm,
            "check_every": check_every,
            "world_size": world.world_size,
        }
        await check_layout_agreement(world, layout_digest(declared), schedule_digest(schedule))
        # Every rank declared the same: the checks below fail alike on all of them.
        config.check_world(world.world_size)
        config.check_layers(spec.n_layers)
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 0:
            raise ValueError(f"check_every must be a non-negative int, got {check_every!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm!r}")
        if spec.n_heads % config.mp_size or spec.vocab_size % config.mp_size:
            raise ValueError(
                f"tp (mp_size) = {config.mp_size} must divide the model's n_heads "
                f"({spec.n_heads}) and vocab_size ({spec.vocab_size})"
            )
        plane, owned = await _data_plane(world, config)
        try:
            mesh = await init_device_mesh(
                plane, config.mesh_names(), config.mesh_shape(), **group_options
            )
        except BaseException:
            if owned is not None:
                with trio.CancelScope(shield=True):
                    await owned.aclose()
            raise
        embedding: ProcessGroup | None = None
        try:
            if spec.tie_weights and config.pp_size > 1:
                embedding = await new_embedding_group(plane, mesh.groups("pp"), **group_options)
            tp_comm = ThreadCollectives(mesh.group("tp"))
            shard = build_shard_model(
                spec, tp_comm, activation_checkpointing=config.activation_checkpointing
            )
            vocab = spec.vocab_size

            def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
                return vocab_parallel_cross_entropy(logits, targets, tp_comm, vocab).mean()

            activation_shape: list[tuple[int, ...]] = [(1, spec.context, spec.d_model)]
            stage = TracedPipelineStage.from_blocks(
                shard.layers,
                pp_group=mesh.group("pp"),
                chunks_per_rank=config.virtual_chunks,
                loss_fn=loss_fn,
                activation_shape=lambda _stage, _mb: activation_shape[0],
                dp_group=mesh.group("dp"),
                embedding_group=embedding,
                tied=shard.tied,
                recv_seconds=recv_seconds,
                tracer=tracer,
            )
            assert isinstance(stage, TracedPipelineStage)  # from_blocks builds a cls
            last = stage.num_stages - 1
            if config.pp_size > 1 and last in stage.chunks:
                for param in stage.tied_params:  # the first stage's copy counts in the norm
                    param.tied_duplicate = True  # type: ignore[attr-defined]
            await stage.sync_tied_weights()
            params: list[torch.Tensor] = list(stage.parameters())
            zero = None
            optimizer = None
            if config.zero1:
                zero = ZeroRedundancyOptimizer(params, mesh.group("dp"), optimizer_factory)
            else:
                optimizer = optimizer_factory(params)
        except BaseException:
            with trio.CancelScope(shield=True):
                await mesh.aclose()
                if embedding is not None:
                    await embedding.aclose()
                if owned is not None:
                    await owned.aclose()
            raise
        return cls(
            config=config,
            spec=spec,
            mesh=mesh,
            embedding_group=embedding,
            shard=shard,
            stage=stage,
            schedule=schedule,
            optimizer=optimizer,
            zero=zero,
            max_grad_norm=max_grad_norm,
            check_every=check_every,
            activation_shape=activation_shape,
            hooks=hooks,
            plane=owned,
        )

    # ------------------------------------------------------------------ what this rank holds

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's mesh coordinates: ``{"pp": …, "dp": …, "tp": …}``."""
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp}

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage.chunks

    @property
    def holds_last_stage(self) -> bool:
        return self.stage.num_stages - 1 in self.stage.chunks

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once (what its optimizer steps)."""
        return self.stage.parameters()

    def shard_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters by their names in the dense model (``stages.<i>.<name>``):
        each is the dense parameter's tp slice (along its ``partition_dim``), or the whole
        parameter where it is replicated across tp."""
        return self.shard.named_parameters(list(self.stage.chunks.values()))

    def state_digest(self) -> StateDigest:
        """The digest of this rank's stages and its optimizer's state (not ZeRO-1's: see
        `shard_digest`)."""
        return self._hasher.digest(self.module, self.optimizer)

    async def shard_digest(self) -> StateDigest:
        """The C-DDP-001 digest of this rank's shard: its stages' weights and the optimizer
        state (ZeRO-1's gathered over the dp group: collective there)."""
        if self.zero is not None:
            return await self.zero.consolidated_digest(self.module)
        return self.state_digest()

    # ------------------------------------------------------------------ training

    async def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Train on this replica's batch (``(batch, time)`` token ids and next-token targets,
        the batch a multiple of ``num_micro_batches``); return its mean loss over every dp
        replica. The optimizer steps after every ``accumulation_steps``-th batch."""
        if self.broken is not None:
            raise RuntimeError(
                f"rank {self.mesh.rank} (pp={self.pp}, dp={self.dp}, tp={self.tp}): a previous "
                f"step failed ({self.broken!r}); its groups are closed"
            )
        m = self.config.num_micro_batches
        xs = split_microbatches(inputs, m)
        ys = split_microbatches(targets, m)
        if inputs.shape != targets.shape or inputs.dim() != 2:
            raise ValueError(
                f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} must be the "
                "same (batch, time) shape"
            )
        self._activation_shape[0] = (xs[0].shape[0], xs[0].shape[1], self.spec.d_model)
        accumulation = self.config.accumulation_steps
        try:
            if self.batches % accumulation == 0:
                self._zero_grad()
            result = await self.stage.run_schedule(
                self.schedule.actions[self.pp],
                xs if self.holds_first_stage else None,
                ys if self.holds_last_stage else None,
                microbatches=m,
                step=self.batches,
            )
            self.batches += 1
            loss = await self._mean_loss(result.loss)
            if self.batches % accumulation == 0:
                with self.stage.tracer.span("optimizer", PIPELINE_TRACK, step=self.batches - 1):
                    await self._optimizer_step()
        except BaseException as exc:
            await self._fail(exc)
            raise
        return loss

    def _zero_grad(self) -> None:
        for param in self.parameters():
            param.grad = None

    async def _mean_loss(self, local: float | None) -> float:
        """The last stage's mean loss, broadcast over the pipeline group, averaged over dp."""
        value = torch.tensor([local if local is not None else 0.0], dtype=torch.float64)
        if self.config.pp_size > 1:
            last_rank = stage_rank(self.stage.num_stages - 1, self.config.pp_size)
            await broadcast(self.mesh.group("pp"), value, root=last_rank)
        if self.config.dp_size > 1:
            await all_reduce(self.mesh.group("dp"), value, "avg")
        return float(value[0])

    async def _optimizer_step(self) -> None:
        params = self.parameters()
        accumulation = self.config.accumulation_steps
        if accumulation > 1:
            with torch.no_grad():
                for param in params:
                    if param.grad is not None:
                        param.grad.div_(accumulation)
        if self.hooks is not None:
            numel = sum(p.numel() for p in params if p.requires_grad)
            await self.hooks.before_reduce(self.optimizer_steps, self.mesh.group("dp"), numel)
        if self.zero is not None:
            await sum_tied(self.embedding_group, self.stage.tied_params)
            if self.max_grad_norm is None:
                await self.zero.step()
            else:
                await self._zero_step_clipped(self.zero, self.max_grad_norm)
        else:
            assert self.optimizer is not None
            await self.stage.finalize_grads()
            if self.max_grad_norm is not None:
                self.last_grad_norm = await clip_grad_norm_async(
                    params,
                    self.max_grad_norm,
                    tp=self.mesh.group("tp"),
                    pp=self.mesh.group("pp"),
                )
            self.optimizer.step()
        if self.hooks is not None:
            with self.stage.tracer.span("replica check", PIPELINE_TRACK, by="hooks"):
                await self.hooks.after_step(self.optimizer_steps, await self.shard_digest())
        self.optimizer_steps += 1
        if (
            self.config.dp_size > 1
            and self.check_every
            and self.optimizer_steps % self.check_every == 0
        ):
            with self.stage.tracer.span("replica check", PIPELINE_TRACK):
                await self._check_replicas()

    async def _check_replicas(self) -> None:
        """C-DDP-001 for this rank's shard over its dp group (`check_shard_replicas`)."""
        await check_shard_replicas(
            self.mesh.group("dp"),
            await self.shard_digest(),
            tp=self.tp,
            pp=self.pp,
            step=self.optimizer_steps,
            describe=lambda name: self._digest_names.get(name, name),
        )
        self.checks_passed += 1

    async def _zero_step_clipped(self, zero: ZeroRedundancyOptimizer, max_norm: float) -> None:
        """ZeRO-1's step with global-norm clipping between its reduce-scatter and the shard's
        update: the norm of the averaged gradient is summed from the dp ranks' segments (each
        element counted where `counts_for_norm` says), then over tp and pp."""
        shard_grad = await zero.reduce_gradients()
        mask = self._zero_norm_mask(zero)
        part = (shard_grad.double().pow(2) * mask).sum().reshape(1)
        for dim in ("dp", "tp", "pp"):
            group = self.mesh.group(dim)
            if group.world_size > 1:
                await all_reduce(group, part)
        total = math.sqrt(float(part[0]))
        self.last_grad_norm = total
        coefficient = clip_coefficient(total, max_norm)
        if coefficient < 1.0:
            shard_grad.mul_(coefficient)
        zero.read_shard()  # the parameters as they are now (as ZeroRedundancyOptimizer.step)
        zero.shard.grad = shard_grad
        zero.optimizer.step()
        zero.shard.grad = None
        await zero.gather_parameters()

    def _zero_norm_mask(self, zero: ZeroRedundancyOptimizer) -> torch.Tensor:
        """1.0 for the elements of this rank's ZeRO segment that count in the global norm."""
        if self._norm_mask is None:
            full = torch.zeros(zero.padded_numel, dtype=torch.float64)
            for param, offset in zip(zero.params, zero.offsets, strict=True):
                if counts_for_norm(param, self.tp):
                    full[offset : offset + param.numel()] = 1.0
            lo, hi = zero.shard_bounds
            self._norm_mask = full[lo:hi].clone()
        return self._norm_mask

    # ------------------------------------------------------------------ closing

    async def _fail(self, exc: BaseException) -> None:
        if self.broken is None:
            self.broken = exc
        with trio.CancelScope(shield=True):
            await self.stage.fail(exc)
            await self._close_groups()

    async def _close_groups(self) -> None:
        await self.mesh.aclose()
        if self.embedding_group is not None:
            await self.embedding_group.aclose()
        if self.plane is not None:
            await self.plane.aclose()

    async def aclose(self) -> None:
        """Close every group of this rank, and the torch data plane it formed (not the
        world)."""
        with trio.CancelScope(shield=True):
            await self._close_groups()

    async def __aenter__(self) -> Trainer3D:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return (
            f"Trainer3D(rank {self.mesh.rank}: pp={self.pp}, dp={self.dp}, tp={self.tp}; "
            f"{self.config.pipeline_schedule.value}, m={self.config.num_micro_batches})"
        )


async def _data_plane(
    world: Transport, config: ParallelismConfig
) -> tuple[Transport, TorchPlaneTransport | None]:
    """The transport the mesh's groups are built on, and the one this rank formed for it (to
    close with them), if any. ``DataPlane.PARAMSYNC``: ``world`` itself. ``TORCH``: a
    world already on torch's data plane (a `TorchPlaneTransport`, or a group of one), else a
    torch group formed over ``world`` (`connect_torch_transport`: rank 0 hosts a fresh store),
    so every group's collectives and pipeline sends go through torch.distributed."""
    if config.data_plane is DataPlane.PARAMSYNC or isinstance(world, NativeCollectives):
        return world, None
    store_host, local_host = _hosts(world)
    plane = await connect_torch_transport(
        world, store_host=store_host, local_host=local_host, prefix="paramsync-3d"
    )
    return plane, plane


def _hosts(world: Transport) -> tuple[str, str]:
    """Where rank 0 of ``world`` can host a store every rank reaches, and this rank's own
    address: the addresses of its TCP connections; loopback for ranks in one process."""
    base = world
    while isinstance(base, ProcessGroup):
        base = base.members
    if isinstance(base, TcpTransport) and base.world_size > 1:
        peer = 1 if base.rank == 0 else 0
        sock = base.connections[peer].socket
        local = sock.getsockname()[0]
        return (local if base.rank == 0 else sock.getpeername()[0]), local
    if isinstance(base, InProcessTransport) or base.world_size == 1:
        return "127.0.0.1", "127.0.0.1"
    raise ValueError(
        f"data_plane='torch' over a {type(base).__name__}: Trainer3D forms torch's data "
        "plane over an InProcessTransport or TcpTransport world, or takes one on it "
        "(paramsync.runtime.transport.torch_plane)"
    )


def _plain_config(config: ParallelismConfig) -> dict[str, Any]:
    """The config's fields as plain values (enums by value), for `layout_digest`."""
    out: dict[str, Any] = {}
    for item in fields(config):
        value = getattr(config, item.name)
        out[item.name] = value.value if isinstance(value, enum.Enum) else value
    return out
