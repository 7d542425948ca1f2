"""paramsync's engine: configuration, CBOR wire protocol, transports and collectives."""

from .admission import AdmissionGate, AdmissionLimits
from .aggregators import (
    AllReduceAggregator,
    GradientAggregator,
    ParameterServerAggregator,
)
from .collectives import (
    DEFAULT_CHUNK_BYTES,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    reduce_scatter,
    segment_bounds,
)
from .config import DistributedConfig, parse_address
from .coordinator import Coordinator, CoordinatorOptions, RunFailed
from .coordinator_core import CoordinatorCore, RunState
from .errors import (
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
from .link import Link, MemoryLink
from .tcp import TcpTransport
from .tls import TlsConfig
from .trace import TraceRecorder, merge_traces
from .train_config import DistributedBackend, DistributedRole, DistributedTrainConfig
from .transport import InProcessTransport, Transport
from .wire import BFLOAT16_TAG, PROTOCOL_VERSION

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
