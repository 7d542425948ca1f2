"""No byte that has not passed its frame's tag (and every other check) reaches a destination the
receiver keeps: issue 31 row 1.

An on-path relay without the secret (`paramsync.runtime.testing.relay`) flips one bulk bit on the
way; the receiving side must refuse the frame and leave its destination as it was, on every path
whose destination is live state: a broadcast into a live parameter, the trainer's initial weight
broadcast and its re-sync, the rejoin's state transfer, a posted point-to-point receive. The
gradient ring lands in its bucket uncopied (the hot path); there a failed frame must raise, and the
trainer zeroes the bucket (never applied, rewritten before reuse).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from paramsync.actors.state.digest import named_state
from paramsync.actors.train.state_moves import resync, sync_initial_weights
from paramsync.actors.train.state_transfer import receive_state, send_state
from paramsync.runtime.collectives import p2p
from paramsync.runtime.collectives.ring import all_reduce, broadcast
from paramsync.runtime.errors import FrameAuthenticationError, ProtocolError
from paramsync.runtime.protocol.messages import ResyncOrder
from paramsync.runtime.testing.relay import TO_DIALER, TO_LISTENER, Attack, FlipBulk, relayed_pair
from paramsync.runtime.transport.base import InProcessTransport, Transport

SECRET = b"landing-test-secret-0123456789"
SECONDS = 30


async def _run_pair(
    attack: Attack,
    rank0: Callable[[Transport], Awaitable[Any]],
    rank1: Callable[[Transport], Awaitable[Any]],
) -> list[BaseException | None]:
    """Run ``rank0`` and ``rank1`` on the two ends of a relayed connection; their errors.

    Rank 1 dialed the relay: what rank 1 sends travels `TO_LISTENER`, what rank 0 sends
    `TO_DIALER`. A rank that fails shuts its transport down, so the other one wakes."""
    errors: list[BaseException | None] = [None, None]
    with trio.fail_after(SECONDS):
        async with relayed_pair(SECRET, attack) as ranks:

            async def run(index: int, body: Callable[[Transport], Awaitable[Any]]) -> None:
                try:
                    await body(ranks[index])
                except (ProtocolError, OSError) as exc:
                    errors[index] = exc
                    ranks[index].abort()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, 0, rank0)
                nursery.start_soon(run, 1, rank1)
    return errors


def _refused(error: BaseException | None) -> None:
    assert isinstance(error, FrameAuthenticationError), repr(error)


# --------------------------------------------------------------------------- broadcast


async def test_a_broadcast_into_a_live_weight_lands_nothing_from_a_forged_frame() -> None:
    """The issue's measurement: a bulk frame with a bad tag into an ``nn.Linear`` weight of
    1,024 elements. Today all 1,024 hold the forged values when the refusal comes."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 32)
    before = layer.weight.detach().clone()
    source = torch.randn(32, 32)
    attack = FlipBulk(TO_LISTENER, nth=0, offset=2)

    async def receiver(transport: Transport) -> None:
        await broadcast(transport, layer.weight.detach(), root=1)

    async def root(transport: Transport) -> None:
        await broadcast(transport, source, root=1)

    errors = await _run_pair(attack, receiver, root)
    assert attack.done, attack.log
    _refused(errors[0])
    assert torch.equal(layer.weight.detach(), before), "forged bytes reached the live weight"


async def test_a_broadcast_keeps_its_destination_until_its_last_part_verified() -> None:
    """A flip in the third of four parts: the two verified parts before it do not reach the
    destination either (the broadcast commits all or nothing)."""
    destination = torch.zeros(4096)
    source = torch.arange(4096, dtype=torch.float32)
    attack = FlipBulk(TO_LISTENER, nth=2, offset=5)

    async def receiver(transport: Transport) -> None:
        await broadcast(transport, destination, root=1, chunk_bytes=4096)

    async def root(transport: Transport) -> None:
        await broadcast(transport, source, root=1, chunk_bytes=4096)

    errors = await _run_pair(attack, receiver, root)
    assert attack.done, attack.log
    _refused(errors[0])
    assert torch.equal(destination, torch.zeros(4096))


async def test_a_broadcast_part_of_another_collective_is_refused_before_it_lands() -> None:
    """A ``coll`` frame with the wrong ``op`` (a peer out of step): today written into the
    destination before "out of step" is raised."""
    transports = InProcessTransport.create_group(2)
    destination = torch.zeros(8)

    async def receiver() -> None:
        await broadcast(transports[0], destination, root=1)

    with trio.fail_after(SECONDS):
        await transports[1].send(0, "coll", {"op": 7, "hop": 0, "part": 0}, torch.ones(8))
        with pytest.raises(ProtocolError, match="out of step"):
            await receiver()
    assert torch.equal(destination, torch.zeros(8))


# --------------------------------------------------------------------------- the trainer


