"""Checking pipeline schedules without processes: `validate` (the rules every rank's list must
meet) and `simulate` (a discrete-event run of all ranks' lists over channels that hold nothing).

`validate` applies torch.distributed.pipelining's rules (each stage forwards every micro-batch
exactly once, a backward B or input-gradient I only after that micro-batch's forward on that
stage, a weight-gradient W only after its I, every micro-batch's backward exactly once per stage)
and the rules of the lowered lists: each stage on the rank that holds it, every send matched by
exactly one receive (same stage, micro-batch and direction, the right ranks at both ends, tags
unique in a step), a send after the compute that produces it, a receive before the compute that
needs it, and a chunk's input taken from the chunk before it when both live on one rank.

`simulate` runs the lists with compute taking ``costs[kind]`` time units (divided by v, the
chunks per rank), or each stage's own measured ``stage_costs``, and communication taking none,
where a send completes only together with its receive (rendezvous). It returns every action's
start and end, the makespan, the bubble fraction and per rank the peaks of activations in flight
and held, or raises `ScheduleDeadlock` naming what each rank waits on when no rank can move.
Times are exact (`fractions.Fraction`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

from paramsync.runtime.errors import ParamsyncError
from paramsync.runtime.parallel.actions import Action, ActionKind
from paramsync.runtime.parallel.lowering import counterpart
from paramsync.runtime.parallel.schedules import Schedule

__all__ = [
    "InvalidSchedule",
    "ScheduleDeadlock",
    "TimedAction",
    "SimulationResult",
    "DEFAULT_COSTS",
    "validate",
    "simulate",
]

FWD, BWD, INPUT, WEIGHT = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)

DEFAULT_COSTS: Mapping[ActionKind, Fraction] = {
    FWD: Fraction(1),
    BWD: Fraction(2),
    INPUT: Fraction(1),
    WEIGHT: Fraction(1),
}
"""The unit-cost model of one model chunk's work when v = 1 (a full backward costs two
forwards; its halves one each)."""


class InvalidSchedule(ParamsyncError, ValueError):
    """A schedule breaks a rule; the message names the rank, the index and the action."""


class ScheduleDeadlock(ParamsyncError):
    """No rank can move: the message names every unfinished rank's blocked action."""

    def __init__(self, blocked: Mapping[int, tuple[int, Action]]) -> None:
        self.blocked = dict(blocked)
        super().__init__(
            "pipeline schedule deadlocks: "
            + "; ".join(
                f"rank {rank} blocked at index {index} on {action}"
                for rank, (index, action) in sorted(self.blocked.items())
            )
        )


def _fail(rank: int, index: int, action: Action, problem: str) -> InvalidSchedule:
    return InvalidSchedule(f"rank {rank}, index {index}, action {action}: {problem}")


