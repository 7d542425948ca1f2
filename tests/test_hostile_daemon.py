"""Hostile input against a running coordinator daemon over TCP while real workers train.

A coordinator (``python -m paramsync.runtime.cli.main coordinator``) and two LM-job workers run as
processes; the test process attacks the coordinator's port with the attacks of
``benchmarks/hostile.py`` (strangers, garbage, a 4 GiB length prefix, wrong secrets, an offline
guesser, a replayed handshake, a slow drip, a connection flood over the cap). Every attack must be
refused with a log line naming the attacker's address and the reason, the daemon must keep serving,
and the training must finish with exit code 0 and the same state digest on both workers.

Garbage after a valid handshake needs a free rank, so it runs against a second coordinator
whose rank 1 the test takes itself before the real workers start.
"""

from __future__ import annotations

import importlib.util
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import trio

from paramsync.runtime.errors import PeerClosed
from paramsync.runtime.protocol.handshake import Identity
from paramsync.runtime.transport.tcp import DEFAULT_GROUP, dial

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "paramsync.runtime.cli.main"]


def _load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hostile_bench", ROOT / "benchmarks/hostile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


hostile = _load_bench()

HANDSHAKE_SECONDS = 1.5
CAP = 16
PER_SOURCE = 8
"""The gate's default cap per source address (the attacks come from 127.0.0.1-8 in turn)."""
FLOOD = 40
STEPS = 1500  # about 15 s on 2 cores: the attacks are over after about 5 s of it


def wait_for_log(run: Any, needles: list[str], seconds: float = 10.0) -> str:
    """The coordinator's log once it holds every needle (fails naming the missing ones)."""
    deadline = time.monotonic() + seconds
    while True:
        text = run.coordinator_log()
        missing = [needle for needle in needles if needle not in text]
        if not missing:
            return text
        if time.monotonic() > deadline:
            pytest.fail(f"not in the coordinator's log: {missing}\n--- log:\n{text[-6000:]}")
        time.sleep(0.05)


async def attack(target: Any) -> list[Any]:
    """Every single-connection attack once (the slow drip meanwhile), then the flood."""
    attempts: list[Any] = []
    async with trio.open_nursery() as nursery:

        async def drip() -> None:
            attempts.extend(await hostile.slow_drip(target, 0))

        nursery.start_soon(drip)
        for name in hostile.PHASES:
            if name in ("slow_drip", "flood"):  # the drip runs alongside, the flood after
                continue
            attempts.extend(await hostile.ATTACKS[name](target, 1))
    attempts.extend(await hostile.flood(target, FLOOD))
    # Still serving after all that: a full authenticated handshake reaches admission (and is
    # refused there: rank 0 is taken), and its replay is refused as one.
    attempts.extend(await hostile.replay(target, 2))
    return attempts


EXPECTED_OUTCOMES = {
    # What the attacker hears, by attack (the coordinator's log is checked separately).
    "connect_close": "closed by us",
    # "GET / HT" read as a prefix: item 0x47455420, bulk 0x2f204854, a head of 405081036 bytes
    "http_garbage": "refuse: frame of 405081036 bytes exceeds this receiver's limit of 4096",
    "framed_garbage": "refuse: ",
    "oversized": "refuse: frame of 4294967295 bytes exceeds this receiver's limit of 4096",
    "wrong_secret": "AuthenticationError: refused: 'authentication failed: wrong shared secret'",
    "forged_auth": "refuse: authentication failed: wrong shared secret",
    # one hello's reply holds a nonce, a salt and a CPace share: nothing to test guesses against
    "offline_guess": "challenge ['nonce', 'salt', 'share']: nothing to test guesses against",
    "taken_rank": "refuse: rank 0 is already taken",
    "replay": "refuse: replayed handshake: this hello's nonce was sent by an earlier connection",
    "slow_drip": "closed after ",
}


