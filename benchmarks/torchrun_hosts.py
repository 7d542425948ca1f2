"""torch DDP under ``torchrun --nnodes 2`` with c10d rendezvous, one node per network namespace.

Two Linux network namespaces on a bridge are the two hosts (`paramsync.runtime.testing.netns`).
Each runs ``torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint A:PORT --local-addr ITS_ADDR``
on this file's ``job``: a plain torch script, nothing imported from paramsync, that calls
``init_process_group(BACKEND)`` and trains a small MLP under torch's own DDP. Host a (the
rendezvous endpoint's) is node rank 0: torchrun ranks the nodes by their ``--local-addr``.

Two trials:

* ``train`` (`train_on_two_hosts`): the job to its end on the ``paramsync`` backend and on
  ``gloo``, each rank saving its final state and, on the backend, who ran which coordinator
  (the group spans two hosts, so it runs the coordinator tree unless
  ``PARAMSYNC_COORDINATOR_KIND`` says ``flat``); the test compares them bitwise.
* ``loss`` (`host_loss_trial`): the job on the backend with a heartbeat deadline; once both hosts
  are past step ``--kill-step``, one host dies: ``kill`` SIGKILLs every process inside its
  namespace (its torchrun agent and its workers: their sockets close), ``link`` brings its veth
  down (nothing closes: the survivors hear silence). Measured: from the death to the moment each
  surviving rank's collective fails with the backend's error, and that error's line.

Reported (the benchmark, ``main``): per way of dying and per host lost (``node1``: a member's
host; ``node0``: the host of rank 0 and so of the group's root coordinator), the median over rounds
of the time to name the loss, with the heartbeat deadline it is bounded by.

    python benchmarks/torchrun_hosts.py --rounds 5 --json out/torchrun_hosts.json
    python benchmarks/torchrun_hosts.py --rounds 1 --ways link --lost node1

Needs root, iproute2 (``ip netns``) and torchrun; says why and exits 2 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

THIS = Path(__file__).resolve()
RDZV_PORT = 29541
WAYS = ("kill", "link")
LOST = ("node1", "node0")
AGENT_SECONDS = 10.0
"""How long a loss trial waits for the surviving torchrun agent to exit after its ranks did."""
Command = Callable[[int, list[str]], list[str]]
"""``(node, script argv) -> the argv that node runs``."""
ERROR_EXIT = 3
"""The job's exit status when a collective failed (its error line is in ``rank<r>.err``)."""


# ----------------------------------------------------------------------------- the job


def job(argv: list[str]) -> int:
    """One rank of the training script (under torchrun): plain torch DDP on ``--backend``."""
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="torchrun_hosts.py job")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 4),
    )  # fmt: skip
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)  # a few buckets
    initial = {key: value.detach().clone() for key, value in model.state_dict().items()}
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1000 + rank)
    progress = args.out / f"step{rank}"
    try:
        for step in range(args.steps):
            x, y = torch.randn(16, 16, generator=data), torch.randn(16, 4, generator=data)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
            progress.write_text(f"{step + 1}\n")
            time.sleep(args.step_sleep)
        dist.barrier()
    except Exception as exc:  # the backend's error: when, and its line
        lines = str(exc).strip().splitlines()
        line = lines[-1] if lines else type(exc).__name__
        partial = args.out / f"rank{rank}.err.partial"  # renamed whole: read whole
        partial.write_text(f"{time.monotonic():.6f}\n{line}\n")
        partial.rename(args.out / f"rank{rank}.err")
        print(f"rank {rank}: {line}", file=sys.stderr, flush=True)
        os._exit(ERROR_EXIT)  # the group is gone: nothing to tear down
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    record = {"world": world, "initial": initial, "state": state, "coordinators": _hosted()}
    torch.save(record, args.out / f"rank{rank}.pt")
    dist.destroy_process_group()
    return 0


def _hosted() -> dict[str, Any]:
    """Which coordinators this rank ran for the world group on the paramsync backend (its
    process group's session; nothing on another backend)."""
    import torch.distributed as dist

    session = getattr(dist.group.WORLD, "session", None)
    if session is None:
        return {}
    root = session.root.root if session.root is not None else None
    return {
        "sub": session.sub.name if session.sub is not None else None,
        "root_hosts": sorted(r.name for r in root.hosts.values()) if root is not None else None,
        "flat": session.coordinator is not None,
    }


