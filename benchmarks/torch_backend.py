"""torch.distributed on the ``paramsync`` backend against ``gloo``, same run: torch DDP's step
and ``dist.all_reduce``.

The same torch program runs on each backend, ``init_process_group(backend)`` being the only
difference, one OS process per rank on this machine's loopback, one intra-op thread per rank:

- DDP: ``torch.nn.parallel.DistributedDataParallel`` around a small model (``--model``: the
  demo's ``CharTransformer``, d_model 128, 2 layers, or ``CharMLP``, an embedding and a
  two-layer MLP per position; both from benchmarks/ddp.py), the same initial weights and the
  same synthetic batches (random characters, seeded by rank) on both backends, AdamW; rank 0
  takes the time between the ends of consecutive steps after ``--warmup`` untimed ones.
  paramsync proves the identical state after every optimizer step (its default); with
  ``--proof-cost`` paramsync also runs with the proof off (``PARAMSYNC_STATE_PROOF=0``);
- all-reduce: ``dist.all_reduce`` (sum) of a float32 tensor at each ``--sizes`` (4 KiB to
  64 MiB), back-to-back calls after a barrier; the median over repeats and rounds of the time
  per call, the algorithm bandwidth (bytes / time) and bus bandwidth (algbw x 2(n-1)/n).

Every ratio is paramsync / gloo (time: above 1 paramsync is slower): for DDP the median over
rounds of each round's ratio of median step times (steadier than a ratio of pooled medians when
the machine's speed drifts), for the all-reduce the ratio of the medians. The systems alternate
round by round (the order reversed every other round) so that drift in load hits all alike.

    python benchmarks/torch_backend.py --json out/torch_backend.json
    python benchmarks/torch_backend.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GLOO, PARAMSYNC, NO_PROOF = "gloo", "paramsync", "paramsync-noproof"
BASELINE = "paramsync@baseline"
"""paramsync with the code of the checkout ``--baseline`` names (an A/B in the same rounds)."""
LABELS = {
    GLOO: "gloo",
    PARAMSYNC: "paramsync",
    NO_PROOF: "paramsync, proof off",
    BASELINE: "paramsync, baseline",
}
PARTS = ("ddp", "allreduce")
DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
LAUNCH_SECONDS = 600.0
VOCAB = 96
"""Characters in the synthetic batches' alphabet (the stdlib corpus has about this many)."""


