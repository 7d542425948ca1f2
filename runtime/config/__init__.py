"""Configuration foundations: who a process is in a group (`DistributedConfig`, addresses), the
data planes (`DataPlane`), the one parser of each kind of value, and the one layering of
sources (flags > environment > TOML > defaults) every configuration resolves through. Imports
nothing from the project but `paramsync.runtime.errors`.
"""

from paramsync.runtime.config.data_plane import (
    DATA_PLANE_ENV,
    DATA_PLANE_FLAG,
    DATA_PLANES,
    RENAMED_DATA_PLANE_ENV,
    DataPlane,
    add_data_plane_flag,
    check_data_plane,
)
from paramsync.runtime.config.group import (
    ADVERTISE_ENV,
    DistributedConfig,
    advertised_host,
    parse_address,
)
from paramsync.runtime.config.layering import Layering
from paramsync.runtime.config.values import parse_bool, parse_enum, parse_int

__all__ = [
    "ADVERTISE_ENV",
    "DATA_PLANES",
    "DATA_PLANE_ENV",
    "DATA_PLANE_FLAG",
    "RENAMED_DATA_PLANE_ENV",
    "DataPlane",
    "DistributedConfig",
    "Layering",
    "add_data_plane_flag",
    "advertised_host",
    "check_data_plane",
    "parse_address",
    "parse_bool",
    "parse_enum",
    "parse_int",
]
