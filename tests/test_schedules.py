"""Pipeline schedules without processes: for random pp (1..8), micro-batches and chunks, every
schedule of every kind is valid (our rules and torch.distributed.pipelining's own validator and
dry-run), runs to completion over rendezvous channels under any compute costs, matches every
send with one receive, has its kind's bubble fraction exactly in the unit-cost model, and keeps
activations in flight within its bound; bad parameters give errors naming the kind and the
numbers; the digest is stable and differs when any list differs; 1F1B at p=4, m=8 equals the list
written out by hand from Megatron's warm-up rule."""

from __future__ import annotations

import dataclasses
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining import schedules as torch_schedules

from paramsync.runtime.errors import ConfigError
from paramsync.runtime.parallel import (
    DEFAULT_COSTS,
    Action,
    ActionKind,
    InvalidSchedule,
    Schedule,
    ScheduleDeadlock,
    build_schedule,
    check_layers,
    check_schedule_parameters,
    compute_lists,
    schedule_digest,
    simulate,
    validate,
)
from paramsync.runtime.parallel.lowering import transfers_of

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
K = ActionKind


@st.composite
def schedule_parameters(draw: st.DrawFn, kinds: tuple[str, ...] | None = None) -> tuple:
    """(kind, p, m, v) that the kind accepts: pp 1..8, up to 3 rounds of micro-batches above
    the minimum, v 2..4 for interleaved."""
    kind = draw(st.sampled_from(kinds or ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")))
    p = draw(st.integers(1, 8))
    if kind == "interleaved_1f1b":
        v = draw(st.integers(2, 4))
        m = p * draw(st.integers(1, 3))
    else:
        v = 1
        low = 1 if kind == "gpipe" else p
        m = draw(st.integers(low, low + 12))
    return kind, p, m, v


# --- torch.distributed.pipelining as an independent check -------------------------------------

TORCH_KIND = {
    K.FORWARD: torch_schedules.FORWARD,
    K.BACKWARD: torch_schedules.FULL_BACKWARD,
    K.BACKWARD_INPUT: torch_schedules.BACKWARD_INPUT,
    K.BACKWARD_WEIGHT: torch_schedules.BACKWARD_WEIGHT,
    K.SEND_ACTIVATION: torch_schedules.SEND_F,
    K.RECV_ACTIVATION: torch_schedules.RECV_F,
    K.SEND_GRADIENT: torch_schedules.SEND_B,
    K.RECV_GRADIENT: torch_schedules.RECV_B,
}


def to_torch(action: Action) -> torch_schedules._Action:
    """Our action in torch's form. torch names a receive by the *receiving* stage (``3RECV_F0``
    takes stage 2's output into stage 3); ours names the stage whose tensor travels."""
    stage = action.stage
    if action.kind is K.RECV_ACTIVATION:
        stage += 1
    elif action.kind is K.RECV_GRADIENT:
        stage -= 1
    return torch_schedules._Action(stage, TORCH_KIND[action.kind], action.microbatch)


def torch_order(schedule: Schedule) -> dict[int, list[torch_schedules._Action | None]]:
    return {rank: [to_torch(a) for a in actions] for rank, actions in enumerate(schedule.actions)}


def check_with_torch(schedule: Schedule) -> None:
    """torch's validator and its comms dry-run accept our lowered lists, and torch's own
    lowering of our compute lists puts the same sends and receives on every rank."""
    order = torch_order(schedule)
    mapping = torch_schedules._validate_schedule(order, schedule.p, schedule.num_stages, schedule.m)
    assert mapping == {s: schedule.stage_to_rank(s) for s in range(schedule.num_stages)}
    torch_schedules._simulate_comms_compute(
        torch_order(schedule), schedule.stage_to_rank, schedule.num_stages
    )
    compute = {
        rank: [to_torch(a) for a in actions if a.kind.is_compute]
        for rank, actions in enumerate(schedule.actions)
    }
    add_send_recv = getattr(
        torch_schedules._add_send_recv, "__wrapped__", torch_schedules._add_send_recv
    )  # past any cache: our dict of lists is not hashable
    lowered = add_send_recv(compute, schedule.stage_to_rank, schedule.num_stages)
    for rank in range(schedule.p):
        theirs = Counter(a for a in lowered[rank] if not a.is_compute_op)
        ours = Counter(to_torch(a) for a in schedule.actions[rank] if not a.kind.is_compute)
        assert ours == theirs, f"rank {rank}"


# --- the golden case: 1F1B, p=4, m=8, by hand from Megatron's warm-up rule ----------------------


def parse(text: str) -> tuple[Action, ...]:
    """``0F3`` = stage 0 forward of micro-batch 3; ``1RECV_B0@1`` = receive from rank 1 the
    input gradient of stage 1, micro-batch 0 (our `Action.__str__` form)."""
    actions = []
    for word in text.split():
        body, _, peer = word.partition("@")
        stage = int(body[0])
        for kind in sorted(ActionKind, key=lambda k: -len(k.value)):
            if body[1:].startswith(kind.value):
                mb = int(body[1 + len(kind.value) :])
                actions.append(Action(kind, stage, mb, int(peer) if peer else None))
                break
        else:
            raise AssertionError(word)
    return tuple(actions)


def test_1f1b_golden_p4_m8() -> None:
    # Megatron: rank r warms up with p - r - 1 forwards, then F(warmup + i), B(i) alternately,
    # then the remaining backwards. Rank 0: 3 warm-up forwards; rank 3 (last): none.
    rank0 = "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7"
    rank3 = "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7"
    lists = compute_lists("1f1b", 4, 8)
    assert lists[0] == parse(rank0)
    assert lists[3] == parse(rank3)
    # The lowered lists: each receive right before the compute that needs it, each send right
    # after the compute that makes it; where both fall in one gap, the lower sender's first.
    schedule = build_schedule("1f1b", 4, 8)
    assert schedule.actions[0] == parse(
        "0F0 0SEND_F0@1 0F1 0SEND_F1@1 0F2 0SEND_F2@1 0F3 0SEND_F3@1 1RECV_B0@1 0B0 "
        "0F4 0SEND_F4@1 1RECV_B1@1 0B1 0F5 0SEND_F5@1 1RECV_B2@1 0B2 0F6 0SEND_F6@1 "
        "1RECV_B3@1 0B3 0F7 0SEND_F7@1 1RECV_B4@1 0B4 1RECV_B5@1 0B5 1RECV_B6@1 0B6 "
        "1RECV_B7@1 0B7"
    )
    assert schedule.actions[3] == parse(
        "2RECV_F0@2 3F0 3B0 2RECV_F1@2 3SEND_B0@2 3F1 3B1 2RECV_F2@2 3SEND_B1@2 3F2 3B2 "
        "2RECV_F3@2 3SEND_B2@2 3F3 3B3 2RECV_F4@2 3SEND_B3@2 3F4 3B4 2RECV_F5@2 3SEND_B4@2 "
        "3F5 3B5 2RECV_F6@2 3SEND_B5@2 3F6 3B6 2RECV_F7@2 3SEND_B6@2 3F7 3B7 3SEND_B7@2"
    )
    assert schedule.describe(3).splitlines()[:2] == ["   0 2RECV_F0@2", "   1 3F0"]


def test_gpipe_and_zero_bubble_shapes() -> None:
    assert compute_lists("gpipe", 2, 3)[1] == parse("1F0 1F1 1F2 1B0 1B1 1B2")
    # ZB-H1, p=3, m=4: rank r defers its first r weight gradients; the rest follow each I.
    zb = compute_lists("zero_bubble", 3, 4)
    assert zb[0] == parse("0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3")
    assert zb[2] == parse("2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3")
    # Interleaved, p=2, v=2, m=2: stage s on rank s % 2; rank 0 warms up 2*(2-0-1)+(2-1)*2 = 4.
    assert compute_lists("interleaved_1f1b", 2, 2, 2)[0] == parse("0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1")


# --- every schedule: valid, deadlock-free, matched, its bubble and its memory ------------------


@SETTINGS
@given(schedule_parameters())
def test_every_schedule_is_valid_and_runs(params: tuple) -> None:
    kind, p, m, v = params
    schedule = build_schedule(kind, p, m, v)
    assert (schedule.kind, schedule.p, schedule.m, schedule.v) == (kind, p, m, v)
    validate(schedule)
    check_with_torch(schedule)
    # Every transfer a compute implies is in the lists once, on the right ranks.
    implied: Counter[tuple[int, Action]] = Counter()
    for rank, actions in enumerate(schedule.actions):
        for action in actions:
            if action.kind.is_compute:
                recvs, sends = transfers_of(
                    action, rank, schedule.num_stages, schedule.stage_to_rank
                )
                implied.update((rank, a) for a in recvs + sends)
    present = Counter(
        (rank, a)
        for rank, actions in enumerate(schedule.actions)
        for a in actions
        if not a.kind.is_compute
    )
    assert present == implied
    assert all(n == 1 for n in present.values())
    # Sends and receives pair one to one, with unique tags in a step.
    sends = {(r, a.peer, a.kind, a.stage, a.microbatch) for r, a in present if a.kind.is_send}
    recvs = {(a.peer, r, a.kind, a.stage, a.microbatch) for r, a in present if a.kind.is_recv}
    partner = {K.SEND_ACTIVATION: K.RECV_ACTIVATION, K.SEND_GRADIENT: K.RECV_GRADIENT}
    assert {(s, d, partner[k], st_, mb) for s, d, k, st_, mb in sends} == recvs
    tags = [a.tag(7) for _, a in present if a.kind.is_send]
    assert len(tags) == len(set(tags))
    # Each rank's compute: every micro-batch forwarded once per stage, one backward each.
    result = simulate(schedule)
    for rank in range(p):
        computes = Counter(
            (t.action.kind, t.action.stage)
            for t in result.timelines[rank]
            if t.action.kind.is_compute
        )
        for stage in schedule.stages_of(rank):
            assert computes[(K.FORWARD, stage)] == m
            if kind == "zero_bubble":
                assert (
                    computes[(K.BACKWARD_INPUT, stage)] == computes[(K.BACKWARD_WEIGHT, stage)] == m
                )
            else:
                assert computes[(K.BACKWARD, stage)] == m
        assert len(result.timelines[rank]) == len(schedule.actions[rank])


def placement(schedule: Schedule) -> Counter[str]:
    """Counts receives right before (only transfers between) the compute that needs them, and
    sends right after the compute that makes them, against the others."""
    counts: Counter[str] = Counter()
    for actions in schedule.actions:
        computes = [i for i, a in enumerate(actions) if a.kind.is_compute]
        for i, a in enumerate(actions):
            if a.kind.is_recv:
                after = actions[min(c for c in computes if c > i)]
                wants = (
                    (K.FORWARD,) if a.kind is K.RECV_ACTIVATION else (K.BACKWARD, K.BACKWARD_INPUT)
                )
                hit = after.kind in wants and after.microbatch == a.microbatch
                counts["recv right before" if hit else "recv earlier"] += 1
            elif a.kind.is_send:
                before = actions[max(c for c in computes if c < i)]
                hit = (before.stage, before.microbatch) == (a.stage, a.microbatch)
                counts["send right after" if hit else "send later"] += 1
    return counts


@SETTINGS
@given(schedule_parameters())
def test_transfers_sit_next_to_their_computes(params: tuple) -> None:
    # GPipe and 1F1B: every receive right before its compute, every send right after its own.
    # ZB-H1: every receive right before; a send may wait past a W until its receiver is free.
    # Interleaved: a receive comes earlier, or a send later, only where the receiver's compute
    # starts while the sender computes (rendezvous needs both between computes).
    kind, p, m, v = params
    counts = placement(build_schedule(kind, p, m, v))
    if kind in ("gpipe", "1f1b"):
        assert counts["recv earlier"] == counts["send later"] == 0
    if kind == "zero_bubble":
        assert counts["recv earlier"] == 0
    assert counts["recv earlier"] <= counts["recv right before"]


def idle_time(result) -> Fraction:
    return len(result.busy) * result.makespan - sum(result.busy)


@SETTINGS
@given(
    schedule_parameters(("gpipe", "1f1b")),
    st.integers(1, 4),
    st.integers(1, 4),
)
def test_gpipe_and_1f1b_bubble_is_the_formula_for_any_uniform_costs(
    params: tuple, forward: int, backward: int
) -> None:
    kind, p, m, _ = params
    result = simulate(build_schedule(kind, p, m), {"F": forward, "B": backward})
    assert result.bubble_fraction == Fraction(p - 1, m + p - 1)
    assert result.makespan == (m + p - 1) * (forward + backward)


@SETTINGS
@given(schedule_parameters(("interleaved_1f1b",)))
def test_interleaved_bubble_is_the_formula_in_the_unit_cost_model(params: tuple) -> None:
    # Unit-cost model: one chunk's F = 1/v, B = 2/v (Megatron's warm-up of 2 per hop is made
    # for B = 2F; with other ratios the bubble is larger, so the formula is tested here only).
    _, p, m, v = params
    result = simulate(build_schedule("interleaved_1f1b", p, m, v))
    assert result.bubble_fraction == Fraction(p - 1, v * m + p - 1)
    plain = simulate(build_schedule("1f1b", p, m))
    assert result.makespan <= plain.makespan


@SETTINGS
@given(schedule_parameters(("zero_bubble",)))
def test_zero_bubble_h1_idles_a_third_of_1f1b(params: tuple) -> None:
    # The bound tested, and why: ZB-H1's idle time per rank is (p - 1) * (F + I - W) against
    # 1F1B's (p - 1) * (F + B) (arXiv 2401.10241, section 3). In the unit-cost model F = I = W
    # = 1, B = I + W = 2 that is p - 1 against 3 (p - 1): exactly a third of the idle time. As a
    # fraction of the (shorter) makespan that is (p - 1) / (3m + p - 1), 1F1B's (p - 1) / (m + p
    # - 1) times (m + p - 1) / (3m + p - 1): "about a third", tending to a third as m grows.
    _, p, m, _ = params
    zero_bubble = simulate(build_schedule("zero_bubble", p, m))
    one_f_one_b = simulate(build_schedule("1f1b", p, m))
    assert 3 * idle_time(zero_bubble) == idle_time(one_f_one_b)
    assert zero_bubble.bubble_fraction == Fraction(p - 1, 3 * m + p - 1)
    if p > 1:
        ratio = zero_bubble.bubble_fraction / one_f_one_b.bubble_fraction
        assert ratio == Fraction(m + p - 1, 3 * m + p - 1)
    assert zero_bubble.makespan == 3 * m + p - 1


@SETTINGS
@given(schedule_parameters())
def test_activations_in_flight_stay_within_the_bound(params: tuple) -> None:
    kind, p, m, v = params
    result = simulate(build_schedule(kind, p, m, v))
    for rank, peak in enumerate(result.peak_in_flight):
        if kind == "gpipe":
            bound = m
        elif kind == "interleaved_1f1b":  # the warm-up forwards plus the first steady one
            bound = min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1)
        else:  # 1F1B and ZB-H1: p - rank
            bound = p - rank
        assert peak <= bound
        assert peak == min(bound, m * v)  # and the schedules use all of it
        if kind != "zero_bubble":
            assert result.peak_held[rank] == peak
    if kind == "zero_bubble":
        # ZB-H1 keeps a micro-batch's activations from F until W. Rank r defers r W's, so it
        # holds up to (p - r) + r = p: 1F1B's peak (rank 0's p), on every rank.
        one_f_one_b = simulate(build_schedule("1f1b", p, m))
        assert max(result.peak_held) == max(one_f_one_b.peak_held) == p
        assert all(held <= p for held in result.peak_held)


@SETTINGS
@given(
    schedule_parameters(),
    st.fixed_dictionaries({k: st.fractions(Fraction(1, 8), 8) for k in ("F", "B", "I", "W")}),
)
def test_no_deadlock_under_any_compute_costs(params: tuple, costs: dict) -> None:
    # The lowering writes every rank's transfers in one global order; that makes the lists
    # deadlock-free whatever the compute times (see runtime/parallel/lowering.py).
    kind, p, m, v = params
    result = simulate(build_schedule(kind, p, m, v), costs)
    assert result.makespan >= max(result.busy)
    assert 0 <= result.bubble_fraction < 1


# --- the simulator and the validator catch broken lists ---------------------------------------


def replace(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    lists = list(schedule.actions)
    lists[rank] = tuple(actions)
    return dataclasses.replace(schedule, actions=tuple(lists))


def test_simulator_reports_a_deadlock_naming_each_blocked_action() -> None:
    schedule = build_schedule("1f1b", 2, 2)
    # Rank 1 waits for micro-batch 1's activation before returning micro-batch 0's gradient,
    # and rank 0 now wants that gradient before it sends micro-batch 1: a cycle.
    rank0 = list(schedule.actions[0])
    send_f1 = Action(K.SEND_ACTIVATION, 0, 1, peer=1)
    recv_b0 = Action(K.RECV_GRADIENT, 1, 0, peer=1)
    rank0.remove(send_f1)
    rank0.insert(rank0.index(recv_b0) + 1, send_f1)
    rank1 = list(schedule.actions[1])
    recv_f1 = Action(K.RECV_ACTIVATION, 0, 1, peer=0)
    send_b0 = Action(K.SEND_GRADIENT, 1, 0, peer=0)
    rank1.remove(recv_f1)
    rank1.insert(rank1.index(send_b0), recv_f1)
    broken = replace(replace(schedule, 0, rank0), 1, rank1)
    validate(broken)  # each list alone keeps every rule
    with pytest.raises(ScheduleDeadlock) as caught:
        simulate(broken)
    assert "rank 0 blocked at index" in str(caught.value) and "1RECV_B0@1" in str(caught.value)
    assert "rank 1 blocked at index" in str(caught.value) and "0RECV_F1@0" in str(caught.value)
    assert set(caught.value.blocked) == {0, 1}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda a: a[1:], "rank 0, index 0"),  # 0F0's activation sent before 0F0 ran
        (lambda a: [x for x in a if x != Action(K.RECV_GRADIENT, 1, 2, peer=1)], "0B2"),
        (lambda a: [*a, Action(K.FORWARD, 0, 0)], "forwards this micro-batch a second time"),
        (lambda a: [x for x in a if x != Action(K.BACKWARD, 0, 3)], "never finishes the backward"),
        (
            lambda a: [Action(K.BACKWARD, 0, 0), *a],
            "rank 0, index 0, action 0B0: backward before this micro-batch's forward",
        ),
        (
            lambda a: [
                x
                if x != Action(K.SEND_ACTIVATION, 0, 1, peer=1)
                else Action(K.SEND_ACTIVATION, 0, 1, peer=2)
                for x in a
            ],
            "belongs on rank 0 with peer 1",
        ),
    ],
)
def test_validate_names_rank_index_and_action(mutate, message: str) -> None:
    schedule = build_schedule("1f1b", 3, 4)
    broken = replace(schedule, 0, mutate(list(schedule.actions[0])))
    with pytest.raises(InvalidSchedule, match="rank 0") as caught:
        validate(broken)
    assert message in str(caught.value)


