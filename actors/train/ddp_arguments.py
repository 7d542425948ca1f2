"""torch DDP's constructor arguments, read with torch's meaning for paramsync's wrapper.

`torch.nn.parallel.DistributedDataParallel(module, device_ids=None, output_device=None, dim=0,
broadcast_buffers=None, init_sync=True, process_group=None, bucket_cap_mb=None,
find_unused_parameters=False, check_reduction=False, gradient_as_bucket_view=False,
static_graph=False, delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None)` (torch 2.13): every
argument is accepted by `paramsync.actors.train.ddp_wrapper.DistributedDataParallel` in the same
position. `torch_ddp_options` turns them into `TrainerOptions` and the device inputs go to; an
argument that cannot apply raises one `ValueError` line naming it and why.

What each one does here:

* ``device_ids``/``output_device``: as torch checks them: None for a CPU module or one spread over
  several devices; for a module on one CUDA device, None or that one device, and the forward's
  inputs are moved to it (torch's ``_to_kwargs``). ``dim`` only splits inputs across several
  devices in torch's deprecated single-process mode: accepted, nothing to split.
* ``broadcast_buffers`` / ``forward_sync_buffers`` (torch 2.13's name): True keeps the buffers
  identical (rank 0's, synchronized after each step's all-reduce: ``buffer_sync="broadcast"``),
  False leaves each rank its own (``"local"``, and the buffers leave the state check).
* ``process_group``: None, or torch.distributed's default group (the same ranks as the run):
  paramsync all-reduces over its own connections among the run's members.
* ``bucket_cap_mb``: the bucket size (``bucket_bytes``); ``bucket_cap_mb_list`` is refused.
* ``find_unused_parameters``: as in torch; ``static_graph=True`` also accepts parameters that
  every step leaves unused (torch finds them in its first iteration; here every step agrees on
  them, one small extra all-reduce a step).
* ``init_sync``: paramsync always starts every replica from rank 0's weights (a replica that
  differs at the start would fail the first state check anyway).
* ``gradient_as_bucket_view``, ``check_reduction`` (deprecated in torch), ``batched_grad_copy``:
  accepted; the gradients are always views of paramsync's bucket buffers, which backward writes
  into directly.
* ``skip_all_reduce_unused_params``, ``delay_all_reduce_named_params``,
  ``param_to_hook_all_reduce``, ``mixed_precision``, ``device_mesh``: refused (see each error).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from paramsync.actors.train.trainer import TrainerOptions

__all__ = ["DeviceArgs", "POWERSGD_DEFAULTS", "device_args", "torch_comm_hook", "torch_ddp_options"]


@dataclass(frozen=True)
class DeviceArgs:
    """Where the forward's inputs go (None: left where they are) and its output."""

    input_device: torch.device | None
    output_device: torch.device | None


def device_args(
    module: torch.nn.Module,
    device_ids: Sequence[int | torch.device] | None,
    output_device: int | torch.device | None,
) -> DeviceArgs:
    """Check ``device_ids``/``output_device`` against ``module``'s devices, as torch DDP does."""
    devices = {p.device for p in module.parameters()} | {b.device for b in module.buffers()}
    single_gpu = len(devices) == 1 and next(iter(devices)).type not in ("cpu", "meta")
    if not device_ids:
        if output_device is not None and not single_gpu:
            raise ValueError(
                f"DistributedDataParallel: output_device={output_device!r} needs a module on "
                f"one accelerator and device_ids naming it (the module's devices: "
                f"{sorted(str(d) for d in devices)}), as with torch DDP"
            )
        return DeviceArgs(None, None)
    if not single_gpu:
        raise ValueError(
            f"DistributedDataParallel: device_ids={list(device_ids)!r} only applies to a module "
            f"on one accelerator; this module's parameters are on "
            f"{sorted(str(d) for d in devices)}: pass device_ids=None (as torch DDP requires "
            "for a CPU module or one spread over several devices)"
        )
    (device,) = devices
    if len(device_ids) != 1:
        raise ValueError(
            f"DistributedDataParallel: device_ids={list(device_ids)!r} names several devices: "
            "one process per device, device_ids=[local_rank] (torch DDP's single-process "
            "multi-device mode was removed)"
        )
    wanted = _device(device_ids[0], device.type)
    if wanted != device:
        raise ValueError(
            f"DistributedDataParallel: device_ids=[{device_ids[0]!r}] but the module is on "
            f"{device}: move the module to the device first (model.to(device))"
        )
    out = _device(output_device, device.type) if output_device is not None else wanted
    return DeviceArgs(wanted, out)


def _device(value: int | torch.device | str, kind: str) -> torch.device:
    if isinstance(value, int):
        return torch.device(kind, value)
    device = torch.device(value)
    if device.index is None and device.type == kind:
        return torch.device(kind, torch.cuda.current_device() if kind == "cuda" else 0)
    return device


