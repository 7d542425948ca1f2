"""Run one process per rank and collect what each said (the multi-process tests' launcher).

``run_ranks`` starts every rank's command at once with one environment (the tests' own folder
on ``PYTHONPATH``, so a worker script imports its siblings) and gives each rank's exit code and
its output (stdout and stderr together). A rank still running when the shared deadline passes
is killed, and its output says so.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def run_ranks(
    commands: Sequence[Sequence[str]], env: Mapping[str, str], *, seconds: float
) -> list[tuple[int, str]]:
    """Run ``commands`` (one per rank) at once; each rank's (exit code, output)."""
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for command in commands
    ]
    results = []
    deadline = time.monotonic() + seconds
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            output += "\n[killed: the test's deadline passed]"
        results.append((proc.returncode, output))
    return results