# ----------------------------------------------------------------------------- the driver


def torchrun_argv(
    node: int, address: str, endpoint: str, run_id: str, nproc: int, job_args: list[str]
) -> list[str]:
    """The command one host runs: torchrun with c10d rendezvous at ``endpoint``. Node 0 hosts
    the rendezvous store (``is_host``: torch cannot tell that a namespace's address is its
    own), and each node names its address (``--local-addr``): the hosts share one hostname,
    which resolves to loopback, so torchrun's default (the host's FQDN) reaches no other."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
        str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", address, "--max-restarts",
        "0", str(THIS), "job", *job_args,
    ]  # fmt: skip


def job_env(heartbeat_deadline: float | None = None) -> dict[str, str]:
    """This checkout's code first, a fresh secret, no launcher variables of an enclosing run;
    gloo on the namespaces' interface (it would resolve the shared hostname to loopback)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHELASTIC_", "PARAMSYNC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(PARAMSYNC_SECRET=secrets.token_hex(16), OMP_NUM_THREADS="1")
    env["GLOO_SOCKET_IFNAME"] = "eth0"
    if heartbeat_deadline is not None:
        env["PARAMSYNC_HEARTBEAT_DEADLINE"] = f"{heartbeat_deadline:g}"
    return env


class Nodes:
    """The two torchrun agents of one trial, each logging to ``node<i>.log`` in ``out``."""

    def __init__(self, hosts: list[Any], out: Path, env: dict[str, str]) -> None:
        self.hosts, self.out, self.env = hosts, out, env
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self, nproc: int, job_args: list[str], run_id: str, command: Command | None = None
    ) -> None:
        endpoint = f"{self.hosts[0].address}:{RDZV_PORT}"
        for node, host in enumerate(self.hosts):
            if command is None:
                argv = torchrun_argv(node, host.address, endpoint, run_id, nproc, job_args)
            else:
                argv = command(node, [str(THIS), "job", *job_args])
            with open(self.out / f"node{node}.log", "wb") as log:
                self.procs.append(
                    host.popen(argv, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
                )

    def wait(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        return [proc.poll() for proc in self.procs]

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name}:\n{path.read_text(errors='replace')[-3000:]}"
            for path in sorted(self.out.glob("node*.log"))
        )

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def train_on_two_hosts(
    hosts: list[Any],
    out: Path,
    backend: str,
    *,
    steps: int = 8,
    timeout: float = 240.0,
    command: Command | None = None,
    nproc: int = 1,
    env: dict[str, str] | None = None,
) -> list[int | None]:
    """The job on ``backend`` to its end, ``nproc`` ranks a host; each rank's initial and
    final state in ``out/rank<r>.pt``. ``command(node, script)``: the command node ``node``
    runs for the job's ``script`` (argv; default: `torchrun_argv`); ``env``: variables added
    to the job's. Returns the two agents' exit codes (None: still running at the timeout,
    then killed); their logs are ``out/node<i>.log``."""
    out.mkdir(parents=True, exist_ok=True)
    nodes = Nodes(hosts, out, {**job_env(), **(env or {})})
    job_args = ["--backend", backend, "--out", str(out), "--steps", str(steps)]
    try:
        nodes.start(nproc, job_args, f"{backend}-{nproc}", command)
        return nodes.wait(timeout)
    finally:
        nodes.stop()


@dataclass(frozen=True)
class Loss:
    """What the surviving host's ranks saw after the other host died."""

    way: str
    lost: str
    seconds: dict[int, float]
    """Per surviving rank: from the death to its collective's failure."""
    lines: dict[int, str]
    """Per surviving rank: the error it raised."""
    exit_codes: list[int | None]
    """The agents' exit codes (the dead host's: killed, or None when its link went down)."""


def _step(out: Path, rank: int) -> int:
    path = out / f"step{rank}"
    text = path.read_text().strip() if path.exists() else ""
    return int(text) if text else 0


