"""Running under torchrun: where paramsync's coordinator listens, and which run this is.

torchrun (``torch.distributed.run``) starts each worker with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT, like ``paramsync launch``, plus TORCHELASTIC_RUN_ID and
TORCHELASTIC_RESTART_COUNT; and its agent's own TCPStore already listens on
MASTER_ADDR:MASTER_PORT, so paramsync's coordinator (hosted by rank 0) cannot take that port.

Where the coordinator listens instead: the hosting rank binds a port the OS picks on
MASTER_ADDR and publishes the number in torchrun's store, under a key of this run and restart
attempt (`TorchrunEnv.store_key`); every other rank reads it from there, waiting until it is
written. Not MASTER_PORT + 1 (or any port derived from MASTER_PORT): nothing reserves that
port, so another job, a second torchrun on the same host or a lingering socket of a previous
attempt would fail the run at random, while the store is already the rendezvous that every
rank of this torchrun run reaches, and one key costs one round trip. A restarted attempt
(``--max-restarts``) reads a key of its own, so it never dials the previous attempt's
coordinator. ``PARAMSYNC_COORDINATOR_PORT`` fixes the port for every rank and skips the store
(a firewall that opens one port, a coordinator started by hand). When torchrun says its agent
hosts no store (TORCHELASTIC_USE_AGENT_STORE=False), MASTER_PORT is free and the coordinator
takes it, as under ``paramsync launch``.

Only the port number goes into the store. The shared secret comes from PARAMSYNC_SECRET or
PARAMSYNC_SECRET_FILE on every rank, as ever: torchrun's store is plain, unauthenticated TCP,
and the secret never travels.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

from paramsync.runtime.errors import ConfigError

__all__ = [
    "COORDINATOR_PORT_ENV",
    "RUN_ID_ENV",
    "TorchrunEnv",
    "run_id_from_env",
]

COORDINATOR_PORT_ENV = "PARAMSYNC_COORDINATOR_PORT"
"""Fixes the coordinator's port under torchrun (default: a free port, published in the store)."""

RUN_ID_ENV = "PARAMSYNC_RUN_ID"
"""The run id every rank of a fresh run shares (``paramsync launch`` sets it)."""


def run_id_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The run id the launcher gave every rank: $PARAMSYNC_RUN_ID, else torchrun's
    $TORCHELASTIC_RUN_ID (its ``--rdzv-id``; "none" is torchrun's placeholder, not an id)."""
    env = os.environ if environ is None else environ
    for name in (RUN_ID_ENV, "TORCHELASTIC_RUN_ID"):
        value = env.get(name, "").strip()
        if value and value != "none":
            return value
    return None


def _port(text: str, name: str, *, allow_zero: bool = False) -> int:
    value = text.strip()
    low = 0 if allow_zero else 1
    if not value.isdigit() or not low <= int(value) <= 65535:
        raise ConfigError(f"{name}={text!r} is not a TCP port ({low}-65535): set it to one")
    return int(value)


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun told this worker: its run, restart attempt and store address, and the
    coordinator port ``PARAMSYNC_COORDINATOR_PORT`` fixes (None: exchange it in the store)."""

    run_id: str
    restart_count: int
    store_host: str
    store_port: int
    coordinator_port: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
        """Read the environment; None when this process was not started by torchrun (no
        TORCHELASTIC_RUN_ID). A malformed variable is a `ConfigError` naming it."""
        env = os.environ if environ is None else environ
        run_id = env.get("TORCHELASTIC_RUN_ID")
        if not run_id:
            return None
        restart_text = env.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
        if not restart_text.isdigit():
            raise ConfigError(
                f"TORCHELASTIC_RESTART_COUNT={restart_text!r} is not a count: torchrun sets it"
            )
        host = env.get("MASTER_ADDR", "").strip()
        if not host:
            raise ConfigError("TORCHELASTIC_RUN_ID is set but MASTER_ADDR is not: set MASTER_ADDR")
        if "MASTER_PORT" not in env:
            raise ConfigError("TORCHELASTIC_RUN_ID is set but MASTER_PORT is not: set MASTER_PORT")
        store_port = _port(env["MASTER_PORT"], "MASTER_PORT")
        fixed = env.get(COORDINATOR_PORT_ENV)
        coordinator_port = None if fixed is None else _port(fixed, COORDINATOR_PORT_ENV)
        if coordinator_port is None and env.get("TORCHELASTIC_USE_AGENT_STORE") == "False":
            # No agent store on MASTER_PORT (the workers would host one themselves, through
            # init_process_group): MASTER_PORT is free for the coordinator, as under launch.
            coordinator_port = store_port
        return cls(
            run_id=run_id,
            restart_count=int(restart_text),
            store_host=host,
            store_port=store_port,
            coordinator_port=coordinator_port,
        )

    @property
    def store_key(self) -> str:
        """The key of the coordinator's port: one per run and restart attempt."""
        return f"paramsync/{self.run_id}/attempt_{self.restart_count}/coordinator_port"

    @property
    def store_address(self) -> str:
        return f"{self.store_host}:{self.store_port}"

    def _store(self, seconds: float) -> object:
        import torch.distributed as dist

        if not dist.is_available():
            raise ConfigError(
                "this torch was built without torch.distributed, so paramsync cannot read "
                f"torchrun's store: set {COORDINATOR_PORT_ENV} to a free port on every rank"
            )
        try:
            return dist.TCPStore(
                self.store_host,
                self.store_port,
                is_master=False,
                timeout=datetime.timedelta(seconds=seconds),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as exc:  # DistStoreError, DistNetworkError
            raise ConfigError(
                f"cannot reach torchrun's store at {self.store_address} (MASTER_ADDR, "
                f"MASTER_PORT): {_first_line(exc)}"
            ) from None

    def publish_coordinator_port(self, port: int, *, seconds: float = 60.0) -> None:
        """Write the port the coordinator listens on into torchrun's store (blocking: call
        it from a thread). Only the number is written."""
        store = self._store(seconds)
        try:
            store.set(self.store_key, str(port))  # type: ignore[attr-defined]
        except (RuntimeError, OSError) as exc:
            raise ConfigError(
                f"cannot write the coordinator's port to torchrun's store at "
                f"{self.store_address}: {_first_line(exc)}"
            ) from None

    def lookup_coordinator_port(self, *, seconds: float = 120.0) -> int:
        """Wait up to ``seconds`` for the hosting rank to publish the coordinator's port and
        return it (blocking: call it from a thread)."""
        store = self._store(seconds)
        try:
            store.wait([self.store_key])  # type: ignore[attr-defined]
            raw = store.get(self.store_key)  # type: ignore[attr-defined]
        except (RuntimeError, OSError) as exc:
            raise ConfigError(
                f"no paramsync coordinator port appeared in torchrun's store at "
                f"{self.store_address} within {seconds:g} s ({_first_line(exc)}): the rank "
                f"with the coordinator role (rank 0 unless PARAMSYNC_ROLE says otherwise) "
                f"publishes it; or set {COORDINATOR_PORT_ENV} on every rank"
            ) from None
        text = bytes(raw).decode("ascii", errors="replace")
        return _port(text, f"torchrun store key {self.store_key}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
