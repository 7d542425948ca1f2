"""Multi-device benchmark: one process with 2 CPU replicas in threads, against one replica and
against torch DDP, on the same LoRA model in the same run.

The model: the built-in `CharTransformer` (d_model 128, 2 layers, 4 heads, context 64), wrapped
by peft's ``get_peft_model`` with LoRA (rank ``--rank``) on every attention and MLP linear
layer, the base frozen; AdamW over the adapters (``--optimizer``: torch's default for-loop
implementation, or its ``foreach`` or ``fused`` one, for every system alike); the same total
batch (``--batch`` sequences of 64 characters from the stdlib corpus) for every system:

- ``threads``: `DataParallelCoordinator` with two ``"cpu"`` devices, each replica on its own OS
  thread with one intra-op thread, half the batch each, the digest check every step (C-DP-002;
  ``--check-interval`` changes it, to see what the check costs);
- ``one``: one replica with one intra-op thread processing both halves in turn (forward and
  backward of each, gradients accumulated, one optimizer step): the same work without
  parallelism;
- ``ddp``: torch ``DistributedDataParallel`` over 2 processes (gloo), one intra-op thread each,
  half the batch each;
- ``limit``: the machine's physical ceiling: the same 2 processes, each training its own replica
  on its half of the batch with no communication at all (a gloo barrier before the first step
  and after the last only, so that they compete for the cores as DDP's ranks do), as
  benchmarks/ddp.py's ``limit``; ``one``/``limit`` per round is the best speed-up any 2-way data
  parallelism could show here.

``--device cuda`` puts every system's replicas on the GPUs instead (replica or rank ``i`` on
``cuda:i % device_count``: with one GPU, both replicas of ``threads`` and both DDP processes
share it; DDP and the limit still go through gloo), each step's time taken after
``torch.cuda.synchronize()``.

With ``--baseline PATH`` (another checkout, e.g. ``git worktree add /tmp/base <commit>``), each
round also runs ``threads@baseline``: the same ``threads`` system with that checkout's code; both
then run in a fresh process each (``--threads-worker``), and their step-time ratio per round is
printed (this code / the baseline's, median over rounds).

Each round runs every system (``--warmup`` untimed steps, then ``--steps`` timed); a system's
figure per round is its median step time. Printed: the medians over rounds, throughput in
samples/s, the CPU cores each system actually got (its processes' CPU seconds per wall
second: on a shared host the second core may not be free) and the CPU time each spends per step
(all its processes' and threads'), the ``threads`` speed-up over ``one`` (target >= 1.7 on a
2-core host, >= 1.3 with ``--device cuda``) and the ``threads``/``ddp`` step-time ratio (target
<= 1), both computed per round and their median shown, and which of torch's kernels the
replicas' AdamW runs.
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
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
CODE_ENV = "PARAMSYNC_BENCH_CODE"
"""The checkout whose code a ``--threads-worker`` imports (``--baseline``'s); this one's by
default."""
sys.path.insert(0, os.environ.get(CODE_ENV, str(ROOT)))

from paramsync.actors.demo_job.corpus import load_corpus  # noqa: E402
from paramsync.actors.demo_job.model import CharTransformer  # noqa: E402
from paramsync.actors.multidevice import DataParallelCoordinator  # noqa: E402

CONTEXT = 64
TARGETS = ["qkv", "proj", "fc", "out"]


def lora_model(rank: int) -> torch.nn.Module:
    import peft

    base = CharTransformer(VOCAB, d_model=128, n_heads=4, n_layers=2, context=CONTEXT, seed=0)
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=True
    )
    torch.manual_seed(1)
    return peft.get_peft_model(base, config)


def loss_fn(model: torch.nn.Module, shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    idx, targets = shard
    logits = model(idx)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


OPTIMIZERS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
"""``--optimizer``: AdamW as a user writes it (``default``: torch's for-loop implementation on
CPU), or its ``foreach`` or ``fused`` implementation (the same arithmetic in fewer kernels)."""


def optimizer(model: torch.nn.Module, kind: str = "default") -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=3e-3, **OPTIMIZERS[kind])


def _corpus() -> torch.Tensor:
    text = load_corpus()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    return torch.tensor([lookup[c] for c in text], dtype=torch.long), len(chars)


DATA, VOCAB = _corpus()


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(DATA) - CONTEXT - 1, (size,), generator=generator)
    idx = torch.stack([DATA[s : s + CONTEXT] for s in starts.tolist()])
    targets = torch.stack([DATA[s + 1 : s + CONTEXT + 1] for s in starts.tolist()])
    return idx, targets


def _timed(step_fn: Any, args: argparse.Namespace, cpu: dict | None = None) -> list[float]:
    """Step times of the timed steps; ``cpu["cores"]``: this process's CPU seconds per wall
    second over them (how many cores it got: the machine is shared)."""
    times = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            wall, cpu_start = time.perf_counter(), time.process_time()
        data = batch(step, args.batch)
        started = time.perf_counter()
        step_fn(data)
        if args.device == "cuda":
            torch.cuda.synchronize()  # the step's kernels are done, not only queued
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    if cpu is not None:
        cpu["cores"] = (time.process_time() - cpu_start) / (time.perf_counter() - wall)
        cpu["cpu_seconds"] = time.process_time() - cpu_start
        cpu["wall_seconds"] = time.perf_counter() - wall
        cpu["cpu_seconds_per_step"] = cpu["cpu_seconds"] / args.steps
    return times


def device_of(args: argparse.Namespace, index: int) -> str:
    """Replica or rank ``index``'s device: ``"cpu"``, or with ``--device cuda``
    ``"cuda:<index % device_count>"`` (two replicas share one GPU)."""
    if args.device == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    return f"cuda:{index % torch.cuda.device_count()}"


def threads_coordinator(args: argparse.Namespace) -> DataParallelCoordinator:
    """The ``threads`` system: two replicas of the LoRA model (``--device``), one thread
    each."""
    return DataParallelCoordinator(
        lambda: lora_model(args.rank),
        lambda model: optimizer(model, args.optimizer),
        loss_fn,
        [device_of(args, 0), device_of(args, 1)],
        check_interval=args.check_interval,
    )


def run_threads(args: argparse.Namespace) -> dict:
    with threads_coordinator(args) as dp:
        results: list[Any] = []
        cpu: dict = {}
        times = _timed(lambda data: results.append(dp.train_batch_parallel(data)), args, cpu)
        timed = results[args.warmup :]
        return {
            "step_seconds": statistics.median(times),
            "compute_seconds": statistics.median(r.compute_seconds for r in timed),
            "averaging_seconds": statistics.median(r.averaging_seconds for r in timed),
            "update_seconds": statistics.median(r.update_seconds for r in timed),
            "cores": cpu["cores"],
            "cpu_seconds_per_step": cpu["cpu_seconds_per_step"],
            # Which of torch's kernels each replica's AdamW runs (a baseline's code may not say).
            "update_kernels": getattr(dp, "update_kernels", None),
        }


def run_phases(args: argparse.Namespace) -> dict[str, float]:
    """``--phases``: the threads system once more, each replica's forward/backward, optimizer
    step (with the gradient's copy in) and digest timed on the thread that runs it; medians over
    the timed steps, in ms. ``finish gap``: how far apart the two backwards end."""
    marks: list[tuple[str, int, float, float]] = []

    def timed(name: str, index: int, method: Any) -> Any:
        def call(*a: Any, **options: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*a, **options)
            finally:
                marks.append((name, index, started, time.perf_counter()))

        return call

    with threads_coordinator(args) as dp:
        for replica in dp._replicas:  # a benchmark of the internals: wrap each replica's parts
            for name in ("compute", "apply", "digest"):
                setattr(replica, name, timed(name, replica.index, getattr(replica, name)))
        steps: list[dict[tuple[str, int], tuple[float, float]]] = []
        for step in range(args.warmup + args.steps):
            data = batch(step, args.batch)
            marks.clear()
            dp.train_batch_parallel(data)
            if step >= args.warmup:
                steps.append({(name, index): (a, b) for name, index, a, b in marks})
    parts: dict[str, list[float]] = {}

    def note(label: str, seconds: float) -> None:
        parts.setdefault(label, []).append(seconds)

    for step_marks in steps:
        for index in (0, 1):
            note(f"replica {index} forward/backward", _span(step_marks[("compute", index)]))
        ends = [step_marks[("compute", index)][1] for index in (0, 1)]
        note("finish gap", abs(ends[0] - ends[1]))
        for name, label in (("apply", "optimizer step"), ("digest", "digest")):
            if (name, 0) in step_marks:
                first, second = sorted(
                    (step_marks[(name, 0)], step_marks[(name, 1)]), key=lambda span: span[0]
                )
                note(f"first {label}", _span(first))
                note(f"second {label}", _span(second))
    return {label: statistics.median(values) * 1e3 for label, values in parts.items()}


def _span(span: tuple[float, float]) -> float:
    return span[1] - span[0]


def run_one(args: argparse.Namespace) -> dict:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        device = device_of(args, 0)
        model = lora_model(args.rank).to(device)
        opt = optimizer(model, args.optimizer)

        def step(data: tuple[torch.Tensor, torch.Tensor]) -> None:
            opt.zero_grad(set_to_none=False)
            half = (args.batch + 1) // 2
            for part in ((d[:half] for d in data), (d[half:] for d in data)):
                idx, targets = (d.to(device) for d in part)
                (loss_fn(model, (idx, targets)) * (idx.shape[0] / args.batch)).backward()
            opt.step()

        cpu: dict = {}
        times = _timed(step, args, cpu)
        return {
            "step_seconds": statistics.median(times),
            "cores": cpu["cores"],
            "cpu_seconds_per_step": cpu["cpu_seconds_per_step"],
        }
    finally:
        torch.set_num_threads(previous)


def ddp_worker(rank: int, port: int, args: argparse.Namespace) -> None:
    """One DDP rank; with ``--no-communication``, one rank of the limit: its own replica, nothing
    crossing between the ranks but a barrier before the first step and one after the last."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = device_of(args, rank)
    if device != "cpu":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = lora_model(args.rank).to(device)
    if not args.no_communication:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = optimizer(model, args.optimizer)
    half = (args.batch + 1) // 2
    lo, hi = (0, half) if rank == 0 else (half, args.batch)

    def step(data: tuple[torch.Tensor, torch.Tensor]) -> None:
        opt.zero_grad(set_to_none=False)
        loss_fn(model, (data[0][lo:hi].to(device), data[1][lo:hi].to(device))).backward()
        opt.step()

    dist.barrier()
    cpu: dict = {}
    times = _timed(step, args, cpu)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"step_seconds": statistics.median(times), **cpu}), flush=True)
    # The result is out; end here, as a multiprocessing child does, without the interpreter's
    # teardown: with --optimizer fused, torch's teardown of this process aborted it after its
    # result now and then ("terminate called without an active exception", exit -6; 1 in 16
    # and 2 in 2 fifteen-round runs here), on the code of earlier sessions too.
    sys.stderr.flush()
    os._exit(0)


