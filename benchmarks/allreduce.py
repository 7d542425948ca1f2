"""All-reduce benchmark: paramsync (TCP ring, shared-memory plane, torch data plane) against
torch.distributed on gloo, same run.

One OS process per worker for every system, on this machine's loopback. ``paramsync`` is the
TCP data path (shared memory switched off), ``paramsync-shm`` the same transport with the
shared-memory plane attached (`paramsync.runtime.transport.shm`), ``paramsync-torch`` paramsync's
``all_reduce`` over its torch.distributed data plane (``data_plane = "torch"``:
`paramsync.runtime.transport.torch_plane`, a gloo group formed through a TCP mesh), ``gloo``
torch.distributed called directly. For each world size and float32 message
size it
times back-to-back all-reduces (after a barrier) and reports the median over repeats of: time per
all-reduce, algorithm bandwidth (bytes / time) and bus bandwidth (algbw x 2(n-1)/n, as
nccl-tests define it), and each paramsync system's bus-bandwidth ratio to gloo. The systems
alternate round by round (order rotated) so that drift in machine load hits all alike.

``--baseline PATH`` runs each paramsync system of ``--systems`` again with the code of another
checkout (``SYSTEM@baseline``, the same worker with ``PATH`` first on ``PYTHONPATH``) in the
same rounds, and reports this code's bus bandwidth over the baseline's.

    python benchmarks/allreduce.py --json out/allreduce.json
    python benchmarks/allreduce.py --systems gloo paramsync-shm --worlds 2
    python benchmarks/allreduce.py --systems gloo paramsync paramsync-shm --baseline ../base
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SIZES = [4 * 1024, 1 << 20, 16 << 20, 64 << 20]
DEFAULT_CHUNK_BYTES = 4 << 20
SYSTEMS = ("gloo", "paramsync", "paramsync-shm", "paramsync-torch")
BASELINE = "@baseline"
"""Suffix of a paramsync system run with ``--baseline``'s code."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _iterations(nbytes: int) -> int:
    """Enough back-to-back operations that one repeat takes a measurable while."""
    if nbytes <= 64 * 1024:
        return 200
    if nbytes <= 2 << 20:
        return 20
    if nbytes <= 32 << 20:
        return 5
    return 2


# ----------------------------------------------------------------------------- workers


def _worker_gloo(rank: int, world: int, port: int, sizes: list[int], repeats: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    try:
        for nbytes in sizes:
            tensor = torch.ones(nbytes // 4, dtype=torch.float32)
            iters = _iterations(nbytes)
            dist.all_reduce(tensor)  # warm-up: connections, buffers
            for repeat in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(tensor)
                elapsed = (time.perf_counter() - start) / iters
                rows.append({"bytes": nbytes, "repeat": repeat, "seconds": elapsed})
    finally:
        dist.destroy_process_group()
    return rows


def _worker_paramsync(
    rank: int,
    world: int,
    port: int,
    sizes: list[int],
    repeats: int,
    chunk_bytes: int,
    shared_memory: bool,
    shm_step_bytes: int | None,
    torch_plane: bool = False,
) -> list[dict]:
    import torch
    import trio

    from paramsync.runtime import DistributedConfig, TcpTransport, all_reduce, barrier
    from paramsync.runtime.transport.base import Transport
    from paramsync.runtime.transport.shm import attach_shared_memory
    from paramsync.runtime.transport.torch_plane import connect_torch_transport

    rows: list[dict] = []

    async def main() -> None:
        config = DistributedConfig(world, rank, f"127.0.0.1:{port}")
        async with TcpTransport.connect(
            config, secret="benchmark-secret-7Hq2vX9pLm", shared_memory=False
        ) as tcp:
            if shared_memory and world > 1:
                steps = {"step_bytes": shm_step_bytes} if shm_step_bytes else {}
                plane = await attach_shared_memory(tcp, want=True, **steps)
                if plane is None:
                    raise RuntimeError("the shared-memory plane could not be attached")
            if not torch_plane:
                await timed(tcp)
                return
            plane_transport = await connect_torch_transport(
                tcp, store_host="127.0.0.1", local_host="127.0.0.1", prefix="benchmark"
            )
        try:
            await timed(plane_transport)
        finally:
            await plane_transport.aclose()

    async def timed(transport: Transport) -> None:
        for nbytes in sizes:
            tensor = torch.ones(nbytes // 4, dtype=torch.float32)
            iters = _iterations(nbytes)
            await all_reduce(transport, tensor, chunk_bytes=chunk_bytes)
            for repeat in range(repeats):
                await barrier(transport)
                start = time.perf_counter()
                for _ in range(iters):
                    await all_reduce(transport, tensor, chunk_bytes=chunk_bytes)
                elapsed = (time.perf_counter() - start) / iters
                rows.append({"bytes": nbytes, "repeat": repeat, "seconds": elapsed})
        await barrier(transport)

    trio.run(main)
    return rows


def _run_worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    if args.worker == "gloo":
        rows = _worker_gloo(args.rank, args.world, args.port, args.sizes, args.repeats)
    else:
        rows = _worker_paramsync(
            args.rank,
            args.world,
            args.port,
            args.sizes,
            args.repeats,
            args.chunk_bytes,
            args.worker == "paramsync-shm",
            args.shm_step_bytes,
            torch_plane=args.worker == "paramsync-torch",
        )
    if args.rank == 0:
        print(json.dumps(rows), flush=True)


# ----------------------------------------------------------------------------- driver


def _launch(
    system: str,
    world: int,
    sizes: list[int],
    repeats: int,
    chunk_bytes: int,
    shm_step: int | None,
    baseline: Path | None = None,
) -> list[dict]:
    port = _free_port()
    # A baseline system runs this file's worker with the other checkout's code first.
    code = baseline if system.endswith(BASELINE) and baseline is not None else ROOT
    label, system = system, system.removesuffix(BASELINE)
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS="1")
    if code != ROOT:  # that checkout may predate the torch backend's entry point
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    procs = []
    for rank in range(world):
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            system,
            "--rank",
            str(rank),
            "--world",
            str(world),
            "--port",
            str(port),
            "--repeats",
            str(repeats),
            "--chunk-bytes",
            str(chunk_bytes),
            *(("--shm-step-bytes", str(shm_step)) if shm_step else ()),
            "--sizes",
            *map(str, sizes),
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=code,
            )
        )
    outputs = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{label} worker {rank} of {world} failed:\n{err}")
        outputs.append(out)
    return json.loads(outputs[0].strip().splitlines()[-1])