def _trainer_stub(model: torch.nn.Module, **more: Any) -> Any:
    options = SimpleNamespace(chunk_bytes=1 << 20, buffer_sync="broadcast")
    return SimpleNamespace(model=model, options=options, **more)


async def test_the_initial_weight_broadcast_changes_no_parameter_unless_all_verified() -> None:
    """`sync_initial_weights` with a flip in the bias (the second tensor):
    neither the weight (already verified) nor the bias changes."""
    torch.manual_seed(1)
    theirs, mine = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
    before = [p.detach().clone() for p in mine.parameters()]
    attack = FlipBulk(TO_DIALER, nth=1, offset=3)

    async def root(transport: Transport) -> None:
        await sync_initial_weights(_trainer_stub(theirs), transport)

    async def receiver(transport: Transport) -> None:
        await sync_initial_weights(_trainer_stub(mine), transport)

    errors = await _run_pair(attack, root, receiver)
    assert attack.done, attack.log
    _refused(errors[1])
    for param, old in zip(mine.parameters(), before, strict=True):
        assert torch.equal(param.detach(), old)


async def test_the_initial_weight_broadcast_copies_every_parameter_when_verified() -> None:
    torch.manual_seed(2)
    theirs, mine = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    errors = await _run_pair(
        Attack(),
        lambda t: sync_initial_weights(_trainer_stub(theirs), t),
        lambda t: sync_initial_weights(_trainer_stub(mine), t),
    )
    assert errors == [None, None]
    for a, b in zip(theirs.parameters(), mine.parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach())


START = SimpleNamespace(position=lambda worker: worker)
"""The epoch a re-sync runs in: ring position = rank."""


def _resync_stub(transport: Transport, model: torch.nn.Module, opt: Any, rank: int) -> Any:
    return _trainer_stub(
        model,
        optimizer=opt,
        rank=rank,
        precision=None,
        replicas=None,
        states_received=0,
    )


def _adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, model.in_features)).sum().backward()
    opt.step()
    return opt


async def test_a_resync_changes_no_state_unless_every_tensor_verified() -> None:
    """`resync` with a flip in its third tensor: the two verified tensors
    before it do not reach the model either."""
    torch.manual_seed(3)
    theirs, mine = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    their_opt, my_opt = _adam(theirs), _adam(mine)
    before = [t.clone() for _, t in named_state(mine, my_opt)]
    order = ResyncOrder(5, 0, (1,))
    attack = FlipBulk(TO_DIALER, nth=2, offset=1)

    async def source(transport: Transport) -> None:
        await resync(_resync_stub(transport, theirs, their_opt, 0), START, transport, order)

    async def target(transport: Transport) -> None:
        await resync(_resync_stub(transport, mine, my_opt, 1), START, transport, order)

    errors = await _run_pair(attack, source, target)
    assert attack.done, attack.log
    _refused(errors[1])
    for (name, now), old in zip(named_state(mine, my_opt), before, strict=True):
        assert torch.equal(now, old), name


# --------------------------------------------------------------------------- state transfer


async def test_a_state_transfer_with_a_flipped_bit_leaves_model_and_optimizer_unchanged() -> None:
    torch.manual_seed(4)
    theirs, mine = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    their_opt, my_opt = _adam(theirs), _adam(mine)
    before = [t.clone() for _, t in named_state(mine, my_opt)]
    attack = FlipBulk(TO_DIALER, nth=0, offset=9)

    async def donor(transport: Transport) -> None:
        await send_state(transport, 1, theirs, their_opt, 3)

    async def joiner(transport: Transport) -> None:
        await receive_state(transport, 0, mine, my_opt)

    errors = await _run_pair(attack, donor, joiner)
    assert attack.done, attack.log
    _refused(errors[1])
    for (name, now), old in zip(named_state(mine, my_opt), before, strict=True):
        assert torch.equal(now, old), name


# --------------------------------------------------------------------------- point-to-point


async def test_a_posted_receive_is_unchanged_by_a_forged_frame() -> None:
    destination = torch.zeros(1024)
    attack = FlipBulk(TO_LISTENER, nth=0, offset=100)

    async def receiver(transport: Transport) -> None:
        await p2p.recv(transport, destination, 1, tag=3)

    async def sender(transport: Transport) -> None:
        await p2p.send(transport, torch.ones(1024), 0, tag=3)

    errors = await _run_pair(attack, receiver, sender)
    assert attack.done, attack.log
    _refused(errors[0])
    assert torch.equal(destination, torch.zeros(1024))


# --------------------------------------------------------------------------- property


PATHS = ("broadcast", "p2p", "state", "ring")


