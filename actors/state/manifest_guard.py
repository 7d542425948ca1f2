"""Checking a received state manifest against the local model before allocating anything for it.

A joiner learns the donor's state layout from its ``state_manifest`` and then allocates a buffer
per listed tensor. The manifest comes from the network, so before any allocation
`check_manifest_fits` holds it against what this process could restore (`restore_state` would
refuse anything else afterwards, but only after the memory was taken):

* ``param.<name>`` and ``buffer.<name>``: exactly the local model's, each with the local shape
  and dtype, none missing;
* ``optim.<index>.<key>``: ``index`` a parameter of the local optimizer, each tensor no larger
  than that parameter (its moments) or a scalar (a step count), at most
  `MAX_OPTIMIZER_TENSORS_PER_PARAMETER` per parameter;
* ``rng.torch`` and ``rng.cuda.<i>``: the local generators' state shapes, uint8;
* nothing else.

The tensors' total is therefore bounded by the local model's own size (at most
``1 + MAX_OPTIMIZER_TENSORS_PER_PARAMETER`` times it, plus the RNG states), and
`allocation_bound` returns that bound for `allocate`'s ``max_bytes``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from paramsync.actors.state.training_state import StateMismatch, parse_manifest

__all__ = ["MAX_OPTIMIZER_TENSORS_PER_PARAMETER", "check_manifest_fits", "allocation_bound"]

MAX_OPTIMIZER_TENSORS_PER_PARAMETER = 8
"""Optimizer-state tensors one parameter may have (Adam with amsgrad has 4: exp_avg,
exp_avg_sq, max_exp_avg_sq and step)."""


def _local_layout(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], list[torch.Tensor]]:
    """The exact (shape, dtype) of every ``param.``/``buffer.``/``rng.`` tensor this process
    restores, and the optimizer's parameters in packed-index order."""
    exact: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, param in model.named_parameters():
        exact[f"param.{name}"] = (tuple(param.shape), param.dtype)
    for name, buffer in model.named_buffers():
        exact[f"buffer.{name}"] = (tuple(buffer.shape), buffer.dtype)
    exact["rng.torch"] = (tuple(torch.get_rng_state().shape), torch.uint8)
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            exact[f"rng.cuda.{i}"] = (tuple(torch.cuda.get_rng_state(i).shape), torch.uint8)
    params: list[torch.Tensor] = []
    if optimizer is not None:
        for group in optimizer.param_groups:
            params.extend(group["params"])
    return exact, params


def check_manifest_fits(
    manifest: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> int:
    """Refuse (`StateMismatch` naming the tensor and the problem) a manifest this process could
    not restore into ``model`` and ``optimizer``; return the bytes it announces, which the
    checks bound by the local model's size. Allocates nothing of the manifest's size."""
    try:
        _, _, specs = parse_manifest(manifest)
    except ValueError as err:
        raise StateMismatch(f"malformed state manifest: {err}") from None
    exact, params = _local_layout(model, optimizer)
    per_parameter: dict[int, int] = {}
    total = 0
    for name, shape, dtype in specs:
        if name in exact:
            want_shape, want_dtype = exact[name]
            if shape != want_shape or dtype != want_dtype:
                raise StateMismatch(
                    f"tensor {name!r}: the manifest says {_describe(shape, dtype)}, this "
                    f"process holds {_describe(want_shape, want_dtype)}"
                )
        elif name.startswith("optim."):
            index_text, _, key = name.removeprefix("optim.").partition(".")
            if not (index_text.isdigit() and key) or int(index_text) >= len(params):
                raise StateMismatch(
                    f"tensor {name!r} names no parameter of the local optimizer "
                    f"({len(params)} parameters)"
                )
            index = int(index_text)
            per_parameter[index] = per_parameter.get(index, 0) + 1
            if per_parameter[index] > MAX_OPTIMIZER_TENSORS_PER_PARAMETER:
                raise StateMismatch(
                    f"more than {MAX_OPTIMIZER_TENSORS_PER_PARAMETER} optimizer tensors for "
                    f"parameter {index}"
                )
            limit = max(params[index].numel(), 1)
            if math.prod(shape) > limit:
                raise StateMismatch(
                    f"tensor {name!r}: {_describe(shape, dtype)} is larger than its parameter "
                    f"({list(params[index].shape)})"
                )
        else:
            raise StateMismatch(f"unexpected tensor {name!r} (nothing here to restore it to)")
        total += math.prod(shape) * dtype.itemsize
    names = {name for name, _, _ in specs}
    for name in exact:
        if name.startswith(("param.", "buffer.", "rng.torch")) and name not in names:
            raise StateMismatch(f"tensor {name!r} of the local model is missing from the manifest")
    return total


def allocation_bound(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """The most bytes a manifest that passes `check_manifest_fits` can announce."""
    exact, params = _local_layout(model, optimizer)
    fixed = sum(math.prod(shape) * dtype.itemsize for shape, dtype in exact.values())
    optimizer_bytes = sum(max(p.numel(), 1) * 8 for p in params)
    return fixed + MAX_OPTIMIZER_TENSORS_PER_PARAMETER * optimizer_bytes


def _describe(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"{list(shape)} {str(dtype).removeprefix('torch.')}"
