"""Process groups on torch's data plane (`paramsync.runtime.collectives.groups.new_group` over a
`TorchPlaneTransport` world): each group its own torch communicator, a lost member named to the
survivors within the deadline, the world's epoch owning its groups, and the NCCL plumbing.

The group, mesh, point-to-point and conformance tests run on this plane too (``torch`` in
tests/test_groups.py, tests/test_mesh.py, tests/test_p2p.py; ``torch-group`` in
tests/test_transport_conformance.py); 3D parity in tests/test_parallel3d_parity.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import trio
import trio.testing
from conftest import run_ranks

from paramsync.runtime.collectives.groups import NativeProcessGroup, ProcessGroup, new_group
from paramsync.runtime.collectives.ring import all_reduce, barrier
from paramsync.runtime.errors import CollectiveError, PeerClosed, ProtocolError, StallError
from paramsync.runtime.transport import torch_plane
from paramsync.runtime.transport.base import InProcessTransport, Transport
from paramsync.runtime.transport.torch_plane import (
    TorchPlaneTransport,
    connect_torch_transport,
    open_local_group,
)

DEADLINE = 20.0
"""The collectives' deadline in these tests: every failure must come well within it."""
CLOSE_SECONDS = 2.0
"""How long a rank's close waits for a collective abandoned on a silent peer (it ends at the
deadline, on the transport's release thread) before it returns: the default 10 s, spent by
every test that leaves one behind, proves nothing here."""


async def test_a_member_closed_mid_collective_is_named_to_the_survivors_within_the_deadline() -> (
    None
):
    """Group ranks 0 and 1 (world ranks 1, 2) all-reduce; group rank 2 (world rank 3) closes
    its group instead of joining: both survivors get a PeerClosed naming it, by group and world
    rank, in seconds, not at the deadline."""

    async def rank_fn(world: Transport) -> Any:
        group = await new_group(world, [1, 2, 3])
        if group is None:
            return None
        assert isinstance(group, NativeProcessGroup)
        if group.rank == 2:
            await trio.testing.wait_all_tasks_blocked(0.1)
            await group.aclose()
            return "closed"
        start = trio.current_time()
        try:
            await all_reduce(group, torch.ones(50000))
        except (PeerClosed, StallError, CollectiveError) as exc:
            return exc, trio.current_time() - start
        finally:
            # A survivor's all-reduce is abandoned on the closed member: its close need not
            # wait for it (the closing member keeps the default, for its goodbyes).
            group.members.close_seconds = CLOSE_SECONDS
            await group.aclose()
        return "finished"

    async with open_local_group(4, collective_seconds=DEADLINE) as world:
        results = await run_ranks(world, rank_fn, seconds=DEADLINE + 10)
    assert results[0] is None and results[3] == "closed"
    for error, waited in results[1:3]:
        assert isinstance(error, PeerClosed), error
        assert error.peer == "group rank 2 (world rank 3)", error
        assert "all_reduce" in str(error) and "closed its end" in str(error)
        assert waited < DEADLINE / 2, waited


async def test_closing_the_world_closes_its_groups_and_aborting_it_ends_their_collectives() -> None:
    """A group belongs to its world's epoch: aborting the world fails a collective in flight
    on the group at once; after the world's close, the group refuses every call."""
    groups: list[ProcessGroup | None] = [None] * 3
    failures: list[BaseException] = []

    async def make(world: Transport) -> None:
        groups[world.rank] = await new_group(world, [0, 1])

    async with open_local_group(
        3, collective_seconds=DEADLINE, close_seconds=CLOSE_SECONDS
    ) as world:
        await run_ranks(world, make)
        first = groups[0]
        assert first is not None and groups[2] is None

        async def alone() -> None:  # group rank 1 never joins
            try:
                await all_reduce(first, torch.ones(8))
            except PeerClosed as exc:
                failures.append(exc)

        with trio.fail_after(DEADLINE / 2):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(alone)
                await trio.testing.wait_all_tasks_blocked(0.1)
                world[0].abort()
        assert failures and "aborted" in str(failures[0])
    for group in groups[:2]:
        assert group is not None
        with pytest.raises(PeerClosed, match="closed"):
            await group.send(1 - group.rank, "probe", {"src": 0, "dst": 1, "seq": 0, "note": ""})
        with pytest.raises(PeerClosed):
            await barrier(group)


