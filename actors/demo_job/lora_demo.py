"""``make demo-lora``: LoRA fine-tuning on 2 CPU devices in each of 2 processes.

``paramsync launch`` starts a coordinator and two worker processes
(`paramsync.actors.demo_job.lora_job`). Each briefly pre-trains the built-in character transformer
(seeded, the same in both), freezes it, and fine-tunes peft LoRA adapters with two replicas on two
CPU devices (one thread each): gradients averaged inside the process, then all-reduced across the
processes, identical weights checked every step in both (C-DP-002 inside, C-DDP-001 across). The
demo prints the falling loss, the adapters' digests (every replica of every process, moved from
their initial value), whether every replica's frozen base still equals the pre-trained one, and the
saved adapter's size; it exits 1 if any of these fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m paramsync.actors.demo_job.lora_demo", description=__doc__
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--pretrain-steps", type=int, default=150)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per process")
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000)
    parser.add_argument("--out", type=Path, default=Path("out/demo-lora"))
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("rank*.json"):
        stale.unlink()
    print(
        f"paramsync demo-lora: {args.workers} processes x {args.devices} CPU devices fine-tune "
        f"LoRA adapters of a briefly pre-trained, frozen character transformer\n",
        flush=True,
    )
    command = [
        sys.executable, "-m", "paramsync.runtime.cli.main", "--log-level", "WARNING", "launch",
        "--nproc", str(args.workers), "--", "-m", "paramsync.actors.demo_job.lora_job",
        "--devices", str(args.devices), "--pretrain-steps", str(args.pretrain_steps),
        "--steps", str(args.steps), "--batch-size", str(args.batch_size),
        "--corpus-bytes", str(args.corpus_bytes), "--out", str(out),
    ]  # fmt: skip
    code = subprocess.call(command)
    if code != 0:
        print(f"\ndemo-lora failed: paramsync launch exited with code {code}")
        return code
    results = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    if len(results) != args.workers:
        print(f"demo-lora failed: {len(results)} of {args.workers} workers reported")
        return 1
    digests = {d for result in results for d in result["replica_adapter_digests"]}
    trained = all(r["initial_adapter_digest"] not in digests for r in results)
    frozen = {d for r in results for d in (r["frozen_digest_before"], *r["replica_frozen_digests"])}
    head = [sum(r["losses"][:10]) / 10 for r in results]
    tail = [sum(r["losses"][-10:]) / 10 for r in results]
    first = results[0]
    print(f"pre-training loss:     {first['pretrain_loss']:.3f} (frozen base)")
    print(
        f"fine-tuning loss:      {sum(head) / len(head):.3f} -> {sum(tail) / len(tail):.3f} "
        "(mean of the first and last 10 steps over the processes)"
    )
    print(
        f"trainable:             {first['adapter_parameters']:,} of "
        f"{first['model_parameters']:,} parameters (LoRA adapters)"
    )
    print(
        f"identical adapters:    {len(digests) == 1} ({len(results)} processes x "
        f"{first['devices']} replicas, xxh3 {sorted(digests)[0][:16]}...)"
    )
    print(
        f"frozen base untouched: {len(frozen) == 1} (every replica's frozen weights equal the "
        "pre-trained base's)"
    )
    print(f"adapter (safetensors): {first['adapter_file']}, {first['adapter_bytes']:,} bytes")
    failures = [
        text
        for text, failed in (
            ("adapters differ", len(digests) != 1),
            ("adapters never moved from their initial values", not trained),
            ("frozen weights changed or differ", len(frozen) != 1),
            ("loss not falling", not sum(tail) < sum(head)),
        )
        if failed
    ]
    if failures:
        print("demo-lora failed: " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
