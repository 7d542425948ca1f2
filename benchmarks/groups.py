"""Process-group benchmark: two groups of 2 all-reducing at the same time, paramsync against
torch.distributed ``new_group`` on gloo, same run.

Four OS processes on this machine's loopback form one world; every rank creates the groups
{0, 1} and {2, 3} (all ranks call both creations, as both libraries require) and then
all-reduces float32 tensors in its own group, both groups at once. ``paramsync`` is the groups'
own TCP meshes (shared memory off), ``paramsync-shm`` the same groups with a shared-memory plane
each (`paramsync.runtime.collectives.groups`), ``gloo`` torch's ``new_group`` on gloo. For each
size, after a world barrier, each rank times back-to-back all-reduces; a repeat's time is the
slowest rank's (the moment both groups are done). Reported: the median over repeats and rounds, the
bus bandwidth per group (algbw x 2(k-1)/k with k = 2, i.e. the algbw), and each paramsync system's
bus-bandwidth ratio to gloo (above 1: faster; the JSON also has the time ratio). The systems
alternate round by round, order rotated, so drift in machine load hits all alike (as in
``benchmarks/allreduce.py``).

    python benchmarks/groups.py --json out/groups.json
    python benchmarks/groups.py --rounds 1 --repeats 2 --sizes 65536 1048576
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

from allreduce import _free_port, _human  # the sibling benchmark's helpers (same folder)

ROOT = Path(__file__).resolve().parent.parent
WORLD = 4
GROUPS = ([0, 1], [2, 3])
DEFAULT_SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
SYSTEMS = ("gloo", "paramsync", "paramsync-shm")


def _iterations(nbytes: int) -> int:
    """Enough back-to-back operations that one repeat takes a measurable while."""
    if nbytes <= 64 * 1024:
        return 100
    if nbytes <= 2 << 20:
        return 20
    if nbytes <= 32 << 20:
        return 5
    return 2


# ----------------------------------------------------------------------------- workers


def _worker_gloo(rank: int, port: int, sizes: list[int], repeats: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    groups = [dist.new_group(ranks) for ranks in GROUPS]
    mine = groups[0] if rank in GROUPS[0] else groups[1]
    rows = []
    try:
        for nbytes in sizes:
            tensor = torch.ones(nbytes // 4, dtype=torch.float32)
            iters = _iterations(nbytes)
            dist.all_reduce(tensor, group=mine)  # warm-up: connections, buffers
            for repeat in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(tensor, group=mine)
                elapsed = (time.perf_counter() - start) / iters
                rows.append({"bytes": nbytes, "repeat": repeat, "seconds": elapsed})
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return rows


def _worker_paramsync(
    rank: int, port: int, sizes: list[int], repeats: int, shared_memory: bool
) -> list[dict]:
    import torch
    import trio

    from paramsync.runtime.collectives.groups import new_group
    from paramsync.runtime.collectives.ring import all_reduce, barrier
    from paramsync.runtime.config import DistributedConfig
    from paramsync.runtime.transport.tcp import TcpTransport

    rows: list[dict] = []

    async def main() -> None:
        config = DistributedConfig(WORLD, rank, f"127.0.0.1:{port}")
        async with TcpTransport.connect(
            config, secret="benchmark-secret-7Hq2vX9pLm", shared_memory=False
        ) as world:
            groups = [
                await new_group(world, ranks, shared_memory=shared_memory) for ranks in GROUPS
            ]
            mine = next(group for group in groups if group is not None)
            if shared_memory and mine.shared_memory is None:
                raise RuntimeError("the group's shared-memory plane could not be attached")
            async with mine:
                for nbytes in sizes:
                    tensor = torch.ones(nbytes // 4, dtype=torch.float32)
                    iters = _iterations(nbytes)
                    await all_reduce(mine, tensor)
                    for repeat in range(repeats):
                        await barrier(world)
                        start = time.perf_counter()
                        for _ in range(iters):
                            await all_reduce(mine, tensor)
                        elapsed = (time.perf_counter() - start) / iters
                        rows.append({"bytes": nbytes, "repeat": repeat, "seconds": elapsed})
                await barrier(world)

    trio.run(main)
    return rows


def _run_worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    if args.worker == "gloo":
        rows = _worker_gloo(args.rank, args.port, args.sizes, args.repeats)
    else:
        shm = args.worker == "paramsync-shm"
        rows = _worker_paramsync(args.rank, args.port, args.sizes, args.repeats, shm)
    print(json.dumps(rows), flush=True)


# ----------------------------------------------------------------------------- driver


def _launch(system: str, sizes: list[int], repeats: int) -> list[list[dict]]:
    """Run one system's four workers; return every rank's rows."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = []
    for rank in range(WORLD):
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            system,
            "--rank",
            str(rank),
            "--port",
            str(port),
            "--repeats",
            str(repeats),
            "--sizes",
            *map(str, sizes),
        ]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outputs = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{system} worker {rank} failed:\n{err}")
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    return outputs


