"""Activation memory with and without activation checkpointing, per block count.

The model is the demo's char transformer (`paramsync.actors.demo_job.model.CharTransformer`), its
blocks wrapped by `paramsync.actors.parallel.checkpointing.checkpoint_blocks` (one block per
checkpoint). For each number of blocks it reports:

- ``saved``: bytes of the distinct storages autograd holds for backward after the forward
  (`SavedTensorMeter`: every tensor an operation saves, plus the inputs a checkpointed block
  keeps; the parameters left out). Deterministic: the same on every machine and run.
- ``RSS fwd`` and ``peak``: how far the resident set grows from before a step to the end of its
  forward (what stays held for backward), and at its peak over forward and backward (the
  recomputation's and the gradients' transients included), each configuration in a fresh
  process after one warm-up step, with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``)
  so that freed tensors leave the resident set, and the peak restarted through
  ``/proc/self/clear_refs`` (Linux). These track ``saved`` to within a MiB or two.
- ``step``: median time of forward + backward (checkpointing recomputes each block's forward
  once more in backward).

    python benchmarks/activation_memory.py
    python benchmarks/activation_memory.py --layers 1 2 4 8 --d-model 256 --context 256 --batch 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from paramsync.actors.demo_job.model import CharTransformer  # noqa: E402
from paramsync.actors.parallel.checkpointing import SavedTensorMeter, checkpoint_blocks  # noqa: E402

VOCAB = 96


def build(args: argparse.Namespace, layers: int, checkpointed: bool) -> CharTransformer:
    model = CharTransformer(
        vocab_size=VOCAB,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=layers,
        context=args.context,
        seed=0,
    )
    if checkpointed:
        model.blocks = checkpoint_blocks(list(model.blocks))
    return model


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (args.batch, args.context), generator=generator)
    return idx, idx.roll(-1, 1)


def saved_bytes(args: argparse.Namespace, layers: int, checkpointed: bool) -> int:
    model = build(args, layers, checkpointed)
    idx, targets = batch(args)
    with SavedTensorMeter(model.parameters()) as meter:
        loss = model.loss(idx, targets)
    loss.backward()
    return meter.bytes


def step_seconds(args: argparse.Namespace, layers: int, checkpointed: bool) -> float:
    model = build(args, layers, checkpointed)
    idx, targets = batch(args)
    times = []
    for _ in range(args.repeats + 1):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model.loss(idx, targets).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def child_rss(args: argparse.Namespace, layers: int, checkpointed: bool) -> tuple[int, int]:
    """In this (fresh) process: bytes the resident set grows by (1) from before a step to the
    end of its forward, (2) at its peak during the forward and backward."""
    model = build(args, layers, checkpointed)
    idx, targets = batch(args)
    model.loss(idx, targets).backward()  # one-off allocations (kernels' caches) paid here
    model.zero_grad(set_to_none=True)
    base = _status_kib("VmRSS:")
    Path("/proc/self/clear_refs").write_text("5")  # restart VmHWM from the current RSS
    loss = model.loss(idx, targets)
    after_forward = _status_kib("VmRSS:")
    loss.backward()
    return (after_forward - base) * 1024, (_status_kib("VmHWM:") - base) * 1024


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def rss(args: argparse.Namespace, layers: int, checkpointed: bool) -> tuple[int, int]:
    """`child_rss` in a fresh process whose allocator returns every large block to the system
    when it is freed (a fixed mmap threshold), so the resident set follows the live tensors."""
    command = [
        sys.executable,
        __file__,
        "--child",
        str(layers),
        "1" if checkpointed else "0",
        "--d-model",
        str(args.d_model),
        "--heads",
        str(args.heads),
        "--context",
        str(args.context),
        "--batch",
        str(args.batch),
    ]
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    held, peak = out.strip().splitlines()[-1].split()
    return int(held), int(peak)


def mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):8.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        layers, checkpointed = args.child
        print(*child_rss(args, layers, bool(checkpointed)))
        return
    print(
        f"char transformer d_model {args.d_model}, {args.heads} heads, batch {args.batch} x "
        f"context {args.context}, float32, 1 thread; torch {torch.__version__}"
    )
    header = (
        f"{'blocks':>6}  {'saved plain':>12}  {'saved ckpt':>12}  {'ratio':>6}  "
        f"{'RSS fwd plain':>13}  {'RSS fwd ckpt':>13}  {'peak plain':>12}  {'peak ckpt':>12}  "
        f"{'step plain':>10}  {'step ckpt':>10}"
    )
    print(header)
    rows = []
    for layers in args.layers:
        row: dict[str, float] = {"blocks": layers}
        for mode, flag in (("plain", False), ("checkpointed", True)):
            row[f"saved_{mode}"] = saved_bytes(args, layers, flag)
            row[f"rss_forward_{mode}"], row[f"peak_rss_{mode}"] = rss(args, layers, flag)
            row[f"step_{mode}_s"] = step_seconds(args, layers, flag)
        row["saved_ratio"] = row["saved_plain"] / row["saved_checkpointed"]
        rows.append(row)
        print(
            f"{layers:>6}  {mib(row['saved_plain']):>12}  {mib(row['saved_checkpointed']):>12}  "
            f"{row['saved_ratio']:5.1f}x  {mib(row['rss_forward_plain']):>13}  "
            f"{mib(row['rss_forward_checkpointed']):>13}  {mib(row['peak_rss_plain']):>12}  "
            f"{mib(row['peak_rss_checkpointed']):>12}  {row['step_plain_s'] * 1e3:8.1f}ms  "
            f"{row['step_checkpointed_s'] * 1e3:8.1f}ms"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = vars(args) | {"json": str(args.json)}
        args.json.write_text(json.dumps({"config": config, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
