"""Is `benchmarks/multidevice.py`'s one-replica baseline handicapped by running on the main
thread? The same step (one LoRA replica, both halves of the batch in turn, one optimizer step,
one intra-op thread) on the main thread and on a separate thread, in alternating blocks of
steps, so both see the same machine; prints the median step of each.

    python benchmarks/baseline_thread.py --blocks 8 --steps 10
"""

from __future__ import annotations

import argparse
import functools
import json
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import multidevice as md


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8, help="alternating blocks per thread")
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    threads_before = torch.get_num_threads()
    try:
        return _measure(args)
    finally:
        torch.set_num_threads(threads_before)  # a caller in-process keeps its threading


def _measure(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(1)
    model = md.lora_model(args.rank)
    optimizer = md.optimizer(model)
    half = args.batch // 2

    def step(index: int) -> None:
        optimizer.zero_grad()
        idx, targets = md.batch(index, args.batch)
        for lo in (0, half):
            shard = (idx[lo : lo + half], targets[lo : lo + half])
            (md.loss_fn(model, shard) / 2).backward()
        optimizer.step()

    jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
    done: queue.SimpleQueue[float] = queue.SimpleQueue()

    def serve() -> None:
        torch.set_num_threads(1)
        while (job := jobs.get()) is not None:
            started = time.perf_counter()
            job()
            done.put(time.perf_counter() - started)

    worker = threading.Thread(target=serve, name="baseline", daemon=True)
    worker.start()
    on_main: list[float] = []
    on_thread: list[float] = []
    for _ in range(args.blocks):
        for index in range(args.steps):
            started = time.perf_counter()
            step(index)
            on_main.append(time.perf_counter() - started)
        for index in range(args.steps):
            jobs.put(functools.partial(step, index))
            on_thread.append(done.get())
    jobs.put(None)
    worker.join()
    skip = args.steps if args.blocks > 1 else 0  # the first block warms up
    result = {
        "main_thread_ms": statistics.median(on_main[skip:]) * 1e3,
        "other_thread_ms": statistics.median(on_thread[skip:]) * 1e3,
        "steps_each": len(on_main) - skip,
    }
    print(
        f"one replica, batch {args.batch}: main thread {result['main_thread_ms']:.2f} ms, "
        f"another thread {result['other_thread_ms']:.2f} ms (medians of {result['steps_each']} "
        f"steps each, alternating blocks of {args.steps})"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
