"""paramsync's workers: the actor graph, the trainer built from it, and the built-in LM job."""

from actors.client.client import CoordinatorClient, RunAborted
from actors.demo_job.corpus import CharDataset, CharVocab, load_char_dataset
from actors.demo_job.model import CharTransformer
from actors.graph.compute import ComputeActor
from actors.graph.factory import ActorFactory
from actors.graph.gradcomm import GradCommActor
from actors.graph.loader import DataLoaderActor
from actors.graph.optimizer import CheckCost, OptimizerActor
from actors.graph.sampler import shard
from actors.state.buckets import Bucket, plan_buckets
from actors.state.digest import StateDigest, StateHasher, state_digest
from actors.train.run import trainer_from_env
from actors.train.sync import SyncTrainer
from actors.train.trainer import DistributedTrainer, TrainerOptions
from actors.train.worker import join_run, train_in_process

__all__ = [
    "ActorFactory",
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
