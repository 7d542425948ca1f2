"""Periodic checkpoints of committed states only.

A state captured after step s is offered to `CommittedCheckpoints` right away (training goes on),
but written only once step s is committed, i.e. every rank's digest of it agreed
(``wait_commit(s)``; the state's ``step`` is s + 1). A state whose check never commits (the run
aborts for divergence first) never reaches the disk, so ``--resume`` cannot restart from it; each
written checkpoint records ``committed=True`` and its store's run id (security review rows 7, 8).
Nor does a state that a peer's replaced before the commit (a restarted coordinator's donor, a
re-sync: ``replaced`` counts them): the commit that follows checked the peer's state, not this
one, which may be the very state the donor rule rolled back.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import trio

from paramsync.actors.state.checkpoint import CheckpointStore
from paramsync.actors.state.training_state import TrainingState

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
        self,
        store: CheckpointStore,
        wait_commit: Callable[[int], Awaitable[None]],
        *,
        replaced: Callable[[], int] | None = None,
    ) -> None:
        self.store = store
        self._wait_commit = wait_commit
        self._replaced = replaced
        """How many times a peer's state replaced the worker's so far (e.g. the trainer's
        ``states_received``); None: never."""
        self._pending: deque[tuple[TrainingState, int]] = deque()
        """Offered states waiting for their commit, each with ``replaced()`` at its offer."""
        self._offered = trio.Event()
        self._changed = trio.Event()
        self.written: list[Path] = []
        self.newest_written = -1
        """The step of the newest state written so far (-1: none)."""

    def _replacements(self) -> int:
        return self._replaced() if self._replaced is not None else 0

    def offer(self, state: TrainingState) -> None:
        """Queue ``state`` (the state after step ``state.step - 1``) for writing once that step
        commits."""
        if len(self._pending) >= MAX_PENDING:
            dropped, _ = self._pending.popleft()
            log.warning("checkpoint of step %d dropped: its commit is late", dropped.step)
        self._pending.append((state, self._replacements()))
        self._offered.set()

    async def run(self) -> None:
        """Write each offered state after its commit, in order; runs until cancelled."""
        while True:
            while not self._pending:
                self._offered = trio.Event()
                await self._offered.wait()
            entry = self._pending[0]
            state, offered_at = entry
            await self._wait_commit(state.step - 1)
            if self._replacements() != offered_at:
                log.warning(
                    "checkpoint of step %d dropped: a peer's state replaced it before the commit",
                    state.step,
                )
            else:
                save = partial(self.store.save, state, committed=True)
                path = await trio.to_thread.run_sync(save)
                self.written.append(path)
                self.newest_written = max(self.newest_written, state.step)
                log.info("wrote the committed checkpoint %s", path)
            if self._pending and self._pending[0] is entry:
                self._pending.popleft()
            self._changed.set()
            self._changed = trio.Event()

    async def wait_written(self, step: int) -> None:
        """Wait until a state of ``step`` or later has been written."""
        while self.newest_written < step:
            await self._changed.wait()

    async def flush(self) -> None:
        """Wait until every state offered so far is written (or dropped: replaced before
        its commit, or pushed out by newer offers)."""
        if not self._pending:
            return
        last = self._pending[-1]
        while any(entry is last for entry in self._pending):
            await self._changed.wait()
