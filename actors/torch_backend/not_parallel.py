"""The refusal of a run on the paramsync backend that is silently not data-parallel.

A run can make a paramsync group of several ranks and still train each rank on its own: the
model never wrapped in a data-parallel module, every rank stepping its optimizer on its own
gradients while the replicas drift apart. Accelerate does this on the CPU when
``Accelerator()`` runs without ``cpu=True``: it joins the group, shards the data loader over
the ranks, and sets ``DistributedType.NO``, so no gradient is ever reduced; the HF Trainer,
built on Accelerate, does the same. This module refuses such a run with one line.

When it fires, precisely: at a rank's optimizer step (torch's global optimizer step pre-hook,
before the step changes anything) when all of these hold:

- the process belongs to a live paramsync group of world size > 1 (one that formed and was
  not destroyed);
- no reducing collective (``all_reduce`` in any form, ``reduce``, ``reduce_scatter`` in any
  form; on paramsync's mesh or an inner torch group) has run on any live paramsync group of
  size > 1 of the process since it formed: torch DDP, FSDP2/HSDP (``reduce_scatter``), tensor
  parallelism and hand-written gradient averaging all reduce in the first backward, before
  the first step, and disarm the check for good;
- no module of this process is wrapped in paramsync's own `DistributedDataParallel` (the
  import swap), which reduces on its own mesh;
- the step applies a gradient: some parameter it steps has a gradient with a non-zero
  element (a step with no gradients or all-zero ones, as torch's distributed checkpoint takes
  to create an optimizer's state, is not counted);
- and this is more than ``PARAMSYNC_LOCAL_STEPS`` such steps (default 20) on this rank.

So a rank may take up to ``PARAMSYNC_LOCAL_STEPS`` local steps before its first reduction (a
warm-up before the model is wrapped, a local reference model trained first, as torch's own DDP
tests do) and is refused at the next one, with `NotDataParallel` naming the group, the rank,
the world size, the step and the likely cause. A longer local phase (local SGD that first
averages after H steps) sets ``PARAMSYNC_LOCAL_STEPS=H``; ``PARAMSYNC_LOCAL_STEPS=off`` turns the
check off. A reduction of any tensor disarms it (it cannot tell a gradient from a loss averaged
for a log), so a non-parallel run that all-reduces a metric before its optimizer steps is not
refused.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from paramsync.actors.torch_backend.session import BackendError
from paramsync.runtime.errors import ConfigError

__all__ = [
    "LOCAL_STEPS_ENV",
    "REDUCING_CALLS",
    "NotDataParallel",
    "ParallelWatch",
    "local_steps_allowed",
    "watch_parallel",
]

LOCAL_STEPS_ENV = "PARAMSYNC_LOCAL_STEPS"
"""Optimizer steps with gradients a rank may take before its group's first reduction (default
20); ``off`` turns the check off."""

DEFAULT_LOCAL_STEPS = 20

REDUCING_CALLS = frozenset(
    {
        "allreduce",
        "allreduce_coalesced",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
    }
)
"""The calls (as `paramsync.actors.torch_backend.calls.Call` names them) that combine the ranks'
tensors: the ones a data-parallel run averages its gradients with."""


class NotDataParallel(BackendError):
    """Several ranks step optimizers on a paramsync group without ever reducing a gradient."""


def local_steps_allowed() -> int | None:
    """``PARAMSYNC_LOCAL_STEPS`` as a number of steps, or None when the check is off."""
    text = os.environ.get(LOCAL_STEPS_ENV, "").strip().lower()
    if not text:
        return DEFAULT_LOCAL_STEPS
    if text in ("off", "no", "false"):
        return None
    try:
        steps = int(text)
    except ValueError:
        steps = -1
    if steps < 0:
        raise ConfigError(
            f"{LOCAL_STEPS_ENV}={text!r} is not a number of steps (0 or more) or 'off'"
        )
    return steps


class ParallelWatch:
    """One paramsync group's part in the check: its identity, whether it reduced, and the
    local steps counted against it."""

    def __init__(self, name: str, rank: int, size: int) -> None:
        self.name, self.rank, self.size = name, rank, size
        self.reductions = 0
        self.local_steps = 0

    def saw(self, call: str) -> None:
        """The group issued ``call`` (its `Call` name): a reducing one disarms the check."""
        if call in REDUCING_CALLS:
            self.reductions += 1
            if self.reductions == 1:
                with _LOCK:
                    _ARMED.discard(self)

    def forget(self) -> None:
        """The group ended (``destroy_process_group``): it no longer counts."""
        with _LOCK:
            _LIVE.discard(self)
            _ARMED.discard(self)


_LOCK = threading.Lock()
_LIVE: weakref.WeakSet[ParallelWatch] = weakref.WeakSet()
_ARMED: weakref.WeakSet[ParallelWatch] = weakref.WeakSet()
_HOOKED = False


def watch_parallel(name: str, rank: int, size: int) -> ParallelWatch:
    """The watch of a paramsync group that just formed (rank ``rank`` of ``size``): the group
    keeps it and reports each call to it; the optimizer step hook reads it. A group of one
    rank is never armed."""
    global _HOOKED
    watch = ParallelWatch(name, rank, size)
    if size <= 1:
        return watch
    with _LOCK:
        _LIVE.add(watch)
        _ARMED.add(watch)
        if not _HOOKED:
            register_optimizer_step_pre_hook(_before_step)
            _HOOKED = True
    return watch


def _own_ddp_in_use() -> bool:
    """Whether a module of this process is wrapped in paramsync's DistributedDataParallel,
    which reduces on its own mesh (looked up only if that module is loaded)."""
    wrapper = sys.modules.get("paramsync.actors.train.ddp_wrapper")
    return wrapper is not None and len(getattr(wrapper, "_WRAPPED_MODULES", ())) > 0


def _applies_a_gradient(optimizer: torch.optim.Optimizer) -> bool:
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            grad = parameter.grad
            if grad is not None and not grad.is_sparse and bool(grad.any()):
                return True
            if grad is not None and grad.is_sparse and grad._nnz() > 0:
                return True
    return False


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _ARMED:  # the fast path: every live group has reduced, or none is live
        return
    with _LOCK:
        armed = list(_ARMED)
        reduced = any(watch.reductions for watch in _LIVE)
    if not armed or reduced or _own_ddp_in_use():
        return
    allowed = local_steps_allowed()
    if allowed is None or not _applies_a_gradient(optimizer):
        return
    for watch in armed:
        watch.local_steps += 1
    watch = min(armed, key=lambda w: w.name)
    if watch.local_steps > allowed:
        raise NotDataParallel(
            f"paramsync group {watch.name}, rank {watch.rank} of {watch.size}: optimizer step "
            f"{watch.local_steps} applies this rank's own gradients, and no all_reduce, reduce "
            "or reduce_scatter has run on the group since it formed: the ranks train apart, "
            "not data-parallel; likely cause: the model is not wrapped in torch's "
            "DistributedDataParallel (Accelerate's DistributedType.NO: on the CPU give "
            f"Accelerator(cpu=True) or ACCELERATE_USE_CPU=1; {LOCAL_STEPS_ENV}=N allows N "
            "local steps first)"
        )
