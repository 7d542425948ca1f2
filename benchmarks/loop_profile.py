"""Where the event loop's CPU goes in training: per trio task, per part of the step.

Runs the coordinator and ``--world`` paramsync workers of `benchmarks/ddp.py` (its model, its
data) as separate processes, each wrapped so that, during a window of wall time after start-up,
it records the CPU time (``time.thread_time``) of every trio task step on its event loop,
keyed by the task and where it paused, and of a few hot functions (the shared-memory plane's
copies and sums, frame encoding and decoding, the coordinator core). Prints, per step, each
process's CPU, its event loop's, and the largest items of rank ``--rank`` and the coordinator.

    python benchmarks/loop_profile.py --world 4 --steps 300

The recording costs a few microseconds per task step, so its figures are a little above a bare
run's; compare runs of this script with each other (for example before and after a change).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import runpy
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_SKIP = ("_run.py", "_traps", "_socket.py", "_sync.py", "_timeouts", "_channel", "_threads")
_SKIP += ("_io_", "_generated", "_abc.py", "contextlib")
_TIMED = {
    "paramsync.runtime.transport.shm": [
        ("_Steps", "copy_in"),
        ("_Steps", "reduce"),
        ("_Steps", "reduce_whole"),
        ("_Steps", "copy_out"),
    ],
    "paramsync.runtime.transport.tcp": [(None, "encode_frame"), (None, "decode_head")],
    "paramsync.runtime.coordinator.service": [(None, "event_from_wire")],
    "paramsync.runtime.coordinator.core": [("CoordinatorCore", "handle")],
    # The trainer starts a step's digest after the optimizer step and reads it when it reports:
    # both halves are the digest's work.
    "paramsync.actors.state.digest": [
        ("StateHasher", "start", "digest"),
        ("PendingDigest", "result", "digest"),
    ],
}
MANDATED = {
    "rank": ("digest", "copy_in", "reduce", "reduce_whole", "copy_out"),
    "coordinator": ("decode_head", "event_from_wire", "handle", "encode_frame"),
}
"""The parts no implementation of the contracts can skip: on a rank, hashing its state for
C-DDP-001 (``digest``, on the optimizer's thread) and moving the gradient's bytes through the
shared-memory plane; on the coordinator, decoding each report, checking it and encoding the
answer. Their CPU, summed over the processes and spread over the machine's cores, is a floor
under any executor's overhead over the no-communication limit (`benchmarks/ddp.py`)."""


def _where(coro: Any) -> str:
    """The two innermost frames of our code where a task is paused."""
    frames = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            frames.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    ours = [name for name in frames if not name.startswith(_SKIP)]
    return " > ".join(ours[-2:])


def _wrapped(out: Path, window: tuple[float, float], target: list[str]) -> None:
    """Run ``target`` (a script path, or -m MODULE) with the recording installed."""
    import trio

    started = time.monotonic()

    def inside() -> bool:
        return window[0] <= time.monotonic() - started < window[1]

    cpu: collections.Counter[str] = collections.Counter()
    steps: collections.Counter[str] = collections.Counter()
    parts: collections.Counter[str] = collections.Counter()
    totals: dict[str, float] = {}

    class Recorder(trio.abc.Instrument):
        begun = 0

        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            self.begun = time.thread_time_ns()

        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            if inside():
                key = f"{task.name.split('.')[-1][:28]} @ {_where(task.coro)}"
                cpu[key] += time.thread_time_ns() - self.begun
                steps[key] += 1

    run = trio.run

    def run_recorded(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("instruments", []).append(Recorder())
        return run(*args, **kwargs)

    trio.run = run_recorded  # type: ignore[assignment]
    sys.path.insert(0, str(ROOT))
    for module_name, names in _TIMED.items():
        module = __import__(module_name, fromlist=["_"])
        for owner_name, name, *label in names:
            owner = getattr(module, owner_name, None) if owner_name else module
            if hasattr(owner, name):  # an older checkout may lack one
                part = label[0] if label else name
                setattr(owner, name, _timer(getattr(owner, name), part, parts, inside))

    def sample() -> None:
        ident = threading.main_thread().ident
        assert ident is not None
        main = time.pthread_getcpuclockid(ident)  # the event loop's thread CPU clock
        time.sleep(max(0.0, started + window[0] - time.monotonic()))
        loop, process = time.clock_gettime(main), time.process_time()
        time.sleep(max(0.0, started + window[1] - time.monotonic()))
        totals["event_loop"] = time.clock_gettime(main) - loop
        totals["process"] = time.process_time() - process

    threading.Thread(target=sample, daemon=True).start()
    try:
        sys.argv = target
        if target[0] == "-m":
            sys.argv = target[1:]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target[0], run_name="__main__")
    finally:
        record = {"tasks": cpu, "task_steps": steps, "parts": parts, **totals}
        record["ended_at"] = time.monotonic() - started
        out.write_text(json.dumps(record))


_PARTS_LOCK = threading.Lock()  # the hash runs on the optimizer's thread, the rest on the loop


def _timer(function: Any, label: str, parts: collections.Counter[str], inside: Any) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        begun = time.thread_time_ns()
        try:
            return function(*args, **kwargs)
        finally:
            if inside():
                spent = time.thread_time_ns() - begun
                with _PARTS_LOCK:
                    parts[label] += spent

    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300, help="enough to outlast the window")
    parser.add_argument("--window", type=float, nargs=2, default=(14.0, 24.0), metavar="S")
    parser.add_argument("--rank", type=int, default=1, help="the worker whose tasks are listed")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--wrap", type=Path, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.wrap:
        _wrapped(args.wrap, tuple(args.window), rest[1:] if rest[:1] == ["--"] else rest)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env["PARAMSYNC_SECRET"] = secrets.token_hex(16)
    window = ["--window", *map(str, args.window)]
    with tempfile.TemporaryDirectory(prefix="paramsync-loop-") as tmp:
        names = ["coordinator"] + [f"rank {rank}" for rank in range(args.world)]
        outs = {name: Path(tmp) / f"{name.replace(' ', '-')}.json" for name in names}
        wrap = [sys.executable, __file__, *window, "--wrap"]
        coordinator = ["-m", "paramsync.runtime.cli.main", "--log-level", "WARNING", "coordinator"]
        coordinator += ["--world-size", str(args.world), "--bind", f"127.0.0.1:{port}"]
        procs = [
            subprocess.Popen(
                [*wrap, str(outs["coordinator"]), "--", *coordinator], env=env, cwd=ROOT
            )
        ]
        time.sleep(1.0)
        ddp = str(ROOT / "benchmarks" / "ddp.py")
        for rank in range(args.world):
            worker = [ddp, "--worker", "paramsync", "--rank", str(rank), "--world"]
            worker += [str(args.world), "--port", str(port), "--steps", str(args.steps)]
            worker += [f"--option={item}" for item in args.option]
            procs.append(
                subprocess.Popen(
                    [*wrap, str(outs[f"rank {rank}"]), "--", *worker],
                    env=env,
                    cwd=ROOT,
                    stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                    text=True,
                )
            )
        rank0 = procs[1].communicate()[0]
        if any(proc.wait() != 0 for proc in procs):
            raise SystemExit("a process failed: " + ", ".join(str(p.returncode) for p in procs))
        records = {name: json.loads(path.read_text()) for name, path in outs.items()}
    short = [
        f"{name} at {r['ended_at']:.1f} s" for name, r in records.items() if "process" not in r
    ]
    if short:
        raise SystemExit(
            f"the run ended before the window ({args.window[0]:g}-{args.window[1]:g} s) closed: "
            f"{', '.join(short)}; give it more --steps"
        )
    result = json.loads(rank0.strip().splitlines()[-1])
    per_step = 1.0 / (result["steps_per_second"] * (args.window[1] - args.window[0]))
    print(f"{args.world} workers, {result['steps_per_second']:.2f} steps/s; CPU a step (ms):")
    for name in names:
        record = records[name]
        print(
            f"  {name}: process {record['process'] * 1e3 * per_step:.2f}, event loop "
            f"{record['event_loop'] * 1e3 * per_step:.2f}, task steps "
            f"{sum(record['task_steps'].values()) * per_step:.1f}"
        )
    _print_floor(records, names, per_step, 1e3 / result["steps_per_second"])
    for name in ("coordinator", f"rank {args.rank}"):
        record = records[name]
        print(f"{name}, parts (ms a step):")
        for label, ns in sorted(record["parts"].items(), key=lambda item: -item[1]):
            print(f"  {ns / 1e6 * per_step:7.3f}  {label}")
        print(f"{name}, task steps by task and where it paused (ms a step, steps a step):")
        tasks = sorted(record["tasks"].items(), key=lambda item: -item[1])[: args.top]
        for key, ns in tasks:
            count = record["task_steps"][key] * per_step
            print(f"  {ns / 1e6 * per_step:7.3f} {count:5.2f}  {key}")


