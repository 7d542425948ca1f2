"""One rank of a framework's own training loop on a torch.distributed backend (gloo or
paramsync), for tests/test_frameworks.py. Run under torchrun, or Accelerate's launcher
(``accelerate launch --multi_gpu --num_processes 2``: torchrun underneath), 2 processes, CPU:

    frameworks_worker.py FRAMEWORK OUT RUN... [--steps N]

FRAMEWORK is ``lightning`` (``Trainer(strategy=DDPStrategy(process_group_backend=BACKEND))``),
``accelerate`` (the group initialized first, then ``Accelerator(cpu=True)``; ``prepare``,
``accumulate``, ``backward``, ``clip_grad_norm_``) or ``transformers`` (the group initialized
first, then the HF ``Trainer`` on a 2-layer GPT-2 built from a config). Nothing is downloaded:
models are built from code or a config, data is generated from a fixed seed, identical on
every rank (each framework's distributed sampler gives every rank its share).

Each RUN, in order, in this one job: ``gloo``, ``paramsync``, or ``paramsync@K`` (named
``diverge``: rank 1 nudges one weight after the backward of optimizer step K, 0-based, and
before that step, so the state after step K differs between the ranks), or, for
``accelerate``, ``notparallel`` (``Accelerator(kwargs_handlers=[InitProcessGroupKwargs(
backend="paramsync")])`` on the CPU: Accelerate's DistributedType.NO, which the backend refuses
as not data-parallel). A run writes to
``OUT/NAME/``: the initial weights (``initial.safetensors``, rank 0), each rank's final weights
(``rank{R}.safetensors``) and prints ``[NAME] rank R: done after N steps``; or, when it
stops, the error (``rank{R}.error``) and ``[NAME] rank R: stopped: <error>``. The default
group is destroyed after each run and made again by the next.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SEED = 1234
STEPS = 6
BATCH = 4
"""Examples per rank per optimizer step (after accumulation)."""
NOT_PARALLEL_STEPS = 24
"""Optimizer steps of the run that is not data-parallel: past the backend's 20 local steps."""
NUDGED = "layers.0.weight"
"""The weight rank 1 nudges in the MLP of the Lightning and Accelerate runs."""
NUDGED_LM = "transformer.h.1.mlp.c_fc.weight"
"""The weight rank 1 nudges in the language model of the transformers run."""


def _rank() -> int:
    return int(os.environ["RANK"])


def _nudge(parameter: torch.Tensor) -> None:
    """The divergence: one element of ``parameter`` moved by a small amount on this rank."""
    with torch.no_grad():
        parameter.view(-1)[0] += 1e-3


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}


def _save_initial(model: nn.Module, out: Path) -> None:
    from safetensors.torch import save_file

    if _rank() == 0:
        save_file(_state(model), str(out / "initial.safetensors"))


def _save(model: nn.Module, out: Path, steps: int) -> None:
    from safetensors.torch import save_file

    save_file(_state(model), str(out / f"rank{_rank()}.safetensors"))
    print(f"[{out.name}] rank {_rank()}: done after {steps} steps", flush=True)


