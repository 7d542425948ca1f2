"""Who this training process is: role, rank, device and where the coordinator listens.

`DistributedTrainConfig` is what a training entry point builds first. It can come from torchrun's
environment variables, from a ``[distributed]`` table in a TOML file, or from command-line flags;
`DistributedTrainConfig.resolve` layers them (flags > environment > TOML > defaults) so a launch
script can set what it knows and leave the rest. Every bad value is a ``ValueError`` that names
the field, variable or key it came from.

TLS (`paramsync.runtime.transport.tls`) is on when ``tls_cert``, ``tls_key`` and ``tls_ca`` are all
given (flags ``--tls-cert/--tls-key/--tls-ca``, variables ``PARAMSYNC_TLS_CERT/KEY/CA`` or TOML
keys; a relative path in a TOML file is relative to that file); `DistributedTrainConfig.tls_config`
checks the files and returns the `TlsConfig`.

``data_plane`` picks the data plane, a `DataPlane`: ``PARAMSYNC`` (its own TCP ring and shared
memory, the default) or ``TORCH`` (torch.distributed process groups,
`paramsync.runtime.transport.torch_plane`); flag ``--data-plane``, variable
``PARAMSYNC_DATA_PLANE``, TOML key ``data_plane`` (`paramsync.runtime.config.data_plane`).

The command line (`paramsync.runtime.cli`) and the library (`paramsync.actors.train.run`,
`paramsync.actors.train.worker`) both build it from here; the sources are layered by
`paramsync.runtime.config.layering.Layering`, as
`paramsync.runtime.parallel.config.ParallelismConfig`'s are.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paramsync.runtime.config import (
    DATA_PLANE_ENV,
    RENAMED_DATA_PLANE_ENV,
    DataPlane,
    DistributedConfig,
    Layering,
    check_data_plane,
    parse_address,
    parse_enum,
    parse_int,
)
from paramsync.runtime.errors import ConfigError, one_line
from paramsync.runtime.launcher_env import launcher_env
from paramsync.runtime.protocol.handshake import SECRET_ENV, SECRET_FILE_ENV, load_secret
from paramsync.runtime.transport.tls import TlsConfig

if TYPE_CHECKING:  # torch is imported where a device is resolved: the launcher never needs it
    import torch

__all__ = [
    "DEFAULT_COORDINATOR_HOST",
    "DEFAULT_COORDINATOR_PORT",
    "Device",
    "DistributedRole",
    "DistributedTrainConfig",
    "DEVICE_ENV",
    "ENV_VARS",
    "RENAMED_ENV_VARS",
    "TLS_ENV_VARS",
    "resolve_tls",
    "role_is_given",
    "shared_secret",
]

DEFAULT_COORDINATOR_HOST = "127.0.0.1"
DEFAULT_COORDINATOR_PORT = 29500  # torchrun's default MASTER_PORT

DEVICE_ENV = "PARAMSYNC_DEVICE"
"""The variable naming the device (`Device`)."""

RENAMED_ENV_VARS = {"PARAMSYNC_BACKEND": DEVICE_ENV, **RENAMED_DATA_PLANE_ENV}
"""Variables `DistributedTrainConfig.from_env` no longer reads, each with its new name: one that
is set is a `ConfigError` saying so."""

#: Environment variables `DistributedTrainConfig.from_env` reads. The first five are torchrun's.
ENV_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PARAMSYNC_ROLE",
    DEVICE_ENV,
    "PARAMSYNC_TLS_CERT",
    "PARAMSYNC_TLS_KEY",
    "PARAMSYNC_TLS_CA",
    "PARAMSYNC_DATA_PLANE",
    "PARAMSYNC_COORDINATOR_ADDR",
)

COORDINATOR_ADDR_ENV = "PARAMSYNC_COORDINATOR_ADDR"
"""host:port of paramsync's coordinator. When set it wins over MASTER_ADDR/MASTER_PORT, which
then stay torch.distributed's: ``paramsync launch`` sets it, so that a script calling
``init_process_group`` finds MASTER_PORT free for torch's own store."""

#: The TLS fields, each with its environment variable and command-line flag.
TLS_ENV_VARS = {
    "tls_cert": "PARAMSYNC_TLS_CERT",
    "tls_key": "PARAMSYNC_TLS_KEY",
    "tls_ca": "PARAMSYNC_TLS_CA",
}