def contract_floor(
    records: dict[str, Any], names: list[str], per_step: float, cores: int
) -> tuple[dict[str, dict[str, float]], float, float]:
    """The mandated parts' CPU a step in ms (`MANDATED`), per process and part; their sum over
    the processes; and the least wall time (ms) that sum adds a step, spread perfectly over
    ``cores`` cores. ``per_step``: one recorded window's figures per step."""
    per_process = {}
    for name in names:
        wanted = MANDATED["coordinator" if name == "coordinator" else "rank"]
        parts = records[name]["parts"]
        per_process[name] = {label: parts.get(label, 0) / 1e6 * per_step for label in wanted}
    total = sum(sum(parts.values()) for parts in per_process.values())
    return per_process, total, total / cores


def _print_floor(
    records: dict[str, Any], names: list[str], per_step: float, step_ms: float
) -> None:
    cores = os.cpu_count() or 1
    per_process, total, floor = contract_floor(records, names, per_step, cores)
    print(f"the contracts' own work, CPU a step (ms), {cores} cores:")
    for name, parts in per_process.items():
        shown = ", ".join(f"{label} {value:.3f}" for label, value in parts.items() if value)
        print(f"  {name}: {sum(parts.values()):.3f} ({shown})")
    print(
        f"  all processes: {total:.3f} ms of CPU; spread over {cores} cores at best "
        f"{floor:.3f} ms of wall a step"
    )
    print(
        f"  = {floor / step_ms * 100:.2f} % of this run's step (the limit's step is shorter, "
        "so its share of the limit is larger)"
    )


if __name__ == "__main__":
    main()
