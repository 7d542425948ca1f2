"""The actor base: mailbox bound and backpressure, typed messages, request/reply, lifecycle,
failure propagation. Every test runs on trio's mock clock (``autojump_clock``), so sleeps and
deadlines are instant and deterministic, and most sit under ``trio.fail_after`` so a hang is a
failure, not a stuck run."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from paramsync.runtime.actor.base import Actor, ActorState, ActorStopped, ActorSystem, run_in_thread
from paramsync.runtime.errors import ActorFailed, ParamsyncError

DEADLINE = 1_000  # mock-clock seconds: far beyond any test, so only a real hang reaches it


class Gated(Actor):
    """Handles one int per ``gate.release()``; replies with twice it, raises on a negative."""

    accepts = (int,)

    def __init__(self, name: str, mailbox_size: int = 16) -> None:
        super().__init__(name, mailbox_size)
        self.gate = trio.Semaphore(0)
        self.seen: list[int] = []

    async def handle(self, message: object) -> object:
        assert isinstance(message, int)
        await self.gate.acquire()
        if message < 0:
            raise RuntimeError("boom")
        self.seen.append(message)
        return message * 2


class Echo(Actor):
    """Replies with twice the int; raises ValueError on a negative one."""

    accepts = (int,)

    def __init__(self, name: str, mailbox_size: int = 16) -> None:
        super().__init__(name, mailbox_size)
        self.seen: list[int] = []

    async def handle(self, message: object) -> object:
        assert isinstance(message, int)
        if message < 0:
            raise ValueError(f"negative: {message}")
        self.seen.append(message)
        return message * 2


class Sleeper(Actor):
    """Sleeps forever on any message; records whether it was cancelled and stopped."""

    accepts = (str,)

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.handling = trio.Event()
        self.cancelled = False
        self.stopped = False

    async def handle(self, message: object) -> None:
        self.handling.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            self.cancelled = True
            raise

    async def on_stop(self) -> None:
        self.stopped = True


class Recorder(Actor):
    """Logs its hooks and messages into a shared list; on_start takes 5 (mock) seconds."""

    accepts = (str,)

    def __init__(self, name: str, log: list[str]) -> None:
        super().__init__(name)
        self.log = log

    async def on_start(self) -> None:
        await trio.sleep(5)
        self.log.append(f"{self.name}:start")

    async def handle(self, message: object) -> None:
        await trio.sleep(1)
        self.log.append(f"{self.name}:{message}")

    async def on_stop(self) -> None:
        self.log.append(f"{self.name}:stop")


# -- mailbox and backpressure ---------------------------------------------------------------


async def test_full_mailbox_blocks_sender_until_actor_takes_a_message(autojump_clock):
    sent: list[int] = []
    high_water = 0

    async def producer(actor: Gated) -> None:
        nonlocal high_water
        for i in range(6):
            await actor.tell(i)
            sent.append(i)
            high_water = max(high_water, actor.queued)

    with trio.fail_after(DEADLINE):
        async with ActorSystem() as system:
            actor = await system.start(Gated("gated", mailbox_size=2))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(producer, actor)
                await trio.testing.wait_all_tasks_blocked()
                # 0 is in handle (waiting on the gate), 1 and 2 fill the mailbox, 3 waits.
                assert sent == [0, 1, 2]
                assert actor.queued == 2
                await trio.sleep(100)  # time alone does not unblock the sender
                assert sent == [0, 1, 2]
                actor.gate.release()  # the actor finishes 0 and takes 1: one slot frees
                await trio.testing.wait_all_tasks_blocked()
                assert actor.seen == [0]
                assert sent == [0, 1, 2, 3]
                assert actor.queued == 2
                for _ in range(5):
                    actor.gate.release()
    assert actor.seen == [0, 1, 2, 3, 4, 5]  # leaving the system drained the mailbox
    assert high_water == 2


async def test_mailbox_size_must_be_positive():
    with pytest.raises(ValueError, match="mailbox_size"):
        Echo("e", mailbox_size=0)


# -- typed messages -------------------------------------------------------------------------


async def test_wrong_message_type_is_rejected_at_the_sender(autojump_clock):
    async with ActorSystem() as system:
        actor = await system.start(Echo("typed"))
        with pytest.raises(TypeError, match=r"actor 'typed' does not accept str \(accepts: int\)"):
            await actor.tell("nope")
        with pytest.raises(TypeError, match="does not accept float"):
            await actor.ask(1.5)
        assert actor.queued == 0
        assert actor.state is ActorState.RUNNING
        assert await actor.ask(2) == 4
    assert actor.seen == [2]


async def test_actor_must_declare_its_message_types():
    class Untyped(Actor):
        async def handle(self, message: object) -> None:
            return None

    with pytest.raises(TypeError, match="accepts"):
        Untyped("untyped")


# -- request/reply --------------------------------------------------------------------------


async def test_ask_returns_what_handle_returns_and_tell_keeps_order(autojump_clock):
    with trio.fail_after(DEADLINE):
        async with ActorSystem() as system:
            actor = await system.start(Echo("echo"))
            await actor.tell(1)
            await actor.tell(2)
            assert await actor.ask(21) == 42
            assert actor.seen == [1, 2, 21]


async def test_ask_where_handle_raises_fails_the_asker_and_the_actor(autojump_clock):
    body_continued = False
    with trio.fail_after(DEADLINE):
        with pytest.raises(ActorFailed) as outer:
            async with ActorSystem() as system:
                actor = await system.start(Echo("boom"))
                with pytest.raises(ActorFailed) as inner:
                    await actor.ask(-1)
                await trio.sleep(1)  # the system is cancelled: this never returns
                body_continued = True
    assert not body_continued
    assert trio.current_time() == 0
    assert inner.value.actor == "boom"
    assert isinstance(inner.value.__cause__, ValueError)
    assert outer.value.actor == "boom"
    assert isinstance(outer.value.__cause__, ValueError)
    assert "negative: -1" in str(outer.value)
    assert actor.state is ActorState.FAILED


async def test_cancelled_ask_while_being_handled_leaves_actor_usable(autojump_clock):
    with trio.fail_after(DEADLINE):
        async with ActorSystem() as system:
            actor = await system.start(Gated("gated"))
            with pytest.raises(trio.TooSlowError):
                with trio.fail_after(1):
                    await actor.ask(1)
            assert actor.state is ActorState.RUNNING
            actor.gate.release()  # 1 completes; its reply is discarded
            actor.gate.release()
            assert await actor.ask(2) == 4
            assert actor.seen == [1, 2]


async def test_cancelled_ask_still_queued_is_dropped(autojump_clock):
    with trio.fail_after(DEADLINE):
        async with ActorSystem() as system:
            actor = await system.start(Gated("gated"))
            await actor.tell(0)  # occupies the actor at the gate
            with trio.move_on_after(1) as scope:
                await actor.ask(1)
            assert scope.cancelled_caught
            assert actor.queued == 1
            actor.gate.release()  # 0 completes; 1 is skipped, the asker is gone
            actor.gate.release()
            assert await actor.ask(2) == 4
            assert actor.seen == [0, 2]


async def test_actor_asking_itself_raises_instead_of_deadlocking(autojump_clock):
    class Selfish(Actor):
        accepts = (int,)

        async def handle(self, message: object) -> object:
            try:
                await self.ask(1)
            except RuntimeError as exc:
                return str(exc)
            return "asked itself"

    with trio.fail_after(DEADLINE):
        async with ActorSystem() as system:
            actor = await system.start(Selfish("selfish"))
            assert "cannot ask itself" in str(await actor.ask(0))


# -- lifecycle ------------------------------------------------------------------------------


async def test_start_waits_for_on_start_and_exit_stops_in_reverse_spawn_order(autojump_clock):
    log: list[str] = []
    with trio.fail_after(DEADLINE):
        async with ActorSystem() as system:
            first = Recorder("a", log)
            assert first.state is ActorState.CREATED
            before = trio.current_time()
            await system.start(first)
            assert trio.current_time() - before == 5
            assert log == ["a:start"]
            assert first.state is ActorState.RUNNING
            second = await system.start(Recorder("b", log))
            for i in range(3):
                await second.tell(f"x{i}")  # b is busy for 3 s
            await trio.sleep(0.5)
            await first.tell("m1")  # a is done at 1.5 s, but stops only after b stopped
            assert system.actors == (first, second)
    assert log == ["a:start", "b:start", "b:x0", "a:m1", "b:x1", "b:x2", "b:stop", "a:stop"]
    assert first.state is ActorState.STOPPED
    assert second.state is ActorState.STOPPED


async def test_stop_drains_queued_messages_then_runs_on_stop(autojump_clock):
    log: list[str] = []
    with trio.fail_after(DEADLINE):
        async with ActorSystem() as system:
            actor = await system.start(Recorder("r", log))
            for i in range(3):
                await actor.tell(f"m{i}")
            before = trio.current_time()
            await actor.stop()
            assert trio.current_time() - before == 3  # one mock second per queued message
            assert log == ["r:start", "r:m0", "r:m1", "r:m2", "r:stop"]
            assert actor.state is ActorState.STOPPED
            await actor.stop()  # idempotent
            assert log[-1] == "r:stop" and log.count("r:stop") == 1


async def test_tell_and_ask_after_stop_raise_actor_stopped(autojump_clock):
    async with ActorSystem() as system:
        actor = await system.start(Echo("done"))
        await actor.stop()
        with pytest.raises(ActorStopped, match="'done' is stopped") as info:
            await actor.tell(1)
        assert isinstance(info.value, ParamsyncError)
        assert info.value.state is ActorState.STOPPED
        with pytest.raises(ActorStopped):
            await actor.ask(1)
    assert actor.seen == []


async def test_on_start_failure_surfaces_with_the_actor_name(autojump_clock):
    class BadStart(Echo):
        async def on_start(self) -> None:
            raise OSError("no device")

    start_returned = False
    with trio.fail_after(DEADLINE):
        with pytest.raises(ActorFailed, match="'loader' failed: OSError: no device") as info:
            async with ActorSystem() as system:
                await system.start(BadStart("loader"))
                start_returned = True
    assert not start_returned
    assert isinstance(info.value.__cause__, OSError)


# -- failure propagation --------------------------------------------------------------------


async def test_failure_cancels_siblings_and_surfaces_as_actor_failed(autojump_clock):
    sibling = Sleeper("sibling")
    with trio.fail_after(DEADLINE):
        with pytest.raises(ActorFailed) as info:
            async with ActorSystem() as system:
                system.spawn(sibling)
                bad = system.spawn(Echo("bad"))
                await sibling.tell("work")
                await sibling.handling.wait()
                await bad.tell(-5)
                await trio.sleep_forever()
    assert trio.current_time() == 0  # cancelled at once, not by the deadline
    assert info.value.actor == "bad"
    assert isinstance(info.value.__cause__, ValueError)
    assert sibling.cancelled
    assert not sibling.stopped  # on_stop is for graceful stops only
    assert sibling.state is ActorState.STOPPED
    assert bad.state is ActorState.FAILED
    with pytest.raises(ActorStopped, match="'bad' is failed"):
        await bad.tell(1)


async def test_first_failure_wins_when_it_cascades(autojump_clock):
    class Relay(Actor):
        accepts = (int,)

        def __init__(self, name: str, target: Actor) -> None:
            super().__init__(name)
            self.target = target

        async def handle(self, message: object) -> object:
            return await self.target.ask(message)

    with trio.fail_after(DEADLINE):
        with pytest.raises(ActorFailed) as info:
            async with ActorSystem() as system:
                leaf = await system.start(Echo("leaf"))
                relay = await system.start(Relay("relay", leaf))
                await relay.ask(-1)  # leaf fails first, then relay fails on its reply
    assert trio.current_time() == 0
    assert info.value.actor == "leaf"
    assert isinstance(info.value.__cause__, ValueError)
    assert relay.state is ActorState.FAILED
    assert leaf.state is ActorState.FAILED


async def test_failed_actor_releases_blocked_senders_and_queued_askers(autojump_clock):
    """Senders outside the system are not cancelled with it: they must still not hang."""
    actor = Gated("stuck", mailbox_size=1)
    outcomes: dict[str, BaseException] = {}

    async def blocked_tell() -> None:
        try:
            await actor.tell(7)
        except ActorStopped as exc:
            outcomes["tell"] = exc

    async def queued_ask() -> None:
        try:
            await actor.ask(6)
        except ActorStopped as exc:
            outcomes["ask"] = exc

    async def run_system() -> None:
        with pytest.raises(ActorFailed, match="'stuck' failed: RuntimeError: boom"):
            async with ActorSystem() as system:
                system.spawn(actor)
                await trio.sleep_forever()

    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_system)
            await actor.tell(-5)  # taken by the actor, waits at the gate, then raises
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(queued_ask)  # fills the one-slot mailbox
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(blocked_tell)  # blocks: the mailbox is full
            await trio.testing.wait_all_tasks_blocked()
            assert outcomes == {}
            assert actor.queued == 1
            actor.gate.release()
    assert trio.current_time() == 0
    assert actor.state is ActorState.FAILED
    assert isinstance(outcomes["ask"], ActorStopped)
    assert isinstance(outcomes["tell"], ActorStopped)
    assert outcomes["tell"].state is ActorState.FAILED
    assert actor.seen == []


async def test_failure_while_draining_on_exit_surfaces(autojump_clock):
    with trio.fail_after(DEADLINE):
        with pytest.raises(ActorFailed, match="'drainer' failed: RuntimeError: boom"):
            async with ActorSystem() as system:
                actor = await system.start(Gated("drainer"))
                await actor.tell(1)
                await actor.tell(-1)
                actor.gate.release()
                actor.gate.release()
                # leaving now: the graceful stop handles 1, then -1 raises while draining
    assert trio.current_time() == 0
    assert actor.seen == [1]
    assert actor.state is ActorState.FAILED


async def test_body_exception_propagates_unchanged_and_cancels_actors(autojump_clock):
    sleeper = Sleeper("sleeper")
    with trio.fail_after(DEADLINE):
        with pytest.raises(KeyError, match="body"):
            async with ActorSystem() as system:
                await system.start(sleeper)
                await sleeper.tell("work")
                await sleeper.handling.wait()
                raise KeyError("body")
    assert sleeper.cancelled
    assert sleeper.state is ActorState.STOPPED


async def test_outer_deadline_cancels_a_stop_that_would_hang(autojump_clock):
    sleeper = Sleeper("sleeper")
    with pytest.raises(trio.TooSlowError):
        with trio.fail_after(10):
            async with ActorSystem() as system:
                await system.start(sleeper)
                await sleeper.tell("work")
            # the graceful stop waits for the handler forever; the deadline ends it
    assert trio.current_time() == pytest.approx(10)
    assert sleeper.cancelled
    assert not sleeper.stopped


async def test_spawn_needs_an_open_system_and_a_fresh_actor(autojump_clock):
    system = ActorSystem()
    with pytest.raises(RuntimeError, match="open ActorSystem"):
        system.spawn(Echo("early"))
    async with system:
        actor = system.spawn(Echo("once"))
        with pytest.raises(RuntimeError, match="already spawned"):
            system.spawn(actor)
    with pytest.raises(RuntimeError, match="open ActorSystem"):
        system.spawn(Echo("late"))


# -- the hot path: task switches an ask and a thread crossing cost ---------------------------


class _TaskSteps(trio.abc.Instrument):
    """Counts the steps of one task."""

    def __init__(self) -> None:
        self.task: trio.lowlevel.Task | None = None
        self.steps = 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


async def test_an_ask_to_a_mailbox_with_room_switches_tasks_only_for_the_reply():
    async with ActorSystem() as system:
        actor = await system.start(Echo("echo"))
        counter = _TaskSteps()
        counter.task = trio.lowlevel.current_task()
        trio.lowlevel.add_instrument(counter)
        try:
            assert await actor.ask(21) == 42
        finally:
            trio.lowlevel.remove_instrument(counter)
        # Posting took no step of its own: the asker paused once, for the reply (a post that
        # switched tasks would count a second step).
        assert counter.steps == 1
        assert actor.seen == [21]


async def test_an_ask_to_a_full_mailbox_still_waits_for_room(autojump_clock):
    with trio.fail_after(DEADLINE):
        async with ActorSystem() as system:
            actor = await system.start(Gated("gated", mailbox_size=1))
            await actor.tell(1)  # handled: waits on the gate
            await trio.testing.wait_all_tasks_blocked()
            await actor.tell(2)  # fills the mailbox
            answers: list[object] = []

            async def asker() -> None:
                answers.append(await actor.ask(3))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(asker)
                await trio.testing.wait_all_tasks_blocked()
                assert actor.queued == 1 and answers == []
                for _ in range(3):
                    actor.gate.release()
            assert answers == [6]
            assert actor.seen == [1, 2, 3]


async def test_a_cancelled_ask_posts_nothing(autojump_clock):
    async with ActorSystem() as system:
        actor = await system.start(Echo("echo"))
        with trio.CancelScope() as scope:
            scope.cancel()
            await actor.ask(5)
        assert scope.cancelled_caught
        await actor.ask(6)
        assert actor.seen == [6]


async def test_run_in_thread_runs_off_the_loop_with_from_thread_and_errors():
    loop_thread = threading.get_ident()

    def work(value: int) -> tuple[int, bool]:
        # trio.from_thread works as under trio.to_thread (the crossing is the same)
        trio.from_thread.run_sync(lambda: None)
        return value * 2, threading.get_ident() != loop_thread

    assert await run_in_thread(work, 4) == (8, True)

    def boom() -> None:
        raise ValueError("in the thread")

    with pytest.raises(ValueError, match="in the thread"):
        await run_in_thread(boom)


async def test_run_in_thread_is_one_task_switch_and_honours_a_cancel_before_it_starts():
    ran: list[int] = []
    counter = _TaskSteps()
    counter.task = trio.lowlevel.current_task()
    trio.lowlevel.add_instrument(counter)
    try:
        await run_in_thread(ran.append, 1)
    finally:
        trio.lowlevel.remove_instrument(counter)
    assert ran == [1]
    assert counter.steps == 1  # trio.to_thread.run_sync's default limiter costs a second
    with trio.CancelScope() as scope:
        scope.cancel()
        await run_in_thread(ran.append, 2)
    assert scope.cancelled_caught and ran == [1]
