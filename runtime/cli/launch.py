"""``paramsync launch``: a coordinator and N workers on this machine, or one node of many.

The launcher owns its children: it forwards SIGINT and SIGTERM to all of them, and when one
worker fails it stops the others and exits non-zero naming the failed rank, so a run never
half-survives. Each worker gets torchrun's variables and a fresh shared secret.

Multi-node (`LaunchPlan`): ``--nnodes N --node-rank R --coordinator HOST:PORT
--nproc-per-node K`` starts ranks R*K .. R*K+K-1 on this node; node 0 also runs the coordinator
daemon, bound to HOST:PORT (HOST must be an address of node 0 that the other nodes reach),
unless ``--no-coordinator`` says it runs elsewhere (``paramsync coordinator --bind`` on a
machine of its own). Every node must hold the same secret ($PARAMSYNC_SECRET or
$PARAMSYNC_SECRET_FILE). Workers dial the coordinator at HOST, so they listen for their peers on
the interface that reaches it, or on ``--advertise-addr`` ($PARAMSYNC_ADVERTISE_ADDR).

The coordinator tree (``--coordinator-kind tree``, the default for ``--nnodes > 1`` without
``--max-restarts`` or ``--no-coordinator``): every node also runs a sub-coordinator on its own
address; the node's workers dial it as they dial a coordinator, and it dials the root at
HOST:PORT (node 0's root daemon, started in the coordinator's place), so the root sees one link
and one report per node, not one per worker. ``--coordinator-kind flat`` (or
$PARAMSYNC_COORDINATOR_KIND) keeps one coordinator for all workers, the default on one node;
``tree`` forces the tree, one node included. In an elastic tree run a node's failed
sub-coordinator is started again at its address (up to `SUB_RESTARTS` times): its workers
redial it and the host rejoins the run.

``--max-restarts M``: a worker that fails is started again, with its rank, up to M times on
this node, and rejoins the running run live (the coordinator is then elastic: the survivors
go on in a new epoch, and the restarted worker receives their whole state). Only the failed
process is restarted, not the node's whole group as torchrun does: paramsync's epochs survive
a lost member, and the node's healthy workers keep the state a restart needs.
"""

from __future__ import annotations

import argparse
import ipaddress
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paramsync.runtime.config import ADVERTISE_ENV, advertised_host, parse_address
from paramsync.runtime.errors import one_line
from paramsync.runtime.protocol.handshake import SECRET_ENV, SECRET_FILE_ENV
from paramsync.runtime.train_config import DEFAULT_COORDINATOR_PORT, shared_secret

__all__ = [
    "LaunchPlan",
    "RESTART_COUNT_ENV",
    "COORDINATOR_KIND_ENV",
    "run_launch",
    "merge_summaries",
    "free_port",
]

SUB_RESTARTS = 3
"""How many times the launcher starts a node's failed sub-coordinator again in an elastic run
(its workers redial it and rejoin; a static run stops when a host is lost)."""

COORDINATOR_KIND_ENV = "PARAMSYNC_COORDINATOR_KIND"
"""``flat``, ``tree`` or ``auto`` (the default): ``paramsync launch --coordinator-kind``."""

