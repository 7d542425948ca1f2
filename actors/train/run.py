"""Starting a trainer the way torchrun users expect: from the environment.

`trainer_from_env` reads `DistributedTrainConfig` (flags > RANK/WORLD_SIZE/LOCAL_RANK/
MASTER_ADDR/MASTER_PORT > TOML), hosts the coordinator in this process when this rank's role is
COORDINATOR (rank 0 by default, like torchrun's rendezvous host; ``paramsync launch`` runs a
separate coordinator and marks every rank a worker), joins the run and yields the trainer.
On a clean exit it writes the summary to ``$PARAMSYNC_SUMMARY_JSON`` when that is set.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch
import trio

from paramsync.actors.state.digest import Scheduler
from paramsync.actors.train.rendezvous import Rendezvous, find_rendezvous
from paramsync.actors.train.trainer import DistributedTrainer, LossFn, TrainerOptions
from paramsync.actors.train.worker import join_run
from paramsync.runtime.cli.torchrun import COORDINATOR_PORT_ENV
from paramsync.runtime.config import ADVERTISE_ENV, DataPlane, DistributedConfig
from paramsync.runtime.coordinator.service import Coordinator, CoordinatorOptions
from paramsync.runtime.errors import ConfigError, configuration_error, one_line, pick_error
from paramsync.runtime.observe.trace import TraceRecorder
from paramsync.runtime.train_config import DistributedTrainConfig, role_is_given, shared_secret
from paramsync.runtime.transport.tls import TlsConfig

__all__ = ["trainer_from_env", "run_script", "SUMMARY_ENV", "write_summary"]

T = TypeVar("T")

SUMMARY_ENV = "PARAMSYNC_SUMMARY_JSON"


def write_summary(path: str | os.PathLike[str], summary: Mapping[str, object]) -> Path:
    """Write ``summary`` as JSON atomically (temporary file, then rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(target)
    return target


@asynccontextmanager
async def trainer_from_env(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    *,
    options: TrainerOptions | None = None,
    coordinator_options: CoordinatorOptions | None = None,
    trace: TraceRecorder | None = None,
    toml_path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, object] | None = None,
    secret: bytes | str | None = None,
    resume_step: int = 0,
    resume_committed: bool = False,
    reconnect_seconds: float | None = 60.0,
    join_seconds: float = 120.0,
    scheduler: Scheduler | None = None,
) -> AsyncIterator[DistributedTrainer]:
    """Join (and, for the COORDINATOR role, also host) the run this environment describes.

    Everything a first run gets wrong is checked before anything starts: the configuration,
    the shared secret, the TLS files and the coordinator's port. Each is a `ConfigError` (one
    line naming what to set), raised as it is, never inside an exception group; `run_script`
    turns it into that line and exit code 2.

    Where the coordinator listens and how the ranks find it is
    `paramsync.actors.train.rendezvous`'s: under torchrun, a free port of MASTER_ADDR published
    in torchrun's store; after the script's own ``init_process_group`` (any launcher), a free
    port published in the default group's store, the rank and world size the group's; else
    MASTER_ADDR:MASTER_PORT or what Slurm's or Open MPI's variables give.

    ``resume_step``/``resume_committed``: the checkpoint this worker restored (`join_run`);
    ``reconnect_seconds``: how long a worker redials a lost coordinator of its own process
    (``paramsync launch``'s, a daemon's: `join_run`); rank 0's coordinator dies with rank 0,
    so it is never waited for: losing it ends the run at once, naming rank 0;
    ``join_seconds``: how long joining may take.
    ``scheduler``: an LR scheduler of ``optimizer``, stepped after each optimizer step.
    """
    try:
        config = DistributedTrainConfig.resolve(toml_path=toml_path, overrides=overrides)
        tls = config.tls_config()
        key = shared_secret(secret)

        def rebuild(rank: int, world_size: int) -> DistributedTrainConfig:
            placed = {**(overrides or {}), "rank": rank, "world_size": world_size}
            return DistributedTrainConfig.resolve(toml_path=toml_path, overrides=placed)

        meet = find_rendezvous(
            config, rebuild, role_given=role_is_given(toml_path, overrides=overrides)
        )
        config = meet.config
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(one_line(exc)) from None
    try:
        async with trio.open_nursery() as nursery:
            host, port = meet.host, meet.port
            if meet.hosts:
                coordinator = Coordinator(config.world_size, coordinator_options, secret=key)
                port = await _serve_coordinator(nursery, coordinator, host, port, tls, meet)
                if meet.publish is not None:
                    await trio.to_thread.run_sync(meet.publish, host, port)
            elif meet.lookup is not None:
                host, port = await trio.to_thread.run_sync(
                    meet.lookup, join_seconds, abandon_on_cancel=True
                )
            dist_config = DistributedConfig(
                config.world_size,
                config.rank,
                f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
            )
            if config.data_plane is not DataPlane.PARAMSYNC:  # the environment, TOML or a flag
                options = replace(options or TrainerOptions(), data_plane=config.data_plane)
            async with join_run(
                model,
                optimizer,
                loss_fn,
                dist_config,
                secret=key,
                options=options,
                trace=trace,
                tls=tls,
                resume_step=resume_step,
                resume_committed=resume_committed,
                reconnect_seconds=reconnect_seconds if meet.daemon else None,
                join_seconds=join_seconds,
                scheduler=scheduler,
                coordinator_rank=meet.host_rank,
            ) as trainer:
                yield trainer
                summary_path = os.environ.get(SUMMARY_ENV)
            if summary_path:
                write_summary(summary_path, trainer.summary())
    except BaseExceptionGroup as group:
        leaf = pick_error(group)
        if isinstance(leaf, ConfigError):
            raise leaf from None
        raise


