"""Fault-injection trials: real worker processes SIGKILLed at a chosen phase and step.

A trial starts an elastic coordinator daemon and ``workers`` worker daemons of the built-in LM
job, arms one worker with ``PARAMSYNC_FAULT=phase:step`` (it SIGKILLs itself there), and lets
the run finish with the survivors. It then checks what the fault-tolerance contract promises:
the coordinator and every survivor exit 0, the survivors end bitwise identical (one digest), the
membership history shows the loss, and the final model equals a reference run with the same
membership history (the same worker killed before it touches the step the survivors resumed
at). Detection and recovery times come from the coordinator's log.

``python -m runtime.fault_trials --trials 20`` runs trials at random points and prints figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from .faults import FAULT_ENV, PHASES, STAMP_ENV

__all__ = ["TrialResult", "run_trial", "JOB_FLAGS", "main"]

JOB_FLAGS = [
    "--steps", "8", "--d-model", "16", "--layers", "1", "--heads", "2", "--context", "16",
    "--batch-size", "4", "--corpus-bytes", "65536", "--no-progress",
]  # fmt: skip
"""A tiny LM job: a trial is dominated by process start-up, not training."""

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


@dataclass
class TrialResult:
    """What one trial ended with."""

    phase: str
    step: int
    victim: int
    exit_codes: dict[str, int]
    digests: dict[int, str | None]
    epochs: list[dict[str, Any]]
    resumed_at: int | None
    detection_seconds: float | None
    recovery_seconds: float | None
    elapsed_seconds: float
    coordinator_log: str = field(repr=False)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _stamp(line: str) -> float | None:
    match = _STAMP.match(line)
    if match is None:
        return None
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _python() -> list[str]:
    return [sys.executable, "-m", "runtime.cli"]


def run_trial(
    phase: str,
    step: int,
    *,
    workers: int = 3,
    min_workers: int = 2,
    victim: int | None = None,
    workdir: str | os.PathLike[str] | None = None,
    timeout: float = 120.0,
    job_flags: list[str] | None = None,
    rejoin: bool = False,
) -> TrialResult:
    """Run one elastic run with worker ``victim`` (default: the last) killed at ``phase`` of
    ``step``; returns its outcome with the contract's violations listed in ``problems``.

    ``rejoin``: restart the killed worker as soon as it died; it must rejoin live, receive
    the whole state, and finish with everyone's digest."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    victim = workers - 1 if victim is None else victim
    flags = JOB_FLAGS if job_flags is None else job_flags
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        root = Path(tmp)
        env = dict(os.environ, PARAMSYNC_SECRET=secrets.token_hex(16), OMP_NUM_THREADS="1")
        env.pop(FAULT_ENV, None)
        port_file = root / "port"
        coordinator_log = root / "coordinator.log"
        with open(coordinator_log, "w") as log_file:
            coordinator = subprocess.Popen(
                [
                    *_python(),
                    "coordinator",
                    "--world-size",
                    str(workers),
                    "--bind",
                    "127.0.0.1:0",
                    "--port-file",
                    str(port_file),
                    "--min-workers",
                    str(min_workers),
                    "--heartbeat-deadline",
                    "3",
                    "--rejoin-seconds",
                    "10",
                ],
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        procs: dict[int, subprocess.Popen[bytes]] = {}
        kill_seen: float | None = None
        rejoined: subprocess.Popen[bytes] | None = None
        try:
            deadline = time.monotonic() + timeout
            while not port_file.exists() or not port_file.read_text().strip():
                if coordinator.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the coordinator did not start: {coordinator_log.read_text()}"
                    )
                time.sleep(0.02)
            address = f"127.0.0.1:{port_file.read_text().strip()}"

            def start_worker(rank: int, worker_env: dict[str, str], log: str) -> Any:
                command = [*_python(), "worker", "--rank", str(rank)]
                command += ["--world-size", str(workers), "--coordinator", address]
                command += ["--summary-json", str(root / f"summary-{rank}.json"), *flags]
                with open(root / log, "w") as err:
                    return subprocess.Popen(
                        command, env=worker_env, stdout=subprocess.DEVNULL, stderr=err
                    )

            for rank in range(workers):
                worker_env = dict(env)
                if rank == victim:
                    worker_env[FAULT_ENV] = f"{phase}:{step}"
                    worker_env[STAMP_ENV] = str(root / "killed-at")
                procs[rank] = start_worker(rank, worker_env, f"worker-{rank}.log")
            while any(
                p.poll() is None for p in (coordinator, *procs.values(), rejoined) if p is not None
            ):
                if kill_seen is None and procs[victim].poll() is not None:
                    kill_seen = time.time()
                    if rejoin:
                        rejoined = start_worker(victim, env, "rejoined.log")
                if time.monotonic() > deadline:
                    logs = "\n".join(
                        f"--- {path.name}:\n{path.read_text()[-3000:]}"
                        for path in sorted(root.glob("*.log"))
                    )
                    raise TimeoutError(f"the trial did not finish within {timeout} s\n{logs}")
                time.sleep(0.005)
            if kill_seen is None:
                kill_seen = time.time()
        finally:
            for proc in (coordinator, *procs.values(), rejoined):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
        log_text = coordinator_log.read_text()
        stamp = root / "killed-at"
        if stamp.exists():
            kill_seen = float(stamp.read_text())
        codes = {"coordinator": coordinator.returncode}
        codes.update({f"rank {r}": p.returncode for r, p in procs.items()})
        if rejoined is not None:
            codes["rejoined"] = rejoined.returncode
        digests: dict[int, str | None] = {}
        epochs: list[dict[str, Any]] = []
        for rank in procs:
            path = root / f"summary-{rank}.json"
            if (rank != victim or rejoin) and path.exists():
                summary = json.loads(path.read_text())
                digests[rank] = summary["digest"]
                epochs = summary["epochs"]
        problems = []
        if coordinator.returncode != 0:
            problems.append(f"the coordinator exited {coordinator.returncode}: {log_text[-3000:]}")
        for rank, proc in procs.items():
            expected = -9 if rank == victim else 0
            if proc.returncode != expected:
                tail = (root / f"worker-{rank}.log").read_text()[-2000:]
                problems.append(f"rank {rank} exited {proc.returncode}, not {expected}: {tail}")
        if rejoin and (rejoined is None or rejoined.returncode != 0):
            tail = (root / "rejoined.log").read_text()[-2000:] if rejoined else ""
            problems.append(f"the restarted rank {victim} did not finish: {tail}")
        if rejoin and victim not in digests:
            problems.append(f"the restarted rank {victim} wrote no summary")
        if len(set(digests.values())) != 1 or None in digests.values():
            problems.append(f"survivors' digests differ: {digests}")
        resumed_at = None
        if rejoin:
            survivor = next(r for r in procs if r != victim)
            path = root / f"summary-{survivor}.json"
            epochs = json.loads(path.read_text())["epochs"] if path.exists() else []
        later = [e for e in epochs if victim not in e["members"]]
        if not later:
            problems.append(f"no epoch without rank {victim}: {epochs}")
        else:
            resumed_at = later[0]["step"]
            if resumed_at not in (step, step + 1):
                problems.append(f"resumed at step {resumed_at} after a kill at step {step}")
        detection = recovery = None
        for line in log_text.splitlines():
            when = _stamp(line)
            if when is None:
                continue
            if detection is None and f"rank {victim} " in line and "epoch" in line:
                detection = when - kill_seen
            if recovery is None and "recovered" in line:
                recovery = when - kill_seen
        return TrialResult(
            phase,
            step,
            victim,
            codes,
            digests,
            epochs,
            resumed_at,
            detection,
            recovery,
            time.monotonic() - started,
            log_text,
            problems,
        )


