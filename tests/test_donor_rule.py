"""The restart's donor rule (security review, issue 18 row 8): which state a restarted
coordinator resumes from, so that one corrupted rank cannot overwrite a majority.

A worker's join reports its state (next step, digest) and whether that state is *committed*
(the coordinator's digest check of the step before passed and the worker still holds the
digest it reported there). `paramsync.runtime.coordinator.membership.resume_plan` resumes from the
newer of the newest committed state and the state a strict majority holds; with neither, from the
state most ranks hold, ties to the lower step. Checked here at the sans-I/O level (`CoordinatorCore`
fed `Joined` events; a hypothesis property over random join sets), on the worker's side
(`WorkerProtocol` computes the flag from the commits it saw) and end to end with a restarted
coordinator (`tests/test_coordinator_restart.py`'s cluster).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from test_coordinator_restart import run_cluster

from paramsync.actors.client.events import ConnectionLost, EnterEpoch, Join, Received, ReportDigest
from paramsync.actors.client.protocol import WorkerProtocol
from paramsync.actors.state.checkpoint import CheckpointStore
from paramsync.actors.state.training_state import TrainingState
from paramsync.actors.train.checkpointing import CommittedCheckpoints
from paramsync.runtime.coordinator.core import CoordinatorCore
from paramsync.runtime.coordinator.events import Action, Broadcast, Report
from paramsync.runtime.coordinator.membership import COMMITTED, MAJORITY, PLURALITY, resume_plan
from paramsync.runtime.protocol.messages import Commit, Joined, ResyncOrder, StartRun
from paramsync.runtime.protocol.wire import decode_frame, encode_frame_bytes

SIG = (("w", (2, 2), "float32", True),)


def join(rank: int, step: int = 0, digest: bytes = b"", *, committed: bool = False) -> Joined:
    return Joined(
        rank, SIG, ("10.0.0.1", 7000 + rank), step=step, digest=digest, epoch=3,
        committed=committed,
    )  # fmt: skip


def restart(*joins: Joined) -> tuple[StartRun, list[Report]]:
    """A restarted coordinator fed these joins: the start it sends and what it logs."""
    core = CoordinatorCore(len(joins))
    actions: list[Action] = []
    for event in joins:
        actions += core.handle(event)
    starts = [a.message for a in actions if isinstance(a, Broadcast)]
    assert len(starts) == 1 and isinstance(starts[0], StartRun), actions
    return starts[0], [a for a in actions if isinstance(a, Report)]


# --------------------------------------------------------------------------- the coordinator


def test_one_rank_a_step_ahead_does_not_overwrite_the_majority() -> None:
    """Today's rule took the newest step: rank 2, alone one step ahead with a state nobody
    checked, became the donor for the two ranks that agree."""
    start, reports = restart(join(0, 4, b"d"), join(1, 4, b"d"), join(2, 5, b"bad"))
    assert (start.step, start.donor, start.receivers) == (4, 0, (2,))
    assert reports[0].text == (
        "resume at step 4 from rank 0: majority state (2 of 3 ranks); ranks [2] roll back to step 4"
    )
    assert reports[0].level == "warning"


def test_a_corroborated_committed_state_ahead_of_the_majority_wins() -> None:
    """Ranks 0 and 1 got the commit of step 4 before the coordinator died, rank 2 restarted
    from an older checkpoint: the committed state, which two ranks hold, is the one to resume."""
    start, reports = restart(join(0, 5, b"c", committed=True), join(1, 5, b"c"), join(2, 4, b"d"))
    assert (start.step, start.donor, start.receivers) == (5, 0, (2,))
    assert reports[0].text == "resume at step 5 from rank 0: committed state"


def test_a_lone_committed_claim_ahead_of_the_majority_is_not_trusted() -> None:
    """Second security review, row 8: rank 0 alone claims a committed state a step ahead of
    the two ranks that agree. A commit is of a digest every member reported, so a claim no
    other rank's state corroborates is not trusted: the majority's state wins, rank 0 rolls
    back and the coordinator names the claim."""
    start, reports = restart(join(0, 5, b"c", committed=True), join(1, 4, b"d"), join(2, 4, b"d"))
    assert (start.step, start.donor, start.receivers) == (4, 1, (0,))
    assert reports[0].text.startswith(
        "resume at step 4 from rank 1: majority state (2 of 3 ranks); ranks [0] roll back"
    )
    assert "ranks [0] claim a committed state no other rank holds: not trusted" in (reports[0].text)
    assert reports[0].level == "error"


def test_a_majority_ahead_of_the_committed_state_wins() -> None:
    start, reports = restart(join(0, 4, b"d", committed=True), join(1, 5, b"e"), join(2, 5, b"e"))
    assert (start.step, start.donor, start.receivers) == (5, 1, (0,))
    assert "majority state (2 of 3 ranks)" in reports[0].text


def test_a_lone_committed_claim_disagreeing_with_the_majority_at_its_step_is_named() -> None:
    """Rank 0 claims a committed state at step 5 that the two others, at step 5 too, do not
    hold (no honest run produces this): the majority's state wins, the claim is named."""
    start, reports = restart(join(0, 5, b"x", committed=True), join(1, 5, b"y"), join(2, 5, b"y"))
    assert (start.step, start.donor, start.receivers) == (5, 1, (0,))
    assert reports[0].level == "error"
    assert "ranks [0] claim a committed state no other rank holds: not trusted" in (reports[0].text)


