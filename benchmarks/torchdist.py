"""The identical-state proof's cost a step under torch's own parallelisms on the ``paramsync``
backend: HSDP (``fully_shard`` on a 2-D mesh, 2 replicas x 2 shards) and tensor parallelism
(``parallelize_module``, replicated LayerNorms), the proof on and off, gloo beside them.

The same torch program runs on each system, one OS process per rank on this machine, one
intra-op thread per rank, the same weights and batches: ``gloo``, ``paramsync`` (the proof on,
its default: the replicated shards or LayerNorms and their optimizer state hashed and compared
after every optimizer step) and ``paramsync, proof off`` (``PARAMSYNC_STATE_PROOF=0``). Rank 0
takes the time between the ends of consecutive steps after ``--warmup`` untimed ones. The
systems alternate round by round (the order reversed every other round); a ratio is the median
over rounds of each round's ratio of median step times. The proof's cost is
``paramsync / proof off`` (target: at most 1.02); its hashing, which runs in the optimizer's
step (torch's step post-hook), is the median ``optimizer.step()`` time with the proof on less
with it off, also given as a share of the step (the report to the coordinator is queued, not
waited for).

    python benchmarks/torchdist.py --rounds 3 --json out/torchdist.json
    python benchmarks/torchdist.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GLOO, PARAMSYNC, NO_PROOF = "gloo", "paramsync", "paramsync-noproof"
LABELS = {GLOO: "gloo", PARAMSYNC: "paramsync", NO_PROOF: "paramsync, proof off"}
WORLDS = {"hsdp": 4, "tp": 2}
LAUNCH_SECONDS = 600.0


def _model(args: argparse.Namespace) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(args.seed)
    d = args.width
    blocks = [
        torch.nn.Sequential(
            torch.nn.Linear(d, 4 * d),
            torch.nn.GELU(),
            torch.nn.Linear(4 * d, d),
            torch.nn.LayerNorm(d),
        )
        for _ in range(args.layers)
    ]
    model = torch.nn.Sequential(*blocks)
    world = WORLDS[args.scenario]
    if args.scenario == "hsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan: dict[str, Any] = {}
    for index in range(len(blocks)):
        plan[f"{index}.0"] = ColwiseParallel()
        plan[f"{index}.2"] = RowwiseParallel(use_local_output=False)
    parallelize_module(model, mesh, plan)
    for block in blocks:
        distribute_module(block[3], mesh)  # the LayerNorms: Replicate
    return model


def _run_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo" if args.worker == GLOO else "paramsync",
        init_method=f"file://{args.store}",
        rank=args.rank,
        world_size=WORLDS[args.scenario],
        timeout=timedelta(seconds=120),
    )
    model = _model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # The tensor-parallel ranks share a batch; HSDP's data-parallel ranks each have their own.
    seed = 0 if args.scenario == "tp" else args.rank
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(args.batch_size, args.width, generator=gen)
    y = torch.randn(args.batch_size, args.width, generator=gen)
    ends, optimizer_steps = [], []
    for _ in range(args.warmup + args.steps):
        optimizer.zero_grad()
        out = model(x)
        out = out.to_local() if hasattr(out, "to_local") else out
        loss = torch.nn.functional.mse_loss(out, y)
        loss.backward()
        started = time.perf_counter()
        optimizer.step()  # the proof's hashing runs in it, in torch's step post-hook
        ends.append(time.perf_counter())
        optimizer_steps.append(ends[-1] - started)
    steps = [b - a for a, b in zip(ends[args.warmup :], ends[args.warmup + 1 :])]
    if args.rank == 0:
        params = sum(p.numel() for p in model.parameters())
        result = {"step_seconds": steps, "optimizer_seconds": optimizer_steps[args.warmup :]}
        print(json.dumps({**result, "loss": loss.item(), "params": params}))
    dist.barrier()
    dist.destroy_process_group()


def _launch(system: str, args: argparse.Namespace) -> dict:
    world = WORLDS[args.scenario]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
    )
    env.setdefault("PARAMSYNC_SECRET", secrets.token_hex(16))
    if system == NO_PROOF:
        env["PARAMSYNC_STATE_PROOF"] = "0"
    with tempfile.TemporaryDirectory(prefix="paramsync-torchdist-bench-") as tmp:
        flags = [
            "--scenario", args.scenario, "--store", str(Path(tmp) / "store"),
            "--width", str(args.width), "--layers", str(args.layers),
            "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--seed", str(args.seed),
        ]  # fmt: skip
        logs = [Path(tmp) / f"rank{rank}.err" for rank in range(world)]
        out_path = Path(tmp) / "rank0.out"
        procs = []
        with open(out_path, "w") as out:
            for rank in range(world):
                cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", system]
                cmd += ["--rank", str(rank), *flags]
                with open(logs[rank], "w") as err:
                    stdout = out if rank == 0 else subprocess.DEVNULL
                    procs.append(subprocess.Popen(cmd, env=env, stdout=stdout, stderr=err))
        deadline = time.monotonic() + LAUNCH_SECONDS
        for rank, proc in enumerate(procs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                for other in procs:
                    if other.poll() is None:
                        other.kill()
                        other.wait()
                raise RuntimeError(
                    f"{system} ({args.scenario}): rank {rank} ended with {code}:\n"
                    + logs[rank].read_text()[-3000:]
                )
        result: dict = json.loads(out_path.read_text().strip().splitlines()[-1])
        return result


def _summarise(runs: dict[str, list[dict]], systems: list[str]) -> dict:
    medians = {s: [statistics.median(r["step_seconds"]) for r in runs[s]] for s in systems}
    row: dict = {}
    for system in systems:
        row[system] = {
            "median_step_seconds": statistics.median(
                t for r in runs[system] for t in r["step_seconds"]
            ),
            "round_median_step_seconds": medians[system],
            "median_optimizer_step_seconds": statistics.median(
                t for r in runs[system] for t in r["optimizer_seconds"]
            ),
            "final_loss": runs[system][-1]["loss"],
        }
        if system != GLOO:
            ratios = [a / b for a, b in zip(medians[system], medians[GLOO])]
            row[system]["ratio_to_gloo"] = statistics.median(ratios)
    proof = [a / b for a, b in zip(medians[PARAMSYNC], medians[NO_PROOF])]
    # The hashing's own time: the optimizer step with the proof on, less with it off.
    hashing = (
        row[PARAMSYNC]["median_optimizer_step_seconds"]
        - row[NO_PROOF]["median_optimizer_step_seconds"]
    )
    row["proof_cost"] = {
        "round_ratios": proof,
        "ratio": statistics.median(proof),
        "hashing_seconds": hashing,
        "hashing_share": hashing / row[PARAMSYNC]["median_step_seconds"],
    }
    row["params"] = runs[PARAMSYNC][0]["params"]
    return row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", choices=tuple(WORLDS), default=list(WORLDS))
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per system")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument("--width", type=int, default=256, help="the model's width")
    parser.add_argument("--layers", type=int, default=4, help="MLP blocks, each with a LayerNorm")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1 round of 8 steps: a smoke run")
    parser.add_argument("--json", type=Path, help="write the table as JSON here")
    parser.add_argument("--worker", choices=tuple(LABELS), help=argparse.SUPPRESS)
    parser.add_argument("--scenario", choices=tuple(WORLDS), help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.worker:
        _run_worker(args)
        return
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 8, 2
    systems = [GLOO, PARAMSYNC, NO_PROOF]
    table = {}
    for scenario in args.scenarios:
        args.scenario = scenario
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        for round_index in range(args.rounds):
            order = systems if round_index % 2 == 0 else systems[::-1]
            for system in order:
                runs[system].append(_launch(system, args))
        table[scenario] = _summarise(runs, systems)
    print(
        f"{'median step (ms)':<34}" + "".join(f"{LABELS[s]:>22}" for s in systems) + "   proof cost"
    )
    for scenario, row in table.items():
        name = f"{scenario}, {WORLDS[scenario]} ranks ({row['params']} params)"
        cells = "".join(
            f"{row[s]['median_step_seconds'] * 1e3:>14.2f}"
            + (f" (x{row[s]['ratio_to_gloo']:.3f})" if s != GLOO else " " * 8)
            for s in systems
        )
        cost = row["proof_cost"]
        hashing = f"{cost['hashing_seconds'] * 1e3:.2f} ms ({cost['hashing_share'] * 100:.2f} %)"
        print(f"{name:<34}{cells}   x{cost['ratio']:.4f}   {hashing}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rounds": args.rounds, "table": table}, indent=2))


if __name__ == "__main__":
    main()
