"""Configuration foundations: who a process is in a group (`DistributedConfig`, addresses), the
data planes (`CommBackend`), the one parser of each kind of value, and the one layering of
sources (flags > environment > TOML > defaults) every configuration resolves through. Imports
nothing from the project but `paramsync.runtime.errors`.
"""

from paramsync.runtime.config.comm import (
    COMM_BACKEND_ENV,
    COMM_BACKEND_FLAG,
    COMM_BACKENDS,
    CommBackend,
    add_comm_backend_flag,
    check_comm_backend,
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
    "COMM_BACKENDS",
    "COMM_BACKEND_ENV",
    "COMM_BACKEND_FLAG",
    "CommBackend",
    "DistributedConfig",
    "Layering",
    "add_comm_backend_flag",
    "advertised_host",
    "check_comm_backend",
    "parse_address",
    "parse_bool",
    "parse_enum",
    "parse_int",
]