def _slowest(per_rank: list[list[dict]]) -> list[dict]:
    """One row per (size, repeat): the slowest rank's time, when both groups are done."""
    slowest: dict[tuple[int, int], float] = {}
    for rows in per_rank:
        for row in rows:
            key = (row["bytes"], row["repeat"])
            slowest[key] = max(slowest.get(key, 0.0), row["seconds"])
    return [{"bytes": b, "repeat": r, "seconds": s} for (b, r), s in sorted(slowest.items())]


def _summarise(samples: dict, systems: list[str], sizes: list[int]) -> list[dict]:
    table = []
    for nbytes in sizes:
        row: dict = {"bytes": nbytes, "groups": [list(g) for g in GROUPS]}
        for system in systems:
            seconds = statistics.median(samples[(system, nbytes)])
            algbw = nbytes / seconds / 1e9
            row[system] = {
                "seconds": seconds,
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * 2 * (2 - 1) / 2,
                "samples": len(samples[(system, nbytes)]),
            }
        if "gloo" in systems:
            for system in systems:
                if system != "gloo":
                    ours, gloo = row[system], row["gloo"]
                    ours["time_ratio"] = ours["seconds"] / gloo["seconds"]
                    ours["busbw_ratio"] = ours["busbw_GBps"] / gloo["busbw_GBps"]
        table.append(row)
    return table


def _print_table(table: list[dict], systems: list[str]) -> None:
    header = f"{'size':>8}"
    for system in systems:
        header += f" | {system:>13} {'busbw':>7}" + (" ratio" if system != "gloo" else "")
    print(header)
    print("-" * len(header))
    for row in table:
        line = f"{_human(row['bytes']):>8}"
        for system in systems:
            cell = row[system]
            line += f" | {cell['seconds'] * 1e3:>10.3f} ms {cell['busbw_GBps']:>7.3f}"
            if system != "gloo":
                ratio = cell.get("busbw_ratio")
                line += f" {ratio:>4.2f}x" if ratio is not None else "     -"
        print(line)
    print(
        "(4 ranks, groups {0,1} and {2,3} all-reducing at once; time = median over repeats of the "
        "slowest rank's back-to-back all-reduce; busbw in GB/s per group; ratio = busbw / gloo's "
        "busbw, above 1 is faster, as in benchmarks/allreduce.py)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per system")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per round")
    parser.add_argument("--json", type=Path, help="write the table as JSON here")
    parser.add_argument(
        "--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="systems to time"
    )
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _run_worker(args)
        return
    samples: dict = {}
    for round_index in range(args.rounds):
        shift = round_index % len(args.systems)
        order = args.systems[shift:] + args.systems[:shift]
        for system in order:
            for row in _slowest(_launch(system, args.sizes, args.repeats)):
                samples.setdefault((system, row["bytes"]), []).append(row["seconds"])
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    table = _summarise(samples, args.systems, args.sizes)
    _print_table(table, args.systems)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "cpu_count": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "systems": args.systems,
            "world_size": WORLD,
        }
        args.json.write_text(json.dumps({**report, "rows": table}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