# --------------------------------------------------------------------------- a small model


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def regression_data(count: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(count, 8, generator=generator)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh() + 0.1 * torch.randn(count, 1, generator=generator)
    return torch.utils.data.TensorDataset(x, y)


# --------------------------------------------------------------------------- Lightning


def run_lightning(backend: str, out: Path, steps: int, diverge: int | None) -> None:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = MLP()

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            # after the backward (gradients averaged), before the step
            if self.global_step == diverge and self.global_rank == 1:
                _nudge(self.net.get_parameter(NUDGED))

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(SEED)
    model = Regressor()
    _save_initial(model, out)
    data = torch.utils.data.DataLoader(regression_data(2 * BATCH * steps), batch_size=BATCH)
    trainer = L.Trainer(
        strategy=DDPStrategy(process_group_backend=backend),
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    assert dist.get_backend() == backend, dist.get_backend()
    _save(model, out, trainer.global_step)


# --------------------------------------------------------------------------- Accelerate


def run_accelerate(backend: str, out: Path, steps: int, diverge: int | None) -> None:
    """The README's path: the group first (on the CPU Accelerate names only gloo or mpi and
    refuses another name), then ``Accelerator(cpu=True)``, which finds it: MULTI_CPU."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    dist.init_process_group(backend)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    assert accelerator.distributed_type == DistributedType.MULTI_CPU, accelerator.distributed_type
    assert accelerator.num_processes == 2 and dist.get_backend() == backend
    _accelerate_loop(accelerator, out, steps, diverge)


def run_accelerate_not_parallel(backend: str, out: Path, steps: int, diverge: int | None) -> None:
    """What Accelerate does with a third-party backend named on the CPU without ``cpu=True``:
    it makes the group, shards the data over the ranks and sets DistributedType.NO, so no
    gradient is reduced. The backend refuses it at the step past its local allowance (20)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    accelerator = Accelerator(
        gradient_accumulation_steps=2,
        kwargs_handlers=[InitProcessGroupKwargs(backend=backend)],
    )
    assert accelerator.distributed_type == DistributedType.NO, accelerator.distributed_type
    assert accelerator.num_processes == 2 and dist.get_backend() == backend
    _accelerate_loop(accelerator, out, max(steps, NOT_PARALLEL_STEPS), diverge)


def _accelerate_loop(accelerator: Any, out: Path, steps: int, diverge: int | None) -> None:
    accumulation = accelerator.gradient_accumulation_steps
    torch.manual_seed(SEED)
    model = MLP()
    _save_initial(model, out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    micro = BATCH // accumulation
    data = torch.utils.data.DataLoader(regression_data(2 * BATCH * steps), batch_size=micro)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    step = 0
    for x, y in data:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                if step == diverge and accelerator.process_index == 1:
                    _nudge(accelerator.unwrap_model(model).get_parameter(NUDGED))
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
    accelerator.wait_for_everyone()
    _save(accelerator.unwrap_model(model), out, step)


# --------------------------------------------------------------------------- transformers


def run_transformers(backend: str, out: Path, steps: int, diverge: int | None) -> None:
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    dist.init_process_group(backend)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(config)
    _save_initial(model, out)
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, config.vocab_size, (2 * BATCH * steps, 16), generator=generator)
    dataset = [{"input_ids": row, "labels": row} for row in tokens]

    class Nudge(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            # after the backward and the clipping, before the step
            if state.global_step == diverge and args.process_index == 1:
                _nudge(model.get_parameter(NUDGED_LM))

    arguments = TrainingArguments(
        output_dir=str(out / "hf"),
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        seed=SEED,
        dataloader_num_workers=0,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    assert arguments.world_size == 2 and dist.get_backend() == backend
    trainer = Trainer(model=model, args=arguments, train_dataset=dataset, callbacks=[Nudge()])
    trainer.train()
    _save(model, out, trainer.state.global_step)


def _await_the_others(out: Path, seconds: float = 60.0) -> None:
    """Wait (bounded) until every rank has ended the run in ``out`` (weights or an error
    written), so the ranks start the next run together and each says why it stopped."""
    deadline = time.monotonic() + seconds
    world = int(os.environ["WORLD_SIZE"])
    while time.monotonic() < deadline:
        ended = {p.stem for p in out.glob("rank*.error")}
        ended |= {p.stem for p in out.glob("rank*.safetensors")}
        if len(ended) >= world:
            return
        time.sleep(0.05)


def _reset_frameworks() -> None:
    """Forget the framework's per-process state of the run before (Accelerate keeps its
    distributed state in singletons, shared by the HF Trainer)."""
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def run_once(framework: str, spec: str, out: Path, steps: int) -> bool:
    """One run: ``spec`` is a backend (``gloo``, ``paramsync``), ``paramsync@K`` (rank 1
    diverges at step K; the run is then named ``diverge``) or ``notparallel`` (Accelerate's
    DistributedType.NO on paramsync). True when it ended normally."""
    if spec == "notparallel":
        run, backend, diverge, folder = NOT_PARALLEL[framework], "paramsync", None, out / spec
    else:
        backend, _, at = spec.partition("@")
        diverge = int(at) if at else None
        run, folder = RUNS[framework], out / ("diverge" if at else backend)
    folder.mkdir(parents=True, exist_ok=True)
    ok = True
    try:
        run(backend, folder, steps, diverge)
    except Exception as exc:
        ok = False
        text = f"{type(exc).__name__}: {exc}"
        print(f"[{folder.name}] rank {_rank()}: stopped: {text}", flush=True)
        (folder / f"rank{_rank()}.error").write_text(text)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _reset_frameworks()
    _await_the_others(folder)
    return ok


RUNS = {"lightning": run_lightning, "accelerate": run_accelerate, "transformers": run_transformers}
NOT_PARALLEL = {"accelerate": run_accelerate_not_parallel}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("framework", choices=sorted(RUNS))
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "runs", nargs="+", help="gloo, paramsync, paramsync@K or notparallel, in order"
    )
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for spec in args.runs:
        run_once(args.framework, spec, args.out, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
