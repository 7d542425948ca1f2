"""paramsync's engine: configuration, transports, collectives, process groups, the coordinator.

Layers, lowest first (each imports only those below it; ``docs/architecture.md`` is the map):
``runtime.errors`` and ``runtime.config`` (foundations), ``runtime.protocol`` (frames, messages,
handshake: sans-I/O), ``runtime.transport`` (in-process, TCP, TLS, shared memory),
``runtime.collectives`` (ring collectives, process groups, device mesh, point-to-point),
``runtime.coordinator`` (sans-I/O core and its trio shell), ``runtime.cli`` (the ``paramsync``
command), ``runtime.testing`` (fault wrappers, trials, the transport conformance suite). This
module re-exports only what a user reaches for; everything else stays importable from its module.
"""

from runtime.cli.train_config import DistributedBackend, DistributedRole, DistributedTrainConfig
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
)
from runtime.parallel.config import ParallelismConfig
from runtime.protocol.wire import PROTOCOL_VERSION
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
    "ActorFailed",
    "PROTOCOL_VERSION",
]
