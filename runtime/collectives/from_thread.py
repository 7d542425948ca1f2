"""Collectives called from a compute thread: the synchronous bridge to the trio collectives.

The engine's collectives (`paramsync.runtime.collectives.ring`) are trio async functions over a
`Transport` (a `ProcessGroup` is one). Autograd runs synchronously, on a worker thread that the
trio side started with ``trio.to_thread.run_sync``; a tensor-parallel layer's forward or backward
needs an all-reduce in the middle of that synchronous code. `ThreadCollectives` holds the group
and the trio token of the run that owns it and calls ``trio.from_thread.run(all_reduce, group,
tensor)``: the calling thread blocks while the collective runs as a trio task, and its errors
(a peer gone, a cancelled run) are raised in the thread.

`SyncCollectives` is the interface layers program against. A test that counts the collectives a
layer issues wraps a `ThreadCollectives` in an object with the same methods (it never patches the
collectives). A group of one never enters trio: its collectives are the identity, so a
tensor-parallel layer at tp=1 costs nothing and needs no trio run.

Why here and not in `paramsync.runtime.parallel`: the bridge knows transports and collectives only
(no model, no parallelism plan), any thread-side code can use it (tensor-parallel layers, gradient
clipping, a pipeline stage's compute thread), and `paramsync.runtime.parallel` sits above this
layer.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import trio

from paramsync.runtime.collectives.ring import ReduceOp, all_gather, all_reduce, broadcast
from paramsync.runtime.errors import CollectiveError
from paramsync.runtime.transport.base import Transport

__all__ = ["SyncCollectives", "ThreadCollectives"]


@runtime_checkable
class SyncCollectives(Protocol):
    """Blocking collectives over one group, as a compute thread calls them.

    ``rank`` and ``world_size`` are the group's. Every member calls the same collectives in the
    same order (as for the async collectives).
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over the group in place and return it."""
        ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every member's ``tensor`` stacked: shape ``(world_size, *tensor.shape)``."""
        ...

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Copy ``root``'s tensor into ``tensor`` on every member, in place, and return it."""
        ...


class ThreadCollectives:
    """`SyncCollectives` over a trio `Transport` (a `ProcessGroup`), for a worker thread.

    Build it on the trio side (``ThreadCollectives(group)`` inside the run: it captures the
    current trio token) and hand it to code that runs in ``trio.to_thread.run_sync``. Calling it
    from the trio thread itself is a `CollectiveError` (it would block the loop that must run
    the collective). ``chunk_bytes`` and the other collective options are not exposed: the ring's
    defaults apply.
    """

    def __init__(self, group: Transport, trio_token: trio.lowlevel.TrioToken | None = None) -> None:
        if not isinstance(group, Transport):
            raise CollectiveError(
                f"ThreadCollectives needs a Transport or ProcessGroup, got {type(group).__name__}"
            )
        if trio_token is None and group.world_size > 1:
            try:
                trio_token = trio.lowlevel.current_trio_token()
            except RuntimeError:
                raise CollectiveError(
                    "ThreadCollectives must be created inside the trio run that owns its group "
                    "(or be given that run's trio_token)"
                ) from None
        self.group = group
        self.trio_token = trio_token

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        if self.group.world_size == 1:
            return tensor
        return self._run(all_reduce, tensor, op)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return tensor.unsqueeze(0).clone()
        return self._run(all_gather, tensor)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        if self.group.world_size == 1:
            if root != 0:
                raise CollectiveError(f"broadcast root {root!r} is not a rank of a group of 1")
            return tensor
        return self._run(broadcast, tensor, root)

    def _run(self, collective: object, *args: object) -> torch.Tensor:
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            pass  # not on the trio thread: the expected case
        else:
            raise CollectiveError(
                f"{getattr(collective, '__name__', collective)} over {self.group!r} was called "
                "on the trio thread; call ThreadCollectives from a trio.to_thread worker thread"
            )
        try:
            trio.from_thread.check_cancelled()  # a trio worker thread: raises if cancelled
        except RuntimeError:
            # A thread trio did not start: enter through the token, as a system task.
            if self.trio_token is None:
                raise CollectiveError(
                    f"{self!r} was called from a thread trio did not start and holds no trio "
                    "token: create it inside the trio run"
                ) from None
            token: trio.lowlevel.TrioToken | None = self.trio_token
        else:
            # A trio.to_thread worker: run as part of its host task, so cancelling the run
            # (a deadline, a failed peer) cancels the collective and raises here.
            token = None
        result: torch.Tensor = trio.from_thread.run(
            collective,  # type: ignore[arg-type]
            self.group,
            *args,
            trio_token=token,
        )
        return result

    def __repr__(self) -> str:
        return f"ThreadCollectives({self.group!r})"
