"""paramsync's engine: configuration, transports, collectives, process groups, the coordinator.

Layers, lowest first (each imports only those below it; ``docs/architecture.md`` is the map):
``paramsync.runtime.errors`` and ``paramsync.runtime.config`` (foundations),
``paramsync.runtime.protocol`` (frames, messages, handshake: sans-I/O),
``paramsync.runtime.transport`` (in-process, TCP, TLS, shared memory),
``paramsync.runtime.collectives`` (ring collectives, process groups, device mesh, point-to-point),
``paramsync.runtime.coordinator`` (sans-I/O core and its trio shell), ``paramsync.runtime.cli`` (the
``paramsync`` command), ``paramsync.runtime.testing`` (fault wrappers, trials, the transport
conformance suite). This module re-exports only what a user reaches for; everything else stays
importable from its module.

The names load on first use (PEP 562): ``import paramsync.runtime.cli.main`` for the launcher or the
coordinator daemon does not import torch, which only the workers need.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from paramsync.runtime.collectives.aggregators import (
        AllReduceAggregator,
        GradientAggregator,
        ParameterServerAggregator,
    )
    from paramsync.runtime.collectives.groups import ProcessGroup, new_group
    from paramsync.runtime.collectives.mesh import DeviceMesh, init_device_mesh
    from paramsync.runtime.collectives.p2p import irecv, isend, recv, send
    from paramsync.runtime.collectives.ring import (
        all_gather,
        all_reduce,
        barrier,
        broadcast,
        reduce_scatter,
    )
    from paramsync.runtime.config import DistributedConfig
    from paramsync.runtime.coordinator.service import Coordinator, CoordinatorOptions, RunFailed
    from paramsync.runtime.errors import (
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
    from paramsync.runtime.parallel.config import ParallelismConfig
    from paramsync.runtime.protocol.wire import PROTOCOL_VERSION
    from paramsync.runtime.train_config import (
        Device,
        DistributedRole,
        DistributedTrainConfig,
    )
    from paramsync.runtime.transport.base import InProcessTransport, Transport
    from paramsync.runtime.transport.tcp import TcpTransport
    from paramsync.runtime.transport.tls import TlsConfig

__all__ = [
    # configuration
    "DistributedConfig",
    "DistributedTrainConfig",
    "Device",
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
    "Device": "paramsync.runtime.train_config",
    "DistributedRole": "paramsync.runtime.train_config",
    "DistributedTrainConfig": "paramsync.runtime.train_config",
    "AllReduceAggregator": "paramsync.runtime.collectives.aggregators",
    "GradientAggregator": "paramsync.runtime.collectives.aggregators",
    "ParameterServerAggregator": "paramsync.runtime.collectives.aggregators",
    "ProcessGroup": "paramsync.runtime.collectives.groups",
    "new_group": "paramsync.runtime.collectives.groups",
    "DeviceMesh": "paramsync.runtime.collectives.mesh",
    "init_device_mesh": "paramsync.runtime.collectives.mesh",
    "irecv": "paramsync.runtime.collectives.p2p",
    "isend": "paramsync.runtime.collectives.p2p",
    "recv": "paramsync.runtime.collectives.p2p",
    "send": "paramsync.runtime.collectives.p2p",
    "all_gather": "paramsync.runtime.collectives.ring",
    "all_reduce": "paramsync.runtime.collectives.ring",
    "barrier": "paramsync.runtime.collectives.ring",
    "broadcast": "paramsync.runtime.collectives.ring",
    "reduce_scatter": "paramsync.runtime.collectives.ring",
    "DistributedConfig": "paramsync.runtime.config",
    "Coordinator": "paramsync.runtime.coordinator.service",
    "CoordinatorOptions": "paramsync.runtime.coordinator.service",
    "RunFailed": "paramsync.runtime.coordinator.service",
    "ActorFailed": "paramsync.runtime.errors",
    "AuthenticationError": "paramsync.runtime.errors",
    "CollectiveError": "paramsync.runtime.errors",
    "HandshakeError": "paramsync.runtime.errors",
    "ParamsyncError": "paramsync.runtime.errors",
    "PeerClosed": "paramsync.runtime.errors",
    "ProtocolError": "paramsync.runtime.errors",
    "StallError": "paramsync.runtime.errors",
    "StateDiverged": "paramsync.runtime.errors",
    "ParallelismConfig": "paramsync.runtime.parallel.config",
    "PROTOCOL_VERSION": "paramsync.runtime.protocol.wire",
    "InProcessTransport": "paramsync.runtime.transport.base",
    "Transport": "paramsync.runtime.transport.base",
    "TcpTransport": "paramsync.runtime.transport.tcp",
    "TlsConfig": "paramsync.runtime.transport.tls",
}
"""Each re-exported name's module."""


def __getattr__(name: str) -> _typing.Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'paramsync.runtime' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
