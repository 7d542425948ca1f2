"""Split backward benchmark: zero-bubble's I + W against one whole backward B, on one stage.

ZB-H1 only helps if splitting a stage's backward into the input gradient (I) and the weight
gradients (W) costs no more than the whole backward (B). This times, on one pipeline stage, per
micro-batch (forward untimed before each):

- ``B``: ``torch.autograd.grad`` over the stage input and every weight at once;
- ``I`` and ``W``: `paramsync.actors.parallel.split_backward` (W from the gradients kept at the
  joints);
- ``I+W (rewalk)``: what the executor did before: I as ``autograd.grad`` over the input keeping
  the graph, W as ``autograd.grad`` over the weights from the output again (the
  activation-gradient chain walked twice);
- ``torch I+W``: torch.distributed.pipelining's own ``stage_backward_input`` and
  ``stage_backward_weight`` (the reference design), for comparison;
- ``F``: the forward alone.

Two stages: ``mlp`` (half of the pipeline benchmark's model: 4 x (Linear(1024, 1024) + ReLU),
micro-batches of 32 rows) and ``transformer`` (2 ``nn.TransformerEncoderLayer`` of d_model 256,
4 heads, feed-forward 1024, dropout 0, micro-batches of 8 sequences of 64). One intra-op
thread; intervals on the thread's CPU clock by default (``--clock wall`` for elapsed time).
Each quantity's median over ``--repeats`` repetitions; the kinds alternate within a
repetition so drift in the machine's load hits all alike. The gradients of both splits are
checked equal to B's, bit for bit.

    python benchmarks/split_backward.py
    python benchmarks/split_backward.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paramsync.actors.parallel.split_backward import backward_input


def _mlp_stage(quick: bool) -> tuple[nn.Module, torch.Tensor]:
    width, rows = (256, 16) if quick else (1024, 32)
    torch.manual_seed(0)
    chunk = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(4)))
    return chunk, torch.randn(rows, width)


def _transformer_stage(quick: bool) -> tuple[nn.Module, torch.Tensor]:
    d_model, seqs, length = (64, 4, 16) if quick else (256, 8, 64)
    torch.manual_seed(0)
    chunk = nn.Sequential(
        *(
            nn.TransformerEncoderLayer(
                d_model, 4, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
            )
            for _ in range(2)
        )
    )
    return chunk, torch.randn(seqs, length, d_model)


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
CLOCK = time.thread_time
"""The clock every interval is taken on (``--clock``): the thread's CPU time by default, which
the other processes of a loaded machine do not inflate (they do inflate wall time)."""

STAGES = {"mlp": _mlp_stage, "transformer": _transformer_stage}


def _forward(chunk: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xi = x.detach().clone().requires_grad_(True)
    return xi, chunk(xi)


def _time_stage(chunk: nn.Module, x: torch.Tensor, grad: torch.Tensor, repeats: int) -> dict:
    params = list(chunk.parameters())
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    keys = ("F", "B", "I", "W", "I_rewalk", "W_rewalk", "I_torch", "W_torch")
    times: dict[str, list[float]] = {k: [] for k in keys}
    reference = None
    for repeat in range(repeats + 1):  # the first repetition warms up, untimed
        # F and B
        xi = x.detach().clone().requires_grad_(True)
        start = CLOCK()
        out = chunk(xi)
        forward = CLOCK() - start
        start = CLOCK()
        whole = torch.autograd.grad([out], [xi, *params], [grad])
        b = CLOCK() - start
        del out
        # I then W (split_backward)
        xi, out = _forward(chunk, x)
        start = CLOCK()
        input_grad, weights = backward_input(out, grad, xi, params)
        i = CLOCK() - start
        del out
        start = CLOCK()
        weight_grads = weights.compute()
        w = CLOCK() - start
        # I then W walking the chain twice (the executor before)
        xi, out = _forward(chunk, x)
        start = CLOCK()
        (old_input,) = torch.autograd.grad([out], [xi], [grad], retain_graph=True)
        i_old = CLOCK() - start
        start = CLOCK()
        old_weights = torch.autograd.grad([out], params, [grad])
        w_old = CLOCK() - start
        del out
        # torch's own split (it accumulates into .grad: cleared before and after)
        xi, out = _forward(chunk, x)
        start = CLOCK()
        _, param_groups = stage_backward_input([out], [grad], [xi], iter(params))
        i_torch = CLOCK() - start
        start = CLOCK()
        stage_backward_weight(iter(params), param_groups)
        w_torch = CLOCK() - start
        del out
        for p in params:
            p.grad = None
        if reference is None:
            reference = whole
            for name, got in (
                ("split", (input_grad, *weight_grads)),
                ("rewalk", (old_input, *old_weights)),
            ):
                for index, (e, g) in enumerate(zip(whole, got, strict=True)):
                    if g is None or not torch.equal(e, g):
                        raise SystemExit(f"{name}: gradient {index} differs from B's")
        if repeat == 0:
            continue
        for key, value in (
            ("F", forward),
            ("B", b),
            ("I", i),
            ("W", w),
            ("I_rewalk", i_old),
            ("W_rewalk", w_old),
            ("I_torch", i_torch),
            ("W_torch", w_torch),
        ):
            times[key].append(value)
    med = {k: statistics.median(v) for k, v in times.items()}
    # per-repetition sums, then their median (I and W of one micro-batch belong together)
    med["I+W"] = statistics.median(a + b for a, b in zip(times["I"], times["W"], strict=True))
    for tail in ("rewalk", "torch"):
        med[f"I+W_{tail}"] = statistics.median(
            a + b for a, b in zip(times[f"I_{tail}"], times[f"W_{tail}"], strict=True)
        )
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--stages", nargs="+", choices=sorted(STAGES), default=sorted(STAGES))
    parser.add_argument("--quick", action="store_true", help="small stages, 3 repeats")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: this thread's CPU time (robust to other processes' load); wall: elapsed time",
    )
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 3
    torch.set_num_threads(1)
    global CLOCK
    CLOCK = CLOCKS[args.clock]
    load = os.getloadavg()
    print(
        f"{args.repeats} repeats, {args.clock} clock, 1 thread, {os.cpu_count()} CPUs, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    header = (
        f"{'stage':<12} | {'F':>8} | {'B':>8} | {'I':>8} | {'W':>8} | {'I+W':>8} | "
        f"{'(I+W)/B':>7} | {'rewalk I+W':>10} | {'rewalk/B':>8} | {'torch I+W':>9} | "
        f"{'torch/B':>7}"
    )
    print(header)
    print("-" * len(header))
    out = {}
    for name in args.stages:
        chunk, x = STAGES[name](args.quick)
        with torch.no_grad():
            grad = torch.randn_like(chunk(x))
        med = _time_stage(chunk, x, grad, args.repeats)
        out[name] = med
        ms = {k: v * 1e3 for k, v in med.items()}
        print(
            f"{name:<12} | {ms['F']:>5.2f} ms | {ms['B']:>5.2f} ms | {ms['I']:>5.2f} ms | "
            f"{ms['W']:>5.2f} ms | {ms['I+W']:>5.2f} ms | {med['I+W'] / med['B']:>6.2f}x | "
            f"{ms['I+W_rewalk']:>7.2f} ms | {med['I+W_rewalk'] / med['B']:>7.2f}x | "
            f"{ms['I+W_torch']:>6.2f} ms | {med['I+W_torch'] / med['B']:>6.2f}x"
        )
    print("(medians; I+W: of the per-micro-batch sums; rewalk: W from the output again)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"load_average": list(load), "clock": args.clock, "stages": out}, indent=2)
        )


if __name__ == "__main__":
    main()
