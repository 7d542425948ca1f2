"""In-process multi-device data parallelism (seed 003, contract C-DP-002).

One process holds one model replica per device and trains them in parallel, one OS thread per
replica, averaging only the trainable (e.g. LoRA) gradients: `DataParallelCoordinator`. Modules:
``sharding`` (balanced shards), ``threads`` (the persistent replica threads), ``replica`` (one
device's model, optimizer, gradient buffers and stream), ``coordinator`` (the step).
"""

from actors.multidevice.coordinator import (
    BatchResult,
    DataParallelCoordinator,
    ReplicaDivergedError,
)
from actors.multidevice.sharding import TooFewSamplesError
from actors.multidevice.threads import ReplicaError

__all__ = [
    "BatchResult",
    "DataParallelCoordinator",
    "ReplicaDivergedError",
    "ReplicaError",
    "TooFewSamplesError",
]
