"""`CallerGate`: where the caller's own loop is (`paramsync.actors.train.ddp_wrapper`), so that a
new epoch's entry and the caller's thread never touch the model and optimizer at once.

A new epoch's entry (its state transfer, buffer synchronization and opening check) touches the
model and optimizer, which the caller's thread also touches between its crossings into the
event loop. The entry waits until that thread is parked in a crossing (`parked`), and a
crossing (`crossing`) does not hand the state back while an entry runs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

__all__ = ["CallerGate"]


@dataclass
class CallerGate:
    """The caller's own loop's place, as the epoch supervisor and the crossings see it."""

    applies: bool = False
    """The caller steps its optimizer itself: a step every member was told to apply is
    applied by the caller when the epoch ends under it, not by the trainer."""
    must_apply: int | None = None
    """A step every member was told to apply when its epoch ended: the caller applies it
    before the next epoch may enter."""
    outside: bool = True
    """The caller's thread runs its own code (not inside a crossing)."""
    changed: trio.Event = field(default_factory=trio.Event)
    """Set (and replaced) whenever the caller enters or leaves a crossing."""
    entering: bool = False
    entered: trio.Event = field(default_factory=trio.Event)
    gone: bool = False
    """The caller's loop is over (the trainer is finishing): nothing to wait for."""

    def left(self) -> None:
        """The caller's loop is over: epochs enter without waiting for it."""
        self.gone = True
        self.changed.set()

    async def crossing(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``await fn(*args)`` for the caller's thread, which is parked meanwhile: a new
        epoch may enter; the result is handed back only once no entry is running."""
        self.outside = False
        self.changed.set()
        try:
            return await fn(*args)
        finally:
            with trio.CancelScope(shield=True):
                while self.entering:
                    await self.entered.wait()
            self.outside = True
            self.changed.set()

    async def parked(self) -> None:
        """Before a new epoch's entry: wait until the caller's thread is parked in a crossing
        (or its loop is over), and keep it there until `released`."""
        while not self.gone and (self.outside or self.must_apply is not None):
            self.changed = trio.Event()
            await self.changed.wait()
        # No await since the check: the caller is still parked, and stays so until released.
        self.entering, self.entered = True, trio.Event()

    def released(self) -> None:
        """The entry is over: the crossing may hand the state back."""
        if self.entering:
            self.entering = False
            self.entered.set()
