"""Cross-entropy over vocabulary-parallel logits, never gathering them.

Each tp rank holds the logits of its vocabulary slice (a column-parallel LM head without
``gather_output``). As Megatron's ``tensor_parallel/cross_entropy.py``, per token:

1. the global maximum logit, for a stable exponent: each rank's maximum is all-gathered (the
   engine's all-reduce sums only) and the largest taken, so every rank subtracts the same value;
2. the target's shifted logit, taken on the rank whose slice holds the target and zero elsewhere,
   and the sum of the exponentials of the slice: both summed in one all-reduce;
3. loss = log(sum of exponentials) - target logit.

Backward needs no communication: the gradient of a slice is its softmax minus the one-hot target
(only on the rank that holds it), times the incoming gradient. So a forward costs one all-gather
of a token-sized vector and one all-reduce of two, whatever the vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from paramsync.actors.parallel.tensor_parallel.layers import partition_range
from paramsync.runtime.collectives.from_thread import SyncCollectives

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        comm: SyncCollectives,
        vocab_size: int,
    ) -> torch.Tensor:
        rows = partition_range(vocab_size, comm.world_size, comm.rank, "vocabulary")
        local_max = logits.max(dim=-1).values.contiguous()
        if comm.world_size > 1:
            global_max = comm.all_gather(local_max).max(dim=0).values
        else:
            global_max = local_max
        shifted = logits - global_max.unsqueeze(-1)
        outside = (target < rows.start) | (target >= rows.stop)
        local_target = (target - rows.start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted = predicted.masked_fill(outside, 0.0)
        exp = shifted.exp()
        both = torch.stack([predicted, exp.sum(dim=-1)])
        comm.all_reduce(both)
        predicted, sum_exp = both[0], both[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), outside, local_target)
        return torch.log(sum_exp) - predicted

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, outside, local_target = ctx.saved_tensors
        grad_logits = softmax.clone()
        hit = (~outside).to(grad_logits.dtype).unsqueeze(-1)
        grad_logits.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        grad_logits.mul_(grad.unsqueeze(-1))
        return grad_logits, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, comm: SyncCollectives, vocab_size: int
) -> torch.Tensor:
    """Per-token cross-entropy (shape of ``target``) from this rank's vocabulary slice of the
    logits (``(*target.shape, vocab_size / tp)``). Take ``.mean()`` for F.cross_entropy's
    default reduction."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(target.shape)} disagree: the "
            "logits must be the targets' shape plus this rank's vocabulary slice"
        )
    rows = partition_range(vocab_size, comm.world_size, comm.rank, "vocabulary")
    if logits.shape[-1] != rows.stop - rows.start:
        raise ValueError(
            f"logits hold {logits.shape[-1]} vocabulary entries; tp rank {comm.rank} of "
            f"{comm.world_size} owns {rows.stop - rows.start} of {vocab_size}"
        )
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= vocab_size):
        raise ValueError(f"targets must lie in 0..{vocab_size - 1}")
    loss: torch.Tensor = _VocabParallelCrossEntropy.apply(logits, target, comm, vocab_size)
    return loss
