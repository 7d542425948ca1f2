"""paramsync's engine: configuration, CBOR wire protocol, transports and collectives."""

from runtime.cli.train_config import DistributedBackend, DistributedRole, DistributedTrainConfig
from runtime.collectives.aggregators import (
    AllReduceAggregator,
    GradientAggregator,
    ParameterServerAggregator,
)
from runtime.collectives.ring import (
    DEFAULT_CHUNK_BYTES,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    reduce_scatter,
    segment_bounds,
)
from runtime.config import DistributedConfig, parse_address
from runtime.coordinator.core import CoordinatorCore
from runtime.coordinator.run_state import RunState
from runtime.coordinator.service import Coordinator, CoordinatorOptions, RunFailed
from runtime.errors import (
    ActorFailed,
    AuthenticationError,
    CollectiveError,
    FrameTooLarge,
    HandshakeError,
    ListenerBusy,
    ParamsyncError,
    PeerClosed,
    ProtocolError,
    StallError,
)
from runtime.observe.trace import TraceRecorder, merge_traces
from runtime.protocol.wire import BFLOAT16_TAG, PROTOCOL_VERSION
from runtime.transport.admission import AdmissionGate, AdmissionLimits
from runtime.transport.base import InProcessTransport, Transport
from runtime.transport.link import Link, MemoryLink
from runtime.transport.tcp import TcpTransport
from runtime.transport.tls import TlsConfig

__all__ = [
    "AdmissionGate",
    "AdmissionLimits",
    "AllReduceAggregator",
    "GradientAggregator",
    "ParameterServerAggregator",
    "StallError",
    "ActorFailed",
    "AuthenticationError",
    "ListenerBusy",
    "BFLOAT16_TAG",
    "CollectiveError",
    "Coordinator",
    "CoordinatorCore",
    "CoordinatorOptions",
    "DistributedBackend",
    "DistributedRole",
    "DistributedTrainConfig",
    "Link",
    "MemoryLink",
    "RunFailed",
    "RunState",
    "TraceRecorder",
    "merge_traces",
    "DEFAULT_CHUNK_BYTES",
    "DistributedConfig",
    "FrameTooLarge",
    "HandshakeError",
    "InProcessTransport",
    "PROTOCOL_VERSION",
    "ParamsyncError",
    "PeerClosed",
    "ProtocolError",
    "TcpTransport",
    "TlsConfig",
    "Transport",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "parse_address",
    "reduce_scatter",
    "segment_bounds",
]
