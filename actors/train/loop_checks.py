"""`LoopChecks`: what the user's own loop must keep while `DistributedDataParallel` wraps its
module (`paramsync.actors.train.ddp_wrapper`): one thread runs forward, backward and the optimizer
step, and the module keeps the parameters it was wrapped with (torch DDP's buckets are fixed
too)."""

from __future__ import annotations

import threading

import torch

from paramsync.actors.train.trainer import DistributedTrainer

__all__ = ["LoopChecks"]


class LoopChecks:
    """The loop's thread (named by its first forward) and the module's wrapped parameters."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.thread: int | None = None
        """The thread that runs the loop, once its first forward ran."""
        self.params = tuple(id(p) for p in module.parameters())
        self.mine = frozenset(self.params)

    def check_thread(self) -> None:
        """One thread runs the loop: the hooks' bookkeeping is that thread's."""
        me = threading.get_ident()
        if self.thread is None:
            self.thread = me
        elif self.thread != me:
            raise RuntimeError(
                "DistributedDataParallel: the training loop moved to another thread; run "
                "forward, backward and step from one thread"
            )

    def in_another_thread(self) -> bool:
        """Whether this runs outside the loop's thread (the trainer's own optimizer step, a
        joined rank's, `DistributedDataParallel.join`)."""
        return self.thread is not None and threading.get_ident() != self.thread

    def holds(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the wrapped module's parameters."""
        return id(param) in self.mine

    def check_parameters(self, trainer: DistributedTrainer) -> None:
        """The module's parameters are the ones wrapped (torch DDP's buckets are fixed too)."""
        now = tuple(id(p) for p in self.module.parameters())
        if now != self.params:
            added = [n for n, p in self.module.named_parameters() if id(p) not in self.mine]
            raise RuntimeError(
                f"rank {trainer.run.rank}, step {trainer.step}: the module's parameters "
                f"changed after it was wrapped (new: {added or 'none'}; "
                f"{len(self.params)} wrapped, {len(now)} now): add every parameter before "
                "wrapping the module"
            )
