"""Tensor-parallel MLP benchmark: paramsync's layers against torch.distributed.tensor.parallel,
same model, same data, same run.

The model is ``--pairs`` column/row pairs, ``Linear(hidden, ffn)``, GELU, ``Linear(ffn, hidden)``
(default 4 x 1024/4096), on a batch of ``--batch`` rows (default 32); one training step is
forward, ``out.pow(2).mean()``, backward and an SGD step. Systems, each in its own OS processes
with one torch thread per process:

- ``paramsync``: 2 processes, tp=2, `ColumnParallelLinear`/`RowParallelLinear` shards sliced from
  the dense model, collectives over a paramsync TCP world (shared memory off) through
  `ThreadCollectives` from the compute thread (one all-reduce forward and one backward per pair);
- ``paramsync-shm``: the same with the world's shared-memory plane on;
- ``torch``: 2 processes, tp=2, gloo, ``parallelize_module`` with ``ColwiseParallel`` /
  ``RowwiseParallel`` on a 1-d ``DeviceMesh``;
- ``dense``: the whole model in one process (the speed-up's reference).

Every system starts from the same seeded weights and data, and the first step's loss is checked
equal across systems (so the benchmark times the same computation). A round runs every system
once, in an order rotated round by round; a system's step time in a round is the median over its
timed steps of the slowest rank. Reported: medians over rounds, and the per-round ratios'
medians (paramsync / torch: below 1 is faster; dense / tp: the speed-up).

    python benchmarks/tensor_parallel.py --json out/tensor_parallel.json
    python benchmarks/tensor_parallel.py --rounds 1 --steps 5 --hidden 256 --ffn 1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TP = 2
SYSTEMS = ("paramsync", "paramsync-shm", "torch", "dense")
TP_SYSTEMS = ("paramsync", "paramsync-shm", "torch")


# ----------------------------------------------------------------------------- the model


def dense_mlp(args: argparse.Namespace) -> Any:
    """The dense model, its weights drawn from a seeded generator (same in every process)."""
    import torch
    from torch import nn

    layers: list[nn.Module] = []
    for _ in range(args.pairs):
        layers += [nn.Linear(args.hidden, args.ffn), nn.GELU(), nn.Linear(args.ffn, args.hidden)]
    model = nn.Sequential(*layers)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    return model


def batch(args: argparse.Namespace, step: int) -> Any:
    import torch

    return torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(step))


def train(model: Any, args: argparse.Namespace, sync: Any = None) -> dict[str, Any]:
    """Warm-up then timed steps; ``sync()`` (if given) lines the ranks up before timing."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses, times = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup and sync is not None:
            sync()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = model(batch(args, step)).pow(2).mean()
        loss.backward()
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
    return {"step_seconds": times, "first_loss": losses[0], "last_loss": losses[-1]}


# ----------------------------------------------------------------------------- workers


def worker_dense(args: argparse.Namespace) -> dict[str, Any]:
    return train(dense_mlp(args), args)


def worker_paramsync(args: argparse.Namespace, rank: int, shared_memory: bool) -> dict[str, Any]:
    import torch
    import trio
    from torch import nn

    from paramsync.actors.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from paramsync.runtime.collectives.from_thread import ThreadCollectives
    from paramsync.runtime.collectives.ring import all_reduce
    from paramsync.runtime.config import DistributedConfig
    from paramsync.runtime.transport.tcp import TcpTransport

    result: dict[str, Any] = {}

    async def main() -> None:
        config = DistributedConfig(TP, rank, f"127.0.0.1:{args.port}")
        async with TcpTransport.connect(
            config, secret="benchmark-secret-7Hq2vX9pLm", shared_memory=shared_memory
        ) as world:
            if shared_memory and world.shared_memory is None:
                raise RuntimeError("the world's shared-memory plane could not be attached")
            comm = ThreadCollectives(world)
            dense = dense_mlp(args)
            layers: list[nn.Module] = []
            for index in range(0, len(dense), 3):
                layers.append(ColumnParallelLinear.from_dense(dense[index], comm))
                layers.append(nn.GELU())
                layers.append(RowParallelLinear.from_dense(dense[index + 2], comm))
            model = nn.Sequential(*layers)

            def sync() -> None:
                comm.all_reduce(torch.zeros(1))

            result.update(await trio.to_thread.run_sync(train, model, args, sync))
            await all_reduce(world, torch.zeros(1))  # no rank closes while another works

    trio.run(main)
    return result


