"""Pipeline benchmark: paramsync's pipeline stages against torch.distributed.pipelining (gloo),
and one process alone, same run.

The model is an MLP of ``--blocks`` blocks (Linear(width, width) + ReLU; 8 x 1024 by default),
trained with MSE and SGD on the same data from the same initial weights, a batch of
``--microbatches`` micro-batches (m = 8) of ``--microbatch-size`` rows each, every step:

- ``single``: one process, the whole model, the m micro-batches in order (loss / m, gradients
  accumulated), then the optimizer: the baseline a 2-stage pipeline divides;
- ``paramsync-<schedule>``: two processes joined by `TcpTransport`, each a `PipelineStage`
  (`paramsync.actors.parallel.pipeline`) holding its blocks (half of them; with ``interleaved_1f1b``
  two chunks of a quarter, stages r and r + 2), executing its list of
  `paramsync.runtime.parallel.schedules.build_schedule` with tagged p2p, moved on threads over the
  connections the transport lends (``--p2p threads``, the default: a sender and a receive thread per
  peer, trio never woken per message) or through trio (``--p2p trio``);
- ``torch-<schedule>``: two processes in a gloo process group, each holding the same blocks as
  ``torch.distributed.pipelining.PipelineStage``s, on the same micro-batches: ``gpipe`` and
  ``1f1b`` by ``ScheduleGPipe`` and ``Schedule1F1B``; ``interleaved_1f1b`` by
  ``ScheduleInterleaved1F1B`` with the same 2 stages per rank; ``zero_bubble`` by torch's
  runtime for custom schedules (``_PipelineScheduleRuntime``) fed OUR ZB-H1 compute lists
  (`paramsync.runtime.parallel.schedules.compute_lists`), lowered by torch's own send/receive pass
  and run with torch's own split backward: the same schedule, action for action (torch's own
  zero-bubble schedules, ``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble``, are
  multi-chunk forms, not ZB-H1).

One intra-op thread per process (OMP_NUM_THREADS=1, torch.set_num_threads(1)), CPU only. Per
system, ``--warmup`` untimed steps, then ``--steps`` timed ones; rank 0 takes the time between
the ends of consecutive steps; the table shows the median (pooled over rounds), the ratio of
paramsync's step time to torch's for the same schedule (below 1: paramsync is faster), the
speedup over one process and the fraction of the schedule's ideal speedup reached: the unit-cost
bound p * (1 - bubble) of the simulator (`paramsync.runtime.parallel.simulate`; F = 1, B = 2, I = W
= 1), p * m / (m + p - 1) for GPipe and 1F1B (1.78x for p = 2, m = 8), p * v * m / (v * m + p - 1)
for interleaved with v chunks (1.88x), about a third of 1F1B's bubble for ZB-H1 (1.92x). Next to it,
the simulator's prediction with the costs measured in the single process (F, B, I, W per
micro-batch, on the CPU clock, a stage taking 1/p of them): its bubble fraction and the speedup m *
(F + B) / makespan. And per schedule a ``limit``: both ranks run their lists' compute at once with
no communication at all (a received tensor replaced by one made before the step), each action timed,
and the simulator places those measured actions, every stage with its own costs (the last stage
computes the loss and the input gradient its neighbour needs; stage 0 no input gradient), in the
schedule, plus the slower rank's optimizer step: the fastest step any executor could take with this
machine's compute, as benchmarks/ddp.py's ``limit`` is for data parallelism. ``of limit`` is the
limit's step over a system's. The systems alternate round by round, the order reversed every other
round, so drift in the machine's load hits all alike. Each system prints its final loss: paramsync's
equals the single process's (same arithmetic), torch's agrees to rounding.

    python benchmarks/pipeline.py --json out/pipeline.json
    python benchmarks/pipeline.py --quick
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

from allreduce import _free_port  # the sibling benchmark's helper (same folder)

ROOT = Path(__file__).resolve().parent.parent
PP = 2
SCHEDULES = ("gpipe", "1f1b", "zero_bubble", "interleaved_1f1b")
CHUNKS = {"interleaved_1f1b": 2}
"""Model chunks per rank (v) of each schedule; 1 when not named."""
LAUNCH_SECONDS = 900.0


def ideal_speedup(p: int, m: int) -> float:
    """The bubble-limited best speedup of p stages over one process: p * m / (m + p - 1)."""
    return p * m / (m + p - 1)


def _schedule(schedule: str, m: int):
    from paramsync.runtime.parallel.schedules import build_schedule

    return build_schedule(schedule, PP, m, CHUNKS.get(schedule, 1))


def schedule_ideal_speedup(schedule: str, m: int) -> float:
    """The best speedup of ``schedule`` on PP ranks over one process in the unit-cost model
    (F = 1, B = 2, I = W = 1): PP * (1 - its simulated bubble fraction). GPipe and 1F1B:
    `ideal_speedup`; interleaved with v chunks: p * v * m / (v * m + p - 1)."""
    from paramsync.runtime.parallel.simulate import simulate

    return PP * (1 - float(simulate(_schedule(schedule, m)).bubble_fraction))


def predicted(schedule: str, m: int, costs: dict[str, float]) -> tuple[float, float]:
    """(bubble fraction, speedup over one process) the simulator predicts for ``schedule`` with
    ``costs``: the single process's measured seconds per micro-batch of the whole model for F,
    B, I and W, each stage taking 1 / PP of them (1 / (PP * v) per chunk). The speedup is one
    process's m * (F + B) over the simulated step (the makespan)."""
    from paramsync.runtime.parallel.simulate import simulate

    stage_costs = {kind: costs[kind] / PP for kind in ("F", "B", "I", "W")}
    result = simulate(_schedule(schedule, m), stage_costs)
    single = m * (costs["F"] + costs["B"])
    return float(result.bubble_fraction), single / float(result.makespan)


