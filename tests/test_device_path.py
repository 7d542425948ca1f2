"""The device path of a training step, run on the CPU by the recording device double.

`RecordingDeviceOps` treats every tensor as a device tensor, so the trainer takes its device
path (device bucket buffers, ready events, pinned host staging, copies back) with CPU tensors
and records each device call. Per step: nothing synchronizes the device; the only bytes copied
to the host are the gradient buckets (none at all on the torch data plane, which reduces them
where they lie) and, for the proof (C-DDP-001), the state digest's lanes, computed on the device
(never a state tensor's bytes); each bucket's ready event is recorded before its copy, and the
host reads the copy only after querying its event (C-STREAMSYNC-001). The device path trains
bitwise like the host path.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import trio
from torch import nn

from paramsync.actors.graph.device_staging import GRADIENTS, DeviceStaging
from paramsync.actors.graph.factory import ActorFactory
from paramsync.actors.graph.gradcomm import GradCommActor
from paramsync.actors.state.buckets import plan_buckets
from paramsync.actors.state.fold_digest import DIGEST_PURPOSE, LANES
from paramsync.actors.state.training_state import capture_state
from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions
from paramsync.actors.train.worker import train_in_process
from paramsync.runtime.collectives.ring import ReduceOp
from paramsync.runtime.config import DataPlane
from paramsync.runtime.testing.device_double import DeviceCall, RecordingDeviceOps
from paramsync.runtime.transport.device_ops import context_device_ops, device_ops_in_context

WORLD, PER_RANK, STEPS = 2, 4, 3
RUN_SECONDS = 60.0
BUCKET_BYTES = 256  # several buckets, each its own copy


def _model(seed: int, norm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(5, 16), nn.Tanh()]
    if norm:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3)]
    return nn.Sequential(*layers)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    n = WORLD * PER_RANK
    return [
        (torch.randn(n, 5, generator=gen), torch.randn(n, 3, generator=gen)) for _ in range(STEPS)
    ]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.mse_loss(model(inputs), targets)


class MarkingGradComm(GradCommActor):
    """Marks in the device record each tensor the host all-reduces (its address): where the
    host reads a bucket."""

    async def _all_reduce_flat(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        ops = self.staging.ops
        assert isinstance(ops, RecordingDeviceOps)
        nbytes = tensor.numel() * tensor.element_size()
        ops.note(DeviceCall("all_reduce", nbytes=nbytes, address=tensor.data_ptr()))
        await super()._all_reduce_flat(tensor, op)


async def train(
    ops: RecordingDeviceOps | None,
    plane: DataPlane,
    *,
    norm: bool = False,
    accumulation_steps: int = 1,
) -> list[dict[str, torch.Tensor]]:
    """Each rank's parameters and buffers after `STEPS` steps of ``WORLD`` workers, with
    ``ops`` as every worker's device operations (None: the default, here the host path)."""
    batches = _batches()

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _model(100 + rank, norm)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    async def body(trainer: DistributedTrainer) -> dict[str, torch.Tensor]:
        rank = trainer.dist_config.rank
        for inputs, targets in batches:
            part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            await trainer.train_batch((inputs[part], targets[part]))
            await trainer.verified()
        return {name: t.detach().clone() for name, t in trainer.model.state_dict().items()}

    options = TrainerOptions(
        bucket_bytes=BUCKET_BYTES, data_plane=plane, accumulation_steps=accumulation_steps
    )
    actors = ActorFactory(comm=MarkingGradComm) if ops is not None else None
    with trio.fail_after(RUN_SECONDS):
        if ops is None:
            runs = await train_in_process(WORLD, make_replica, _loss, body, options=options)
        else:
            with device_ops_in_context(ops):
                runs = await train_in_process(
                    WORLD, make_replica, _loss, body, options=options, actors=actors
                )
    return list(runs)


def _bucket_bytes(norm: bool = False) -> list[int]:
    model = _model(0, norm)
    buckets = plan_buckets(list(model.named_parameters()), BUCKET_BYTES)
    assert len(buckets) > 1
    return [bucket.numel * torch.empty((), dtype=bucket.dtype).element_size() for bucket in buckets]


def _same(got: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]]) -> None:
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), name


