"""paramsync's worker: the trainer a training script reaches for.

The layers below, lowest first (``docs/architecture.md``): ``actors.state`` (buckets, the
C-DDP-001 digest, checkpoints), ``actors.multidevice`` (one process, one replica per device,
C-DP-002), ``actors.client`` (the worker's side of the coordinator
protocol), ``actors.graph`` (the actors of one worker), ``actors.train`` (the trainers built from
them), ``actors.torchdist`` (paramsync as a torch.distributed backend); ``actors.demo_job`` is
the built-in demo, a user of all this. Only what a training script uses is exported here;
everything else stays importable from its module.

The names load on first use (PEP 562), so that importing one part of ``actors`` costs only
that part: torch imports ``actors.torchdist.entry`` at ``import torch``, which must stay cheap.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from actors.client.client import RunAborted
    from actors.multidevice import BatchResult, DataParallelCoordinator
    from actors.state.digest import StateDigest, state_digest
    from actors.train.ddp_wrapper import DistributedDataParallel
    from actors.train.options import TrainerOptions
    from actors.train.run import trainer_from_env
    from actors.train.sync import SyncTrainer
    from actors.train.trainer import DistributedTrainer
    from actors.train.worker import join_run, train_in_process

_EXPORTS = {
    "BatchResult": "actors.multidevice",
    "DataParallelCoordinator": "actors.multidevice",
    "DistributedDataParallel": "actors.train.ddp_wrapper",
    "DistributedTrainer": "actors.train.trainer",
    "RunAborted": "actors.client.client",
    "StateDigest": "actors.state.digest",
    "SyncTrainer": "actors.train.sync",
    "TrainerOptions": "actors.train.options",
    "join_run": "actors.train.worker",
    "state_digest": "actors.state.digest",
    "train_in_process": "actors.train.worker",
    "trainer_from_env": "actors.train.run",
}

__all__ = [
    "BatchResult",
    "DataParallelCoordinator",
    "DistributedDataParallel",
    "DistributedTrainer",
    "RunAborted",
    "StateDigest",
    "SyncTrainer",
    "TrainerOptions",
    "join_run",
    "state_digest",
    "train_in_process",
    "trainer_from_env",
]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