class DistributedRole(enum.Enum):
    """What a process does in the group: the coordinator (rank 0 by default) or a worker."""

    COORDINATOR = "coordinator"
    WORKER = "worker"

    @classmethod
    def parse(cls, value: object) -> DistributedRole:
        """Return the role named by ``value`` (a role or its name, any case)."""
        return parse_enum(cls, value, "role")


class Device(enum.Enum):
    """Which torch device a process computes on; ``AUTO`` takes CUDA when there is one."""

    CPU = "cpu"
    CUDA = "cuda"
    AUTO = "auto"

    @classmethod
    def parse(cls, value: object) -> Device:
        """Return the device named by ``value`` (a device or its name, any case)."""
        return parse_enum(cls, value, "device")

    def resolve(self, local_rank: int = 0) -> torch.device:
        """The device to use: ``cpu``, or ``cuda:<local_rank>`` (one GPU per local process).

        Raises ``RuntimeError`` when CUDA is asked for but this torch cannot see a GPU, or
        when there are fewer GPUs than local ranks.
        """
        import torch

        if self is Device.CPU:
            return torch.device("cpu")
        if not torch.cuda.is_available():
            if self is Device.AUTO:
                return torch.device("cpu")
            raise RuntimeError(
                f"device 'cuda' was requested but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, CUDA {torch.version.cuda}); use device 'cpu' "
                f"or 'auto'"
            )
        count = torch.cuda.device_count()
        if not 0 <= local_rank < count:
            raise RuntimeError(
                f"local_rank {local_rank} needs GPU cuda:{local_rank} but only {count} "
                f"GPU(s) are visible"
            )
        return torch.device("cuda", local_rank)


def _check_path(name: str, value: object) -> Path:
    text = os.fspath(value) if isinstance(value, str | os.PathLike) else None
    if isinstance(text, str) and text.strip():
        return Path(text)
    raise ValueError(f"{name} must be a file path, got {value!r}")


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return value


