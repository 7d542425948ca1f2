"""Fault-injection trials: real worker processes SIGKILLed at a chosen phase and step.

A trial starts an elastic coordinator daemon and ``workers`` worker daemons of the built-in LM
job, arms one worker with the fault ``phase:step`` (it runs through
`paramsync.runtime.testing.faulty_daemon`, which wraps its actors so it SIGKILLs itself there), and
lets the run finish with the survivors. It then checks what the fault-tolerance contract promises:
the coordinator and every survivor exit 0, the survivors end bitwise identical (one digest), the
membership history shows the loss, and the final model equals a reference run with the same
membership history (the same worker killed before it touches the step the survivors resumed at).
Detection and recovery times come from the coordinator's log.

`run_coordinator_restart_trial` kills the coordinator instead (``commit:step``: it has decided
to commit the step, nobody has heard of it) and starts it again on the same port: every worker
must keep its state, redial, rejoin, and finish with the model of an uninterrupted run.

``python -m paramsync.runtime.testing.fault_trials --trials 20`` runs trials at random points and
prints figures; ``--coordinator-restarts N`` adds N coordinator-restart trials.
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

from paramsync.runtime.testing.faults import PHASES
from paramsync.runtime.testing.faulty_daemon import command as faulty_command

__all__ = [
    "TrialResult",
    "RestartResult",
    "run_trial",
    "run_coordinator_restart_trial",
    "JOB_FLAGS",
    "main",
]

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
    summaries: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)
    """The summary each worker that finished wrote (`DistributedTrainer.summary`)."""

    @property
    def ok(self) -> bool:
        return not self.problems


def _stamp(line: str) -> float | None:
    match = _STAMP.match(line)
    if match is None:
        return None
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _python(fault: str | None = None, stamp: Path | None = None) -> list[str]:
    """The command line of a ``paramsync`` daemon; armed with ``fault`` (``phase:step``), it
    runs through `paramsync.runtime.testing.faulty_daemon` and writes the time of its kill to
    ``stamp``."""
    if fault is None:
        return [sys.executable, "-m", "paramsync.runtime.cli.main"]
    return [sys.executable, *faulty_command(fault, [], stamp=str(stamp) if stamp else None)]


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
        env = _trial_env()
        port_file = root / "port"
        coordinator_log = root / "coordinator.log"
        elastic = ["--min-workers", str(min_workers), "--rejoin-seconds", "10"]
        coordinator = _start_coordinator(
            workers, "127.0.0.1:0", port_file, env, coordinator_log, elastic
        )
        procs: dict[int, subprocess.Popen[bytes]] = {}
        kill_seen: float | None = None
        rejoined: subprocess.Popen[bytes] | None = None
        try:
            deadline = time.monotonic() + timeout
            port = _wait_for_port(port_file, coordinator, coordinator_log, deadline)

            def start_worker(rank: int, log: str, fault: str | None = None) -> Any:
                stamp = root / "killed-at"
                return _start_worker(rank, workers, port, root, flags, env, log, fault, stamp)

            for rank in range(workers):
                fault = f"{phase}:{step}" if rank == victim else None
                procs[rank] = start_worker(rank, f"worker-{rank}.log", fault)
            while any(
                p.poll() is None for p in (coordinator, *procs.values(), rejoined) if p is not None
            ):
                if kill_seen is None and procs[victim].poll() is not None:
                    kill_seen = time.time()
                    if rejoin:
                        rejoined = start_worker(victim, "rejoined.log")
                _check_deadline(deadline, timeout, root)
                time.sleep(0.005)
            if kill_seen is None:
                kill_seen = time.time()
        finally:
            _kill_all(coordinator, *procs.values(), rejoined)
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
        summaries: dict[int, dict[str, Any]] = {}
        for rank in procs:
            path = root / f"summary-{rank}.json"
            if (rank != victim or rejoin) and path.exists():
                summary = summaries[rank] = json.loads(path.read_text())
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
            summaries,
        )


@dataclass
class RestartResult:
    """What one coordinator-restart trial ended with."""

    step: int | None
    """The commit the coordinator was killed at (None: the uninterrupted reference run)."""
    exit_codes: dict[str, int]
    digests: dict[int, str | None]
    epochs: list[dict[str, Any]]
    resumed_at: int | None
    recovery_seconds: float | None
    """From the kill to the restarted coordinator's first commit (includes its start-up)."""
    rejoin_seconds: float | None
    """From the restarted coordinator's launch to its first commit: the workers' redial,
    rejoin and digest check (the process start-up of the coordinator included)."""
    elapsed_seconds: float
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _trial_env() -> dict[str, str]:
    """This process's environment with a fresh secret, one thread per process."""
    return dict(os.environ, PARAMSYNC_SECRET=secrets.token_hex(16), OMP_NUM_THREADS="1")


