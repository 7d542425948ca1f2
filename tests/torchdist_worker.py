"""One rank of a torch FSDP2, HSDP or tensor-parallel training script, as its users write it,
on a backend named on the command line (tests/test_torch_proof.py, benchmarks/torchdist.py).

    torchdist_worker.py SCENARIO BACKEND RANK WORLD STORE OUT_DIR [STEPS] [NUDGE_STEP]

SCENARIO: ``fsdp`` (``fully_shard`` on a 1-D mesh of every rank), ``hsdp`` (``fully_shard``
on a 2-D mesh: WORLD/2 replicas x 2 shards), ``tp`` (``parallelize_module``: a column-wise
and a row-wise Linear, then a LayerNorm whose parameters are replicated DTensors). With
NUDGE_STEP, one rank changes one replicated tensor silently after that step's optimizer step
(``hsdp``: rank 2, its shard of ``0.weight``, held also by rank 0; ``tp``: rank 1,
``3.weight``). Writes ``rankN.pt`` (the full model state after the last step) or, on an
error, ``rankN.err`` (seconds, then the error's last line) and exits 3; its stderr carries
the proof's notice.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

NUDGED = {"hsdp": (2, "0.weight"), "tp": (1, "3.weight")}
"""The rank that nudges and the parameter it nudges, by scenario."""


def build(scenario: str, world: int, width: int = 32) -> tuple[torch.nn.Module, int]:
    """The scenario's model, parallelized, and its output width."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    if scenario == "tp":
        from torch.distributed.tensor import distribute_module
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        model = torch.nn.Sequential(
            torch.nn.Linear(16, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 16, bias=False),
            torch.nn.LayerNorm(16),
        )
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel(use_local_output=False)}
        parallelize_module(model, mesh, plan)
        distribute_module(model[3], mesh)  # the LayerNorm's weight and bias: Replicate
        return model, 16
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width), torch.nn.LayerNorm(width), torch.nn.Linear(width, 4)
    )
    if scenario == "hsdp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    elif scenario == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, 4


def batch(scenario: str, rank: int, world: int, step: int, out: int) -> tuple[Any, Any]:
    """Each data-parallel rank's batch of ``step`` (the tensor-parallel ranks share one)."""
    seed = 0 if scenario == "tp" else rank
    gen = torch.Generator().manual_seed(1000 * step + seed)
    return torch.randn(8, 16, generator=gen), torch.randn(8, out, generator=gen)


def local(value: Any) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def train(scenario: str, rank: int, world: int, steps: int, nudge: int | None) -> torch.nn.Module:
    model, out = build(scenario, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = batch(scenario, rank, world, step, out)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(local(model(x)), y)
        loss.backward()
        optimizer.step()
        if nudge is not None and step == nudge and rank == NUDGED[scenario][0]:
            with torch.no_grad():
                local(model.get_parameter(NUDGED[scenario][1])).view(-1)[0] += 1e-3
    return model


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        state[name] = full.detach().clone()
    return state


def main() -> None:
    scenario, backend, rank, world, store, out_dir = sys.argv[1:7]
    steps = int(sys.argv[7]) if len(sys.argv) > 7 else 4
    nudge = int(sys.argv[8]) if len(sys.argv) > 8 else None
    rank_i, world_i, out = int(rank), int(world), Path(out_dir)
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank_i,
        world_size=world_i,
        timeout=timedelta(seconds=60),
    )
    started = time.monotonic()
    try:
        model = train(scenario, rank_i, world_i, steps, nudge)
        state = full_state(model)
        torch.save(state, out / f"rank{rank}.pt")
        dist.barrier()
    except Exception as exc:
        line = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        (out / f"rank{rank}.err").write_text(f"{time.monotonic() - started:.2f}\n{line}\n")
        print(f"rank {rank}: {line}", file=sys.stderr, flush=True)
        import os

        os._exit(3)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