def worker_torch(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=TP
    )
    try:
        mesh = init_device_mesh("cpu", (TP,))
        model = dense_mlp(args)
        plan: dict[str, Any] = {}
        for index in range(0, len(model), 3):
            plan[str(index)] = ColwiseParallel()
            plan[str(index + 2)] = RowwiseParallel()
        model = parallelize_module(model, mesh, plan)
        result = train(model, args, dist.barrier)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return result


def run_worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    if args.worker == "dense":
        result = worker_dense(args)
    elif args.worker == "torch":
        result = worker_torch(args, args.rank)
    else:
        result = worker_paramsync(args, args.rank, args.worker == "paramsync-shm")
    print(json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- driver


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _model_flags(args: argparse.Namespace) -> list[str]:
    flags = ("hidden", "ffn", "pairs", "batch", "warmup", "steps", "lr")
    return [item for flag in flags for item in (f"--{flag}", str(getattr(args, flag)))]


def launch(system: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one system's processes; return its step time (slowest rank's median) and losses."""
    ranks = 1 if system == "dense" else TP
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                system,
                "--rank",
                str(rank),
                "--port",
                str(port),
                *_model_flags(args),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(ranks)
    ]
    results = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{system} rank {rank} failed:\n{err}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    slowest = [max(times) for times in zip(*(r["step_seconds"] for r in results), strict=True)]
    return {
        "step_seconds": statistics.median(slowest),
        "first_loss": results[0]["first_loss"],
        "last_loss": results[0]["last_loss"],
    }


def check_losses(rounds: list[dict[str, dict]], rel: float = 1e-4) -> None:
    """Every system's first loss equals the dense model's (same weights, same data)."""
    for index, entry in enumerate(rounds):
        reference = entry["dense"]["first_loss"] if "dense" in entry else None
        for system, cell in entry.items():
            if reference is None:
                reference = cell["first_loss"]
            if abs(cell["first_loss"] - reference) > rel * abs(reference):
                raise SystemExit(
                    f"round {index + 1}: {system}'s first loss {cell['first_loss']} differs from "
                    f"{reference}: the systems do not compute the same model"
                )


def summarise(rounds: list[dict[str, dict]]) -> dict[str, Any]:
    """Medians over rounds of each system's step time, and medians of per-round ratios."""
    systems = [s for s in SYSTEMS if all(s in r for r in rounds)]
    table: dict[str, Any] = {
        s: {"step_seconds": statistics.median(r[s]["step_seconds"] for r in rounds)}
        for s in systems
    }
    for ours in ("paramsync", "paramsync-shm"):
        if ours in systems and "torch" in systems:
            table[ours]["ratio_to_torch"] = statistics.median(
                r[ours]["step_seconds"] / r["torch"]["step_seconds"] for r in rounds
            )
    if "dense" in systems:
        for system in systems:
            if system != "dense":
                table[system]["speedup_over_dense"] = statistics.median(
                    r["dense"]["step_seconds"] / r[system]["step_seconds"] for r in rounds
                )
    return table


def print_table(table: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"MLP {args.pairs} x Linear({args.hidden}, {args.ffn}) / Linear({args.ffn}, "
        f"{args.hidden}), batch {args.batch}, tp={TP}, {args.steps} timed steps x "
        f"{args.rounds} rounds, one torch thread per process"
    )
    print(f"{'system':>14} | {'step ms':>9} | {'vs torch':>8} | {'vs dense':>8}")
    for system, row in table.items():
        ratio = row.get("ratio_to_torch")
        speedup = row.get("speedup_over_dense")
        print(
            f"{system:>14} | {row['step_seconds'] * 1e3:>9.2f} | "
            f"{(f'{ratio:.2f}x' if ratio else '-'):>8} | "
            f"{(f'{speedup:.2f}x' if speedup else '-'):>8}"
        )
    print("(vs torch: step time / torch's, median of per-round ratios, below 1 is faster; "
          "vs dense: dense step time / this one's)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--json", type=Path, help="write the rounds and the table here")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    for name in ("hidden", "ffn", "pairs", "batch", "steps", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.ffn % TP:
        raise SystemExit(f"--ffn {args.ffn} does not split over tp={TP}")
    rounds: list[dict[str, dict]] = []
    for index in range(args.rounds):
        shift = index % len(args.systems)
        order = args.systems[shift:] + args.systems[:shift]
        rounds.append({system: launch(system, args) for system in order})
        print(f"round {index + 1}/{args.rounds} done", flush=True)
    check_losses(rounds)
    table = summarise(rounds)
    print_table(table, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "cpu_count": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "args": {k: v for k, v in vars(args).items() if k not in ("json", "worker")},
            "rounds": rounds,
            "table": table,
        }
        args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