def torch_ddp_options(
    options: TrainerOptions,
    *,
    broadcast_buffers: bool | None = None,
    forward_sync_buffers: bool | None = None,
    process_group: Any = None,
    world_size: int | None = None,
    bucket_cap_mb: float | None = None,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
    delay_all_reduce_named_params: Any = None,
    param_to_hook_all_reduce: Any = None,
    mixed_precision: Any = None,
    device_mesh: Any = None,
    skip_all_reduce_unused_params: bool = False,
    bucket_cap_mb_list: Any = None,
) -> TrainerOptions:
    """``options`` with torch DDP's arguments of the same meaning applied; `ValueError` naming
    the argument for one that cannot apply. ``world_size``: the run's, when known (to check a
    ``process_group`` against it)."""
    refused = {
        "delay_all_reduce_named_params": (
            delay_all_reduce_named_params,
            "paramsync all-reduces every bucket as backward finishes it; delaying named "
            "parameters to the end of backward is not supported",
        ),
        "param_to_hook_all_reduce": (
            param_to_hook_all_reduce,
            "it only applies with delay_all_reduce_named_params, which is not supported",
        ),
        "mixed_precision": (
            mixed_precision,
            "DDP's native mixed precision (low-precision parameter copies) is not supported: "
            "run the forward under torch.autocast, or compress the all-reduce with "
            "register_comm_hook(None, default_hooks.bf16_compress_hook)",
        ),
        "device_mesh": (
            device_mesh,
            "paramsync's data-parallel group is the run's workers; build meshes with "
            "paramsync.runtime.collectives.mesh.init_device_mesh",
        ),
        "bucket_cap_mb_list": (
            bucket_cap_mb_list,
            "per-bucket sizes are not supported: give one bucket_cap_mb",
        ),
    }
    for name, (value, why) in refused.items():
        if value is not None:
            raise ValueError(f"DistributedDataParallel: {name} is not supported: {why}")
    if skip_all_reduce_unused_params:
        raise ValueError(
            "DistributedDataParallel: skip_all_reduce_unused_params=True is not supported: "
            "every bucket is all-reduced whole (an unused parameter contributes zeros, as "
            "torch DDP does without this option)"
        )
    _check_process_group(process_group, world_size)
    if broadcast_buffers is not None and forward_sync_buffers is not None:
        if bool(broadcast_buffers) != bool(forward_sync_buffers):
            raise ValueError(
                "DistributedDataParallel: broadcast_buffers and forward_sync_buffers (its new "
                f"name) disagree ({broadcast_buffers} and {forward_sync_buffers}): give one"
            )
    sync_buffers = forward_sync_buffers if forward_sync_buffers is not None else broadcast_buffers
    changes: dict[str, Any] = {}
    if find_unused_parameters or static_graph:
        changes["find_unused_parameters"] = True
    if sync_buffers is not None:
        changes["buffer_sync"] = "broadcast" if sync_buffers else "local"
    if bucket_cap_mb is not None:
        if not bucket_cap_mb > 0:
            raise ValueError(
                f"DistributedDataParallel: bucket_cap_mb must be positive, got {bucket_cap_mb}"
            )
        changes["bucket_bytes"] = max(1, int(bucket_cap_mb * 1024 * 1024))
    return dataclasses.replace(options, **changes) if changes else options


def _check_process_group(process_group: Any, world_size: int | None) -> None:
    """Only torch.distributed's default group (or None) names the run's own ranks."""
    if process_group is None:
        return
    import torch.distributed as dist

    default = dist.GroupMember.WORLD if dist.is_available() else None
    if process_group is not default or default is None:
        raise ValueError(
            "DistributedDataParallel: process_group must be None or torch.distributed's "
            "default group: paramsync all-reduces among the run's workers over its own "
            "connections (subgroups: paramsync.runtime.collectives.groups.new_group)"
        )
    size = dist.get_world_size()
    if world_size is not None and size != world_size:
        raise ValueError(
            f"DistributedDataParallel: process_group has {size} ranks but the run has "
            f"{world_size} workers"
        )


POWERSGD_DEFAULTS: dict[str, object] = {
    "min_compression_rate": 2,
    "use_error_feedback": True,
    "warm_start": True,
    "orthogonalization_epsilon": 0,
    "random_seed": 0,
    "batch_tensors_with_same_shape": False,
}
"""The `PowerSGDState` settings paramsync's PowerSGD reducer runs with (the rank and the start
iteration are the state's own)."""


def torch_comm_hook(state: object, hook: Any) -> tuple[str, int, int]:
    """(comm_hook, powersgd_rank, powersgd_start_iter) for one of torch's own DDP comm hooks:
    ``default_hooks.allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook`` and
    ``powerSGD_hook.powerSGD_hook`` (with its `PowerSGDState`), which paramsync's bucket
    reducers compute with torch's arithmetic (`paramsync.runtime.collectives.compression`). Any
    other hook is refused naming it: a Python hook calls torch.distributed collectives on a process
    group, which this wrapper does not hand out."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    name = getattr(hook, "__qualname__", repr(hook))
    if hook is default_hooks.allreduce_hook:
        return "none", 1, 2
    if hook is default_hooks.fp16_compress_hook:
        return "fp16", 1, 2
    if hook is default_hooks.bf16_compress_hook:
        return "bf16", 1, 2
    if hook is powerSGD_hook.powerSGD_hook:
        if not isinstance(state, powerSGD_hook.PowerSGDState):
            raise ValueError(
                "register_comm_hook: powerSGD_hook needs a PowerSGDState as its state, got "
                f"{type(state).__name__}"
            )
        for field, default in POWERSGD_DEFAULTS.items():
            value = getattr(state, field, default)
            if value != default:
                raise ValueError(
                    f"register_comm_hook: PowerSGDState.{field}={value!r} is not supported "
                    f"(paramsync's PowerSGD runs with {field}={default!r})"
                )
        return "powersgd", int(state.matrix_approximation_rank), int(state.start_powerSGD_iter)
    raise ValueError(
        f"register_comm_hook: {name} is not supported: paramsync runs torch's allreduce_hook, "
        "fp16_compress_hook, bf16_compress_hook and powerSGD_hook (each bucket reduced with "
        "torch's arithmetic); a hook of your own would need torch.distributed collectives "
        "on paramsync's group"
    )
