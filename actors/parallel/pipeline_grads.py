"""After a pipeline step: the reductions that make a stage's gradients the model's.

Two, as Megatron's ``finalize_model_grads`` does them:

- data parallelism: every replica of a stage (its dp group, one per (pp, tp) coordinate of the
  device mesh) averages its gradients (`average_over_dp`), one flat all-reduce per stage;
- tied embeddings: when the first and the last stage hold copies of one weight (the input
  embedding and the LM head), the two ranks sum that weight's gradient over their 2-rank
  embedding group (`sum_tied`), so both copies take the same update and stay equal. Megatron's
  ``_allreduce_embedding_grads`` and DeepSpeed's ``ReduceTiedGrads`` do the same.

`new_embedding_group` creates the embedding groups (collective: every world rank calls it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from paramsync.runtime.collectives.flatten import dtype_groups, flatten, unflatten
from paramsync.runtime.collectives.groups import ProcessGroup, new_group
from paramsync.runtime.collectives.ring import all_reduce, broadcast
from paramsync.runtime.transport.base import Transport

__all__ = ["new_embedding_group", "average_over_dp", "sum_tied", "broadcast_tied"]


async def new_embedding_group(
    world: Transport, pp_groups: Sequence[Sequence[int]], **group_options: Any
) -> ProcessGroup | None:
    """Create, for every pipeline group (world ranks in pipeline order, as
    ``mesh.groups("pp")`` lists them), the group of its first and last rank; return this rank's,
    or None (not a first or last pipeline rank, or pp_size 1). Every world rank calls this alike,
    with the same ``pp_groups``, in the same order of group creations (`new_group`)."""
    mine = None
    for ranks in pp_groups:
        if len(ranks) < 2:
            continue
        group = await new_group(world, [ranks[0], ranks[-1]], **group_options)
        if group is not None:
            mine = group
    return mine


def _grads(params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    """The parameters' gradients, zeros where a gradient is None."""
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def _set_grads(params: Sequence[nn.Parameter], flat: torch.Tensor) -> None:
    """Write ``flat`` (as `flatten` made it from `_grads`) back into the gradients."""
    with torch.no_grad():
        for p, value in zip(params, unflatten(flat, params), strict=True):
            if p.grad is None:
                p.grad = value.clone()
            else:
                p.grad.copy_(value)


def _by_dtype(params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
    return [[params[index] for index in group] for group in dtype_groups(params)]


async def average_over_dp(dp_group: Transport | None, params: Sequence[nn.Parameter]) -> None:
    """Average ``params``' gradients over ``dp_group`` in place (a None gradient counts as
    zeros and ends as the average). Every replica passes the same parameters in the same order;
    nothing happens for a group of one or None."""
    if dp_group is None or dp_group.world_size == 1 or not params:
        return
    for same_dtype in _by_dtype(params):
        flat = flatten(_grads(same_dtype))
        await all_reduce(dp_group, flat, "avg")
        _set_grads(same_dtype, flat)


async def sum_tied(embedding_group: Transport | None, params: Sequence[nn.Parameter]) -> None:
    """Sum the tied weights' gradients over the embedding group (first and last stage), so both
    copies get the whole gradient. ``params``: this rank's copies, in the order both ranks
    agree on."""
    if embedding_group is None or embedding_group.world_size == 1 or not params:
        return
    for same_dtype in _by_dtype(params):
        flat = flatten(_grads(same_dtype))
        await all_reduce(embedding_group, flat, "sum")
        _set_grads(same_dtype, flat)


async def broadcast_tied(embedding_group: Transport | None, params: Sequence[nn.Parameter]) -> None:
    """Make the last stage's copies of the tied weights equal the first stage's (group rank 0):
    once, before training, as Megatron's initial embedding broadcast."""
    if embedding_group is None or embedding_group.world_size == 1 or not params:
        return
    for p in params:
        value = p.detach().clone().contiguous()
        await broadcast(embedding_group, value, root=0, in_place=True)  # a copy of its own
        with torch.no_grad():
            p.copy_(value)
