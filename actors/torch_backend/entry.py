"""The ``torch.backends`` entry point: registers the ``paramsync`` backend at ``import torch``.

torch imports every entry point of the group ``torch.backends`` at the end of its own import
(``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off) and turns any exception into an error of
``import torch`` itself. So `register` imports nothing of paramsync, costs a few attribute
lookups, and never raises: a torch without distributed support, or a half-installed
paramsync, leaves ``import torch`` working (the backend is then simply not there). The
process group and everything it needs load when the first ``paramsync`` group is made.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["register", "BACKEND_NAME"]

BACKEND_NAME = "paramsync"


def _create(options: Any, backend_options: Any = None) -> Any:
    """torch's factory for a ``paramsync`` group (loads the backend on first use)."""
    from paramsync.actors.torch_backend.process_group import create_process_group

    return create_process_group(options, backend_options)


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