def test_validate_checks_weight_after_input_and_unmatched_transfers() -> None:
    schedule = build_schedule("zero_bubble", 2, 3)
    rank1 = list(schedule.actions[1])
    w0 = Action(K.BACKWARD_WEIGHT, 1, 0)
    rank1.remove(w0)
    rank1.insert(rank1.index(Action(K.BACKWARD_INPUT, 1, 0)), w0)
    with pytest.raises(InvalidSchedule, match=r"rank 1, index \d+, action 1W0: BACKWARD_WEIGHT"):
        validate(replace(schedule, 1, rank1))
    rank1 = [a for a in schedule.actions[1] if a != Action(K.SEND_GRADIENT, 1, 2, peer=0)]
    with pytest.raises(
        InvalidSchedule, match=r"rank 0, index \d+, action 1RECV_B2@1: no matching send on rank 1"
    ):
        validate(replace(schedule, 1, rank1))
    send = Action(K.SEND_GRADIENT, 1, 2, peer=0)
    rank1 = [*schedule.actions[1], send]
    first = schedule.actions[1].index(send)
    with pytest.raises(
        InvalidSchedule,
        match=rf"rank 1, index {len(rank1) - 1}, action 1SEND_B2@0: its tag repeats in the step "
        rf"\(first at rank 1, index {first}\)",
    ):
        validate(replace(schedule, 1, rank1))


