"""Hostile peers against the coordinator (security review rows 5 and 11).

Row 5: a rank that floods ``ready`` reports for the next step with distinct bucket ids must
cost the coordinator linear time, and is refused once it exceeds the agreed layout (or, before
any agreement, the declared maximum of early reports a rank may hold).
Row 11: a peer-supplied string (a dtype, a tensor name, a refusal reason) that carries a
newline cannot forge a log line: every such string is quoted (``repr``, clipped) before it
enters a refusal, an abort reason or a log line.
"""

from __future__ import annotations

import logging
import time

import pytest

from paramsync.runtime.coordinator.core import CoordinatorCore
from paramsync.runtime.coordinator.events import Abort, Action, Refuse, Report
from paramsync.runtime.coordinator.run_state import RunState
from paramsync.runtime.coordinator.service import Coordinator
from paramsync.runtime.coordinator.step_state import (
    MAX_EARLY_READIES,
    MAX_EARLY_READY_BYTES,
    spec_bytes,
)
from paramsync.runtime.errors import HandshakeError, one_line, quoted
from paramsync.runtime.protocol.handshake import DialerHandshake, Identity
from paramsync.runtime.protocol.messages import Digest, Joined, Ready

FORGED = "\n2026-11-23 21:00:00 INFO paramsync.daemon: run finished"
SIG = (("embed.w", (16, 8), "float32", True), ("norm.b", (8,), "float32", False))


def addr(rank: int) -> tuple[str, int]:
    return ("10.0.0.1", 7000 + rank)


def spec(bucket: int) -> tuple[tuple[tuple[int, ...], str], ...]:
    return (((bucket + 1, 4), "float32"),)


def started(n: int, **kwargs: object) -> CoordinatorCore:
    core = CoordinatorCore(n, heartbeat_deadline=5.0, **kwargs)  # type: ignore[arg-type]
    for rank in range(n):
        core.handle(Joined(rank, SIG, addr(rank), now=0.0))
    assert core.view.state is RunState.RUNNING
    return core


def log_actions(actions: list[Action], caplog: pytest.LogCaptureFixture) -> None:
    """Log the core's actions as the daemon does (`Coordinator._apply` logs every refusal,
    eviction, report and abort), and as a plain ``%s`` of the reason would."""
    Coordinator(3)._apply(actions)
    log = logging.getLogger("paramsync.test")
    for action in actions:
        if isinstance(action, (Refuse, Abort)):
            log.warning("refusing: %s", action.reason)


def assert_no_forged_line(caplog: pytest.LogCaptureFixture) -> None:
    text = caplog.text
    assert "\n" not in "".join(r.getMessage() for r in caplog.records)
    for line in text.splitlines():
        assert not line.startswith("2026-11-23 21:00:00 INFO paramsync.daemon"), line


# --------------------------------------------------------------------------- row 5


def _burst(reports: int) -> tuple[float, list[Action]]:
    """Rank 0 sends ``reports`` early readies for step 1 with distinct bucket ids."""
    core = started(2)
    actions: list[Action] = []
    start = time.perf_counter()
    for bucket in range(reports):
        actions += core.handle(Ready(0, 1, bucket, spec(0)))
        if actions:
            break
    return time.perf_counter() - start, actions


def test_early_ready_flood_costs_linear_time() -> None:
    small = min(_burst(2_000)[0] for _ in range(3))
    large = min(_burst(20_000)[0] for _ in range(2))
    assert large / small < 30, (small, large)


def test_early_ready_flood_is_refused_beyond_the_declared_maximum() -> None:
    _, actions = _burst(MAX_EARLY_READIES + 10)
    assert actions, "a rank held more early reports than any layout allows"
    assert any(str(MAX_EARLY_READIES) in getattr(a, "reason", "") for a in actions), actions


def test_early_ready_reports_are_bounded_in_bytes_per_member() -> None:
    """Second review, row 4: 30 early reports of 65,000-entry specs held 217 MiB; the count cap
    alone allowed about 116 GiB. Each member's early reports now hold at most
    MAX_EARLY_READY_BYTES of specs: the report that would pass it stops the run naming the
    rank, the step and the budget, and nothing of it is held."""
    core = started(2)
    huge = tuple(((i % 7 + 1, 3), "float32") for i in range(65_000))
    actions: list[Action] = []
    held = 0
    for bucket in range(30):
        actions = core.handle(Ready(0, 1, bucket, huge))
        if actions:
            break
        held += 1
    assert held * spec_bytes(huge) <= MAX_EARLY_READY_BYTES
    reason = " ".join(getattr(a, "reason", "") for a in actions)
    assert "step 1: rank 0's bucket reports ahead of the step hold more than" in reason, actions
    assert str(MAX_EARLY_READY_BYTES) in reason, actions