def test_without_commit_or_majority_the_plurality_wins_ties_to_the_lower_step() -> None:
    start, reports = restart(join(0, 5, b"a"), join(1, 5, b"b"), join(2, 6, b"c"), join(3, 6, b"c"))
    assert (start.step, start.donor, start.receivers) == (6, 2, (0, 1))
    assert "plurality state (2 of 4 ranks)" in reports[0].text
    # Two ranks, two states, no commit: the uncommitted later step is recomputed.
    start, reports = restart(join(0, 6, b"a"), join(1, 5, b"b"))
    assert (start.step, start.donor, start.receivers) == (5, 1, (0,))
    assert "ranks [0] roll back to step 5" in reports[0].text


def test_fresh_workers_hold_no_state_and_receive_the_only_one() -> None:
    start, reports = restart(join(0), join(1), join(2, 5, b"a"))
    assert (start.step, start.donor, start.receivers) == (5, 2, (0, 1))
    assert not start.broadcast
    start, reports = restart(join(0), join(1))
    assert start.broadcast and start.step == 0 and not reports


STATES = st.tuples(
    st.integers(min_value=0, max_value=4), st.sampled_from([b"a", b"b", b"c"]), st.booleans()
)


@settings(max_examples=300, deadline=None)
@given(st.lists(STATES, min_size=1, max_size=7))
def test_property_the_chosen_state_is_committed_shared_or_the_only_one(
    reports: list[tuple[int, bytes, bool]],
) -> None:
    """Over random join sets (a committed flag may even be a lie): the coordinator never
    resumes from a state one rank holds alone unless no state is shared (no rank alone makes
    the others adopt its state, whatever it claims); never behind a corroborated committed
    state (claimed and held by two ranks or more); from a strict majority's state unless a
    corroborated committed one is at least as new; the donor is the chosen state's lowest
    holder and every other rank receives it."""
    joins = [join(r, s, d if s else b"", committed=c) for r, (s, d, c) in enumerate(reports)]
    core = CoordinatorCore(len(joins))
    actions: list[Action] = []
    for event in joins:
        actions += core.handle(event)
    (start,) = [a.message for a in actions if isinstance(a, Broadcast)]
    assert isinstance(start, StartRun)
    held = {(j.step, j.digest) for j in joins if j.step > 0}
    if not held:
        assert start.broadcast and start.step == 0
        return
    holders = {s: [j.rank for j in joins if (j.step, j.digest) == s] for s in held}
    claimed = {(j.step, j.digest) for j in joins if j.committed and j.step > 0}
    claims = {state for state in claimed if len(holders[state]) >= 2}  # corroborated
    chosen = (start.step, joins[start.donor].digest)
    assert chosen in held and start.donor == holders[chosen][0]
    assert start.receivers == tuple(j.rank for j in joins if j.rank not in holders[chosen])
    if len(holders[chosen]) == 1 and len(joins) > 1:
        assert all(len(r) == 1 for r in holders.values())
    assert start.step >= max((s for s, _ in claims), default=0)
    majority = [s for s, r in holders.items() if 2 * len(r) > len(joins)]
    if majority and not any(s >= majority[0][0] for s, _ in claims):
        assert chosen == majority[0]
    if chosen not in claims:
        assert len(holders[chosen]) == max(len(r) for r in holders.values())
    plan = resume_plan({j.rank: j for j in joins})
    assert plan is not None
    assert plan.rule in (COMMITTED, MAJORITY, PLURALITY)
    assert plan.rolled_back == tuple(j.rank for j in joins if j.step > start.step)


# --------------------------------------------------------------------------- the wire


def test_the_join_carries_committed_only_when_true_and_reads_false_when_absent() -> None:
    plain = join(1, 4, b"d")
    kind, body = plain.to_wire()
    assert "committed" not in body  # a join without the flag is byte for byte as before
    frame = decode_frame(encode_frame_bytes(kind, body))
    assert Joined.from_wire(frame, rank=1).committed is False
    kind, body = join(1, 4, b"d", committed=True).to_wire()
    assert body["committed"] is True
    frame = decode_frame(encode_frame_bytes(kind, body))
    assert Joined.from_wire(frame, rank=1).committed is True


# --------------------------------------------------------------------------- the worker


def running(step: int = 0) -> WorkerProtocol:
    """A worker that joined and entered epoch 1 at ``step``."""
    protocol = WorkerProtocol(2)
    protocol.handle(Join(SIG, ("h", 7)))
    start = StartRun(addresses=(("h", 7),), ring=(0,), step=step, epoch=1, members=(2,))
    protocol.handle(Received(start, 0.0))
    protocol.handle(EnterEpoch(start))
    return protocol


