"""The coordinator core's read-only view (`paramsync.runtime.coordinator.view.CoordinatorView`):
it shows the run as it is now, holds nothing of its own, and nothing it returns can change the
run."""

from __future__ import annotations

import pytest

from paramsync.runtime.coordinator.core import CoordinatorCore
from paramsync.runtime.coordinator.events import Tick
from paramsync.runtime.coordinator.run_state import RunState
from paramsync.runtime.protocol.messages import Joined

SIG = (("w", (2,), "float32", True),)


def test_the_view_follows_the_run_as_it_moves() -> None:
    core = CoordinatorCore(2, heartbeat_deadline=5.0)
    view = core.view
    assert (view.state, view.epoch, view.members, view.step) == (RunState.RENDEZVOUS, 0, (), 0)
    core.handle(Joined(0, SIG, ("h", 1000), 0.0))
    assert view.members == (0,) and view.joined == (0,)
    core.handle(Joined(1, SIG, ("h", 1001), 0.0))
    assert (view.state, view.epoch, view.members) == (RunState.RUNNING, 1, (0, 1))
    assert dict(view.addresses) == {0: ("h", 1000), 1: ("h", 1001)}
    assert view.waiting_for() == ("data loading and forward", (0, 1))
    core.handle(Tick(20.0))  # both silent past the deadline: a static run aborts
    assert view.state is RunState.ABORTED and view.abort_reason is not None
    assert "missed heartbeats" in view.abort_reason


def test_the_view_cannot_change_the_run() -> None:
    core = CoordinatorCore(2)
    core.handle(Joined(0, SIG, ("h", 1000), 0.0))
    core.handle(Joined(1, SIG, ("h", 1001), 0.0))
    view = core.view
    with pytest.raises(AttributeError):
        view.state = RunState.FINISHED  # type: ignore[misc]
    with pytest.raises(AttributeError):
        view.extra = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        view.addresses[0] = ("evil", 1)  # type: ignore[index]
    with pytest.raises(TypeError):
        view.last_heartbeat[0] = 99.0  # type: ignore[index]
    assert view.state is RunState.RUNNING and view.addresses[0] == ("h", 1000)
