"""paramsync: data-parallel PyTorch replicas kept in lockstep, proven identical every step.

The names here are the few a training script needs, grouped as trio groups its own
(`docs/api.md` documents each of them once, generated from these docstrings):

- **the front doors**: `BACKEND_NAME`, torch.distributed's backend
  (``dist.init_process_group("paramsync")``, registered at ``import torch``);
  `DistributedDataParallel`, torch DDP's interface for a script's own loop; `SyncTrainer`, the
  trainer driven from synchronous code; `trainer_from_env`, the trainer in a trio application;
- **the configurations**: `TrainerOptions`, `DistributedTrainConfig`, `ParallelismConfig`,
  `CoordinatorOptions`, `DistributedConfig`, `TlsConfig`;
- **the errors**: `ParamsyncError` and the family under it;
- **namespaces**: `paramsync.testing` (check a deployment, a transport or a fault of your own),
  `paramsync.runtime` (the engine: transports, collectives, process groups, the coordinator)
  and `paramsync.actors` (the worker: the actors, the trainers, the torch backend).

Everything else is reachable from its module under `paramsync.runtime` and `paramsync.actors`.
Nothing is imported until it is first used (PEP 562): ``import paramsync`` costs the import of
this module alone, which is what lets torch import `paramsync.torch_entry` at ``import torch``.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from paramsync import actors, runtime, testing
    from paramsync.actors.client.client import RunAborted
    from paramsync.actors.train.ddp_wrapper import DistributedDataParallel
    from paramsync.actors.train.options import TrainerOptions
    from paramsync.actors.train.run import trainer_from_env
    from paramsync.actors.train.sync import SyncTrainer
    from paramsync.runtime.config import DistributedConfig
    from paramsync.runtime.coordinator.service import CoordinatorOptions, RunFailed
    from paramsync.runtime.errors import (
        ActorFailed,
        AuthenticationError,
        CollectiveError,
        ConfigError,
        HandshakeError,
        ParamsyncError,
        PeerClosed,
        ProtocolError,
        StallError,
        StateDiverged,
    )
    from paramsync.runtime.parallel.config import ParallelismConfig
    from paramsync.runtime.train_config import DistributedTrainConfig
    from paramsync.runtime.transport.tls import TlsConfig
    from paramsync.torch_entry import BACKEND_NAME

__all__ = [
    # the front doors
    "BACKEND_NAME",
    "DistributedDataParallel",
    "SyncTrainer",
    "trainer_from_env",
    # the configurations
    "TrainerOptions",
    "DistributedTrainConfig",
    "ParallelismConfig",
    "CoordinatorOptions",
    "DistributedConfig",
    "TlsConfig",
    # the errors
    "ParamsyncError",
    "ConfigError",
    "ProtocolError",
    "HandshakeError",
    "AuthenticationError",
    "PeerClosed",
    "StallError",
    "CollectiveError",
    "ActorFailed",
    "StateDiverged",
    "RunAborted",
    "RunFailed",
    # namespaces
    "testing",
    "runtime",
    "actors",
]

_WHERE = {
    "BACKEND_NAME": "paramsync.torch_entry",
    "DistributedDataParallel": "paramsync.actors.train.ddp_wrapper",
    "SyncTrainer": "paramsync.actors.train.sync",
    "trainer_from_env": "paramsync.actors.train.run",
    "TrainerOptions": "paramsync.actors.train.options",
    "DistributedTrainConfig": "paramsync.runtime.train_config",
    "ParallelismConfig": "paramsync.runtime.parallel.config",
    "CoordinatorOptions": "paramsync.runtime.coordinator.service",
    "DistributedConfig": "paramsync.runtime.config",
    "TlsConfig": "paramsync.runtime.transport.tls",
    "ParamsyncError": "paramsync.runtime.errors",
    "ConfigError": "paramsync.runtime.errors",
    "ProtocolError": "paramsync.runtime.errors",
    "HandshakeError": "paramsync.runtime.errors",
    "AuthenticationError": "paramsync.runtime.errors",
    "PeerClosed": "paramsync.runtime.errors",
    "StallError": "paramsync.runtime.errors",
    "CollectiveError": "paramsync.runtime.errors",
    "ActorFailed": "paramsync.runtime.errors",
    "StateDiverged": "paramsync.runtime.errors",
    "RunAborted": "paramsync.actors.client.client",
    "RunFailed": "paramsync.runtime.coordinator.service",
}
"""Each exported name's module (the namespaces are the submodules of the same name)."""

_NAMESPACES = frozenset({"testing", "runtime", "actors"})


def __getattr__(name: str) -> _typing.Any:
    value: object
    if name in _NAMESPACES:
        value = _importlib.import_module(f"paramsync.{name}")
    elif name in _WHERE:
        value = getattr(_importlib.import_module(_WHERE[name]), name)
    elif name == "__version__":
        from importlib.metadata import version

        value = version("paramsync")
    else:
        raise AttributeError(f"module 'paramsync' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
