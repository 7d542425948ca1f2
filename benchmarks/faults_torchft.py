"""Faults side by side: paramsync and torchft, the same worker killed at the same step.

Three workers, at least two needed (paramsync: a coordinator with ``--min-workers 2``; torchft:
a lighthouse with ``--min_replicas 2`` and ``min_replica_size=2``), the same tiny
CharTransformer job as the fault trials (`paramsync.runtime.testing.fault_trials.JOB_FLAGS`: d_model
16, 1 layer, 2 heads, context 16, batch 4 a worker, AdamW lr 3e-3). Each kill point ``phase:step``
is run under both systems, rank 2 SIGKILLing itself there, then started again at once:

- paramsync: `paramsync.runtime.testing.fault_trials.run_trial` with ``rejoin=True`` (the worker
  daemon armed through `paramsync.runtime.testing.faulty_daemon`);
- torchft: the worker of this script (``--worker torchft-fault``), one replica group a process as
  torchft's ``train_ddp.py`` runs on the CPU (`torchft_peer`), armed at the same phases: ``data``
  before the batch is loaded, ``forward`` after the forward, ``backward`` in DDP's comm hook
  before the first bucket is all-reduced, ``allreduce`` right after the first bucket's
  all-reduce was issued, ``optimizer`` inside the optimizer step (``should_commit`` has agreed),
  ``digest`` after the committed step (paramsync: before its digest report).

For each trial, from the kill (the time the victim stamped just before SIGKILLing itself):

- detection: until the survivors' next committed step (paramsync: the coordinator's "recovered"
  line; torchft: the first survivor's first step after the kill whose ``should_commit`` agreed);
- steps lost: step attempts the survivors ran and discarded (paramsync: the step in flight when
  it is rerun; torchft: the steps whose ``should_commit`` refused);
- time lost, in steps: the survivors' time from the kill to their next commit, less the one
  step that commit takes anyway, in units of that system's median step in the same run (the
  survivors' steps; a wait for the lost member costs the steps they could have run);
- rejoin: until the restarted worker's first committed step in step with the others (the
  process start-up included: both restart it as soon as the driver sees it dead);
- identical: the three workers' final states (parameters and optimizer state) bitwise equal.

``--nudge``: the adversarial case. Rank 1 adds 1e-3 to one parameter tensor after its optimizer
step at step 3, silently (a bug in a user's loop, a flipped bit); what each system does.

    python benchmarks/faults_torchft.py --trials 10 --nudge --json out/faults_torchft.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
for _path in (str(ROOT), str(BENCHMARKS)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torchft_peer  # noqa: E402

PHASES = ("data", "forward", "backward", "allreduce", "optimizer", "digest")
"""The kill points both systems are armed at (`paramsync.runtime.testing.faults.PHASES`)."""
WORKERS = 3
MIN_WORKERS = 2
VICTIM = 2
JOB = {
    "d_model": 16,
    "layers": 1,
    "heads": 2,
    "context": 16,
    "batch_size": 4,
    "corpus_bytes": 65536,
}
"""The fault trials' job (`paramsync.runtime.testing.fault_trials.JOB_FLAGS`), for ddp.py's
set-up."""
PARAMSYNC_STEPS = 800
"""paramsync's run length in a trial: long enough for the killed worker to start again and
rejoin before the survivors finish (on the loaded 2-core machine a restart took up to 50 s,
while the survivors ran about 7 steps a second)."""
AFTER_REJOIN_STEPS = 20
"""torchft's survivors run until the restarted worker has committed a step, then this many
more, all stopping at the same step."""
NUDGE_STEP = 3
NUDGE = 1e-3
NUDGE_RANK = 1
NUDGE_STEPS = 12
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _stamp(line: str) -> float | None:
    match = _STAMP.match(line)
    if match is None:
        return None
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def kill_points(trials: int) -> list[tuple[str, int]]:
    """``trials`` kill points, every phase in turn, steps 2 to 5: the same list for both."""
    if trials < 1:
        raise ValueError(f"trials must be at least 1, got {trials}")
    return [(PHASES[i % len(PHASES)], 2 + (i * 5 // len(PHASES)) % 4) for i in range(trials)]


def _job_args(rank: int, world: int) -> argparse.Namespace:
    """ddp.py's set-up arguments for the fault job at ``rank``."""
    import ddp

    flags = ["--rank", str(rank), "--world", str(world)]
    for name, value in JOB.items():
        flags += ["--" + name.replace("_", "-"), str(value)]
    return ddp.build_parser().parse_args(flags)


