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
from paramsync.actors.train.trainer import DistributedTrainer, LossFn, TrainerOptions
from paramsync.actors.train.worker import join_run
from paramsync.runtime.cli.torchrun import COORDINATOR_PORT_ENV, TorchrunEnv
from paramsync.runtime.config import DataPlane, DistributedConfig
from paramsync.runtime.coordinator.service import Coordinator, CoordinatorOptions
from paramsync.runtime.errors import ConfigError, configuration_error, one_line, pick_error
from paramsync.runtime.observe.trace import TraceRecorder
from paramsync.runtime.train_config import DistributedRole, DistributedTrainConfig, shared_secret
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

    Under torchrun (TORCHELASTIC_RUN_ID set) the coordinator listens on a free port of
    MASTER_ADDR, not on MASTER_PORT (torchrun's own store has it), and the ranks find it
    through torchrun's store (`paramsync.runtime.cli.torchrun`).

    ``resume_step``/``resume_committed``: the checkpoint this worker restored (`join_run`);
    ``reconnect_seconds``: how long a worker redials a lost coordinator (`join_run`);
    ``join_seconds``: how long joining may take.
    ``scheduler``: an LR scheduler of ``optimizer``, stepped after each optimizer step.
    """
    try:
        config = DistributedTrainConfig.resolve(toml_path=toml_path, overrides=overrides)
        tls = config.tls_config()
        key = shared_secret(secret)
        torchrun = TorchrunEnv.from_env()
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(one_line(exc)) from None
    try:
        async with trio.open_nursery() as nursery:
            host, port = config.address
            if torchrun is not None:
                host = torchrun.store_host
                port = torchrun.coordinator_port or 0
            if config.role is DistributedRole.COORDINATOR:
                coordinator = Coordinator(config.world_size, coordinator_options, secret=key)
                port = await _serve_coordinator(nursery, coordinator, host, port, tls, torchrun)
                if torchrun is not None and torchrun.coordinator_port is None:
                    await trio.to_thread.run_sync(torchrun.publish_coordinator_port, port)
            elif torchrun is not None and torchrun.coordinator_port is None:
                port = await trio.to_thread.run_sync(
                    partial(torchrun.lookup_coordinator_port, seconds=join_seconds),
                    abandon_on_cancel=True,
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
                reconnect_seconds=reconnect_seconds,
                join_seconds=join_seconds,
                scheduler=scheduler,
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
    torchrun: TorchrunEnv | None,
) -> int:
    """Start ``coordinator`` listening at host:port in ``nursery``; return the bound port. A
    port that cannot be bound is a `ConfigError` naming the variable to change."""
    try:
        bound = await nursery.start(partial(coordinator.serve_tcp, host, port, tls=tls))
    except OSError as exc:
        if torchrun is not None:
            what = (
                f"MASTER_ADDR must be an address of this host (rank 0's), and "
                f"{COORDINATOR_PORT_ENV}, if set, a free port"
            )
        else:
            what = "set MASTER_ADDR to an address of this host and MASTER_PORT to a free port"
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