def _worker_options(args: argparse.Namespace) -> list[str]:
    """The options a worker process of this script runs the same model and steps with."""
    options = ("--rank", args.rank, "--batch", args.batch, "--warmup", args.warmup)
    options += ("--steps", args.steps, "--optimizer", args.optimizer, "--device", args.device)
    return [str(option) for option in options]


def run_ddp(args: argparse.Namespace, *, communicate: bool = True) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    common = _worker_options(args) + ([] if communicate else ["--no-communication"])
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--ddp-worker", str(rank), "--port", str(port), *common],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    for rank, proc in enumerate(procs):
        if proc.returncode != 0:
            raise RuntimeError(f"DDP rank {rank} exited with {proc.returncode}")
    ranks = [json.loads(output.strip().splitlines()[-1]) for output in outputs]
    cores = sum(r["cpu_seconds"] for r in ranks) / ranks[0]["wall_seconds"]
    return {
        "step_seconds": ranks[0]["step_seconds"],
        "cores": cores,
        "cpu_seconds_per_step": sum(r["cpu_seconds_per_step"] for r in ranks),
    }


def run_limit(args: argparse.Namespace) -> dict:
    return run_ddp(args, communicate=False)


def run_threads_in(code: Path, args: argparse.Namespace) -> dict:
    """The ``threads`` system in a fresh process importing ``code``'s paramsync."""
    options = [*_worker_options(args), "--check-interval", str(args.check_interval)]
    env = dict(os.environ, OMP_NUM_THREADS="1", **{CODE_ENV: str(code)})
    output = subprocess.run(
        [sys.executable, __file__, "--threads-worker", *options],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
        check=True,
        timeout=600,
    ).stdout
    result = json.loads(output.strip().splitlines()[-1])
    if Path(result["code"]).resolve() != code.resolve():
        raise RuntimeError(f"a threads worker for {code} imported {result['code']}'s paramsync")
    return result