@dataclass(frozen=True)
class DistributedTrainConfig:
    """This process's place in a data-parallel training group; validated on construction.

    ``role`` defaults to COORDINATOR on rank 0 and WORKER elsewhere. ``role`` and ``device``
    also accept their names as strings. ``coordinator_addr`` is ``host:port``. ``tls_cert``,
    ``tls_key`` and ``tls_ca`` (paths) turn TLS on: all three or none. ``data_plane``: the
    data plane, a `DataPlane` or its name (``"paramsync"`` or ``"torch"``).
    """

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    role: DistributedRole | None = None
    coordinator_addr: str = f"{DEFAULT_COORDINATOR_HOST}:{DEFAULT_COORDINATOR_PORT}"
    device: Device = Device.AUTO
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    data_plane: DataPlane = DataPlane.PARAMSYNC

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_plane", check_data_plane(self.data_plane))
        world_size = _check_int("world_size", self.world_size)
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        rank = _check_int("rank", self.rank)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
        local_rank = _check_int("local_rank", self.local_rank)
        if local_rank < 0:
            raise ValueError(f"local_rank must be non-negative, got {local_rank}")
        if local_rank >= world_size:
            raise ValueError(f"local_rank {local_rank} is out of range for world_size {world_size}")
        if self.role is None:
            role = DistributedRole.COORDINATOR if rank == 0 else DistributedRole.WORKER
        else:
            role = DistributedRole.parse(self.role)
        object.__setattr__(self, "role", role)
        object.__setattr__(self, "device", Device.parse(self.device))
        if not isinstance(self.coordinator_addr, str):
            raise ValueError(f"coordinator_addr must be a str, got {self.coordinator_addr!r}")
        try:
            parse_address(self.coordinator_addr)
        except ValueError as exc:
            raise ValueError(f"coordinator_addr: {exc}") from None
        for name in TLS_ENV_VARS:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _check_path(name, value))
        given = [name for name in TLS_ENV_VARS if getattr(self, name) is not None]
        if given and len(given) < len(TLS_ENV_VARS):
            missing = [name for name in TLS_ENV_VARS if name not in given]
            raise ValueError(
                f"TLS needs tls_cert, tls_key and tls_ca together: {', '.join(given)} given, "
                f"{' and '.join(missing)} missing (flags "
                f"{', '.join('--' + name.replace('_', '-') for name in missing)}; environment "
                f"{', '.join(TLS_ENV_VARS[name] for name in missing)})"
            )

    @property
    def is_coordinator(self) -> bool:
        """True for the coordinator process."""
        return self.role is DistributedRole.COORDINATOR

    @property
    def address(self) -> tuple[str, int]:
        """The coordinator address as a (host, port) pair."""
        return parse_address(self.coordinator_addr)

    def torch_device(self) -> torch.device:
        """The torch device this process computes on (see `Device.resolve`)."""
        return self.device.resolve(self.local_rank)

    def tls_config(self) -> TlsConfig | None:
        """The TLS of every connection (`paramsync.runtime.transport.tls`), or None for plaintext
        TCP.

        Reads the three files: a missing, unreadable or malformed one is a ``ValueError``
        naming it."""
        if self.tls_cert is None or self.tls_key is None or self.tls_ca is None:
            return None
        return TlsConfig.from_paths(self.tls_cert, self.tls_key, self.tls_ca)

    def to_distributed_config(self) -> DistributedConfig:
        """The transport-level group description (world size, rank, rendezvous address)."""
        return DistributedConfig(
            world_size=self.world_size, rank=self.rank, coordinator_addr=self.coordinator_addr
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DistributedTrainConfig:
        """Build from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
        MASTER_PORT, plus PARAMSYNC_ROLE and PARAMSYNC_DEVICE), else Slurm's or Open MPI's
        (`paramsync.runtime.launcher_env`); unset ones take defaults. A variable
        of `RENAMED_ENV_VARS` still set is a `ConfigError` naming its new name."""
        return cls(**_LAYERING.from_env(os.environ if environ is None else environ))

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> DistributedTrainConfig:
        """Build from the ``[distributed]`` table of a TOML file; missing keys take defaults.

        Other tables are left for other readers; unknown keys in ``[distributed]`` are errors.
        """
        return cls(**_LAYERING.from_toml(path))

    @classmethod
    def resolve(
        cls,
        toml_path: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
        overrides: Mapping[str, object] | None = None,
    ) -> DistributedTrainConfig:
        """Layer the sources: ``overrides`` (flags) > environment > TOML file > defaults.

        ``environ`` defaults to ``os.environ``; pass ``{}`` to ignore the environment.
        ``None`` values in ``overrides`` mean "not given" (argparse's default), so they do not
        mask lower layers; unknown override keys are errors.
        """
        return cls(**_LAYERING.resolve(toml_path, environ, overrides))


_INT_FIELDS = ("world_size", "rank", "local_rank")


def _coerce(key: str, value: object, label: str) -> object:
    """One source's value of ``key``, checked (`paramsync.runtime.config.layering.Coerce`)."""
    if key in _INT_FIELDS:
        return parse_int(value, label)
    if key == "role":
        return parse_enum(DistributedRole, value, label)
    if key == "device":
        return parse_enum(Device, value, label)
    if key in TLS_ENV_VARS:
        return _check_path(label, value)
    if key == "data_plane":
        return DataPlane.parse(value, label)
    if not isinstance(value, str):
        raise ConfigError(f"{label} must be a host:port string, got {value!r}")
    try:
        parse_address(value)
    except ValueError as exc:
        raise ConfigError(f"{label}: {exc}") from None
    return value


def _address_from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The coordinator's address: $PARAMSYNC_COORDINATOR_ADDR, else torchrun's MASTER_ADDR and
    MASTER_PORT (each defaulted when only the other is set)."""
    host = environ.get("MASTER_ADDR")
    port_text = environ.get("MASTER_PORT")
    given = environ.get(COORDINATOR_ADDR_ENV)
    if given is not None:
        try:
            parse_address(given.strip())
        except ValueError as exc:
            raise ConfigError(
                f"environment variable {COORDINATOR_ADDR_ENV}={given!r}: {exc}"
            ) from None
        return {"coordinator_addr": given.strip()}
    if host is None and port_text is None:
        return {}
    if host is not None:
        if not isinstance(host, str):
            raise ConfigError(f"environment variable MASTER_ADDR={host!r} is not a string")
        host = host.strip()
        if not host or any(c.isspace() or c in "[]/" for c in host):
            raise ConfigError(f"environment variable MASTER_ADDR={host!r} is not a host name")
    else:
        host = DEFAULT_COORDINATOR_HOST
    if port_text is not None:
        port = parse_int(port_text, "environment variable MASTER_PORT")
        if not 0 <= port <= 65535:
            raise ConfigError(f"environment variable MASTER_PORT={port_text!r} is not in 0-65535")
    else:
        port = DEFAULT_COORDINATOR_PORT
    addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        parse_address(addr)
    except ValueError as exc:
        raise ConfigError(f"environment variable MASTER_ADDR={host!r}: {exc}") from None
    return {"coordinator_addr": addr}


def _launcher_from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The coordinator's address (`_address_from_env`) and, when torch's RANK and WORLD_SIZE
    are absent, the rank, world size, local rank and rank 0's address that Slurm or Open MPI
    give (`paramsync.runtime.launcher_env`; LOCAL_RANK and PARAMSYNC_COORDINATOR_ADDR, when
    set, still win)."""
    out = _address_from_env(environ)
    found = launcher_env(environ)
    if found is None:
        return out
    out.update(rank=found.rank, world_size=found.world_size)
    if "LOCAL_RANK" not in environ:
        out["local_rank"] = found.local_rank
    if COORDINATOR_ADDR_ENV not in environ:
        try:
            parse_address(found.address)
        except ValueError as exc:
            raise ConfigError(f"{found.launcher.value}: rank 0's address: {exc}") from None
        out["coordinator_addr"] = found.address
    return out


_LAYERING = Layering(
    table="distributed",
    fields=tuple(f.name for f in fields(DistributedTrainConfig)),
    coerce=_coerce,
    env_vars={
        "rank": "RANK",
        "world_size": "WORLD_SIZE",
        "local_rank": "LOCAL_RANK",
        "role": "PARAMSYNC_ROLE",
        "device": DEVICE_ENV,
        **TLS_ENV_VARS,
        "data_plane": DATA_PLANE_ENV,
    },
    renamed_env=RENAMED_ENV_VARS,
    paths=tuple(TLS_ENV_VARS),
    flag_source="override",
    env_extra=_launcher_from_env,
)
"""`DistributedTrainConfig`'s sources: the ``[distributed]`` TOML table, torchrun's and
paramsync's variables (else Slurm's or Open MPI's), flags (named "override" in errors)."""


def role_is_given(
    toml_path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> bool:
    """Whether a source names this process's role (PARAMSYNC_ROLE, the TOML key, the flag):
    then the run's coordinator may be a process of its own (``paramsync coordinator``), not
    rank 0's (`paramsync.actors.train.rendezvous`)."""
    return "role" in _LAYERING.resolve(toml_path, environ, overrides)


def resolve_tls(
    flags: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None
) -> TlsConfig | None:
    """The TLS config of a process that needs nothing else of `DistributedTrainConfig` (the
    coordinator daemon): ``flags`` (``tls_cert``, ``tls_key``, ``tls_ca``; None: not given)
    over ``PARAMSYNC_TLS_*`` in ``environ`` (default ``os.environ``). All three or none; the
    files are read and checked. Every problem is a ``ValueError`` naming the flag or file."""
    env = os.environ if environ is None else environ
    merged = _LAYERING.from_env({var: env[var] for var in TLS_ENV_VARS.values() if var in env})
    if flags is not None:
        merged.update(_LAYERING.from_flags(flags))
    return DistributedTrainConfig(**merged).tls_config()


def shared_secret(secret: bytes | str | None = None) -> bytes:
    """The run's shared secret for an entry point: ``secret``, else $PARAMSYNC_SECRET, else
    the file $PARAMSYNC_SECRET_FILE names (`load_secret`). None found, or one that cannot be
    used (too short, an unreadable file), is a `ConfigError` naming the variables to set."""
    try:
        return load_secret(secret)
    except ValueError as exc:
        text = one_line(exc)
        if SECRET_ENV not in text:
            text = f"{text} (set {SECRET_ENV}, or {SECRET_FILE_ENV} to a file holding one)"
        raise ConfigError(text) from None
