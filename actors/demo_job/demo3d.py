"""``make demo-3d``: the character-level transformer trained by dp=2 x pp=2 processes.

Four OS processes on this machine (`paramsync.actors.demo_job.demo3d_worker`), each one rank of a
``ParallelismConfig`` layout (by default dp=2 x pp=2 with the 1F1B schedule over 4
micro-batches; ``--tp-size 2 --dp-size 1`` gives tp=2 x pp=2), joined over authenticated TCP on
loopback, with paramsync's coordinator as a fifth process: it refuses ranks that disagree on the
layout or the schedule, negotiates each dp group's gradient bucket, and after every optimizer
step compares the state digests of each (tp, pp) shard's replicas (C-DDP-001 per shard), so a
mismatch stops the run naming the shard and the ranks (``--no-coordinator``: the ranks form
their world themselves and compare digests in band, over each dp group). Each pipeline rank runs
its list of actions; every forward, backward and the idle time waiting for a peer (the pipeline
bubble) is a span in its trace, and the traces are merged into ``out/demo3d/trace.json`` for
Perfetto (ui.perfetto.dev: open the file; each process is a rank, its ``pipeline`` track the
schedule). At the end the demo prints the summary (loss first and last, steps per second, checks
passed, each rank's share of compute, bubble and optimizer) and leaves it in
``out/demo3d/summary.json``.

The launcher owns its children: a child that fails stops the others (by their process ids),
and the demo exits non-zero naming the rank or the coordinator.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paramsync.runtime.cli.launch import free_port
from paramsync.runtime.observe.trace import merge_traces
from paramsync.runtime.protocol.handshake import SECRET_ENV

__all__ = ["main", "pipeline_breakdown", "summarize"]

_GRACE_SECONDS = 10.0
COORDINATOR = -1
"""The coordinator's key among the launched processes (ranks are 0 .. world - 1)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m paramsync.actors.demo_job.demo3d", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--dp-size", type=int, default=2)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--pp-size", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument(
        "--pipeline-schedule",
        default="1f1b",
        choices=["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"],
    )
    p.add_argument("--virtual-chunks", type=int, default=1)
    p.add_argument("--steps", type=int, default=300, help="about a minute on 2 loaded cores")
    p.add_argument("--out", type=Path, default=Path("out/demo3d"))
    p.add_argument(
        "--coordinator",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run paramsync's coordinator, which checks the ranks' layout and schedule at the "
        "start and every shard's replicas after every step (--no-coordinator: the ranks "
        "compare their digests in band, over each dp group)",
    )
    p.add_argument(
        "--worker-args",
        default="",
        help="more flags for every worker, one string: model size (--d-model, --layers), "
        "--memory-optimization zero1, --activation-checkpointing, ...",
    )
    return p


