"""The actor base: a bounded mailbox, typed messages, request/reply, a clear lifecycle.

An `Actor` owns a trio memory channel of ``mailbox_size`` slots. `Actor.tell` blocks while the
mailbox is full (backpressure: a mailbox never grows past its bound) and `Actor.ask` also waits
for the value `Actor.handle` returns. Actors run as tasks of an `ActorSystem`, which owns a trio
nursery:

    async with ActorSystem() as system:
        worker = await system.start(Worker("worker"))
        reply = await worker.ask(Job(...))
    # leaving the block normally stops every actor gracefully (mailboxes drain)

Failure is structured: if ``on_start``, ``handle`` or ``on_stop`` raises, the actor goes
`ActorState.FAILED`, closes its mailbox (blocked senders raise `ActorStopped` rather than wait
forever), fails the ask it was serving and the asks still queued, and cancels the whole system.
The ``async with`` then raises `ActorFailed` naming the actor, with the handler's exception as
``__cause__``. Never a hang, never a silent death.

Lifecycle::

    CREATED --on_start--> RUNNING --stop()--> STOPPING --drain, on_stop--> STOPPED
        any step raises --> FAILED;  cancelled (a sibling failed, the body raised) --> STOPPED
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import ClassVar, TypeVar

import trio

from paramsync.runtime.errors import ActorFailed, ParamsyncError

__all__ = ["Actor", "ActorState", "ActorStopped", "ActorSystem", "run_in_thread"]

A = TypeVar("A", bound="Actor")
R = TypeVar("R")


class _OneThreadEach:
    """A thread "limiter" for `run_in_thread` that never waits: an actor handles one message at
    a time, so it never has more than one thread of its own running. Unlike trio's default
    `trio.CapacityLimiter`, acquiring it is no schedule point (a cancelled caller still raises
    here): the crossing costs the caller one task step fewer."""

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()

    def release_on_behalf_of(self, borrower: object) -> None:
        pass


_ONE_THREAD_EACH = _OneThreadEach()


async def run_in_thread(fn: Callable[..., R], *args: object) -> R:
    """``trio.to_thread.run_sync(fn, *args)`` for an actor's blocking work (forward and
    backward, an optimizer step, a digest): the same thread cache, context, cancellation
    (none until ``fn`` returns) and ``trio.from_thread`` support, without the default thread
    limiter's extra schedule point before the thread starts. Only for work an actor's own
    task runs (at most one thread at a time per actor)."""
    return await trio.to_thread.run_sync(fn, *args, limiter=_ONE_THREAD_EACH)  # type: ignore[arg-type]


class ActorState(enum.Enum):
    """Where an actor is in its life; see the module docstring for the transitions."""

    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class ActorStopped(ParamsyncError):
    """A message was sent to an actor whose mailbox is closed (stopping, stopped or failed).

    Also raised for asks that were still queued when the actor failed or was cancelled:
    the message was never handled. ``state`` is the actor's state when the error was made.
    """

    def __init__(self, actor: str, state: ActorState) -> None:
        self.actor = actor
        self.state = state
        super().__init__(f"actor {actor!r} is {state.value}: its mailbox is closed")


class _Reply:
    """A one-shot slot for the answer to an `Actor.ask`."""

    __slots__ = ("abandoned", "done", "error", "value")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: object = None
        self.error: BaseException | None = None
        self.abandoned = False  # the asker stopped waiting (cancelled)

    def resolve(self, value: object = None, error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.value, self.error = value, error
            self.done.set()


class _Envelope:
    __slots__ = ("message", "reply")

    def __init__(self, message: object, reply: _Reply | None) -> None:
        self.message = message
        self.reply = reply


class Actor:
    """Base class of every actor: subclass, set `accepts`, implement `handle`.

    ``accepts`` lists the message types this actor takes; `tell` and `ask` raise `TypeError`
    at the sender for anything else, so a wrong message fails where it was sent, not later
    inside the actor. Messages are handled one at a time, in arrival order.

    ``on_start`` runs before the first message; ``on_stop`` runs after a graceful stop has
    drained the mailbox. Neither runs again, and ``on_stop`` does not run when the actor
    failed or was cancelled: put cleanup that must always happen in ``try/finally``.

    Messages may be told before the actor is spawned (they wait in the mailbox), but an actor
    that is never spawned never answers: spawn it, or `stop` it to fail the waiting asks.
    """

    accepts: ClassVar[tuple[type, ...]] = ()

    def __init__(self, name: str, mailbox_size: int = 16) -> None:
        if not self.accepts:
            raise TypeError(f"{type(self).__name__}.accepts must name at least one message type")
        if mailbox_size < 1:
            raise ValueError(f"mailbox_size must be >= 1, got {mailbox_size}")
        self.name = name
        self.mailbox_size = mailbox_size
        self._send, self._receive = trio.open_memory_channel[_Envelope](mailbox_size)
        self._state = ActorState.CREATED
        self._system: ActorSystem | None = None
        self._task: trio.lowlevel.Task | None = None
        self._started = trio.Event()  # set after on_start, or when the actor ends first
        self._done = trio.Event()  # set when the actor task has ended, whatever the way
        self._failure: ActorFailed | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self._state.value}>"

    # -- to override ------------------------------------------------------------------------

    async def on_start(self) -> None:
        """Run once before the first message (open resources, connect). Raising fails it."""

    async def handle(self, message: object) -> object | None:
        """Handle one message; the return value is the reply to an `ask` (ignored for tell)."""
        raise NotImplementedError(f"{type(self).__name__} must implement handle()")

    async def on_stop(self) -> None:
        """Run once after a graceful stop drained the mailbox. Not run on failure or cancel."""

    # -- public API -------------------------------------------------------------------------

    @property
    def state(self) -> ActorState:
        """The current lifecycle state."""
        return self._state

    @property
    def queued(self) -> int:
        """Messages waiting in the mailbox now (never more than ``mailbox_size``)."""
        return self._send.statistics().current_buffer_used

    async def tell(self, message: object) -> None:
        """Queue ``message``; wait while the mailbox is full (backpressure).

        Raises `TypeError` if the actor does not accept the message's type and `ActorStopped`
        if the mailbox is closed, including when it closes while this call waits.
        """
        self._check_type(message)
        await self._post(_Envelope(message, None))

    def tell_nowait(self, message: object) -> None:
        """Queue ``message`` without waiting, for callers that cannot (a callback that trio runs
        with ``run_sync_soon``). Raises `trio.WouldBlock` if the mailbox is full, `TypeError`
        and `ActorStopped` as `tell` does."""
        self._check_type(message)
        try:
            self._send.send_nowait(_Envelope(message, None))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise ActorStopped(self.name, self._state) from None

    async def ask(self, message: object) -> object | None:
        """Send ``message`` and return what `handle` returns for it.

        If `handle` raises on it, this raises `ActorFailed` (cause: the handler's exception)
        and the actor fails. If the actor ends before handling it, this raises `ActorStopped`.
        For a deadline, wrap the call in ``trio.fail_after``/``move_on_after``: a cancelled ask
        whose message is still queued is dropped unhandled; one already being handled runs to
        completion and its reply is discarded. Either way the actor stays usable.
        """
        self._check_type(message)
        if self._task is not None and trio.lowlevel.current_task() is self._task:
            raise RuntimeError(f"actor {self.name!r} cannot ask itself: it would deadlock")
        reply = _Reply()
        await self._post(_Envelope(message, reply), schedule=False)
        if not reply.done.is_set():  # a reply that is already there wins over a cancel
            try:
                await reply.done.wait()
            except BaseException:
                reply.abandoned = True
                raise
        if reply.error is not None:
            raise reply.error
        return reply.value

    async def stop(self) -> None:
        """Stop gracefully: refuse new messages, handle the queued ones, run ``on_stop``.

        Waits until the actor has ended; raises `ActorFailed` if it failed. Idempotent. Called
        from the actor's own ``handle`` it only requests the stop (it cannot wait for itself).
        """
        self._close_mailbox()
        if self._system is None:  # never spawned: nothing will drain the mailbox
            if self._state is not ActorState.FAILED:
                self._state = ActorState.STOPPED
            self._shutdown()
            self._done.set()
        elif trio.lowlevel.current_task() is self._task:
            return
        await self._done.wait()
        if self._failure is not None:
            cause = self._failure.__cause__
            assert cause is not None
            raise ActorFailed(self.name, cause) from cause

    # -- internals --------------------------------------------------------------------------

    def _check_type(self, message: object) -> None:
        if not isinstance(message, self.accepts):
            names = ", ".join(t.__qualname__ for t in self.accepts)
            raise TypeError(
                f"actor {self.name!r} does not accept {type(message).__qualname__} "
                f"(accepts: {names})"
            )

    async def _post(self, envelope: _Envelope, *, schedule: bool = True) -> None:
        """Queue ``envelope``, waiting while the mailbox is full. ``schedule=False`` (an ask,
        whose wait for the reply is the schedule point): a mailbox with room takes it without
        a task switch (a cancelled caller still raises here)."""
        try:
            if not schedule and self._task is not trio.lowlevel.current_task():
                await trio.lowlevel.checkpoint_if_cancelled()
                try:
                    self._send.send_nowait(envelope)
                    return
                except trio.WouldBlock:
                    pass
            if self._task is not None and trio.lowlevel.current_task() is self._task:
                try:  # an actor telling itself must not wait on its own mailbox
                    self._send.send_nowait(envelope)
                except trio.WouldBlock:
                    raise RuntimeError(
                        f"actor {self.name!r} told itself with a full mailbox: it would deadlock"
                    ) from None
                await trio.lowlevel.checkpoint()
            else:
                await self._send.send(envelope)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise ActorStopped(self.name, self._state) from None

    def _close_mailbox(self) -> None:
        """Refuse new messages; what is queued still drains."""
        if self._state in (ActorState.CREATED, ActorState.RUNNING):
            self._state = ActorState.STOPPING
        self._send.close()

    def _shutdown(self) -> None:
        """Close the mailbox for good and fail every ask still queued in it (no hang)."""
        self._send.close()
        while True:
            try:
                envelope = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            if envelope.reply is not None:
                envelope.reply.resolve(error=ActorStopped(self.name, self._state))
        self._receive.close()

    async def _run(self, system: ActorSystem) -> None:
        """The actor's task: on_start, the message loop, on_stop; failures go to ``system``."""
        self._task = trio.lowlevel.current_task()
        current: _Envelope | None = None
        try:
            await self.on_start()
            if self._state is ActorState.CREATED:
                self._state = ActorState.RUNNING
            self._started.set()
            async for envelope in self._receive:
                if envelope.reply is not None and envelope.reply.abandoned:
                    continue
                current = envelope
                result = await self.handle(envelope.message)
                if envelope.reply is not None:
                    envelope.reply.resolve(result)
                current = None
            self._state = ActorState.STOPPING
            await self.on_stop()
            self._state = ActorState.STOPPED
        except Exception as exc:
            failure = ActorFailed(self.name, exc)
            failure.__cause__ = exc
            self._failure = failure
            self._state = ActorState.FAILED
            if current is not None and current.reply is not None:
                error = ActorFailed(self.name, exc)
                error.__cause__ = exc
                current.reply.resolve(error=error)
            self._shutdown()
            system._actor_failed(failure)
        except BaseException:  # cancelled (or KeyboardInterrupt): end now, no on_stop
            if self._state is not ActorState.FAILED:
                self._state = ActorState.STOPPED
            self._shutdown()
            raise
        finally:
            self._started.set()
            self._done.set()


class ActorSystem:
    """Owns a trio nursery in which actors run; use as ``async with ActorSystem() as s:``.

    Exit rules, deterministic:

    * body ends normally: actors are stopped gracefully one at a time in reverse spawn order
      (an actor may rely on the ones spawned before it), each draining its mailbox;
    * an actor fails: the system is cancelled and the ``async with`` raises `ActorFailed` for
      the *first* actor that failed. Later failures, and errors the body raised after it
      (an ``ask`` that got `ActorFailed`, say), are suppressed; the first failure wins;
    * the body raises before any actor failed: actors are cancelled and the body's exception
      propagates unchanged (failures caused by that cancellation are suppressed);
    * an outer cancel scope fires (a deadline): actors are cancelled and the cancellation
      propagates, unless an actor failed, which then wins (errors beat cancellation).

    A cancelled actor ends at once in `ActorState.STOPPED` without ``on_stop``.
    """

    def __init__(self) -> None:
        self._nursery_manager: AbstractAsyncContextManager[trio.Nursery] | None = None
        self._nursery: trio.Nursery | None = None
        self._actors: list[Actor] = []
        self._failure: ActorFailed | None = None
        self._closed = False

    @property
    def actors(self) -> tuple[Actor, ...]:
        """Every actor spawned in this system, in spawn order."""
        return tuple(self._actors)

    async def __aenter__(self) -> ActorSystem:
        if self._nursery_manager is not None:
            raise RuntimeError("an ActorSystem can be entered only once")
        self._nursery_manager = trio.open_nursery()
        self._nursery = await self._nursery_manager.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        assert self._nursery_manager is not None
        failed_first = self._failure is not None
        body_exc = exc
        if exc is None:
            try:
                await self._stop_all()
            except BaseException as stop_exc:  # cancelled because an actor failed
                exc_type, exc, tb = type(stop_exc), stop_exc, stop_exc.__traceback__
        try:
            suppressed = await self._nursery_manager.__aexit__(exc_type, exc, tb)
        except BaseException as raised:
            leaves = _leaves(raised)
            if any(leaf is not exc and not isinstance(leaf, trio.Cancelled) for leaf in leaves):
                raise  # a BaseException of an actor task (KeyboardInterrupt...): as trio raised it
            if not self._actor_wins(failed_first, body_exc) and (
                body_exc is None or all(leaf is not body_exc for leaf in leaves)
            ):
                raise  # only cancellations from an outer scope
            suppressed = False  # the body's exception propagates unchanged, or see below
        finally:
            self._closed = True
        if self._actor_wins(failed_first, body_exc):
            assert self._failure is not None
            raise self._failure from self._failure.__cause__
        return bool(suppressed)

    def spawn(self, actor: A) -> A:
        """Start ``actor`` in this system without waiting for ``on_start``; return it."""
        if self._nursery is None or self._closed:
            raise RuntimeError("spawn() needs an open ActorSystem (inside its async with)")
        if actor._system is not None or actor._state is not ActorState.CREATED:
            raise RuntimeError(f"actor {actor.name!r} was already spawned or stopped")
        actor._system = self
        self._actors.append(actor)
        self._nursery.start_soon(actor._run, self, name=f"actor:{actor.name}")
        return actor

    async def start(self, actor: A) -> A:
        """Spawn ``actor`` and return once its ``on_start`` completed.

        Raises `ActorFailed` if ``on_start`` raised (inside the system, the system's
        cancellation usually arrives first and the ``async with`` raises it instead).
        """
        self.spawn(actor)
        await actor._started.wait()
        if actor._failure is not None:
            cause = actor._failure.__cause__
            assert cause is not None
            raise ActorFailed(actor.name, cause) from cause
        return actor

    def _actor_wins(self, failed_first: bool, body_exc: BaseException | None) -> bool:
        """Whether the first actor failure, not the body's exception, leaves the system."""
        return self._failure is not None and (
            failed_first or body_exc is None or isinstance(body_exc, trio.Cancelled)
        )

    def _actor_failed(self, failure: ActorFailed) -> None:
        if self._failure is None:
            self._failure = failure
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()

    async def _stop_all(self) -> None:
        while pending := [a for a in reversed(self._actors) if not a._done.is_set()]:
            for actor in pending:
                actor._close_mailbox()
                await actor._done.wait()


def _leaves(exc: BaseException) -> list[BaseException]:
    """The non-group exceptions inside ``exc`` (``exc`` itself when it is not a group)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]
