"""One worker of a torch DDP loop in an elastic run (tests/test_ddp_elastic.py).

    python tests/ddp_elastic_worker.py OUT KILL_RANK KILL_STEP [--wrapped]

The loop is torch DDP's (`ddp_contract_worker.Net`, AdamW, clipping between backward and step);
the rank KILL_RANK SIGKILLs itself right after the backward of its step KILL_STEP, before its
optimizer step: its peers' step is then dropped by the membership change and they go on
without it. ``--wrapped`` steps through ``model.wrap_optimizer`` (``step()`` returns False for
the dropped step) instead of the unwrapped optimizer. Each survivor writes its final parameters,
its trainer's step and what ``step()`` returned to ``OUT/rankR.safetensors``/``.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from ddp_contract_worker import batches, make_model
from safetensors.torch import save_file
from torch import nn

from paramsync.actors import DistributedDataParallel

STEPS = 8


def main(argv: list[str]) -> None:
    out, kill_rank, kill_step = Path(argv[0]), int(argv[1]), int(argv[2])
    wrapped_optimizer = "--wrapped" in argv
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    model = make_model(rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    ddp = DistributedDataParallel(model)
    stepper = ddp.wrap_optimizer(optimizer) if wrapped_optimizer else optimizer
    data = batches(world, 0) * 2  # every rank the same shard: only the state matters here
    taken = []
    for index in range(STEPS):
        x, y = data[index]
        stepper.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if rank == kill_rank and index == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        taken.append(stepper.step())
    ddp.verified()
    summary = {"step": ddp.trainer.step, "taken": taken, "world": ddp.world_size}
    save_file(
        {n: p.detach().clone() for n, p in model.named_parameters()},
        str(out / f"rank{rank}.safetensors"),
    )
    (out / f"rank{rank}.json").write_text(json.dumps(summary))
    ddp.close()


if __name__ == "__main__":
    main(sys.argv[1:])