SYSTEMS = {"threads": run_threads, "one": run_one, "ddp": run_ddp, "limit": run_limit}
BASELINE = "threads@baseline"


def summarise(rounds: list[dict[str, dict]], batch_size: int) -> dict:
    table: dict[str, Any] = {}
    systems = [name for name in (*SYSTEMS, BASELINE) if all(name in r for r in rounds)]
    for name in systems:
        seconds = statistics.median(r[name]["step_seconds"] for r in rounds)
        table[name] = {"step_seconds": seconds, "samples_per_second": batch_size / seconds}
    for name in systems:
        for key in ("cores", "cpu_seconds_per_step"):
            if all(key in r[name] for r in rounds):
                table[name][key] = statistics.median(r[name][key] for r in rounds)
    for key in ("compute_seconds", "averaging_seconds", "update_seconds"):
        table["threads"][key] = statistics.median(r["threads"][key] for r in rounds)
    table["threads"]["update_kernels"] = rounds[-1]["threads"].get("update_kernels")
    table["speedup_over_one"] = statistics.median(
        r["one"]["step_seconds"] / r["threads"]["step_seconds"] for r in rounds
    )
    table["step_ratio_to_ddp"] = statistics.median(
        r["threads"]["step_seconds"] / r["ddp"]["step_seconds"] for r in rounds
    )
    if all(BASELINE in r for r in rounds):
        table["step_ratio_to_baseline"] = statistics.median(
            r["threads"]["step_seconds"] / r[BASELINE]["step_seconds"] for r in rounds
        )
    if all("limit" in r for r in rounds):
        table["limit_speedup_over_one"] = statistics.median(
            r["one"]["step_seconds"] / r["limit"]["step_seconds"] for r in rounds
        )
        table["step_ratio_to_limit"] = statistics.median(
            r["threads"]["step_seconds"] / r["limit"]["step_seconds"] for r in rounds
        )
    return table


