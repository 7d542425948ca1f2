"""One worker process of ``make demo-lora``: LoRA fine-tuning on several devices per process.

The worker pre-trains the built-in `CharTransformer` briefly on the first part of the corpus
(seeded: every process builds the same base), freezes it, wraps it with peft's LoRA on the
attention and MLP linears, and fine-tunes the adapters on the rest of the corpus with a
`DataParallelCoordinator` over ``--devices`` CPU devices (one thread each) inside a multi-process
`DistributedTrainer` run (hierarchical data parallelism: in-process average, then all-reduce).
It writes its losses, its adapters' digests (initial, and every replica's after training), the
frozen base's digests (before fine-tuning, and every replica's after) and (rank 0) the adapter
itself, as safetensors.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import xxhash

from paramsync.actors.demo_job.corpus import load_char_dataset
from paramsync.actors.demo_job.model import CharTransformer
from paramsync.actors.multidevice import DataParallelCoordinator, ReplicatedOptimizer
from paramsync.actors.train.run import run_script, trainer_from_env
from paramsync.actors.train.trainer import TrainerOptions

__all__ = ["main"]

TARGETS = ["qkv", "proj", "fc", "out"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m paramsync.actors.demo_job.lora_job", description=__doc__
    )
    parser.add_argument("--pretrain-steps", type=int, default=150)
    parser.add_argument("--steps", type=int, default=120, help="fine-tuning steps")
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out/demo-lora"))
    return parser


def _lora() -> Any:
    try:
        import peft
    except ImportError:
        raise SystemExit(
            "demo-lora needs peft: pip install 'paramsync[lora]' (make test installs it)"
        ) from None
    return peft


def loss_fn(model: torch.nn.Module, shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = shard
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )


def pretrain(model: CharTransformer, data: Any, windows: int, args: argparse.Namespace) -> float:
    """A brief, seeded, single-process pre-training of the base model; returns its last loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(args.seed)
    loss = torch.tensor(float("nan"))
    for _ in range(args.pretrain_steps):
        indices = torch.randint(0, windows, (args.batch_size,), generator=generator).tolist()
        loss = model.loss(*data.batch(indices))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss.detach())


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    peft = _lora()
    state = peft.get_peft_model_state_dict(model)
    return {name: tensor.detach().contiguous() for name, tensor in sorted(state.items())}


def frozen_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that do not train (the frozen base under the adapters), by their names
    in the base model (peft's wrapper prefixes stripped), so a bare base and a wrapped replica
    compare."""
    state = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            bare = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            state[bare] = param.detach().contiguous()
    return dict(sorted(state.items()))


def digest_of(state: dict[str, torch.Tensor]) -> str:
    hasher = xxhash.xxh3_128()
    for name, tensor in state.items():
        hasher.update(name.encode())
        hasher.update(tensor.numpy().tobytes())
    return hasher.hexdigest()


async def run(args: argparse.Namespace) -> int:
    peft = _lora()
    torch.manual_seed(args.seed)
    vocab, data = load_char_dataset(args.context, max_bytes=args.corpus_bytes)
    split = int(len(data) * 0.8)
    base = CharTransformer(len(vocab), context=args.context, seed=args.seed)
    pretrain_loss = pretrain(base, data, split, args)
    base.requires_grad_(False)
    frozen_before = digest_of(frozen_state(base))
    config = peft.LoraConfig(
        r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=TARGETS, lora_dropout=0.0
    )

    def model_factory() -> torch.nn.Module:
        torch.manual_seed(args.seed + 1)
        return peft.get_peft_model(copy.deepcopy(base), config)

    def optimizer_factory(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)

    rank = int(os.environ.get("RANK", "0"))
    dp = DataParallelCoordinator(model_factory, optimizer_factory, loss_fn, ["cpu"] * args.devices)
    initial_adapter = digest_of(adapter_state(dp.primary_pipeline))
    losses: list[float] = []
    try:
        async with trainer_from_env(
            dp.primary_pipeline,
            ReplicatedOptimizer(dp),
            dp.loss_fn,
            options=TrainerOptions(max_steps=args.steps),
        ) as trainer:
            rank = trainer.run.rank
            generator = torch.Generator().manual_seed(args.seed * 1000 + 17 + rank)
            while not trainer.run.reached_max_steps:
                indices = torch.randint(split, len(data), (args.batch_size,), generator=generator)
                losses.append(await trainer.train_batch(data.batch(indices.tolist())))
            await trainer.verified()
        dp.check()  # C-DP-002 one last time: every device's replica identical
        replicas = [digest_of(adapter_state(model)) for model in dp.replicas]
        frozen_after = [digest_of(frozen_state(model)) for model in dp.replicas]
    finally:
        dp.close()
    adapter = adapter_state(dp.primary_pipeline)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "rank": rank,
        "devices": args.devices,
        "pretrain_loss": pretrain_loss,
        "losses": losses,
        "adapter_digest": replicas[0],
        "replica_adapter_digests": replicas,
        "initial_adapter_digest": initial_adapter,
        "frozen_digest_before": frozen_before,
        "replica_frozen_digests": frozen_after,
        "adapter_parameters": sum(t.numel() for t in adapter.values()),
        "model_parameters": sum(p.numel() for p in dp.primary_pipeline.parameters()),
    }
    if rank == 0:
        from safetensors.torch import save_file

        path = args.out / "adapter.safetensors"
        save_file(adapter, str(path), metadata={"lora_rank": str(args.lora_rank)})
        result["adapter_file"] = str(path)
        result["adapter_bytes"] = path.stat().st_size
    (args.out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m paramsync.actors.demo_job.lora_job`` (under ``paramsync
    launch``)."""
    return run_script(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
