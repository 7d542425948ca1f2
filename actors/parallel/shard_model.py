"""One rank's shard of the 3D-parallel transformer: its tensor-parallel slice, cut into layers.

`ModelSpec` describes the small decoder-only transformer (`DenseTransformer`'s shape arguments).
`build_shard_model` builds, for one tp rank, the dense model from the spec's seed, slices it into
its tensor-parallel form (`TensorParallelTransformer.from_dense`: every shard is exactly the
dense weight's slice) and regroups the stage list into ``n_layers`` pipeline layers, Megatron's
layout: layer 0 holds the embedding and the first block, the last layer the last block and the
head, every other layer one block. A pipeline of p * v stages then splits the layers evenly
(`paramsync.runtime.parallel.config.ParallelismConfig.check_layers`), and the first and the last
stage hold the tied embedding's two copies (``TIED`` names them as
`paramsync.actors.parallel.pipeline.PipelineStage` expects: "<layer>.<name in the layer>").

With activation checkpointing every block is wrapped in a `CheckpointedBlock` whose
recomputation replays the tp rank's dropout generators. `ShardModel.dense_names` maps each
parameter to its name in the dense model, whatever the wrapping, so that shards can be compared
with (or gathered into) the single-device model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

from paramsync.actors.parallel.checkpointing import CheckpointedBlock
from paramsync.actors.parallel.dense_transformer import DenseTransformer
from paramsync.actors.parallel.tensor_parallel.random import TensorParallelRNG
from paramsync.actors.parallel.tensor_parallel.transformer import (
    ParallelBlock,
    TensorParallelTransformer,
)
from paramsync.runtime.collectives.from_thread import SyncCollectives

__all__ = ["ModelSpec", "ShardModel", "build_shard_model", "pipeline_layers"]


@dataclass(frozen=True)
class ModelSpec:
    """The transformer every rank builds (`DenseTransformer`'s arguments but the rng)."""

    vocab_size: int
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    context: int = 32
    tie_weights: bool = False
    dropout: float = 0.0
    seed: int = 0

    def dense(self, rng: TensorParallelRNG | None = None) -> DenseTransformer:
        """The single-device model (its dropout drawn from ``rng``)."""
        return DenseTransformer(**asdict(self), rng=rng)


def pipeline_layers(stages: list[nn.Module]) -> list[nn.Sequential]:
    """``[embedding, block 0, ..., block L-1, head]`` regrouped into L layers: the embedding
    joins the first block, the head the last."""
    if len(stages) < 3:
        raise ValueError(f"a transformer's stage list has at least 3 entries, got {len(stages)}")
    embedding, blocks, head = stages[0], stages[1:-1], stages[-1]
    layers = []
    for index, block in enumerate(blocks):
        parts: list[nn.Module] = []
        if index == 0:
            parts.append(embedding)
        parts.append(block)
        if index == len(blocks) - 1:
            parts.append(head)
        layers.append(nn.Sequential(*parts))
    return layers


@dataclass
class ShardModel:
    """One tp rank's whole model as pipeline layers (a pipeline rank keeps its stages' layers).

    ``tied``: the tied embedding's (first layer's name, last layer's name) pairs for
    `PipelineStage`; ``dense_names``: parameter id -> its name in the dense model; ``rng``: the
    tp rank's dropout generators (None without dropout).
    """

    layers: list[nn.Sequential]
    tied: list[tuple[str, str]]
    dense_names: dict[int, str]
    rng: TensorParallelRNG | None

    def named_parameters(self, modules: list[nn.Module]) -> dict[str, nn.Parameter]:
        """The parameters of ``modules`` (some of `layers`), by dense name, each once."""
        out: dict[str, nn.Parameter] = {}
        for module in modules:
            for param in module.parameters():
                out.setdefault(self.dense_names[id(param)], param)
        return out


def build_shard_model(
    spec: ModelSpec,
    comm: SyncCollectives,
    *,
    activation_checkpointing: bool = False,
) -> ShardModel:
    """Tp rank ``comm.rank``'s shard of ``spec``'s model, as pipeline layers."""
    rng = TensorParallelRNG(spec.seed, comm.rank) if spec.dropout else None
    dense = spec.dense(rng)
    tp_model = TensorParallelTransformer.from_dense(dense, comm, rng)
    dense_names: dict[int, str] = {}
    for name, param in tp_model.named_parameters(remove_duplicate=False):
        dense_names.setdefault(id(param), name)  # a tied weight keeps the embedding's name
    stages = list(tp_model.stages)
    if activation_checkpointing:
        stages = [
            CheckpointedBlock(stage, rng_tracker=rng) if isinstance(stage, ParallelBlock) else stage
            for stage in stages
        ]
    layers = pipeline_layers(stages)
    tied: list[tuple[str, str]] = []
    if spec.tie_weights:
        last = len(layers) - 1
        head_index = len(layers[last]) - 1
        tied = [("0.0.tok_emb.weight", f"{last}.{head_index}.head.weight")]
    del dense
    return ShardModel(layers, tied, dense_names, rng)
