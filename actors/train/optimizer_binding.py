"""`OptimizerBinding`: which optimizer steps the parameters `DistributedDataParallel` wraps
(`paramsync.actors.train.ddp_wrapper`), and torch's global optimizer step hooks that run the step's
crossings around the user's own optimizer step.

The optimizer is either the user's own, stepped by the user (named when wrapping, or found at
its first step: the first optimizer whose first parameter is the module's), or one
`wrap_optimizer` wrapped, which the trainer steps. Before the user's own optimizer steps, the
pre-hook waits for the previous step's commit and the epoch's apply barrier; after it, the
post-hook reports the state digest (`StepTracker`). A step a membership change dropped runs
muted: its parameter groups are empty, so neither a parameter nor the optimizer's state
changes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from paramsync.actors.state.digest import Scheduler
from paramsync.actors.train.loop_checks import LoopChecks
from paramsync.actors.train.step_tracker import StepTracker
from paramsync.actors.train.trainer_link import TrainerLink

__all__ = ["OptimizerBinding", "check_optimizer"]


class OptimizerBinding:
    """The wrapped module's optimizer, bound to the trainer, and its step hooks."""

    def __init__(
        self,
        module: torch.nn.Module,
        link: TrainerLink,
        steps: StepTracker,
        checks: LoopChecks,
    ) -> None:
        self.module = module
        self.link = link
        self.steps = steps
        self.checks = checks
        self.user_optimizer: torch.optim.Optimizer | None = None
        """The optimizer the user steps itself (its step hooks report the digest)."""
        self.wrapped: torch.optim.Optimizer | None = None
        """The optimizer `wrap_optimizer` wrapped (the trainer steps it)."""
        self._muted: tuple[torch.optim.Optimizer, list[Any]] | None = None
        """The optimizer whose parameter groups a dropped step emptied, and their parameters."""
        self._hooks: list[RemovableHandle] = []

    # -- which optimizer -------------------------------------------------------------------

    def use(self, optimizer: torch.optim.Optimizer) -> None:
        """The user steps ``optimizer`` itself: the trainer hashes and transfers it."""
        check_optimizer(self.module, optimizer)
        self.bind(optimizer)
        self.user_optimizer = optimizer

    def wrap(self, optimizer: torch.optim.Optimizer, scheduler: Scheduler | None) -> None:
        """The trainer steps ``optimizer`` (and ``scheduler``) from now on
        (`DistributedDataParallel.wrap_optimizer`), before the first step."""
        if self.wrapped is not None:
            raise RuntimeError("DistributedDataParallel: the optimizer is already wrapped")
        if self.link.trainer.step > 0 or self.steps.own is not None:
            raise RuntimeError(
                "DistributedDataParallel: wrap_optimizer after training started: wrap it "
                "before the first forward"
            )
        check_optimizer(self.module, optimizer)
        self.bind(optimizer, scheduler)
        self.wrapped, self.user_optimizer = optimizer, None

    def bind(self, optimizer: torch.optim.Optimizer, scheduler: Scheduler | None = None) -> None:
        """Have the trainer step, hash and transfer ``optimizer`` (`OwnLoop.bind_optimizer`)."""
        trainer = self.link.trainer

        async def bind() -> None:
            trainer.own_loop.bind_optimizer(optimizer, scheduler)

        self.link.run(bind)

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` is the one the user steps for this module (naming it at its
        first step if none is known yet)."""
        if optimizer is self.user_optimizer:
            return True
        if self.user_optimizer is not None or optimizer is self.wrapped:
            return False
        if self.wrapped is not None or self.link.attached is None:
            return False
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not params or not self.checks.holds(params[0]):
            return False
        self.use(optimizer)  # its first step: it steps this module's parameters
        return True

    def flush_skipped(self) -> None:
        """When the user steps its own optimizer: a synchronized step no optimizer step
        followed (a loss scaler skipped it) is finished now, as skipped (`StepTracker`)."""
        if self.wrapped is None:
            self.steps.finish_skipped()

    # -- torch's step hooks ----------------------------------------------------------------

    def hook_steps(self) -> None:
        """Register the global optimizer step hooks (every optimizer's), until `unhook`."""
        self._hooks = [
            register_optimizer_step_pre_hook(_weak_hook(self._before_step)),
            register_optimizer_step_post_hook(_weak_hook(self._after_step)),
        ]

    def unhook(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """torch's optimizer step pre-hook (every optimizer's): for this module's, wait until
        the step may be applied (the previous step's commit, the apply barrier)."""
        if self.checks.in_another_thread():
            return  # the trainer's own optimizer step (a joined rank's, `join`)
        if not self.owns(optimizer):
            return
        if not self.steps.begin_caller_apply():
            self.mute(optimizer)  # dropped by a membership change: it must change nothing

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """torch's optimizer step post-hook: report the applied step's digest (C-DDP-001)."""
        if optimizer is not self.user_optimizer:
            return
        if self._muted is not None:
            self.unmute()
            return
        self.steps.end_caller_apply()

    def mute(self, optimizer: torch.optim.Optimizer) -> None:
        """Empty ``optimizer``'s parameter groups for the step about to run (a dropped step's:
        no parameter and no state may change), until `unmute`."""
        self._muted = (optimizer, [group["params"] for group in optimizer.param_groups])
        for group in optimizer.param_groups:
            group["params"] = []

    def unmute(self) -> None:
        """Give a muted optimizer its parameter groups back (nothing when none is muted)."""
        if self._muted is not None:
            optimizer, params = self._muted
            self._muted = None
            for group, kept in zip(optimizer.param_groups, params):
                group["params"] = kept


def _weak_hook(method: Callable[[Any, Any, Any], None]) -> Callable[[Any, Any, Any], None]:
    """A global optimizer step hook that calls ``method`` while its binding lives (a wrapper
    nobody closed does not stay alive through torch's global hook table)."""
    ref = weakref.WeakMethod(method)

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(optimizer, args, kwargs)

    return hook


def check_optimizer(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must step ``module``'s parameters (and nothing else)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"wrap_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    mine = {id(param) for param in module.parameters()}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in mine:
                raise ValueError(
                    f"wrap_optimizer: parameter group {index} holds a tensor of shape "
                    f"{tuple(param.shape)} that is not a parameter of the wrapped module"
                )