def _summarise(
    samples: dict, systems: list[str], worlds: list[int], sizes: list[int]
) -> list[dict]:
    table = []
    for world in worlds:
        for nbytes in sizes:
            row: dict = {"world_size": world, "bytes": nbytes}
            for system in systems:
                seconds = statistics.median(samples[(system, world, nbytes)])
                algbw = nbytes / seconds / 1e9
                row[system] = {
                    "seconds": seconds,
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw * 2 * (world - 1) / world,
                    "samples": len(samples[(system, world, nbytes)]),
                }
            if "gloo" in systems:
                for system in systems:
                    if system != "gloo":
                        gloo, ours = row["gloo"], row[system]
                        ours["busbw_ratio"] = ours["busbw_GBps"] / gloo["busbw_GBps"]
                        ours["time_ratio"] = ours["seconds"] / gloo["seconds"]
            for system in systems:
                if system.endswith(BASELINE):  # this code over the baseline's
                    new, old = row[system.removesuffix(BASELINE)], row[system]
                    old["this_over_baseline_busbw"] = new["busbw_GBps"] / old["busbw_GBps"]
            if "gloo" in systems and "paramsync" in systems:  # the original columns
                row["busbw_ratio"] = row["paramsync"]["busbw_ratio"]
                row["time_ratio"] = row["paramsync"]["time_ratio"]
            table.append(row)
    return table


def _human(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _print_table(table: list[dict], systems: list[str]) -> None:
    header = f"{'n':>2} {'size':>8}"
    for system in systems:
        header += f" | {system:>15} {'busbw':>7}" + (" ratio" if system != "gloo" else "")
    print(header)
    print("-" * len(header))
    for row in table:
        line = f"{row['world_size']:>2} {_human(row['bytes']):>8}"
        for system in systems:
            cell = row[system]
            line += f" | {cell['seconds'] * 1e3:>12.3f} ms {cell['busbw_GBps']:>7.3f}"
            if system != "gloo":
                ratio = cell.get("busbw_ratio")
                line += f" {ratio:>4.2f}x" if ratio is not None else "     -"
        print(line)
    print(
        "(busbw in GB/s; ratio = busbw / gloo's busbw; time is the median over repeats of "
        "back-to-back all-reduces)"
    )
    for system in (s for s in systems if s.endswith(BASELINE)):
        ratios = " ".join(
            f"n={row['world_size']} {_human(row['bytes'])}: "
            f"x{row[system]['this_over_baseline_busbw']:.3f}"
            for row in table
        )
        print(f"{system.removesuffix(BASELINE)}: this code's busbw / the baseline's: {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per system")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per round")
    parser.add_argument("--json", type=Path, help="write the table as JSON here")
    parser.add_argument(
        "--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="paramsync's ring part size"
    )
    parser.add_argument(
        "--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="systems to time"
    )
    parser.add_argument(
        "--shm-step-bytes",
        type=int,
        help="paramsync-shm: bytes of each rank's tensor per step (default: the shm plane's)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="also run the paramsync systems with this checkout's code (SYSTEM@baseline)",
    )
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _run_worker(args)
        return
    if args.baseline is not None:
        args.baseline = args.baseline.resolve()
        if not (args.baseline / "paramsync" / "runtime" / "transport").is_dir():
            raise SystemExit(
                f"--baseline {args.baseline}: not a paramsync checkout (no paramsync/runtime); "
                "make one with benchmarks/baseline_checkout.py"
            )
        args.systems += [s + BASELINE for s in args.systems if s != "gloo"]
    samples: dict = {}
    for world in args.worlds:
        for round_index in range(args.rounds):
            shift = round_index % len(args.systems)
            order = args.systems[shift:] + args.systems[:shift]
            for system in order:
                rows = _launch(
                    system,
                    world,
                    args.sizes,
                    args.repeats,
                    args.chunk_bytes,
                    args.shm_step_bytes,
                    args.baseline,
                )
                for row in rows:
                    key = (system, world, row["bytes"])
                    samples.setdefault(key, []).append(row["seconds"])
            print(f"world size {world}: round {round_index + 1}/{args.rounds} done", flush=True)
    table = _summarise(samples, args.systems, args.worlds, args.sizes)
    _print_table(table, args.systems)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        load = os.getloadavg()
        report = {
            "cpu_count": os.cpu_count(),
            "loadavg": load,
            "systems": args.systems,
            "baseline": str(args.baseline) if args.baseline else None,
        }
        args.json.write_text(json.dumps({**report, "rows": table}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
