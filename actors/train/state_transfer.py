"""Live state transfer: a healthy member (the donor) sends its whole training state to a joiner.

The donor sends a ``state_manifest`` (`paramsync.actors.state.training_state.manifest`), then one
``state`` frame per tensor. The joiner treats the manifest as untrusted input: it is checked
against the joiner's own model and optimizer (`paramsync.actors.state.manifest_guard`) before any
buffer is allocated, and every refusal, before or after the data arrives, is a `ProtocolError`
naming the donor.
"""

from __future__ import annotations

from functools import partial

import torch
import trio

from paramsync.actors.state.manifest_guard import allocation_bound, check_manifest_fits
from paramsync.actors.state.training_state import (
    TrainingState,
    allocate,
    capture_state,
    manifest,
    restore_state,
)
from paramsync.runtime.errors import ProtocolError
from paramsync.runtime.protocol.messages import StateManifest, StateTensor
from paramsync.runtime.transport.base import Transport
from paramsync.runtime.transport.device_ops import DeviceOps

__all__ = ["send_state", "receive_state"]


def wire_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as the wire can carry it: bool (no RFC 8746 tag) as its uint8 bytes."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


async def send_state(
    transport: Transport,
    peer: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    *,
    grad_scaler: torch.amp.GradScaler | None = None,
    device_ops: DeviceOps | None = None,
) -> None:
    """Send this worker's whole training state (next step ``step``, the LR scheduler's state
    and the loss scaler's, if it has them) to ring position ``peer``; ``device_ops`` copies
    device tensors to the host (`capture_state`)."""
    state = capture_state(
        model,
        optimizer,
        step,
        scheduler=scheduler,
        grad_scaler=grad_scaler,
        device_ops=device_ops,
    )
    await transport.send(peer, *StateManifest(manifest(state)).to_wire())
    for index, (_, tensor) in enumerate(state.tensors):
        part = StateTensor(state.step, index, wire_view(tensor))
        await transport.send(peer, *part.to_wire_bulk())


async def receive_state(
    transport: Transport,
    peer: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    donor: object = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> TrainingState:
    """Receive the state the donor at ring position ``peer`` sends and restore it into
    ``model``, ``optimizer`` and ``scheduler`` (and ``grad_scaler``, the loss scaler, if the run
    has one); returns it. ``donor`` names the donor in errors (default: its position). Raises
    `ProtocolError` naming the donor for a manifest this process cannot hold (before allocating
    anything), out-of-order frames, or a state that does not restore."""
    who = f"donor {donor if donor is not None else peer}"
    message = await transport.recv(peer)
    if message.get("kind") != StateManifest.KIND:
        raise ProtocolError(
            f"{who}: expected the state manifest, got {message.get('kind')!r}", peer=peer
        )
    plan = message["manifest"]
    try:
        check_manifest_fits(plan, model, optimizer)
        tensors = allocate(plan, max_bytes=allocation_bound(model, optimizer))
    except ValueError as err:  # StateMismatch included
        raise ProtocolError(f"{who}: state manifest refused: {err}", peer=peer) from None
    for index, (name, tensor) in enumerate(tensors):
        got = await transport.recv_into(peer, wire_view(tensor))
        if got["kind"] != StateTensor.KIND or got["index"] != index:
            raise ProtocolError(
                f"{who}: state transfer: expected tensor {index} ({name}), got "
                f"{got['kind']!r} {got.get('index')!r}",
                peer=peer,
            )
    try:
        state = TrainingState.from_manifest(plan, tensors)
        await trio.to_thread.run_sync(
            partial(
                restore_state,
                model,
                optimizer,
                state,
                scheduler=scheduler,
                grad_scaler=grad_scaler,
            )
        )
    except ValueError as err:
        raise ProtocolError(
            f"{who}: the received state does not restore: {err}", peer=peer
        ) from None
    return state
