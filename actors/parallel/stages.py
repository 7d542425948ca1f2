"""Splitting a model into pipeline stages, and where each stage lives.

A pipelined model is an ordered list of blocks (an ``nn.Sequential`` or a list of modules: the
embedding first, the head last). `split_blocks` cuts it into ``p * v`` chunks of equal length
(chunk s holds a contiguous range of blocks; an uneven split is an error, never a guess), and
stage s lives on pipeline rank ``s % p`` (`stage_rank`): with v chunks per rank, rank r holds
stages r, r + p, ..., r + (v - 1) p, the interleaved layout of Megatron and
torch.distributed.pipelining (`rank_stages`). A parameter is named as
``nn.Sequential(*blocks).named_parameters()`` names it: ``"<block index>.<name in the block>"``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = [
    "StageChunk",
    "split_blocks",
    "stage_rank",
    "rank_stages",
    "check_stage_layout",
]


class StageChunk(nn.Sequential):
    """One stage: a contiguous run of the model's blocks, which remembers where it came from
    (``first_block``: the index of its first block in the whole model)."""

    def __init__(self, stage: int, first_block: int, blocks: Sequence[nn.Module]) -> None:
        super().__init__(*blocks)
        self.stage = stage
        self.first_block = first_block

    def block_parameter(self, name: str) -> nn.Parameter | None:
        """The parameter the whole model names ``name`` ("<block index>.<name>"), if one of this
        chunk's blocks holds it; None otherwise."""
        index_text, _, rest = name.partition(".")
        if not index_text.isdigit() or not rest:
            raise ValueError(
                f"parameter name {name!r} is not '<block index>.<name in the block>' (as "
                "nn.Sequential(*blocks).named_parameters() names it)"
            )
        offset = int(index_text) - self.first_block
        if not 0 <= offset < len(self):
            return None
        try:
            return self[offset].get_parameter(rest)
        except AttributeError:
            raise ValueError(
                f"block {index_text} ({type(self[offset]).__name__}) has no parameter {rest!r}"
            ) from None


def check_stage_layout(pp_size: int, chunks_per_rank: int) -> int:
    """The number of stages, ``pp_size * chunks_per_rank``, after checking both are positive."""
    for what, value in (("pp_size", pp_size), ("chunks_per_rank", chunks_per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a positive int, got {value!r}")
    return pp_size * chunks_per_rank


def split_blocks(blocks: nn.Sequential | Sequence[nn.Module], num_stages: int) -> list[StageChunk]:
    """Cut ``blocks`` into ``num_stages`` chunks of equal length, in order.

    ``len(blocks)`` must be a multiple of ``num_stages`` (p * v): a ValueError says by how much
    it is not. The chunks hold the very modules given (no copy).
    """
    listed = list(blocks)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"the number of stages must be a positive int, got {num_stages!r}")
    for index, block in enumerate(listed):
        if not isinstance(block, nn.Module):
            raise ValueError(f"block {index} is a {type(block).__name__}, not an nn.Module")
    if not listed or len(listed) % num_stages:
        raise ValueError(
            f"{len(listed)} blocks do not split evenly into {num_stages} stages (p * v): "
            f"use a multiple of {num_stages} blocks, or another pp_size / chunks per rank"
        )
    per = len(listed) // num_stages
    return [
        StageChunk(stage, stage * per, listed[stage * per : (stage + 1) * per])
        for stage in range(num_stages)
    ]


def stage_rank(stage: int, pp_size: int) -> int:
    """The pipeline rank that holds ``stage``: ``stage % pp_size``."""
    return stage % pp_size


def rank_stages(rank: int, pp_size: int, chunks_per_rank: int) -> list[int]:
    """The stages pipeline rank ``rank`` holds, ascending: rank, rank + p, ..."""
    check_stage_layout(pp_size, chunks_per_rank)
    if not 0 <= rank < pp_size:
        raise ValueError(f"pipeline rank {rank} is not in 0..{pp_size - 1}")
    return [rank + chunk * pp_size for chunk in range(chunks_per_rank)]
