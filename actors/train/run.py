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
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import torch
import trio

from actors.train.trainer import DistributedTrainer, LossFn, TrainerOptions
from actors.train.worker import join_run
from runtime.cli.train_config import DistributedRole, DistributedTrainConfig
from runtime.coordinator.service import Coordinator, CoordinatorOptions
from runtime.observe.trace import TraceRecorder

__all__ = ["trainer_from_env", "SUMMARY_ENV", "write_summary"]

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
) -> AsyncIterator[DistributedTrainer]:
    """Join (and, for the COORDINATOR role, also host) the run this environment describes.

    ``resume_step``/``resume_committed``: the checkpoint this worker restored (`join_run`);
    ``reconnect_seconds``: how long a worker redials a lost coordinator (`join_run`).
    """
    config = DistributedTrainConfig.resolve(toml_path=toml_path, overrides=overrides)
    tls = config.tls_config()
    async with trio.open_nursery() as nursery:
        if config.role is DistributedRole.COORDINATOR:
            coordinator = Coordinator(config.world_size, coordinator_options, secret=secret)
            host, port = config.address
            await nursery.start(partial(coordinator.serve_tcp, host, port, tls=tls))
        async with join_run(
            model,
            optimizer,
            loss_fn,
            config.to_distributed_config(),
            secret=secret,
            options=options,
            trace=trace,
            tls=tls,
            resume_step=resume_step,
            resume_committed=resume_committed,
            reconnect_seconds=reconnect_seconds,
        ) as trainer:
            yield trainer
            summary_path = os.environ.get(SUMMARY_ENV)
        if summary_path:
            write_summary(summary_path, trainer.summary())