# ----------------------------------------------------------------------------- workers


def _setup(args: argparse.Namespace):
    """The blocks, the batch (micro-batches of inputs and targets), the loss: the same in every
    system (seeded)."""
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    blocks = nn.Sequential(
        *(nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU()) for _ in range(args.blocks))
    )
    generator = torch.Generator().manual_seed(args.seed + 1)
    rows = args.microbatches * args.microbatch_size
    inputs = torch.randn(rows, args.width, generator=generator)
    targets = torch.randn(rows, args.width, generator=generator)
    return blocks, inputs, targets, nn.MSELoss()


def _optimizer(params, args: argparse.Namespace):
    import torch

    return torch.optim.SGD(params, lr=args.lr)


def _timed(steps: int, warmup: int, step_fn) -> tuple[list[float], float | None]:
    """Run ``warmup + steps`` steps; the times between consecutive step ends (timed steps)."""
    loss = None
    for _ in range(warmup):
        loss = step_fn()
    ends = [time.perf_counter()]
    for _ in range(steps):
        loss = step_fn()
        ends.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(ends)], loss


def _worker_single(args: argparse.Namespace) -> dict:
    blocks, inputs, targets, loss_fn = _setup(args)
    optimizer = _optimizer(blocks.parameters(), args)
    xs, ys = inputs.chunk(args.microbatches), targets.chunk(args.microbatches)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        losses = []
        for x, y in zip(xs, ys, strict=True):
            loss = loss_fn(blocks(x), y)
            (loss / args.microbatches).backward()
            losses.append(float(loss.detach()))
        optimizer.step()
        return math.fsum(losses) / args.microbatches

    seconds, loss = _timed(args.steps, args.warmup, step)
    return {"step_seconds": seconds, "loss": loss, "costs": _measure_costs(blocks, xs, args)}


def _measure_costs(blocks, xs, args: argparse.Namespace) -> dict[str, float]:
    """Median seconds per micro-batch of the whole model's forward F, whole backward B (input
    gradient and weights), and its split halves I and W
    (`paramsync.actors.parallel.split_backward`), the input requiring grad as a middle stage's does:
    the simulator's costs. Taken on this thread's CPU clock (one intra-op thread), which other
    processes' load does not inflate."""
    import torch

    from paramsync.actors.parallel.split_backward import backward_input

    params = list(blocks.parameters())
    grad = torch.ones_like(blocks(xs[0])) / xs[0].numel()
    times: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": []}
    for repeat in range(args.steps + 1):  # the first one warms up
        x = xs[repeat % len(xs)].detach().clone().requires_grad_(True)
        start = time.thread_time()
        out = blocks(x)
        forward = time.thread_time() - start
        start = time.thread_time()
        torch.autograd.grad([out], [x, *params], [grad])
        whole = time.thread_time() - start
        x = x.detach().clone().requires_grad_(True)
        out = blocks(x)
        start = time.thread_time()
        _, weights = backward_input(out, grad, x, params)
        split_input = time.thread_time() - start
        del out
        start = time.thread_time()
        weights.compute()
        split_weight = time.thread_time() - start
        if repeat:
            for key, value in zip("FBIW", (forward, whole, split_input, split_weight), strict=True):
                times[key].append(value)
    return {key: statistics.median(values) for key, values in times.items()}


