"""The lowering pass of pipeline schedules: from each rank's compute-only list (F, B, I, W) to
the full list with every send and receive in place, in an order that cannot deadlock even when
a send completes only together with its receive (rendezvous channels, no buffering).

What the pass does (the role of torch.distributed.pipelining's ``_add_send_recv``, but for
channels that hold nothing). A transfer can only happen while both of its ranks stand between
two computes (in a *gap*), at or after the end of the compute that produces the tensor, and at
the latest in the gap right before the compute that consumes it. The pass runs all ranks once
in the unit-cost model (F=1, B=2, I=1, W=1; communication free) and lets every transfer happen
at the first moment both ends stand in a gap; a rank starts its next compute as soon as that
compute's inputs are in. Then:

- a send lands right after the compute that produces it, unless its receiver is busy then: it
  lands in the first later gap of the sender in which the receiver also stands in a gap (the
  sender keeps the tensor meanwhile and does not wait);
- a receive lands right before the compute that needs it, unless the sender handed the tensor
  over earlier, in a gap both stood in (the receiver keeps it until the compute);
- the pass writes the transfers down in the one global order in which they happened, and every
  rank's list takes its own transfers in that order.

Transfers at the first common gap are what make rendezvous cost nothing here: in the unit-cost
model the lowered GPipe, 1F1B, interleaved 1F1B and ZB-H1 lists run exactly as fast as their
compute lists would over buffered channels (their bubble formulas hold exactly).

Why that cannot deadlock, whatever the real compute times: take the first transfer, in the
global order, that has not completed. Each of its two ranks has completed every transfer before
it in its own list (they are earlier in the global order) and the computes between are local,
so both reach it, and it completes. By induction every transfer completes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from runtime.parallel.actions import Action, ActionKind

__all__ = ["lower_to_send_recv", "transfers_of", "LOWERING_COSTS"]

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


def _counterpart(action: Action, rank: int) -> tuple[int, Action]:
    """The rank and action at the other end of a send or receive on ``rank``."""
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
    ranks = len(compute)
    needs: list[list[list[Action]]] = []  # needs[r][k]: receives before compute k
    makes: list[list[list[Action]]] = []  # makes[r][k]: sends after compute k
    for rank, actions in enumerate(compute):
        pairs = [transfers_of(a, rank, num_stages, stage_to_rank) for a in actions]
        needs.append([recvs for recvs, _ in pairs])
        makes.append([sends for _, sends in pairs])

    out: list[list[Action]] = [[] for _ in range(ranks)]
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
        key = (sender, send.stage, send.microbatch, int(send.kind is ActionKind.SEND_GRADIENT))
        heapq.heappush(events, (time, 1, key, sender, send))

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
            receiver, recv = _counterpart(send, rank)
            if send not in sends[rank] or not in_gap[rank] or not in_gap[receiver]:
                continue  # offered twice, the first one did it
            sends[rank].discard(send)
            expected[receiver].discard(recv)
            out[rank].append(send)
            out[receiver].append(recv)
            heapq.heappush(events, (time, 2, (receiver,), receiver, None))
        elif in_gap[rank] and ready(rank):
            action = compute[rank][position[rank]]
            out[rank].append(action)
            in_gap[rank] = False
            sends[rank].update(makes[rank][position[rank]])
            position[rank] += 1
            heapq.heappush(events, (time + LOWERING_COSTS[action.kind], 0, (rank,), rank, None))
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
    return tuple(tuple(actions) for actions in out)
