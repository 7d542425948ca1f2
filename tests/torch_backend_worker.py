"""One rank of a torch.distributed script on the ``paramsync`` backend
(tests/test_torch_backend.py).

    python torch_backend_worker.py SCENARIO RANK WORLD STORE OUT

Plain torch code: ``init_process_group("paramsync")`` after ``import torch``, nothing
imported from paramsync. Each rank writes what it saw to OUT (``rank<r>.pt``: the results;
``rank<r>.err``: the one error line a failed collective raised; ``rank<r>.planes.json``: how
many of the world group's calls each plane ran) and exits 0 unless the scenario says otherwise.
The ``train`` scenario ends without ``barrier`` or ``destroy_process_group``, as many scripts
do: the backend closes the group at the interpreter's exit.
``PARAMSYNC_TORCH_INNER`` (the launcher's environment) chooses the inner torch group;
``TORCHDIST_FAKE_HOSTS=N`` puts the ranks on N fake hosts (``PARAMSYNC_HOST_KEY``, contiguous
blocks of ranks; ``rank<r>.tree.json``: which of the world group's coordinators the rank
runs), and the ``tree_train`` scenario trains under the coordinator tree and again on a flat
group of the same ranks.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}


KILL_RANK = int(os.environ.get("TORCHDIST_KILL_RANK", "1"))
"""The rank the ``kill`` scenario SIGKILLs after its backward."""
DEVICE = os.environ.get("TORCHDIST_DEVICE", "cpu")
"""Where the collectives' tensors live (``cuda``: NCCL inside by default, staged through host
memory with ``PARAMSYNC_TORCH_INNER=native``)."""


def values(rank: int, dtype: torch.dtype, n: int = 37, device: str = "cpu") -> torch.Tensor:
    """Rank ``rank``'s input: seeded per rank, so every rank can compute every input."""
    gen = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen).to(dtype).to(device)
    return torch.randint(1, 100, (n,), generator=gen).to(dtype).to(device)


