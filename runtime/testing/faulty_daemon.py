"""A ``paramsync`` daemon armed with a fault: it SIGKILLs itself at ``phase:step``.

``python -m paramsync.runtime.testing.faulty_daemon --fault PHASE:STEP [--stamp FILE] -- ARGS...``
runs ``paramsync ARGS...`` (`paramsync.runtime.cli.main.main`) with the fault's wrapper passed in,
nothing patched. A coordinator phase (``commit``) hands
`paramsync.runtime.testing.faults.commit_fault_core` to ``main`` as the coordinator's core; a worker
phase runs ``main`` inside ``armed(fault)`` of the module ``--worker-faults`` names (default
`WORKER_FAULTS`, the wrappers around the worker's actors, a context manager the job's trainer picks
up), imported by name like a job, so the engine imports no worker code. ``--stamp``: the killed
process writes the wall-clock time of its kill there.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from paramsync.runtime.cli.main import main as paramsync_main
from paramsync.runtime.testing.faults import COORDINATOR_PHASES, Fault, commit_fault_core

__all__ = ["WORKER_FAULTS", "arm", "command", "main"]

WORKER_FAULTS = "paramsync.actors.testing.faults"
"""The module whose ``armed(fault)`` arms a worker (the built-in worker's actors)."""


def command(fault: str, args: Sequence[str], *, stamp: str | None = None) -> list[str]:
    """The arguments after ``python`` that run ``paramsync args`` armed with ``fault``."""
    extra = ["--stamp", stamp] if stamp else []
    return ["-m", "paramsync.runtime.testing.faulty_daemon", "--fault", fault, *extra, "--", *args]


@contextmanager
def arm(
    fault: Fault, args: Sequence[str], worker_faults: str = WORKER_FAULTS
) -> Iterator[dict[str, Any]]:
    """Arm the daemon ``args`` start with ``fault`` for the block: yields the keyword
    arguments of `paramsync.runtime.cli.main.main` that carry a coordinator's fault (a worker's
    holds in the block through its module's ``armed``). ValueError if the fault's phase belongs to
    the other kind of daemon, or the module cannot arm a worker."""
    daemon = "coordinator" if fault.phase in COORDINATOR_PHASES else "worker"
    if daemon not in args:
        raise ValueError(
            f"fault {fault.phase}:{fault.step} is a {daemon}'s, but the command "
            f"({' '.join(args)}) starts no {daemon}"
        )
    if daemon == "coordinator":
        yield {"coordinator_core": commit_fault_core(fault)}
        return
    try:
        module = importlib.import_module(worker_faults)
    except ImportError as exc:
        raise ValueError(f"worker faults {worker_faults!r} cannot be imported: {exc}") from exc
    armed = getattr(module, "armed", None)
    if not callable(armed):
        raise ValueError(f"worker faults {worker_faults!r} define no armed(fault)")
    with armed(fault):
        yield {}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the fault, arm this process, run the daemon; returns its exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m paramsync.runtime.testing.faulty_daemon",
        description="run a paramsync daemon that SIGKILLs itself at PHASE:STEP",
    )
    parser.add_argument("--fault", required=True, help="PHASE:STEP")
    parser.add_argument("--stamp", help="write the wall-clock time of the kill here")
    parser.add_argument(
        "--worker-faults",
        default=WORKER_FAULTS,
        help="module whose armed(fault) arms a worker (default %(default)s)",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then paramsync's arguments")
    options = parser.parse_args(argv)
    args = options.args[1:] if options.args[:1] == ["--"] else options.args
    with ExitStack() as stack:
        try:
            fault = Fault.parse(options.fault, options.stamp)
            main_options = stack.enter_context(arm(fault, args, options.worker_faults))
        except ValueError as exc:
            parser.error(str(exc))
        return paramsync_main(args, **main_options)


if __name__ == "__main__":
    sys.exit(main())
