"""Worker jobs the ``paramsync worker`` command runs, loaded by module name.

The engine never imports the worker: a job is any module that defines ``build_parser(parser)``
(adds the job's flags to the ``worker`` subcommand) and ``async run(args) -> int`` (trains and
returns the exit code). ``paramsync worker`` runs `DEMO_JOB`, the built-in LM demo, unless
``--job MODULE`` (or ``PARAMSYNC_JOB``) names another, the way torchrun runs a script it does not
know in advance.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

__all__ = ["DEMO_JOB", "JOB_ENV", "WorkerJob", "load_job", "job_name"]

DEMO_JOB = "paramsync.actors.demo_job.job"
"""The built-in demo: a character-level transformer trained on CPython's sources."""
JOB_ENV = "PARAMSYNC_JOB"


@dataclass(frozen=True)
class WorkerJob:
    """A loaded job: its module's name and its two entry points."""

    name: str
    build_parser: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
    run: Callable[[argparse.Namespace], Awaitable[int]]


def job_name(argv: Sequence[str], environ: dict[str, str] | None = None) -> str:
    """The job ``argv`` names with ``--job MODULE``/``--job=MODULE``, else $PARAMSYNC_JOB, else
    the demo (read before parsing, since the job's flags are part of the parser)."""
    for index, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--job" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--job="):
            return arg.split("=", 1)[1]
    env = os.environ if environ is None else environ
    return env.get(JOB_ENV) or DEMO_JOB


def load_job(name: str) -> WorkerJob:
    """Import the job module ``name``; ValueError names what is missing."""
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise ValueError(f"job {name!r} cannot be imported: {exc}") from exc
    entry = {}
    for attr in ("build_parser", "run"):
        value = getattr(module, attr, None)
        if not callable(value):
            raise ValueError(f"job {name!r} defines no {attr}() (a job needs build_parser and run)")
        entry[attr] = value
    return WorkerJob(name, entry["build_parser"], entry["run"])
