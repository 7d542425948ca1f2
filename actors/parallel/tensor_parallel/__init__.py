"""Tensor parallelism (Megatron style) on the engine's process groups.

One tp rank's shard of each layer, talking to the other tp ranks through a `SyncCollectives`
(`paramsync.runtime.collectives.from_thread.ThreadCollectives` over the tp `ProcessGroup`) from the
compute thread. Modules: `mappings` (the autograd functions entering and leaving the tp region),
`layers` (column/row-parallel linear, vocabulary-parallel embedding), `cross_entropy`
(vocabulary-parallel cross-entropy), `random` (per-tp-rank dropout generators), `transformer` (a
tensor-parallel transformer built from
`paramsync.actors.parallel.dense_transformer.DenseTransformer`).
"""

from paramsync.actors.parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from paramsync.actors.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    is_tensor_parallel,
    mark_tensor_parallel,
    partition_range,
)
from paramsync.actors.parallel.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
)
from paramsync.actors.parallel.tensor_parallel.random import TensorParallelRNG, model_parallel_seed
from paramsync.actors.parallel.tensor_parallel.transformer import (
    ParallelAttention,
    ParallelBlock,
    ParallelEmbedding,
    ParallelHead,
    ParallelMLP,
    TensorParallelTransformer,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "copy_to_tp_region",
    "reduce_from_tp_region",
    "gather_from_tp_region",
    "scatter_to_tp_region",
    "is_tensor_parallel",
    "mark_tensor_parallel",
    "partition_range",
    "TensorParallelRNG",
    "model_parallel_seed",
    "ParallelAttention",
    "ParallelMLP",
    "ParallelBlock",
    "ParallelEmbedding",
    "ParallelHead",
    "TensorParallelTransformer",
]
