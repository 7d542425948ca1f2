"""The identical-state proof (C-DDP-001) on the paramsync backend: torch DDP, FSDP2, HSDP and
tensor parallelism.

After every optimizer step, the state torch keeps identical on several ranks is hashed (in the
stepping thread) and reported to the coordinator of the group whose ranks hold it
(`GroupSession.end_step`); each group's coordinator compares its ranks' digests and stops the
run at the first step where they differ, naming the ranks and the first tensor that differs.
What is compared, and across which ranks (`paramsync.actors.torch_backend.proof_targets`,
found where torch builds it, never by a search of the heap):

* a torch DDP module on a paramsync group: its parameters and buffers and the optimizer's
  state of its parameters, across the DDP group's ranks;
* a DTensor parameter (FSDP2, HSDP, tensor parallelism) with a ``Replicate`` placement on a
  mesh dimension whose group is a paramsync group: its local tensor and its optimizer state,
  across that dimension's group: HSDP's shards across the replicas holding the same shard, a
  tensor-parallel LayerNorm across the tensor-parallel ranks
  (`paramsync.actors.torch_backend.proof_digest`).

Nothing else is claimed identical, so nothing else is ever falsely flagged: a pure FSDP shard
(no replica to compare), a rank-local head, state on a group of another backend. At each
optimizer's first step, global rank 0 prints one line saying what is proven and what is not
(`paramsync.actors.torch_backend.proof_notice`). A paramsync group of a stepped DTensor's mesh
that holds no replica (FSDP's shard dimension) ends its step too, with the digest of nothing,
so its collectives are numbered by step like every other group's. ``PARAMSYNC_STATE_PROOF=0``
turns the proof off.

The optimizer is met at its first step by a global optimizer step post-hook (torch's
``register_optimizer_step_post_hook``); what it steps is planned then (again for an optimizer
not seen before), and each later step only hashes and reports.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any, Protocol

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from paramsync.actors.state.digest import StateDigest, StateHasher
from paramsync.actors.torch_backend.proof_digest import LocalHasher
from paramsync.actors.torch_backend.proof_notice import notice
from paramsync.actors.torch_backend.proof_targets import Plan, install, plan_for
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
    the state the group's ranks hold alike (its DDP modules, the DTensor parameters replicated
    over it) after every optimizer step."""
    global _HOOKED
    with _LOCK:
        _BROKEN_CHECKED.add(group)
        if prove:
            _GROUPS.add(group)
        if not _HOOKED:
            install(_proven)
            register_optimizer_step_pre_hook(_before_step)
            register_optimizer_step_post_hook(_after_step)
            _HOOKED = True


def _proven(group: Any) -> bool:
    """Whether ``group`` is a paramsync group whose state is proven."""
    try:
        return group in _GROUPS
    except TypeError:  # not weakly referenceable: not a paramsync group
        return False


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
    """What one optimizer's step proves (its `Plan`), held weakly, with a hasher for each
    part and what of the optimizer to hash with each DDP module (all of it when it steps only
    the module)."""

    def __init__(self, optimizer: torch.optim.Optimizer, plan: Plan) -> None:
        self.modules = [(weakref.ref(m), weakref.ref(g)) for m, g in plan.ddp]
        self.hashers: list[StateHasher] = [StateHasher() for _ in plan.ddp]
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.parts: list[Any] = []
        for module, _ in plan.ddp:
            if stepped <= {id(p) for p in module.parameters()}:
                self.parts.append(optimizer)
            else:
                self.parts.append(_ReplicatedPart(optimizer, module))
        self.replicated = [
            (weakref.ref(entry.group), entry.params, LocalHasher()) for entry in plan.replicated
        ]
        self.bare = [weakref.ref(group) for group in plan.bare]


_BINDINGS: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Binding] = weakref.WeakKeyDictionary()


def _bind(optimizer: torch.optim.Optimizer) -> _Binding:
    plan = plan_for(optimizer, _proven)
    if _global_rank() == 0:
        print(notice(plan), file=sys.stderr, flush=True)
    return _Binding(optimizer, plan)


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


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
    for group_ref, params, local_hasher in binding.replicated:
        group = group_ref()
        if group is None:
            continue
        digest = local_hasher.digest(params, optimizer)
        entry = per_group.setdefault(id(group), (group, [], set()))
        entry[1].extend(digest.tensors)
        entry[2].add(digest.algorithm)
    for group_ref in binding.bare:
        group = group_ref()
        if group is not None:
            per_group.setdefault(id(group), (group, [], set()))
    for group, tensors, algorithms in per_group.values():
        # The report names its algorithm (the coordinator compares like with like); modules of
        # one group hashed by different ones (one on the CPU, one on a GPU) name both.
        algorithm = "+".join(sorted(algorithms))
        if algorithms:
            group.session.end_step(StateDigest(None, tensors, algorithm=algorithm))
        else:  # a group holding no replica: the digest of nothing ends its step
            group.session.end_step(StateDigest(None, []))
