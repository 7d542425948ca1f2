"""The long-lived daemons behind ``paramsync coordinator`` and ``paramsync worker``."""

from __future__ import annotations

import argparse
import logging
import signal
import socket

import trio

from paramsync.runtime.cli.jobs import WorkerJob
from paramsync.runtime.cli.torchrun import TorchrunEnv, run_id_from_env
from paramsync.runtime.config import parse_address
from paramsync.runtime.coordinator.core import CoordinatorCore
from paramsync.runtime.coordinator.service import Coordinator, CoordinatorOptions, RunFailed
from paramsync.runtime.coordinator.tree_service import RootCoordinator, SubCoordinator
from paramsync.runtime.errors import ParamsyncError, configuration_error, one_line, pick_error
from paramsync.runtime.observe.metrics import (
    METRICS_HOST_ENV,
    METRICS_PORT_ENV,
    Metrics,
    check_port,
    serve_metrics,
)
from paramsync.runtime.train_config import shared_secret
from paramsync.runtime.transport.admission import AdmissionLimits

__all__ = [
    "run_coordinator",
    "run_worker",
    "parse_ranks",
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_USAGE",
]

log = logging.getLogger("paramsync.daemon")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
_SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


def parse_ranks(text: str, world_size: int) -> tuple[int, ...]:
    """``--host-ranks``: ``A-B`` (A to B) or ``a,b,c``; a ValueError naming the flag."""
    try:
        if "-" in text:
            first, _, last = text.partition("-")
            ranks = tuple(range(int(first), int(last) + 1))
        else:
            ranks = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--host-ranks {text!r}: expected A-B or a,b,c (world ranks)") from None
    if not ranks or not all(0 <= r < world_size for r in ranks):
        raise ValueError(f"--host-ranks {text!r}: not ranks of 0..{world_size - 1}")
    return ranks


def _tree_coordinator(
    args: argparse.Namespace, options: CoordinatorOptions, metrics: Metrics | None
) -> Coordinator | None:
    """The coordinator tree's root or a host's sub-coordinator, as ``--tree`` says (None:
    the flat coordinator)."""
    tree = getattr(args, "tree", None)
    if tree == "root":
        return RootCoordinator(args.world_size, options, secret=shared_secret(), metrics=metrics)
    if tree != "host":
        return None
    if args.root is None or args.host_index is None or args.host_ranks is None:
        raise ValueError("--tree host needs --root HOST:PORT, --host-index and --host-ranks")
    parse_address(args.root)  # a ValueError naming it
    if not 0 <= args.host_index < args.world_size:
        raise ValueError(f"--host-index must be in 0..{args.world_size - 1}, got {args.host_index}")
    name = args.host_name or f"node{args.host_index} ({socket.gethostname()})"
    ranks = parse_ranks(args.host_ranks, args.world_size)
    return SubCoordinator(
        args.world_size,
        name,
        args.host_index,
        ranks,
        options,
        secret=shared_secret(),
        metrics=metrics,
    )