async def _serve_coordinator(
    nursery: trio.Nursery,
    coordinator: Coordinator,
    host: str,
    port: int,
    tls: TlsConfig | None,
    meet: Rendezvous,
) -> int:
    """Start ``coordinator`` listening at host:port in ``nursery``; return the bound port. A
    port that cannot be bound is a `ConfigError` naming the variable to change."""
    try:
        bound = await nursery.start(partial(coordinator.serve_tcp, host, port, tls=tls))
    except OSError as exc:
        if meet.publish is not None or port != meet.config.address[1]:
            what = (
                f"MASTER_ADDR (or {ADVERTISE_ENV}) must be an address of this host (rank 0's), "
                f"and {COORDINATOR_PORT_ENV}, if set, a free port"
            )
        else:
            what = (
                "set MASTER_ADDR to an address of this host and MASTER_PORT to a free port "
                "(a script that calls init_process_group first leaves MASTER_PORT to torch's "
                "store and the coordinator takes another port)"
            )
        raise ConfigError(
            f"the coordinator cannot listen on {host}:{port} ({exc.strerror or exc}): {what}"
        ) from None
    return int(bound[1])


def run_script(main: Callable[..., Awaitable[T]], *args: object) -> T:
    """``trio.run(main, *args)`` for a training script's ``if __name__ == "__main__"``: a
    configuration error (`ConfigError`, or a join the coordinator refused: wrong secret or
    world size) prints one line naming what to set, ``paramsync: ...``, on stderr and exits
    with code 2 instead of a traceback. Everything else propagates as ``trio.run``'s would."""
    with exit_on_configuration_error():
        return trio.run(main, *args)


@contextmanager
def exit_on_configuration_error() -> Iterator[None]:
    """Around a synchronous script's main (what `run_script` does for a trio one): a
    configuration error raised inside prints its one line, ``paramsync: ...``, on stderr and
    exits with code 2; anything else propagates unchanged."""
    try:
        yield
    except BaseException as exc:
        message = configuration_error(exc)
        if message is None:
            raise
        print(f"paramsync: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
