"""Where a trainer meets its run's coordinator, under any launcher (`find_rendezvous`).

The coordinator is either rank 0's (the default role: rank 0's process hosts it, as torchrun's
rendezvous host) or a process of its own (``paramsync launch`` names it in
PARAMSYNC_COORDINATOR_ADDR; ``paramsync coordinator`` with PARAMSYNC_ROLE=worker on every
rank). Rank 0's coordinator needs a port, and MASTER_PORT is usually taken:

* **torchrun**: its agent's store holds MASTER_PORT; the coordinator takes a free port and
  rank 0 publishes it in that store (`paramsync.runtime.cli.torchrun`).
* **a script that called ``init_process_group``**, under any launcher that set torch's
  variables (a hand-written one, Slurm or mpirun with MASTER_ADDR/MASTER_PORT exported,
  ``mp.spawn``): rank 0's own TCP store holds MASTER_PORT. The coordinator takes a free port
  on rank 0's host (PARAMSYNC_ADVERTISE_ADDR, MASTER_ADDR, else the host the ranks reach that
  store at) and rank 0 publishes ``host port`` in the default group's store, which
  every rank already reaches, under a key of its own per trainer this process makes (as the
  torch backend publishes its group's coordinator, `paramsync.actors.torch_backend`). The
  rank and world size are then the default group's; environment variables that say
  otherwise are a `ConfigError` naming both.
* **otherwise** (no torch group, nothing on MASTER_PORT): the coordinator listens on
  MASTER_ADDR:MASTER_PORT, or on the address Slurm's or Open MPI's variables give
  (`paramsync.runtime.launcher_env`).

Only a coordinator of its own process can come back after it is lost (a daemon restarted
with its state): the workers redial it for a while (`Rendezvous.daemon`). Rank 0's
coordinator dies with rank 0, so the other ranks do not wait for it: the run ends at once,
naming rank 0.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from paramsync.runtime.cli.torchrun import TorchrunEnv
from paramsync.runtime.config import advertised_host
from paramsync.runtime.errors import ConfigError
from paramsync.runtime.launcher_env import launcher_env
from paramsync.runtime.train_config import COORDINATOR_ADDR_ENV, DistributedTrainConfig

__all__ = ["GROUP_STORE_KEY", "Rendezvous", "find_rendezvous"]

GROUP_STORE_KEY = "paramsync/trainer/coordinator"
"""The key, in the default torch group's store, of rank 0's coordinator address (``host
port``); the second trainer a process makes uses ``.../2``, and so on."""

_TRAINERS = itertools.count(1)
"""How many trainers this process met through the default group's store: every rank makes
them in the same order, so the keys agree."""


@dataclass(frozen=True)
class Rendezvous:
    """How this rank meets the coordinator: the configuration (rank and world size as the
    default torch group has them), the address (to bind, for the hosting rank; to dial,
    otherwise; port 0: a free one), how the hosting rank publishes the bound address and the
    others look it up (None: the address is known), and who hosts it."""

    config: DistributedTrainConfig
    host: str
    port: int
    publish: Callable[[str, int], None] | None = None
    """Called by the hosting rank with the address it bound (blocking)."""
    lookup: Callable[[float], tuple[str, int]] | None = None
    """Called by the other ranks: waits up to its argument in seconds (blocking)."""
    host_rank: int | None = 0
    """The rank whose process hosts the coordinator; None: a process of its own."""

    @property
    def hosts(self) -> bool:
        """Whether this process hosts the coordinator."""
        return self.config.is_coordinator

    @property
    def daemon(self) -> bool:
        """Whether the coordinator runs in a process of its own, which may come back after it
        is lost (so a worker redials it)."""
        return self.host_rank is None


def _group_store() -> tuple[Any, int, int] | None:
    """The default torch group's store, rank and size; None when there is no default group."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover: torch without distributed
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store(), dist.get_rank(), dist.get_world_size()


def _store_host(store: Any) -> str | None:
    """The host the ranks reach the default group's TCP store at (rank 0's, which serves it),
    under any prefixes; None for another kind of store."""
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return str(store.host) if isinstance(store, dist.TCPStore) else None