def run_coordinator(
    args: argparse.Namespace, *, core_type: type[CoordinatorCore] = CoordinatorCore
) -> int:
    """Serve one run until it finishes, aborts, or a signal stops it; returns the exit code.
    ``core_type``: the class of the coordinator's core (`Coordinator`'s ``core_type``).
    ``--tree root``: the coordinator tree's root (its peers are the hosts' sub-coordinators);
    ``--tree host``: a host's sub-coordinator, which dials the root at ``--root``."""
    try:
        host, port = parse_address(args.bind)
        options = CoordinatorOptions(
            digest_interval=args.digest_interval,
            resync=args.resync,
            heartbeat_deadline=args.heartbeat_deadline,
            min_workers=args.min_workers,
            rejoin_seconds=args.rejoin_seconds,
            rendezvous_seconds=args.rendezvous_seconds,
            stall_seconds=args.stall_seconds,
            stall_deadline=args.stall_deadline,
            run_id=run_id_from_env(),  # $PARAMSYNC_RUN_ID (launch, --run-id), else random
        )
        metrics_port = getattr(args, "metrics_port", None)
        if metrics_port is not None:
            check_port(metrics_port, "--metrics-port")
        metrics = Metrics("coordinator") if metrics_port is not None else None
        coordinator = _tree_coordinator(args, options, metrics) or Coordinator(
            args.world_size,
            options,
            secret=shared_secret(),
            metrics=metrics,
            core_type=core_type,
        )
        coordinator.admission.limits = AdmissionLimits(
            max_pending=args.max_pending_handshakes, handshake_seconds=args.handshake_seconds
        )
    except ValueError as exc:  # no secret, a bad --bind or --world-size, ...
        log.error("bad configuration: %s", one_line(exc))
        return EXIT_USAGE
    stopped: list[int] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        stopped.append(signum)
                        name = signal.Signals(signum).name
                        log.warning("%s: stopping the run", name)
                        coordinator.stop(f"the coordinator was stopped by {name}")

            nursery.start_soon(watch)

            async def serve(*, task_status: trio.TaskStatus[tuple[str, int]]) -> None:
                tls = getattr(args, "tls", None)  # set by paramsync.runtime.cli.main from --tls-*
                if isinstance(coordinator, SubCoordinator):
                    root = parse_address(args.root)
                    await coordinator.serve_tcp(
                        host, port, root=root, tls=tls, task_status=task_status
                    )
                else:
                    await coordinator.serve_tcp(host, port, tls=tls, task_status=task_status)
                nursery.cancel_scope.cancel()  # served to the end: stop watching signals

            if metrics is not None:
                assert metrics_port is not None
                host_port = await nursery.start(
                    serve_metrics, metrics, metrics_port, args.metrics_host
                )
                log.info("metrics at http://%s:%d/metrics", *host_port)
            bound = await nursery.start(serve)
            what = {"root": "root coordinator", "host": "sub-coordinator"}.get(
                getattr(args, "tree", None) or "", "coordinator"
            )
            log.info("%s for %d workers listening on %s:%d", what, args.world_size, *bound)
            if args.port_file:
                await trio.Path(args.port_file).write_text(f"{bound[1]}\n")

    try:
        trio.run(main)
    except BaseException as exc:
        cause = pick_error(exc)
        if stopped:
            return _SIGNAL_EXIT[signal.Signals(stopped[0])]
        if isinstance(cause, RunFailed):
            log.error("run aborted: %s", cause)
            return EXIT_FAILED
        if isinstance(cause, OSError):  # the port is taken, the address is not this host's
            log.error(
                "bad configuration: cannot listen on %s (%s): give --bind a free port of this "
                "host (host:0 picks one)",
                args.bind,
                one_line(cause.strerror or cause),
            )
            return EXIT_USAGE
        if isinstance(cause, ValueError):
            log.error("bad configuration: %s", one_line(cause))
            return EXIT_USAGE
        raise
    if stopped:
        return _SIGNAL_EXIT[signal.Signals(stopped[0])]
    log.info("run finished")
    return EXIT_OK


def run_worker(args: argparse.Namespace, job: WorkerJob) -> int:
    """Run ``job`` (by default the built-in LM demo) as one worker; returns the exit code."""
    import os

    for flag, variable in (
        ("rank", "RANK"),
        ("world_size", "WORLD_SIZE"),
        ("local_rank", "LOCAL_RANK"),
    ):
        value = getattr(args, flag)
        if value is not None:
            os.environ[variable] = str(value)
    try:
        torchrun_env = TorchrunEnv.from_env()
    except ValueError as exc:
        log.error("bad configuration: %s", one_line(exc))
        return EXIT_USAGE
    if args.coordinator:
        try:
            host, port = parse_address(args.coordinator)
        except ValueError as exc:
            log.error("bad configuration: %s", exc)
            return EXIT_USAGE
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    metrics_port = getattr(args, "metrics_port", None)
    if metrics_port is not None:  # the trainer serves them (`TrainerOptions.metrics_port`)
        try:
            check_port(metrics_port, "--metrics-port")
        except ValueError as exc:
            log.error("bad configuration: %s", exc)
            return EXIT_USAGE
        os.environ[METRICS_PORT_ENV] = str(metrics_port)
        os.environ[METRICS_HOST_ENV] = args.metrics_host
    if args.role is not None:
        os.environ.setdefault("PARAMSYNC_ROLE", args.role)
    elif torchrun_env is None:  # by hand or under launch: the coordinator is a daemon
        os.environ.setdefault("PARAMSYNC_ROLE", "worker")
    # Under torchrun nobody else starts a coordinator: rank 0 hosts it (trainer_from_env).
    try:
        return trio.run(job.run, args)
    except BaseException as exc:
        cause = pick_error(exc)
        if isinstance(cause, KeyboardInterrupt):
            return _SIGNAL_EXIT[signal.SIGINT]
        message = configuration_error(exc)  # no secret, wrong secret or world size, ...
        if message is None and isinstance(cause, ValueError):
            message = one_line(cause)
        if message is not None:
            log.error("bad configuration: %s", message)
            return EXIT_USAGE
        if isinstance(cause, ParamsyncError):  # RunAborted included
            log.error("rank %s stopped: %s", os.environ.get("RANK", "?"), cause)
            return EXIT_FAILED
        raise
