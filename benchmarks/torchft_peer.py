"""torchft, the peer the benchmarks compare paramsync with: its lighthouse and its Manager.

torchft (PyPI ``torchft``, pinned in constraints.txt, installed by the ``bench`` extra) is a
benchmark-only dependency: neither ``runtime`` nor ``actors`` imports it. Every torchft import
here sits inside a function, so the drivers that only start processes import no torch.

The set-up follows torchft's own ``train_ddp.py`` example on the CPU: one replica group per
worker process (group world size 1), each with its own TCPStore, a `torchft.Manager` on a
`torchft.ProcessGroupGloo`, the model wrapped in `torchft.DistributedDataParallel` and the
optimizer in `torchft.Optimizer`, and a lighthouse (the ``torchft_lighthouse`` binary the
wheel ships) that forms each step's quorum.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Lighthouse",
    "available",
    "lighthouse_binary",
    "make_manager",
    "missing_reason",
    "start_lighthouse",
    "state_digest",
]

START_SECONDS = 60.0
"""How long the lighthouse may take to accept connections (on a loaded machine, seconds)."""


def available() -> bool:
    """Whether torchft is installed beside this Python (``pip install -e '.[bench]'``)."""
    return importlib.util.find_spec("torchft") is not None and lighthouse_binary() is not None


def missing_reason() -> str:
    """Why the torchft runs cannot start here, for a skip or an error message."""
    if importlib.util.find_spec("torchft") is None:
        return "torchft is not installed (pip install -c constraints.txt -e '.[bench]')"
    return "torchft is installed but its torchft_lighthouse binary is not found"


def lighthouse_binary() -> str | None:
    """The ``torchft_lighthouse`` executable installed beside this interpreter, or on PATH."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    if beside.is_file():
        return str(beside)
    return shutil.which("torchft_lighthouse")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Lighthouse:
    """A running lighthouse process and the address managers dial."""

    process: subprocess.Popen[bytes]
    address: str
    log: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def start_lighthouse(
    min_replicas: int,
    log: Path,
    *,
    join_timeout_ms: int = 1000,
    quorum_tick_ms: int = 100,
    heartbeat_timeout_ms: int = 5000,
) -> Lighthouse:
    """Start ``torchft_lighthouse`` on a free loopback port, its output to ``log``; returns
    once it accepts connections. ``heartbeat_timeout_ms`` is the lighthouse's default (how long
    a replica may go unheard before a quorum leaves it out)."""
    binary = lighthouse_binary()
    if binary is None:
        raise RuntimeError(missing_reason())
    if min_replicas < 1:
        raise ValueError(f"lighthouse: min_replicas must be at least 1, got {min_replicas}")
    port = _free_port()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                binary,
                "--min_replicas",
                str(min_replicas),
                "--bind",
                f"127.0.0.1:{port}",
                "--join_timeout_ms",
                str(join_timeout_ms),
                "--quorum_tick_ms",
                str(quorum_tick_ms),
                "--heartbeat_timeout_ms",
                str(heartbeat_timeout_ms),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + START_SECONDS
    while True:
        if process.poll() is not None:
            raise RuntimeError(
                f"torchft_lighthouse exited {process.returncode}: {log.read_text()[-2000:]}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise RuntimeError(
                    f"torchft_lighthouse did not listen on port {port} in {START_SECONDS:.0f} s: "
                    f"{log.read_text()[-2000:]}"
                ) from None
            time.sleep(0.05)
    return Lighthouse(process, f"http://127.0.0.1:{port}", log)


def make_manager(
    model: Any,
    optimizer: Any,
    *,
    replica: int,
    lighthouse: str,
    min_replica_size: int,
    timeout_seconds: float = 30.0,
    quorum_timeout_seconds: float = 60.0,
) -> tuple[Any, Any, Any, Any]:
    """torchft's data parallelism for one replica group of one process, as ``train_ddp.py``
    runs it on the CPU: (manager, the DDP-wrapped model, the wrapped optimizer, the group's
    TCPStore, which must live as long as the manager). The state a recovering replica receives
    is the model's and the optimizer's state dicts."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=timeout_seconds)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=min_replica_size,
        timeout=timedelta(seconds=timeout_seconds),
        quorum_timeout=timedelta(seconds=quorum_timeout_seconds),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"replica_{replica}",
        hostname="127.0.0.1",
        # Every replica starts from the same seeded weights, where torchft's documentation says
        # to turn the step-0 sync off. With it on, step 0 averages the sync source's gradient
        # with zeros from the replicas it syncs (they do not participate in that step).
        init_sync=False,
    )
    wrapped = DistributedDataParallel(manager, model)
    return manager, wrapped, Optimizer(manager, optimizer), store


def state_digest(model: Any, optimizer: Any) -> str:
    """SHA-256 over every parameter's and optimizer-state tensor's bytes, in a fixed order:
    equal digests mean bitwise-equal replicas."""
    import torch

    def _raw(tensor: torch.Tensor) -> bytes:
        return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(_raw(tensor))
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            if isinstance(value, torch.Tensor):
                digest.update(f"{index}/{key}".encode())
                digest.update(_raw(value))
    return digest.hexdigest()
