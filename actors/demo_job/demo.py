"""``make demo``: a coordinator and 4 workers train a character-level LM, checked every step.

Five OS processes on this machine: ``paramsync launch`` starts the coordinator and four workers
that talk over authenticated TCP on loopback. The workers train a small transformer on
CPython's own standard-library sources; after every optimizer step the coordinator compares all
workers' XXH3-128 digests of their weights and optimizer state (C-DDP-001). At the end the demo
prints the summary and leaves the loss curve, the merged Chrome trace (open it in Perfetto) and
the summary JSON in ``out/demo``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from paramsync.runtime.observe.trace import merge_traces

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m paramsync.actors.demo_job.demo", description=__doc__
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1200, help="about two minutes on 2 cores")
    parser.add_argument("--out", type=Path, default=Path("out/demo"))
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("trace-rank*.json"):
        stale.unlink()
    print(
        f"paramsync demo: a coordinator and {args.workers} workers (separate processes, "
        f"authenticated TCP on loopback)\ntrain a character-level transformer on CPython's "
        f"standard library for {args.steps} steps; identical weights are checked every step.\n",
        flush=True,
    )
    command = [
        sys.executable,
        "-m",
        "paramsync.runtime.cli.main",
        "--log-level",
        "WARNING",
        "launch",
        "--nproc",
        str(args.workers),
        "--summary-json",
        str(out / "summary.json"),
        "--",
        "-m",
        "paramsync.actors.demo_job.job",
        "--steps",
        str(args.steps),
        "--trace",
        str(out / "trace-rank{rank}.json"),
        "--plot",
        str(out / "loss.png"),
    ]
    code = subprocess.call(command)
    if code != 0:
        print(f"\ndemo failed: paramsync launch exited with code {code}")
        return code
    summary = json.loads((out / "summary.json").read_text())
    traces = sorted(out.glob("trace-rank*.json"))
    merged = merge_traces(traces, out / "trace.json")
    first = [rank["first_loss"] for rank in summary["ranks"]]
    print()
    print(f"steps:                 {summary['final_step']}")
    print(f"loss:                  {sum(first) / len(first):.3f} -> {summary['final_loss']:.3f}")
    print(
        f"throughput:            {summary['steps_per_second']:.2f} steps/s "
        f"({summary['steps_per_second'] * args.workers * 16 * 64:,.0f} tokens/s)"
    )
    print(
        f"identical weights:     {summary['digests_identical']} "
        f"(xxh3 {next(iter(summary['digests'].values()))[:16]}... on every rank)"
    )
    print(f"loss curve:            {out / 'loss.png'}")
    print(f"trace (Perfetto):      {merged}")
    print(f"summary:               {out / 'summary.json'}")
    if not summary["digests_identical"]:
        print("demo failed: the workers' final digests differ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