@pytest.mark.soak  # a 27 s live run of every attack; the attacks' own tests stay in make test
def test_every_attack_is_refused_and_logged_while_training_finishes(tmp_path: Path) -> None:
    run = hostile.LiveRun(
        tmp_path, steps=STEPS, handshake_seconds=HANDSHAKE_SECONDS, max_pending=CAP
    )
    try:
        run.start()
        run.wait_training()
        attempts = trio.run(attack, run.target())
        assert run.alive(), (
            "the run ended before the attacks did (too fast a machine? raise STEPS)\n"
            + run.coordinator_log()[-4000:]
        )
        single = [a for a in attempts if a.attack != "flood"]
        # One line per attempt, naming the attacker's address, the category and the reason.
        wait_for_log(
            run,
            # (the drip: cut at the deadline, or evicted once the flood reaches the cap)
            [
                f"from {a.address} [{'' if len(a.expect) > 1 else a.expect[0] + ']: '}"
                for a in single
            ],
            seconds=HANDSHAKE_SECONDS + 10,
        )
        outcome = run.finish(timeout=120)
    finally:
        run.kill()

    log = hostile.parse_admission_log(outcome.coordinator_log)
    for attempt in single:
        assert attempt.outcome.startswith(EXPECTED_OUTCOMES[attempt.attack]), attempt
        lines = log.lines[attempt.address]  # a port may be reused by a later attempt
        assert any(c in attempt.expect and attempt.text in r for c, r in lines), (attempt, lines)
    drip = next(a for a in single if a.attack == "slow_drip")
    sent, total = (int(n) for n in drip.outcome.split()[2:5:2])
    assert sent < total, drip  # cut by the deadline, not finished

    # The flood (from eight addresses, 5 each: under the cap per source): CAP connections held
    # until the deadline (or evicted for a newcomer), the others refused at once.
    flood = [a for a in attempts if a.attack == "flood"]
    busy = [a for a in flood if a.outcome.startswith("refuse: coordinator is busy")]
    assert len(busy) >= FLOOD - CAP - 4, [a.outcome for a in flood]
    caps = (f"the cap is {CAP}", f"the cap per source is {PER_SOURCE}", "made no progress")
    assert all(any(cap in a.outcome for cap in caps) for a in busy), [a.outcome for a in busy]
    over_cap_lines = [a for a in busy if log.lines.get(a.address, [("", "")])[0][0] == "over_cap"]
    assert over_cap_lines, "no over-the-cap line names a flood connection"
    assert all(any(cap in log.lines[a.address][0][1] for cap in caps[:2]) for a in over_cap_lines)
    rows = hostile.account(attempts, log)
    assert rows["flood"]["unaccounted"] == 0 and not rows["flood"]["unexpected"], rows["flood"]

    # The daemon's own totals: every connection accounted for, only the two workers admitted.
    totals = log.totals
    assert totals["connections"] == len(attempts) + 2, totals
    assert totals["admitted"] == 2, totals
    assert totals["over_cap"] <= len(busy) <= totals["over_cap"] + totals["evicted"], totals
    assert totals["peak_pending"] <= CAP, totals
    assert totals["other"] == 0 and totals["accept_errors"] == 0, totals

    # ...and the training never noticed.
    assert outcome.exit_codes == {"coordinator": 0, "rank 0": 0, "rank 1": 0}, (
        outcome.exit_codes,
        outcome.coordinator_log[-4000:],
    )
    assert outcome.digests_identical, outcome.digests
    assert all(s["final_step"] == STEPS for s in outcome.summaries.values()), outcome.summaries
    assert "run finished" in outcome.coordinator_log


