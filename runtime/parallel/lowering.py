"""The lowering pass of pipeline schedules: from each rank's compute-only list (F, B, I, W) to
the full list with every send and receive in place, in an order that cannot deadlock even when
a send completes only together with its receive (rendezvous channels, no buffering).

What the pass does (the role of torch.distributed.pipelining's ``_add_send_recv``, but for
channels that hold nothing). A transfer can only happen while both of its ranks stand between
two computes (in a *gap*), at or after the end of the compute that makes the tensor and at the
latest right before the compute that needs it. The pass

1. runs all ranks once in the unit-cost model (F=1, B=2, I=1, W=1; communication free), every
   transfer happening at the first moment both ends stand in a gap and every rank starting its
   next compute as soon as that compute's inputs are in (`_earliest_run`);
2. moves each transfer to the *latest* moment of that run, up to the start of the compute that
   needs it, at which both ranks stand in a gap (the run's times do not change);
3. writes the transfers into each rank's gaps in the one global order of (moment, sender,
   stage, micro-batch, direction).

So a receive lands right before the compute that needs it whenever the sender is free then
(always for GPipe, 1F1B and ZB-H1), and a send right after the compute that makes it whenever
the receiver is ready then (always for GPipe and 1F1B; ZB-H1 may hand a gradient over after a W,
interleaved 1F1B sometimes one compute later, and in rare cases receives a compute early). In
the unit-cost model the lowered lists run exactly as fast as the compute lists would over
buffered channels: every kind's bubble formula holds exactly (tests/test_schedules.py).

Why that cannot deadlock, whatever the real compute times: take the first transfer, in the
global order, that has not completed. Each of its two ranks has completed every transfer before
it in its own list (they are earlier in the global order) and the computes between are local,
so both reach it, and it completes. By induction every transfer completes.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Sequence

from paramsync.runtime.parallel.actions import Action, ActionKind

__all__ = ["lower_to_send_recv", "transfers_of", "counterpart", "LOWERING_COSTS"]

LOWERING_COSTS: dict[ActionKind, int] = {
    ActionKind.FORWARD: 1,
    ActionKind.BACKWARD: 2,
    ActionKind.BACKWARD_INPUT: 1,
    ActionKind.BACKWARD_WEIGHT: 1,
}
"""The unit-cost model that places and orders the transfers (v chunks scale every cost by the
same 1/v, which changes no placement, so the pass uses these integers for every v)."""


def transfers_of(
    action: Action, rank: int, num_stages: int, stage_to_rank: Callable[[int], int]
) -> tuple[list[Action], list[Action]]:
    """The receives compute ``action`` on ``rank`` needs before it and the sends it makes after
    it (empty where the neighbouring stage lives on the same rank, or at the pipeline's ends:
    stage 0's forward loads its micro-batch, the last stage's backward starts from the loss)."""
    stage, mb = action.stage, action.microbatch
    recvs: list[Action] = []
    sends: list[Action] = []
    if action.kind is ActionKind.FORWARD:
        if stage > 0 and stage_to_rank(stage - 1) != rank:
            recvs.append(
                Action(ActionKind.RECV_ACTIVATION, stage - 1, mb, peer=stage_to_rank(stage - 1))
            )
        if stage < num_stages - 1 and stage_to_rank(stage + 1) != rank:
            sends.append(
                Action(ActionKind.SEND_ACTIVATION, stage, mb, peer=stage_to_rank(stage + 1))
            )
    elif action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
        if stage < num_stages - 1 and stage_to_rank(stage + 1) != rank:
            recvs.append(
                Action(ActionKind.RECV_GRADIENT, stage + 1, mb, peer=stage_to_rank(stage + 1))
            )
        if stage > 0 and stage_to_rank(stage - 1) != rank:
            sends.append(Action(ActionKind.SEND_GRADIENT, stage, mb, peer=stage_to_rank(stage - 1)))
    return recvs, sends


def counterpart(action: Action, rank: int) -> tuple[int, Action]:
    """The rank and action at the other end of the send or receive ``action`` on ``rank``."""
    assert action.peer is not None
    partner_kind = {
        ActionKind.SEND_ACTIVATION: ActionKind.RECV_ACTIVATION,
        ActionKind.RECV_ACTIVATION: ActionKind.SEND_ACTIVATION,
        ActionKind.SEND_GRADIENT: ActionKind.RECV_GRADIENT,
        ActionKind.RECV_GRADIENT: ActionKind.SEND_GRADIENT,
    }[action.kind]
    return action.peer, Action(partner_kind, action.stage, action.microbatch, peer=rank)


def lower_to_send_recv(
    compute: Sequence[Sequence[Action]],
    num_stages: int,
    stage_to_rank: Callable[[int], int],
) -> tuple[tuple[Action, ...], ...]:
    """Every rank's full list: ``compute[rank]`` with its sends and receives placed (see the
    module docstring). Raises ``ValueError`` when the compute lists wait on each other in a
    cycle (then no placement of transfers could run them)."""
    starts, ends = _earliest_run(compute, num_stages, stage_to_rank)
    produced: dict[Action, tuple[int, int]] = {}  # send -> (sender, end of its compute)
    consumed: dict[Action, tuple[int, int]] = {}  # receive -> (receiver, start of its compute)
    for rank, actions in enumerate(compute):
        for k, action in enumerate(actions):
            recvs, sends = transfers_of(action, rank, num_stages, stage_to_rank)
            for send in sends:
                produced[send] = (rank, ends[rank][k])
            for recv in recvs:
                consumed[recv] = (rank, starts[rank][k])
    # placed[rank][gap]: (time, global key, action) of the transfers in that gap.
    placed: list[list[list[tuple[int, tuple[int, ...], Action]]]] = [
        [[] for _ in range(len(actions) + 1)] for actions in compute
    ]
    for send, (sender, ready) in produced.items():
        receiver, recv = counterpart(send, sender)
        _, needed = consumed[recv]
        time = _latest_common_gap(
            starts[sender], ends[sender], starts[receiver], ends[receiver], ready, needed
        )
        key = _transfer_key(sender, send)
        placed[sender][bisect.bisect_right(ends[sender], time)].append((time, key, send))
        placed[receiver][bisect.bisect_right(ends[receiver], time)].append((time, key, recv))
    lists: list[tuple[Action, ...]] = []
    for rank, actions in enumerate(compute):
        full: list[Action] = []
        for gap, transfers in enumerate(placed[rank]):
            full += [action for _, _, action in sorted(transfers)]
            if gap < len(actions):
                full.append(actions[gap])
        lists.append(tuple(full))
    return tuple(lists)


def _transfer_key(sender: int, send: Action) -> tuple[int, int, int, int]:
    """Orders transfers that happen at the same moment, the same way on both ranks."""
    return (sender, send.stage, send.microbatch, int(send.kind is ActionKind.SEND_GRADIENT))


def _latest_common_gap(
    sender_starts: list[int],
    sender_ends: list[int],
    receiver_starts: list[int],
    receiver_ends: list[int],
    ready: int,
    needed: int,
) -> int:
    """The latest moment in [ready, needed] at which neither rank computes (in the earliest
    run). One exists: the earliest run handed the tensor over at such a moment."""

    def gaps(starts: list[int], ends: list[int]) -> list[tuple[int, float]]:
        # Gap k runs from the end of compute k - 1 to the start of compute k, within the window.
        first = max(bisect.bisect_right(ends, ready) - 1, 0)
        last = bisect.bisect_right(ends, needed)
        out: list[tuple[int, float]] = []
        for k in range(first, last + 1):
            low = ends[k - 1] if k > 0 else 0
            high: float = starts[k] if k < len(starts) else float("inf")
            low, high = max(low, ready), min(high, needed)
            if low <= high:
                out.append((low, high))
        return out

    best: float = -1
    for low_s, high_s in gaps(sender_starts, sender_ends):
        for low_r, high_r in gaps(receiver_starts, receiver_ends):
            low, high = max(low_s, low_r), min(high_s, high_r)
            if low <= high:
                best = max(best, high)
    if best < 0:
        raise AssertionError(f"no common gap in [{ready}, {needed}]")
    return int(best)


def _earliest_run(
    compute: Sequence[Sequence[Action]],
    num_stages: int,
    stage_to_rank: Callable[[int], int],
) -> tuple[list[list[int]], list[list[int]]]:
    """Start and end of every compute when all ranks run in the unit-cost model and every
    transfer happens at the first moment both of its ranks stand between computes."""
    ranks = len(compute)
    needs: list[list[list[Action]]] = []  # needs[r][k]: receives before compute k
    makes: list[list[list[Action]]] = []  # makes[r][k]: sends after compute k
    for rank, actions in enumerate(compute):
        pairs = [transfers_of(a, rank, num_stages, stage_to_rank) for a in actions]
        needs.append([recvs for recvs, _ in pairs])
        makes.append([sends for _, sends in pairs])
    starts: list[list[int]] = [[] for _ in range(ranks)]
    ends: list[list[int]] = [[] for _ in range(ranks)]
    position = [0] * ranks  # the next compute of each rank
    in_gap = [False] * ranks  # standing between computes (not computing)
    expected: list[set[Action]] = [  # receives not yet taken
        {recv for recvs in needs[rank] for recv in recvs} for rank in range(ranks)
    ]
    sends: list[set[Action]] = [set() for _ in range(ranks)]  # made, not yet handed over
    # Events: (time, order, key, rank, send). At one time, arrivals (0) come before transfers
    # (1), and those before a rank leaves its gap (2): a rank that can hand a send over at the
    # moment it would start computing hands it over first.
    events: list[tuple[int, int, tuple[int, ...], int, Action | None]] = []

    def offer(time: int, sender: int, send: Action) -> None:
        heapq.heappush(events, (time, 1, _transfer_key(sender, send), sender, send))

    def arrive(rank: int, time: int) -> None:
        in_gap[rank] = True
        for send in sends[rank]:
            assert send.peer is not None
            if in_gap[send.peer]:
                offer(time, rank, send)
        for peer in range(ranks):
            if peer != rank and in_gap[peer]:
                for send in sends[peer]:
                    if send.peer == rank:
                        offer(time, peer, send)
        heapq.heappush(events, (time, 2, (rank,), rank, None))

    def ready(rank: int) -> bool:
        return position[rank] < len(compute[rank]) and not any(
            recv in expected[rank] for recv in needs[rank][position[rank]]
        )

    for rank in range(ranks):
        arrive(rank, 0)
    while events:
        time, order, _, rank, send = heapq.heappop(events)
        if order == 0:
            arrive(rank, time)
        elif order == 1:
            assert send is not None
            receiver, recv = counterpart(send, rank)
            if send not in sends[rank] or not in_gap[rank] or not in_gap[receiver]:
                continue  # offered twice, the first one did it
            sends[rank].discard(send)
            expected[receiver].discard(recv)
            heapq.heappush(events, (time, 2, (receiver,), receiver, None))
        elif in_gap[rank] and ready(rank):
            action = compute[rank][position[rank]]
            in_gap[rank] = False
            sends[rank].update(makes[rank][position[rank]])
            position[rank] += 1
            end = time + LOWERING_COSTS[action.kind]
            starts[rank].append(time)
            ends[rank].append(end)
            heapq.heappush(events, (end, 0, (rank,), rank, None))
    stuck = [
        f"rank {rank} before compute {position[rank]} waits to hand over "
        + (", ".join(sorted(str(a) for a in sends[rank])) or "nothing")
        + " and to receive "
        + (", ".join(sorted(str(a) for a in expected[rank])) or "nothing")
        for rank in range(ranks)
        if sends[rank] or expected[rank] or position[rank] < len(compute[rank])
    ]
    if stuck:
        raise ValueError("the compute lists wait on each other in a cycle: " + "; ".join(stuck))
    return starts, ends
