"""The ``paramsync`` command line."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from paramsync.runtime.cli.fuzz import add_fuzz_parser
from paramsync.runtime.cli.jobs import DEMO_JOB, JOB_ENV, WorkerJob, job_name, load_job
from paramsync.runtime.config import DATA_PLANE_ENV, add_data_plane_flag

if TYPE_CHECKING:
    from paramsync.runtime.coordinator.core import CoordinatorCore
    from paramsync.runtime.transport.tls import TlsConfig

__all__ = ["main", "build_parser"]

log = logging.getLogger("paramsync.cli")

_UNITS = {
    "": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
}


def parse_size(text: str) -> int:
    """Parse a byte count such as ``4096``, ``64KiB`` or ``16MiB``."""
    raw = text.strip().lower().replace(" ", "")
    digits = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(digits) :]
    if not digits.isdigit() or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4096, 64KiB or 16MiB")
    return int(digits) * _UNITS[unit]


def _add_tls_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "TLS",
        "Encrypt every connection and authenticate it by certificate too (mutual TLS, under "
        "the HMAC handshake). All three or none; each defaults to PARAMSYNC_TLS_CERT, "
        "PARAMSYNC_TLS_KEY, PARAMSYNC_TLS_CA.",
    )
    group.add_argument("--tls-cert", metavar="PEM", help="this node's certificate")
    group.add_argument("--tls-key", metavar="PEM", help="its private key (unencrypted)")
    group.add_argument(
        "--tls-ca", metavar="PEM", help="the CA that signed every node's certificate"
    )


def _add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("metrics (Prometheus; off by default)")
    group.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port)",
    )
    group.add_argument(
        "--metrics-host",
        default="127.0.0.1",  # paramsync.runtime.observe.metrics.DEFAULT_METRICS_HOST
        metavar="HOST",
        help="the address the metrics endpoint listens on (default %(default)s, loopback: the "
        "endpoint is unauthenticated; name another address, e.g. 0.0.0.0, to be scraped from "
        "other hosts)",
    )


def _tls_flags(args: argparse.Namespace) -> dict[str, str | None]:
    return {key: getattr(args, key) for key in ("tls_cert", "tls_key", "tls_ca")}


def build_parser(
    job: WorkerJob | None = None, *, job_flags: bool = True
) -> argparse.ArgumentParser:
    """The argument parser of every ``paramsync`` subcommand; ``worker`` takes ``job``'s flags
    (default: the job $PARAMSYNC_JOB names, else the built-in demo). ``job_flags=False`` (a
    command line that runs no worker) imports no job: the launcher and the coordinator start
    without torch, which only a worker needs."""
    if job is None and job_flags:
        job = load_job(job_name([]))
    parser = argparse.ArgumentParser(
        prog="paramsync",
        description="Async actor-model parameter synchronization for data-parallel PyTorch.",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default INFO)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    allreduce = sub.add_parser(
        "allreduce",
        help="run one rank of an all-reduce check over TCP",
        description="Average a deterministic per-rank tensor over TCP, check the result "
        "against a float64 reference and that every rank holds identical bytes, and report "
        "the bandwidth. Needs PARAMSYNC_SECRET (or PARAMSYNC_SECRET_FILE) on every rank.",
    )
    allreduce.add_argument("--rank", type=int, required=True)
    allreduce.add_argument("--world-size", type=int, required=True)
    allreduce.add_argument(
        "--coordinator", required=True, help="host:port where rank 0 listens for the rendezvous"
    )
    allreduce.add_argument("--size", type=parse_size, default=16 << 20, help="bytes (float32)")
    allreduce.add_argument("--repeats", type=int, default=5)
    allreduce.add_argument("--summary-json", help="write this rank's result here")
    _add_tls_flags(allreduce)

    coordinator = sub.add_parser(
        "coordinator",
        help="run the coordinator daemon of one training run",
        description="Admit authenticated workers, sequence every all-reduce and check that all "
        "workers hold identical weights after every step (C-DDP-001). Exit codes: 0 the run "
        "finished, 1 the run was aborted (the log says why), 2 bad configuration, 130/143 "
        "stopped by SIGINT/SIGTERM.",
    )
    coordinator.add_argument("--world-size", type=int, required=True)
    _add_tls_flags(coordinator)
    coordinator.add_argument(
        "--bind", default="127.0.0.1:29500", help="host:port to listen on (default %(default)s)"
    )
    coordinator.add_argument("--digest-interval", type=int, default=1)
    coordinator.add_argument("--heartbeat-deadline", type=float, default=10.0)
    coordinator.add_argument(
        "--resync", action="store_true", help="re-sync a diverged minority instead of aborting"
    )
    coordinator.add_argument(
        "--port-file", help="write the bound port here once listening (for --bind host:0)"
    )
    elastic = coordinator.add_argument_group("fault tolerance")
    elastic.add_argument(
        "--min-workers",
        type=int,
        help="keep training while at least this many workers remain (default: all; fewer "
        "makes the run elastic: a lost worker ends its epoch, not the run)",
    )
    elastic.add_argument(
        "--rejoin-seconds",
        type=float,
        default=60.0,
        help="below --min-workers, wait this long for joiners, then stop (default %(default)s)",
    )
    elastic.add_argument(
        "--rendezvous-seconds",
        type=float,
        default=5.0,
        help="elastic restart: start with --min-workers once nobody joined for this long",
    )
    elastic.add_argument(
        "--stall-seconds",
        type=float,
        default=60.0,
        help="report the ranks and phase a step waits for after this long (default %(default)s)",
    )
    elastic.add_argument(
        "--stall-deadline",
        type=float,
        help="then drop the stalled ranks (elastic) or stop the run (default: report only)",
    )
    coordinator.add_argument(
        "--handshake-seconds",
        type=float,
        default=10.0,
        help="deadline of one connection's handshake, from its accept (default %(default)s)",
    )
    _add_metrics_flags(coordinator)
    coordinator.add_argument(
        "--max-pending-handshakes",
        type=int,
        default=64,
        help="handshakes in progress at once; more connections are refused at once "
        "(default %(default)s)",
    )
    tree = coordinator.add_argument_group(
        "coordinator tree (paramsync launch --nnodes > 1 starts these)"
    )
    tree.add_argument(
        "--tree",
        choices=["root", "host"],
        help="root: the tree's root, which the hosts' sub-coordinators dial (it sees hosts, "
        "not workers); host: one host's sub-coordinator, which its workers dial as they dial "
        "a coordinator (default: the flat coordinator)",
    )
    tree.add_argument("--root", metavar="HOST:PORT", help="--tree host: the root's address")
    tree.add_argument("--host-index", type=int, help="--tree host: this host's index (its node)")
    tree.add_argument(
        "--host-ranks", metavar="A-B", help="--tree host: the world ranks of its workers"
    )
    tree.add_argument("--host-name", help="--tree host: its name in messages (default: nodeI)")

    worker = sub.add_parser(
        "worker",
        help="run one worker of a training job (default: the built-in LM demo)",
        description="Join a run (flags > torchrun variables RANK/WORLD_SIZE/LOCAL_RANK/"
        "MASTER_ADDR/MASTER_PORT > --config TOML) and train the character-level transformer "
        "on CPython's sources. Exit codes: 0 finished, 1 failed, 2 bad configuration, "
        "130/143 stopped by SIGINT/SIGTERM after the step in flight.",
    )
    worker.add_argument("--rank", type=int)
    worker.add_argument("--world-size", type=int)
    worker.add_argument("--local-rank", type=int)
    worker.add_argument("--coordinator", help="host:port of the coordinator")
    worker.add_argument(
        "--role",
        choices=["worker", "coordinator"],
        help="coordinator: also host the coordinator in this process (default: worker, a "
        "coordinator runs elsewhere; under torchrun rank 0 hosts it, like a script's rank 0)",
    )
    _add_tls_flags(worker)
    _add_metrics_flags(worker)
    add_data_plane_flag(worker)
    worker.add_argument(
        "--job",
        default=job.name if job is not None else job_name([]),
        help="module of the job to run: build_parser(parser) and async run(args) "
        f"(default: ${JOB_ENV} or the built-in demo, {DEMO_JOB})",
    )
    if job is not None:
        job.build_parser(worker)

    launch = sub.add_parser(
        "launch",
        help="start a coordinator and N workers on this machine, or one node of several",
        description="Start a coordinator process and N worker processes running SCRIPT (or "
        "-m MODULE) with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and a fresh "
        "PARAMSYNC_SECRET set. Signals are forwarded; when a worker fails the whole run is "
        "stopped and the failed rank named (or, with --max-restarts, the worker is started "
        "again and rejoins). Several nodes: run it on each with --nnodes N --node-rank R "
        "--coordinator HOST:PORT (node 0's address) and the same PARAMSYNC_SECRET; node R runs "
        "ranks R*K..R*K+K-1, node 0 also the coordinator.",
    )
    launch.add_argument(
        "--nproc",
        "--nproc-per-node",
        dest="nproc",
        type=int,
        required=True,
        help="number of workers on this node",
    )
    launch.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    launch.add_argument(
        "--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1 (default 0)"
    )
    launch.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="where the coordinator listens: an address of node 0 that every node reaches "
        "(port default 29500); node 0 binds it. One node: default 127.0.0.1 and a free port",
    )
    launch.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT", help="torchrun's name for --coordinator"
    )
    launch.add_argument(
        "--master-addr", metavar="HOST", help="torchrun's name for --coordinator's HOST"
    )
    launch.add_argument(
        "--master-port", type=int, default=0, help="the coordinator's port (0: pick a free port)"
    )
    launch.add_argument(
        "--coordinator-kind",
        choices=["auto", "flat", "tree"],
        help="tree: a sub-coordinator on every node, which the node's workers dial, under a "
        "root on node 0 (at --coordinator); flat: one coordinator for every worker; auto "
        "(default, or $PARAMSYNC_COORDINATOR_KIND): tree when --nnodes > 1 without "
        "--max-restarts (a worker restarted alone cannot rejoin the tree) or --no-coordinator "
        "(one started by hand is flat unless started with --tree root), else flat; the "
        "workers get it in $PARAMSYNC_COORDINATOR_KIND (the torch backend's other groups)",
    )
    launch.add_argument(
        "--no-coordinator",
        action="store_true",
        help="the coordinator runs elsewhere (paramsync coordinator --bind HOST:PORT): node 0 "
        "starts workers only",
    )
    launch.add_argument(
        "--advertise-addr",
        "--host",
        dest="advertise_addr",
        metavar="HOST",
        help="the address this node's workers listen on and give their peers (default: the "
        "address of the interface that reaches the coordinator)",
    )
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="start a failed worker again, up to this many times on this node; it rejoins "
        "the run live (makes the run elastic, see --min-workers; default %(default)s)",
    )
    launch.add_argument(
        "--min-workers",
        type=int,
        help="the coordinator's --min-workers (default: all; with --max-restarts all but "
        "one node's workers, or all but one on a single node)",
    )
    launch.add_argument(
        "--rejoin-seconds",
        type=float,
        default=120.0,
        help="elastic runs: below --min-workers, wait this long for joiners (default %(default)s)",
    )
    launch.add_argument(
        "--rendezvous-seconds",
        type=float,
        default=120.0,
        help="elastic runs: start without the ranks still missing once nobody joined for "
        "this long (default %(default)s)",
    )
    launch.add_argument(
        "--run-id",
        help="the run id every rank records (default: $PARAMSYNC_RUN_ID; else a random one: "
        "on one node the launcher's, on several the coordinator's, which it tells every worker)",
    )
    launch.add_argument("--summary-json", help="write every rank's summary here")
    launch.add_argument("--digest-interval", type=int, default=1)
    launch.add_argument("--heartbeat-deadline", type=float, default=10.0)
    launch.add_argument("program", nargs=argparse.REMAINDER, help="[--] SCRIPT|-m MODULE [ARGS]")

    sub.add_parser(
        "secret",
        help="print a fresh random shared secret",
        description="Print a fresh random shared secret (32 random bytes, URL-safe base64: 43 "
        "characters) for PARAMSYNC_SECRET, e.g. export PARAMSYNC_SECRET=$(paramsync secret), "
        "or for a file PARAMSYNC_SECRET_FILE names (paramsync secret > secret; chmod 600 "
        "secret). Every process of a run must hold the same one.",
    )
    add_fuzz_parser(sub)
    return parser


def _run_allreduce(args: argparse.Namespace, tls: TlsConfig | None) -> int:
    import torch
    import trio

    from paramsync.runtime.collectives.ring import all_gather, all_reduce, barrier
    from paramsync.runtime.config import DistributedConfig
    from paramsync.runtime.protocol.wire import tensor_buffer
    from paramsync.runtime.transport.tcp import TcpTransport

    config = DistributedConfig(args.world_size, args.rank, args.coordinator)
    numel = args.size // 4

    def rank_tensor(rank: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 + rank)
        return torch.randn(numel, generator=gen, dtype=torch.float32)

    async def main() -> dict:
        async with TcpTransport.connect(config, tls=tls) as transport:
            tensor = rank_tensor(config.rank)
            await all_reduce(transport, tensor, "avg")
            reference = torch.stack([rank_tensor(r).double() for r in range(config.world_size)])
            reference = reference.sum(0) / config.world_size
            max_error = float((tensor.double() - reference).abs().max()) if numel else 0.0
            digest = hashlib.sha256(tensor_buffer(tensor)).digest()
            token = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
            digests = await all_gather(transport, token)
            identical = bool((digests == digests[0]).all())
            times = []
            for _ in range(args.repeats):
                await barrier(transport)
                start = time.perf_counter()
                await all_reduce(transport, tensor, "avg")
                times.append(time.perf_counter() - start)
            await barrier(transport)
        seconds = sorted(times)[len(times) // 2] if times else float("nan")
        n = config.world_size
        algbw = args.size / seconds / 1e9
        return {
            "rank": config.rank,
            "world_size": n,
            "bytes": args.size,
            "max_abs_error": max_error,
            "identical_on_all_ranks": identical,
            "median_seconds": seconds,
            "algbw_GBps": algbw,
            "busbw_GBps": algbw * 2 * (n - 1) / n,
            "digest": digest.hex(),
        }

    result = trio.run(main)
    ok = result["identical_on_all_ranks"] and result["max_abs_error"] < 1e-5
    if args.summary_json:
        with open(args.summary_json, "w") as handle:
            json.dump(result, handle, indent=2)
    if config.rank == 0 or not ok:
        print(json.dumps(result), flush=True)
    return 0 if ok else 3


def main(
    argv: Sequence[str] | None = None, *, coordinator_core: type[CoordinatorCore] | None = None
) -> int:
    """Entry point of the ``paramsync`` console script; returns the exit code.

    ``coordinator_core``: the class of the core ``paramsync coordinator`` builds (default
    `CoordinatorCore`; the fault harness passes a subclass,
    `paramsync.runtime.testing.faulty_daemon`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        job = load_job(job_name(argv)) if "worker" in argv else None
    except ValueError as exc:
        print(f"paramsync: {exc}", file=sys.stderr)
        return 2
    parser = build_parser(job, job_flags=job is not None)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.log_level != "DEBUG":  # a redial while the coordinator starts is routine
        logging.getLogger("stamina").setLevel(logging.ERROR)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "secret":
        from paramsync.runtime.protocol.handshake import new_secret

        print(new_secret(), flush=True)
        return 0
    if args.command in ("allreduce", "coordinator"):
        from paramsync.runtime.train_config import resolve_tls

        try:
            args.tls = resolve_tls(_tls_flags(args))
        except ValueError as exc:
            log.error("bad configuration: %s", exc)
            return 2
    if args.command == "allreduce":
        return _run_allreduce(args, args.tls)
    if args.command == "coordinator":
        from paramsync.runtime.cli.daemons import run_coordinator

        if coordinator_core is None:
            return run_coordinator(args)
        return run_coordinator(args, core_type=coordinator_core)
    if args.command == "worker":
        from paramsync.runtime.cli.daemons import run_worker
        from paramsync.runtime.train_config import TLS_ENV_VARS

        for key, value in _tls_flags(args).items():  # read back by DistributedTrainConfig
            if value is not None:
                os.environ[TLS_ENV_VARS[key]] = value
        if args.data_plane is not None:  # read back the same way
            os.environ[DATA_PLANE_ENV] = args.data_plane

        assert job is not None  # "worker" is in argv
        return run_worker(args, job)
    if args.command == "launch":
        from paramsync.runtime.cli.launch import run_launch

        return run_launch(args)
    if args.command == "fuzz":
        from paramsync.runtime.cli.fuzz import run_fuzz

        return run_fuzz(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
