"""In-process multi-device data parallelism (seed 003, contract C-DP-002).

One process holds one model replica per device and trains them in parallel, one OS thread per
replica, averaging only the trainable (e.g. LoRA) gradients: `DataParallelCoordinator`. Modules:
``sharding`` (balanced shards), ``threads`` (the persistent replica threads), ``replica`` (one
device's model, optimizer, gradient buffers and stream), ``marker`` (CUDA events ordering the
streams), ``averaging`` (the weighted average, on the devices or on the host), ``coordinator``
(the step),
``replicated`` (the seam to a multi-process `DistributedTrainer`: hierarchical data parallelism).
"""

from paramsync.actors.multidevice.coordinator import (
    BatchResult,
    DataParallelCoordinator,
    ReplicaDivergedError,
)
from paramsync.actors.multidevice.replicated import ReplicatedOptimizer, primary_backward
from paramsync.actors.multidevice.sharding import TooFewSamplesError
from paramsync.actors.multidevice.threads import ReplicaError

__all__ = [
    "BatchResult",
    "DataParallelCoordinator",
    "ReplicaDivergedError",
    "ReplicaError",
    "ReplicatedOptimizer",
    "TooFewSamplesError",
    "primary_backward",
]