def _worker_paramsync(args: argparse.Namespace, schedule: str) -> dict:
    import trio

    from paramsync.actors.parallel.pipeline import PipelineStage
    from paramsync.runtime.collectives.ring import barrier
    from paramsync.runtime.config import DistributedConfig
    from paramsync.runtime.parallel.schedules import build_schedule
    from paramsync.runtime.transport.tcp import TcpTransport

    blocks, inputs, targets, loss_fn = _setup(args)
    chunks = CHUNKS.get(schedule, 1)
    actions = build_schedule(schedule, PP, args.microbatches, chunks).actions[args.rank]
    xs, ys = list(inputs.chunk(args.microbatches)), list(targets.chunk(args.microbatches))
    out: dict = {}

    async def main() -> None:
        config = DistributedConfig(PP, args.rank, f"127.0.0.1:{args.port}")
        async with TcpTransport.connect(config, secret=args.secret) as world:
            stage = PipelineStage.from_blocks(
                blocks,
                pp_group=world,
                chunks_per_rank=chunks,
                loss_fn=loss_fn,
                activation_shape=(args.microbatch_size, args.width),
                thread_links=args.p2p == "threads",
            )
            optimizer = _optimizer(stage.parameters(), args)
            first, last = stage.rank == 0, stage.rank == PP - 1

            async def step() -> float | None:
                return await stage.train_step(
                    actions,
                    xs if first else None,
                    ys if last else None,
                    optimizer,
                    microbatches=args.microbatches,
                    broadcast_loss=False,
                )

            loss = None
            for _ in range(args.warmup):
                loss = await step()
            await barrier(world)
            ends = [time.perf_counter()]
            for _ in range(args.steps):
                loss = await step()
                ends.append(time.perf_counter())
            await barrier(world)
            out["step_seconds"] = [b - a for a, b in itertools.pairwise(ends)]
            out["loss"] = loss

    trio.run(main)
    return out


def _my_stages(schedule: str, blocks, args: argparse.Namespace) -> dict:
    """This rank's stages of ``schedule``, in chunk order: stage s = rank + chunk * PP, each an
    equal slice of the blocks (the split every system uses)."""
    num_stages = PP * CHUNKS.get(schedule, 1)
    per = args.blocks // num_stages
    mine = range(args.rank, num_stages, PP)
    return {s: blocks[s * per : (s + 1) * per] for s in mine}


def _torch_runner(schedule: str, blocks, args: argparse.Namespace, loss_fn):
    """torch's schedule object for ``schedule`` on this rank, and the modules it trains.

    gpipe, 1f1b: ``ScheduleGPipe``, ``Schedule1F1B``; interleaved_1f1b:
    ``ScheduleInterleaved1F1B`` with the same 2 stages per rank (r and r + PP); zero_bubble:
    torch's runtime for custom schedules (``_PipelineScheduleRuntime``) given OUR ZB-H1
    compute lists (`paramsync.runtime.parallel.schedules.compute_lists`), which torch lowers with
    its own send/receive pass and runs with its own I/W (``stage_backward_input`` /
    ``stage_backward_weight``): the same schedule, action for action.
    """
    import torch
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )
    from torch.distributed.pipelining.schedules import (
        _Action,
        _ComputationType,
        _PipelineScheduleRuntime,
    )

    from paramsync.runtime.parallel.schedules import compute_lists

    mine = _my_stages(schedule, blocks, args)
    chunks = CHUNKS.get(schedule, 1)
    num_stages = PP * chunks
    modules = list(mine.values())
    stages = [
        PipelineStage(module, s, num_stages, torch.device("cpu")) for s, module in mine.items()
    ]
    m = args.microbatches
    if schedule == "gpipe":
        return ScheduleGPipe(stages[0], m, loss_fn=loss_fn), modules
    if schedule == "1f1b":
        return Schedule1F1B(stages[0], m, loss_fn=loss_fn), modules
    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn), modules
    runner = _PipelineScheduleRuntime(stages, m, loss_fn=loss_fn)
    ours = compute_lists(schedule, PP, m, chunks)
    runner._prepare_schedule_with_comms(
        {
            rank: [
                _Action(a.stage, _ComputationType(a.kind.value), a.microbatch) for a in ours[rank]
            ]
            for rank in range(PP)
        }
    )
    return runner, modules


