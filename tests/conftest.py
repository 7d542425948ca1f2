"""Shared helpers for the wire, transport, handshake and collective tests.

Nothing here is a fixture with side effects: tests import the helpers they need
(``from conftest import ...``). Groups of ranks run as tasks of one trio nursery, over either
transport, always under a deadline so that a hang is a failure rather than a stuck run.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import torch
import trio

from paramsync.runtime.transport.base import InProcessTransport, Transport
from paramsync.runtime.transport.tcp import TcpTransport
from paramsync.runtime.transport.torch_plane import open_local_group

TRANSPORT_KINDS = ("inproc", "tcp")
"""Both transports every group test runs over."""

GROUP_KINDS = (*TRANSPORT_KINDS, "torch")
"""The worlds the process-group tests (groups, mesh, point-to-point) run over: both transports
and torch's data plane (a gloo group in this process, `paramsync.runtime.transport.torch_plane`)."""

GROUP_SECONDS = 60.0
"""Deadline for one whole group run: far beyond any healthy run on a 2-core machine."""


@asynccontextmanager
async def open_group(kind: str, n: int) -> AsyncIterator[list[Transport]]:
    """``n`` connected transports of the given kind, closed on exit."""
    if kind == "inproc":
        transports: list[Transport] = list(InProcessTransport.create_group(n))
        try:
            yield transports
        finally:
            with trio.CancelScope(shield=True):
                for transport in transports:
                    await transport.aclose()
    elif kind == "tcp":
        async with TcpTransport.open_group(n) as tcp_transports:
            yield list(tcp_transports)
    elif kind == "torch":
        async with open_local_group(n) as torch_transports:
            yield list(torch_transports)
    else:  # pragma: no cover - a typo in a test
        raise ValueError(f"unknown transport kind {kind!r}")


async def run_ranks(
    transports: Sequence[Transport],
    fn: Callable[[Transport], Awaitable[Any]],
    *,
    seconds: float = GROUP_SECONDS,
) -> list[Any]:
    """Run ``fn(transport)`` for every rank concurrently; return the results by rank."""
    results: list[Any] = [None] * len(transports)

    async def one(transport: Transport) -> None:
        results[transport.rank] = await fn(transport)

    with trio.fail_after(seconds):
        async with trio.open_nursery() as nursery:
            for transport in transports:
                nursery.start_soon(one, transport)
    return results


async def run_ranks_capture(
    transports: Sequence[Transport],
    fn: Callable[[Transport], Awaitable[Any]],
    *,
    seconds: float = 20.0,
) -> list[Any]:
    """Like run_ranks, but a rank's exception becomes its result, and a rank that fails closes
    its transport (as a crashing process would), so ranks still waiting on it fail too."""
    results: list[Any] = [None] * len(transports)

    async def one(transport: Transport) -> None:
        try:
            results[transport.rank] = await fn(transport)
        except Exception as exc:
            results[transport.rank] = exc
            with trio.CancelScope(shield=True):
                await transport.aclose()

    with trio.fail_after(seconds):
        async with trio.open_nursery() as nursery:
            for transport in transports:
                nursery.start_soon(one, transport)
    return results


def run_in_group(
    kind: str,
    n: int,
    fn: Callable[[Transport], Awaitable[Any]],
    *,
    seconds: float = GROUP_SECONDS,
) -> list[Any]:
    """Synchronous entry point: open a group of ``n``, run ``fn`` on every rank, close it."""

    async def main() -> list[Any]:
        with trio.fail_after(seconds):
            async with open_group(kind, n) as transports:
                return await run_ranks(transports, fn, seconds=seconds)

    return trio.run(main)


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (works for 0-d tensors and every dtype)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same shape and the very same bytes (NaN payloads and -0.0 included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw_bytes(a), raw_bytes(b))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
