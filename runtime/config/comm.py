"""Whose data plane moves the tensors (``comm_backend``): defined once, for every configuration
that names it (`paramsync.runtime.train_config.DistributedTrainConfig`, `TrainerOptions`,
`paramsync.runtime.parallel.config.ParallelismConfig`), with its one variable and its one flag.
Here, not in `paramsync.runtime.transport.torch_dist`, so that naming one needs no torch."""

from __future__ import annotations

import argparse
import enum

from paramsync.runtime.config.values import parse_enum
from paramsync.runtime.errors import ConfigError

__all__ = [
    "COMM_BACKENDS",
    "COMM_BACKEND_ENV",
    "COMM_BACKEND_FLAG",
    "CommBackend",
    "add_comm_backend_flag",
    "check_comm_backend",
]


class CommBackend(enum.Enum):
    """Whose data plane moves the tensors: paramsync's own collectives (TCP ring, shared memory)
    or torch.distributed's (`paramsync.runtime.transport.torch_dist`)."""

    PARAMSYNC = "paramsync"
    TORCH = "torch"

    @classmethod
    def parse(cls, value: object, label: str = "comm_backend") -> CommBackend:
        """The member ``value`` names (a member or its name, any case); else a `ConfigError`
        naming ``label``."""
        return parse_enum(cls, value, label)


COMM_BACKENDS = tuple(backend.value for backend in CommBackend)
"""The data planes' names: ``("paramsync", "torch")``."""

COMM_BACKEND_ENV = "PARAMSYNC_COMM_BACKEND"
"""The variable naming the data plane (``paramsync worker --comm-backend`` sets it)."""

COMM_BACKEND_FLAG = "--comm-backend"
"""The flag naming the data plane, added by `add_comm_backend_flag` (dest ``comm_backend``)."""


def check_comm_backend(value: object, where: str = "comm_backend") -> str:
    """``value`` if it is a data plane's name exactly (or a `CommBackend`: its name), else a
    `ConfigError` (a ``ValueError``) naming ``where``. Strict, for values given in code; the
    text of a variable, TOML key or flag goes through the lenient `CommBackend.parse`."""
    if isinstance(value, CommBackend):
        return value.value
    if not isinstance(value, str) or value not in COMM_BACKENDS:
        choices = ", ".join(repr(name) for name in COMM_BACKENDS)
        raise ConfigError(f"{where} must be one of {choices}, got {value!r}")
    return value


def add_comm_backend_flag(parser: argparse._ActionsContainer) -> None:
    """Add ``--comm-backend`` (dest ``comm_backend``, None when not given) to ``parser`` (or an
    argument group), unless it already has it: the worker's command line and the parallelism
    flags both take it, and a job adding both gets one flag."""
    try:
        parser.add_argument(
            COMM_BACKEND_FLAG,
            dest="comm_backend",
            choices=list(COMM_BACKENDS),
            default=None,
            help="the data plane: paramsync's own TCP ring and shared memory (default), or "
            "torch.distributed process groups (gloo; NCCL on CUDA); default "
            f"${COMM_BACKEND_ENV} or paramsync",
        )
    except argparse.ArgumentError:
        pass  # declared already, by the other configuration of this command line