def test_single_rank_interleaved_keeps_chunk_order_locally() -> None:
    schedule = build_schedule("interleaved_1f1b", 1, 3, 3)
    assert all(a.kind.is_compute for a in schedule.actions[0])  # no transfers on one rank
    validate(schedule)
    check_with_torch(schedule)
    assert simulate(schedule).bubble_fraction == 0
    swapped = list(schedule.actions[0])
    i, j = swapped.index(Action(K.FORWARD, 0, 0)), swapped.index(Action(K.FORWARD, 1, 0))
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(InvalidSchedule, match="runs before stage 0's forward on this rank"):
        validate(replace(schedule, 0, swapped))


# --- parameters --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("1f1b", 4, 3, 1), ["1f1b", "num_microbatches=3", "pp_size=4"]),
        (("zero_bubble", 8, 7, 1), ["zero_bubble", "num_microbatches=7", "pp_size=8"]),
        (("interleaved_1f1b", 4, 6, 2), ["interleaved_1f1b", "num_microbatches=6", "pp_size=4"]),
        (("interleaved_1f1b", 4, 2, 2), ["interleaved_1f1b", "num_microbatches=2"]),
        (("interleaved_1f1b", 2, 4, 1), ["interleaved_1f1b", "chunks >= 2", "got 1"]),
        (("gpipe", 2, 4, 2), ["gpipe", "chunks=2"]),
        (("1f1b", 2, 4, 3), ["1f1b", "chunks=3"]),
        (("gpipe", 0, 4, 1), ["gpipe", "pp_size must be >= 1, got 0"]),
        (("gpipe", 2, 0, 1), ["gpipe", "num_microbatches must be >= 1, got 0"]),
        (("dualpipe", 2, 4, 1), ["'dualpipe'", "gpipe"]),
        (("1f1b", 2.0, 4, 1), ["1f1b", "pp_size must be an integer"]),
        (("interleaved_1f1b", 2048, 2048, 3), ["6144 stages", "tag limit"]),
    ],
)
def test_bad_parameters_name_the_kind_and_the_numbers(args: tuple, words: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        check_schedule_parameters(*args)
    assert isinstance(caught.value, ValueError)
    for word in words:
        assert word in str(caught.value)
    with pytest.raises(ValueError, match=str(args[0])):
        build_schedule(*args)


def test_good_parameters_and_layers() -> None:
    check_schedule_parameters("gpipe", 4, 1)  # GPipe runs fewer micro-batches than stages
    check_schedule_parameters("1f1b", 4, 4)
    check_schedule_parameters("interleaved_1f1b", 4, 8, 3)
    check_layers(12, 2, 3)
    check_layers(8, 1)
    with pytest.raises(ConfigError, match=r"10 layers .* 2 \* 3 = 6 pipeline stages"):
        check_layers(10, 2, 3)
    with pytest.raises(ConfigError, match="0 layers"):
        check_layers(0, 1, 1)


# --- the digest --------------------------------------------------------------------------------


def test_digest_is_stable() -> None:
    a = build_schedule("interleaved_1f1b", 4, 8, 2)
    b = build_schedule("interleaved_1f1b", 4, 8, 2)
    assert a == b and schedule_digest(a) == schedule_digest(b)
    assert len(schedule_digest(a)) == 32
    # Pinned: the canonical CBOR encoding is part of the coordinator's contract across
    # processes and versions; a change of encoding or of the 1F1B lists shows here.
    assert schedule_digest(build_schedule("1f1b", 4, 8)).hex() == GOLDEN_1F1B_DIGEST


GOLDEN_1F1B_DIGEST = "589b2e1eedec195227a50485448cc4e8a6224a710b73d64e4c79042b9cc14da5"


@SETTINGS
@given(schedule_parameters(), st.data())
def test_digest_differs_when_any_list_differs(params: tuple, data: st.DataObject) -> None:
    kind, p, m, v = params
    schedule = build_schedule(kind, p, m, v)
    digest = schedule_digest(schedule)
    rank = data.draw(st.integers(0, p - 1))
    actions = list(schedule.actions[rank])
    index = data.draw(st.integers(0, len(actions) - 1))
    change = data.draw(st.sampled_from(["drop", "swap", "microbatch", "peer"]))
    target = actions[index]
    if change == "drop":
        del actions[index]
    elif change == "swap":
        other = data.draw(st.integers(0, len(actions) - 1).filter(lambda i: actions[i] != target))
        actions[index], actions[other] = actions[other], target
    elif change == "microbatch":
        actions[index] = dataclasses.replace(target, microbatch=target.microbatch + m)
    else:
        peer = 0 if target.peer is None else target.peer + p
        actions[index] = dataclasses.replace(
            target, kind=target.kind if target.peer is not None else K.SEND_ACTIVATION, peer=peer
        )
    assert schedule_digest(replace(schedule, rank, actions)) != digest
    for field, value in (("kind", "other"), ("p", p + 1), ("m", m + 1), ("v", v + 1)):
        assert schedule_digest(dataclasses.replace(schedule, **{field: value})) != digest


# --- measured costs per stage -------------------------------------------------------------------


KINDS = (K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT)


def _stages_of(schedule: Schedule) -> set[int]:
    return {a.stage for actions in schedule.actions for a in actions if a.kind.is_compute}


@SETTINGS
@given(schedule_parameters())
def test_stage_costs_equal_to_the_unit_model_give_its_exact_timelines(params: tuple) -> None:
    """Every stage given the unit model's costs (divided by v, as `costs` are) runs exactly as
    the unit model: same timelines, makespan and bubble."""
    kind, p, m, v = params
    schedule = build_schedule(kind, p, m, v)
    unit = {k: c / v for k, c in DEFAULT_COSTS.items()}
    measured = simulate(schedule, stage_costs={s: unit for s in _stages_of(schedule)})
    assert measured == simulate(schedule)


@SETTINGS
@given(schedule_parameters(), st.data())
def test_a_slower_stage_never_shortens_the_step(params: tuple, data: st.DataObject) -> None:
    """Measured per-stage costs: making one stage's action slower never shortens the makespan,
    and the makespan is at least every rank's busy time."""
    kind, p, m, v = params
    schedule = build_schedule(kind, p, m, v)
    stages = sorted(_stages_of(schedule))
    cost = st.fractions(min_value=0, max_value=5, max_denominator=8)
    base = {
        s: {
            k: data.draw(cost) for k in (K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT)
        }
        for s in stages
    }
    before = simulate(schedule, stage_costs=base)
    slow_stage = data.draw(st.sampled_from(stages))
    slow_kind = data.draw(st.sampled_from(sorted(base[slow_stage], key=lambda k: k.value)))
    slower = {s: dict(c) for s, c in base.items()}
    slower[slow_stage][slow_kind] += data.draw(st.fractions(min_value=0, max_value=3))
    after = simulate(schedule, stage_costs=slower)
    assert after.makespan >= before.makespan
    assert all(after.makespan >= busy for busy in after.busy)


def test_stage_costs_name_a_missing_stage_and_refuse_both_forms() -> None:
    schedule = build_schedule("1f1b", 2, 4, 1)
    with pytest.raises(ValueError, match="no FORWARD cost for stage 1"):
        simulate(schedule, stage_costs={0: {"F": 1, "B": 2}})
    with pytest.raises(ValueError, match="not both"):
        simulate(schedule, {"F": 1}, stage_costs={0: {"F": 1, "B": 2}, 1: {"F": 1, "B": 2}})
    with pytest.raises(ValueError, match=r"stage_costs\[0\]: FORWARD must be >= 0"):
        simulate(schedule, stage_costs={0: {"F": -1, "B": 2}, 1: {"F": 1, "B": 2}})
