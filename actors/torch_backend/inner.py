"""The inner torch group a paramsync group hands a collective's bytes to (the wrapper mode).

A ``paramsync`` process group can hold torch's own process groups, made from the same store
(under a prefix of the group's) and the same ranks, once per paramsync group: NCCL for CUDA
tensors, gloo for CPU tensors when asked. A call whose tensors it routes to one of them still
goes through the paramsync coordinator first (the same `Call`, agreed by every member before it
runs); only the bytes move through torch's group (`paramsync.actors.torch_backend.inner_ops`).

Which calls go where (``PARAMSYNC_TORCH_INNER``, or ``pg_options`` of ``init_process_group``
and ``new_group``: the same words, as a string or a mapping ``{"inner": ...}``):

* ``auto`` (the default): CUDA tensors through NCCL when torch has it, CPU tensors on
  paramsync's own mesh (the native plane);
* ``nccl``: the same, and a torch without NCCL is a `ConfigError` at the group's creation;
* ``gloo``: CPU tensors through gloo too (CUDA tensors through NCCL when torch has it);
* ``native``: every byte on paramsync's mesh (CUDA tensors staged through host memory).

A call whose tensors the inner group does not take (mixed devices, a dtype torch's group does
not reduce, such as int16 on gloo) runs on the native plane, as do barriers and, with gloo,
point-to-point messages (gloo sends only once the receiver has posted its receive, which would
hold the group's executor between an ``isend`` and its ``irecv``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from paramsync.runtime.errors import ConfigError
from paramsync.runtime.transport.torch_plane import GLOO_DTYPES as TORCH_PLANE_GLOO_DTYPES

__all__ = ["INNER_ENV", "INNER_KINDS", "InnerGroups", "inner_kind", "route_for"]

log = logging.getLogger(__name__)

INNER_ENV = "PARAMSYNC_TORCH_INNER"
"""Which inner torch group a ``paramsync`` group hands bytes to: auto, nccl, gloo or native."""

INNER_KINDS = ("auto", "nccl", "gloo", "native")

GLOO_DTYPES = TORCH_PLANE_GLOO_DTYPES | {torch.bool}
"""The dtypes torch's gloo group takes here: the torch plane's, and bool (not int16: those calls
stay on the native plane)."""


def inner_kind(backend_options: Any = None) -> str:
    """The inner kind asked for: ``backend_options`` (torch's ``pg_options``: a string, or a
    mapping whose ``inner`` names it) first, then ``PARAMSYNC_TORCH_INNER``, else ``auto``."""
    source, value = INNER_ENV, os.environ.get(INNER_ENV, "")
    if isinstance(backend_options, str):
        source, value = "pg_options", backend_options
    elif isinstance(backend_options, Mapping):
        if "inner" in backend_options:
            source, value = "pg_options['inner']", str(backend_options["inner"])
    elif backend_options is not None:
        raise ConfigError(
            f"pg_options {backend_options!r}: the paramsync backend takes one of "
            f"{', '.join(INNER_KINDS)}, or a mapping {{'inner': ...}}"
        )
    kind = value.strip().lower() or "auto"
    if kind not in INNER_KINDS:
        raise ConfigError(f"{source}={value!r}: use one of {', '.join(INNER_KINDS)}")
    if kind == "nccl" and not dist.is_nccl_available():
        raise ConfigError(f"{source}=nccl: this torch has no NCCL")
    return kind


def route_for(kind: str, tensors: Sequence[torch.Tensor], *, nccl: bool) -> str | None:
    """Which inner group runs a call over ``tensors`` under ``kind``: ``"nccl"``, ``"gloo"``,
    or None (the native plane). ``nccl``: whether NCCL can be used (torch has it and a GPU)."""
    if kind == "native" or not tensors:
        return None
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return None
    device = next(iter(devices))
    if device.type == "cuda":
        return "nccl" if nccl else None
    if device.type == "cpu" and kind == "gloo":
        if all(_real_dtype(t) in GLOO_DTYPES for t in tensors):
            return "gloo"
    return None


def _real_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype the group sees: a complex tensor travels as its real view."""
    if tensor.dtype.is_complex:
        return torch.view_as_real(tensor[:0] if tensor.dim() else tensor.reshape(1)).dtype
    return tensor.dtype


class InnerGroups:
    """The inner torch groups of one paramsync group: gloo made at once (its constructor
    connects every rank, so every rank makes it in the paramsync group's constructor), NCCL
    made at the first CUDA call (its communicator forms at its first collective anyway; every
    rank reaches it at the same agreed call). Both carry the group's timeout."""

    def __init__(
        self, kind: str, store: Any, rank: int, size: int, timeout: timedelta, prefix: str
    ) -> None:
        self.kind = kind
        self.rank, self.size, self.timeout = rank, size, timeout
        self._store = dist.PrefixStore(prefix, store)
        self._lock = threading.Lock()
        self._nccl: Any = None
        self._gloo: Any = None
        self._aborted = False
        self.nccl_usable = (
            kind != "native" and dist.is_nccl_available() and torch.cuda.is_available()
        )
        if kind == "gloo":
            self._gloo = dist.ProcessGroupGloo(
                dist.PrefixStore("gloo", self._store), rank, size, timeout
            )

    def route(self, tensors: Sequence[torch.Tensor]) -> str | None:
        """The inner group for a call over ``tensors`` (None: the native plane)."""
        return route_for(self.kind, tensors, nccl=self.nccl_usable)

    def group(self, route: str) -> Any:
        """The torch group for ``route`` (NCCL made here on its first use)."""
        with self._lock:
            if self._aborted:
                raise RuntimeError("the inner torch group was aborted")
            if route == "gloo":
                return self._gloo
            if self._nccl is None:  # pragma: no cover - needs CUDA and NCCL
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self.timeout
                self._nccl = dist.ProcessGroupNCCL(
                    dist.PrefixStore("nccl", self._store), self.rank, self.size, options
                )
            return self._nccl

    def abort(self) -> None:
        """Abort the inner groups: a call blocked in one of them returns with an error (the
        paramsync group already failed with its own, naming the rank or the call)."""
        with self._lock:
            self._aborted = True
            groups = [g for g in (self._nccl, self._gloo) if g is not None]
        for group in groups:
            try:
                group.abort()
            except Exception as exc:  # the group's error stays the paramsync one
                log.debug("aborting the inner %s group: %s", group, exc)

    def shutdown(self) -> None:
        """Release the inner groups (the paramsync group has finished)."""
        with self._lock:
            groups = [g for g in (self._nccl, self._gloo) if g is not None]
            self._nccl = self._gloo = None
        for group in groups:
            try:
                group.shutdown()
            except Exception as exc:
                log.debug("shutting the inner %s group down: %s", group, exc)
