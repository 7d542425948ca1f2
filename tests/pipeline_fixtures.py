"""Helpers for the pipeline tests: a small transformer as blocks, its single-process reference,
and hand-written action lists with the sends and receives lowered in (GPipe with backwards in
either order, 1F1B with the weight gradients split off and deferred, torch's looped
breadth-first): orders `paramsync.runtime.parallel.schedules.build_schedule` does not generate,
which the executor must run to the same bits."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from paramsync.runtime.parallel.actions import Action, ActionKind

VOCAB, D_MODEL, HEADS, SEQ = 13, 16, 2, 6
MICRO_BATCH = 2
"""Sequences per micro-batch."""


class Head(nn.Module):
    """The LM head: a norm and a projection to the vocabulary (``proj.weight`` may be tied)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D_MODEL)
        self.proj = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def transformer_blocks(layers: int, *, tied: bool = False, seed: int = 0) -> nn.Sequential:
    """Embedding, ``layers`` encoder layers (dropout 0), head: ``layers + 2`` blocks."""
    torch.manual_seed(seed)
    blocks: list[nn.Module] = [nn.Embedding(VOCAB, D_MODEL)]
    for _ in range(layers):
        blocks.append(
            nn.TransformerEncoderLayer(
                D_MODEL, HEADS, dim_feedforward=32, dropout=0.0, batch_first=True
            )
        )
    head = Head()
    if tied:
        head.proj.weight = blocks[0].weight
    blocks.append(head)
    return nn.Sequential(*blocks)


TIED = [("0.weight", "{last}.proj.weight")]


def tied_names(blocks: nn.Sequential) -> list[tuple[str, str]]:
    return [(first, last.format(last=len(blocks) - 1)) for first, last in TIED]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batches(steps: int, microbatches: int, replicas: int = 1, seed: int = 1):
    """Per step, per dp replica: (inputs, targets), lists of ``microbatches`` micro-batches."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(replicas):
            ids = torch.randint(0, VOCAB, (microbatches, MICRO_BATCH, SEQ + 1), generator=generator)
            step.append((list(ids[:, :, :-1]), list(ids[:, :, 1:])))
        out.append(step)
    return out


def make_optimizer(params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum. Not Adam: the attention's key bias has a gradient that is zero up to
    rounding noise (softmax ignores a shift of every score), and Adam scales that noise to
    lr-sized steps, so a last-bit difference in summation order (tied embeddings) would show
    as a 1e-2 difference in the weights: a property of Adam, not of the pipeline."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference_training(
    model: nn.Sequential, data: list, steps: int
) -> tuple[nn.Sequential, list[float]]:
    """One process: per step, per replica, the micro-batches in order with loss / m, replicas'
    gradients averaged (summed in replica order, divided by the count), then the optimizer."""
    model = copy.deepcopy(model)
    optimizer = make_optimizer(list(model.parameters()))
    losses = []
    for step in range(steps):
        replica_grads = []
        replica_losses = []
        for inputs, targets in data[step]:
            optimizer.zero_grad(set_to_none=True)
            m = len(inputs)
            total = []
            for x, y in zip(inputs, targets, strict=True):
                loss = loss_fn(model(x), y)
                (loss / m).backward()
                total.append(float(loss.detach()))
            replica_losses.append(sum(total) / m)
            replica_grads.append([p.grad.clone() for p in model.parameters()])
        for index, p in enumerate(model.parameters()):
            grad = replica_grads[0][index].clone()
            for other in replica_grads[1:]:
                grad.add_(other[index])
            if len(replica_grads) > 1:
                grad.div_(len(replica_grads))
            p.grad = grad
        optimizer.step()
        losses.append(replica_losses[0])
    return model, losses


# ------------------------------------------------------------------------ hand-written schedules


def lower(compute: list[Action], pp: int, num_stages: int) -> list[Action]:
    """Insert the receives before and the sends after each compute action (stage s on rank
    s % p; a neighbour on this very rank needs neither)."""
    out: list[Action] = []
    for action in compute:
        s, i, rank = action.stage, action.microbatch, action.stage % pp
        kind = action.kind
        if kind is ActionKind.FORWARD and s > 0 and (s - 1) % pp != rank:
            out.append(Action(ActionKind.RECV_ACTIVATION, s - 1, i, (s - 1) % pp))
        if kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and s < num_stages - 1:
            if (s + 1) % pp != rank:
                out.append(Action(ActionKind.RECV_GRADIENT, s + 1, i, (s + 1) % pp))
        out.append(action)
        if kind is ActionKind.FORWARD and s < num_stages - 1 and (s + 1) % pp != rank:
            out.append(Action(ActionKind.SEND_ACTIVATION, s, i, (s + 1) % pp))
        if kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and s > 0:
            if (s - 1) % pp != rank:
                out.append(Action(ActionKind.SEND_GRADIENT, s, i, (s - 1) % pp))
    return out


F, B, BI, BW = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)


def gpipe(pp: int, m: int, *, reverse_backward: bool = False) -> list[list[Action]]:
    order = range(m - 1, -1, -1) if reverse_backward else range(m)
    return [
        lower([Action(F, r, i) for i in range(m)] + [Action(B, r, i) for i in order], pp, pp)
        for r in range(pp)
    ]


def one_f_one_b(pp: int, m: int, *, split: bool = False) -> list[list[Action]]:
    """1F1B (warm-up p - r - 1 forwards); ``split``: each B as I, and the W's deferred to the
    end of the list in ascending order (a valid, if unambitious, zero-bubble-style list)."""
    lists = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        compute = [Action(F, r, i) for i in range(warmup)]
        f, b = warmup, 0
        while b < m:
            if f < m:
                compute.append(Action(F, r, f))
                f += 1
            compute.append(Action(BI if split else B, r, b))
            b += 1
        if split:
            compute += [Action(BW, r, i) for i in range(m)]
        lists.append(lower(compute, pp, pp))
    return lists


def looped_bfs(pp: int, m: int, v: int) -> list[list[Action]]:
    """torch's ScheduleLoopedBFS: each rank forwards all micro-batches of its chunks in stage
    order, then backs them in reverse stage order."""
    stages = pp * v
    lists = []
    for r in range(pp):
        mine = [r + c * pp for c in range(v)]
        compute = [Action(F, s, i) for s in mine for i in range(m)]
        compute += [Action(B, s, i) for s in reversed(mine) for i in range(m)]
        lists.append(lower(compute, pp, stages))
    return lists