def _free_port() -> int:
    """A port free now, below Linux's ephemeral range (32768 up), so that no connection another
    program opens meanwhile is given it before torch's store binds it."""
    for _ in range(100):
        port = random.randrange(20000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-31999 on 127.0.0.1")


def _iterations(nbytes: int) -> int:
    """Enough back-to-back calls that one repeat takes a measurable while."""
    if nbytes <= 64 << 10:
        return 100
    if nbytes <= 2 << 20:
        return 20
    if nbytes <= 32 << 20:
        return 4
    return 2


# ----------------------------------------------------------------------------- workers


def _model(args: argparse.Namespace):
    """The model benchmarks/ddp.py trains (the same seed: the same weights on every rank)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ddp as ddp_bench  # benchmarks/ddp.py, this script's sibling

    from paramsync.actors.demo_job.model import CharTransformer

    if args.model == "mlp":
        return ddp_bench._mlp_model(VOCAB, args.d_model, args.seed)
    return CharTransformer(
        VOCAB, args.d_model, args.heads, args.layers, args.context, seed=args.seed
    )


def _ddp_steps(args: argparse.Namespace) -> dict:
    """Train the model in torch DDP on the default group; rank 0's step ends and losses."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = _model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed * 1000 + args.rank)
    total = args.warmup + args.steps
    tokens = torch.randint(VOCAB, (total, args.batch_size, args.context + 1), generator=generator)
    forward = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    _KEEP_ALIVE.append(forward)
    ends: list[float] = []
    losses: list[float] = []
    for step in range(total):
        inputs, targets = tokens[step, :, :-1], tokens[step, :, 1:]
        optimizer.zero_grad()
        logits = forward(inputs)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )
        loss.backward()  # DDP all-reduces the gradient buckets on the group's backend
        optimizer.step()
        losses.append(float(loss.detach()))
        ends.append(time.perf_counter())
        if step == args.warmup - 1:
            cpu_start = time.process_time()
    return {
        "step_seconds": [b - a for a, b in zip(ends[args.warmup - 1 :], ends[args.warmup :])],
        # This process's CPU time (all its threads: the backend's too) a timed step.
        "cpu_seconds_per_step": (time.process_time() - cpu_start) / args.steps,
        "losses": losses,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _allreduce_sweep(args: argparse.Namespace) -> list[dict]:
    """``dist.all_reduce`` at every size: the time per call of each repeat."""
    import torch
    import torch.distributed as dist

    rows = []
    for nbytes in args.sizes:
        tensor = torch.ones(nbytes // 4, dtype=torch.float32)
        iters = max(1, _iterations(nbytes) // (4 if args.quick else 1))
        dist.all_reduce(tensor)  # warm-up: buffers, the backend's first call of this shape
        for repeat in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(tensor)
            elapsed = (time.perf_counter() - start) / iters
            rows.append({"bytes": nbytes, "repeat": repeat, "seconds": elapsed})
    return rows


_KEEP_ALIVE: list[object] = []
"""torch objects a gloo rank must not destroy before it exits (see `_run_worker`)."""


def _run_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = GLOO if args.worker == GLOO else PARAMSYNC
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world
    )
    result: dict = {"backend": dist.get_backend()}
    if "ddp" in args.parts:
        result["ddp"] = _ddp_steps(args)
    if "allreduce" in args.parts:
        result["allreduce"] = _allreduce_sweep(args)
    dist.barrier()
    if args.rank == 0:
        print(json.dumps(result), flush=True)
    if args.worker == GLOO:
        # As benchmarks/ddp.py: never let torch tear a DDP rank's gloo group down (its
        # destructor can hang joining gloo's worker thread); the result is out.
        sys.stdout.flush()
        os._exit(0)
    dist.destroy_process_group()  # paramsync: the group's orderly end (bounded)


# ----------------------------------------------------------------------------- driver


def _worker_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--parts", *args.parts, "--sizes", *map(str, args.sizes)]
    for name in (
        "model",
        "steps",
        "warmup",
        "batch_size",
        "context",
        "d_model",
        "layers",
        "heads",
        "lr",
        "seed",
        "bucket_cap_mb",
        "repeats",
    ):
        flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return flags + (["--quick"] if args.quick else [])


def _launch(system: str, world: int, args: argparse.Namespace) -> dict:
    """One run of ``system`` with ``world`` ranks (again on a fresh port, up to 4 times more,
    when another program took the chosen one before torch's store bound it)."""
    for attempt in range(5):
        try:
            return _launch_once(system, world, args, _free_port())
        except RuntimeError as exc:
            if "EADDRINUSE" not in str(exc) or attempt == 4:
                raise
    raise AssertionError("unreachable")


def _launch_once(system: str, world: int, args: argparse.Namespace, port: int) -> dict:
    code = Path(args.baseline).resolve() if system == BASELINE else ROOT
    env = dict(
        os.environ,
        # The code first (its paramsync.actors.torch_backend is the backend torch loads), then what
        # PYTHONPATH already held.
        PYTHONPATH=os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
    )
    env.setdefault("PARAMSYNC_SECRET", secrets.token_hex(16))
    if system == NO_PROOF:
        env["PARAMSYNC_STATE_PROOF"] = "0"
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="paramsync-torch-backend-bench-") as tmp:
        logs = [Path(tmp) / f"rank{rank}.err" for rank in range(world)]
        out_path = Path(tmp) / "rank0.out"
        with open(out_path, "w") as out:
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
                    *_worker_flags(args),
                ]
                with open(logs[rank], "w") as err:
                    stdout = out if rank == 0 else subprocess.DEVNULL
                    procs.append(
                        subprocess.Popen(cmd, env=env, stdout=stdout, stderr=err, cwd=code)
                    )
        _wait_all(procs, logs, f"{system} with {world} ranks")
        return json.loads(out_path.read_text().strip().splitlines()[-1])


def _wait_all(procs: list[subprocess.Popen], logs: list[Path], what: str) -> None:
    """Wait for every rank; on a failure or the deadline stop the rest and raise."""
    deadline = time.monotonic() + LAUNCH_SECONDS
    failure = None
    for rank, proc in enumerate(procs):
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            failure = f"{what}: rank {rank} still running after {LAUNCH_SECONDS:.0f} s"
            break
        if code != 0:
            failure = f"{what}: rank {rank} exited with code {code}"
            break
    if failure is None:
        return
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    tails = "\n".join(
        f"--- rank {rank} stderr ---\n{log.read_text()[-3000:]}" for rank, log in enumerate(logs)
    )
    raise RuntimeError(f"{failure}\n{tails}")


