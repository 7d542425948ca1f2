"""``paramsync launch``: a coordinator and N workers on this machine, like torchrun.

The launcher owns its children: it forwards SIGINT and SIGTERM to all of them, and when one
worker fails it stops the others and exits non-zero naming the failed rank, so a run never
half-survives. Each worker gets torchrun's variables and a fresh shared secret.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from runtime.cli.train_config import shared_secret
from runtime.errors import one_line
from runtime.protocol.handshake import SECRET_ENV, SECRET_FILE_ENV

__all__ = ["run_launch", "merge_summaries", "free_port"]

log = logging.getLogger("paramsync.launch")

_GRACE_SECONDS = 10.0
EXIT_USAGE = 2


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def merge_summaries(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One run summary from the workers' own: the final step and loss, each rank's digest and
    whether they agree, and the slowest rank's steps per second."""
    per_rank = sorted(per_rank, key=lambda s: s["rank"])
    digests = [s.get("digest") for s in per_rank]
    losses = [s["final_loss"] for s in per_rank if s.get("final_loss") is not None]
    rates = [s["steps_per_second"] for s in per_rank if s.get("steps_per_second")]
    return {
        "world_size": len(per_rank),
        "final_step": min(s["final_step"] for s in per_rank) if per_rank else 0,
        "final_loss": sum(losses) / len(losses) if losses else None,
        "digests": {str(s["rank"]): s.get("digest") for s in per_rank},
        "digests_identical": len(set(digests)) == 1 and digests[0] is not None,
        "steps_per_second": min(rates) if rates else None,
        "ranks": per_rank,
    }


def _command(parts: list[str]) -> list[str]:
    if parts and parts[0] == "--":
        parts = parts[1:]
    if not parts:
        raise ValueError("nothing to launch: give SCRIPT [ARGS] or -m MODULE [ARGS]")
    if parts[0] == "-m":
        if len(parts) < 2:
            raise ValueError("-m needs a module name")
        return [sys.executable, "-m", *parts[1:]]
    return [sys.executable, *parts]


def run_launch(args: argparse.Namespace) -> int:
    """Run the launch; returns its exit code: 1 when a worker failed, 2 on a bad
    configuration (the launcher's own, e.g. a secret too short, or a worker's that exited 2).

    The secret: $PARAMSYNC_SECRET or $PARAMSYNC_SECRET_FILE as the user set them (checked
    first), else a fresh one in every child's environment."""
    try:
        command = _command(list(args.program))
        if args.nproc < 1:
            raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
        if not 0 <= args.master_port <= 65535:
            raise ValueError(f"--master-port must be a TCP port (0-65535), got {args.master_port}")
        given_secret = bool(os.environ.get(SECRET_ENV) or os.environ.get(SECRET_FILE_ENV))
        if given_secret:
            shared_secret()  # the user's secret must work before N processes find out it does not
    except ValueError as exc:
        log.error("bad configuration: %s", one_line(exc))
        return EXIT_USAGE
    port = args.master_port or free_port()
    # torchrun's variables of an enclosing run would send the children to its store.
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    if not given_secret:  # a fresh one for this run; the user's own (variable or file) as it is
        base[SECRET_ENV] = secrets.token_hex(16)
    base.update(
        # One run id for every rank: jobs record it in their checkpoints (a resume refuses
        # another run's).
        PARAMSYNC_RUN_ID=os.environ.get("PARAMSYNC_RUN_ID") or secrets.token_hex(8),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(args.nproc),
        PARAMSYNC_ROLE="worker",
    )
    # Like torchrun: one intra-op thread per worker unless the user says otherwise, so N
    # workers do not oversubscribe the machine's cores.
    base.setdefault("OMP_NUM_THREADS", "1")
    base.setdefault(
        "PARAMSYNC_LOG_LEVEL", logging.getLevelName(logging.getLogger().getEffectiveLevel())
    )
    summary_dir = Path(tempfile.mkdtemp(prefix="paramsync-launch-"))
    coordinator = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runtime.cli.main",
            "--log-level",
            logging.getLevelName(logging.getLogger().getEffectiveLevel()),
            "coordinator",
            "--world-size",
            str(args.nproc),
            "--bind",
            f"127.0.0.1:{port}",
            "--digest-interval",
            str(args.digest_interval),
            "--heartbeat-deadline",
            str(args.heartbeat_deadline),
        ],
        env=base,
    )
    workers: dict[int, subprocess.Popen[bytes]] = {}
    for rank in range(args.nproc):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        if args.summary_json:
            env["PARAMSYNC_SUMMARY_JSON"] = str(summary_dir / f"rank{rank}.json")
        workers[rank] = subprocess.Popen(command, env=env)
    log.info(
        "launched a coordinator (pid %d) and %d workers on 127.0.0.1:%d",
        coordinator.pid,
        args.nproc,
        port,
    )
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        for proc in [coordinator, *workers.values()]:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        failed = _supervise(workers, coordinator)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failed is None:
        try:
            coordinator.wait(timeout=_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            coordinator.terminate()
            coordinator.wait()
    else:
        _stop_all([coordinator, *workers.values()])
    code = 0
    if received:
        code = 128 + received[0]
    elif failed is not None:
        rank, proc = failed
        who = (
            f"worker rank {rank} (pid {proc.pid})"
            if rank >= 0
            else f"the coordinator (pid {proc.pid})"
        )
        if proc.returncode == EXIT_USAGE:
            log.error(
                "%s exited with code 2, bad configuration (its line above): stopped the run", who
            )
            code = EXIT_USAGE
        else:
            log.error("%s failed with exit code %s: stopped the run", who, proc.returncode)
            code = 1
    elif coordinator.returncode:
        log.error("the coordinator exited with code %d", coordinator.returncode)
        code = 1
    if args.summary_json and code == 0:
        summaries = [json.loads(p.read_text()) for p in sorted(summary_dir.glob("rank*.json"))]
        target = Path(args.summary_json)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(merge_summaries(summaries), indent=2))
        log.info("wrote the run summary to %s", target)
    return code


def _supervise(
    workers: dict[int, subprocess.Popen[bytes]], coordinator: subprocess.Popen[bytes]
) -> tuple[int, subprocess.Popen[bytes]] | None:
    """Wait for every worker; return the first that failed (rank -1: the coordinator)."""
    pending = dict(workers)
    while pending:
        for rank, proc in list(pending.items()):
            code = proc.poll()
            if code is None:
                continue
            del pending[rank]
            if code != 0:
                return rank, proc
        code = coordinator.poll()
        if code not in (None, 0) and pending:
            return -1, coordinator
        time.sleep(0.05)
    return None


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + _GRACE_SECONDS
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