def _worker_torch(args: argparse.Namespace, schedule: str) -> dict:
    import torch
    import torch.distributed as dist

    blocks, inputs, targets, loss_fn = _setup(args)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    dist.init_process_group("gloo", rank=args.rank, world_size=PP)
    try:
        runner, modules = _torch_runner(schedule, blocks, args, loss_fn)
        optimizer = _optimizer([p for module in modules for p in module.parameters()], args)
        first, last = args.rank == 0, args.rank == PP - 1

        def step() -> float | None:
            optimizer.zero_grad(set_to_none=True)
            losses: list = []
            if first:
                runner.step(inputs)
            elif last:
                runner.step(target=targets, losses=losses)
            optimizer.step()
            return float(torch.stack(losses).detach().mean()) if losses else None

        for _ in range(args.warmup):
            loss = step()
        dist.barrier()
        ends = [time.perf_counter()]
        for _ in range(args.steps):
            loss = step()
            ends.append(time.perf_counter())
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"step_seconds": [b - a for a, b in itertools.pairwise(ends)], "loss": loss}


def _worker_limit(args: argparse.Namespace, schedule: str) -> dict:
    """The schedule's compute with no communication at all: this rank runs its list's FORWARD,
    BACKWARD, BACKWARD_INPUT and BACKWARD_WEIGHT actions in order on its own stages (the same
    blocks as the other systems), a received activation or gradient replaced by a tensor made
    before the step, then its optimizer step; both ranks at once (a gloo barrier before the
    first timed step and after the last only), so that they compete for the cores as the
    pipelines' ranks do. Each action is timed (wall clock): per stage and kind the median over
    the timed steps, and the optimizer step's, are what `paramsync.runtime.parallel.simulate` turns
    into the fastest step any executor could take with this compute on this machine (the limit)."""
    import torch
    import torch.distributed as dist

    from paramsync.actors.parallel.split_backward import backward_input
    from paramsync.runtime.parallel.actions import ActionKind
    from paramsync.runtime.parallel.schedules import build_schedule

    blocks, inputs, targets, loss_fn = _setup(args)
    chunks = CHUNKS.get(schedule, 1)
    num_stages = PP * chunks
    modules = _my_stages(schedule, blocks, args)
    params = {s: list(module.parameters()) for s, module in modules.items()}
    everything = [p for module_params in params.values() for p in module_params]
    optimizer = _optimizer(everything, args)
    actions = [
        a
        for a in build_schedule(schedule, PP, args.microbatches, chunks).actions[args.rank]
        if a.kind.is_compute
    ]
    xs, ys = inputs.chunk(args.microbatches), targets.chunk(args.microbatches)
    m = args.microbatches
    generator = torch.Generator().manual_seed(args.seed + 2 + args.rank)
    shape = (args.microbatch_size, args.width)
    received = [torch.randn(shape, generator=generator) for _ in range(m)]
    grads_in = [torch.randn(shape, generator=generator) / shape[0] for _ in range(m)]

    def accumulate(stage: int, grads) -> None:
        for param, grad in zip(params[stage], grads, strict=True):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad.clone()
            else:
                param.grad.add_(grad)

    def step(times: dict | None) -> None:
        forwards: dict = {}
        for action in actions:
            stage, mb = action.stage, action.microbatch
            last = stage == num_stages - 1
            start = time.perf_counter()
            if action.kind is ActionKind.FORWARD:
                x = xs[mb] if stage == 0 else received[mb].detach().requires_grad_(True)
                with torch.enable_grad():
                    out = modules[stage](x)
                    if last:
                        out = loss_fn(out, ys[mb]) / m
                forwards[(stage, mb)] = [x, out, None]
            else:
                x, out, weights = forwards[(stage, mb)]
                grad_out = None if last else grads_in[mb]
                wants_input = stage > 0
                if action.kind is ActionKind.BACKWARD:
                    targets_ = ([x] if wants_input else []) + params[stage]
                    grads = torch.autograd.grad(
                        [out], targets_, None if grad_out is None else [grad_out]
                    )
                    accumulate(stage, grads[1:] if wants_input else grads)
                    del forwards[(stage, mb)]
                elif action.kind is ActionKind.BACKWARD_INPUT:
                    _, weights = backward_input(
                        out, grad_out, x if wants_input else None, params[stage]
                    )
                    forwards[(stage, mb)] = [x, None, weights]
                else:
                    accumulate(stage, weights.compute())
                    del forwards[(stage, mb)]
            if times is not None:
                times.setdefault((stage, action.kind.value), []).append(time.perf_counter() - start)
        start = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if times is not None:
            times.setdefault("optimizer", []).append(time.perf_counter() - start)

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    dist.init_process_group("gloo", rank=args.rank, world_size=PP)
    try:
        for _ in range(args.warmup):
            step(None)
        dist.barrier()
        times: dict = {}
        ends = [time.perf_counter()]
        for _ in range(args.steps):
            step(times)
            ends.append(time.perf_counter())
        dist.barrier()
    finally:
        dist.destroy_process_group()
    stage_costs: dict = {}
    for key, values in times.items():
        if key != "optimizer":
            stage, kind = key
            stage_costs.setdefault(str(stage), {})[kind] = statistics.median(values)
    return {
        "step_seconds": [b - a for a, b in itertools.pairwise(ends)],
        "loss": None,
        "stage_costs": stage_costs,
        "optimizer_seconds": statistics.median(times["optimizer"]),
    }