def test_a_legitimate_members_early_reports_fit_the_byte_budget() -> None:
    """A model of 2,000 gradient tensors of 4 dimensions each, in 100 buckets, reported ahead
    of the step by both members: held, nothing refused."""
    core = started(2)
    per_bucket = tuple(((64, 64, 3, 3), "bfloat16") for _ in range(20))
    for rank in range(2):
        for bucket in range(100):
            assert core.handle(Ready(rank, 1, bucket, per_bucket)) == []
    assert 100 * spec_bytes(per_bucket) < MAX_EARLY_READY_BYTES


def test_early_ready_beyond_the_agreed_layout_is_a_fault_naming_the_rank() -> None:
    core = started(2)
    for rank in range(2):  # step 0: the members agree on a two-bucket layout
        for bucket in range(2):
            core.handle(Ready(rank, 0, bucket, spec(bucket)))
    core.handle(
        Digest(0, 0, b"x", (("w", b"1"),))
    )  # rank 1 still in step 0: rank 0's step-1 reports are early
    assert core.handle(Ready(0, 1, 1, spec(1))) == []
    actions = core.handle(Ready(0, 1, 2, spec(2)))
    reasons = " ".join(getattr(a, "reason", "") for a in actions)
    assert "rank 0" in reasons and "bucket 2" in reasons and "2 buckets" in reasons, actions


def test_a_duplicate_early_ready_is_still_a_fault() -> None:
    core = started(2)
    assert core.handle(Ready(0, 1, 3, spec(3))) == []
    actions = core.handle(Ready(0, 1, 3, spec(3)))
    assert any("twice" in getattr(a, "reason", "") for a in actions), actions


# --------------------------------------------------------------------------- row 11


def test_quoted_escapes_and_clips() -> None:
    assert quoted("float32") == "'float32'"
    assert "\n" not in quoted(FORGED) and "\\n" in quoted(FORGED)
    assert "\x1b" not in quoted("a\x1b[2Jb")
    assert len(quoted("x" * 10_000)) < 300


def test_one_line_escapes_control_characters_and_keeps_plain_text() -> None:
    assert one_line("rank 1 sent a bad message: 'x'") == "rank 1 sent a bad message: 'x'"
    assert one_line("a" + FORGED) == "a\\n" + FORGED[1:]
    assert "\x1b" not in one_line("\x1b[2J") and "\r" not in one_line("a\rb")


def test_the_daemon_logs_a_forged_report_on_one_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    Coordinator(2)._apply([Report("rank 1 says" + FORGED, "info"), Refuse(1, "x" + FORGED)])
    assert len(caplog.records) == 2
    assert_no_forged_line(caplog)


def test_a_forged_dtype_in_a_join_is_refused_without_forging_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    core = CoordinatorCore(2)
    assert core.handle(Joined(0, SIG, addr(0))) == []
    evil = ((SIG[0][0], SIG[0][1], "float32" + FORGED, True), SIG[1])
    actions = core.handle(Joined(1, evil, addr(1)))
    assert len(actions) == 1 and isinstance(actions[0], Refuse), actions
    assert "dtype" in actions[0].reason
    log_actions(actions, caplog)
    assert_no_forged_line(caplog)


def test_a_forged_tensor_name_in_a_digest_mismatch_is_quoted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    core = started(3)
    core.handle(Digest(0, 0, b"x", (("w", b"1"),)))
    core.handle(Digest(1, 0, b"x", (("w", b"1"),)))
    actions = core.handle(Digest(2, 0, b"y", (("w", b"1"), ("v" + FORGED, b"2"))))
    assert any(isinstance(a, Abort) for a in actions), actions
    log_actions(actions, caplog)
    assert_no_forged_line(caplog)


def test_a_forged_refusal_reason_in_the_handshake_is_quoted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    dialer = DialerHandshake(b"s" * 32, Identity("g", 2, 1))
    for step in (dialer.on_challenge, dialer.on_verdict):
        with pytest.raises(HandshakeError) as caught:
            step({"kind": "refuse", "reason": "busy" + FORGED})
        logging.getLogger("paramsync.transport").warning("handshake failed: %s", caught.value)
    assert_no_forged_line(caplog)
