"""Whose data plane moves the tensors (``data_plane``): defined once, for every configuration
that names it (`paramsync.runtime.train_config.DistributedTrainConfig`, `TrainerOptions`,
`paramsync.runtime.parallel.config.ParallelismConfig`), with its one variable and its one flag.
Here, not in `paramsync.runtime.transport.torch_plane`, so that naming one needs no torch."""

from __future__ import annotations

import argparse
import enum

from paramsync.runtime.config.values import parse_enum
from paramsync.runtime.errors import ConfigError

__all__ = [
    "DATA_PLANES",
    "DATA_PLANE_ENV",
    "DATA_PLANE_FLAG",
    "RENAMED_DATA_PLANE_ENV",
    "DataPlane",
    "add_data_plane_flag",
    "check_data_plane",
]


class DataPlane(enum.Enum):
    """Whose data plane moves the tensors: paramsync's own collectives (TCP ring, shared memory)
    or torch.distributed's (`paramsync.runtime.transport.torch_plane`)."""

    PARAMSYNC = "paramsync"
    TORCH = "torch"

    @classmethod
    def parse(cls, value: object, label: str = "data_plane") -> DataPlane:
        """The member ``value`` names (a member or its name, any case); else a `ConfigError`
        naming ``label``."""
        return parse_enum(cls, value, label)


DATA_PLANES = tuple(plane.value for plane in DataPlane)
"""The data planes' names: ``("paramsync", "torch")``."""

DATA_PLANE_ENV = "PARAMSYNC_DATA_PLANE"
"""The variable naming the data plane (``paramsync worker --data-plane`` sets it)."""

RENAMED_DATA_PLANE_ENV = {"PARAMSYNC_COMM_BACKEND": DATA_PLANE_ENV}
"""The data plane's variable's former name, refused (with its new name) by every configuration
that reads `DATA_PLANE_ENV` (`paramsync.runtime.config.layering.Layering`'s ``renamed_env``)."""

DATA_PLANE_FLAG = "--data-plane"
"""The flag naming the data plane, added by `add_data_plane_flag` (dest ``data_plane``)."""


def check_data_plane(value: object, where: str = "data_plane") -> DataPlane:
    """The `DataPlane` ``value`` is (a member, or a member's name exactly), else a `ConfigError`
    (a ``ValueError``) naming ``where``. Strict, for values given in code; the text of a
    variable, TOML key or flag goes through the lenient `DataPlane.parse`."""
    if isinstance(value, DataPlane):
        return value
    if not isinstance(value, str) or value not in DATA_PLANES:
        choices = ", ".join(repr(name) for name in DATA_PLANES)
        raise ConfigError(f"{where} must be one of {choices}, got {value!r}")
    return DataPlane(value)


def add_data_plane_flag(parser: argparse._ActionsContainer) -> None:
    """Add ``--data-plane`` (dest ``data_plane``, None when not given) to ``parser`` (or an
    argument group), unless it already has it: the worker's command line and the parallelism
    flags both take it, and a job adding both gets one flag."""
    try:
        parser.add_argument(
            DATA_PLANE_FLAG,
            dest="data_plane",
            choices=list(DATA_PLANES),
            default=None,
            help="the data plane: paramsync's own TCP ring and shared memory (default), or "
            "torch.distributed process groups (gloo; NCCL on CUDA); default "
            f"${DATA_PLANE_ENV} or paramsync",
        )
    except argparse.ArgumentError:
        pass  # declared already, by the other configuration of this command line
