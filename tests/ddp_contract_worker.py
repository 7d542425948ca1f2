"""One rank of torch DDP's contract, written once and run under torch DDP (gloo) and under
paramsync's `DistributedDataParallel` (tests/test_ddp_contract.py).

Every case is the loop a torch DDP script has: the optimizer is built before the model is
wrapped and stepped unwrapped, the gradients are read or edited between ``backward()`` and
``step()``. Only the class (and, for paramsync, one run per case) differs:

    python tests/ddp_contract_worker.py IMPL RANK WORLD PORT[,PORT...] OUT CASE[,CASE...]

IMPL is ``torch`` (one gloo group on the first PORT for every case) or ``paramsync`` (case k
joins a run whose coordinator rank 0 hosts on the k-th PORT; the secret comes from
PARAMSYNC_SECRET). Each case
writes its final parameters and per-step losses to ``OUT/CASE-IMPL-rankR.safetensors``.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

STEPS = 6
PER_RANK = 8
DEVICE = torch.device(os.environ.get("CONTRACT_DEVICE", "cpu"))
"""``cuda``: every rank's model on the GPU (the ranks share it), wrapped with
``device_ids=[0]``; the inputs stay on the host (DDP moves them), the targets on the GPU."""


class Net(nn.Module):
    """Linear, Tanh, Linear, Tanh, Linear: small enough for many runs, several buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def make_model(rank: int) -> Net:
    torch.manual_seed(100 + rank)  # ranks start apart: construction broadcasts rank 0's
    return Net()


def batches(world: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4321 + world)
    out = []
    for _ in range(STEPS):
        x = torch.randn(world * PER_RANK, 6, generator=gen)
        y = torch.randn(world * PER_RANK, 3, generator=gen)
        rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        out.append((x[rows], y[rows].to(DEVICE)))
    return out


Case = Callable[[nn.Module, Any, int, int], list[float]]
"""``case(model, ddp_class_and_kwargs, rank, world) -> losses``."""


def _wrap(ddp: Any, model: nn.Module, **kwargs: Any) -> nn.Module:
    if DEVICE.type == "cuda":
        kwargs["device_ids"] = [DEVICE.index or 0]
    with warnings.catch_warnings():  # torch 2.13 renames broadcast_buffers (same meaning)
        warnings.simplefilter("ignore", FutureWarning)
        wrapped: nn.Module = ddp(model, **kwargs)
        return wrapped


def plain_steps(
    wrapped: Any, optimizer: torch.optim.Optimizer, data: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[float]:
    """The plainest DDP loop over ``data``: zero_grad, forward, backward, step; the losses."""
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(wrapped(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def clip(model: nn.Module, ddp: Any, rank: int, world: int) -> list[float]:
    """clip_grad_norm_ between backward and step (nanoGPT's loop), AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    wrapped = _wrap(ddp, model, device_ids=None)
    losses = []
    for x, y in batches(world, rank):
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(wrapped(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 0.05)
        optimizer.step()
        losses.append(float(loss))
    return losses


def accumulate(model: nn.Module, ddp: Any, rank: int, world: int) -> list[float]:
    """Gradient accumulation through ``require_backward_grad_sync`` (nanoGPT's), SGD momentum,
    and an LR scheduler the loop steps itself."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    wrapped = _wrap(ddp, model)
    micro = 3
    losses = []
    for x, y in batches(world, rank):
        total = 0.0
        for index, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            wrapped.require_backward_grad_sync = index == micro - 1  # type: ignore[assignment]
            loss = nn.functional.mse_loss(wrapped(xs), ys) / micro
            loss.backward()
            total += float(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def no_sync(model: nn.Module, ddp: Any, rank: int, world: int) -> list[float]:
    """Accumulation with ``no_sync()``, Adam, zero_grad(set_to_none=False)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    wrapped = _wrap(ddp, model)
    losses = []
    for x, y in batches(world, rank):
        optimizer.zero_grad(set_to_none=False)
        (xa, xb), (ya, yb) = x.chunk(2), y.chunk(2)
        with wrapped.no_sync():  # type: ignore[operator]
            first = nn.functional.mse_loss(wrapped(xa), ya) / 2
            first.backward()
        second = nn.functional.mse_loss(wrapped(xb), yb) / 2
        second.backward()
        optimizer.step()
        losses.append(float(first) + float(second))
    return losses


def surgery(model: nn.Module, ddp: Any, rank: int, world: int) -> list[float]:
    """In-place gradient edits after backward: one gradient zeroed, one scaled, the norm read."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    wrapped = _wrap(ddp, model)
    losses = []
    for step, (x, y) in enumerate(batches(world, rank)):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(wrapped(x), y)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads if g is not None]))
        with torch.no_grad():
            model.mid.bias.grad.zero_()  # type: ignore[union-attr]
            model.out.weight.grad.mul_(1.0 + step / 4)  # type: ignore[union-attr]
            model.inp.weight.grad.div_(norm.clamp(min=1.0))  # type: ignore[union-attr]
        optimizer.step()
        losses.append(float(loss))
    return losses


def scaler(model: nn.Module, ddp: Any, rank: int, world: int) -> list[float]:
    """fp16 autocast with a GradScaler (on CPU): scale, unscale_, clip, step, update. Rank 0's
    step 2 input holds a huge value, so its local gradient overflows; the averaged gradient has
    the inf on every rank and every rank skips the same step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**8, growth_interval=2)
    wrapped = _wrap(ddp, model, grad_scaler=amp)  # paramsync: the scaler in the digest too
    losses = []
    for step, (x, y) in enumerate(batches(world, rank)):
        if step == 2 and rank == 0:
            x = x.clone()
            x[0, 0] = 6.0e4
        optimizer.zero_grad()
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            loss = nn.functional.mse_loss(wrapped(x).float(), y)
        amp.scale(loss).backward()
        amp.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        amp.step(optimizer)
        amp.update()
        losses.append(float(loss))
    losses.append(float(amp.get_scale()))
    return losses


def compiled(model: nn.Module, ddp: Any, rank: int, world: int) -> list[float]:
    """torch.compile before wrapping and after (aot_eager: dynamo and AOTAutograd, no C++)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    inner = torch.compile(model, backend="aot_eager")
    wrapped = torch.compile(_wrap(ddp, inner), backend="aot_eager")
    return plain_steps(wrapped, optimizer, batches(world, rank))


def inductor(model: nn.Module, ddp: Any, rank: int, world: int) -> list[float]:
    """torch.compile with its default backend (inductor: C++ kernels) after wrapping."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    wrapped = torch.compile(_wrap(ddp, model))
    return plain_steps(wrapped, optimizer, batches(world, rank))


def uneven(model: nn.Module, ddp: Any, rank: int, world: int) -> list[float]:
    """Uneven inputs under ``with model.join():``: rank r stops after STEPS - 2r batches."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    wrapped = _wrap(ddp, model)
    with wrapped.join():  # type: ignore[operator]
        return plain_steps(wrapped, optimizer, batches(world, rank)[: STEPS - 2 * rank])


def early_termination(model: nn.Module, ddp: Any, rank: int, world: int) -> list[float]:
    """``join(throw_on_early_termination=True)``: every rank raises at the step where rank 1's
    inputs ran out; the losses taken before it, then -1, are recorded."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = _wrap(ddp, model)
    losses: list[float] = []
    try:
        with wrapped.join(throw_on_early_termination=True):  # type: ignore[operator]
            for step in batches(world, rank)[: STEPS - 3 * rank]:
                losses += plain_steps(wrapped, optimizer, [step])
    except RuntimeError as exc:
        assert "exhausted" in str(exc), exc
        losses.append(-1.0)
    return losses


def hooked(hook_name: str) -> Case:
    """torch's own comm hook registered on the wrapped model, SGD with momentum."""

    def case(model: nn.Module, ddp: Any, rank: int, world: int) -> list[float]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        wrapped = _wrap(ddp, model)
        if hook_name == "powerSGD_hook":
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2
            )
            wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)  # type: ignore[operator]
        else:
            wrapped.register_comm_hook(None, getattr(default_hooks, hook_name))  # type: ignore[operator]
        return plain_steps(wrapped, optimizer, batches(world, rank))

    return case


