"""An in-process run with a real coordinator: one `Coordinator` served over memory links, a
world of in-process transports, and one task per worker; each worker's result or exception.

Shared by the tests that drive workers by hand against the coordinator
(tests/test_layouts_in_process.py, tests/test_trainer3d_coordinator.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from paramsync.runtime.coordinator.service import Coordinator, RunFailed
from paramsync.runtime.transport.base import InProcessTransport, Transport
from paramsync.runtime.transport.link import MemoryLink

Worker = Callable[[int, MemoryLink, Transport], Awaitable[Any]]


async def run_with_coordinator(
    world_size: int, worker: Worker, seconds: float
) -> tuple[dict[str, Any], Coordinator]:
    """Serve a coordinator for ``world_size`` workers and run ``worker(rank, link, world)`` for
    each rank; ``outcome["rank R"]`` is its result or exception, ``outcome["coordinator"]``
    None or the `RunFailed` it ended with."""
    coordinator = Coordinator(world_size)
    pairs = [MemoryLink.pair("coordinator", f"rank {rank}") for rank in range(world_size)]
    worlds = InProcessTransport.create_group(world_size)
    outcome: dict[str, Any] = {}

    async def one(rank: int) -> None:
        try:
            outcome[f"rank {rank}"] = await worker(rank, pairs[rank][1], worlds[rank])
        except BaseException as exc:  # an abort arrives as a group (client task and loop)
            if isinstance(exc, trio.Cancelled):
                raise
            outcome[f"rank {rank}"] = exc
        finally:
            with trio.CancelScope(shield=True):
                await pairs[rank][1].aclose()
                await worlds[rank].aclose()

    async def serve() -> None:
        try:
            await coordinator.serve_links({rank: pair[0] for rank, pair in enumerate(pairs)})
            outcome["coordinator"] = None
        except RunFailed as exc:
            outcome["coordinator"] = exc

    with trio.fail_after(seconds):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            for rank in range(world_size):
                nursery.start_soon(one, rank)
    return outcome, coordinator
