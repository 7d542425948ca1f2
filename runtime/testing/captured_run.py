"""A training run with every byte it sends captured from outside its processes, and its key log
(issue 39 row 10; `paramsync.runtime.testing.keylog_check` checks the one against the other).

`run_captured` makes a fresh network namespace (`paramsync.runtime.testing.netns`), starts the
packet capture in it (`paramsync.runtime.testing.packet_capture`), then ``paramsync launch
--nproc N`` of the LM demo job: a coordinator and N workers training a few steps, every one of
them with ``PARAMSYNC_KEYLOG_FILE`` set to one shared file and ``PARAMSYNC_SHM=0`` (the workers'
data plane on TCP, so that every frame of the run crosses the namespace's loopback rather than
shared memory). When the run has ended, the capture is stopped and drained. The namespace holds
nothing else, so the capture is the run's: worker to coordinator, the workers' rendezvous and
ring links, and whatever else it dials. Linux and root only (`unavailable_reason`).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from paramsync.runtime.testing.netns import unavailable_reason, virtual_hosts
from paramsync.runtime.testing.packet_capture import READY_LINE, CaptureStats

__all__ = ["CapturedRun", "run_captured", "unavailable_reason"]

_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class CapturedRun:
    """A finished `run_captured`: its capture, its key log, how it ended."""

    pcap: Path
    key_log: Path
    exit_code: int
    capture: CaptureStats
    seconds: float
    log_text: str
    command: list[str]


def run_captured(
    workdir: Path, *, workers: int = 2, steps: int = 6, timeout: float = 240.0
) -> CapturedRun:
    """Launch ``workers`` workers and a coordinator training ``steps`` steps in a namespace of
    their own, all their packets captured into ``workdir/run.pcap`` (module doc). Raises
    RuntimeError when the capture does not start; the run's own failure is its exit code."""
    if workers < 2:
        raise ValueError(f"a captured run needs 2 or more workers, got {workers}")
    workdir.mkdir(parents=True, exist_ok=True)
    pcap, key_log, log = workdir / "run.pcap", workdir / "keys.log", workdir / "launch.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARAMSYNC_", "TORCHELASTIC_"))}
    env |= {
        "PARAMSYNC_SECRET": secrets.token_hex(16),
        "PARAMSYNC_KEYLOG_FILE": str(key_log),
        "PARAMSYNC_SHM": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable, "-m", "paramsync.runtime.cli.main", "launch", "--nproc", str(workers),
        "--", "-m", "paramsync.actors.demo_job.job", "--steps", str(steps), "--batch-size", "2",
        "--context", "16", "--d-model", "16", "--layers", "1", "--heads", "2",
        "--corpus-bytes", "100000", "--no-progress",
    ]  # fmt: skip
    started = time.perf_counter()
    with virtual_hosts(1) as (host,):
        capture = host.popen(
            [sys.executable, "-m", "paramsync.runtime.testing.packet_capture", str(pcap)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        stdout = capture.stdout
        try:
            ready = stdout.readline().decode().strip() if stdout is not None else ""
            if ready != READY_LINE:
                capture.kill()
                _, err = capture.communicate(timeout=10)
                raise RuntimeError(f"the packet capture did not start: {ready!r} {err.decode()}")
            with open(log, "wb") as handle:
                run = host.popen(
                    command, env=env, cwd=_ROOT, stdout=handle, stderr=subprocess.STDOUT
                )
                try:
                    code = run.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    run.kill()
                    code = run.wait()
            capture.terminate()
            out, err = capture.communicate(timeout=60)
        finally:
            if capture.poll() is None:
                capture.kill()
                capture.wait()
    lines = out.decode().strip().splitlines()
    if capture.returncode != 0 or not lines:
        raise RuntimeError(f"the packet capture failed ({capture.returncode}): {err.decode()}")
    stats = CaptureStats(**json.loads(lines[-1]))
    return CapturedRun(
        pcap=pcap,
        key_log=key_log,
        exit_code=code,
        capture=stats,
        seconds=time.perf_counter() - started,
        log_text=log.read_text(errors="replace"),
        command=[f"PARAMSYNC_KEYLOG_FILE={key_log}", "PARAMSYNC_SHM=0", "paramsync", *command[3:]],
    )
