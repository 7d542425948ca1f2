"""Joining a run: connect to the coordinator, form the data mesh, start the trainer.

`join_run` is the multi-process form (TCP: the coordinator at ``coordinator_addr``, a data
listener of this worker's own); `train_in_process` runs a coordinator and ``n`` workers in one
trio run over in-process links and transports, for tests and notebooks. Both hand the caller a
`DistributedTrainer` inside the caller's nursery, and both tell the coordinator when the caller
is done, so the run ends cleanly for everyone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import torch
import trio

from paramsync.actors.client.client import CoordinatorClient, CoordinatorLost, RunAborted
from paramsync.actors.graph.factory import ActorFactory
from paramsync.actors.state.digest import Scheduler, state_digest
from paramsync.actors.train.trainer import Connect, DistributedTrainer, LossFn, TrainerOptions
from paramsync.runtime.config import ADVERTISE_ENV, DataPlane, DistributedConfig, advertised_host
from paramsync.runtime.coordinator.events import model_signature
from paramsync.runtime.coordinator.service import Coordinator, CoordinatorOptions
from paramsync.runtime.errors import ConfigError
from paramsync.runtime.observe.trace import TraceRecorder
from paramsync.runtime.protocol.handshake import Identity
from paramsync.runtime.protocol.messages import ParallelLayout, StartRun
from paramsync.runtime.train_config import shared_secret
from paramsync.runtime.transport.base import InProcessTransport, Transport
from paramsync.runtime.transport.link import Link, MemoryLink
from paramsync.runtime.transport.shm import attach_shared_memory
from paramsync.runtime.transport.tcp import (
    DEFAULT_GROUP,
    TcpTransport,
    dial,
    dial_with_retry,
    form_mesh,
)
from paramsync.runtime.transport.tls import TlsConfig
from paramsync.runtime.transport.torch_plane import connect_torch_transport, create_local_group

__all__ = ["join_run", "train_in_process", "WorkerBody", "Replica"]

WorkerBody = Callable[[DistributedTrainer], Awaitable[Any]]
"""What one in-process worker does with its trainer; its return value is collected."""

Replica = (
    tuple[torch.nn.Module, torch.optim.Optimizer]
    | tuple[torch.nn.Module, torch.optim.Optimizer, Scheduler | None]
)
"""What `train_in_process`'s ``make_replica`` returns: a model and its optimizer, and
optionally an LR scheduler of that optimizer."""


def _model_device(model: torch.nn.Module) -> torch.device | None:
    """The CUDA device the model's parameters live on (its collectives then go through NCCL),
    or None for a CPU model."""
    for param in model.parameters():
        return param.device if param.device.type == "cuda" else None
    return None


@asynccontextmanager
async def _trainer_session(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    config: DistributedConfig,
    connect: Connect,
    client: CoordinatorClient,
    options: TrainerOptions | None,
    trace: TraceRecorder | None,
    scheduler: Scheduler | None = None,
    actors: ActorFactory | None = None,
) -> AsyncIterator[DistributedTrainer]:
    """Listen to the coordinator from the start, so an abort reaches this worker even while
    it is still connecting an epoch's data plane (``connect``), then train; at the end say
    finished (again after any membership change) until the run is over.

    When the run ends on the coordinator's word (it aborted the run) or on the coordinator's
    loss, that is the run's error, not whatever else broke with it (a data-plane link to the
    same lost peer): one account of what happened."""
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(client.serve)
            async with DistributedTrainer.open(
                model,
                optimizer,
                loss_fn,
                config,
                None,
                client,
                options,
                trace,
                connect=connect,
                scheduler=scheduler,
                actors=actors,
            ) as trainer:
                yield trainer
                await trainer.finish()
            # client.serve returns when the coordinator says the run is over.
    except BaseExceptionGroup as group:
        verdict = _run_verdict(group)
        if verdict is None:
            raise
        raise verdict from None


def _run_verdict(group: BaseExceptionGroup) -> BaseException | None:
    """The coordinator's abort or its loss among ``group``'s leaves, if there is one."""
    matched, _ = group.split((RunAborted, CoordinatorLost))
    leaf: BaseException | None = matched
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf


@asynccontextmanager
async def join_run(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    config: DistributedConfig,
    *,
    secret: bytes | str | None = None,
    group: str = DEFAULT_GROUP,
    options: TrainerOptions | None = None,
    trace: TraceRecorder | None = None,
    join_seconds: float = 120.0,
    tls: TlsConfig | None = None,
    resume_step: int = 0,
    resume_committed: bool = False,
    reconnect_seconds: float | None = 60.0,
    scheduler: Scheduler | None = None,
    coordinator_rank: int | None = None,
) -> AsyncIterator[DistributedTrainer]:
    """Join the run whose coordinator listens at ``config.coordinator_addr``.

    Authenticates, sends this model's signature (a mismatch is refused with the first
    difference named), waits until every rank has joined, connects to every other worker, and
    starts from rank 0's weights. ``resume_step``: this worker restored a checkpoint whose
    next step is this; the run resumes there once every worker's state agrees.
    ``resume_committed``: that checkpoint was written only once its step was committed
    (`paramsync.actors.train.checkpointing`), which the coordinator's donor rule trusts over a
    majority behind it (`paramsync.runtime.coordinator.membership.resume_plan`).
    ``reconnect_seconds``: if the coordinator is lost (its connection breaks, or it stays silent
    past the heartbeat deadline), keep the state and redial it with backoff for this long, then
    rejoin where the workers stand (None: losing the coordinator ends the run).
    ``coordinator_rank``: the rank whose process hosts the coordinator (None: a process of its
    own), named when it is lost. ``scheduler``: an LR
    scheduler of ``optimizer``, stepped after each optimizer step (`DistributedTrainer.open`). No
    secret, no coordinator answering within ``join_seconds``, or a run that does not start within
    ``join_seconds`` of joining (ranks missing: WORLD_SIZE too large) is a `ConfigError`.
    """
    key = shared_secret(secret)
    chosen = options or TrainerOptions()
    me = Identity(group, config.world_size, config.rank)
    try:
        with trio.fail_after(join_seconds):
            conn, _ = await dial_with_retry(config.address, key, me, tls=tls)
    except trio.TooSlowError:
        raise ConfigError(
            f"rank {config.rank}: no coordinator answered at {config.coordinator_addr} within "
            f"{join_seconds:g} s: start it there, or set MASTER_ADDR and MASTER_PORT "
            "(--coordinator) to where it listens"
        ) from None
    # Where the other workers dial this one: $PARAMSYNC_ADVERTISE_ADDR, else the interface
    # that reaches the coordinator (paramsync.runtime.config.advertised_host).
    try:
        local_host = advertised_host() or conn.socket.getsockname()[0]
        with trio.fail_after(join_seconds):
            listeners = await trio.open_tcp_listeners(0, host=local_host)
    except (ValueError, OSError) as exc:
        await conn.aclose()
        if isinstance(exc, ValueError):
            raise ConfigError(f"rank {config.rank}: {exc}") from None
        raise ConfigError(
            f"rank {config.rank}: cannot listen for peers on {local_host} ({exc.strerror or exc})"
            f": set {ADVERTISE_ENV} (--advertise-addr) to an address of this host"
        ) from None

    async def redial() -> Link:
        link, _ = await dial(config.address, key, me, tls=tls)
        return link

    client = CoordinatorClient(
        conn,
        config.rank,
        redial=None if reconnect_seconds is None else redial,
        reconnect_seconds=reconnect_seconds or 0.0,
        address=config.coordinator_addr,
        host_rank=coordinator_rank,
    )

    async def connect(start: StartRun) -> Transport:
        # Each epoch has its own mesh among its members, on the listener kept for the run;
        # the epoch in the group name keeps a late dialer of an older epoch out.
        position = start.position(config.rank)
        ident = Identity(f"{group}#{start.epoch}", len(start.members), position)
        with trio.fail_after(join_seconds):
            mesh = await form_mesh(ident, listeners[0], list(start.addresses), key, tls=tls)
        transport = TcpTransport(position, len(start.members), mesh)
        if chosen.data_plane is DataPlane.TORCH:
            # The authenticated mesh carries only the torch store's port; the epoch's data
            # goes through its own torch.distributed group, named by the run and the epoch.
            try:
                return await connect_torch_transport(
                    transport,
                    store_host=start.addresses[0][0],
                    local_host=local_host,
                    prefix=f"{group}#{start.epoch}",
                    seconds=join_seconds,
                    device=_model_device(model),
                    collective_seconds=chosen.collective_seconds,
                )
            finally:
                await transport.aclose()
        # Members on one host all-reduce through shared memory (bitwise the ring's result);
        # PARAMSYNC_SHM=0, or TLS, keeps them on TCP.
        await attach_shared_memory(transport, seconds=join_seconds)
        return transport

    try:
        port = listeners[0].socket.getsockname()[1]
        try:
            with trio.fail_after(join_seconds):
                chosen = options or TrainerOptions()
                local = chosen.buffer_sync == "local"
                algorithm = chosen.state_digest
                digest = (
                    state_digest(
                        model, optimizer, scheduler, buffers=not local, algorithm=algorithm
                    ).digest
                    if resume_step
                    else b""
                )
                await client.join(
                    model_signature(model.named_parameters()),
                    (local_host, port),
                    step=resume_step,
                    digest=digest,
                    committed=resume_committed and resume_step > 0,
                    fold=(options or TrainerOptions()).response_cache,
                    layout=(options or TrainerOptions()).parallel_layout,
                )
        except trio.TooSlowError:
            raise ConfigError(
                f"rank {config.rank}: the run did not start within {join_seconds:g} s of joining "
                f"the coordinator at {config.coordinator_addr}, which waits for all "
                f"{config.world_size} ranks: start every rank, or set WORLD_SIZE (--world-size) "
                "to the number of processes"
            ) from None
        async with _trainer_session(
            model, optimizer, loss_fn, config, connect, client, options, trace, scheduler
        ) as trainer:
            yield trainer
    finally:
        with trio.CancelScope(shield=True):
            for listener in listeners:
                await listener.aclose()
            await conn.aclose()
            await client.link.aclose()


async def train_in_process(
    world_size: int,
    make_replica: Callable[[int], Replica],
    loss_fn: LossFn,
    body: WorkerBody,
    *,
    options: TrainerOptions | None = None,
    coordinator_options: CoordinatorOptions | None = None,
    transports: list[Transport] | None = None,
    parallel_layout: Callable[[int], ParallelLayout | None] | None = None,
    actors: ActorFactory | None = None,
) -> list[Any]:
    """Run a coordinator and ``world_size`` workers in this trio run; return each body's result.

    ``make_replica(rank)`` builds that rank's model and optimizer (and optionally an LR
    scheduler of it, as a third item); ``body(trainer)`` trains.
    Pass ``transports`` (e.g. from ``TcpTransport.open_group``) to use real sockets for the
    data plane; the default is `InProcessTransport`, or with ``options.data_plane=DataPlane.TORCH``
    a gloo group per epoch (`paramsync.runtime.transport.torch_plane.create_local_group`).
    ``parallel_layout(rank)``: that rank's 3D-parallel layout (`TrainerOptions.parallel_layout`,
    which differs per rank). ``actors``: what every worker builds its actors with
    (`DistributedTrainer.open`; a harness passes wrapped ones).
    """
    fixed = transports
    groups: dict[int, list[Transport]] = {}
    forming: dict[int, trio.Event] = {}
    chosen = options or TrainerOptions()

    async def epoch_group(start: StartRun) -> list[Transport]:
        """The epoch's transports, made by the first member to ask (the others wait)."""
        if start.epoch in forming:
            await forming[start.epoch].wait()
        else:
            forming[start.epoch] = trio.Event()
            try:
                size = len(start.members)
                if chosen.data_plane is DataPlane.TORCH:
                    groups[start.epoch] = list(
                        await create_local_group(
                            size,
                            prefix=f"in-process#{start.epoch}",
                            collective_seconds=chosen.collective_seconds,
                        )
                    )
                else:
                    groups[start.epoch] = list(InProcessTransport.create_group(size))
            finally:
                forming[start.epoch].set()
        if start.epoch not in groups:
            raise RuntimeError(f"epoch {start.epoch}'s data plane did not form")
        return groups[start.epoch]

    coordinator = Coordinator(world_size, coordinator_options)
    pairs = [MemoryLink.pair("coordinator", f"rank {rank}") for rank in range(world_size)]
    results: list[Any] = [None] * world_size

    async def worker(rank: int) -> None:
        mine = options or TrainerOptions()
        if parallel_layout is not None:
            mine = replace(mine, parallel_layout=parallel_layout(rank))
        replica = make_replica(rank)
        model, optimizer = replica[0], replica[1]
        scheduler = replica[2] if len(replica) > 2 else None
        link = pairs[rank][1]
        client = CoordinatorClient(link, rank)
        try:
            await client.join(
                model_signature(model.named_parameters()),
                ("in-process", rank + 1),
                fold=mine.response_cache,
                layout=mine.parallel_layout,
            )
            config = DistributedConfig(world_size, rank)

            async def connect(start: StartRun) -> Transport:
                if fixed is not None:
                    if start.epoch != 1 or len(start.members) != world_size:
                        raise RuntimeError("the given transports cannot follow a membership change")
                    return fixed[rank]
                return (await epoch_group(start))[start.position(rank)]

            async with _trainer_session(
                model, optimizer, loss_fn, config, connect, client, mine, None, scheduler, actors
            ) as trainer:
                results[rank] = await body(trainer)
        finally:
            await link.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            coordinator.serve_links, {rank: pair[0] for rank, pair in enumerate(pairs)}
        )
        for rank in range(world_size):
            nursery.start_soon(worker, rank)
    return results