def _check_label(interval: int) -> str:
    if interval == 0:
        return "no digest check"
    return "digest check every step" if interval == 1 else f"digest check every {interval} steps"


def print_table(table: dict, args: argparse.Namespace) -> None:
    print(
        f"LoRA CharTransformer (rank {args.rank}, targets {TARGETS}), batch {args.batch}, "
        f"{args.rounds} rounds x {args.steps} timed steps, AdamW ({args.optimizer}), "
        f"{_check_label(args.check_interval)}, on {args.device}, medians over rounds"
    )
    labels = {
        "threads": "2 replicas in threads",
        "one": "1 replica, both shards",
        "ddp": "torch DDP, 2 procs",
        "limit": "limit: 2 procs, no comm",
        BASELINE: "threads, baseline code",
    }
    for name, label in labels.items():
        if name not in table:
            continue
        row = table[name]
        ms, rate = row["step_seconds"] * 1e3, row["samples_per_second"]
        cores = ""
        if "cores" in row and "cpu_seconds_per_step" in row:
            cpu_ms = row["cpu_seconds_per_step"] * 1e3
            cores = f"  ({row['cores']:.2f} cores used, {cpu_ms:.1f} CPU ms/step)"
        print(f"  {label:<24} {ms:8.2f} ms/step {rate:8.1f} samples/s{cores}")
    threads = table["threads"]
    print(
        f"  threads split: compute {threads['compute_seconds'] * 1e3:.2f} ms, averaging "
        f"{threads['averaging_seconds'] * 1e3:.3f} ms, "
        f"update+check {threads['update_seconds'] * 1e3:.2f} ms"
        + (
            f"; the replicas' AdamW runs torch's {'/'.join(threads['update_kernels'])} kernels"
            if threads.get("update_kernels")
            else ""
        )
    )
    goal = 1.3 if args.device == "cuda" else 1.7  # 2 replicas sharing one GPU: 1.3x
    print(f"  speed-up over one replica: {table['speedup_over_one']:.3f}x (target >= {goal}x)")
    print(f"  step time / DDP's:         {table['step_ratio_to_ddp']:.3f} (target <= 1)")
    if "step_ratio_to_baseline" in table:
        print(
            f"  threads: this code / the baseline's ({args.baseline}), round by round: "
            f"x{table['step_ratio_to_baseline']:.3f}"
        )
    if "limit_speedup_over_one" in table:
        print(
            f"  physical ceiling (one / limit): {table['limit_speedup_over_one']:.2f}x; "
            f"threads' step time / the limit's: {table['step_ratio_to_limit']:.2f}"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--batch", type=int, default=16, help="total batch (sequences)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--rounds", type=int, default=15, help="rounds; the figures are medians over them"
    )
    parser.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default="default",
        help="AdamW's implementation for every system (default: as a user writes it)",
    )
    parser.add_argument(
        "--check-interval",
        type=int,
        default=1,
        help="the threads system's C-DP-002 digest check every N steps (default 1, the "
        "library's default; 0: never, to see what the check costs)",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="then time each replica's forward/backward, optimizer step and digest",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="every system's replicas on the CPU (default) or the GPUs (replica or rank i on "
        "cuda:i %% device_count: two share one GPU)",
    )
    parser.add_argument("--json", type=Path, help="write the rounds and the table here")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout: its threads system runs in every round too (see above)",
    )
    parser.add_argument("--threads-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ddp-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--no-communication", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.ddp_worker is not None:
        ddp_worker(args.ddp_worker, args.port, args)
        return
    if args.threads_worker:
        # The checkout whose paramsync this process imported: the root package's folder's parent.
        code = Path(sys.modules["paramsync"].__file__ or "").parents[1]
        print(json.dumps({**run_threads(args), "code": str(code)}), flush=True)
        return
    if args.batch < 2:
        raise SystemExit("--batch must be at least 2 (one sample per replica)")
    systems = dict(SYSTEMS)
    if args.baseline is not None:
        baseline = args.baseline.resolve()
        if not (baseline / "paramsync" / "actors" / "multidevice").is_dir():
            raise SystemExit(
                f"--baseline {args.baseline}: no paramsync/actors/multidevice there; make one "
                "with benchmarks/baseline_checkout.py"
            )
        # Both threads systems in fresh processes, this code's and the baseline's alike.
        systems["threads"] = lambda args: run_threads_in(ROOT, args)
        systems[BASELINE] = lambda args: run_threads_in(baseline, args)
    rounds = []
    for index in range(args.rounds):
        rounds.append({name: run(args) for name, run in systems.items()})
        print(
            f"round {index + 1}: "
            + ", ".join(f"{n} {r['step_seconds'] * 1e3:.2f} ms" for n, r in rounds[-1].items()),
            flush=True,
        )
    table = summarise(rounds, args.batch)
    print_table(table, args)
    if args.phases:
        table["phases_ms"] = run_phases(args)
        print("  threads' parts, medians over the timed steps (one more run):")
        for label, ms in table["phases_ms"].items():
            print(f"    {label:<30} {ms:7.3f} ms")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rounds": rounds, "table": table}, indent=2))


if __name__ == "__main__":
    main()
