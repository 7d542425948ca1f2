"""Wall time of a small run from the command line: ``paramsync launch`` of 2 workers training
`examples/own_training_loop.py` for a few steps, start to exit, and when the launcher had
started its processes; with ``--baseline PATH``, the same with another checkout's code, the
two alternating round by round. Medians over ``--rounds``.

    python benchmarks/launch_time.py --rounds 5 --baseline /tmp/old-checkout

What it shows: how much of a short run is start-up and exit (imports, the coordinator coming
up, the processes ending) rather than training.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCHED = re.compile(r"paramsync\.launch: node 0 of 1: launched")


def one_run(code: Path, nproc: int, steps: int) -> tuple[float, float]:
    """(seconds until the launcher said it launched, seconds until it exited) for one run
    with the checkout ``code``."""
    env = dict(os.environ, PYTHONPATH=str(code))
    env.pop("PARAMSYNC_SECRET", None)
    command = [sys.executable, "-m", "paramsync.runtime.cli.main", "--log-level", "INFO", "launch"]
    command += ["--nproc", str(nproc), "--", str(code / "examples" / "own_training_loop.py")]
    command += ["--steps", str(steps)]
    started = time.perf_counter()
    proc = subprocess.Popen(
        command, cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    launched = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if launched is None and LAUNCHED.search(line):
            launched = time.perf_counter() - started
    if proc.wait(timeout=300) != 0 or launched is None:
        raise SystemExit(f"the run with {code} failed (exit {proc.returncode})")
    return launched, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--baseline", type=Path, help="another paramsync checkout")
    args = parser.parse_args()
    codes = {"this code": ROOT}
    if args.baseline:
        codes["baseline"] = args.baseline.resolve()
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in codes}
    for index in range(args.rounds):
        names = list(codes) if index % 2 == 0 else list(reversed(codes))
        for name in names:
            runs[name].append(one_run(codes[name], args.nproc, args.steps))
    print(
        f"paramsync launch --nproc {args.nproc} -- examples/own_training_loop.py --steps "
        f"{args.steps}, median of {args.rounds} rounds:"
    )
    for name, results in runs.items():
        launched = statistics.median(r[0] for r in results)
        total = statistics.median(r[1] for r in results)
        print(f"  {name:<10} launched after {launched:5.2f} s, exited after {total:5.2f} s")
    if args.baseline:
        ratios = [new[1] / old[1] for new, old in zip(runs["this code"], runs["baseline"])]
        print(f"  this code / baseline, round by round: x{statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