# ----------------------------------------------------------------------------- torchft worker


def _torchft_fault_worker(args: argparse.Namespace) -> None:
    """One torchft replica group (one process) of a fault trial: trains until the driver's
    stop step, logging every step attempt to ``progress-<tag>.jsonl``; armed with
    ``--fault``, SIGKILLs itself there after stamping the time to ``killed-at``."""
    import ddp
    import torch

    directory = Path(args.dir)
    progress = open(directory / f"progress-{args.tag}.jsonl", "a", buffering=1)

    def log(**fields: Any) -> None:
        progress.write(json.dumps({"t": time.time(), **fields}) + "\n")

    model, optimizer, batch, _info = ddp._setup(_job_args(args.rank, args.world))
    fault = None
    if args.fault:
        phase, _, step = args.fault.partition(":")
        fault = (phase, int(step))
    # Every first start waits for the others, so that the first quorum holds all of them.
    (directory / f"ready-{args.tag}").touch()
    if args.tag.startswith("rank"):
        while len(list(directory.glob("ready-rank*"))) < args.world:
            time.sleep(0.01)
    log(event="ready")
    manager, forward, wrapped, _store = torchft_peer.make_manager(
        model,
        optimizer,
        replica=args.rank,
        lighthouse=args.lighthouse,
        min_replica_size=MIN_WORKERS,
    )
    current = [0]

    def kill(phase: str) -> None:
        # At the fault's step or the first after it: a replica that joins after the first
        # quorum heals to its peers' step and may never run the step itself.
        if fault is not None and fault[0] == phase and current[0] >= fault[1]:
            (directory / "killed-at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    first_bucket = [True]
    all_reduce = manager.allreduce

    def armed_all_reduce(tensor: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
        first = first_bucket[0]
        first_bucket[0] = False
        if first:
            kill("backward")
        work = all_reduce(tensor, *rest, **kwargs)
        if first:
            kill("allreduce")
        return work

    manager.allreduce = armed_all_reduce
    optimizer.register_step_pre_hook(lambda *_: kill("optimizer"))
    stop_file = directory / "stop"
    while current[0] < args.max_steps:
        if stop_file.exists() and current[0] >= int(stop_file.read_text()):
            break
        current[0] = manager.current_step()
        kill("data")
        inputs, targets = batch(current[0])
        wrapped.zero_grad()  # starts this step's quorum
        first_bucket[0] = True
        logits = forward(inputs)
        kill("forward")
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )
        try:
            loss.backward()
        except AssertionError as error:
            # torchft 0.2.0's DDP comm hook asserts on the future of a failed all-reduce (a
            # peer died mid-step); its train_ddp.py loop would die here. The step is refused:
            # the Manager already holds the all-reduce's error, so should_commit says no.
            log(event="hook-error", step=current[0], error=repr(error))
            if manager.errored() is None:
                manager.report_error(error)
        wrapped.step()  # should_commit, then the optimizer step if it agreed
        committed = manager.current_step() == current[0] + 1
        log(step=current[0], committed=committed, participants=manager.num_participants())
        if committed:
            kill("digest")
        current[0] = manager.current_step()
    log(
        event="done",
        step=manager.current_step(),
        digest=torchft_peer.state_digest(model, optimizer),
    )
    progress.close()
    manager.shutdown(wait=False)
    os._exit(0)  # never let torch tear the gloo group down (see ddp.py's _run_worker)


# ----------------------------------------------------------------------------- torchft trial


def _read_progress(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def torchft_trial(
    phase: str, step: int, *, heartbeat_timeout_ms: int = 5000, timeout: float = 240.0
) -> dict:
    """One torchft trial: rank 2 killed at ``phase:step`` and started again at once; the
    figures from the workers' progress logs."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="paramsync-torchft-fault-") as tmp:
        root = Path(tmp)
        lighthouse = torchft_peer.start_lighthouse(
            MIN_WORKERS,
            root / "lighthouse.log",
            join_timeout_ms=10_000,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        procs: dict[str, subprocess.Popen[bytes]] = {}

        def start(rank: int, tag: str, fault: str | None = None) -> None:
            command = [
                sys.executable, str(Path(__file__).resolve()), "--worker", "torchft-fault",
                "--rank", str(rank), "--world", str(WORKERS), "--lighthouse", lighthouse.address,
                "--dir", str(root), "--tag", tag,
            ]  # fmt: skip
            if fault:
                command += ["--fault", fault]
            with open(root / f"{tag}.log", "wb") as err:
                procs[tag] = subprocess.Popen(
                    command, env=env, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT
                )

        try:
            for rank in range(WORKERS):
                start(rank, f"rank{rank}", f"{phase}:{step}" if rank == VICTIM else None)
            deadline = time.monotonic() + timeout
            victim = f"rank{VICTIM}"
            while any(p.poll() is None for p in procs.values()):
                if time.monotonic() > deadline:
                    tails = "\n".join(
                        f"--- {p.name}\n{p.read_text()[-2000:]}" for p in root.glob("*.log")
                    )
                    raise TimeoutError(
                        f"torchft trial {phase}:{step} ran past {timeout} s\n{tails}"
                    )
                survivors = [procs[f"rank{r}"] for r in range(WORKERS) if r != VICTIM]
                if any(p.poll() not in (None, 0) for p in survivors):
                    break  # a survivor died: fewer than MIN_WORKERS can never commit again
                if "rejoined" not in procs and procs[victim].poll() is not None:
                    start(VICTIM, "rejoined")
                if "rejoined" in procs and not (root / "stop").exists():
                    rejoined = [
                        r for r in _read_progress(root / "progress-rejoined.jsonl")
                        if r.get("committed")
                    ]  # fmt: skip
                    if rejoined:
                        (root / "stop").write_text(str(rejoined[0]["step"] + AFTER_REJOIN_STEPS))
                time.sleep(0.02)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            lighthouse.stop()
        return torchft_figures(phase, step, root, procs, time.monotonic() - started)


def torchft_figures(
    phase: str, step: int, root: Path, procs: dict[str, subprocess.Popen[bytes]], elapsed: float
) -> dict:
    """A torchft trial's figures from the workers' progress logs under ``root`` and the
    processes' exit codes."""
    problems: list[str] = []
    killed_at = float((root / "killed-at").read_text()) if (root / "killed-at").exists() else None
    codes = {tag: proc.returncode for tag, proc in procs.items()}
    for tag, code in codes.items():
        expected = -9 if tag == f"rank{VICTIM}" else 0
        if code != expected:
            tail = (root / f"{tag}.log").read_text()[-1500:]
            problems.append(f"{tag} exited {code}, not {expected}: {tail}")
    logs = {tag: _read_progress(root / f"progress-{tag}.jsonl") for tag in procs}
    survivors = [f"rank{r}" for r in range(WORKERS) if r != VICTIM]
    detection = rejoin = rejoin_from_ready = median_step = None
    lost = 0
    if killed_at is None:
        problems.append("the victim never reached its kill point")
    else:
        after = [r for r in logs[survivors[0]] if "committed" in r and r["t"] > killed_at]
        refused = 0
        for record in after:
            if record.get("committed"):
                detection = record["t"] - killed_at
                break
            refused += 1
        lost = refused
        commits = [r["t"] for r in logs[survivors[0]] if r.get("committed")]
        median_step = _median([b - a for a, b in itertools.pairwise(commits)])
        back = [r for r in logs.get("rejoined", []) if r.get("committed")]
        ready = [r for r in logs.get("rejoined", []) if r.get("event") == "ready"]
        if back:
            rejoin = back[0]["t"] - killed_at
            if ready:
                rejoin_from_ready = back[0]["t"] - ready[0]["t"]
        else:
            problems.append("the restarted worker never committed a step")
    digests = {
        tag: done[-1]["digest"]
        for tag in (*survivors, "rejoined")
        if (done := [r for r in logs.get(tag, []) if r.get("event") == "done"])
    }
    identical = len(digests) == WORKERS and len(set(digests.values())) == 1
    if not identical:
        problems.append(f"final states differ or are missing: {digests}")
    hook_errors = sum(r.get("event") == "hook-error" for tag in survivors for r in logs[tag])
    return {
        "system": "torchft",
        "hook_errors": hook_errors,
        "survivor_log_after_kill": [
            r for r in logs[survivors[0]] if killed_at is not None and r["t"] > killed_at
        ][:4],
        "phase": phase,
        "step": step,
        "detection_seconds": detection,
        "steps_lost": lost,
        "median_step_seconds": median_step,
        "time_lost_steps": time_lost_steps(detection, median_step),
        "rejoin_seconds": rejoin,
        "rejoin_from_ready_seconds": rejoin_from_ready,
        "identical": identical,
        "exit_codes": codes,
        "elapsed_seconds": elapsed,
        "problems": problems,
    }


def time_lost_steps(detection: float | None, median_step: float | None) -> float | None:
    """The survivors' training time a kill cost, in that system's own steps: from the kill to
    their next commit, less the one step that commit would have taken anyway, over their
    median step in the same run (0: the kill cost no time; None: not measured)."""
    if detection is None or not median_step:
        return None
    return max(0.0, detection - median_step) / median_step


# ----------------------------------------------------------------------------- paramsync trial


def paramsync_trial(phase: str, step: int, *, timeout: float = 600.0) -> dict:
    """One paramsync trial: `run_trial` with the live rejoin; the rejoin's time from the
    coordinator's log (the epoch the restarted rank joined, to its first commit)."""
    from paramsync.runtime.testing.fault_trials import JOB_FLAGS, run_trial

    flags = list(JOB_FLAGS)
    flags[flags.index("--steps") + 1] = str(PARAMSYNC_STEPS)
    result = run_trial(
        phase,
        step,
        workers=WORKERS,
        min_workers=MIN_WORKERS,
        victim=VICTIM,
        rejoin=True,
        job_flags=flags,
        timeout=timeout,
    )
    return paramsync_figures(phase, step, result)


def paramsync_figures(phase: str, step: int, result: Any) -> dict:
    """A `paramsync.runtime.testing.fault_trials.TrialResult`'s figures; the kill's time is the
    coordinator's first "recovered" line less the trial's recovery time."""
    lines = [(t, line) for line in result.coordinator_log.splitlines() if (t := _stamp(line))]
    recovered = [t for t, line in lines if " recovered: " in line]
    killed_at = None
    if recovered and result.recovery_seconds is not None:
        killed_at = recovered[0] - result.recovery_seconds
    rejoin = rejoin_from_join = None
    joined = [t for t, line in lines if f"(rank {VICTIM} joined)" in line]
    if joined and killed_at is not None:
        back = [t for t in recovered if t >= joined[0]]
        if back:
            rejoin = back[0] - killed_at
            rejoin_from_join = back[0] - joined[0]
    digests = result.digests
    identical = len(digests) == WORKERS and len(set(digests.values())) == 1
    problems = list(result.problems)
    if rejoin is None:
        problems.append("no commit with the restarted rank in the coordinator's log")
    median_step = _median(
        [summary.get("median_step_seconds") for summary in result.summaries.values()]
    )
    return {
        "system": "paramsync",
        "phase": phase,
        "step": step,
        "detection_seconds": result.recovery_seconds,
        "new_epoch_seconds": result.detection_seconds,
        "steps_lost": 1 if result.resumed_at == step else 0,
        "median_step_seconds": median_step,
        "time_lost_steps": time_lost_steps(result.recovery_seconds, median_step),
        "resumed_at": result.resumed_at,
        "rejoin_seconds": rejoin,
        "rejoin_from_join_seconds": rejoin_from_join,
        "identical": identical,
        "exit_codes": result.exit_codes,
        "elapsed_seconds": result.elapsed_seconds,
        "problems": problems,
    }


# ----------------------------------------------------------------------------- the nudge


def _nudged_name(model: Any) -> str:
    """The tensor the nudge changes: the model's last parameter (a final layer norm's bias in
    CharTransformer)."""
    return list(model.named_parameters())[-1][0]


def _arm_nudge(model: Any, optimizer: Any, rank: int, steps: list[int]) -> str:
    """After the optimizer step numbered NUDGE_STEP (``steps[0]`` counts them), rank
    NUDGE_RANK adds NUDGE to one tensor; returns its name."""
    import torch

    name = _nudged_name(model)
    tensor = dict(model.named_parameters())[name]

    def after_step(*_: Any) -> None:
        if rank == NUDGE_RANK and steps[0] == NUDGE_STEP:
            with torch.no_grad():
                tensor.add_(NUDGE)
        steps[0] += 1

    optimizer.register_step_post_hook(after_step)
    return name


def _paramsync_nudge_worker(args: argparse.Namespace) -> None:
    import ddp
    import trio

    from paramsync.actors.train.worker import join_run
    from paramsync.runtime.config import DistributedConfig

    model, optimizer, batch, _info = ddp._setup(_job_args(args.rank, args.world))
    steps = [0]
    name = _arm_nudge(model, optimizer, args.rank, steps)

    def loss_fn(model: Any, micro_batch: Any) -> Any:
        inputs, targets = micro_batch
        return model.loss(inputs, targets)

    async def main() -> dict:
        config = DistributedConfig(args.world, args.rank, args.coordinator)
        reached = 0
        try:
            async with join_run(model, optimizer, loss_fn, config) as trainer:
                for step in range(NUDGE_STEPS):
                    await trainer.train_batch(batch(step))
                    reached = trainer.step
                await trainer.verified()
        except BaseException as error:  # an exception group holding RunAborted
            return {"outcome": "stopped", "error": _abort_text(error), "reached": reached}
        return {"outcome": "finished", "reached": reached}

    result = trio.run(main)
    result["tensor"] = name
    print(json.dumps(result), flush=True)


def _abort_text(error: BaseException) -> str:
    from paramsync.actors import RunAborted

    pending = [error]
    while pending:
        leaf = pending.pop()
        if isinstance(leaf, RunAborted):
            return str(leaf)
        pending.extend(getattr(leaf, "exceptions", ()))
    return f"{type(error).__name__}: {error}"


def _torchft_nudge_worker(args: argparse.Namespace) -> None:
    import ddp
    import torch

    model, optimizer, batch, _info = ddp._setup(_job_args(args.rank, args.world))
    steps = [0]
    name = _arm_nudge(model, optimizer, args.rank, steps)
    manager, forward, wrapped, _store = torchft_peer.make_manager(
        model, optimizer, replica=args.rank, lighthouse=args.lighthouse, min_replica_size=args.world
    )
    refused = []
    for step in range(NUDGE_STEPS):
        inputs, targets = batch(step)
        wrapped.zero_grad()
        logits = forward(inputs)
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        ).backward()
        wrapped.step()
        if manager.current_step() != step + 1:
            refused.append(step)
    values = dict(model.named_parameters())[name].detach().clone()
    torch.save({"values": values}, Path(args.dir) / f"nudged-{args.rank}.pt")
    print(
        json.dumps(
            {
                "outcome": "finished",
                "reached": manager.current_step(),
                "refused_steps": refused,
                "errored": str(manager.errored()),
                "tensor": name,
                "digest": torchft_peer.state_digest(model, optimizer),
            }
        ),
        flush=True,
    )
    manager.shutdown(wait=False)
    os._exit(0)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nudge(system: str, timeout: float = 180.0) -> dict:
    """The adversarial case under ``system``: what each worker reported, and for torchft how
    far the nudged replica's tensor ends from the others'."""
    import torch

    with tempfile.TemporaryDirectory(prefix=f"paramsync-nudge-{system}-") as tmp:
        root = Path(tmp)
        env = dict(os.environ, OMP_NUM_THREADS="1", PARAMSYNC_SECRET=secrets.token_hex(16))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        procs: dict[str, subprocess.Popen[bytes]] = {}
        extra: list[str] = []
        lighthouse = None
        if system == "paramsync":
            port = _free_port()
            command = [
                sys.executable, "-m", "paramsync.runtime.cli.main", "coordinator",
                "--world-size", str(WORKERS), "--bind", f"127.0.0.1:{port}",
                "--digest-interval", "1",
            ]  # fmt: skip
            with open(root / "coordinator.log", "wb") as out:
                procs["coordinator"] = subprocess.Popen(
                    command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT
                )
            extra = ["--coordinator", f"127.0.0.1:{port}"]
        else:
            lighthouse = torchft_peer.start_lighthouse(WORKERS, root / "lighthouse.log")
            extra = ["--lighthouse", lighthouse.address]
        try:
            for rank in range(WORKERS):
                command = [
                    sys.executable, str(Path(__file__).resolve()), "--worker", f"{system}-nudge",
                    "--rank", str(rank), "--world", str(WORKERS), "--dir", str(root), *extra,
                ]  # fmt: skip
                with (
                    open(root / f"rank{rank}.out", "wb") as out,
                    open(root / f"rank{rank}.log", "wb") as err,
                ):
                    procs[f"rank{rank}"] = subprocess.Popen(
                        command, env=env, stdout=out, stderr=err, cwd=ROOT
                    )
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs.values()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {system} nudge run ran past {timeout} s")
                time.sleep(0.05)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            if lighthouse is not None:
                lighthouse.stop()
        reports = {}
        for rank in range(WORKERS):
            lines = (root / f"rank{rank}.out").read_text().strip().splitlines()
            if not lines:
                tail = (root / f"rank{rank}.log").read_text()[-2000:]
                raise RuntimeError(f"{system} nudge: rank {rank} reported nothing: {tail}")
            reports[rank] = json.loads(lines[-1])
        result: dict[str, Any] = {
            "system": system,
            "exit_codes": {tag: p.returncode for tag, p in procs.items()},
            "reports": reports,
        }
        if system == "paramsync":
            log = (root / "coordinator.log").read_text()
            result["coordinator"] = [line for line in log.splitlines() if "differ" in line][-1:]
        else:
            values = {
                rank: torch.load(root / f"nudged-{rank}.pt")["values"] for rank in range(WORKERS)
            }
            result["nudged_max_abs_diff"] = {
                rank: float((values[rank] - values[0]).abs().max()) for rank in range(WORKERS)
            }
            result["digests_equal"] = len({r["digest"] for r in reports.values()}) == 1
        return result


# ----------------------------------------------------------------------------- driver


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(trials: list[dict]) -> dict[str, dict]:
    """Per system: medians and maxima of the figures, and how many recoveries were identical."""
    out: dict[str, dict] = {}
    for system in ("paramsync", "torchft"):
        mine = [t for t in trials if t["system"] == system]
        if not mine:
            continue
        row: dict[str, Any] = {"trials": len(mine)}
        for key in ("detection_seconds", "rejoin_seconds"):
            values = [t[key] for t in mine if t[key] is not None]
            row[key] = {
                "median": statistics.median(values) if values else None,
                "max": max(values) if values else None,
                "measured": len(values),
            }
        row["steps_lost"] = {
            "total": sum(t["steps_lost"] for t in mine),
            "max": max(t["steps_lost"] for t in mine),
        }
        spent = [t["time_lost_steps"] for t in mine if t.get("time_lost_steps") is not None]
        row["time_lost_steps"] = {
            "median": statistics.median(spent) if spent else None,
            "max": max(spent) if spent else None,
            "measured": len(spent),
        }
        row["median_step_seconds"] = _median([t.get("median_step_seconds") for t in mine])
        row["identical"] = sum(bool(t["identical"]) for t in mine)
        row["with_problems"] = sum(bool(t["problems"]) for t in mine)
        out[system] = row
    return out


def _seconds(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f} s"


def _steps(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _print_summary(summary: dict[str, dict]) -> None:
    print(f"{'figure':<44} | {'paramsync':>18} | {'torchft':>18}")
    print("-" * 86)

    def cell(system: str, text: Any) -> str:
        return text(summary[system]) if system in summary else "-"

    rows = [
        ("kills (rank 2, restarted at once)", lambda r: str(r["trials"])),
        (
            "detection: kill to next commit, median / max",
            lambda r: (
                f"{_seconds(r['detection_seconds']['median'])} / "
                f"{_seconds(r['detection_seconds']['max'])}"
            ),
        ),
        (
            "steps lost: total / most in one kill",
            lambda r: f"{r['steps_lost']['total']} / {r['steps_lost']['max']}",
        ),
        (
            "time lost in steps: median / max (measured)",
            lambda r: (
                f"{_steps(r['time_lost_steps']['median'])} / "
                f"{_steps(r['time_lost_steps']['max'])} ({r['time_lost_steps']['measured']})"
            ),
        ),
        ("median step (the survivors')", lambda r: _seconds(r["median_step_seconds"], 3)),
        (
            "rejoin: kill to in step again, median / max",
            lambda r: (
                f"{_seconds(r['rejoin_seconds']['median'])} / "
                f"{_seconds(r['rejoin_seconds']['max'])}"
            ),
        ),
        ("all three bitwise identical after", lambda r: f"{r['identical']} of {r['trials']}"),
        ("trials with a problem", lambda r: str(r["with_problems"])),
    ]
    for label, text in rows:
        print(f"{label:<44} | {cell('paramsync', text):>18} | {cell('torchft', text):>18}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10, help="kill points, each under both")
    parser.add_argument(
        "--systems", nargs="+", choices=("paramsync", "torchft"), default=["paramsync", "torchft"]
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="torchft's lighthouse: how long a replica may go unheard (its default 5000)",
    )
    parser.add_argument(
        "--start",
        type=int,
        default=0,
        help="skip the first START kill points (to resume a stopped run; the list is fixed)",
    )
    parser.add_argument("--nudge", action="store_true", help="also run the adversarial case")
    parser.add_argument("--no-kills", action="store_true", help="only the nudge")
    parser.add_argument("--json", type=Path, help="write every trial and the summary here")
    parser.add_argument(
        "--worker",
        choices=("torchft-fault", "torchft-nudge", "paramsync-nudge"),
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--max-steps", type=int, default=100_000, help=argparse.SUPPRESS)
    for hidden in ("--lighthouse", "--dir", "--tag", "--fault", "--coordinator"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "torchft-fault":
        _torchft_fault_worker(args)
        return
    if args.worker == "torchft-nudge":
        _torchft_nudge_worker(args)
        return
    if args.worker == "paramsync-nudge":
        _paramsync_nudge_worker(args)
        return
    if "torchft" in args.systems and not torchft_peer.available():
        raise SystemExit(f"torchft: {torchft_peer.missing_reason()}")
    points = [] if args.no_kills else kill_points(args.trials)[args.start :]
    at = " ".join(f"{phase}:{step}" for phase, step in points) or "(no kills)"
    print(
        f"{WORKERS} workers, at least {MIN_WORKERS}; rank {VICTIM} killed and restarted at: "
        f"{at}; {os.cpu_count()} CPUs",
        flush=True,
    )
    trials: list[dict] = []
    started = time.perf_counter()
    for index, (phase, step) in enumerate(points):
        order = args.systems if index % 2 == 0 else args.systems[::-1]
        for system in order:
            try:
                if system == "paramsync":
                    trial = paramsync_trial(phase, step)
                else:
                    trial = torchft_trial(
                        phase, step, heartbeat_timeout_ms=args.heartbeat_timeout_ms
                    )
            except (TimeoutError, RuntimeError) as error:  # a trial that never ended is a result
                trial = _failed_trial(system, phase, step, error)
            trials.append(trial)
            _write_json(args, trials, [])
            print(
                f"{system} {phase}:{step}: detection {_seconds(trial['detection_seconds'])}, "
                f"steps lost {trial['steps_lost']} "
                f"(time lost {_steps(trial.get('time_lost_steps'))} steps), "
                f"rejoin {_seconds(trial['rejoin_seconds'])}, "
                f"identical {trial['identical']}"
                + (f"; problems: {trial['problems']}" if trial["problems"] else ""),
                flush=True,
            )
    summary = summarise(trials)
    if trials:
        _print_summary(summary)
    nudges = []
    if args.nudge:
        for system in args.systems:
            outcome = nudge(system)
            nudges.append(outcome)
            print(f"nudge, {system}: {json.dumps(outcome)}", flush=True)
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        _write_json(args, trials, nudges)
        print(f"wrote {args.json}")


def _failed_trial(system: str, phase: str, step: int, error: Exception) -> dict:
    """A trial that raised (it ran past its deadline, a process never started): no figures,
    the error as its problem."""
    return {
        "system": system,
        "phase": phase,
        "step": step,
        "detection_seconds": None,
        "steps_lost": 0,
        "rejoin_seconds": None,
        "identical": False,
        "problems": [f"{type(error).__name__}: {str(error)[:3000]}"],
    }


def _write_json(args: argparse.Namespace, trials: list[dict], nudges: list[dict]) -> None:
    """Every trial so far, the summary and the nudges to ``--json`` (after every trial, so
    that a long run's figures survive it being stopped)."""
    if not args.json:
        return
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "cpu_count": os.cpu_count(),
                "heartbeat_timeout_ms": args.heartbeat_timeout_ms,
                "trials": trials,
                "summary": summarise(trials),
                "nudge": nudges,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
