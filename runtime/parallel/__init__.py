"""3D parallelism's engine side (seed 004): what data x tensor x pipeline parallelism is, as pure
descriptions the workers execute and the coordinator checks.

- `actions.py`: the vocabulary of a pipeline schedule (one rank's list of actions, the p2p tags
  of its sends and receives).
- `schedules.py`: `build_schedule` (GPipe, 1F1B, interleaved 1F1B, ZB-H1 zero bubble: every
  rank's list for one step), `check_schedule_parameters`, `check_layers`, `schedule_digest`.
- `lowering.py`: the pass that places every send and receive in the compute lists so that
  rendezvous channels cannot deadlock.
- `simulate.py`: `validate` (torch.distributed.pipelining's rules and matched transfers) and
  `simulate` (a discrete-event run over rendezvous channels: timelines, makespan, bubble
  fraction, activations in flight, `ScheduleDeadlock`).

Modules here know tensors and collectives, never models or optimizers: those are the worker's
(`paramsync.actors.parallel`).
"""

from paramsync.runtime.parallel.actions import (
    TAG_MICROBATCH_LIMIT,
    TAG_STAGE_LIMIT,
    Action,
    ActionKind,
    Direction,
    p2p_tag,
)
from paramsync.runtime.parallel.schedules import (
    SCHEDULE_KINDS,
    Schedule,
    build_schedule,
    check_layers,
    check_schedule_parameters,
    compute_lists,
    schedule_digest,
)
from paramsync.runtime.parallel.simulate import (
    DEFAULT_COSTS,
    InvalidSchedule,
    ScheduleDeadlock,
    SimulationResult,
    TimedAction,
    simulate,
    validate,
)

__all__ = [
    "DEFAULT_COSTS",
    "SCHEDULE_KINDS",
    "TAG_MICROBATCH_LIMIT",
    "TAG_STAGE_LIMIT",
    "Action",
    "ActionKind",
    "Direction",
    "InvalidSchedule",
    "Schedule",
    "ScheduleDeadlock",
    "SimulationResult",
    "TimedAction",
    "build_schedule",
    "check_layers",
    "check_schedule_parameters",
    "compute_lists",
    "p2p_tag",
    "schedule_digest",
    "simulate",
    "validate",
]
