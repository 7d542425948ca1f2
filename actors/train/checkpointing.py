"""Periodic checkpoints of committed states only.

A state captured after step s is offered to `CommittedCheckpoints` right away (training goes on),
but written only once step s is committed, i.e. every rank's digest of it agreed
(``wait_commit(s)``; the state's ``step`` is s + 1). A state whose check never commits (the run
aborts for divergence first) never reaches the disk, so ``--resume`` cannot restart from it; each
written checkpoint records ``committed=True`` and its store's run id (security review rows 7, 8).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import trio

from actors.state.checkpoint import CheckpointStore
from actors.state.training_state import TrainingState

__all__ = ["CommittedCheckpoints"]

log = logging.getLogger("paramsync.checkpoint")

MAX_PENDING = 4
"""States waiting for their commit; an older one is dropped for a newer beyond this."""


class CommittedCheckpoints:
    """Writes offered states to ``store`` once ``wait_commit`` says their step is committed.

    Run `run` in a nursery; `offer` from synchronous code (e.g. a per-step callback); `flush`
    waits until every offered state is written (it waits on the commits too).
    """

    def __init__(
        self, store: CheckpointStore, wait_commit: Callable[[int], Awaitable[None]]
    ) -> None:
        self.store = store
        self._wait_commit = wait_commit
        self._pending: deque[TrainingState] = deque()
        self._offered = trio.Event()
        self._changed = trio.Event()
        self.written: list[Path] = []
        self.newest_written = -1
        """The step of the newest state written so far (-1: none)."""

    def offer(self, state: TrainingState) -> None:
        """Queue ``state`` (the state after step ``state.step - 1``) for writing once that step
        commits."""
        if len(self._pending) >= MAX_PENDING:
            dropped = self._pending.popleft()
            log.warning("checkpoint of step %d dropped: its commit is late", dropped.step)
        self._pending.append(state)
        self._offered.set()

    async def run(self) -> None:
        """Write each offered state after its commit, in order; runs until cancelled."""
        while True:
            while not self._pending:
                self._offered = trio.Event()
                await self._offered.wait()
            state = self._pending[0]
            await self._wait_commit(state.step - 1)
            path = await trio.to_thread.run_sync(partial(self.store.save, state, committed=True))
            if self._pending and self._pending[0] is state:
                self._pending.popleft()
            self.written.append(path)
            self.newest_written = max(self.newest_written, state.step)
            log.info("wrote the committed checkpoint %s", path)
            self._changed.set()
            self._changed = trio.Event()

    async def wait_written(self, step: int) -> None:
        """Wait until a state of ``step`` or later has been written."""
        while self.newest_written < step:
            await self._changed.wait()

    async def flush(self) -> None:
        """Wait until every state offered so far is written."""
        if self._pending:
            await self.wait_written(self._pending[-1].step)