def _run_worker(args: argparse.Namespace) -> None:
    system = args.worker
    if system == "single":
        result = _worker_single(args)
    elif system.startswith("paramsync-"):
        result = _worker_paramsync(args, system.removeprefix("paramsync-"))
    elif system.startswith("limit-"):
        result = _worker_limit(args, system.removeprefix("limit-"))
    else:
        result = _worker_torch(args, system.removeprefix("torch-"))
    print(json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- driver


def _model_args(args: argparse.Namespace) -> list[str]:
    return [
        "--width",
        str(args.width),
        "--blocks",
        str(args.blocks),
        "--microbatches",
        str(args.microbatches),
        "--microbatch-size",
        str(args.microbatch_size),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--lr",
        str(args.lr),
        "--seed",
        str(args.seed),
        "--p2p",
        args.p2p,
    ]


def _launch(system: str, args: argparse.Namespace) -> dict:
    """Run one system's processes; return rank 0's step times and the last stage's loss."""
    ranks = 1 if system == "single" else PP
    port = _free_port()
    secret = secrets.token_hex(16)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = []
    for rank in range(ranks):
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", system]
        command += ["--rank", str(rank), "--port", str(port), "--secret", secret]
        command += _model_args(args)
        procs.append(
            subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outputs = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=LAUNCH_SECONDS)
            if proc.returncode != 0:
                raise RuntimeError(f"{system} rank {rank} failed:\n{err[-4000:]}")
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    result = {"step_seconds": outputs[0]["step_seconds"], "loss": outputs[-1]["loss"]}
    if "costs" in outputs[0]:
        result["costs"] = outputs[0]["costs"]
    if "stage_costs" in outputs[0]:
        result["stage_costs"] = {k: v for out in outputs for k, v in out["stage_costs"].items()}
        result["optimizer_seconds"] = max(out["optimizer_seconds"] for out in outputs)
    return result


def limit_step(schedule: str, runs: list[dict], args: argparse.Namespace) -> dict:
    """The limit's step: `paramsync.runtime.parallel.simulate` of the schedule with every stage's
    own measured costs per action (median over the rounds of each round's median), communication
    free, plus the slower rank's optimizer step; the ranks' own compute-only step is kept as
    ``compute_step_seconds``."""
    from paramsync.runtime.parallel.simulate import simulate

    stages = runs[0]["stage_costs"].keys()
    stage_costs = {
        int(stage): {
            kind: statistics.median(run["stage_costs"][stage][kind] for run in runs)
            for kind in runs[0]["stage_costs"][stage]
        }
        for stage in stages
    }
    result = simulate(_schedule(schedule, args.microbatches), stage_costs=stage_costs)
    optimizer = statistics.median(run["optimizer_seconds"] for run in runs)
    busy = [float(b) for b in result.busy]
    return {
        "median_step_seconds": float(result.makespan) + optimizer,
        "compute_step_seconds": statistics.median(s for run in runs for s in run["step_seconds"]),
        "stage_costs_seconds": {str(k): v for k, v in stage_costs.items()},
        "busy_seconds": busy,
        "optimizer_seconds": optimizer,
        "simulated_bubble_fraction": float(result.bubble_fraction),
    }


def _summarise(runs: dict[str, list[dict]], systems: list[str], args: argparse.Namespace) -> dict:
    rows: dict = {}
    for system in systems:
        pooled = [s for run in runs[system] for s in run["step_seconds"]]
        rows[system] = {
            "median_step_seconds": statistics.median(pooled),
            "samples": len(pooled),
            "loss": runs[system][-1]["loss"],
        }
        if system.startswith("limit-"):
            rows[system].update(limit_step(system.removeprefix("limit-"), runs[system], args))
    costs = {
        kind: statistics.median(run["costs"][kind] for run in runs["single"]) for kind in "FBIW"
    }
    rows["single"]["costs_seconds"] = costs
    single = rows["single"]["median_step_seconds"]
    for system in systems:
        if system == "single":
            continue
        schedule = system.split("-", 1)[1]
        row = rows[system]
        row["schedule"] = schedule
        row["chunks_per_rank"] = CHUNKS.get(schedule, 1)
        row["speedup"] = single / row["median_step_seconds"]
        row["ideal_speedup"] = schedule_ideal_speedup(schedule, args.microbatches)
        row["fraction_of_ideal"] = row["speedup"] / row["ideal_speedup"]
        bubble, speedup = predicted(schedule, args.microbatches, costs)
        row["predicted_bubble_fraction"] = bubble
        row["predicted_speedup"] = speedup
        limit = rows.get("limit-" + schedule)
        if limit is not None and not system.startswith("limit-"):
            row["fraction_of_limit"] = limit["median_step_seconds"] / row["median_step_seconds"]
        if system.startswith("paramsync-"):
            torch_row = rows.get("torch-" + schedule)
            if torch_row is not None:
                row["ratio_to_torch"] = (
                    row["median_step_seconds"] / torch_row["median_step_seconds"]
                )
    return {
        "ideal_speedup": ideal_speedup(PP, args.microbatches),
        "costs_seconds": costs,
        "systems": rows,
    }


def _print_table(table: dict, systems: list[str]) -> None:
    header = (
        f"{'system':<26} | {'step':>9} | {'loss':>10} | {'speedup':>7} | {'ideal':>5} | "
        f"{'of ideal':>8} | {'sim bubble':>10} | {'sim speedup':>11} | {'vs torch':>8} | "
        f"{'of limit':>8}"
    )
    print(header)
    print("-" * len(header))
    for system in systems:
        row = table["systems"][system]
        speedup = f"{row['speedup']:.2f}x" if "speedup" in row else "1.00x"
        ideal = f"{row['ideal_speedup']:.2f}x" if "ideal_speedup" in row else "-"
        of_ideal = f"{row['fraction_of_ideal'] * 100:.0f} %" if "fraction_of_ideal" in row else "-"
        bubble = (
            f"{row['predicted_bubble_fraction'] * 100:.1f} %"
            if "predicted_bubble_fraction" in row
            else "-"
        )
        sim = f"{row['predicted_speedup']:.2f}x" if "predicted_speedup" in row else "-"
        versus = f"{row['ratio_to_torch']:.2f}x" if "ratio_to_torch" in row else "-"
        of_limit = f"{row['fraction_of_limit'] * 100:.0f} %" if "fraction_of_limit" in row else "-"
        loss = f"{row['loss']:>10.6f}" if row["loss"] is not None else f"{'-':>10}"
        print(
            f"{system:<26} | {row['median_step_seconds'] * 1e3:>6.1f} ms | {loss} | "
            f"{speedup:>7} | {ideal:>5} | {of_ideal:>8} | {bubble:>10} | {sim:>11} | {versus:>8} | "
            f"{of_limit:>8}"
        )
    costs = table["costs_seconds"]
    print(
        "(step: median time between consecutive step ends on rank 0, pooled over rounds; "
        "speedup: single / system; ideal: the schedule's unit-cost bound PP * (1 - bubble) "
        f"(GPipe and 1F1B p*m/(m+p-1) = {table['ideal_speedup']:.2f}); of ideal: speedup / "
        "ideal; sim bubble, sim speedup: paramsync.runtime.parallel.simulate with the single "
        f"process's measured costs per micro-batch F {costs['F'] * 1e3:.2f} ms, "
        f"B {costs['B'] * 1e3:.2f} ms, I {costs['I'] * 1e3:.2f} ms, "
        f"W {costs['W'] * 1e3:.2f} ms over {PP} stages, "
        "communication free; vs torch: paramsync's step time / torch's for the same schedule, "
        "below 1 is faster; limit: the fastest step any executor could take with this "
        "machine's compute: both ranks run their lists' compute at once with no communication, "
        "each action timed, and paramsync.runtime.parallel.simulate places the measured actions "
        "(stage_costs) in the schedule, plus the slower rank's optimizer step; of limit: the "
        "limit's step / the system's)"
    )
    for system in systems:
        row = table["systems"][system]
        if "busy_seconds" in row:
            busy = ", ".join(f"{b * 1e3:.1f}" for b in row["busy_seconds"])
            print(
                f"{system}: ranks' compute a step {busy} ms (each rank alone, no waiting: "
                f"{row['compute_step_seconds'] * 1e3:.1f} ms on rank 0), optimizer "
                f"{row['optimizer_seconds'] * 1e3:.1f} ms, simulated bubble "
                f"{row['simulated_bubble_fraction'] * 100:.1f} %"
            )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024, help="features of every Linear")
    parser.add_argument("--blocks", type=int, default=8, help="Linear + ReLU blocks (even)")
    parser.add_argument("--microbatches", type=int, default=8, help="m")
    parser.add_argument("--microbatch-size", type=int, default=32, help="rows per micro-batch")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per system")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--p2p",
        choices=("threads", "trio"),
        default="threads",
        help="paramsync's pipeline messages: on threads over lent links, or through trio",
    )
    parser.add_argument(
        "--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES), help="to time"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a seconds-long run: width 128, micro-batches of 4, 1 round of 3 + 1 steps",
    )
    parser.add_argument("--json", type=Path, help="write the table as JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--secret", default="", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.worker:
        _run_worker(args)
        return
    if args.quick:
        args.width, args.microbatch_size, args.rounds, args.steps, args.warmup = 128, 4, 1, 3, 1
    stages = PP * max(CHUNKS.get(schedule, 1) for schedule in args.schedules)
    if args.blocks % stages or args.microbatches < PP or args.microbatches % PP:
        raise SystemExit(
            f"--blocks must be a multiple of {stages} (the stages), --microbatches a multiple "
            f"of {PP}"
        )
    if args.steps < 1 or args.warmup < 1:
        raise SystemExit("--steps and --warmup must be at least 1")
    systems = ["single"]
    for schedule in args.schedules:
        systems += [f"paramsync-{schedule}", f"torch-{schedule}", f"limit-{schedule}"]
    load = os.getloadavg()
    print(
        f"MLP {args.blocks} x Linear({args.width}, {args.width}) + ReLU on {PP} ranks; "
        f"m = {args.microbatches} micro-batches of {args.microbatch_size}; SGD lr {args.lr}; "
        f"{args.warmup} warm-up + {args.steps} timed steps; {args.rounds} rounds; "
        f"{os.cpu_count()} CPUs; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        flush=True,
    )
    runs: dict[str, list[dict]] = {system: [] for system in systems}
    started = time.perf_counter()
    for round_index in range(args.rounds):
        order = systems if round_index % 2 == 0 else systems[::-1]
        for system in order:
            result = _launch(system, args)
            runs[system].append(result)
            print(
                f"round {round_index + 1}/{args.rounds}, {system}: median step "
                f"{statistics.median(result['step_seconds']) * 1e3:.1f} ms"
                + (f", final loss {result['loss']:.6f}" if result["loss"] is not None else ""),
                flush=True,
            )
    table = _summarise(runs, systems, args)
    _print_table(table, systems)
    print(f"total benchmark time {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {
            k: v for k, v in vars(args).items() if k not in ("json", "worker", "rank", "port")
        }
        settings.pop("secret", None)
        table["settings"] = settings
        table["cpu_count"] = os.cpu_count()
        table["load_average"] = list(load)
        args.json.write_text(json.dumps(table, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
