"""The demo job's loss curve with each gradient-compression hook against uncompressed.

Trains the demo job's model and data (`paramsync.actors.demo_job`: the `CharTransformer` on the
stdlib character corpus, AdamW, each rank its `shard`) with paramsync for ``--steps`` steps, once
per ``--hooks`` entry (``TrainerOptions.comm_hook``), every run from the same weights on the same
batches, ``--world`` workers in one process over in-process transports. Prints each hook's loss (the
mean over ranks) every ``--every`` steps, the mean of the last 10 steps, and the gap to the
uncompressed run.

    python benchmarks/compression_loss.py --steps 200 --json out/compression_loss.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import trio  # noqa: E402

from paramsync.actors.demo_job.corpus import load_char_dataset  # noqa: E402
from paramsync.actors.demo_job.model import CharTransformer  # noqa: E402
from paramsync.actors.graph.sampler import shard  # noqa: E402
from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions  # noqa: E402
from paramsync.actors.train.worker import train_in_process  # noqa: E402
from paramsync.runtime.collectives.compression import COMM_HOOKS  # noqa: E402


def run_hook(args: argparse.Namespace, hook: str) -> list[float]:
    """The mean loss over ranks at each step of one run with ``hook``."""
    torch.manual_seed(args.seed)
    vocab, dataset = load_char_dataset(args.context, max_bytes=args.corpus_bytes)

    def make_replica(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = CharTransformer(
            len(vocab), args.d_model, args.heads, args.layers, args.context, seed=args.seed
        )
        return model, torch.optim.AdamW(model.parameters(), lr=args.lr)

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return model.loss(inputs, targets)  # type: ignore[operator]

    async def body(trainer: DistributedTrainer) -> list[float]:
        rank = trainer.dist_config.rank
        indices = shard(len(dataset), rank, args.world, args.seed)
        per_epoch = len(indices) // args.batch_size
        losses = []
        for step in range(args.steps):
            epoch, index = divmod(step, per_epoch)
            order = (
                indices if epoch == 0 else shard(len(dataset), rank, args.world, args.seed, epoch)
            )
            start = index * args.batch_size
            batch = dataset.batch(order[start : start + args.batch_size])
            losses.append(await trainer.train_batch(batch))
        await trainer.verified()
        return losses

    options = TrainerOptions(
        comm_hook=hook,
        powersgd_rank=args.powersgd_rank,
        powersgd_start_iter=args.powersgd_start_iter,
    )
    per_rank = trio.run(
        lambda: train_in_process(args.world, make_replica, loss_fn, body, options=options)
    )
    return [statistics.fmean(step) for step in zip(*per_rank)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hooks", nargs="+", choices=COMM_HOOKS, default=list(COMM_HOOKS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=25, help="print the loss every this many")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus-bytes", type=int, default=1 << 20)
    parser.add_argument("--powersgd-rank", type=int, default=1)
    parser.add_argument("--powersgd-start-iter", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the curves here")
    args = parser.parse_args()
    if "none" not in args.hooks:
        args.hooks.insert(0, "none")
    torch.set_num_threads(1)
    curves: dict[str, list[float]] = {}
    seconds: dict[str, float] = {}
    for hook in args.hooks:
        started = time.perf_counter()
        curves[hook] = run_hook(args, hook)
        seconds[hook] = time.perf_counter() - started
        print(f"{hook}: {args.steps} steps in {seconds[hook]:.0f} s", flush=True)
    marks = sorted({*range(0, args.steps, args.every), args.steps - 1})
    print(f"{'step':>6} " + " ".join(f"{hook:>9}" for hook in args.hooks))
    for step in marks:
        print(f"{step + 1:>6} " + " ".join(f"{curves[h][step]:>9.4f}" for h in args.hooks))
    base = statistics.fmean(curves["none"][-10:])
    for hook in args.hooks:
        last = statistics.fmean(curves[hook][-10:])
        gap = max(abs(a - b) for a, b in zip(curves[hook], curves["none"]))
        print(
            f"{hook}: mean loss of the last 10 steps {last:.4f} ({last - base:+.5f} against "
            f"uncompressed), largest gap along the curve {gap:.2e}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"settings": vars(args) | {"json": None}, "curves": curves}, indent=2)
        )


if __name__ == "__main__":
    main()