def _start_coordinator(
    workers: int,
    bind: str,
    port_file: Path,
    env: dict[str, str],
    log: Path,
    extra: list[str] | None = None,
    fault: str | None = None,
    stamp: Path | None = None,
) -> subprocess.Popen[bytes]:
    """A coordinator daemon (heartbeat deadline 3 s) logging to ``log``; ``fault``: armed
    to SIGKILL itself there (`paramsync.runtime.testing.faulty_daemon`)."""
    command = [
        *_python(fault, stamp), "coordinator", "--world-size", str(workers), "--bind", bind,
        "--port-file", str(port_file), "--heartbeat-deadline", "3", *(extra or []),
    ]  # fmt: skip
    with open(log, "w") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def _start_worker(
    rank: int,
    workers: int,
    port: int,
    root: Path,
    flags: list[str],
    env: dict[str, str],
    log: str,
    fault: str | None = None,
    stamp: Path | None = None,
) -> subprocess.Popen[bytes]:
    """An LM worker daemon writing its summary to ``root``, its log to ``root / log``;
    ``fault``: armed to SIGKILL itself there (`paramsync.runtime.testing.faulty_daemon`)."""
    command = [*_python(fault, stamp), "worker", "--rank", str(rank), "--world-size", str(workers)]
    command += ["--coordinator", f"127.0.0.1:{port}"]
    command += ["--summary-json", str(root / f"summary-{rank}.json"), *flags]
    with open(root / log, "w") as err:
        return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err)


def _check_deadline(deadline: float, timeout: float, root: Path) -> None:
    """Past ``deadline``: fail with the tail of every process's log."""
    if time.monotonic() > deadline:
        logs = "\n".join(
            f"--- {path.name}:\n{path.read_text()[-3000:]}" for path in sorted(root.glob("*.log"))
        )
        raise TimeoutError(f"the trial did not finish within {timeout} s\n{logs}")


def _kill_all(*procs: subprocess.Popen[bytes] | None) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_for_port(port_file: Path, proc: subprocess.Popen[bytes], log: Path, until: float) -> int:
    while not port_file.exists() or not port_file.read_text().strip():
        if proc.poll() is not None or time.monotonic() > until:
            raise RuntimeError(f"the coordinator did not start: {log.read_text()}")
        time.sleep(0.02)
    return int(port_file.read_text())


