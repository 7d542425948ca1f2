"""Fault injection for the fault-tolerance trials: a process SIGKILLs itself at a chosen point.

``PARAMSYNC_FAULT=phase:step`` (read once, at import) arms one point; the trainer marks the
step it is in and calls `fault_point` at each phase, the coordinator at each commit. Unarmed, a
call is one comparison. The kill is a real SIGKILL of the process: no cleanup, no goodbye on any
socket.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = [
    "PHASES",
    "COORDINATOR_PHASES",
    "FAULT_ENV",
    "STAMP_ENV",
    "armed",
    "fault_point",
    "parse_fault",
]

FAULT_ENV = "PARAMSYNC_FAULT"
STAMP_ENV = "PARAMSYNC_FAULT_STAMP"
"""Where the killed process writes the wall-clock time of its kill (for detection figures)."""
PHASES = ("data", "forward", "backward", "allreduce", "optimizer", "digest")
"""Where a worker can be killed: loading the batch, forward, backward, in the middle of a
gradient all-reduce (after its first chunk left), in the optimizer step, before its digest."""
COORDINATOR_PHASES = ("commit",)
"""Where the coordinator can be killed: when it has decided to commit a step, before anyone
hears of it."""


def parse_fault(text: str | None) -> tuple[str, int] | None:
    """``"phase:step"`` -> (phase, step); None for an empty value; ValueError names the problem."""
    if not text:
        return None
    phase, _, step = text.partition(":")
    phases = PHASES + COORDINATOR_PHASES
    if phase not in phases or not step.isdigit():
        raise ValueError(
            f"{FAULT_ENV}={text!r}: expected PHASE:STEP with PHASE one of {', '.join(phases)}"
        )
    return phase, int(step)


_ARMED = parse_fault(os.environ.get(FAULT_ENV))


def fault_point(phase: str, step: int) -> None:
    """Kill this process with SIGKILL if ``phase`` of ``step`` is the armed point."""
    if _ARMED is not None and _ARMED == (phase, step):
        stamp = os.environ.get(STAMP_ENV)
        if stamp:
            with open(stamp, "w") as out:
                out.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)


def armed(phase: str, step: int) -> bool:
    """Whether ``phase`` of ``step`` is the armed point (to set up a kill mid-operation)."""
    return _ARMED is not None and _ARMED == (phase, step)
