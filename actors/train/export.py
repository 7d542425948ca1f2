"""Exporting a trained model: its ``state_dict`` without wrapper prefixes, as CPU copies, and
a safetensors file of it."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = ["export_state_dict", "save_safetensors"]


def export_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained model's ``state_dict()`` (parameters and persistent buffers) as plain,
    contiguous CPU copies under the model's own names, with no wrapper prefix: it loads into
    a fresh instance of the plain module (``load_state_dict``), into torch DDP's
    ``DistributedDataParallel(model).module``, and through DDP's own ``load_state_dict``
    after adding its ``module.`` prefix. Tied weights come out as separate copies of one
    value. Call it between steps (a step in flight is still changing the weights)."""
    return {
        name: tensor.detach().to("cpu", copy=True).contiguous()
        for name, tensor in _export_model(model).state_dict().items()
    }


def save_safetensors(
    model: torch.nn.Module,
    step: int,
    path: str | os.PathLike[str],
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write `export_state_dict` of ``model`` to a safetensors file at ``path`` (readable by
    ``safetensors.torch.load_file``); its metadata records ``format: pt``, the next step
    (``step``, as ``paramsync_step``) and ``metadata``'s strings. Returns the path."""
    target = Path(path)
    extra = dict(metadata or {})
    for key, value in extra.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"safetensors metadata {key!r} must be a str, got {type(value).__name__}"
            )
    extra.update({"format": "pt", "paramsync_step": str(step)})
    save_file(export_state_dict(model), str(target), metadata=extra)
    return target


def _export_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module under wrappers whose ``state_dict`` keys carry a prefix (torch DDP and
    DataParallel's ``module.``, ``torch.compile``'s ``_orig_mod.``)."""
    while True:
        if isinstance(
            model, torch.nn.parallel.DistributedDataParallel | torch.nn.parallel.DataParallel
        ):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model