def _check_staging_order(calls: list[DeviceCall]) -> None:
    """Each gradient copy to the host: its side stream waited on an event recorded earlier on
    the compute stream (the bucket's ready event), and the host read that buffer only after
    querying (or waiting for) the copy's event."""
    recorded_on = {c.event: (i, c.stream) for i, c in enumerate(calls) if c.op == "record_event"}
    copies = [
        (i, c) for i, c in enumerate(calls) if c.op == "copy_to_host" and c.purpose == GRADIENTS
    ]
    assert copies
    for at, copy in copies:
        before = [c for c in calls[:at] if c.stream == copy.stream and c.op != "use_stream"]
        waits = [c for c in before if c.op == "wait_event"]
        assert waits, f"copy at {at}: its stream waited on nothing"
        ready = waits[-1].event
        assert ready in recorded_on and recorded_on[ready][1] == "compute"
        assert recorded_on[ready][0] < at
        later = calls[at + 1 :]
        read = next(
            j for j, c in enumerate(later) if c.op == "all_reduce" and c.address == copy.address
        )
        assert any(
            c.op in ("query", "wait_host") and c.event == copy.event for c in later[:read]
        ), f"the host read the copy of event {copy.event} before its event said it was done"


def _proof_copies(ops: RecordingDeviceOps, norm: bool = False) -> list[DeviceCall]:
    """The proof's copies to the host: at least one digest per rank and step, each the fold's
    lanes (`LANES` int64) of at most every entry of the state (a parameter, its Adam state, a
    buffer), never a state tensor's bytes; and no synchronize for them."""
    digests = [c for c in ops.ops("copy_to_host") if c.purpose == DIGEST_PURPOSE]
    assert len(digests) >= WORLD * STEPS
    model = _model(0, norm)
    entries = 4 * len(list(model.parameters())) + len(list(model.buffers()))
    assert all(c.nbytes % (LANES * 8) == 0 for c in digests)
    assert max(c.nbytes for c in digests) <= LANES * 8 * entries
    return digests


def _pinned_for_gradients(ops: RecordingDeviceOps, digests: list[DeviceCall]) -> Counter[int]:
    """The pinned buffers made, less the digests' (one a digest, of its lanes' size)."""
    pinned = Counter(c.nbytes for c in ops.ops("pinned_empty"))
    pinned.subtract(Counter(c.nbytes for c in digests))
    assert all(count >= 0 for count in pinned.values())
    return +pinned


@pytest.mark.parametrize("accumulation_steps", [1, 2])
async def test_a_host_staged_step_copies_only_its_buckets_and_never_synchronizes(
    accumulation_steps: int,
) -> None:
    ops = RecordingDeviceOps()
    got = await train(ops, DataPlane.PARAMSYNC, accumulation_steps=accumulation_steps)
    _same(got, await train(None, DataPlane.PARAMSYNC, accumulation_steps=accumulation_steps))
    calls = ops.calls
    assert ops.ops("synchronize") == []
    to_host = ops.ops("copy_to_host")
    assert {c.purpose for c in to_host} == {GRADIENTS, DIGEST_PURPOSE}
    digests = _proof_copies(ops)
    sizes = _bucket_bytes()
    gradients = [c.nbytes for c in to_host if c.purpose == GRADIENTS]
    assert Counter(gradients) == Counter(sizes * (WORLD * STEPS))
    # the averaged buckets come back, and the compute stream waits on each before reading
    back = ops.ops("copy_to_device")
    assert Counter(c.nbytes for c in back) == Counter(sizes * (WORLD * STEPS))
    for copy in back:
        at = calls.index(copy)
        assert DeviceCall("wait_event", "compute", copy.event) in calls[at + 1 :]
    # one pinned buffer per bucket and rank, made once
    assert _pinned_for_gradients(ops, digests) == Counter(sizes * WORLD)
    _check_staging_order(calls)


async def test_on_the_torch_plane_no_gradient_byte_goes_through_the_host() -> None:
    """The torch plane reduces the bucket buffers natively (here gloo, on the double's CPU
    "device" tensors; NCCL on a GPU): no copy, no pinned buffer, and the collective is issued
    after the compute stream waited on the bucket's ready event."""
    ops = RecordingDeviceOps()
    got = await train(ops, DataPlane.TORCH)
    _same(got, await train(None, DataPlane.TORCH))
    calls = ops.calls
    assert ops.ops("synchronize", "copy_to_device") == []
    # What reaches the host is the proof's digest lanes, and nothing of the gradients.
    digests = _proof_copies(ops)
    assert ops.ops("copy_to_host") == digests
    assert _pinned_for_gradients(ops, digests) == Counter()
    reads = [i for i, c in enumerate(calls) if c.op == "all_reduce"]
    assert len(reads) == len(_bucket_bytes()) * WORLD * STEPS
    ready = {c.event for c in ops.ops("record_event")}
    waits = [i for i, c in enumerate(calls) if c.op == "wait_event" and c.event in ready]
    assert len(waits) == len(reads)
    assert all(c.stream == "compute" for c in ops.ops("wait_event"))
    # every all-reduce is preceded by one more ready-event wait than the ones before it
    for n, at in enumerate(reads):
        assert sum(1 for w in waits if w < at) >= n + 1


