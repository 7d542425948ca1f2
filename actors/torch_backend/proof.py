"""The identical-state proof (C-DDP-001) for torch DDP on the paramsync backend.

torch's `DistributedDataParallel` replicates a module's parameters and buffers over its
process group, and every rank's optimizer applies the same averaged gradients to them, so
after every optimizer step every rank holds bitwise the same module state and optimizer
state. The backend proves it: a global optimizer step post-hook (torch's
``register_optimizer_step_post_hook``) notices the optimizer that just stepped; when it steps
parameters of a torch DDP module whose process group is a paramsync group, the module's
parameters and buffers and the optimizer's state are hashed (`paramsync.actors.state.digest`, in the
stepping thread) and reported to that group's coordinator as the end of the group's step
(`GroupSession.end_step`). The coordinator compares the ranks' digests and stops the run at
the first step where they differ, naming the ranks and the first tensor that differs.

Only what DDP replicates is claimed identical: a module that is not wrapped in torch DDP on
a paramsync group (FSDP's shards, tensor-parallel layers, a rank-local head) is never hashed,
so it is never falsely flagged. ``PARAMSYNC_STATE_PROOF=0`` turns the proof off.

DDP modules are found without a hook in the forward: the first time an optimizer steps, the
live DDP modules are looked up once among the garbage collector's objects and matched to the
optimizer by parameter identity (again whenever an optimizer not seen before steps).
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from typing import Any, Protocol

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from paramsync.actors.state.digest import StateDigest, StateHasher
from paramsync.actors.torch_backend.session import GroupSession


class ProcessGroupParamsync(Protocol):
    """What the proof needs of a paramsync process group
    (`paramsync.actors.torch_backend.process_group`): its session, which takes the step's digest and
    knows whether the group failed."""

    session: GroupSession


__all__ = ["PROOF_ENV", "proof_enabled", "watch_group"]

PROOF_ENV = "PARAMSYNC_STATE_PROOF"
"""Set to 0 to turn the per-step identical-state proof off (on by default)."""


def proof_enabled() -> bool:
    """Whether the identical-state proof is on (``PARAMSYNC_STATE_PROOF`` is not 0/false)."""
    return os.environ.get(PROOF_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


_GROUPS: weakref.WeakSet[ProcessGroupParamsync] = weakref.WeakSet()
_LOCK = threading.Lock()
_HOOKED = False


_BROKEN_CHECKED: weakref.WeakSet[ProcessGroupParamsync] = weakref.WeakSet()


def watch_group(group: ProcessGroupParamsync, *, prove: bool) -> None:
    """Refuse every optimizer step once ``group`` has failed (a torch DDP bucket that failed
    in backward could not raise there: `GroupSession._complete`), and with ``prove``, prove
    the state of the group's DDP modules after every optimizer step."""
    global _HOOKED
    with _LOCK:
        _BROKEN_CHECKED.add(group)
        if prove:
            _GROUPS.add(group)
        if not _HOOKED:
            register_optimizer_step_pre_hook(_before_step)
            register_optimizer_step_post_hook(_after_step)
            _HOOKED = True


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in list(_BROKEN_CHECKED):
        failure = group.session.failure
        if failure is not None:
            raise failure


class _ReplicatedPart:
    """The part of an optimizer that steps one DDP module's parameters: its param groups with
    only those parameters, and its state. An optimizer that also steps parameters outside
    the module (a rank-local head) is hashed through this, so their state, which DDP does not
    replicate, never enters the comparison."""

    def __init__(self, optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> None:
        self._optimizer = optimizer
        self._ids = {id(p) for p in module.parameters()}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [
            {**group, "params": [p for p in group["params"] if id(p) in self._ids]}
            for group in self._optimizer.param_groups
        ]

    @property
    def state(self) -> Any:
        return self._optimizer.state


class _Binding:
    """What one optimizer steps: the DDP modules (of paramsync groups) among its parameters,
    and what of the optimizer to hash with each (all of it when it steps only the module)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        modules: list[tuple[torch.nn.Module, ProcessGroupParamsync]],
    ) -> None:
        self.modules = [(weakref.ref(m), weakref.ref(g)) for m, g in modules]
        self.hashers: list[StateHasher] = [StateHasher() for _ in modules]
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.parts: list[Any] = []
        for module, _ in modules:
            if stepped <= {id(p) for p in module.parameters()}:
                self.parts.append(optimizer)
            else:
                self.parts.append(_ReplicatedPart(optimizer, module))


_BINDINGS: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Binding] = weakref.WeakKeyDictionary()


def _ddp_modules() -> list[Any]:
    from torch.nn.parallel import DistributedDataParallel

    return [obj for obj in gc.get_objects() if isinstance(obj, DistributedDataParallel)]


def _bind(optimizer: torch.optim.Optimizer) -> _Binding:
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    found: list[tuple[torch.nn.Module, ProcessGroupParamsync]] = []
    for ddp in _ddp_modules():
        group = ddp.process_group
        if group not in _GROUPS:  # not a paramsync group (or its proof is off)
            continue
        if any(id(p) in stepped for p in ddp.module.parameters()):
            found.append((ddp.module, group))
    # The same order on every rank: by the module's parameter names and shapes.
    found.sort(key=lambda pair: [(n, tuple(p.shape)) for n, p in pair[0].named_parameters()])
    return _Binding(optimizer, found)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _GROUPS or not proof_enabled():
        return
    binding = _BINDINGS.get(optimizer)
    if binding is None:
        binding = _BINDINGS[optimizer] = _bind(optimizer)
    per_group: dict[int, tuple[ProcessGroupParamsync, list[tuple[str, bytes]], set[str]]] = {}
    for index, ((module_ref, group_ref), hasher, part) in enumerate(
        zip(binding.modules, binding.hashers, binding.parts, strict=True)
    ):
        module, group = module_ref(), group_ref()
        if module is None or group is None:
            continue
        digest = hasher.digest(module, part)
        prefix = f"ddp{index}." if len(binding.modules) > 1 else ""
        entry = per_group.setdefault(id(group), (group, [], set()))
        entry[1].extend((prefix + name, value) for name, value in digest.tensors)
        entry[2].add(digest.algorithm)
    for group, tensors, algorithms in per_group.values():
        # The report names its algorithm (the coordinator compares like with like); modules of
        # one group hashed by different ones (one on the CPU, one on a GPU) name both.
        algorithm = "+".join(sorted(algorithms))
        group.session.end_step(StateDigest(None, tensors, algorithm=algorithm))