def validate(schedule: Schedule) -> None:
    """Raise `InvalidSchedule` at the first rule ``schedule`` breaks (see the module
    docstring); return None when it keeps them all."""
    p, m, stages = schedule.p, schedule.m, schedule.num_stages
    if len(schedule.actions) != p:
        raise InvalidSchedule(f"schedule has {len(schedule.actions)} rank lists, expected p={p}")
    last = stages - 1
    forwards: dict[int, set[int]] = {s: set() for s in range(stages)}
    backwards: dict[int, set[int]] = {s: set() for s in range(stages)}
    inputs: dict[int, set[int]] = {s: set() for s in range(stages)}
    weights: dict[int, set[int]] = {s: set() for s in range(stages)}
    # A transfer's tag (`Action.tag`, at step 0) -> where its send, or its receive, stands.
    sends: dict[int, tuple[int, int, Action]] = {}
    recvs: dict[int, tuple[int, int, Action]] = {}
    for rank, actions in enumerate(schedule.actions):
        received: set[tuple[ActionKind, int, int]] = set()
        for index, action in enumerate(actions):
            stage, mb = action.stage, action.microbatch
            kind = action.kind
            if not 0 <= mb < m:
                raise _fail(rank, index, action, f"micro-batch outside 0..{m - 1}")
            if not 0 <= stage < stages:
                raise _fail(rank, index, action, f"stage outside 0..{last}")
            if kind.is_compute:
                if schedule.stage_to_rank(stage) != rank:
                    raise _fail(
                        rank,
                        index,
                        action,
                        f"stage {stage} lives on rank {schedule.stage_to_rank(stage)}",
                    )
                _check_compute(
                    schedule, rank, index, action, forwards, backwards, inputs, weights, received
                )
                continue
            _check_transfer(schedule, rank, index, action, forwards, backwards, inputs)
            seen = sends if kind.is_send else recvs
            tag = action.tag(0)
            if tag in seen:
                first_rank, first_index, _ = seen[tag]
                raise _fail(
                    rank,
                    index,
                    action,
                    f"its tag repeats in the step (first at rank {first_rank}, index "
                    f"{first_index})",
                )
            seen[tag] = (rank, index, action)
            if kind.is_recv:
                received.add((kind, stage, mb))
    for stage in range(stages):
        rank = schedule.stage_to_rank(stage)
        missing = set(range(m)) - forwards[stage]
        if missing:
            raise InvalidSchedule(
                f"rank {rank}: stage {stage} never forwards micro-batches {sorted(missing)}"
            )
        done = backwards[stage] | weights[stage]
        missing = set(range(m)) - done
        if missing:
            raise InvalidSchedule(
                f"rank {rank}: stage {stage} never finishes the backward of micro-batches "
                f"{sorted(missing)}"
            )
        unweighted = inputs[stage] - weights[stage]
        if unweighted:
            raise InvalidSchedule(
                f"rank {rank}: stage {stage} runs BACKWARD_INPUT without BACKWARD_WEIGHT for "
                f"micro-batches {sorted(unweighted)}"
            )
    for tag, (rank, index, action) in sends.items():
        if tag not in recvs:
            raise _fail(rank, index, action, f"no matching receive on rank {action.peer}")
        peer, _, recv = recvs[tag]
        if (peer, recv.peer) != (action.peer, rank):
            raise _fail(rank, index, action, f"its receive is on rank {peer}, from {recv.peer}")
    for tag, (rank, index, action) in recvs.items():
        if tag not in sends:
            raise _fail(rank, index, action, f"no matching send on rank {action.peer}")


def _check_compute(
    schedule: Schedule,
    rank: int,
    index: int,
    action: Action,
    forwards: dict[int, set[int]],
    backwards: dict[int, set[int]],
    inputs: dict[int, set[int]],
    weights: dict[int, set[int]],
    received: set[tuple[ActionKind, int, int]],
) -> None:
    stage, mb, kind = action.stage, action.microbatch, action.kind
    last = schedule.num_stages - 1
    if kind is FWD:
        if mb in forwards[stage]:
            raise _fail(rank, index, action, "forwards this micro-batch a second time")
        if stage > 0:
            if schedule.stage_to_rank(stage - 1) == rank:
                if mb not in forwards[stage - 1]:
                    raise _fail(
                        rank, index, action, f"runs before stage {stage - 1}'s forward on this rank"
                    )
            elif (ActionKind.RECV_ACTIVATION, stage - 1, mb) not in received:
                raise _fail(rank, index, action, "runs before receiving its input activation")
        forwards[stage].add(mb)
        return
    if kind in (BWD, INPUT):
        if mb not in forwards[stage]:
            raise _fail(rank, index, action, "backward before this micro-batch's forward")
        if mb in backwards[stage] or mb in inputs[stage]:
            raise _fail(rank, index, action, "second backward of this micro-batch")
        if stage < last:
            if schedule.stage_to_rank(stage + 1) == rank:
                if mb not in backwards[stage + 1] and mb not in inputs[stage + 1]:
                    raise _fail(
                        rank,
                        index,
                        action,
                        f"runs before stage {stage + 1}'s backward on this rank",
                    )
            elif (ActionKind.RECV_GRADIENT, stage + 1, mb) not in received:
                raise _fail(rank, index, action, "runs before receiving its output gradient")
        (backwards if kind is BWD else inputs)[stage].add(mb)
        return
    if mb not in inputs[stage]:
        raise _fail(rank, index, action, "BACKWARD_WEIGHT before this micro-batch's BACKWARD_INPUT")
    if mb in weights[stage]:
        raise _fail(rank, index, action, "second BACKWARD_WEIGHT of this micro-batch")
    weights[stage].add(mb)


