"""paramsync's worker: the trainer a training script reaches for.

The layers below, lowest first (``docs/architecture.md``): ``paramsync.actors.state`` (buckets, the
C-DDP-001 digest, checkpoints), ``paramsync.actors.multidevice`` (one process, one replica per
device, C-DP-002), ``paramsync.actors.client`` (the worker's side of the coordinator protocol),
``paramsync.actors.graph`` (the actors of one worker), ``paramsync.actors.train`` (the trainers
built from them), ``paramsync.actors.torch_backend`` (paramsync as a torch.distributed backend);
``paramsync.actors.demo_job`` is the built-in demo, a user of all this. Only what a training script
uses is exported here; everything else stays importable from its module.

The names load on first use (PEP 562), so that importing one part of ``paramsync.actors``
costs only that part.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from paramsync.actors.client.client import RunAborted
    from paramsync.actors.multidevice import BatchResult, DataParallelCoordinator
    from paramsync.actors.state.digest import StateDigest, state_digest
    from paramsync.actors.train.ddp_wrapper import DistributedDataParallel
    from paramsync.actors.train.options import TrainerOptions
    from paramsync.actors.train.run import trainer_from_env
    from paramsync.actors.train.sync import SyncTrainer
    from paramsync.actors.train.trainer import DistributedTrainer
    from paramsync.actors.train.worker import join_run, train_in_process

_EXPORTS = {
    "BatchResult": "paramsync.actors.multidevice",
    "DataParallelCoordinator": "paramsync.actors.multidevice",
    "DistributedDataParallel": "paramsync.actors.train.ddp_wrapper",
    "DistributedTrainer": "paramsync.actors.train.trainer",
    "RunAborted": "paramsync.actors.client.client",
    "StateDigest": "paramsync.actors.state.digest",
    "SyncTrainer": "paramsync.actors.train.sync",
    "TrainerOptions": "paramsync.actors.train.options",
    "join_run": "paramsync.actors.train.worker",
    "state_digest": "paramsync.actors.state.digest",
    "train_in_process": "paramsync.actors.train.worker",
    "trainer_from_env": "paramsync.actors.train.run",
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
        raise AttributeError(f"module 'paramsync.actors' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