@settings(
    max_examples=24,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    path=st.sampled_from(PATHS),
    corrupt=st.booleans(),
    nth=st.integers(0, 3),
    offset=st.integers(0, 1 << 16),
)
def test_no_destination_changes_unless_its_frame_verified(
    path: str, corrupt: bool, nth: int, offset: int
) -> None:
    """Authenticated frames (the relay passes them through) and frames with a random bulk
    byte flipped, on every receiving path: a path that returns has the sender's values; one
    that raises has raised for frame authentication and, where the destination is kept
    (broadcast, point-to-point, state transfer), left it exactly as it was."""
    note(f"{path} corrupt={corrupt} nth={nth} offset={offset}")
    attack: Attack = FlipBulk(TO_LISTENER, nth=nth, offset=offset) if corrupt else Attack()
    torch.manual_seed(nth)
    size = 1024
    sent = torch.randn(4 * size)  # four parts of 4 KiB
    destination = torch.zeros(4 * size)
    theirs, mine = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    their_opt, my_opt = _adam(theirs), _adam(mine)
    before_state = [t.clone() for _, t in named_state(mine, my_opt)]
    ring = [torch.full((16 * size,), 1.0), torch.full((16 * size,), 2.0)]  # 64 KiB

    async def receiver(transport: Transport) -> None:
        if path == "broadcast":
            await broadcast(transport, destination, root=1, chunk_bytes=4 * size)
        elif path == "p2p":
            for part in range(4):
                await p2p.recv(transport, destination[part * size : (part + 1) * size], 1, part)
        elif path == "state":
            await receive_state(transport, 1, mine, my_opt)
        else:
            await all_reduce(transport, ring[0], chunk_bytes=16 * size, threaded_min_bytes=1 << 40)

    async def sender(transport: Transport) -> None:
        if path == "broadcast":
            await broadcast(transport, sent, root=1, chunk_bytes=4 * size)
        elif path == "p2p":
            for part in range(4):
                await p2p.send(transport, sent[part * size : (part + 1) * size], 0, part)
        elif path == "state":
            await send_state(transport, 0, theirs, their_opt, 3)
        else:
            await all_reduce(transport, ring[1], chunk_bytes=16 * size, threaded_min_bytes=1 << 40)

    errors = trio.run(_run_pair, attack, receiver, sender)
    if not corrupt:
        assert errors == [None, None], errors
        if path in ("broadcast", "p2p"):
            assert torch.equal(destination, sent)
        elif path == "state":
            for (name, now), (_, want) in zip(
                named_state(mine, my_opt), named_state(theirs, their_opt), strict=True
            ):
                assert torch.equal(now, want), name
        else:
            assert torch.equal(ring[0], torch.full((16 * size,), 3.0))
        return
    assert attack.done, attack.log
    assert isinstance(errors[0], FrameAuthenticationError), repr(errors[0])
    if path in ("broadcast", "p2p"):
        # p2p: the parts before the failed one were separate receives, each verified
        failed = nth if path == "p2p" else 0
        assert torch.equal(destination[failed * size :], torch.zeros((4 - failed) * size))
        assert torch.equal(destination[: failed * size], sent[: failed * size])
    elif path == "state":
        for (name, now), old in zip(named_state(mine, my_opt), before_state, strict=True):
            assert torch.equal(now, old), name
    # ring: the bucket is a landing buffer; the error is what its caller acts on


# --------------------------------------------------------------------------- the gradient ring


async def test_a_bucket_whose_all_reduce_failed_is_zeroed_never_applied() -> None:
    """The ring lands its all-gather parts in the bucket uncopied (the hot path), so a bucket
    whose all-reduce fails may hold a forged part: the gradient actor zeroes it (its gradients
    are its views), so the bytes are neither applied nor copied into the next epoch's bucket
    (whose binding copies the gradients over). Today the forged values stay."""
    from paramsync.actors.graph.gradcomm import GradCommActor, StepState
    from paramsync.actors.state.buckets import plan_buckets
    from paramsync.actors.train.trainer import TrainerOptions
    from paramsync.runtime.observe.trace import TraceRecorder

    model = torch.nn.Linear(8, 8)
    model(torch.ones(1, 8)).sum().backward()
    buckets = plan_buckets(list(model.named_parameters()))
    transport = InProcessTransport.create_group(2)[0]
    actor = GradCommActor(model, buckets, transport, None, TrainerOptions(), TraceRecorder())  # type: ignore[arg-type]

    class ForgedRing:
        """A reducer whose all-reduce lands a forged part, then fails its tag check."""

        def payload_bytes(self) -> int:
            return 0

        async def reduce(self, flat: torch.Tensor, *_: Any) -> None:
            flat.fill_(1e30)
            raise FrameAuthenticationError("frame authentication failed on frame 3", peer=1)

    actor._reducers[0] = ForgedRing()  # type: ignore[call-overload]
    actor.current = StepState(0)
    with pytest.raises(FrameAuthenticationError):
        await actor.reduce_bucket(0, 0)
    assert not actor.current.all_reduced.is_set()
    for param in model.parameters():
        assert param.grad is not None and not param.grad.any(), "forged bytes left in a gradient"