async def test_buffers_travel_as_buffers_beside_the_gradient_buckets() -> None:
    """A model with buffers (BatchNorm) adds their copies, named as buffers, once per step per
    dtype; the gradient copies stay the buckets."""
    ops = RecordingDeviceOps()
    got = await train(ops, DataPlane.PARAMSYNC, norm=True)
    _same(got, await train(None, DataPlane.PARAMSYNC, norm=True))
    assert ops.ops("synchronize") == []
    to_host = ops.ops("copy_to_host")
    gradients = [c.nbytes for c in to_host if c.purpose == GRADIENTS]
    assert Counter(gradients) == Counter(_bucket_bytes(norm=True) * (WORLD * STEPS))
    buffers = Counter(c.nbytes for c in to_host if c.purpose == "buffers")
    norm_bytes = 16 * 4 * 2  # running mean and variance (float32), one copy a step
    counter_bytes = 8  # num_batches_tracked (int64)
    assert buffers == Counter({norm_bytes: WORLD * STEPS, counter_bytes: WORLD * STEPS})
    assert {c.purpose for c in to_host} == {GRADIENTS, "buffers", DIGEST_PURPOSE}
    _proof_copies(ops, norm=True)


async def test_a_bucket_packed_on_its_side_stream_waits_on_both_ready_events() -> None:
    """Gradients that are not views of the bucket buffer are packed on the side stream after
    the hook's event and an event recorded after the current stream's own writes (a zero fill
    of an unused gradient), then copied."""
    ops = RecordingDeviceOps()
    device = torch.device("cpu")
    staging = DeviceStaging(ops, [device])
    flat = torch.zeros(4)
    staging.place(0, flat, native=False)
    staging.gradients_done(0)
    packed: list[int] = []
    staging.send_out(0, flat, lambda: packed.append(len(ops.calls)))
    assert packed
    ops_seen = [(c.op, c.stream) for c in ops.calls]
    assert ops_seen == [
        ("pinned_empty", None),
        ("record_event", "compute"),  # the hook's
        ("record_event", "compute"),  # after the current stream's writes
        ("new_stream", "side-1"),
        ("wait_event", "side-1"),
        ("wait_event", "side-1"),
        ("use_stream", "side-1"),
        ("copy_to_host", "side-1"),
    ]
    waited = {c.event for c in ops.ops("wait_event")}
    assert waited == {c.event for c in ops.ops("record_event")}
    assert packed[0] == ops_seen.index(("use_stream", "side-1")) + 1  # packed inside it
    host = await staging.host_buffer(0)
    assert ops.calls[-1] == DeviceCall("query", "side-1", ops.ops("copy_to_host")[0].event)
    host.fill_(2.0)
    staging.bring_back(0, flat)
    assert torch.equal(flat, torch.full((4,), 2.0))
    assert ops.calls[-1].op == "wait_event" and ops.calls[-1].stream == "compute"


def test_a_state_capture_copies_each_device_tensor_and_waits_for_that_copy_alone() -> None:
    model = _model(1, norm=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    _loss(model, (torch.randn(4, 5), torch.randn(4, 3))).backward()
    optimizer.step()
    ops = RecordingDeviceOps()
    state = capture_state(model, optimizer, 3, device_ops=ops)
    plain = capture_state(model, optimizer, 3)
    assert [name for name, _ in state.tensors] == [name for name, _ in plain.tensors]
    for (name, mine), (_, theirs) in zip(state.tensors, plain.tensors):
        assert torch.equal(mine, theirs), name
    copies = ops.ops("copy_to_host")
    assert {c.purpose for c in copies} == {"state"}
    device_tensors = [t for n, t in state.tensors if not n.startswith("rng.")]
    assert len(copies) == len(device_tensors)
    assert {c.event for c in ops.ops("wait_host")} == {c.event for c in copies}
    assert ops.ops("synchronize") == []


def test_the_seam_is_passed_in_a_context_and_restored_after() -> None:
    default = context_device_ops()
    ops = RecordingDeviceOps()
    with device_ops_in_context(ops):
        assert context_device_ops() is ops
    assert context_device_ops() is default
    assert not default.on_device(torch.zeros(1))  # the CUDA implementation: a CPU tensor