def test_slow_holders_and_duplicate_dialers_against_a_daemon(tmp_path: Path) -> None:
    """Issue 18, rows 3 and 9, against a coordinator daemon whose ranks are free: 32 slow
    holders from eight other addresses fill its 16 slots for 1.5 s and come back whenever they
    are cut, with a 20 s handshake deadline; ranks 0 and 1 then join, and rank 0 drops its
    link and rejoins, each within 5 s. Then 48 pairs of dialers claim one free rank each at
    the same moment: never both welcomed."""
    run = hostile.LiveRun(tmp_path, world_size=2 + 48, handshake_seconds=20.0, max_pending=CAP)
    try:
        run.start_coordinator()
        target = run.target()

        async def attacks() -> tuple[dict[str, Any], dict[str, Any]]:
            holding = await hostile.slow_holders(target, 32, hold_first=1.5, join_within=5.0)
            return holding, await hostile.duplicate_rank(target, 48)

        holding, dupes = trio.run(attacks)
        run.stop()  # SIGINT: the gate logs its totals (refusal lines are rate-limited)
        log = run.coordinator_log()
    finally:
        run.kill()
    assert holding["all_joined_in_time"], (holding, log[-3000:])
    assert set(holding["joins_seconds"]) == {"join 0", "join 1", "rejoin 0"}
    assert holding["holder_counts"]["connections"] > 32  # the holders were cut and came back
    # the workers' slots were taken from the holders (one line each, or counted in the totals)
    evicted = hostile.parse_admission_log(log).totals.get("evicted", 0)
    assert "[evicted]" in log or evicted > 0, log[-3000:]
    assert dupes["outcomes"] == {"1 welcomed": 48}, dupes
    assert all("is already taken" in reason for reason in dupes["refusals"]), dupes


def test_garbage_after_a_valid_handshake_is_dropped_naming_the_rank(tmp_path: Path) -> None:
    """An authenticated peer (it holds the secret) takes the free rank 1 and sends garbage
    before joining: the coordinator names rank 1, refuses it and frees the rank; the real
    workers then train. (After a join, see the next test.)"""
    run = hostile.LiveRun(tmp_path, steps=30)
    try:
        run.start_coordinator()
        target = run.target()

        async def take_rank_1_and_send_garbage() -> list[dict[str, Any]]:
            conn, _ = await dial(
                target.address, target.secret, Identity(DEFAULT_GROUP, target.world_size, 1)
            )
            replies = []
            try:
                await conn.send_frame(struct.pack(">II", 5, 0) + b"\xff" * 5)  # with its tag
                with trio.fail_after(10):
                    replies.append(await conn.recv())
                    replies.append(await conn.recv())  # then the coordinator hangs up
            except PeerClosed:
                pass
            finally:
                await conn.aclose()
            return replies

        replies = trio.run(take_rank_1_and_send_garbage)
        assert [r["kind"] for r in replies] == ["join_refused"], replies
        assert "malformed message" in replies[0]["reason"], replies
        wait_for_log(run, ["rank 1 sent a bad message: peer 1: ", "refused rank 1: malformed"])
        run.start_worker(0)
        run.start_worker(1)
        outcome = run.finish(timeout=120)
    finally:
        run.kill()
    assert outcome.exit_codes == {"coordinator": 0, "rank 0": 0, "rank 1": 0}, (
        outcome.exit_codes,
        outcome.coordinator_log[-4000:],
    )
    assert outcome.digests_identical, outcome.digests
    assert hostile.parse_admission_log(outcome.coordinator_log).totals["admitted"] == 3


def lm_signature() -> list[list[Any]]:
    """The join message's ``params`` of the LM job as `hostile.LiveRun` runs it."""
    from paramsync.actors.demo_job.corpus import load_char_dataset
    from paramsync.actors.demo_job.model import CharTransformer
    from paramsync.runtime.coordinator.events import model_signature

    flags = dict(zip(hostile.JOB_ARGS[::2], hostile.JOB_ARGS[1::2]))
    context, d_model = int(flags["--context"]), int(flags["--d-model"])
    vocab, _ = load_char_dataset(context, max_bytes=int(hostile.CORPUS_BYTES))
    model = CharTransformer(len(vocab), d_model, 4, int(flags["--layers"]), context, seed=0)
    return [[n, list(s), d, g] for n, s, d, g in model_signature(model.named_parameters())]


