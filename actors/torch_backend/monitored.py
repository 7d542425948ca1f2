"""``monitored_barrier`` on a paramsync group, with gloo's semantics and messages.

``torch.distributed.monitored_barrier`` is gloo's debugging barrier: rank 0 waits, within the
timeout, for every other rank to arrive and names those that did not; the others wait for
rank 0's answer. torch runs it for gloo groups only (it checks the backend's name); `install`
lets it through for paramsync groups too (every other group goes to torch's own function, as
before), and `ProcessGroupParamsync.monitored_barrier` runs `monitored_barrier_op`:

* every rank but 0 sends rank 0 a token on the group's point-to-point mesh, then waits for
  rank 0's answer within the timeout, else fails with gloo's "Rank r successfully reached
  monitoredBarrier, but received errors while waiting for send/recv from rank 0";
* rank 0 waits for every token at once, until the timeout; when all arrived it answers each
  rank, else it fails naming the first rank that did not arrive ("Rank 1 failed to pass
  monitoredBarrier in 2000 ms"), or all of them with ``wait_all_ranks`` ("Ranks 1, 2 failed
  ..."), and answers nobody (the arrived ranks fail as above).

It needs no agreement from the coordinator (its point is ranks that never call), runs after
the calls the rank made before it, and its verdict fails only the call (`MonitoredBarrierError`):
the group goes on, as gloo's does. Its tokens carry the tag `MONITOR_TAG`, which no torch call
uses; a rank that reaches the barrier after rank 0 gave up leaves its token on its link to rank
0, and the next point-to-point message rank 0 receives from it is refused, naming that tag.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import trio

from paramsync.runtime.collectives.p2p import MAX_TAG
from paramsync.runtime.collectives.p2p import recv as p2p_recv
from paramsync.runtime.collectives.p2p import send as p2p_send
from paramsync.runtime.errors import ParamsyncError
from paramsync.runtime.transport.base import Transport

__all__ = ["MONITOR_TAG", "MonitoredBarrierError", "monitored_barrier_op", "install", "seconds_of"]

MONITOR_TAG = MAX_TAG
"""The point-to-point tag of the barrier's tokens."""


class MonitoredBarrierError(ParamsyncError, RuntimeError):
    """A monitored barrier some ranks did not pass in time (the message names them, in gloo's
    words); the group stays usable."""


def seconds_of(timeout: Any) -> float:
    """``timeout`` (a timedelta or a number of seconds) in seconds, at least 0."""
    if isinstance(timeout, timedelta):
        return max(0.0, timeout.total_seconds())
    value = float(timeout)
    if math.isnan(value):
        raise ValueError("monitored_barrier: timeout is NaN")
    return max(0.0, value)


def _token() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64)


async def monitored_barrier_op(
    group: Transport, seconds: float, wait_all_ranks: bool, where: str
) -> None:
    """One rank's part of the barrier on ``group`` (its point-to-point mesh); ``where`` prefixes
    the error (the group and rank)."""
    me, size = group.rank, group.world_size
    millis = round(seconds * 1000)
    if me != 0:
        with trio.move_on_after(seconds):
            await p2p_send(group, _token(), 0, MONITOR_TAG)
            await p2p_recv(group, _token(), 0, MONITOR_TAG)
            return
        raise MonitoredBarrierError(
            f"{where}: Rank {me} successfully reached monitoredBarrier, but received errors "
            f"while waiting for send/recv from rank 0 (no answer within {millis} ms). Please "
            "check rank 0 logs for faulty rank."
        )
    arrived: set[int] = set()

    async def wait_for(rank: int) -> None:
        await p2p_recv(group, _token(), rank, MONITOR_TAG)
        arrived.add(rank)

    if seconds > 0:
        with trio.move_on_after(seconds):
            async with trio.open_nursery() as nursery:
                for rank in range(1, size):
                    nursery.start_soon(wait_for, rank)
    missing = [rank for rank in range(1, size) if rank not in arrived]
    if missing and seconds == 0:
        raise MonitoredBarrierError(
            f"{where}: Rank 0 timed out in monitoredBarrier after {millis} ms (ranks "
            f"{', '.join(map(str, missing))} had not arrived)"
        )
    if missing and wait_all_ranks:
        raise MonitoredBarrierError(
            f"{where}: Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier "
            f"in {millis} ms"
        )
    if missing:
        raise MonitoredBarrierError(
            f"{where}: Rank {missing[0]} failed to pass monitoredBarrier in {millis} ms"
        )
    for rank in range(1, size):
        await p2p_send(group, _token(), rank, MONITOR_TAG)


def install(is_paramsync: Callable[[Any], bool]) -> None:
    """Let ``torch.distributed.monitored_barrier`` run on the groups ``is_paramsync`` accepts
    (their ``monitored_barrier`` method); any other group goes to torch's own function."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.monitored_barrier
    if getattr(original, "__paramsync_original__", None) is not None:
        return

    @functools.wraps(original)
    def monitored_barrier(
        group: Any = None, timeout: Any = None, wait_all_ranks: bool = False
    ) -> Any:
        member = not c10d._rank_not_in_group(group)
        pg: Any = c10d._get_default_group() if group is None and member else group
        if member and is_paramsync(pg):  # None: the group's own timeout
            return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
        return original(group, timeout, wait_all_ranks)

    monitored_barrier.__paramsync_original__ = original  # type: ignore[attr-defined]
    c10d.monitored_barrier = monitored_barrier
    dist.monitored_barrier = monitored_barrier