def summarize(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's summary from the ranks' own: the loss every rank saw first and last (all ranks
    return the mean over the dp replicas, so they agree), the slowest rank's steps per second,
    and the replica checks every rank passed."""
    summaries = sorted(summaries, key=lambda s: s["rank"])
    first = summaries[0]
    return {
        "world_size": len(summaries),
        "layout": first["layout"],
        "steps": min(s["steps"] for s in summaries),
        "first_loss": first["first_loss"],
        "last_loss": first["last_loss"],
        "last_10_mean_loss": first["last_10_mean_loss"],
        "losses_agree": len({(s["first_loss"], s["last_loss"]) for s in summaries}) == 1,
        "steps_per_second": min(s["steps_per_second"] for s in summaries),
        "optimizer_steps": min(s["optimizer_steps"] for s in summaries),
        "checks_passed": min(s["checks_passed"] for s in summaries),
        "ranks": summaries,
    }


def pipeline_breakdown(events: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per process (rank) of a merged trace: the share of its step time spent computing
    (forwards, backwards), idle in the pipeline (waiting for a peer's activation or gradient:
    the bubble) and in the optimizer step with its replica check."""
    totals: dict[int, dict[str, float]] = {}
    for event in events:
        if event.get("ph") != "X":
            continue
        name = str(event["name"])
        kind = {"F": "compute", "B": "compute", "I": "compute", "W": "compute"}.get(
            name.split(" ")[0],
            {"idle": "idle", "optimizer": "optimizer", "step": "step"}.get(name, ""),
        )
        if kind:
            row = totals.setdefault(int(event["pid"]), {})
            row[kind] = row.get(kind, 0.0) + float(event["dur"])
    shares: dict[int, dict[str, float]] = {}
    for pid, row in sorted(totals.items()):
        step = row.get("step", 0.0)
        if step > 0:
            shares[pid] = {k: row.get(k, 0.0) / step for k in ("compute", "idle", "optimizer")}
    return shares


def _launch(args: argparse.Namespace, world: int, out: Path) -> int:
    port = free_port()
    base = dict(os.environ)
    base.update(
        {
            SECRET_ENV: secrets.token_hex(16),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", "1"),
        }
    )
    layout = [
        f"--dp-size={args.dp_size}",
        f"--tp-size={args.tp_size}",
        f"--pp-size={args.pp_size}",
        f"--micro-batches={args.micro_batches}",
        f"--pipeline-schedule={args.pipeline_schedule}",
        f"--virtual-chunks={args.virtual_chunks}",
        f"--steps={args.steps}",
        *args.worker_args.split(),
        *(["--coordinated"] if args.coordinator else []),
    ]
    procs: dict[int, subprocess.Popen[bytes]] = {}
    if args.coordinator:
        procs[COORDINATOR] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "paramsync.runtime.cli.main",
                "--log-level",
                "WARNING",
                "coordinator",
                "--world-size",
                str(world),
                "--bind",
                f"127.0.0.1:{port}",
                "--digest-interval",
                "1",
                "--heartbeat-deadline",
                "60",
            ],
            env=base,
        )
    for rank in range(world):
        command = [
            sys.executable,
            "-m",
            "paramsync.actors.demo_job.demo3d_worker",
            *layout,
            f"--trace={out / f'trace-rank{rank}.json'}",
            f"--summary={out / f'summary-rank{rank}.json'}",
        ]
        procs[rank] = subprocess.Popen(command, env=dict(base, RANK=str(rank)))
    failed: tuple[int, int] | None = None
    try:
        pending = dict(procs)
        while failed is None and any(rank != COORDINATOR for rank in pending):
            for rank, proc in list(pending.items()):
                code = proc.poll()
                if code is None:
                    continue
                del pending[rank]
                if code != 0:
                    failed = (rank, code)
                    break
            time.sleep(0.05)
        coordinator = procs.get(COORDINATOR)
        if failed is None and coordinator is not None:  # it ends once every rank finished
            try:
                code = coordinator.wait(timeout=_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                code = None
            if code:
                failed = (COORDINATOR, code)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + _GRACE_SECONDS
        for proc in procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if failed is not None:
        rank, code = failed
        who = "the coordinator" if rank == COORDINATOR else f"rank {rank}"
        print(f"\ndemo-3d failed: {who} (pid {procs[rank].pid}) exited with code {code}")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit code."""
    args = _parser().parse_args(argv)
    world = args.dp_size * args.tp_size * args.pp_size
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("trace-rank*.json"), *out.glob("summary-rank*.json")]:
        stale.unlink()
    print(
        f"paramsync demo-3d: {world} processes (dp={args.dp_size} x tp={args.tp_size} x "
        f"pp={args.pp_size}, {args.pipeline_schedule}, {args.micro_batches} micro-batches) "
        f"over authenticated TCP on loopback\ntrain a character-level transformer on CPython's "
        f"standard library for {args.steps} steps; the replicas of every (tp, pp) shard are "
        "compared after every step.\n",
        flush=True,
    )
    code = _launch(args, world, out)
    if code:
        return code
    summary = summarize(
        [json.loads(path.read_text()) for path in sorted(out.glob("summary-rank*.json"))]
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    merged = merge_traces(sorted(out.glob("trace-rank*.json")), out / "trace.json")
    breakdown = pipeline_breakdown(json.loads(merged.read_text())["traceEvents"])
    summary["time_shares"] = {str(pid): shares for pid, shares in breakdown.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    # The coordinator commits every step, whether or not a shard has replicas to compare.
    expected_checks = summary["optimizer_steps"] if args.dp_size > 1 or args.coordinator else 0
    print()
    print(f"steps:                 {summary['steps']}")
    print(
        f"loss:                  {summary['first_loss']:.3f} -> {summary['last_loss']:.3f} "
        f"(mean of the last 10 steps {summary['last_10_mean_loss']:.3f})"
    )
    print(f"throughput:            {summary['steps_per_second']:.2f} steps/s (slowest rank)")
    if args.dp_size > 1:
        print(
            f"identical replicas:    {summary['checks_passed']} of {expected_checks} checks "
            "passed on every rank (digests of each (tp, pp) shard compared across its dp "
            f"group {'by the coordinator' if args.coordinator else 'in band'})"
        )
    else:
        committed = (
            f" ({summary['checks_passed']} of {expected_checks} steps committed by the coordinator)"
            if args.coordinator
            else ""
        )
        print(
            "identical replicas:    none to compare (dp=1: every shard has one replica)" + committed
        )
    for pid, shares in breakdown.items():
        coords = summary["ranks"][pid]["coordinates"]
        print(
            f"rank {pid} (pp={coords['pp']}, dp={coords['dp']}, tp={coords['tp']}):  "
            f"compute {shares['compute']:.0%}, pipeline idle (bubble) {shares['idle']:.0%}, "
            f"optimizer + check {shares['optimizer']:.0%} of its step time"
        )
    print(f"trace (Perfetto):      {merged}")
    print(f"summary:               {out / 'summary.json'}")
    if summary["checks_passed"] != expected_checks or not summary["losses_agree"]:
        print("demo-3d failed: a replica check was missed or the ranks report different losses")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