def rejoin(protocol: WorkerProtocol, step: int, digest: bytes) -> Joined:
    protocol.handle(ConnectionLost("gone", rejoin=True))
    (send,) = protocol.handle(Join(None, None, step=step, digest=digest, epoch=protocol.epoch))
    message = send.message  # type: ignore[union-attr]
    assert isinstance(message, Joined)
    return message


def test_a_worker_reports_committed_for_the_state_whose_digest_the_commit_checked() -> None:
    protocol = running()
    protocol.handle(ReportDigest(0, b"d0", [], 1))
    protocol.handle(Received(Commit(0, 1), 0.0))
    assert protocol.verified == (1, b"d0")
    assert rejoin(protocol, 1, b"d0").committed


@pytest.mark.parametrize(
    "case", ["no commit", "digest changed", "step changed", "resynced", "fresh"]
)
def test_a_worker_reports_uncommitted_unless_it_holds_the_checked_state(case: str) -> None:
    protocol = running()
    protocol.handle(ReportDigest(0, b"d0", [], 1))
    if case == "resynced":  # its state is overwritten by the source's before the commit
        protocol.handle(Received(ResyncOrder(0, 0, (2,)), 0.0))
    if case != "no commit":
        protocol.handle(Received(Commit(0, 1), 0.0))
    step, digest = {"digest changed": (1, b"other"), "step changed": (2, b"d0")}.get(
        case, (1, b"d0")
    )
    if case == "fresh":
        step, digest = 0, b""
    assert not rejoin(protocol, step, digest).committed


def test_an_older_epochs_digest_is_not_taken_for_the_rerun_steps() -> None:
    """Step 3's digest was reported in epoch 1, then the epoch ended before its commit; the
    rerun in epoch 2 commits step 3 without this worker reporting it again: not committed."""
    protocol = running(3)
    protocol.handle(ReportDigest(3, b"old", [], 1))
    start = StartRun(addresses=(("h", 7),), ring=(0,), step=3, epoch=2, members=(2,))
    protocol.handle(Received(start, 0.0))
    protocol.handle(EnterEpoch(start))
    protocol.handle(Received(Commit(3, 2), 0.0))
    assert protocol.verified is None


def test_a_join_from_a_committed_checkpoint_says_so() -> None:
    protocol = WorkerProtocol(0)
    (send,) = protocol.handle(Join(SIG, ("h", 7), step=4, digest=b"ck", committed=True))
    assert send.message.committed  # type: ignore[union-attr]


# --------------------------------------------------------------------------- checkpoints


async def test_a_state_replaced_before_its_commit_never_reaches_the_disk(tmp_path: Path) -> None:
    """The rank alone ahead offered its state after step 3 for writing once step 3 commits;
    the restart rolls it back (a donor's state replaces it) and step 3 commits again after
    the rerun: that commit checked the rerun's state, so only the rerun's offer is written."""
    store = CheckpointStore(tmp_path, keep=5, run_id="run-a")
    received = 0
    commits: dict[int, trio.Event] = {}

    async def wait_commit(step: int) -> None:
        await commits.setdefault(step, trio.Event()).wait()

    writer = CommittedCheckpoints(store, wait_commit, replaced=lambda: received)
    ahead = TrainingState(4, [("x", torch.full((3,), -1.0))], {})
    rerun = TrainingState(4, [("x", torch.full((3,), 4.0))], {})
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer.run)
            writer.offer(ahead)
            await trio.testing.wait_all_tasks_blocked()
            received += 1  # the donor's state at step 3 replaces it
            writer.offer(rerun)
            commits.setdefault(3, trio.Event()).set()  # the rerun of step 3 commits
            await writer.flush()
            nursery.cancel_scope.cancel()
    assert [s for s, _ in store.checkpoints()] == [4]
    written = store.load_latest_valid(committed_only=True)
    assert written is not None and written.tensors[0][1].tolist() == [4.0, 4.0, 4.0]


# --------------------------------------------------------------------------- end to end


@pytest.mark.trio
async def test_a_restarted_coordinator_rolls_a_lone_rank_ahead_back_to_the_committed_state(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While the coordinator is down, rank 2 takes a step alone into a damaged state (one step
    ahead, never checked); ranks 0 and 1 hold the committed state. The restarted coordinator
    resumes from theirs and rolls rank 2 back, which then trains on with the others: the run
    ends where an uninterrupted run does. Under the old rule rank 2 was the donor and its
    damage spread to everyone."""
    caplog.set_level(logging.INFO)
    reference = await run_cluster(None)
    restarted = await run_cluster(3, stray=2, ahead=True)
    assert set(restarted.digests.values()) == {reference.digests[0]}
    for mask in restarted.masks.values():
        assert mask.tolist() == [True, False]
    assert set(restarted.steps.values()) == {reference.steps[0]}
    assert restarted.epochs[2][1][1] == 3  # rank 2 went back from step 4 to step 3
    assert "resume at step 3 from rank 0: committed state; ranks [2] roll back to step 3" in (
        caplog.text
    )
    assert "rank 2 rolls back from step 4" in caplog.text
    # Its train_batch for step 4 was in flight: not run on step 3, the loop fed step 3's.
    assert "rank 2: step 4's batch not run: rolled back to step 3" in caplog.text
