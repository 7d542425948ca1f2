"""A ``paramsync`` daemon armed with a fault: it SIGKILLs itself at ``phase:step``.

``python -m runtime.testing.faulty_daemon --fault PHASE:STEP [--stamp FILE] -- ARGS...`` installs
the fault's wrapper in this process, then runs ``paramsync ARGS...`` (`runtime.cli.main.main`)
unchanged. A coordinator phase (``commit``) substitutes `runtime.testing.faults.commit_fault_core`
for the coordinator's core; a worker phase calls ``install(fault)`` of the module
``--worker-faults`` names (default `WORKER_FAULTS`, the wrappers around the worker's actors),
imported by name like a job, so the engine imports no worker code. ``--stamp``: the killed
process writes the wall-clock time of its kill there.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from runtime.cli.main import main as paramsync_main
from runtime.coordinator.service import Coordinator
from runtime.testing.faults import COORDINATOR_PHASES, Fault, commit_fault_core

__all__ = ["WORKER_FAULTS", "arm", "command", "main"]

WORKER_FAULTS = "actors.testing.faults"
"""The module whose ``install(fault)`` arms a worker (the built-in worker's actors)."""


def command(fault: str, args: Sequence[str], *, stamp: str | None = None) -> list[str]:
    """The arguments after ``python`` that run ``paramsync args`` armed with ``fault``."""
    extra = ["--stamp", stamp] if stamp else []
    return ["-m", "runtime.testing.faulty_daemon", "--fault", fault, *extra, "--", *args]


def arm(fault: Fault, args: Sequence[str], worker_faults: str = WORKER_FAULTS) -> None:
    """Install ``fault``'s wrapper for the daemon ``args`` start; ValueError if the fault's
    phase belongs to the other kind of daemon."""
    daemon = "coordinator" if fault.phase in COORDINATOR_PHASES else "worker"
    if daemon not in args:
        raise ValueError(
            f"fault {fault.phase}:{fault.step} is a {daemon}'s, but the command "
            f"({' '.join(args)}) starts no {daemon}"
        )
    if daemon == "coordinator":
        Coordinator.core_type = commit_fault_core(fault)
        return
    try:
        module = importlib.import_module(worker_faults)
    except ImportError as exc:
        raise ValueError(f"worker faults {worker_faults!r} cannot be imported: {exc}") from exc
    install = getattr(module, "install", None)
    if not callable(install):
        raise ValueError(f"worker faults {worker_faults!r} define no install(fault)")
    install(fault)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the fault, arm this process, run the daemon; returns its exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m runtime.testing.faulty_daemon",
        description="run a paramsync daemon that SIGKILLs itself at PHASE:STEP",
    )
    parser.add_argument("--fault", required=True, help="PHASE:STEP")
    parser.add_argument("--stamp", help="write the wall-clock time of the kill here")
    parser.add_argument(
        "--worker-faults",
        default=WORKER_FAULTS,
        help="module whose install(fault) arms a worker (default %(default)s)",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then paramsync's arguments")
    options = parser.parse_args(argv)
    args = options.args[1:] if options.args[:1] == ["--"] else options.args
    try:
        arm(Fault.parse(options.fault, options.stamp), args, options.worker_faults)
    except ValueError as exc:
        parser.error(str(exc))
    return paramsync_main(args)


if __name__ == "__main__":
    sys.exit(main())