CASES: dict[str, Case] = {
    "clip": clip,
    "accumulate": accumulate,
    "no_sync": no_sync,
    "surgery": surgery,
    "scaler": scaler,
    "compiled": compiled,
    "uneven": uneven,
    "early_termination": early_termination,
    "fp16_hook": hooked("fp16_compress_hook"),
    "powersgd_hook": hooked("powerSGD_hook"),
}


KEEP_ALIVE: list[Any] = []
"""torch DDP wrappers kept until the process ends (see `main`)."""

SLOW_CASES: dict[str, Case] = {"inductor": inductor}
"""Cases of `make soak` (inductor compiles C++ for a minute on 2 cores)."""


def main(argv: list[str]) -> None:
    from safetensors.torch import save_file

    impl, rank, world = argv[0], int(argv[1]), int(argv[2])
    ports = [int(p) for p in argv[3].split(",")]
    out, cases = Path(argv[4]), argv[5].split(",")
    torch.set_num_threads(1)
    if impl == "torch":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as TorchDDP

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=world
        )
        ddp: Any = TorchDDP
    else:
        from paramsync.actors import DistributedDataParallel

        ddp = DistributedDataParallel
    for index, name in enumerate(cases):
        if impl == "paramsync":
            os.environ.update(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(ports[index]),
            )
        model = make_model(rank).to(DEVICE)
        opened: list[Any] = []

        def tracked(module: nn.Module, opened: list[Any] = opened, **kwargs: Any) -> nn.Module:
            wrapped = _wrap(ddp, module, **kwargs)
            opened.append(wrapped)
            return wrapped

        def torchs(module: nn.Module, grad_scaler: Any = None, **kwargs: Any) -> nn.Module:
            wrapped = _wrap(ddp, module, **kwargs)  # torch's DDP takes no grad_scaler
            # Never destroyed before os._exit: torch's ~ProcessGroupGloo, reached from a
            # freed DDP's reducer, can deadlock on the GIL with gloo's worker thread.
            KEEP_ALIVE.append(wrapped)
            return wrapped

        case = CASES.get(name) or SLOW_CASES[name]
        losses = case(model, tracked if impl == "paramsync" else torchs, rank, world)
        state = {f"param/{n}": p.detach().cpu().clone() for n, p in model.named_parameters()}
        state["losses"] = torch.tensor(losses, dtype=torch.float64)
        save_file(state, str(out / f"{name}-{impl}-rank{rank}.safetensors"))
        for wrapped in opened:
            wrapped.close()  # type: ignore[operator]
    if impl == "torch":
        import torch.distributed as dist

        dist.destroy_process_group()
        # torch's own teardown of a gloo process now and then aborts after everything is
        # written ("terminate called without an active exception"; benchmarks/multidevice.py
        # ends its DDP ranks the same way).
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
