"""A joiner checks the donor's state manifest against its own model before allocating anything.

Security review row 6: a 300-byte manifest from a "donor" made the joiner reserve 10 x 16 GiB,
and a huge shape raised a RuntimeError from torch instead of a protocol error. Each crafted
manifest below (huge shapes, extra 16 GiB optimizer tensors, unknown names, wrong dtypes and
shapes, missing tensors, malformed entries) must end the transfer with a `ProtocolError` naming
the donor, and no `torch.empty` may have run for it: the check comes before any allocation. A
genuine manifest still goes through and restores the donor's state.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio
from test_state import make_replica, same_bits, train

from paramsync.actors.state.digest import state_digest
from paramsync.actors.state.training_state import capture_state, manifest
from paramsync.actors.train.state_moves import receive_training_state
from paramsync.runtime.errors import ProtocolError
from paramsync.runtime.transport.base import InProcessTransport

DEADLINE = 20.0
GIB = 1 << 30


def donor_state() -> tuple[Any, Any]:
    model, optimizer = make_replica(7, "adamw")
    train(model, optimizer, range(3), torch.float32)
    return model, optimizer


def genuine_manifest() -> dict[str, Any]:
    model, optimizer = donor_state()
    return manifest(capture_state(model, optimizer, 3))


def joiner() -> SimpleNamespace:
    """What `receive_training_state` reads of its trainer."""
    model, optimizer = make_replica(99, "adamw")
    return SimpleNamespace(
        model=model,
        optimizer=optimizer,
        scheduler=None,
        step=0,
        rank=1,
        states_received=0,
        grad_scaler=None,
    )


def set_entry(name: str, shape: list[int] | None = None, dtype: str | None = None):
    def craft(plan: dict[str, Any]) -> None:
        for entry in plan["tensors"]:
            if entry[0] == name:
                if shape is not None:
                    entry[1] = shape
                if dtype is not None:
                    entry[2] = dtype
                return
        raise AssertionError(f"no tensor {name} in the genuine manifest")

    return craft


def first(prefix: str) -> Callable[[dict[str, Any]], str]:
    return lambda plan: next(e[0] for e in plan["tensors"] if e[0].startswith(prefix))


def crafted_cases() -> list[tuple[str, Callable[[dict[str, Any]], None]]]:
    plan = genuine_manifest()
    param = first("param.")(plan)
    optim = first("optim.")(plan)

    def ten_times_16_gib(plan: dict[str, Any]) -> None:
        # The review's attack: ten extra optimizer tensors of 16 GiB each for parameter 0.
        plan["tensors"] += [[f"optim.0.pad{i}", [4 * GIB], "float32"] for i in range(10)]

    def unknown_name(plan: dict[str, Any]) -> None:
        plan["tensors"].append(["param.evil", [4], "float32"])

    def unknown_kind(plan: dict[str, Any]) -> None:
        plan["tensors"].append(["blob.x", [2], "uint8"])

    def missing_param(plan: dict[str, Any]) -> None:
        plan["tensors"] = [e for e in plan["tensors"] if e[0] != param]

    def optimizer_index_out_of_range(plan: dict[str, Any]) -> None:
        plan["tensors"].append(["optim.999.exp_avg", [4], "float32"])

    def not_a_manifest(plan: dict[str, Any]) -> None:
        plan["tensors"] = [[param, "huge", "float32"]]

    return [
        ("huge param shape", set_entry(param, shape=[1 << 40])),
        ("huge many-dim shape", set_entry(param, shape=[1 << 20] * 4)),
        ("huge optimizer tensor", set_entry(optim, shape=[1 << 36])),
        ("huge rng state", set_entry("rng.torch", shape=[1 << 38])),
        ("ten 16 GiB tensors", ten_times_16_gib),
        ("unknown parameter", unknown_name),
        ("unknown tensor kind", unknown_kind),
        ("wrong param dtype", set_entry(param, dtype="float64")),
        ("wrong param shape", set_entry(param, shape=[3, 3])),
        ("wrong rng dtype", set_entry("rng.torch", dtype="float32")),
        ("missing parameter", missing_param),
        ("optimizer index out of range", optimizer_index_out_of_range),
        ("malformed shape", not_a_manifest),
    ]


@pytest.fixture
def empty_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Record every torch.empty call; refuse (rather than overcommit) any above 64 MiB."""
    calls: list[tuple[Any, ...]] = []
    real = torch.empty

    def recording_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args)
        shape = args[0] if len(args) == 1 and not isinstance(args[0], int) else args
        numel = 1
        for d in shape:
            numel *= int(d)
        if numel > 16 << 20:
            raise MemoryError(f"test refuses to allocate {numel} elements")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", recording_empty)
    return calls


async def transfer(plan: Any, receiver: SimpleNamespace) -> None:
    """Position 0 (the donor) sends ``plan`` as its state manifest, and nothing else;
    position 1 receives it through the trainer's own code."""
    donor, joining = InProcessTransport.create_group(2)
    with trio.fail_after(DEADLINE):
        await donor.send(1, "state_manifest", {"manifest": plan})
        await receive_training_state(receiver, joining, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", [name for name, _ in crafted_cases()])
async def test_a_crafted_manifest_is_a_protocol_error_naming_the_donor_before_any_allocation(
    case: str, empty_calls: list[tuple[Any, ...]]
) -> None:
    craft = dict(crafted_cases())[case]
    plan = copy.deepcopy(genuine_manifest())
    craft(plan)
    receiver = joiner()
    before = state_digest(receiver.model, receiver.optimizer).digest
    empty_calls.clear()
    with pytest.raises(ProtocolError) as caught:
        await transfer(plan, receiver)
    assert caught.value.peer == 0, caught.value
    assert "donor" in str(caught.value), caught.value
    assert empty_calls == [], f"allocated before refusing: {empty_calls}"
    assert receiver.step == 0
    assert state_digest(receiver.model, receiver.optimizer).digest == before


async def test_a_genuine_state_still_transfers() -> None:
    model, optimizer = donor_state()
    state = capture_state(model, optimizer, 3)
    receiver = joiner()
    donor, joining = InProcessTransport.create_group(2, buffer_frames=64)
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                await donor.send(1, "state_manifest", {"manifest": manifest(state)})
                for index, (_, tensor) in enumerate(state.tensors):
                    view = tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor
                    await donor.send(1, "state", {"step": 3, "index": index}, view)

            nursery.start_soon(send)
            await receive_training_state(receiver, joining, 0)  # type: ignore[arg-type]
    assert receiver.step == 3
    got = capture_state(receiver.model, receiver.optimizer, 3)
    for (name, a), (_, b) in zip(state.tensors, got.tensors):
        assert same_bits(a, b), name
