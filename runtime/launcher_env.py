"""What a launcher tells a training process when torch's variables are absent: Slurm's
``srun`` and Open MPI's ``mpirun`` variables, read as Lightning's cluster environments read
them (``lightning.fabric.plugins.environments.slurm`` and ``mpi``).

torch's own variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: torchrun,
``paramsync launch``, a hand-written launcher) always win: `DistributedTrainConfig` reads them
first, and `launcher_env` is asked only for what they leave out.

* **Slurm** (``srun``): the rank is SLURM_PROCID, the world size SLURM_NTASKS, the local rank
  SLURM_LOCALID; rank 0's host is MASTER_ADDR, else the first node of SLURM_NODELIST (or
  SLURM_JOB_NODELIST: ``node[3-5,9]`` gives ``node3``); the port is MASTER_PORT, else 15000
  plus the last four digits of SLURM_JOB_ID (Lightning's ``SLURMEnvironment.main_port``), else
  12910. A shell of an interactive allocation (SLURM_JOB_NAME ``bash`` or ``interactive``) is
  not a Slurm task, as for Lightning.
* **Open MPI** (``mpirun``): OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE and
  OMPI_COMM_WORLD_LOCAL_RANK; rank 0's host is MASTER_ADDR (``mpirun -x MASTER_ADDR=...``),
  else loopback when every rank runs on one node (OMPI_COMM_WORLD_LOCAL_SIZE equals the world
  size); the port is MASTER_PORT, else 29500 (torchrun's default). Lightning's
  ``MPIEnvironment`` broadcasts these through mpi4py, which paramsync does not need.

A variable that is missing where its launcher always sets it, or values that contradict each
other, are a `ConfigError` naming the variables.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass

from paramsync.runtime.errors import ConfigError

__all__ = ["Launcher", "LauncherEnv", "launcher_env", "slurm_root_node"]

SLURM_DEFAULT_PORT = 12910
"""Lightning's port under Slurm when SLURM_JOB_ID is not set either."""

OPEN_MPI_DEFAULT_PORT = 29500
"""torchrun's default MASTER_PORT."""


class Launcher(enum.Enum):
    """Which launcher's variables describe this process."""

    SLURM = "Slurm"
    OPEN_MPI = "Open MPI"


@dataclass(frozen=True)
class LauncherEnv:
    """This process's place in its job, as Slurm or Open MPI describe it."""

    launcher: Launcher
    rank: int
    world_size: int
    local_rank: int
    host: str
    """Rank 0's host (where the coordinator listens)."""
    port: int
    """The coordinator's port when nothing else picks one (`paramsync.actors.train.run`)."""

    @property
    def address(self) -> str:
        """``host:port`` (bracketed for an IPv6 host)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _count(environ: Mapping[str, str], name: str, launcher: Launcher) -> int:
    text = environ.get(name)
    if text is None:
        raise ConfigError(
            f"{launcher.value}: {name} is not set (its launcher sets it on every task)"
        )
    value = text.strip()
    if not value.isdigit():
        raise ConfigError(f"{launcher.value}: {name}={text!r} is not a non-negative integer")
    return int(value)


def _port(environ: Mapping[str, str], default: int) -> int:
    text = environ.get("MASTER_PORT")
    if text is None:
        return default
    value = text.strip()
    if not value.isdigit() or not 0 <= int(value) <= 65535:
        raise ConfigError(f"environment variable MASTER_PORT={text!r} is not in 0-65535")
    return int(value)


def _check(launcher: Launcher, rank: int, world: int, local: int, names: tuple[str, ...]) -> None:
    rank_var, world_var, local_var = names
    if world < 1:
        raise ConfigError(f"{launcher.value}: {world_var}={world} must be at least 1")
    if rank >= world:
        raise ConfigError(
            f"{launcher.value}: {rank_var}={rank} is not below {world_var}={world} (the ranks "
            f"are 0..{world - 1})"
        )
    if local >= world:
        raise ConfigError(
            f"{launcher.value}: {local_var}={local} is not below {world_var}={world} (a task's "
            "local rank counts the tasks of its node)"
        )


def slurm_root_node(nodes: str) -> str:
    """The first host of a Slurm node list: ``host0,host1``, ``host0 host1`` or ``host[5-9]``
    (Lightning's ``SLURMEnvironment.resolve_root_node_address``)."""
    nodes = re.sub(r"\[(.*?)[,-].*\]", "\\1", nodes)  # the first node of every node range
    nodes = re.sub(r"\[(.*?)\]", "\\1", nodes)  # a range of one number
    return nodes.strip().split(" ")[0].split(",")[0]


def _slurm(environ: Mapping[str, str]) -> LauncherEnv:
    launcher = Launcher.SLURM
    names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    rank, world, local = (_count(environ, name, launcher) for name in names)
    _check(launcher, rank, world, local, names)
    host = environ.get("MASTER_ADDR", "").strip()
    if not host:
        nodes = (environ.get("SLURM_NODELIST") or environ.get("SLURM_JOB_NODELIST") or "").strip()
        if not nodes:
            raise ConfigError(
                "Slurm: neither SLURM_NODELIST nor SLURM_JOB_NODELIST names the nodes, so rank "
                "0's host is unknown: set MASTER_ADDR to it"
            )
        host = slurm_root_node(nodes)
    job = environ.get("SLURM_JOB_ID", "").strip()
    if job and not job.isdigit():
        raise ConfigError(f"Slurm: SLURM_JOB_ID={job!r} is not a job number: set MASTER_PORT")
    default = 15000 + int(job[-4:]) if job else SLURM_DEFAULT_PORT
    return LauncherEnv(launcher, rank, world, local, host, _port(environ, default))


def _open_mpi(environ: Mapping[str, str]) -> LauncherEnv:
    launcher = Launcher.OPEN_MPI
    names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
    rank, world, local = (_count(environ, name, launcher) for name in names)
    _check(launcher, rank, world, local, names)
    host = environ.get("MASTER_ADDR", "").strip()
    if not host:
        local_size = environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "").strip()
        if local_size != str(world):
            raise ConfigError(
                f"Open MPI: the {world} ranks may span several nodes (OMPI_COMM_WORLD_LOCAL_SIZE="
                f"{local_size or 'unset'}), so rank 0's host is unknown: set MASTER_ADDR to it "
                "(mpirun -x MASTER_ADDR=<rank 0's host>)"
            )
        host = "127.0.0.1"
    return LauncherEnv(launcher, rank, world, local, host, _port(environ, OPEN_MPI_DEFAULT_PORT))


def launcher_env(environ: Mapping[str, str]) -> LauncherEnv | None:
    """Slurm's or Open MPI's description of this process, or None when neither launched it
    (or when torch's RANK or WORLD_SIZE is set: torch's variables win). A missing or
    contradictory variable is a `ConfigError` naming it."""
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return None
    if "SLURM_PROCID" in environ and environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return _slurm(environ)
    if "OMPI_COMM_WORLD_RANK" in environ or "OMPI_COMM_WORLD_SIZE" in environ:
        return _open_mpi(environ)
    return None
