"""paramsync's workers: the actor graph, the trainer built from it, and the built-in LM job."""

from .buckets import Bucket, plan_buckets
from .client import CoordinatorClient, RunAborted
from .corpus import CharDataset, CharVocab, load_char_dataset, shard
from .digest import StateDigest, StateHasher, state_digest
from .loader import DataLoaderActor
from .model import CharTransformer
from .run import trainer_from_env
from .sync import SyncTrainer
from .trainer import (
    CheckCost,
    ComputeActor,
    DistributedTrainer,
    GradCommActor,
    OptimizerActor,
    TrainerOptions,
)
from .worker import join_run, train_in_process

__all__ = [
    "Bucket",
    "CharDataset",
    "CharTransformer",
    "CharVocab",
    "CheckCost",
    "ComputeActor",
    "CoordinatorClient",
    "DataLoaderActor",
    "DistributedTrainer",
    "GradCommActor",
    "OptimizerActor",
    "RunAborted",
    "StateDigest",
    "StateHasher",
    "SyncTrainer",
    "TrainerOptions",
    "join_run",
    "load_char_dataset",
    "plan_buckets",
    "shard",
    "state_digest",
    "train_in_process",
    "trainer_from_env",
]