def host_loss_trial(
    hosts: list[Any],
    out: Path,
    *,
    way: str,
    lost: str,
    nproc: int = 1,
    heartbeat_deadline: float = 5.0,
    kill_step: int = 3,
    timeout: float = 240.0,
) -> Loss:
    """Train on the backend, then lose host ``lost`` (``node0`` or ``node1``) the ``way`` asked
    (``kill``: every process in its namespace SIGKILLed; ``link``: its veth brought down) once
    every rank is past ``kill_step``; returns what the other host's ranks said, and when.
    Raises RuntimeError, with the logs, when the survivors never fail or the job never gets
    going."""
    if way not in WAYS or lost not in LOST:
        raise ValueError(f"way must be one of {WAYS} and lost one of {LOST}: {way!r}, {lost!r}")
    out.mkdir(parents=True, exist_ok=True)
    victim = int(lost.removeprefix("node"))
    world = 2 * nproc
    survivors = [r for r in range(world) if r // nproc != victim]
    nodes = Nodes(hosts, out, job_env(heartbeat_deadline))
    job_args = ["--backend", "paramsync", "--out", str(out), "--steps", "100000"]
    job_args += ["--step-sleep", "0.05"]
    try:
        nodes.start(nproc, job_args, f"loss-{way}-{lost}")
        deadline = time.monotonic() + timeout
        while min(_step(out, r) for r in range(world)) < kill_step:
            if time.monotonic() > deadline or any(p.poll() is not None for p in nodes.procs):
                raise RuntimeError(f"the job never reached step {kill_step}\n{nodes.logs()}")
            time.sleep(0.05)
        host = hosts[victim]
        died = time.monotonic()  # before the death: the times measured are never short
        if way == "kill":
            for pid in host.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        else:
            subprocess.run(["ip", "link", "set", host.outer_veth, "down"], check=True)
        errors = [out / f"rank{r}.err" for r in survivors]
        while not all(path.exists() for path in errors):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the survivors never named the loss\n{nodes.logs()}")
            time.sleep(0.05)
        seconds, lines = {}, {}
        for rank, path in zip(survivors, errors, strict=True):
            stamp, line = path.read_text().splitlines()[:2]
            seconds[rank], lines[rank] = float(stamp) - died, line
        try:  # torchrun's agent may wait on for a rendezvous store on the host lost
            nodes.procs[1 - victim].wait(AGENT_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        return Loss(way, lost, seconds, lines, [p.poll() for p in nodes.procs])
    finally:
        nodes.stop()


# ----------------------------------------------------------------------------- the benchmark


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    import tempfile

    from paramsync.runtime.testing.netns import virtual_hosts

    rows = []
    for way in args.ways:
        for lost in args.lost:
            samples: list[float] = []
            lines: list[str] = []
            for round_index in range(args.rounds):
                with (
                    virtual_hosts(2) as hosts,
                    tempfile.TemporaryDirectory(prefix="torchrun-hosts-") as tmp,
                ):
                    loss = host_loss_trial(
                        hosts,
                        Path(tmp),
                        way=way,
                        lost=lost,
                        nproc=args.nproc,
                        heartbeat_deadline=args.heartbeat_deadline,
                        timeout=args.timeout,
                    )
                samples.append(max(loss.seconds.values()))
                lines.extend(loss.lines.values())
                print(
                    f"{way} {lost}: round {round_index + 1}/{args.rounds}: named after "
                    f"{samples[-1]:.2f} s: {lines[-1]}",
                    flush=True,
                )
            rows.append(
                {
                    "way": way,
                    "lost": lost,
                    "heartbeat_deadline": args.heartbeat_deadline,
                    "median_seconds": statistics.median(samples),
                    "max_seconds": max(samples),
                    "samples": samples,
                    "line": lines[-1],
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:
        return job(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--lost", nargs="+", choices=LOST, default=list(LOST))
    parser.add_argument("--nproc", type=int, default=1, help="ranks per host")
    parser.add_argument("--heartbeat-deadline", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per trial")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    from paramsync.runtime.testing.netns import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"torchrun_hosts: cannot run here: {reason}", file=sys.stderr)
        return 2
    rows = measure(args)
    print(f"{'way':>5} {'lost':>6} {'median':>8} {'max':>8}  (heartbeat deadline)")
    for row in rows:
        print(
            f"{row['way']:>5} {row['lost']:>6} {row['median_seconds']:>6.2f} s "
            f"{row['max_seconds']:>6.2f} s  ({row['heartbeat_deadline']:g} s)"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": " ".join([Path(sys.argv[0]).name, *argv]),
            "cpu_count": os.cpu_count(),
            "rows": rows,
        }
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