RESTART_COUNT_ENV = "PARAMSYNC_RESTART_COUNT"
"""How many times ``paramsync launch --max-restarts`` restarted this worker (0: first start),
like torchrun's TORCHELASTIC_RESTART_COUNT."""

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


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class LaunchPlan:
    """What this node of a launch runs: its ranks, the coordinator's address, and whether it
    hosts the coordinator. Built from the flags by `LaunchPlan.from_args`, which checks them."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    host: str
    """Where the coordinator listens (node 0's address; 127.0.0.1 for a one-node run)."""
    port: int
    """Its port; 0 on one node: pick a free one."""
    hosts_coordinator: bool
    advertise: str | None
    max_restarts: int
    min_workers: int | None
    """The coordinator's ``--min-workers`` (None: all, a static run)."""
    tree: bool = False
    """Whether the run uses the coordinator tree: a sub-coordinator on every node, the root
    on node 0 (in the flat coordinator's place)."""
    coordinator_kind: str = "auto"
    """``--coordinator-kind`` (or $PARAMSYNC_COORDINATOR_KIND) as asked: the workers get it
    in $PARAMSYNC_COORDINATOR_KIND, so the process groups a script makes besides the world's
    (each hosting its own coordinators, `paramsync.actors.torch_backend.tree`) follow it."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def ranks(self) -> range:
        """The global ranks this node starts."""
        first = self.node_rank * self.nproc_per_node
        return range(first, first + self.nproc_per_node)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LaunchPlan:
        """Check the flags; a bad one is a ``ValueError`` naming it."""
        nproc, nnodes, node_rank = args.nproc, args.nnodes, args.node_rank
        if nproc is None or nproc < 1:
            raise ValueError(f"--nproc-per-node (--nproc) must be at least 1, got {nproc}")
        if nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1, got {nnodes}")
        if not 0 <= node_rank < nnodes:
            raise ValueError(
                f"--node-rank must be in 0..{nnodes - 1} (--nnodes {nnodes}), got {node_rank}"
            )
        if args.max_restarts < 0:
            raise ValueError(f"--max-restarts must be at least 0, got {args.max_restarts}")
        if not 0 <= args.master_port <= 65535:
            raise ValueError(f"--master-port must be a TCP port (0-65535), got {args.master_port}")
        given = [
            flag
            for flag, value in (
                ("--coordinator", args.coordinator),
                ("--rdzv-endpoint", args.rdzv_endpoint),
            )
            if value
        ]
        if len(given) > 1 and args.coordinator != args.rdzv_endpoint:
            raise ValueError("--coordinator and --rdzv-endpoint name two addresses: give one")
        endpoint = args.coordinator or args.rdzv_endpoint
        if endpoint and (args.master_addr or args.master_port):
            raise ValueError(f"{given[0]} and --master-addr/--master-port both given: give one")
        if endpoint:
            try:
                host, port = parse_address(endpoint, default_port=DEFAULT_COORDINATOR_PORT)
            except ValueError as exc:
                raise ValueError(f"{given[0]}: {exc}") from None
        else:
            host = args.master_addr or "127.0.0.1"
            port = args.master_port
        if nnodes > 1:
            if not (endpoint or args.master_addr):
                raise ValueError(
                    "--nnodes > 1 needs the coordinator's address: --coordinator HOST:PORT "
                    "(HOST: an address of node 0 that every node reaches)"
                )
            if _is_loopback(host):
                raise ValueError(
                    f"--nnodes {nnodes}: the coordinator address {host} is loopback, which the "
                    "other nodes cannot reach: give node 0's network address"
                )
            port = port or DEFAULT_COORDINATOR_PORT
        world = nnodes * nproc
        min_workers = args.min_workers
        if min_workers is not None and not 1 <= min_workers <= world:
            raise ValueError(f"--min-workers must be in 1..{world}, got {min_workers}")
        if min_workers is None and args.max_restarts > 0 and world > 1:
            # Elastic, so a failed worker's loss ends its epoch, not the run: it rejoins.
            min_workers = max(1, world - nproc) if nnodes > 1 else world - 1
        if args.advertise_addr:
            advertised_host({ADVERTISE_ENV: args.advertise_addr})  # a ValueError naming it
        kind = args.coordinator_kind or os.environ.get(COORDINATOR_KIND_ENV, "").strip() or "auto"
        if kind not in ("auto", "flat", "tree"):
            raise ValueError(
                f"--coordinator-kind (or ${COORDINATOR_KIND_ENV}) must be auto, flat or tree, "
                f"got {kind!r}"
            )
        if kind == "tree" and args.max_restarts > 0:
            raise ValueError(
                "--coordinator-kind tree does not take --max-restarts: a worker restarted "
                "alone cannot rejoin the coordinator tree (use --coordinator-kind flat)"
            )
        return cls(
            nnodes=nnodes,
            node_rank=node_rank,
            nproc_per_node=nproc,
            host=host,
            port=port,
            hosts_coordinator=node_rank == 0 and not args.no_coordinator,
            advertise=args.advertise_addr,
            max_restarts=args.max_restarts,
            min_workers=min_workers,
            # A coordinator started by hand (--no-coordinator) is flat unless it was started
            # as the tree's root (--tree root): only ``tree`` asks for that.
            tree=kind == "tree"
            or (
                kind == "auto" and nnodes > 1 and args.max_restarts == 0 and not args.no_coordinator
            ),
            coordinator_kind=kind,
        )


def _run_id(plan: LaunchPlan) -> str | None:
    """The run id to give every process of this node: $PARAMSYNC_RUN_ID (or --run-id); one
    node: a random one (its coordinator and workers share it); several: None, and the
    coordinator picks a random one and tells every worker in its ``start_run``, so the nodes
    agree without anything derived from the secret."""
    given = os.environ.get("PARAMSYNC_RUN_ID")
    if given:
        return given
    return secrets.token_hex(8) if plan.nnodes == 1 else None


def run_launch(args: argparse.Namespace) -> int:
    """Run the launch; returns its exit code: 1 when a worker failed, 2 on a bad
    configuration (the launcher's own, e.g. a secret too short, or a worker's that exited 2).

    The secret: $PARAMSYNC_SECRET or $PARAMSYNC_SECRET_FILE as the user set them (checked
    first), else (one node only) a fresh one in every child's environment."""
    try:
        command = _command(list(args.program))
        plan = LaunchPlan.from_args(args)
        given_secret = bool(os.environ.get(SECRET_ENV) or os.environ.get(SECRET_FILE_ENV))
        if given_secret:
            shared_secret()  # the user's secret must work before N processes find out it does not
        elif plan.nnodes > 1:
            raise ValueError(
                f"a multi-node run needs one shared secret on every node: set {SECRET_ENV} "
                f"(or {SECRET_FILE_ENV}) to the same value on each (paramsync secret makes one)"
            )
    except ValueError as exc:
        log.error("bad configuration: %s", one_line(exc))
        return EXIT_USAGE
    if args.run_id:
        os.environ["PARAMSYNC_RUN_ID"] = args.run_id
    port = plan.port or free_port()
    # torchrun's variables of an enclosing run would send the children to its store.
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    if not given_secret:  # a fresh one for this run; the user's own (variable or file) as it is
        base[SECRET_ENV] = secrets.token_hex(16)
    run_id = _run_id(plan)
    if run_id is not None:
        # One run id for every rank: jobs record it in their checkpoints (a resume refuses
        # another run's). Without one, workers take the coordinator's.
        base["PARAMSYNC_RUN_ID"] = run_id
    base.update(
        MASTER_ADDR=plan.host,
        # One node: MASTER_PORT is left to torch.distributed (a script that calls
        # init_process_group binds its store there), the coordinator has its own variable.
        MASTER_PORT=str(port if plan.nnodes > 1 else free_port()),
        PARAMSYNC_COORDINATOR_ADDR=f"[{plan.host}]:{port}"
        if ":" in plan.host
        else f"{plan.host}:{port}",
        WORLD_SIZE=str(plan.world_size),
        LOCAL_WORLD_SIZE=str(plan.nproc_per_node),
        GROUP_RANK=str(plan.node_rank),
        NODE_RANK=str(plan.node_rank),
        PARAMSYNC_ROLE="worker",
        **{COORDINATOR_KIND_ENV: plan.coordinator_kind},
    )
    if plan.advertise:
        base[ADVERTISE_ENV] = plan.advertise
    sub_address: tuple[str, int] | None = None
    if plan.tree:  # the node's workers dial its sub-coordinator, on the node's own address
        sub_address = (plan.advertise or _address_towards(plan.host), free_port())
        base["PARAMSYNC_COORDINATOR_ADDR"] = _host_port(*sub_address)
    # Like torchrun: one intra-op thread per worker unless the user says otherwise, so N
    # workers do not oversubscribe the machine's cores.
    base.setdefault("OMP_NUM_THREADS", "1")
    base.setdefault(
        "PARAMSYNC_LOG_LEVEL", logging.getLevelName(logging.getLogger().getEffectiveLevel())
    )
    summary_dir = Path(tempfile.mkdtemp(prefix="paramsync-launch-"))
    daemons: list[subprocess.Popen[bytes]] = []
    if plan.hosts_coordinator:
        root = ["--tree", "root"] if plan.tree else []
        daemons.append(_start_coordinator(args, plan, _host_port(plan.host, port), base, root))
    host_flags: list[str] = []
    if sub_address is not None:
        first = plan.ranks[0]
        host_flags = [
            "--tree", "host", "--root", _host_port(plan.host, port),
            "--host-index", str(plan.node_rank),
            "--host-ranks", f"{first}-{first + plan.nproc_per_node - 1}",
        ]  # fmt: skip
        daemons.append(_start_coordinator(args, plan, _host_port(*sub_address), base, host_flags))
    names = dict(zip((d.pid for d in daemons), _daemon_names(plan), strict=False))
    envs: dict[int, dict[str, str]] = {}
    workers: dict[int, subprocess.Popen[bytes]] = {}
    for local, rank in enumerate(plan.ranks):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(local), **{RESTART_COUNT_ENV: "0"})
        if args.summary_json:
            env["PARAMSYNC_SUMMARY_JSON"] = str(summary_dir / f"rank{rank}.json")
        envs[rank] = env
        workers[rank] = subprocess.Popen(command, env=env)
    log.info(
        "node %d of %d: launched %s%d workers (ranks %d-%d of %d), coordinator at %s:%d",
        plan.node_rank,
        plan.nnodes,
        "".join(f"{names[d.pid]} (pid {d.pid}) and " for d in daemons),
        plan.nproc_per_node,
        plan.ranks[0],
        plan.ranks[-1],
        plan.world_size,
        plan.host,
        port,
    )
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        for proc in [*daemons, *workers.values()]:
            if proc.poll() is None:
                proc.send_signal(signum)

    sub_restarts: list[int] = []

    def restart_daemon(proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes] | None:
        """This node's sub-coordinator failed: in an elastic run, start it again at its
        address (up to `SUB_RESTARTS` times); its workers redial it and rejoin the run."""
        elastic = plan.min_workers is not None and plan.min_workers < plan.world_size
        if sub_address is None or proc is not daemons[-1] or not elastic:
            return None
        if len(sub_restarts) >= SUB_RESTARTS:
            return None
        sub_restarts.append(proc.pid)
        log.warning(
            "%s (pid %d) failed with exit code %s: restarting it (restart %d of %d); its "
            "workers rejoin the run",
            names[proc.pid],
            proc.pid,
            proc.returncode,
            len(sub_restarts),
            SUB_RESTARTS,
        )
        again = _start_coordinator(args, plan, _host_port(*sub_address), base, host_flags)
        names[again.pid] = names[proc.pid]
        return again

    def restart(rank: int) -> subprocess.Popen[bytes]:
        env = envs[rank]
        env[RESTART_COUNT_ENV] = str(int(env[RESTART_COUNT_ENV]) + 1)
        proc = subprocess.Popen(command, env=env)
        workers[rank] = proc
        return proc

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        failed = _supervise(workers, daemons, restart, plan.max_restarts, received, restart_daemon)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failed is None:
        for daemon in daemons:
            try:
                daemon.wait(timeout=_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                daemon.terminate()
                daemon.wait()
    else:
        _stop_all([*daemons, *workers.values()])
    code = 0
    if received:
        code = 128 + received[0]
    elif failed is not None:
        rank, proc = failed
        who = (
            f"worker rank {rank} (pid {proc.pid})"
            if rank >= 0
            else f"{names.get(proc.pid, 'the coordinator')} (pid {proc.pid})"
        )
        if proc.returncode == EXIT_USAGE:
            log.error(
                "%s exited with code 2, bad configuration (its line above): stopped the run", who
            )
            code = EXIT_USAGE
        else:
            restarts = f" after {plan.max_restarts} restart(s)" if plan.max_restarts else ""
            log.error(
                "%s failed with exit code %s%s: stopped the run", who, proc.returncode, restarts
            )
            code = 1
    elif any(daemon.returncode for daemon in daemons):
        for daemon in daemons:
            if daemon.returncode:
                log.error("%s exited with code %d", names[daemon.pid], daemon.returncode)
        code = 1
    if args.summary_json and code == 0:
        summaries = [json.loads(p.read_text()) for p in sorted(summary_dir.glob("rank*.json"))]
        target = Path(args.summary_json)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(merge_summaries(summaries), indent=2))
        log.info("wrote the run summary to %s", target)
    return code


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _address_towards(host: str) -> str:
    """This machine's address on the interface that reaches ``host`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        address: str = probe.getsockname()[0]
    return address


def _start_coordinator(
    args: argparse.Namespace,
    plan: LaunchPlan,
    bind: str,
    env: dict[str, str],
    tree: list[str] | None = None,
) -> subprocess.Popen[bytes]:
    """A coordinator daemon of the run, listening at ``bind``: the flat coordinator, or with
    ``tree`` flags the coordinator tree's root or this node's sub-coordinator."""
    command = [
        sys.executable, "-m", "paramsync.runtime.cli.main",
        "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel()),
        "coordinator", "--world-size", str(plan.world_size), "--bind", bind,
        "--digest-interval", str(args.digest_interval),
        "--heartbeat-deadline", str(args.heartbeat_deadline),
    ]  # fmt: skip
    if plan.min_workers is not None and plan.min_workers < plan.world_size:
        command += [
            "--min-workers", str(plan.min_workers),
            "--rejoin-seconds", str(args.rejoin_seconds),
            # Start only when every rank has joined, unless nobody joins for this long: a
            # node that starts late is not left out of the first epoch.
            "--rendezvous-seconds", str(args.rendezvous_seconds),
        ]  # fmt: skip
    return subprocess.Popen(command + (tree or []), env=env)


def _daemon_names(plan: LaunchPlan) -> list[str]:
    """What the log calls each daemon this node starts, in the order it starts them."""
    if not plan.tree:
        return ["the coordinator"]
    sub = f"node {plan.node_rank}'s sub-coordinator"
    return ["the root coordinator", sub] if plan.hosts_coordinator else [sub]


def _supervise(
    workers: dict[int, subprocess.Popen[bytes]],
    coordinators: list[subprocess.Popen[bytes]],
    restart: Any = None,
    max_restarts: int = 0,
    stopping: list[int] | None = None,
    restart_daemon: Callable[[subprocess.Popen[bytes]], subprocess.Popen[bytes] | None]
    | None = None,
) -> tuple[int, subprocess.Popen[bytes]] | None:
    """Wait for every worker; return the first that failed for good (rank -1: a coordinator
    daemon, which fails the run while workers still run). A failed worker is started again by
    ``restart(rank)`` while fewer than ``max_restarts`` restarts were made (none once a signal
    is in ``stopping``); a failed coordinator daemon, by ``restart_daemon(proc)`` when it
    returns a new process (None: the run fails)."""
    pending = dict(workers)
    restarts = 0
    while pending:
        for rank, proc in list(pending.items()):
            code = proc.poll()
            if code is None:
                continue
            del pending[rank]
            if code == 0:
                continue
            if code != EXIT_USAGE and restarts < max_restarts and not stopping:
                restarts += 1
                log.warning(
                    "worker rank %d (pid %d) failed with exit code %s: restarting it "
                    "(restart %d of %d); it rejoins the run",
                    rank,
                    proc.pid,
                    code,
                    restarts,
                    max_restarts,
                )
                pending[rank] = restart(rank)
                continue
            return rank, proc
        for index, coordinator in enumerate(coordinators):
            code = coordinator.poll()
            if code not in (None, 0) and pending:
                again = None
                if restart_daemon is not None and code != EXIT_USAGE and not stopping:
                    again = restart_daemon(coordinator)
                if again is None:
                    return -1, coordinator
                coordinators[index] = again
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
