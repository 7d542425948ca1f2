"""What the coordinator's clock decides: the `Tick` handler of its core (pure).

A tick reads the shell's clock into `paramsync.runtime.coordinator.liveness` and acts on what
is due: a member silent past the heartbeat deadline is lost (a static run stops), a hold past
``rejoin_seconds`` aborts, a rendezvous due after a restart starts the first epoch, and a step
in which nothing moved for ``stall_seconds`` is reported, its ranks dropped (or the run
stopped) past ``stall_deadline``.
"""

from __future__ import annotations

from paramsync.runtime.coordinator.events import Action, Evict, Report, format_seconds
from paramsync.runtime.coordinator.run import Run
from paramsync.runtime.coordinator.run_state import DONE, RunState

__all__ = ["tick"]


def tick(run: Run, now: float) -> list[Action]:
    """What the clock decides at ``now``: members silent past the heartbeat deadline are lost
    (or stop a static run), a hold past its time aborts, a due rendezvous starts the first
    epoch, a stalled step is reported and, past the stall deadline, its ranks dropped."""
    live = run.liveness
    live.observe(now)
    silent = live.silent(now)
    actions: list[Action] = []
    if silent:
        if not run.elastic:
            parts = [
                f"rank {rank} missed heartbeats for {format_seconds(gap)} s" for rank, gap in silent
            ]
            deadline = f"(deadline {format_seconds(live.deadline)} s)"
            where = run.membership.hosts_note(rank for rank, _ in silent)
            return run.abort(f"{'; '.join(parts)} {deadline}{where}")
        for rank, gap in silent:
            reason = live.missed(gap)
            actions += [Evict(rank, reason), *run.lose(rank, reason)]
            if run.state in DONE:
                return actions
    if run.state is RunState.HOLDING and live.hold_expired(now):
        return actions + run.abort(
            f"only {len(run.membership)} worker(s) remain (ranks {run.membership.joined}), "
            f"fewer than min_workers={run.min_workers}, and none joined within "
            f"{format_seconds(live.rejoin)} s"
        )
    if (
        run.state is RunState.RENDEZVOUS
        and run.elastic
        and len(run.membership) >= run.min_workers
        and live.rendezvous_due(now)
    ):
        return actions + run.first_epoch()
    if run.state is RunState.RUNNING:
        actions += _check_stall(run, now)
    return actions


def _stalled_call(
    run: Run, call: tuple[str, int, tuple[int, ...]], waited: float, give_up: bool
) -> list[Action]:
    """A torch.distributed group waiting in a call some ranks have not made: named with the
    call, the ranks that did not call it and those waiting in it; past the stall deadline (the
    group's timeout) the run stops."""
    name, number, missing = call
    waiting = [r for r in run.membership.members if r not in missing]
    where = f"{name} (step {run.current.resume_step}, call {number})"
    if not give_up:
        return [
            Report(
                f"stall: {where}: ranks {waiting} have waited {format_seconds(waited)} s for "
                f"ranks {list(missing)}, which have not called it"
            )
        ]
    deadline = run.liveness.stall_deadline
    assert deadline is not None
    return run.abort(
        f"{where}: ranks {list(missing)} did not call it within the timeout of "
        f"{format_seconds(deadline)} s (ranks {waiting} waited in it)"
    )


def _check_stall(run: Run, now: float) -> list[Action]:
    stall = run.liveness.check_stall(now)
    if stall is None:
        return []
    if not run.idle_stalls and not run.current.partly_reported(run.membership.members):
        return []  # every member at the same point between calls: idle, not stalled
    phase, ranks = run.current.waiting_for(run.membership.members)
    step, waited = run.current.resume_step, format_seconds(stall.waited)
    call = run.current.waiting_call(run.membership.members)
    if call is not None and not run.elastic:
        return _stalled_call(run, call, stall.waited, stall.give_up)
    if not stall.give_up:
        return [
            Report(
                f"stall: step {step} (epoch {run.membership.epoch}) has waited "
                f"{waited} s for ranks {list(ranks)} in {phase}"
            )
        ]
    reason = f"stalled for {waited} s in {phase}"
    if not run.elastic:
        deadline = run.liveness.stall_deadline
        assert deadline is not None
        return run.abort(
            f"step {step}: ranks {list(ranks)} {reason} "
            f"(stall deadline {format_seconds(deadline)} s)"
        )
    actions: list[Action] = []
    for rank in ranks:
        actions += [Evict(rank, reason), *run.lose(rank, reason)]
        if run.state is not RunState.RUNNING:
            break
    return actions