def _check_transfer(
    schedule: Schedule,
    rank: int,
    index: int,
    action: Action,
    forwards: dict[int, set[int]],
    backwards: dict[int, set[int]],
    inputs: dict[int, set[int]],
) -> None:
    """A send or receive names the right peer, travels between different ranks and, for a
    send, follows the compute that produced what it sends."""
    stage, mb, kind = action.stage, action.microbatch, action.kind
    last = schedule.num_stages - 1
    if kind in (ActionKind.SEND_ACTIVATION, ActionKind.RECV_ACTIVATION):
        if stage >= last:
            raise _fail(rank, index, action, "the last stage's output travels nowhere")
        sender, receiver = schedule.stage_to_rank(stage), schedule.stage_to_rank(stage + 1)
    else:
        if stage == 0:
            raise _fail(rank, index, action, "stage 0's input gradient travels nowhere")
        sender, receiver = schedule.stage_to_rank(stage), schedule.stage_to_rank(stage - 1)
    me, peer = (sender, receiver) if kind.is_send else (receiver, sender)
    if rank != me or action.peer != peer:
        raise _fail(
            rank,
            index,
            action,
            f"belongs on rank {me} with peer {peer} (stage {stage} on rank {sender})",
        )
    if sender == receiver:
        raise _fail(rank, index, action, "both ends on one rank: no transfer is needed")
    if kind is ActionKind.SEND_ACTIVATION and mb not in forwards[stage]:
        raise _fail(rank, index, action, "sent before the forward that produces it")
    if kind is ActionKind.SEND_GRADIENT and mb not in backwards[stage] | inputs[stage]:
        raise _fail(rank, index, action, "sent before the backward that produces it")


@dataclass(frozen=True)
class TimedAction:
    """One action of one rank's simulated run."""

    action: Action
    start: Fraction
    end: Fraction


@dataclass(frozen=True)
class SimulationResult:
    """A simulated step: ``timelines[rank]`` every action with its times, ``makespan`` when the
    last rank finished, ``busy[rank]`` its compute time, ``bubble_fraction`` = idle /
    (p * makespan), ``peak_in_flight[rank]`` the most forwards whose backward (B or I) had not
    started, at any moment, and ``peak_held[rank]`` the most forwards whose activations were
    still needed: their B, or with a split backward their W, had not finished (ZB-H1 keeps
    activations past I until W)."""

    timelines: tuple[tuple[TimedAction, ...], ...]
    makespan: Fraction
    busy: tuple[Fraction, ...]
    bubble_fraction: Fraction
    peak_in_flight: tuple[int, ...]
    peak_held: tuple[int, ...]


Cost = int | float | Fraction
"""A compute action's duration: time units or seconds, exact or not."""


def _kind_costs(costs: Mapping[ActionKind | str, Cost], what: str) -> dict[ActionKind, Fraction]:
    checked = {}
    for key, value in costs.items():
        kind = key if isinstance(key, ActionKind) else ActionKind(key)
        if not kind.is_compute:
            raise ValueError(f"{what}: {kind.name} is communication, which takes no time here")
        if value < 0:
            raise ValueError(f"{what}: {kind.name} must be >= 0, got {value}")
        checked[kind] = Fraction(value)
    return checked


