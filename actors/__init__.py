"""paramsync's worker: the trainer a training script reaches for.

The layers below, lowest first (``docs/architecture.md``): ``actors.state`` (buckets, the
C-DDP-001 digest, checkpoints), ``actors.multidevice`` (one process, one replica per device,
C-DP-002), ``actors.client`` (the worker's side of the coordinator
protocol), ``actors.graph`` (the actors of one worker), ``actors.train`` (the trainers built from
them); ``actors.demo_job`` is the built-in demo, a user of all this. Only what a training script
uses is exported here; everything else stays importable from its module.
"""

from actors.client.client import RunAborted
from actors.multidevice import BatchResult, DataParallelCoordinator
from actors.state.digest import StateDigest, state_digest
from actors.train.ddp_wrapper import DistributedDataParallel
from actors.train.options import TrainerOptions
from actors.train.run import trainer_from_env
from actors.train.sync import SyncTrainer
from actors.train.trainer import DistributedTrainer
from actors.train.worker import join_run, train_in_process

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
