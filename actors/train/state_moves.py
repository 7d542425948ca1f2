"""How a trainer's state moves between ranks: an epoch's entry (the initial broadcast and its
check, a joiner's state transfer, the buffers brought into line) and a re-sync of diverged ranks.

Each function takes the worker's `TrainingRun` (the model, its optimizer and what travels
with them), which it changes, and the epoch's data plane; a receiver lands every
tensor in a buffer of its own and changes its state only once all of them arrived and verified.
"""

from __future__ import annotations

import logging

import torch

from paramsync.actors.state.digest import named_state, state_digest
from paramsync.actors.train.buffer_sync import BufferSync, sync_buffers
from paramsync.actors.train.state_transfer import receive_state, send_state, wire_view
from paramsync.actors.train.training_run import TrainingRun
from paramsync.actors.train.unbound_optimizer import check_can_receive_state
from paramsync.runtime.collectives.ring import all_reduce, broadcast
from paramsync.runtime.errors import ProtocolError
from paramsync.runtime.protocol.messages import ResyncOrder, StartRun, StateTensor
from paramsync.runtime.transport.base import Transport

__all__ = [
    "StartingStateDiffers",
    "check_starting_state",
    "enter_epoch",
    "receive_training_state",
    "resync",
    "send_training_state",
    "sync_initial_weights",
    "sync_model_buffers",
]

log = logging.getLogger("paramsync.trainer")


class StartingStateDiffers(RuntimeError):
    """After an epoch's initial broadcast, some members' parameters or buffers differ from
    position 0's (C-DDP-001 before the first step): ``ranks`` differ; ``tensor`` is the first
    differing one on a rank that differs (None on the others)."""

    def __init__(self, epoch: int, step: int, ranks: list[int], tensor: str | None) -> None:
        where = f", first at tensor {tensor!r} on this rank" if tensor is not None else ""
        super().__init__(
            f"epoch {epoch} at step {step}: after the initial broadcast, ranks {ranks} hold "
            f"another state than position 0's{where}: the run cannot start"
        )
        self.epoch, self.step, self.ranks, self.tensor = epoch, step, ranks, tensor


async def enter_epoch(run: TrainingRun, start: StartRun, transport: Transport) -> None:
    """Bring every member to the epoch's starting state before its first step."""
    if start.broadcast:
        await sync_initial_weights(run, transport)
        await check_starting_state(run, transport, start)
    elif start.donor >= 0:
        if run.rank == start.donor:
            for receiver in start.receivers:
                await send_training_state(run, transport, start.position(receiver))
        elif run.rank in start.receivers:
            await receive_training_state(
                run, transport, start.position(start.donor), donor=f"rank {start.donor}"
            )
    if not start.broadcast and run.options.buffer_sync != "local":
        # Buffers a dropped step's forward moved on some ranks only: the epoch's opening
        # check covers them, so every member starts from position 0's.
        await sync_model_buffers(run, transport, "broadcast")
    if run.replicas is not None:  # the primary may have taken over a peer's state
        run.replicas.adopt_primary_state()
    if run.rank not in start.receivers:
        if start.broadcast:
            run.step = start.step
        elif run.step != start.step:
            raise ProtocolError(
                f"epoch {start.epoch} starts at step {start.step}, but rank {run.rank} "
                f"is at step {run.step}",
                peer="coordinator",
            )
    run.client.begin_epoch(start)
    run.epochs.append((start.epoch, start.step, start.members))
    if run.metrics is not None:
        run.metrics.observe_epoch(start.epoch, len(start.members))
    log.info(
        "rank %d: epoch %d at step %d, ranks %s (position %d of %d)",
        run.rank,
        start.epoch,
        start.step,
        list(start.members),
        start.position(run.rank),
        len(start.members),
    )


async def sync_initial_weights(run: TrainingRun, transport: Transport) -> None:
    """Broadcast position 0's parameters and buffers so every replica starts identical.

    A receiver lands every tensor in a host buffer of its own (never the live parameter,
    which ``.to("cpu")`` of a CPU tensor would alias) and copies them into the model only
    once all of them arrived and verified: a broadcast that fails changes nothing."""
    tensors = list(run.model.parameters()) + list(run.model.buffers())
    root = transport.rank == 0
    hosts = []
    for tensor in tensors:
        if root:
            host = tensor.detach().to("cpu").contiguous()
        else:
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
        await broadcast(
            transport,
            wire_view(host),
            root=0,
            chunk_bytes=run.options.chunk_bytes,
            in_place=True,  # ``host`` is this call's own buffer, dropped on failure
        )
        hosts.append(host)
    if root:
        return
    with torch.no_grad():  # never across an await: grad mode is per thread, not per task
        for tensor, host in zip(tensors, hosts, strict=True):
            tensor.copy_(host)


