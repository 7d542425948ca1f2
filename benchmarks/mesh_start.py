"""Seconds for N processes to form an authenticated mesh, and the scrypt stretches of the secret
each pays: the handshakes' share of a run's start. With ``--baseline PATH``, the same with another
checkout's code, the two alternating round by round; medians over ``--rounds``.

    python benchmarks/mesh_start.py --nproc 8 --rounds 3 --baseline /tmp/old-checkout

Each process imports paramsync, waits until all N have (so imports are not timed), then joins
the group as ``paramsync allreduce`` does (`TcpTransport.connect`: rank 0 listens, every other
rank dials it, then dials the ranks below it and accepts those above; no shared memory) and
reports how long that took and how many scrypt derivations its process made
(`paramsync.runtime.protocol.handshake.stretch_secret`'s cache misses). Where each listener
sends its own process's salt, rank r stretches r + 1 times (rank 0's salt, each lower peer's, its
own listener's); where the listeners of a deployment use the salt of the listener that proved
the secret to them first (`paramsync.runtime.transport.deployment_salt`), once.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(rank: int, world_size: int, port: int, ready: Path) -> None:
    """One process of the mesh (run with the checkout under test on PYTHONPATH)."""
    import trio

    from paramsync.runtime.config import DistributedConfig
    from paramsync.runtime.protocol import handshake
    from paramsync.runtime.transport import shm  # noqa: F401  (imported by connect: not timed)
    from paramsync.runtime.transport.tcp import TcpTransport

    (ready / str(rank)).touch()
    while len(list(ready.iterdir())) < world_size:
        time.sleep(0.005)
    config = DistributedConfig(world_size, rank, f"127.0.0.1:{port}")

    async def join() -> float:
        started = time.perf_counter()
        async with TcpTransport.connect(config, shared_memory=False):
            took = time.perf_counter() - started
        return took

    seconds = trio.run(join)
    stretches = handshake._stretch.cache_info().misses
    print(json.dumps({"rank": rank, "seconds": seconds, "stretches": stretches}), flush=True)


def one_round(code: Path, nproc: int) -> dict[str, float]:
    """One mesh of ``nproc`` processes with the checkout ``code``: the slowest rank's seconds,
    the median rank's, and the stretches of all processes together."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS="1")
    env["PARAMSYNC_SECRET"] = secrets.token_urlsafe(32)
    with tempfile.TemporaryDirectory(prefix="paramsync-mesh-") as ready:
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--child", str(rank), str(nproc), str(port), ready],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in range(nproc)
        ]
        outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise SystemExit(f"a process of the mesh with {code} failed: {outputs}")
    rows = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    seconds = [row["seconds"] for row in rows]
    return {
        "slowest": max(seconds),
        "median": statistics.median(seconds),
        "stretches": sum(row["stretches"] for row in rows),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        rank, world_size, port = (int(a) for a in sys.argv[2:5])
        child(rank, world_size, port, Path(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--baseline", type=Path, help="another paramsync checkout")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    codes = {"this code": ROOT}
    if args.baseline:
        codes["baseline"] = args.baseline.resolve()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in codes}
    for index in range(args.rounds):
        for name in codes if index % 2 == 0 else reversed(codes):
            runs[name].append(one_round(codes[name], args.nproc))
    print(f"{args.nproc} processes forming a mesh, median of {args.rounds} rounds:")
    summary: dict[str, dict[str, float]] = {}
    for name, rounds in runs.items():
        summary[name] = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        row = summary[name]
        print(
            f"  {name:<10} slowest rank {row['slowest']:.2f} s, median rank {row['median']:.2f} "
            f"s, scrypt stretches {row['stretches']:.0f} in all"
        )
    if args.baseline:
        ratios = [new["slowest"] / old["slowest"] for new, old in zip(*runs.values(), strict=True)]
        print(
            f"  this code / baseline, slowest rank, round by round: "
            f"x{statistics.median(ratios):.3f}"
        )
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps({"nproc": args.nproc, "runs": runs, "summary": summary}, indent=2)
        )


if __name__ == "__main__":
    main()
