"""Fault-injection trials with real worker processes (runtime.testing.fault_trials).

Hypothesis picks where a worker is SIGKILLed (phase and step); every trial must end with the
survivors bitwise identical and equal to a reference run with the same membership history. A
bounded number of trials runs in ``make test``; ``make soak`` runs many more.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.testing.fault_trials import JOB_FLAGS, run_coordinator_restart_trial, run_trial
from runtime.testing.faults import PHASES, parse_fault

_REFERENCES: dict[int, str] = {}


def reference_digest(step: int) -> str:
    """The final model of a run whose last worker is killed before it touches ``step``."""
    if step not in _REFERENCES:
        reference = run_trial("data", step)
        assert reference.ok, reference.problems
        _REFERENCES[step] = next(iter(reference.digests.values()))
    return _REFERENCES[step]


def check_trial(phase: str, step: int) -> None:
    result = run_trial(phase, step)
    assert result.ok, result.problems
    assert result.resumed_at in (step, step + 1)
    if phase in ("data", "forward", "backward"):
        assert result.resumed_at == step  # nothing of the step was applied: it is rerun
    if phase == "digest":
        assert result.resumed_at == step + 1  # applied everywhere before the digest
    assert result.detection_seconds is not None and result.detection_seconds < 3.0
    assert set(result.digests.values()) == {reference_digest(result.resumed_at)}


@settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(phase=st.sampled_from(PHASES), step=st.sampled_from([2, 3]))
def test_a_killed_worker_is_survived_at_any_phase(phase: str, step: int) -> None:
    check_trial(phase, step)


@pytest.mark.parametrize("phase", ["allreduce", "optimizer"])
def test_a_worker_killed_mid_all_reduce_or_optimizer_is_survived(phase: str) -> None:
    check_trial(phase, 2)


def test_a_killed_worker_restarts_rejoins_live_and_matches_everyone() -> None:
    """~40 s. It failed once in three runs under load in session 2 (the coordinator exited 1
    on a reset connection; not reproduced since). Two epoch-change races were fixed after that
    (an event swapped under a waiting step; an ending epoch's actor failure taken for the
    step's own) and 4 of 4 runs passed."""
    flags = list(JOB_FLAGS)
    flags[flags.index("--steps") + 1] = "1500"  # long enough for a process to start again
    result = run_trial("backward", 2, rejoin=True, job_flags=flags, timeout=240)
    assert result.ok, result.problems
    assert result.exit_codes["rejoined"] == 0
    assert len(set(result.digests.values())) == 1 and len(result.digests) == 3
    members = [tuple(e["members"]) for e in result.epochs]
    assert members[0] == (0, 1, 2) and (0, 1) in members and members[-1] == (0, 1, 2)


def test_the_coordinator_killed_and_restarted_the_run_resumes_and_finishes() -> None:
    """SIGKILL of the coordinator daemon as it commits step 3; a new one on the same port.
    Every worker redials, rejoins with its step and digest, and finishes with the model of a
    run that was never interrupted."""
    result = run_coordinator_restart_trial(3)
    assert result.ok, result.problems
    assert result.exit_codes["coordinator"] == -9
    assert result.exit_codes["restarted coordinator"] == 0
    assert [e["members"] for e in result.epochs] == [[0, 1, 2], [0, 1, 2]]
    assert result.recovery_seconds is not None
    reference = run_coordinator_restart_trial(None)
    assert reference.ok, reference.problems
    assert len(reference.epochs) == 1
    assert set(result.digests.values()) == set(reference.digests.values())


def test_parse_fault_names_the_problem() -> None:
    assert parse_fault("backward:3") == ("backward", 3)
    assert parse_fault("commit:4") == ("commit", 4)
    assert parse_fault("") is None
    with pytest.raises(ValueError, match="PHASE:STEP"):
        parse_fault("sideways:3")
    with pytest.raises(ValueError, match="PHASE:STEP"):
        parse_fault("backward:x")


@pytest.mark.soak
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=st.integers(0, 6))
def test_soak_coordinator_restarted_at_random_commits(step: int) -> None:
    result = run_coordinator_restart_trial(step)
    assert result.ok, result.problems
    assert set(result.digests.values()) == {coordinator_reference()}


_COORDINATOR_REFERENCE: list[str] = []


def coordinator_reference() -> str:
    """The final model of the trial job never interrupted."""
    if not _COORDINATOR_REFERENCE:
        reference = run_coordinator_restart_trial(None)
        assert reference.ok, reference.problems
        _COORDINATOR_REFERENCE.append(next(iter(reference.digests.values())) or "")
    return _COORDINATOR_REFERENCE[0]


@pytest.mark.soak
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(phase=st.sampled_from(PHASES), step=st.integers(1, 6))
def test_soak_killed_workers_at_random_points(phase: str, step: int) -> None:
    check_trial(phase, step)