def simulate(
    schedule: Schedule,
    costs: Mapping[ActionKind | str, Cost] | None = None,
    *,
    stage_costs: Mapping[int, Mapping[ActionKind | str, Cost]] | None = None,
) -> SimulationResult:
    """Run every rank's list in order (see the module docstring). ``costs`` maps compute kinds
    (or their short names ``F``, ``B``, ``I``, ``W``) to one chunk's cost at v = 1; missing
    kinds take `DEFAULT_COSTS`. ``stage_costs`` instead gives each stage (the global index an
    action names) its own costs as measured, per action and not divided by v (stages differ:
    the last one computes the loss, the first no input gradient); every stage the schedule
    computes must be given, with every kind it computes. Compute waits for nothing but its own
    rank's previous action; the data dependencies between ranks are the transfers, so a
    schedule whose lists `validate` accepts computes nothing before its inputs exist."""
    if stage_costs is not None and costs is not None:
        raise ValueError("give costs (per kind) or stage_costs (per stage), not both")
    unit = dict(DEFAULT_COSTS)
    unit.update(_kind_costs(costs or {}, "costs"))
    cost = {kind: value / schedule.v for kind, value in unit.items()}
    per_stage = {
        stage: _kind_costs(given, f"stage_costs[{stage}]")
        for stage, given in (stage_costs or {}).items()
    }

    def duration(action: Action) -> Fraction:
        if stage_costs is None:
            return cost[action.kind]
        try:
            return per_stage[action.stage][action.kind]
        except KeyError:
            raise ValueError(
                f"stage_costs: no {action.kind.name} cost for stage {action.stage}"
            ) from None

    p = schedule.p
    lists = schedule.actions
    position = [0] * p
    clock = [Fraction(0)] * p
    timelines: list[list[TimedAction]] = [[] for _ in range(p)]
    in_flight = [0] * p
    peak = [0] * p
    held = [0] * p
    peak_held = [0] * p
    busy = [Fraction(0)] * p
    while True:
        progressed = False
        for rank in range(p):
            while position[rank] < len(lists[rank]):
                action = lists[rank][position[rank]]
                if action.kind.is_compute:
                    start = clock[rank]
                    took = duration(action)
                    clock[rank] = start + took
                    busy[rank] += took
                    timelines[rank].append(TimedAction(action, start, clock[rank]))
                    if action.kind is FWD:
                        in_flight[rank] += 1
                        peak[rank] = max(peak[rank], in_flight[rank])
                        held[rank] += 1
                        peak_held[rank] = max(peak_held[rank], held[rank])
                    if action.kind in (BWD, INPUT):
                        in_flight[rank] -= 1
                    if action.kind in (BWD, WEIGHT):
                        held[rank] -= 1
                    position[rank] += 1
                    progressed = True
                    continue
                peer, partner = counterpart(action, rank)
                if not 0 <= peer < p or position[peer] >= len(lists[peer]):
                    break
                if lists[peer][position[peer]] != partner:
                    break
                at = max(clock[rank], clock[peer])
                clock[rank] = clock[peer] = at
                timelines[rank].append(TimedAction(action, at, at))
                timelines[peer].append(TimedAction(partner, at, at))
                position[rank] += 1
                position[peer] += 1
                progressed = True
        if all(position[r] >= len(lists[r]) for r in range(p)):
            break
        if not progressed:
            raise ScheduleDeadlock(
                {
                    r: (position[r], lists[r][position[r]])
                    for r in range(p)
                    if position[r] < len(lists[r])
                }
            )
    makespan = max(clock) if p else Fraction(0)
    total = p * makespan
    bubble = (total - sum(busy)) / total if total else Fraction(0)
    return SimulationResult(
        timelines=tuple(tuple(t) for t in timelines),
        makespan=makespan,
        busy=tuple(busy),
        bubble_fraction=bubble,
        peak_in_flight=tuple(peak),
        peak_held=tuple(peak_held),
    )
