"""Pipeline schedules, sans-I/O: for a schedule kind, p pipeline ranks, m micro-batches and v
model chunks per rank, every rank's list of actions for one training step.

`build_schedule` gives the four kinds (GPipe, 1F1B, interleaved 1F1B, ZB-H1 zero bubble) as
compute lists, then lowers them (`paramsync.runtime.parallel.lowering`) so each rank's list also
holds its sends and receives, with peers. Stage ``s`` of the ``p * v`` stages lives on rank ``s %
p`` (chunk ``s // p`` of that rank, Megatron's interleaving). `check_schedule_parameters` holds the
rules a configuration must meet (the configuration checks use the same function), and
`schedule_digest` is the hash the coordinator compares across ranks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Final

import cbor2

from paramsync.runtime.errors import ConfigError
from paramsync.runtime.parallel.actions import (
    TAG_MICROBATCH_LIMIT,
    TAG_STAGE_LIMIT,
    Action,
    ActionKind,
)
from paramsync.runtime.parallel.lowering import lower_to_send_recv

__all__ = [
    "SCHEDULE_KINDS",
    "Schedule",
    "build_schedule",
    "check_schedule_parameters",
    "check_layers",
    "compute_lists",
    "schedule_digest",
]

SCHEDULE_KINDS: Final = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")

FWD, BWD, INPUT, WEIGHT = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)


def check_schedule_parameters(
    kind: str, pp_size: int, num_microbatches: int, chunks: int = 1
) -> None:
    """Raise `ConfigError` (a ``ValueError``) naming the schedule and the numbers when ``kind``
    cannot run with ``pp_size`` ranks, ``num_microbatches`` micro-batches and ``chunks`` model
    chunks per rank. Pure and cheap."""
    if kind not in SCHEDULE_KINDS:
        raise ConfigError(f"pipeline schedule {kind!r} is not one of {', '.join(SCHEDULE_KINDS)}")
    for name, value in (
        ("pp_size", pp_size),
        ("num_microbatches", num_microbatches),
        ("chunks", chunks),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"schedule {kind}: {name} must be an integer, got {value!r}")
    p, m, v = pp_size, num_microbatches, chunks
    if p < 1:
        raise ConfigError(f"schedule {kind}: pp_size must be >= 1, got {p}")
    if m < 1:
        raise ConfigError(f"schedule {kind}: num_microbatches must be >= 1, got {m}")
    if v < 1:
        raise ConfigError(f"schedule {kind}: chunks must be >= 1, got {v}")
    if kind == "interleaved_1f1b":
        if v < 2:
            raise ConfigError(
                f"schedule interleaved_1f1b needs chunks >= 2 model chunks per rank, got {v}"
                " (with one chunk use 1f1b)"
            )
        if m < p or m % p:
            raise ConfigError(
                f"schedule interleaved_1f1b needs num_microbatches a multiple of pp_size and "
                f">= it, got num_microbatches={m}, pp_size={p}"
            )
    else:
        if v != 1:
            raise ConfigError(
                f"schedule {kind} runs one model chunk per rank, got chunks={v}"
                " (interleaved_1f1b takes several)"
            )
        if kind in ("1f1b", "zero_bubble") and m < p:
            raise ConfigError(
                f"schedule {kind} needs num_microbatches >= pp_size, got "
                f"num_microbatches={m}, pp_size={p}"
            )
    if p * v > TAG_STAGE_LIMIT:
        raise ConfigError(
            f"schedule {kind}: pp_size * chunks = {p * v} stages exceeds the tag limit "
            f"{TAG_STAGE_LIMIT}"
        )
    if m > TAG_MICROBATCH_LIMIT:
        raise ConfigError(
            f"schedule {kind}: num_microbatches={m} exceeds the tag limit {TAG_MICROBATCH_LIMIT}"
        )


def check_layers(num_layers: int, pp_size: int, chunks: int = 1) -> None:
    """Raise `ConfigError` unless the ``pp_size * chunks`` stages split ``num_layers`` evenly."""
    stages = pp_size * chunks
    if stages < 1 or num_layers < 1 or num_layers % stages:
        raise ConfigError(
            f"{num_layers} layers cannot be split evenly into pp_size * chunks = "
            f"{pp_size} * {chunks} = {stages} pipeline stages"
        )


def _gpipe(p: int, m: int, rank: int) -> list[Action]:
    """All forwards, then all backwards, both in micro-batch order."""
    return [Action(FWD, rank, mb) for mb in range(m)] + [Action(BWD, rank, mb) for mb in range(m)]


def _one_f_one_b_order(p: int, m: int, rank: int) -> list[tuple[ActionKind, int]]:
    """Megatron's 1F1B order of (forward or backward, micro-batch): p - rank - 1 warm-up forwards,
    then one forward and one backward alternately, then the remaining backwards."""
    warmup = min(p - rank - 1, m)
    order: list[tuple[ActionKind, int]] = [(FWD, mb) for mb in range(warmup)]
    for k in range(m - warmup):
        order += [(FWD, warmup + k), (BWD, k)]
    order += [(BWD, mb) for mb in range(m - warmup, m)]
    return order


def _one_f_one_b(p: int, m: int, rank: int) -> list[Action]:
    return [Action(kind, rank, mb) for kind, mb in _one_f_one_b_order(p, m, rank)]


def _zero_bubble_h1(p: int, m: int, rank: int) -> list[Action]:
    """ZB-H1 (arXiv 2401.10241): 1F1B's order with every backward split in two. The
    input-gradient half I goes where 1F1B's B goes, so the gradient travels down the pipeline
    after I alone; the weight-gradient half W of the same micro-batch runs later, in what would
    otherwise be a wait. Rank r runs its first r I's without W (those W's are deferred), then one
    W (the oldest deferred) after each I, and the W's still deferred at the end fill the
    cool-down (torch's ZB-H1 form). In the unit-cost model (F = I = W) each rank's idle time is
    (p - 1) * (F + I - W) instead of 1F1B's (p - 1) * (F + B): a third of it. Activations in
    flight (forwards whose I has not started) stay 1F1B's: at most p - r."""
    order = _one_f_one_b_order(p, m, rank)
    actions: list[Action] = []
    inputs_done = 0
    weights_done = 0
    for kind, mb in order:
        if kind is FWD:
            actions.append(Action(FWD, rank, mb))
            continue
        actions.append(Action(INPUT, rank, mb))
        inputs_done += 1
        if inputs_done - weights_done > rank:
            actions.append(Action(WEIGHT, rank, weights_done))
            weights_done += 1
    actions += [Action(WEIGHT, rank, mb) for mb in range(weights_done, m)]
    return actions


def _interleaved(p: int, m: int, v: int, rank: int) -> list[Action]:
    """Megatron's interleaved 1F1B: the rank's v chunks (stages rank, rank + p, ...) run m * v
    virtual micro-batches in rounds of p micro-batches per chunk; warm-up
    2 * (p - rank - 1) + (v - 1) * p forwards (capped at m * v), then 1F1B, then cool-down."""
    total = m * v

    def forward_of(k: int) -> Action:
        chunk = (k // p) % v
        return Action(FWD, chunk * p + rank, (k // (p * v)) * p + k % p)

    def backward_of(k: int) -> Action:
        chunk = v - 1 - (k // p) % v
        return Action(BWD, chunk * p + rank, (k // (p * v)) * p + k % p)

    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    actions = [forward_of(k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [forward_of(warmup + k), backward_of(k)]
    actions += [backward_of(k) for k in range(total - warmup, total)]
    return actions


def compute_lists(
    kind: str, pp_size: int, num_microbatches: int, chunks: int = 1
) -> tuple[tuple[Action, ...], ...]:
    """Every rank's compute-only list (F, B, I, W; no sends or receives), after
    `check_schedule_parameters`."""
    check_schedule_parameters(kind, pp_size, num_microbatches, chunks)
    p, m, v = pp_size, num_microbatches, chunks
    if kind == "gpipe":
        lists = [_gpipe(p, m, r) for r in range(p)]
    elif kind == "1f1b":
        lists = [_one_f_one_b(p, m, r) for r in range(p)]
    elif kind == "zero_bubble":
        lists = [_zero_bubble_h1(p, m, r) for r in range(p)]
    else:
        lists = [_interleaved(p, m, v, r) for r in range(p)]
    return tuple(tuple(actions) for actions in lists)


@dataclass(frozen=True)
class Schedule:
    """One training step's pipeline schedule: ``actions[rank]`` is that rank's list in execution
    order, compute actions and the sends and receives around them."""

    kind: str
    p: int
    m: int
    v: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def stage_to_rank(self, stage: int) -> int:
        """The pipeline rank that holds ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} outside 0..{self.num_stages - 1}")
        return stage % self.p

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages (model chunks) ``rank`` holds, in chunk order."""
        return tuple(chunk * self.p + rank for chunk in range(self.v))

    def describe(self, rank: int) -> str:
        """``rank``'s list, one action per line: index, then the action in torch's short form
        (``2F0`` = stage 2 forward of micro-batch 0; ``@1`` = the peer rank of a transfer)."""
        return "\n".join(f"{i:4d} {action}" for i, action in enumerate(self.actions[rank]))


def build_schedule(kind: str, pp_size: int, num_microbatches: int, chunks: int = 1) -> Schedule:
    """The ``kind`` schedule of ``pp_size`` ranks, ``num_microbatches`` micro-batches and
    ``chunks`` model chunks per rank, sends and receives included. Raises `ConfigError` (a
    ``ValueError``) for parameters the kind cannot run."""
    compute = compute_lists(kind, pp_size, num_microbatches, chunks)
    p = pp_size
    actions = lower_to_send_recv(compute, p * chunks, lambda stage: stage % p)
    return Schedule(kind=kind, p=p, m=num_microbatches, v=chunks, actions=actions)


SCHEDULE_DIGEST_VERSION: Final = 1


def schedule_digest(schedule: Schedule) -> bytes:
    """sha256 of the canonical CBOR of the schedule: its kind, p, m, v and every rank's list
    (each action as ``[kind, stage, micro-batch, peer or null]``). Equal on every rank that built
    the same schedule; different when any list differs."""
    body = {
        "version": SCHEDULE_DIGEST_VERSION,
        "kind": schedule.kind,
        "p": schedule.p,
        "m": schedule.m,
        "v": schedule.v,
        "actions": [
            [[a.kind.value, a.stage, a.microbatch, a.peer] for a in actions]
            for actions in schedule.actions
        ],
    }
    return hashlib.sha256(cbor2.dumps(body, canonical=True)).digest()