def collectives(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, op in REDUCE_OPS.items():
        for dtype in (torch.float32, torch.float64, torch.int64, torch.int32):
            if name == "avg" and not dtype.is_floating_point:
                continue
            if name in ("band", "bor", "bxor") and dtype.is_floating_point:
                continue
            t = values(rank, dtype, device=DEVICE)
            dist.all_reduce(t, op=op)
            out[f"allreduce/{name}/{dtype}"] = t
    big = values(rank, torch.float32, 300_000, device=DEVICE)  # the ring, in parts
    dist.all_reduce(big)
    out["allreduce/big"] = big
    b = values(rank, torch.bfloat16, device=DEVICE)
    dist.all_reduce(b)
    out["allreduce/bfloat16"] = b
    c = torch.complex(
        values(rank, torch.float32, device=DEVICE), values(rank + 7, torch.float32, device=DEVICE)
    )
    dist.all_reduce(c)
    out["allreduce/complex64"] = c
    for root in range(world):
        t = values(rank, torch.float32, device=DEVICE)
        dist.broadcast(t, src=root)
        out[f"broadcast/{root}"] = t
    gathered = [torch.empty(37, device=DEVICE) for _ in range(world)]
    dist.all_gather(gathered, values(rank, torch.float32, device=DEVICE))
    out["allgather"] = torch.stack(gathered)
    flat = torch.empty(37 * world, device=DEVICE)
    dist.all_gather_into_tensor(flat, values(rank, torch.float32, device=DEVICE))
    out["allgather_into_tensor"] = flat
    part = torch.empty(8, device=DEVICE)
    dist.reduce_scatter_tensor(part, values(rank, torch.float32, 8 * world, device=DEVICE))
    out["reduce_scatter_tensor"] = part
    listed = torch.empty(8, device=DEVICE)
    dist.reduce_scatter(
        listed, list(values(rank, torch.float32, 8 * world, device=DEVICE).chunk(world))
    )
    out["reduce_scatter"] = listed
    a2a = torch.empty(4 * world, device=DEVICE)
    dist.all_to_all_single(
        a2a, torch.arange(4 * world, dtype=torch.float32, device=DEVICE) + 100 * rank
    )
    out["all_to_all_single"] = a2a
    work = dist.all_reduce(values(rank, torch.float32, device=DEVICE), async_op=True)
    assert work is not None
    future = work.get_future()
    work.wait()
    out["async"] = future.value()[0]
    dist.barrier()
    if world > 1:
        if rank == 0:
            dist.send(torch.full((5,), 7.0), dst=1, tag=3)
        elif rank == 1:
            got = torch.empty(5)
            dist.recv(got, src=0, tag=3)
            out["recv"] = got
    sub = dist.new_group(list(range(world - 1, -1, -1))[:2])
    if rank in (world - 1, world - 2):
        t = values(rank, torch.float32, device=DEVICE)
        dist.all_reduce(t, group=sub)
        out["subgroup"] = t
    objects: list[Any] = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    out["objects"] = torch.tensor([o["rank"] for o in objects])
    return {key: value.cpu() for key, value in out.items()}


def train(
    rank: int,
    steps: int,
    nudge_at: int | None = None,
    kill_at: int | None = None,
    group: Any = None,
) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model.to(DEVICE)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        x, y = x.to(DEVICE), y.to(DEVICE)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        if kill_at is not None and step == kill_at and rank == KILL_RANK:
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.step()
        if nudge_at is not None and step == nudge_at and rank == 1:
            with torch.no_grad():
                model[2].bias[1] += 1e-3  # silently, after the step: replicas now differ
    return model


def main() -> None:
    scenario, rank, world, store, out_dir = sys.argv[1:6]
    rank_i, world_i = int(rank), int(world)
    out = Path(out_dir)
    timeout = timedelta(seconds=float(os.environ.get("TORCHDIST_TIMEOUT", "60")))
    fake_hosts = int(os.environ.get("TORCHDIST_FAKE_HOSTS", "0"))
    if fake_hosts:
        os.environ["PARAMSYNC_HOST_KEY"] = f"fake{rank_i * fake_hosts // world_i}"
    if rank_i == 1 and "TORCHDIST_RANK1_INNER" in os.environ:  # rank 1 asks for another
        os.environ["PARAMSYNC_TORCH_INNER"] = os.environ["TORCHDIST_RANK1_INNER"]
    if DEVICE == "cuda" and torch.cuda.device_count() > rank_i:
        torch.cuda.set_device(rank_i)  # one GPU a rank where there are enough
    dist.init_process_group(
        "paramsync",
        init_method=f"file://{store}",  # torch's FileStore: no port to race for
        rank=rank_i,
        world_size=world_i,
        timeout=timeout,
    )
    assert dist.get_backend() == "paramsync", dist.get_backend()
    if fake_hosts:  # who runs which coordinator of the world group
        session = dist.group.WORLD.session  # type: ignore[union-attr]
        root = session.root.root if session.root is not None else None
        hosted = {
            "sub": session.sub.name if session.sub is not None else None,
            "root_hosts": sorted(r.name for r in root.hosts.values()) if root else None,
            "flat": session.coordinator is not None,
        }
        (out / f"rank{rank}.tree.json").write_text(json.dumps(hosted))
    started = time.monotonic()
    try:
        if scenario == "collectives":
            torch.save(collectives(rank_i, world_i), out / f"rank{rank}.pt")
        elif scenario == "mismatch_op":
            t = torch.ones(4)
            if rank_i == 0:
                dist.all_reduce(t)
            else:
                dist.broadcast(t, src=0)
        elif scenario == "mismatch_cached":
            # Both calls agreed once, in the same order; then the ranks call them in different
            # orders, each starting at once from the response cache.
            t = torch.ones(4)
            dist.all_reduce(t)
            dist.broadcast(t, src=0)
            if rank_i == 0:
                dist.all_reduce(t)
            else:
                dist.broadcast(t, src=0)
            torch.save({"after": t}, out / f"rank{rank}.pt")  # never reached
        elif scenario == "mismatch_shape":
            dist.all_reduce(torch.ones(4 + rank_i))
        elif scenario == "train":
            state = train(rank_i, 6).state_dict()
            torch.save({key: value.cpu() for key, value in state.items()}, out / f"rank{rank}.pt")
        elif scenario == "tree_train":
            tree = train(rank_i, 4).state_dict()
            os.environ["PARAMSYNC_COORDINATOR_KIND"] = "flat"
            flat_group = dist.new_group(backend="paramsync")
            flat = train(rank_i, 4, group=flat_group).state_dict()
            dist.destroy_process_group(flat_group)  # the world group closes at exit
            states = {"tree": tree, "flat": flat}
            torch.save(
                {f"{k}/{n}": v.cpu() for k, state in states.items() for n, v in state.items()},
                out / f"rank{rank}.pt",
            )
        elif scenario == "local_head":
            # DDP replicates the body; a head kept per rank (different on each) is stepped by
            # the same optimizer: only the body and its optimizer state are compared.
            torch.manual_seed(0)
            body = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
            torch.manual_seed(100 + rank_i)
            head = torch.nn.Linear(8, 2)
            optimizer = torch.optim.AdamW([*body.parameters(), *head.parameters()], lr=1e-2)
            for _ in range(4):
                optimizer.zero_grad()
                head(body(torch.randn(4, 8))).sum().backward()
                optimizer.step()
        elif scenario == "nudge":
            train(rank_i, 8, nudge_at=3)
        elif scenario == "kill":
            train(rank_i, 30, kill_at=5)
        elif scenario == "idle":
            dist.all_reduce(torch.ones(4))
            time.sleep(5)  # every rank idle past the group's timeout: nothing is waiting
            dist.all_reduce(torch.ones(4))
        elif scenario == "stall":
            if rank_i == 1:  # past the group's timeout: rank 0 waits alone in its call
                away_until = time.monotonic() + 12  # (or until rank 0 has named the stall)
                while time.monotonic() < away_until and not (out / "rank0.err").exists():
                    time.sleep(0.05)
            dist.all_reduce(torch.ones(4))
        else:
            raise SystemExit(f"unknown scenario {scenario}")
        planes = dict(getattr(dist.group.WORLD, "calls_by_plane", {}))
        (out / f"rank{rank}.planes.json").write_text(json.dumps(planes))
        if scenario == "train":
            return  # as many scripts end (Lightning's among them): no barrier, no destroy
        dist.barrier()
    except Exception as exc:
        line = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        (out / f"rank{rank}.err").write_text(f"{time.monotonic() - started:.2f}\n{line}\n")
        print(f"rank {rank}: {line}", file=sys.stderr, flush=True)
        os._exit(3)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