def _summarise(runs: dict, systems: list[str], args: argparse.Namespace) -> dict:
    table: dict = {"ddp": [], "allreduce": []}
    for world in args.worlds:
        if "ddp" in args.parts:
            row: dict = {"world_size": world}
            for system in systems:
                results = [r["ddp"] for r in runs[(system, world)]]
                medians = [statistics.median(r["step_seconds"]) for r in results]
                row[system] = {
                    "median_step_seconds": statistics.median(
                        s for r in results for s in r["step_seconds"]
                    ),
                    "round_median_step_seconds": medians,
                    "cpu_seconds_per_step": statistics.median(
                        r["cpu_seconds_per_step"] for r in results
                    ),
                    "final_loss": results[-1]["losses"][-1],
                    "first_loss": results[-1]["losses"][0],
                }
                row["parameters"] = results[0]["parameters"]
            for system in systems:
                if system == GLOO:
                    continue
                ratios = [
                    ours / theirs
                    for ours, theirs in zip(
                        row[system]["round_median_step_seconds"],
                        row[GLOO]["round_median_step_seconds"],
                    )
                ]
                row[system]["round_ratios"] = ratios
                row[system]["ratio"] = statistics.median(ratios)
            table["ddp"].append(row)
        if "allreduce" in args.parts:
            for nbytes in args.sizes:
                row = {"world_size": world, "bytes": nbytes}
                for system in systems:
                    samples = [
                        sample["seconds"]
                        for r in runs[(system, world)]
                        for sample in r["allreduce"]
                        if sample["bytes"] == nbytes
                    ]
                    seconds = statistics.median(samples)
                    algbw = nbytes / seconds / 1e9
                    row[system] = {
                        "seconds": seconds,
                        "algbw_GBps": algbw,
                        "busbw_GBps": algbw * 2 * (world - 1) / world,
                        "samples": len(samples),
                    }
                for system in systems:
                    if system != GLOO:
                        row[system]["ratio"] = row[system]["seconds"] / row[GLOO]["seconds"]
                table["allreduce"].append(row)
    return table


