"""paramsync's engine: configuration, transports, collectives, process groups, the coordinator.

Layers, lowest first (each imports only those below it; ``docs/architecture.md`` is the map):
``runtime.errors`` and ``runtime.config`` (foundations), ``runtime.protocol`` (frames, messages,
handshake: sans-I/O), ``runtime.transport`` (in-process, TCP, TLS, shared memory),
``runtime.collectives`` (ring collectives, process groups, device mesh, point-to-point),
``runtime.coordinator`` (sans-I/O core and its trio shell), ``runtime.cli`` (the ``paramsync``
command), ``runtime.testing`` (fault wrappers, trials, the transport conformance suite). This
module re-exports only what a user reaches for; everything else stays importable from its module.

The names load on first use (PEP 562): ``import runtime.cli.main`` for the launcher or the
coordinator daemon does not import torch, which only the workers need.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from runtime.collectives.aggregators import (
        AllReduceAggregator,
        GradientAggregator,
        ParameterServerAggregator,
    )
    from runtime.collectives.groups import ProcessGroup, new_group
    from runtime.collectives.mesh import DeviceMesh, init_device_mesh
    from runtime.collectives.p2p import irecv, isend, recv, send
    from runtime.collectives.ring import all_gather, all_reduce, barrier, broadcast, reduce_scatter
    from runtime.config import DistributedConfig
    from runtime.coordinator.service import Coordinator, CoordinatorOptions, RunFailed
    from runtime.errors import (
        ActorFailed,
        AuthenticationError,
        CollectiveError,
        HandshakeError,
        ParamsyncError,
        PeerClosed,
        ProtocolError,
        StallError,
        StateDiverged,
    )
    from runtime.parallel.config import ParallelismConfig
    from runtime.protocol.wire import PROTOCOL_VERSION
    from runtime.train_config import DistributedBackend, DistributedRole, DistributedTrainConfig
    from runtime.transport.base import InProcessTransport, Transport
    from runtime.transport.tcp import TcpTransport
    from runtime.transport.tls import TlsConfig

__all__ = [
    # configuration
    "DistributedConfig",
    "DistributedTrainConfig",
    "DistributedBackend",
    "DistributedRole",
    "ParallelismConfig",
    # transports
    "Transport",
    "InProcessTransport",
    "TcpTransport",
    "TlsConfig",
    # collectives, groups, point-to-point
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "barrier",
    "ProcessGroup",
    "new_group",
    "DeviceMesh",
    "init_device_mesh",
    "send",
    "recv",
    "isend",
    "irecv",
    "GradientAggregator",
    "AllReduceAggregator",
    "ParameterServerAggregator",
    # the coordinator
    "Coordinator",
    "CoordinatorOptions",
    "RunFailed",
    # errors
    "ParamsyncError",
    "ProtocolError",
    "PeerClosed",
    "CollectiveError",
    "HandshakeError",
    "AuthenticationError",
    "StallError",
    "StateDiverged",
    "ActorFailed",
    "PROTOCOL_VERSION",
]

_WHERE = {
    "DistributedBackend": "runtime.train_config",
    "DistributedRole": "runtime.train_config",
    "DistributedTrainConfig": "runtime.train_config",
    "AllReduceAggregator": "runtime.collectives.aggregators",
    "GradientAggregator": "runtime.collectives.aggregators",
    "ParameterServerAggregator": "runtime.collectives.aggregators",
    "ProcessGroup": "runtime.collectives.groups",
    "new_group": "runtime.collectives.groups",
    "DeviceMesh": "runtime.collectives.mesh",
    "init_device_mesh": "runtime.collectives.mesh",
    "irecv": "runtime.collectives.p2p",
    "isend": "runtime.collectives.p2p",
    "recv": "runtime.collectives.p2p",
    "send": "runtime.collectives.p2p",
    "all_gather": "runtime.collectives.ring",
    "all_reduce": "runtime.collectives.ring",
    "barrier": "runtime.collectives.ring",
    "broadcast": "runtime.collectives.ring",
    "reduce_scatter": "runtime.collectives.ring",
    "DistributedConfig": "runtime.config",
    "Coordinator": "runtime.coordinator.service",
    "CoordinatorOptions": "runtime.coordinator.service",
    "RunFailed": "runtime.coordinator.service",
    "ActorFailed": "runtime.errors",
    "AuthenticationError": "runtime.errors",
    "CollectiveError": "runtime.errors",
    "HandshakeError": "runtime.errors",
    "ParamsyncError": "runtime.errors",
    "PeerClosed": "runtime.errors",
    "ProtocolError": "runtime.errors",
    "StallError": "runtime.errors",
    "StateDiverged": "runtime.errors",
    "ParallelismConfig": "runtime.parallel.config",
    "PROTOCOL_VERSION": "runtime.protocol.wire",
    "InProcessTransport": "runtime.transport.base",
    "Transport": "runtime.transport.base",
    "TcpTransport": "runtime.transport.tcp",
    "TlsConfig": "runtime.transport.tls",
}
"""Each re-exported name's module."""


def __getattr__(name: str) -> _typing.Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
