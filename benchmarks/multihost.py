"""Multi-host all-reduce benchmark: paramsync's TCP ring against gloo over shaped links.

The hosts are Linux network namespaces on a bridge (`paramsync.runtime.testing.netns`), each link
shaped with ``tc``'s token bucket filter to a rate (1 and 10 Gbit/s by default) in both directions,
as a machine's NIC is. For each rate, each layout (``2x1``: two hosts with one rank each; ``2x2``:
two hosts with two ranks each) and each float32 message size, both systems run in the same
namespaces, one OS process per rank, rounds alternating so that drift in the machine's load hits
both alike: ``paramsync`` (`paramsync.runtime.transport.tcp.TcpTransport` and the ring all-reduce;
with ranks on two hosts the shared-memory plane declines, so every byte takes TCP) and ``gloo``
(``torch.distributed`` on the namespaces' ``eth0``). Reported: the median time per all-reduce, the
bus bandwidth (2(n-1)/n x bytes / time, as nccl-tests define it) and that bandwidth as a fraction of
the shaped rate: the ring's bytes cross one shaped link per direction, so 100 % is the link's wire
rate (TCP/IP headers take ~3-5 % of it).

Needs root and iproute2 (``ip netns``, ``tc``); says why and exits 2 otherwise.

    python benchmarks/multihost.py --json out/multihost.json
    python benchmarks/multihost.py --rates 1gbit --layouts 2x1 --sizes 16MiB --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SYSTEMS = ("paramsync", "gloo")
DEFAULT_SIZES = [16 << 20, 64 << 20]
DEFAULT_RATES = [10**9, 10**10]
DEFAULT_LAYOUTS = [(2, 1), (2, 2)]
PORT = 29531
_RATE = re.compile(r"([0-9]+(?:\.[0-9]+)?)(k|m|g)bit", re.IGNORECASE)
_SIZE = re.compile(r"([0-9]+)(KiB|MiB|GiB)?", re.IGNORECASE)


def parse_rate(text: str) -> int:
    """``1gbit``, ``10gbit``, ``500mbit`` -> bits per second."""
    match = _RATE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate like 1gbit or 500mbit")
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}[match[2].lower()]
    return int(float(match[1]) * scale)


def parse_size(text: str) -> int:
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4096 or 16MiB")
    unit = (match[2] or "").lower()
    return int(match[1]) * {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}[unit]


def parse_layout(text: str) -> tuple[int, int]:
    hosts, _, per_host = text.partition("x")
    if not (hosts.isdigit() and per_host.isdigit()) or int(hosts) < 2 or int(per_host) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a layout HOSTSxRANKS like 2x2")
    return int(hosts), int(per_host)


def _iterations(nbytes: int, rate_bits: int) -> int:
    """Back-to-back all-reduces per timed repeat: about half a second of wire time."""
    seconds = nbytes * 8 / rate_bits
    return max(1, min(50, round(0.5 / max(seconds, 1e-6))))


# ----------------------------------------------------------------------------- workers


def _worker_gloo(args: argparse.Namespace) -> list[dict]:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.address}:{args.port}",
        rank=args.rank,
        world_size=args.world,
    )
    rows = []
    try:
        for nbytes in args.sizes:
            tensor = torch.ones(nbytes // 4, dtype=torch.float32)
            iters = _iterations(nbytes, args.rate)
            dist.all_reduce(tensor)  # warm-up: connections, buffers
            for repeat in range(args.repeats):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(tensor)
                elapsed = (time.perf_counter() - start) / iters
                rows.append({"bytes": nbytes, "repeat": repeat, "seconds": elapsed})
    finally:
        dist.destroy_process_group()
    return rows


def _worker_paramsync(args: argparse.Namespace) -> list[dict]:
    import torch
    import trio

    from paramsync.runtime import DistributedConfig, TcpTransport, all_reduce, barrier

    rows: list[dict] = []

    async def main() -> None:
        config = DistributedConfig(args.world, args.rank, f"{args.address}:{args.port}")
        async with TcpTransport.connect(config, secret="multihost-benchmark") as transport:
            if transport.shared_memory is not None:
                raise RuntimeError("a shared-memory plane spans the hosts: they are one host")
            for nbytes in args.sizes:
                tensor = torch.ones(nbytes // 4, dtype=torch.float32)
                iters = _iterations(nbytes, args.rate)
                await all_reduce(transport, tensor)
                for repeat in range(args.repeats):
                    await barrier(transport)
                    start = time.perf_counter()
                    for _ in range(iters):
                        await all_reduce(transport, tensor)
                    elapsed = (time.perf_counter() - start) / iters
                    rows.append({"bytes": nbytes, "repeat": repeat, "seconds": elapsed})
            await barrier(transport)

    trio.run(main)
    return rows


def _run_worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    rows = _worker_gloo(args) if args.worker == "gloo" else _worker_paramsync(args)
    if args.rank == 0:
        print(json.dumps(rows), flush=True)


# ----------------------------------------------------------------------------- driver


def _launch(system: str, hosts: list, per_host: int, rate: int, args: argparse.Namespace) -> list:
    """One run of ``system``: ``per_host`` ranks in each namespace, rank 0's rows back."""
    world = len(hosts) * per_host
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0")
    procs = []
    for rank in range(world):
        host = hosts[rank // per_host]
        command = [
            sys.executable, str(Path(__file__).resolve()), "--worker", system,
            "--rank", str(rank), "--world", str(world), "--address", hosts[0].address,
            "--port", str(PORT), "--rate", str(rate), "--repeats", str(args.repeats),
            "--sizes", *map(str, args.sizes),
        ]  # fmt: skip
        procs.append(host.popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise RuntimeError(
                f"{system} rank {rank} of {world} took over {args.timeout} s"
            ) from None
        if proc.returncode != 0:
            raise RuntimeError(f"{system} rank {rank} of {world} failed:\n{err.decode()[-3000:]}")
        outputs.append(out.decode())
    return json.loads(outputs[0].strip().splitlines()[-1])


def _human(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def measure(args: argparse.Namespace) -> list[dict]:
    """Every rate x layout x size x system; returns the table's rows."""
    from paramsync.runtime.testing.netns import Shaping, virtual_hosts

    table = []
    for rate in args.rates:
        for hosts_count, per_host in args.layouts:
            world = hosts_count * per_host
            samples: dict[tuple[str, int], list[float]] = {}
            with virtual_hosts(hosts_count, shaping=Shaping(rate)) as hosts:
                for round_index in range(args.rounds):
                    shift = round_index % len(args.systems)
                    for system in args.systems[shift:] + args.systems[:shift]:
                        for row in _launch(system, hosts, per_host, rate, args):
                            samples.setdefault((system, row["bytes"]), []).append(row["seconds"])
                    print(
                        f"{rate / 1e9:g} Gbit/s, {hosts_count}x{per_host}: round "
                        f"{round_index + 1}/{args.rounds} done",
                        flush=True,
                    )
            for nbytes in args.sizes:
                row: dict = {
                    "rate_bits": rate,
                    "layout": f"{hosts_count}x{per_host}",
                    "world_size": world,
                    "bytes": nbytes,
                }
                for system in args.systems:
                    seconds = statistics.median(samples[(system, nbytes)])
                    busbw = nbytes / seconds * 2 * (world - 1) / world
                    row[system] = {
                        "seconds": seconds,
                        "busbw_Gbit": busbw * 8 / 1e9,
                        "fraction_of_rate": busbw * 8 / rate,
                        "samples": len(samples[(system, nbytes)]),
                    }
                table.append(row)
    return table


def print_table(table: list[dict], systems: list[str]) -> None:
    header = f"{'rate':>8} {'layout':>6} {'size':>8}"
    for system in systems:
        header += f" | {system:>9} {'busbw':>7} {'of rate':>7}"
    print(header)
    print("-" * len(header))
    for row in table:
        line = f"{row['rate_bits'] / 1e9:>5g} Gb {row['layout']:>6} {_human(row['bytes']):>8}"
        for system in systems:
            cell = row[system]
            line += (
                f" | {cell['seconds'] * 1e3:>6.1f} ms {cell['busbw_Gbit']:>5.2f} Gb "
                f"{cell['fraction_of_rate'] * 100:>5.1f} %"
            )
        print(line)
    print(
        "(busbw = 2(n-1)/n x bytes / time, in Gbit/s; 'of rate' = busbw / the shaped link "
        "rate; time: median over rounds x repeats of back-to-back all-reduces)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=parse_rate, nargs="+", default=DEFAULT_RATES)
    parser.add_argument("--layouts", type=parse_layout, nargs="+", default=DEFAULT_LAYOUTS)
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=DEFAULT_SIZES)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per system")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per round")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--json", type=Path, help="write the table as JSON here")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _run_worker(args)
        return 0
    from paramsync.runtime.testing.netns import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"multihost benchmark: cannot run here: {reason}", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    table = measure(args)
    print_table(table, args.systems)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
            "cpu_count": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "systems": args.systems,
            "rows": table,
        }
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