def _human(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _print_table(table: dict, systems: list[str]) -> None:
    if table["ddp"]:
        others = [s for s in systems if s != GLOO]
        header = f"{'n':>2} | {'gloo step':>10}" + "".join(
            f" | {LABELS[s] + ' step':>20} {'ratio':>6}" for s in others
        )
        print("torch DDP, median step (pooled over rounds); ratio = paramsync / gloo, median of")
        print("the rounds' ratios")
        print(header)
        print("-" * len(header))
        for row in table["ddp"]:
            line = f"{row['world_size']:>2} | {row[GLOO]['median_step_seconds'] * 1e3:>7.2f} ms"
            for system in others:
                cell = row[system]
                line += f" | {cell['median_step_seconds'] * 1e3:>17.2f} ms {cell['ratio']:>5.3f}x"
            print(line)
        for row in table["ddp"]:
            rounds = "; ".join(
                f"{LABELS[s]} " + ", ".join(f"{r:.3f}" for r in row[s]["round_ratios"])
                for s in systems
                if s != GLOO
            )
            losses = ", ".join(f"{LABELS[s]} {row[s]['final_loss']:.4f}" for s in systems)
            cpu = ", ".join(
                f"{LABELS[s]} {row[s]['cpu_seconds_per_step'] * 1e3:.2f} ms" for s in systems
            )
            print(f"n={row['world_size']}: round ratios: {rounds}")
            print(f"n={row['world_size']}: rank 0's CPU a step (all threads): {cpu}")
            print(f"n={row['world_size']}: final loss: {losses}")
        print()
    if table["allreduce"]:
        header = f"{'n':>2} {'size':>8}"
        for system in systems:
            header += f" | {LABELS[system]:>20} {'busbw':>7}" + (" ratio" if system != GLOO else "")
        print("dist.all_reduce (sum, float32), median time a call; busbw in GB/s; ratio = time")
        print("paramsync / time gloo")
        print(header)
        print("-" * len(header))
        for row in table["allreduce"]:
            line = f"{row['world_size']:>2} {_human(row['bytes']):>8}"
            for system in systems:
                cell = row[system]
                line += f" | {cell['seconds'] * 1e3:>17.3f} ms {cell['busbw_GBps']:>7.3f}"
                if system != GLOO:
                    line += f" {cell['ratio']:>4.2f}x"
            print(line)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per system")
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to time"
    )
    parser.add_argument("--steps", type=int, default=30, help="timed DDP steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed DDP steps before them")
    parser.add_argument("--model", choices=("transformer", "mlp"), default="transformer")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size")
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="bytes")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per size and run")
    parser.add_argument(
        "--proof-cost",
        action="store_true",
        help="also run paramsync with the identical-state proof off (PARAMSYNC_STATE_PROOF=0)",
    )
    parser.add_argument(
        "--baseline",
        metavar="PATH",
        help="also run paramsync with the code of the checkout at PATH (its runtime and actors "
        "packages; this script's workers) in the same rounds, and report it against gloo too",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a seconds-long run: 2 ranks, the MLP, 1 round of 2 + 4 steps, 2 sizes, 1 repeat",
    )
    parser.add_argument("--json", type=Path, help="write the table as JSON here")
    parser.add_argument("--worker", choices=tuple(LABELS), help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.worker:
        _run_worker(args)
        return
    if args.quick:
        args.worlds, args.rounds, args.model, args.warmup, args.steps = [2], 1, "mlp", 2, 4
        args.sizes, args.repeats = [4 << 10, 1 << 20], 1
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1 or args.repeats < 1:
        raise SystemExit("--warmup, --steps, --rounds and --repeats must be at least 1")
    if any(size < 4 or size % 4 for size in args.sizes):
        raise SystemExit("--sizes: every size must be a positive multiple of 4 bytes (float32)")
    if any(world < 2 for world in args.worlds):
        raise SystemExit("--worlds: every world size must be at least 2")
    if args.baseline and not (Path(args.baseline) / "actors" / "torch_backend").is_dir():
        raise SystemExit(
            f"--baseline {args.baseline}: not a paramsync checkout with the torch backend "
            "(no actors/torch_backend)"
        )
    systems = [GLOO, PARAMSYNC] + ([NO_PROOF] if args.proof_cost else [])
    systems += [BASELINE] if args.baseline else []
    load = os.getloadavg()
    model = (
        f"CharMLP d_model {args.d_model}"
        if args.model == "mlp"
        else f"CharTransformer d_model {args.d_model}, {args.layers} layers, {args.heads} heads"
    )
    print(
        f"machine: {os.cpu_count()} CPUs, {platform.machine()}, Python "
        f"{platform.python_version()}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    print(
        f"DDP: {model}, context {args.context}; batch {args.batch_size} per rank; AdamW lr "
        f"{args.lr}; {args.warmup} warm-up + {args.steps} timed steps; all-reduce sizes "
        f"{', '.join(_human(s) for s in args.sizes)}, {args.repeats} repeats; {args.rounds} "
        f"rounds; worlds {', '.join(map(str, args.worlds))}",
        flush=True,
    )
    runs: dict = {}
    started = time.perf_counter()
    for world in args.worlds:
        for round_index in range(args.rounds):
            order = systems if round_index % 2 == 0 else systems[::-1]
            for system in order:
                result = _launch(system, world, args)
                runs.setdefault((system, world), []).append(result)
                note = ""
                if "ddp" in result:
                    steps = result["ddp"]["step_seconds"]
                    note = (
                        f": DDP median step {statistics.median(steps) * 1e3:.2f} ms, rank 0's "
                        f"CPU {result['ddp']['cpu_seconds_per_step'] * 1e3:.2f} ms a step"
                    )
                print(
                    f"world size {world}, round {round_index + 1}/{args.rounds}, "
                    f"{LABELS[system]} done{note}",
                    flush=True,
                )
    table = _summarise(runs, systems, args)
    _print_table(table, systems)
    print(f"total benchmark time {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {
            k: v for k, v in vars(args).items() if k not in ("json", "worker", "rank", "port")
        }
        report = {
            "cpu_count": os.cpu_count(),
            "load_average": list(load),
            "systems": systems,
            "settings": settings,
            **table,
        }
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
