"""The ``torch.backends`` entry point: registers the ``paramsync`` backend at ``import torch``.

torch imports every entry point of the group ``torch.backends`` at the end of its own import
(``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off) and turns any exception into an error of
``import torch`` itself, so a broken entry point breaks every program in the environment,
including the ones that never use paramsync. This module therefore imports nothing of paramsync
but its own root (whose ``__init__`` loads nothing at import), no folder of the user's can stand
in for any of it (the entry point names ``paramsync.torch_entry``, not a bare top-level name such
as ``actors``), and `register` costs a few attribute lookups and never raises. The backend
itself, and everything it needs, loads at the first ``init_process_group("paramsync")``.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["BACKEND_NAME", "register"]

BACKEND_NAME = "paramsync"
"""The backend's name for ``torch.distributed.init_process_group`` and ``new_group``."""

BACKEND_MODULE = "paramsync.actors.torch_backend.process_group"
"""The module that builds a group: imported by the creator, at the first group, not before."""


def _create(options: Any, backend_options: Any = None) -> Any:
    """torch's creator for a ``paramsync`` group: loads the backend on first use."""
    import importlib

    return importlib.import_module(BACKEND_MODULE).create_process_group(options, backend_options)


def register() -> None:
    """Register the ``paramsync`` backend with torch.distributed (idempotent, never raises)."""
    try:
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available():
            return
        backend = dist.Backend
        if BACKEND_NAME in backend.backend_list:
            return
        backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    except Exception:
        return
