"""What the identical-state proof covers, found where torch builds it: never by a heap scan.

Each of torch's parallelisms says, when it is built, which state it keeps identical on which
ranks, and the proof reads that claim from there:

* torch DDP: every construction runs `DistributedDataParallel.__init__`, a method of the class
  that user code reaches whatever name it imported the class under. `install` wraps it once
  (idempotent: the wrapper is marked, and a second install finds the mark), when the first
  paramsync group is watched, which is before any DDP on a paramsync group can exist. After
  torch's own constructor returns, a module whose process group is a proven paramsync group is
  remembered in a weak set; a module on any other group (gloo, NCCL, a paramsync group with the
  proof off) is left alone, and nothing else of the constructor changes.
* DTensor parameters (FSDP2's ``fully_shard``, HSDP, tensor parallelism's
  ``parallelize_module``, ``distribute_module``/``distribute_tensor``): torch marks every such
  parameter, as it builds it, with its device mesh and one placement per mesh dimension. A
  ``Replicate`` placement on dimension ``d`` is torch's own claim that the local tensor is the
  same on every rank of that dimension's group: HSDP's shards across the replicas that hold the
  same shard, tensor parallelism's replicated LayerNorm weights and biases across the
  tensor-parallel ranks. ``Shard`` and ``Partial`` claim nothing: a pure FSDP shard has no
  replica to compare. The parameters come from the optimizer itself (torch hands it to the
  step hook), so the claim is read exactly for what is stepped, with no module to find.
  ``fully_shard`` and ``parallelize_module`` are functions the user imported by name before
  any group existed, so a wrapper installed at the first group would not see them; the
  placement they leave on each parameter is the sounder seam, and it also covers a DTensor
  built by hand.

Names (what a divergence names): a DDP module's own parameter names; for a DTensor parameter,
the optimizer's names when it was built from ``named_parameters()``, else its fully qualified
name under a module that a composable API (``fully_shard``, ``replicate``) registered in
torch's own registry (``torch.distributed._composable_state``), else the class and attribute
it was registered under (a global parameter-registration hook, `install`, sees
``parallelize_module`` register it), with its index among the optimizer's parameters.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DDP_NOTE", "Plan", "Replicated", "ddp_modules", "install", "plan_for"]

Watched = Callable[[Any], bool]
"""Whether a process group is a paramsync group whose state is proven."""

_MARK = "__paramsync_proof_wrapper__"
_DDP: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_REGISTERED: dict[int, tuple[weakref.ref[Any], str]] = {}
"""DTensor parameters' class-qualified names by id, each held weakly (a tensor's ``==`` is
elementwise, so a weak dictionary keyed by tensors cannot hold them)."""
_HOOKED: list[Any] = []

DDP_NOTE = "torch DDP"


def install(watched: Watched) -> None:
    """Wrap torch DDP's constructor and hook parameter registration, once per process.
    ``watched`` says which process groups' DDP modules to remember."""
    from torch.nn.parallel import DistributedDataParallel

    init = DistributedDataParallel.__init__
    if not getattr(init, _MARK, False):

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            if watched(getattr(self, "process_group", None)):
                _DDP.add(self)

        setattr(__init__, _MARK, True)
        DistributedDataParallel.__init__ = __init__  # type: ignore[method-assign]
    if not _HOOKED:
        hook = torch.nn.modules.module.register_module_parameter_registration_hook
        _HOOKED.append(hook(_registered))


def _registered(module: torch.nn.Module, name: str, param: Any) -> None:
    """torch registers a parameter: remember a DTensor's class-qualified name (weakly)."""
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(param, dtensor):
        key = id(param)
        forget = lambda _: _REGISTERED.pop(key, None)  # noqa: E731
        _REGISTERED[key] = (weakref.ref(param, forget), f"{type(module).__name__}.{name}")


def _registered_name(param: Any) -> str | None:
    entry = _REGISTERED.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def ddp_modules() -> list[torch.nn.Module]:
    """The live torch DDP modules built on a proven paramsync group."""
    return list(_DDP)


