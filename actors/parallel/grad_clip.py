"""Gradient clipping by the global norm across the tensor- and pipeline-parallel groups.

The norm is the one the single-device model's ``torch.nn.utils.clip_grad_norm_`` would compute:
each parameter of the whole model counted exactly once (torchtitan 596: a per-rank norm is wrong;
TransformerEngine's 1.36-1.52x inflated norm: replicated parameters counted on every rank).

- A tp shard (``tensor_model_parallel`` set,
  `paramsync.actors.parallel.tensor_parallel.mark_tensor_parallel`) contributes its part on every tp
  rank: the parts are disjoint.
- A parameter replicated across the tp group (LayerNorms, a row-parallel bias, the position
  embedding) has the same gradient on every tp rank and contributes on tp rank 0 only.
- A parameter marked ``tied_duplicate`` (the second copy of a tied embedding on the last
  pipeline stage) contributes nowhere: its owner counts it.
- Pipeline stages hold disjoint parameters, so the tp-summed squares are summed over the pp group
  too; data-parallel replicas hold identical gradients and are not summed.

Then every rank scales all its gradients (replicated ones too) by the same coefficient,
``min(1, max_norm / (norm + 1e-6))`` as torch does. The squares are summed in float64. The
reductions run through `SyncCollectives` (from a compute thread, `clip_grad_norm_`) or the async
collectives (from trio, `clip_grad_norm_async`); the inf-norm takes the maximum by all-gather.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from paramsync.actors.parallel.tensor_parallel.layers import is_tensor_parallel
from paramsync.runtime.collectives.from_thread import SyncCollectives
from paramsync.runtime.collectives.ring import all_gather, all_reduce
from paramsync.runtime.transport.base import Transport

__all__ = [
    "clip_grad_norm_",
    "clip_grad_norm_async",
    "local_norm_part",
    "clip_coefficient",
    "counts_for_norm",
]


def _norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if norm_type != math.inf and norm_type != 2.0:
        raise ValueError(
            f"global-norm clipping supports the 2-norm and the inf-norm, not {norm_type}"
        )
    return norm_type


def counts_for_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank's copy of ``param`` adds to the global norm (each counted once)."""
    if getattr(param, "tied_duplicate", False):
        return False
    return is_tensor_parallel(param) or tp_rank == 0


def local_norm_part(params: list[torch.Tensor], tp_rank: int, norm_type: float) -> torch.Tensor:
    """This rank's part of the global norm, a float64 scalar: the sum of squares of the
    gradients it counts (2-norm) or their largest magnitude (inf-norm)."""
    grads = [p.grad for p in params if p.grad is not None and counts_for_norm(p, tp_rank)]
    if norm_type == math.inf:
        return torch.stack(
            [g.detach().abs().max().double() for g in grads if g.numel()]
            or [torch.zeros((), dtype=torch.float64)]
        ).max()
    total = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        total += grad.detach().double().pow(2).sum()
    return total


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch's clip coefficient: ``max_norm / (total_norm + 1e-6)``, at most 1."""
    return min(1.0, float(max_norm) / (total_norm + 1e-6))


def _scale(params: list[torch.Tensor], coefficient: float) -> None:
    if coefficient < 1.0:
        for param in params:
            if param.grad is not None:
                param.grad.detach().mul_(coefficient)


def _params(parameters: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    unique: dict[int, torch.Tensor] = {}
    for param in parameters:
        unique.setdefault(id(param), param)  # a tied parameter listed twice counts once
    return list(unique.values())


def _finish(part: torch.Tensor, norm_type: float) -> float:
    return float(part) if norm_type == math.inf else math.sqrt(float(part))


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    *,
    tp: SyncCollectives | None = None,
    pp: SyncCollectives | None = None,
    norm_type: float = 2.0,
) -> float:
    """Clip this rank's gradients by the global norm over ``tp`` then ``pp`` (either None when
    the model is not split that way); return the global norm. Every rank of both groups calls
    it with its own parameters. Call it from a compute thread (``tp``/``pp`` are
    `ThreadCollectives`)."""
    norm_type = _norm_type(norm_type)
    params = _params(parameters)
    part = local_norm_part(params, tp.rank if tp is not None else 0, norm_type).reshape(1)
    for comm in (tp, pp):
        if comm is None or comm.world_size == 1:
            continue
        if norm_type == math.inf:
            part = comm.all_gather(part).max().reshape(1)
        else:
            comm.all_reduce(part)
    total = _finish(part, norm_type)
    _scale(params, clip_coefficient(total, max_norm))
    return total


async def clip_grad_norm_async(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    *,
    tp: Transport | None = None,
    pp: Transport | None = None,
    norm_type: float = 2.0,
) -> float:
    """`clip_grad_norm_` from trio, over the tp and pp process groups themselves."""
    norm_type = _norm_type(norm_type)
    params = _params(parameters)
    part = local_norm_part(params, tp.rank if tp is not None else 0, norm_type).reshape(1)
    for group in (tp, pp):
        if group is None or group.world_size == 1:
            continue
        if norm_type == math.inf:
            part = (await all_gather(group, part)).max().reshape(1)
        else:
            await all_reduce(group, part)
    total = _finish(part, norm_type)
    _scale(params, clip_coefficient(total, max_norm))
    return total