def main(argv: list[str] | None = None) -> int:
    """Run random trials, check each against a reference run, print and save the figures."""
    parser = argparse.ArgumentParser(prog="python -m runtime.fault_trials")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    references: dict[int, str | None] = {}
    results = []
    for index in range(args.trials):
        phase, step = rng.choice(PHASES), rng.randint(1, 5)
        result = run_trial(phase, step)
        if result.resumed_at is not None and result.ok:
            if result.resumed_at not in references:
                reference = run_trial("data", result.resumed_at)
                references[result.resumed_at] = next(iter(reference.digests.values()), None)
            if references[result.resumed_at] not in result.digests.values():
                result.problems.append(
                    f"final model differs from the reference run resumed at step "
                    f"{result.resumed_at}"
                )
        results.append(result)
        print(
            f"trial {index + 1}: kill rank {result.victim} at {phase}:{step} -> "
            f"{'ok' if result.ok else 'FAILED'}, resumed at step {result.resumed_at}, "
            f"detected {result.detection_seconds}, recovered {result.recovery_seconds}",
            flush=True,
        )
        for problem in result.problems:
            print(f"  problem: {problem}", flush=True)
    detections = [r.detection_seconds for r in results if r.detection_seconds is not None]
    recoveries = [r.recovery_seconds for r in results if r.recovery_seconds is not None]
    figures = {
        "trials": len(results),
        "passed": sum(r.ok for r in results),
        "deaths_survived": sum(r.ok for r in results),
        "detection_seconds_median": statistics.median(detections) if detections else None,
        "detection_seconds_max": max(detections) if detections else None,
        "recovery_seconds_median": statistics.median(recoveries) if recoveries else None,
        "recovery_seconds_max": max(recoveries) if recoveries else None,
        "trials_detail": [
            {k: v for k, v in asdict(r).items() if k != "coordinator_log"} for r in results
        ],
    }
    print(json.dumps({k: v for k, v in figures.items() if k != "trials_detail"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0 if figures["passed"] == figures["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