def run_coordinator_restart_trial(
    step: int | None,
    *,
    workers: int = 3,
    timeout: float = 120.0,
    job_flags: list[str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
) -> RestartResult:
    """Kill the coordinator daemon (SIGKILL) as it commits ``step``, start it again on the same
    port, and check that the run resumes and finishes with every worker's model equal to an
    uninterrupted run's (``digests``; the caller compares them with a reference). ``step``
    None: no kill (the reference run)."""
    flags = JOB_FLAGS if job_flags is None else job_flags
    started = time.monotonic()
    deadline = started + timeout
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        root = Path(tmp)
        env = _trial_env()
        fault = None if step is None else f"commit:{step}"
        port_file, first_log, second_log = root / "port", root / "first.log", root / "second.log"
        first = _start_coordinator(
            workers, "127.0.0.1:0", port_file, env, first_log, fault=fault, stamp=root / "killed"
        )
        procs: dict[int, subprocess.Popen[bytes]] = {}
        second: subprocess.Popen[bytes] | None = None
        relaunched = 0.0
        try:
            port = _wait_for_port(port_file, first, first_log, deadline)
            port_file.unlink()
            redial = ["--reconnect-seconds", "60"]
            for rank in range(workers):
                log = f"worker-{rank}.log"
                procs[rank] = _start_worker(rank, workers, port, root, flags + redial, env, log)
            while any(p.poll() is None for p in (first, second, *procs.values()) if p):
                if second is None and first.poll() == -9:  # killed: start it again
                    relaunched = time.time()
                    bind = f"127.0.0.1:{port}"
                    second = _start_coordinator(workers, bind, port_file, env, second_log)
                _check_deadline(deadline, timeout, root)
                time.sleep(0.005)
        finally:
            _kill_all(first, second, *procs.values())
        codes = {"coordinator": first.returncode}
        if second is not None:
            codes["restarted coordinator"] = second.returncode
        codes.update({f"rank {r}": p.returncode for r, p in procs.items()})
        problems = []
        restarted_log = second_log.read_text() if second_log.exists() else ""
        if step is None:
            if first.returncode != 0:
                problems.append(f"the coordinator failed: {first_log.read_text()[-3000:]}")
        elif first.returncode != -9:
            problems.append(f"the coordinator was not killed at commit {step}: {codes}")
        elif second is None or second.returncode != 0:
            problems.append(f"the restarted coordinator failed: {restarted_log[-3000:]}")
        digests: dict[int, str | None] = {}
        epochs: list[dict[str, Any]] = []
        for rank, proc in procs.items():
            if proc.returncode != 0:
                tail = (root / f"worker-{rank}.log").read_text()[-2000:]
                problems.append(f"rank {rank} exited {proc.returncode}: {tail}")
            path = root / f"summary-{rank}.json"
            summary = json.loads(path.read_text()) if path.exists() else {}
            digests[rank] = summary.get("digest")
            epochs = summary.get("epochs", epochs)
        if len(set(digests.values())) != 1 or None in digests.values():
            problems.append(f"the workers' digests differ: {digests}")
        resumed_at = epochs[1]["step"] if len(epochs) > 1 else None
        if step is not None and resumed_at not in (step + 1, step + 2):
            problems.append(f"expected a second epoch resuming after step {step}: {epochs}")
        recovery = rejoin = None
        stamp = root / "killed"
        if stamp.exists():
            killed_at = float(stamp.read_text())
            for line in restarted_log.splitlines():
                when = _stamp(line)
                if when is not None and "recovered" in line:
                    recovery, rejoin = when - killed_at, when - relaunched
                    break
        return RestartResult(
            step,
            codes,
            digests,
            epochs,
            resumed_at,
            recovery,
            rejoin,
            time.monotonic() - started,
            problems,
        )


def main(argv: list[str] | None = None) -> int:
    """Run random trials, check each against a reference run, print and save the figures."""
    parser = argparse.ArgumentParser(prog="python -m paramsync.runtime.testing.fault_trials")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument(
        "--coordinator-restarts",
        type=int,
        default=0,
        help="also kill and restart the coordinator in this many trials",
    )
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
    restarts = []
    if args.coordinator_restarts:
        uninterrupted = run_coordinator_restart_trial(None)
        expected = set(uninterrupted.digests.values())
        for index in range(args.coordinator_restarts):
            restart = run_coordinator_restart_trial(rng.randint(0, 6))
            if restart.ok and set(restart.digests.values()) != expected:
                restart.problems.append("final model differs from the uninterrupted run")
            restarts.append(restart)
            print(
                f"restart {index + 1}: coordinator killed at commit {restart.step} -> "
                f"{'ok' if restart.ok else 'FAILED'}, resumed at step {restart.resumed_at}, "
                f"recovered {restart.recovery_seconds} after the kill, "
                f"{restart.rejoin_seconds} after the relaunch",
                flush=True,
            )
            for problem in restart.problems:
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
        "coordinator_restarts": len(restarts),
        "coordinator_restarts_survived": sum(r.ok for r in restarts),
        "coordinator_recovery_seconds_median": (
            statistics.median(times) if (times := _recoveries(restarts)) else None
        ),
        "coordinator_recovery_seconds_max": max(times) if times else None,
        "coordinator_rejoin_seconds_median": (
            statistics.median(rejoins)
            if (rejoins := [r.rejoin_seconds for r in restarts if r.rejoin_seconds is not None])
            else None
        ),
        "trials_detail": [
            {k: v for k, v in asdict(r).items() if k != "coordinator_log"} for r in results
        ],
    }
    print(json.dumps({k: v for k, v in figures.items() if k != "trials_detail"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    passed = figures["passed"] == figures["trials"]
    return 0 if passed and figures["coordinator_restarts_survived"] == len(restarts) else 1


def _recoveries(restarts: list[RestartResult]) -> list[float]:
    return [r.recovery_seconds for r in restarts if r.recovery_seconds is not None]


if __name__ == "__main__":
    sys.exit(main())