def _with_group_place(
    config: DistributedTrainConfig,
    rank: int,
    world: int,
    environ: Mapping[str, str],
    rebuild: Callable[[int, int], DistributedTrainConfig],
) -> DistributedTrainConfig:
    """``config`` with the default group's rank and world size; a `ConfigError` naming both
    when the environment (or a flag) said otherwise."""
    if (config.rank, config.world_size) == (rank, world):
        return config
    said = "RANK" in environ or "WORLD_SIZE" in environ or launcher_env(environ) is not None
    if said or (config.rank, config.world_size) != (0, 1):
        raise ConfigError(
            f"torch.distributed's default group says rank {rank} of {world}, but this process's "
            f"configuration says rank {config.rank} of {config.world_size} (RANK, WORLD_SIZE, "
            "or Slurm's/Open MPI's variables): launch every rank with the values it passes to "
            "init_process_group"
        )
    return rebuild(rank, world)


def _address_of(text: str, key: str) -> tuple[str, int]:
    host, _, port = text.rpartition(" ")
    if not host or not port.isdigit():
        raise ConfigError(
            f"the default torch group's store holds {text!r} under {key}: not an address"
        )
    return host, int(port)


def find_rendezvous(
    config: DistributedTrainConfig,
    rebuild: Callable[[int, int], DistributedTrainConfig],
    *,
    role_given: bool,
    environ: Mapping[str, str] | None = None,
) -> Rendezvous:
    """Where this rank meets its run's coordinator (see the module). ``rebuild(rank, world)``:
    the configuration resolved again with the default group's rank and world size;
    ``role_given``: a source named this process's role (a worker's coordinator is then a
    process of its own: `paramsync.runtime.train_config.role_is_given`)."""
    env = os.environ if environ is None else environ
    group = _group_store()
    if group is not None:
        config = _with_group_place(config, group[1], group[2], env, rebuild)
    host, port = config.address
    if COORDINATOR_ADDR_ENV in env:  # ``paramsync launch``'s coordinator
        return Rendezvous(config, host, port, host_rank=None)
    # A worker told its role may have a ``paramsync coordinator`` daemon (or, under torchrun,
    # a coordinator started by hand) rather than rank 0's.
    daemon = role_given and not config.is_coordinator
    host_rank = None if daemon else 0
    torchrun = TorchrunEnv.from_env(env)
    if torchrun is not None:
        if torchrun.coordinator_port is not None:
            fixed = torchrun.coordinator_port
            return Rendezvous(config, torchrun.store_host, fixed, host_rank=host_rank)
        store_host = torchrun.store_host

        def lookup_port(seconds: float) -> tuple[str, int]:
            return store_host, torchrun.lookup_coordinator_port(seconds=seconds)

        return Rendezvous(
            config,
            store_host,
            0,
            publish=lambda _host, bound: torchrun.publish_coordinator_port(bound),
            lookup=lookup_port,
            host_rank=host_rank,
        )
    if group is None or daemon:
        return Rendezvous(config, host, port, host_rank=host_rank)
    store = group[0]
    number = next(_TRAINERS)
    key = GROUP_STORE_KEY if number == 1 else f"{GROUP_STORE_KEY}/{number}"
    rank = config.rank

    def publish(bound_host: str, bound_port: int) -> None:
        store.set(key, f"{bound_host} {bound_port}")

    def lookup(seconds: float) -> tuple[str, int]:
        try:
            store.wait([key], timedelta(seconds=seconds))
        except (RuntimeError, OSError) as exc:  # DistStoreError: the wait timed out
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"rank {rank}: rank 0 did not publish its coordinator's address in the default "
                f"torch group's store within {seconds:g} s ({first}): every rank constructs its "
                "DistributedDataParallel (or trainer) in the same order"
            ) from None
        return _address_of(bytes(store.get(key)).decode("ascii", errors="replace"), key)

    # Rank 0's host: as named for paramsync or torch, else where the ranks reach rank 0's
    # store (an ``init_method="tcp://HOST:PORT"`` names no MASTER_ADDR), else the launcher's.
    named = advertised_host(env) or env.get("MASTER_ADDR", "").strip()
    bind_host = named or _store_host(store) or host
    return Rendezvous(config, bind_host, 0, publish=publish, lookup=lookup, host_rank=0)