async def check_starting_state(run: TrainingRun, transport: Transport, start: StartRun) -> None:
    """After a broadcast epoch's initial broadcast, before its first step: every member's
    parameters and buffers hash (per tensor, with the run's state digest algorithm) to
    position 0's, or every member
    raises `StartingStateDiffers` naming the ranks that differ (and, on those ranks, the
    first tensor). What a state-transfer epoch's opening check (its digests of the step
    before) gives the coordinator, a broadcast epoch gets here, on its own data plane."""
    mine = state_digest(run.model, None, buffers=True, algorithm=run.options.state_digest)
    packed = torch.frombuffer(bytearray(mine.packed), dtype=torch.uint8)
    theirs = packed.clone()
    await broadcast(transport, theirs, root=0, chunk_bytes=run.options.chunk_bytes, in_place=True)
    differs = torch.zeros(transport.world_size, dtype=torch.float64)
    differs[transport.rank] = float(not torch.equal(packed, theirs))
    await all_reduce(transport, differs, "sum", chunk_bytes=run.options.chunk_bytes)
    ranks = [start.members[p] for p in range(len(differs)) if differs[p]]
    if not ranks:
        return
    first = None
    if differs[transport.rank]:
        size = len(mine.packed) // max(1, len(mine.names))
        for index, name in enumerate(mine.names):
            part = slice(index * size, (index + 1) * size)
            if not torch.equal(packed[part], theirs[part]):
                first = name
                break
    raise StartingStateDiffers(start.epoch, start.step, ranks, first)


async def sync_model_buffers(
    run: TrainingRun, transport: Transport, mode: BufferSync | None = None
) -> None:
    """Make the model's buffers identical across the epoch's members (``mode``, default
    ``options.buffer_sync``)."""
    await sync_buffers(
        transport,
        list(run.model.buffers()),
        mode if mode is not None else run.options.buffer_sync,
        chunk_bytes=run.options.chunk_bytes,
        threaded_min_bytes=run.options.threaded_min_bytes,
        device_ops=run.device_ops,
    )


async def send_training_state(run: TrainingRun, transport: Transport, peer: int) -> None:
    """Send this worker's whole training state to ring position ``peer`` (a joiner)."""
    await send_state(
        transport,
        peer,
        run.model,
        run.optimizer,
        run.step,
        run.scheduler,
        grad_scaler=run.grad_scaler,
    )


async def receive_training_state(
    run: TrainingRun, transport: Transport, peer: int, donor: object = None
) -> None:
    """Receive a healthy member's whole training state and take it over; its manifest is
    checked against this model before anything is allocated (`receive_state`)."""
    check_can_receive_state(run.optimizer, run.rank)
    received = await receive_state(
        transport,
        peer,
        run.model,
        run.optimizer,
        donor=donor,
        scheduler=run.scheduler,
        grad_scaler=run.grad_scaler,
    )
    if received.step < run.step:
        log.warning("rank %d rolls back from step %d", run.rank, run.step)
    run.step = received.step
    run.states_received += 1
    log.info("rank %d received the training state at step %d", run.rank, received.step)


async def resync(
    run: TrainingRun, start: StartRun, transport: Transport, order: ResyncOrder
) -> None:
    """Copy the source rank's parameters, optimizer state and loss scaler state to the
    diverged ranks, over the data plane of the epoch ``start`` began."""
    rank = run.rank
    if rank != order.source and rank not in order.targets:
        return
    local = run.options.buffer_sync == "local"
    named = named_state(run.model, run.optimizer, buffers=not local)
    tensors = [tensor for _, tensor in named]
    scaler = run.precision.scaler_tensors() if run.precision is not None else []
    tensors += scaler  # the loss scaler's scale and growth tracker travel last
    log.warning(
        "step %d: re-syncing ranks %s from rank %d",
        order.step,
        list(order.targets),
        order.source,
    )
    received: list[torch.Tensor] = []
    for index, tensor in enumerate(tensors):
        if rank == order.source:
            host = tensor.detach().to("cpu").contiguous()
            part = StateTensor(order.step, index, wire_view(host))
            for target in order.targets:
                await transport.send(start.position(target), *part.to_wire_bulk())
        else:
            # Into a buffer of its own; the state changes once every tensor verified.
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
            source = start.position(order.source)
            message = await transport.recv_into(source, wire_view(host))
            if (message["kind"], message["step"], message["index"]) != (
                StateTensor.KIND,
                order.step,
                index,
            ):
                raise ProtocolError(
                    f"re-sync of step {order.step}: expected state tensor {index}, got "
                    f"{message['kind']} {message.get('index')}",
                    peer=order.source,
                )
            received.append(host)
    if rank != order.source:
        with torch.no_grad():
            for tensor, host in zip(tensors, received, strict=True):
                tensor.copy_(host)
    if scaler and rank != order.source:
        assert run.precision is not None
        run.precision.load_scaler_tensors(scaler)
    if rank != order.source:
        run.states_received += 1
        if run.replicas is not None:
            run.replicas.adopt_primary_state()