async def test_every_group_has_a_communicator_of_its_own() -> None:
    """Two overlapping groups and a group of a group: each member's transport is a
    TorchPlaneTransport of the group's size, distinct from the world's and each other's."""

    async def rank_fn(world: Transport) -> list[TorchPlaneTransport]:
        made = [await new_group(world, ranks) for ranks in ([0, 1, 2], [1, 2, 3])]
        inner = None
        if made[1] is not None:
            inner = await new_group(made[1], [1, 2])  # world ranks 2, 3
        mine = [g for g in (*made, inner) if g is not None]
        transports = []
        for group in mine:
            assert isinstance(group, NativeProcessGroup)
            assert isinstance(group.members, TorchPlaneTransport)
            assert group.members.world_size == len(group.ranks)
            total = torch.tensor([world.rank], dtype=torch.int64)
            await all_reduce(group, total)
            assert int(total) == sum(group.world_ranks)
            transports.append(group.members)
        return transports

    async with open_local_group(4, collective_seconds=DEADLINE) as world:
        results = await run_ranks(world, rank_fn)
        seen = [t for transports in results for t in transports]
        assert len({id(t) for t in seen}) == len(seen) == 3 + 3 + 2
        assert not any(t is w for t in seen for w in world)


async def test_a_member_that_creates_another_group_is_named() -> None:
    """The members compare what they create through the epoch's store: world rank 2 creates
    [0, 2] where 0 and 1 create [0, 1, 2]; each side names the other."""

    async def rank_fn(world: Transport) -> object:
        ranks = [0, 2] if world.rank == 2 else [0, 1, 2]
        try:
            # Rank 1 (in [0, 1, 2] only) waits for a rank 2 that never comes: its StallError
            # at this deadline ends the test; ranks 0 and 2 tell the mismatch in milliseconds.
            return await new_group(world, ranks, seconds=2.5)
        except (ProtocolError, StallError) as exc:
            return exc

    async with open_local_group(3, collective_seconds=DEADLINE) as world:
        results = await run_ranks(world, rank_fn)
    assert isinstance(results[0], ProtocolError) and results[0].peer == 2
    assert "every rank must call new_group alike" in str(results[0])
    assert isinstance(results[2], ProtocolError) and results[2].peer == 0


async def test_a_subgroup_of_a_cuda_world_gets_an_nccl_communicator_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device path, without a GPU: a world holding an NCCL group for a CUDA device gives
    each subgroup an NCCL communicator of its own (its rank and size, through the store under
    the group's prefix) next to its gloo one, on the same device (a real NCCL run:
    `test_an_nccl_subgroup_reduces_a_device_buffer_in_place`, on a GPU)."""
    built: list[tuple[int, int]] = []

    class FakeNccl:
        def abort(self) -> None:
            pass

    def fake_nccl(store: dist.Store, rank: int, world_size: int, seconds: float) -> FakeNccl:
        built.append((rank, world_size))
        return FakeNccl()

    monkeypatch.setattr(torch_plane, "_nccl_group", fake_nccl)
    device = torch.device("cuda", 0)
    async with open_local_group(3, collective_seconds=DEADLINE) as world:
        for transport in world:  # as connect_torch_transport makes it for a CUDA device
            transport._device_group = FakeNccl()
            transport.device = device
        groups = await run_ranks(world, lambda w: new_group(w, [1, 2]))
        assert groups[0] is None
        for group in groups[1:]:
            assert isinstance(group, NativeProcessGroup)
            assert group.members.device == device
            assert isinstance(group.members._device_group, FakeNccl)
            assert group.native_accepts(torch.ones(2))  # CPU tensors: its gloo group
        values = [torch.ones(3), torch.ones(3)]
        await run_ranks(groups[1:], lambda g: all_reduce(g, values[g.rank]))
        assert all(torch.equal(v, torch.full((3,), 2.0)) for v in values)
    assert sorted(built) == [(0, 2), (1, 2)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and NCCL")
async def test_an_nccl_subgroup_reduces_a_device_buffer_in_place() -> None:  # pragma: no cover
    """On a GPU (one rank: NCCL allows one rank per device in a process): a subgroup of a
    CUDA world gets an NCCL communicator, and its all-reduce of a device tensor leaves the
    result in the same device buffer, never copied to the host."""
    (bootstrap,) = InProcessTransport.create_group(1)
    device = torch.device("cuda", 0)
    world = await connect_torch_transport(
        bootstrap, store_host="127.0.0.1", local_host="127.0.0.1", prefix="nccl", device=device
    )
    try:
        group = await new_group(world, [0])
        assert isinstance(group, NativeProcessGroup) and group.members.device == device
        tensor = torch.full((1000,), 3.0, device=device)
        pointer = tensor.data_ptr()
        assert group.native_accepts(tensor)
        await group.native_all_reduce(tensor, "sum")
        assert tensor.device == device and tensor.data_ptr() == pointer
        assert torch.equal(tensor.cpu(), torch.full((1000,), 3.0))
    finally:
        await world.aclose()
        await bootstrap.aclose()