def test_garbage_after_a_join_aborts_a_non_elastic_run_naming_the_rank(tmp_path: Path) -> None:
    """The test joins as rank 1 with the LM job's real model signature, receives the run's
    start, then sends garbage. The run is not elastic (no --min-workers), so the coordinator
    aborts it naming rank 1 and the bad bytes; the real rank 0 stops with the same reason."""
    run = hostile.LiveRun(tmp_path, steps=30)
    params = lm_signature()
    try:
        run.start_coordinator()
        run.start_worker(0)
        target = run.target()

        async def join_then_send_garbage() -> dict[str, Any]:
            conn, _ = await dial(
                target.address, target.secret, Identity(DEFAULT_GROUP, target.world_size, 1)
            )
            try:
                await conn.send("join", {"host": "127.0.0.1", "port": 9, "params": params})
                with trio.fail_after(60):
                    start = await conn.recv()
                await conn.send_frame(struct.pack(">II", 5, 0) + b"\xff" * 5)  # with its tag
                with trio.fail_after(10):
                    while (told := await conn.recv())["kind"] == "heartbeat":
                        pass
            finally:
                await conn.aclose()
            assert start["kind"] == "start_run", start
            return told

        told = trio.run(join_then_send_garbage)
        outcome = run.finish(timeout=60)
    finally:
        run.kill()
    assert told["kind"] == "abort" and "rank 1 sent a malformed message" in told["reason"], told
    log = outcome.coordinator_log
    assert "rank 1 sent a bad message: peer 1: malformed CBOR" in log, log[-3000:]
    assert "run aborted: rank 1 sent a malformed message" in log, log[-3000:]
    assert outcome.exit_codes == {"coordinator": 1, "rank 0": 1}, outcome.exit_codes
    assert "rank 1 sent a malformed message" in run.worker_output(0), run.worker_output(0)[-3000:]


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--max-pending-handshakes", "0", "max_pending must be at least 1"),
        ("--handshake-seconds", "0", "handshake_seconds must be positive"),
    ],
)
def test_coordinator_refuses_admission_limits_that_cannot_work(
    flag: str, value: str, words: str
) -> None:
    env = dict(os.environ, PARAMSYNC_SECRET="hostile-tests-secret")
    result = subprocess.run(
        [*CLI, "coordinator", "--world-size", "2", "--bind", "127.0.0.1:0", flag, value],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert words in result.stderr


def test_a_join_of_empty_arrays_is_refused_fast_and_the_daemon_serves_on(
    tmp_path: Path,
) -> None:
    """Issue 18, row 4, against a daemon: an authenticated peer takes the free rank 1 and sends
    a 4 MiB `join` whose ``params`` is an array of empty arrays (about 72x amplification if
    decoded; 4 MiB is within a first join's cap, `FIRST_JOIN_MAX_FRAME`, so the item bound is
    what refuses it). The coordinator refuses it from the raw bytes, quickly, naming the item
    bound; then the real workers join and train."""
    run = hostile.LiveRun(tmp_path, steps=30)
    try:
        run.start_coordinator()
        target = run.target()

        async def take_rank_1_and_send_a_bomb() -> tuple[list[dict[str, Any]], float]:
            conn, _ = await dial(
                target.address, target.secret, Identity(DEFAULT_GROUP, target.world_size, 1)
            )
            replies = []
            try:
                bomb = hostile.join_bomb(4 * 1024 * 1024)
                await conn.send_frame(bomb)  # with its tag: the peer holds the session key
                sent = time.monotonic()
                with trio.fail_after(30):
                    replies.append(await conn.recv())
                answered = time.monotonic() - sent
                with trio.fail_after(10):
                    replies.append(await conn.recv())  # then the coordinator hangs up
            except PeerClosed:
                pass
            finally:
                await conn.aclose()
            return replies, answered

        replies, answered = trio.run(take_rank_1_and_send_a_bomb)
        assert [r["kind"] for r in replies] == ["join_refused"], replies
        assert answered < 2.0, f"refused after {answered:.2f} s"
        wait_for_log(run, ["rank 1 sent a bad message: peer 1: frame announces more than"])
        run.start_worker(0)
        run.start_worker(1)
        outcome = run.finish(timeout=120)
    finally:
        run.kill()
    assert outcome.exit_codes == {"coordinator": 0, "rank 0": 0, "rank 1": 0}, (
        outcome.exit_codes,
        outcome.coordinator_log[-4000:],
    )
    assert outcome.digests_identical, outcome.digests


async def test_slow_drip_counts_a_reset_as_a_hang_up_not_a_crash() -> None:
    """A listener that cuts a slow dripper with a reset (RST: it closed with the drip's last
    bytes unread, as the daemon does at the deadline) is a refusal like any hang-up; the
    harness used to let the reset escape from its nursery as an exception group and crash
    `make reliability-hostile` in its slow_drip phase."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    target = hostile.Target("127.0.0.1", port, 2, 1.0, CAP, b"x" * 32)

    async def cut_with_a_reset() -> None:
        stream = await listener.accept()
        await stream.receive_some(1)  # the first drip byte
        linger_zero = struct.pack("ii", 1, 0)  # close with a reset, as with unread bytes
        stream.socket.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_LINGER, linger_zero)
        await stream.aclose()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cut_with_a_reset)
            (attempt,) = await hostile.slow_drip(target, 0, interval=0.05)
    await listener.aclose()
    assert attempt.refused and attempt.outcome.startswith("closed after "), attempt.outcome
    assert "reset" in attempt.outcome or "broken" in attempt.outcome, attempt.outcome


def test_the_second_reviews_attacks_are_refused_at_small_sizes(tmp_path: Path) -> None:
    """Issue 31, rows 2-6, as `benchmarks/hostile.py`'s second-review phase runs them (a daemon
    each), at small sizes: 2 MiB frames after authentication, typed arrays in hellos, early
    readies larger than the run's model needs (refused from the prefix by its frame cap; the
    core's byte budget behind it is tests/test_coordinator_hostile.py's), a squatter past the
    join deadline,
    three evictions. Each attack's refusal must still happen, every daemon serve on, and a
    legitimate worker be admitted after each."""
    sizes = hostile.ReviewSizes(mib=2, frames=1, hellos=3, squats=1, evictions=3)
    rows = trio.run(hostile.second_review, tmp_path, sizes)
    hostile.print_second_review(rows)
    by_attack = {f"{row['row']} {row['attack']}": row for row in rows}
    assert [row["row"] for row in rows] == ["2"] * 4 + ["3", "4", "4", "5", "6"], list(by_attack)
    for name, row in by_attack.items():
        assert row["ok"], (name, row)
        assert row["daemon_alive"], (name, row["daemon_log"])
        assert None not in row["admission"], (name, row["admission"])
        assert row["probes"] > 0 and not row["probe_failures"], (name, row["probe_failures"])
    for row in rows[:4]:  # row 2: the daemon hangs up on every frame
        assert all(o.endswith("closed") or "closed while sending" in o for o in row["outcomes"])
    assert all("typed arrays are refused" in o for o in rows[4]["outcomes"]), rows[4]
    for row in rows[5:7]:  # row 4: refused from the prefix by the run's model's frame cap
        assert "rank 0 was removed from the run" in row["outcome"], row
        assert "exceeds this receiver's limit of" in row["outcome"], row
    squat = rows[7]
    assert squat["outcomes"][0].startswith("nothing said; closed after"), squat
    assert 0.5 <= squat["admission"][0] <= hostile.SECOND_REVIEW_DEADLINE + 2, squat
    evicted = rows[8]
    assert evicted["outcomes"] == ["abort; closed"] * 3, evicted
    assert evicted["fds_after"] <= evicted["fds_before"] + 1, evicted