def _dtensor_class() -> Any:
    """torch's DTensor class, or None while nothing imported it (then no DTensor exists)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


@dataclass(eq=False)
class Replicated:
    """DTensor parameters replicated over one mesh dimension: the same on every rank of
    ``group`` (that dimension's group on this rank)."""

    group: Any
    dimension: str
    """The mesh dimension, as the notice names it: its name, or its index."""
    replicas: list[list[int]]
    """Every group of that dimension, by global ranks (the ranks compared with each other)."""
    params: list[tuple[str, Any]] = field(default_factory=list)


@dataclass(eq=False)
class Plan:
    """What one optimizer's step proves: DDP modules with their groups, DTensor parameters
    replicated over a paramsync group, the paramsync groups of the stepped DTensors' meshes that
    hold no replica (their steps end with the digest of nothing), and the parameters left
    unproven, counted by why."""

    ddp: list[tuple[torch.nn.Module, Any]] = field(default_factory=list)
    replicated: list[Replicated] = field(default_factory=list)
    bare: list[Any] = field(default_factory=list)
    unproven: dict[str, int] = field(default_factory=dict)


SHARDED = (
    "sharded on every mesh dimension (each rank holds its own shard, as FSDP's: no replica "
    "to compare)"
)
LOCAL = "local to each rank (in no torch DDP module on a paramsync group, not a DTensor)"
OTHER_GROUP = "replicated over groups not on the paramsync backend (or with the proof off)"


def plan_for(optimizer: torch.optim.Optimizer, watched: Watched) -> Plan:
    """What ``optimizer`` steps that the proof covers, and what it does not."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stepped = {id(p) for p in params}
    plan = Plan()
    in_ddp: set[int] = set()
    for ddp in ddp_modules():
        group: Any = ddp.process_group
        if not watched(group):
            continue
        inner: torch.nn.Module = ddp.module  # type: ignore[assignment]
        ids = {id(p) for p in inner.parameters()}
        if ids & stepped:
            plan.ddp.append((inner, group))
            in_ddp |= ids
    # The same order on every rank: by the module's parameter names and shapes.
    plan.ddp.sort(key=lambda pair: [(n, tuple(p.shape)) for n, p in pair[0].named_parameters()])
    dtensor = _dtensor_class()
    names: dict[int, str] | None = None
    replicated: dict[tuple[int, int], Replicated] = {}
    bare: dict[int, Any] = {}
    dims: dict[tuple[int, int], Any] = {}
    for index, param in enumerate(params):
        if id(param) in in_ddp:
            continue
        if dtensor is None or not isinstance(param, dtensor):
            _count(plan, LOCAL)
            continue
        if names is None:
            names = _dtensor_names(optimizer)
        name = names.get(id(param)) or _registered_name(param) or "param"
        name = f"{name}[{index}]" if id(param) not in names else name
        mesh = param.device_mesh
        claimed = other = False
        for dim, placement in enumerate(param.placements):
            key = (id(mesh), dim)
            group = dims.get(key)
            if group is None:
                group = dims[key] = mesh.get_group(dim)
            if not watched(group):
                other = other or placement.is_replicate()
                continue
            if placement.is_replicate():
                entry = replicated.get(key)
                if entry is None:
                    entry = replicated[key] = Replicated(
                        group, _dimension(mesh, dim), _replicas(mesh, dim)
                    )
                entry.params.append((name, param))
                claimed = True
            else:
                bare.setdefault(id(group), group)
        if not claimed:
            _count(plan, OTHER_GROUP if other else SHARDED)
    plan.replicated = list(replicated.values())
    held = {id(entry.group) for entry in plan.replicated} | {id(g) for _, g in plan.ddp}
    plan.bare = [group for key, group in bare.items() if key not in held]
    return plan


def _count(plan: Plan, reason: str) -> None:
    plan.unproven[reason] = plan.unproven.get(reason, 0) + 1


def _dimension(mesh: Any, dim: int) -> str:
    names = mesh.mesh_dim_names
    return repr(names[dim]) if names else str(dim)


def _replicas(mesh: Any, dim: int) -> list[list[int]]:
    """Every group along mesh dimension ``dim``, as lists of global ranks."""
    ranks = mesh.mesh
    return [[int(r) for r in row] for row in ranks.movedim(dim, -1).reshape(-1, ranks.size(dim))]


def _dtensor_names(optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """Fully qualified names of the optimizer's parameters where torch knows them: the
    optimizer's own (built from ``named_parameters()``), else under the outermost module a
    composable API registered (``fully_shard``, ``replicate``)."""
    found: dict[int, str] = {}
    registry = getattr(
        sys.modules.get("torch.distributed._composable_state"), "_module_state_mapping", None
    )
    for module in list(registry.keys()) if registry is not None else []:
        for name, param in module.named_parameters():
            if len(name) > len(found.get(id(param), "")):
                found[id(param)] = name
    for group in optimizer.param_groups:
        for name, param in zip(group.get("param_names", ()), group["params"], strict=False):
            found[id(param)] = name
    return found
