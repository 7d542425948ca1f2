"""Pipeline stages executing schedules (`paramsync.actors.parallel.pipeline`) against one process.

Every case trains a small transformer (embedding, encoder layers with dropout 0, head) for 5
optimizer steps (SGD with momentum; `pipeline_fixtures.make_optimizer` says why not Adam) on the
same micro-batches as the single-process reference (`pipeline_fixtures.reference_training`: each
micro-batch in order with loss / m, gradients accumulated, replicas averaged) and compares every
weight of every rank with the reference's: bitwise (``torch.equal``) where the arithmetic is the
same (stage gradients fold in micro-batch order, whatever the schedule), within 1e-5 relative /
4e-5 absolute where it is not (tied embeddings: the two copies' gradients are summed after the
step, the reference sums them per micro-batch). Worlds run in one process (InProcessTransport),
two cases over TCP (messages on threads over the lent connections, and through trio); a rank
failing in the middle of a schedule makes every rank fail, never hang, on either path.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from functools import partial

import pytest
import torch
import trio
import trio.testing
from conftest import open_group
from pipeline_fixtures import (
    D_MODEL,
    MICRO_BATCH,
    SEQ,
    batches,
    gpipe,
    looped_bfs,
    loss_fn,
    make_optimizer,
    one_f_one_b,
    reference_training,
    tied_names,
    transformer_blocks,
)

from paramsync.actors.parallel.microbatch_grads import OrderedGradients
from paramsync.actors.parallel.pipeline import PipelineStage, split_microbatches
from paramsync.actors.parallel.pipeline_grads import new_embedding_group
from paramsync.actors.parallel.stages import rank_stages, split_blocks
from paramsync.runtime.collectives.mesh import init_device_mesh
from paramsync.runtime.errors import PeerClosed, ProtocolError, StallError
from paramsync.runtime.parallel.actions import Action, ActionKind
from paramsync.runtime.parallel.schedules import SCHEDULE_KINDS, build_schedule
from paramsync.runtime.transport.base import Transport

STEPS = 5
SHAPE = (MICRO_BATCH, SEQ, D_MODEL)
SECONDS = 120.0


async def _train_rank(
    world: Transport,
    model: torch.nn.Sequential,
    lists: Sequence[Sequence[Action]],
    data: list,
    *,
    pp: int,
    dp: int,
    v: int,
    tied: bool,
    mesh_names: tuple[str, ...],
    steps: int = STEPS,
    thread_links: bool = True,
) -> tuple[PipelineStage, list[float | None]]:
    """One world rank: its mesh (pp, dp[, tp of 1]), its stage, ``steps`` training steps."""
    sizes = {"pp": pp, "dp": dp, "tp": 1}
    mesh = await init_device_mesh(world, mesh_names, tuple(sizes[name] for name in mesh_names))
    embedding = await new_embedding_group(world, mesh.groups("pp")) if tied else None
    blocks = copy.deepcopy(model)
    stage = PipelineStage.from_blocks(
        blocks,
        pp_group=mesh.group("pp"),
        chunks_per_rank=v,
        loss_fn=loss_fn,
        activation_shape=SHAPE,
        dp_group=mesh.group("dp"),
        embedding_group=embedding,
        tied=tied_names(blocks) if tied else (),
        thread_links=thread_links,
    )
    await stage.sync_tied_weights()
    optimizer = make_optimizer(stage.parameters())
    replica = mesh.coordinate("dp")
    losses = []
    for step in range(steps):
        inputs, targets = data[step][replica]
        losses.append(await stage.train_step(lists[stage.rank], inputs, targets, optimizer))
    await mesh.aclose()
    if embedding is not None:
        await embedding.aclose()
    return stage, losses


def _train(
    lists: Sequence[Sequence[Action]],
    *,
    pp: int,
    dp: int = 1,
    v: int = 1,
    m: int = 4,
    layers: int = 2,
    tied: bool = False,
    kind: str = "inproc",
    mesh_names: tuple[str, ...] = ("pp", "dp"),
    thread_links: bool = True,
) -> tuple[torch.nn.Sequential, list[float], list[tuple[PipelineStage, list[float | None]]]]:
    model = transformer_blocks(layers, tied=tied)
    data = batches(STEPS, m, replicas=dp)
    reference, reference_losses = reference_training(model, data, STEPS)

    async def main() -> list:
        with trio.fail_after(SECONDS):
            async with open_group(kind, pp * dp) as world:
                results: list = [None] * len(world)

                async def one(t: Transport) -> None:
                    results[t.rank] = await _train_rank(
                        t,
                        model,
                        lists,
                        data,
                        pp=pp,
                        dp=dp,
                        v=v,
                        tied=tied,
                        mesh_names=mesh_names,
                        thread_links=thread_links,
                    )

                async with trio.open_nursery() as nursery:
                    for t in world:
                        nursery.start_soon(one, t)
                return results

    return reference, reference_losses, trio.run(main)


def _compare(
    reference: torch.nn.Sequential,
    reference_losses: list[float],
    results: list[tuple[PipelineStage, list[float | None]]],
    *,
    exact: bool,
) -> None:
    """Every rank's weights against the reference's (by the whole model's names), and the loss
    replica 0's first and last pipeline ranks returned against the reference's (replica 0's)."""
    expected = dict(reference.named_parameters())
    for index, block in enumerate(reference):  # a tied weight is named once: add its alias
        for name, p in block.named_parameters(remove_duplicate=False):
            expected.setdefault(f"{index}.{name}", p)
    compared = 0
    for stage, _ in results:
        for chunk in stage.chunks.values():
            for name, p in chunk.named_parameters(remove_duplicate=False):
                index, rest = name.split(".", 1)
                full = f"{int(index) + chunk.first_block}.{rest}"
                want = expected[full]
                if exact:
                    assert torch.equal(p, want), f"rank {stage.rank} {full} differs"
                else:
                    torch.testing.assert_close(p, want, rtol=1e-5, atol=4e-5, msg=full)
                compared += 1
    assert compared >= len(expected)
    dp = results[0][0].dp_group.world_size if results[0][0].dp_group is not None else 1
    for world_rank in (0, len(results) - dp):  # mesh ("pp", "dp"): (0, 0) and (pp - 1, 0)
        assert results[world_rank][1] == pytest.approx(reference_losses, rel=1e-6)


HAND_WRITTEN = {
    "gpipe-reverse-backward": lambda pp, m: gpipe(pp, m, reverse_backward=True),
    "1f1b-split-backward-weights-last": lambda pp, m: one_f_one_b(pp, m, split=True),
}
GENERATED = [
    # kind, pp, v (chunks per rank), m, encoder layers (p * v stages divide layers + 2 blocks)
    ("gpipe", 2, 1, 4, 2),
    ("gpipe", 4, 1, 8, 2),
    ("1f1b", 2, 1, 4, 2),
    ("1f1b", 4, 1, 8, 2),
    ("interleaved_1f1b", 2, 2, 4, 2),
    ("interleaved_1f1b", 4, 2, 8, 6),
    ("zero_bubble", 2, 1, 4, 2),
    ("zero_bubble", 4, 1, 8, 2),
]
assert {case[0] for case in GENERATED} == set(SCHEDULE_KINDS)


@pytest.mark.parametrize(("kind", "pp", "v", "m", "layers"), GENERATED)
def test_every_generated_schedule_is_bitwise_the_single_process_run(
    kind: str, pp: int, v: int, m: int, layers: int
) -> None:
    """build_schedule's lists for every kind on p = 2 and p = 4 (interleaved with v = 2: 4 and
    8 stages): every weight equal to the reference's, bit for bit, after 5 steps."""
    lists = build_schedule(kind, pp, m, v).actions
    reference, losses, results = _train(lists, pp=pp, v=v, m=m, layers=layers)
    _compare(reference, losses, results, exact=True)


@pytest.mark.parametrize("name", sorted(HAND_WRITTEN))
def test_hand_written_orders_give_the_same_bits(name: str) -> None:
    """Backwards in reverse micro-batch order, or every weight gradient deferred to the end:
    gradients still fold in micro-batch order, so the weights are the reference's bit for bit."""
    reference, losses, results = _train(HAND_WRITTEN[name](2, 4), pp=2)
    _compare(reference, losses, results, exact=True)


def test_one_stage_is_the_single_process_run() -> None:
    reference, losses, results = _train(build_schedule("1f1b", 1, 3).actions, pp=1, m=3)
    _compare(reference, losses, results, exact=True)


def test_two_chunks_per_rank_looped_breadth_first() -> None:
    reference, losses, results = _train(looped_bfs(2, 4, 2), pp=2, v=2)
    _compare(reference, losses, results, exact=True)


def test_data_parallel_two_by_pipeline_two_averages_the_replicas() -> None:
    """A ("pp", "dp", "tp") mesh of 2 x 2 x 1: each stage's replicas average their gradients
    over their dp group, bitwise the reference's average of the replicas."""
    lists = build_schedule("1f1b", 2, 4).actions
    reference, losses, results = _train(lists, pp=2, dp=2, mesh_names=("pp", "dp", "tp"))
    _compare(reference, losses, results, exact=True)
    # world ranks 0 and 1 are stage 0 of replicas 0 and 1: identical weights
    for a, b in zip(results[0][0].parameters(), results[1][0].parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dp", [1, 2])
def test_tied_embeddings_stay_tied_and_match_within_tolerance(dp: int) -> None:
    lists = build_schedule("1f1b", 2, 4).actions
    reference, losses, results = _train(lists, pp=2, dp=dp, tied=True)
    _compare(reference, losses, results, exact=False)
    first, last = results[0][0], results[-1][0]
    assert len(first.tied_params) == len(last.tied_params) == 1
    assert torch.equal(first.tied_params[0], last.tied_params[0])  # the copies never drift


def test_over_tcp_in_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Interleaved 1F1B over TcpTransport: activations and gradients share each link, moved
    on threads over the lent connections (trio's p2p is never called)."""

    def not_through_trio(*args: object, **kwargs: object) -> None:
        raise AssertionError("a message went through trio, not the lent links")

    monkeypatch.setattr("paramsync.actors.parallel.pipeline.isend", not_through_trio)
    monkeypatch.setattr("paramsync.actors.parallel.pipeline.recv", not_through_trio)
    lists = build_schedule("interleaved_1f1b", 2, 4, 2).actions
    reference, losses, results = _train(lists, pp=2, v=2, kind="tcp")
    _compare(reference, losses, results, exact=True)


def test_over_tcp_through_trio_gives_the_same_bits() -> None:
    """``thread_links=False``: the same run with the messages through trio's p2p."""
    lists = build_schedule("1f1b", 2, 4).actions
    reference, losses, results = _train(lists, pp=2, kind="tcp", thread_links=False)
    _compare(reference, losses, results, exact=True)


# ------------------------------------------------------------------------ failures


def _stage(t: Transport, **options: object) -> PipelineStage:
    return PipelineStage.from_blocks(
        copy.deepcopy(transformer_blocks(2)),
        pp_group=t,
        loss_fn=options.pop("loss", loss_fn),  # type: ignore[arg-type]
        activation_shape=options.pop("shape", SHAPE),  # type: ignore[arg-type]
        **options,  # type: ignore[arg-type]
    )


async def _run_stages(
    kind: str,
    stage_class: type[PipelineStage],
    lists: Sequence[Sequence[Action]],
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    *,
    step: int | None = None,
) -> list[PipelineStage]:
    """One ``stage_class`` stage per rank of a 2-rank ``kind`` world, each over its half of the
    same 2-block transformer, running its list once; the stages, in rank order."""
    stages: dict[int, PipelineStage] = {}
    async with open_group(kind, 2) as world:
        model = transformer_blocks(2)

        async def one(t: Transport) -> None:
            stage = stage_class.from_blocks(
                copy.deepcopy(model), pp_group=t, loss_fn=loss_fn, activation_shape=SHAPE
            )
            stages[t.rank] = stage
            await stage.run_schedule(lists[t.rank], inputs, targets, step=step)

        with trio.fail_after(SECONDS):
            async with trio.open_nursery() as nursery:
                for t in world:
                    nursery.start_soon(one, t)
    return [stages[rank] for rank in sorted(stages)]


@pytest.mark.parametrize("kind", ["inproc", "tcp"])
def test_a_rank_failing_mid_schedule_fails_every_rank_and_never_hangs(kind: str) -> None:
    """Pipeline rank 1's loss raises on micro-batch 2 of step 1: rank 1 raises that error,
    closes its groups, and ranks 0 and 2 fail with PeerClosed (all within the deadline)."""
    calls = {"n": 0}

    def failing_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 4 + 3:
            raise RuntimeError("loss exploded")
        return loss_fn(out, target)

    data = batches(2, 4)
    lists = build_schedule("1f1b", 4, 4).actions

    async def rank(t: Transport) -> BaseException | None:
        blocks = copy.deepcopy(transformer_blocks(2))
        stage = PipelineStage.from_blocks(
            blocks, pp_group=t, loss_fn=failing_loss, activation_shape=SHAPE
        )
        optimizer = make_optimizer(stage.parameters())
        try:
            for step in range(2):
                inputs, targets = data[step][0]
                await stage.train_step(lists[t.rank], inputs, targets, optimizer)
        except Exception as exc:
            return exc
        return None

    async def main() -> list:
        with trio.fail_after(SECONDS):
            async with open_group(kind, 4) as world:
                results: list = [None] * 4

                async def one(t: Transport) -> None:
                    results[t.rank] = await rank(t)

                async with trio.open_nursery() as nursery:
                    for t in world:
                        nursery.start_soon(one, t)
                return results

    results = trio.run(main)
    assert isinstance(results[3], RuntimeError) and "loss exploded" in str(results[3])
    assert any("step 1" in note for note in results[3].__notes__)
    for index in (0, 1, 2):
        assert isinstance(results[index], PeerClosed), results[index]


@pytest.mark.parametrize("kind", ["inproc", "tcp"])
def test_a_silent_peer_is_a_stall_error_naming_step_action_and_peer(kind: str) -> None:
    async def main() -> BaseException:
        async with open_group(kind, 2) as world:
            stage = _stage(world[1], recv_seconds=0.5)
            with pytest.raises(StallError) as caught:
                await stage.run_schedule(one_f_one_b(2, 2)[1], None, batches(1, 2)[0][0][1])
            with pytest.raises(RuntimeError, match="previous step failed"):
                await stage.run_schedule(one_f_one_b(2, 2)[1], None, batches(1, 2)[0][0][1])
            return caught.value

    error = trio.run(main)
    assert "step 0" in str(error) and "0RECV_F0@0" in str(error) and "rank 0" in str(error)


@pytest.mark.parametrize("kind", ["inproc", "tcp"])
def test_a_shape_the_receiver_does_not_expect_is_a_protocol_error(kind: str) -> None:
    """The receiver declares another activation shape: p2p refuses the message."""

    async def main() -> list:
        async with open_group(kind, 2) as world:
            lists = gpipe(2, 2)
            inputs, targets = batches(1, 2)[0][0]

            async def one(t: Transport) -> BaseException | None:
                shape = SHAPE if t.rank == 0 else (MICRO_BATCH, SEQ + 1, D_MODEL)
                stage = _stage(t, shape=shape)
                try:
                    await stage.run_schedule(lists[t.rank], inputs, targets)
                except Exception as exc:
                    return exc
                return None

            results: list = [None, None]

            async def run(t: Transport) -> None:
                results[t.rank] = await one(t)

            with trio.fail_after(SECONDS):
                async with trio.open_nursery() as nursery:
                    for t in world:
                        nursery.start_soon(run, t)
            return results

    results = trio.run(main)
    assert isinstance(results[1], ProtocolError) and "shape" in str(results[1])
    assert isinstance(results[0], PeerClosed)


@pytest.mark.parametrize("kind", ["inproc", "tcp"])
def test_receiving_in_another_order_than_the_peer_sends_is_refused_never_swapped(
    kind: str,
) -> None:
    """Rank 1 receives micro-batch 1's activation first while rank 0 sends micro-batch 0's
    first: a ProtocolError naming both tags on rank 1, and rank 0 fails too."""
    f, r, s = ActionKind.FORWARD, ActionKind.RECV_ACTIVATION, ActionKind.SEND_GRADIENT
    swapped = [Action(r, 0, 1, 0), Action(ActionKind.FORWARD, 1, 1), Action(r, 0, 0, 0)]
    swapped += [Action(f, 1, 0), Action(ActionKind.BACKWARD, 1, 0), Action(s, 1, 0, 0)]
    swapped += [Action(ActionKind.BACKWARD, 1, 1), Action(s, 1, 1, 0)]
    lists = [gpipe(2, 2)[0], swapped]
    inputs, targets = batches(1, 2)[0][0]

    async def main() -> list:
        async with open_group(kind, 2) as world:
            results: list = [None, None]

            async def one(t: Transport) -> None:
                try:
                    await _stage(t).run_schedule(lists[t.rank], inputs, targets)
                except Exception as exc:
                    results[t.rank] = exc

            with trio.fail_after(SECONDS):
                async with trio.open_nursery() as nursery:
                    for t in world:
                        nursery.start_soon(one, t)
            return results

    results = trio.run(main)
    expected = Action(r, 0, 1, 0).tag(0)
    sent = Action(r, 0, 0, 0).tag(0)
    assert isinstance(results[1], ProtocolError)
    assert f"sent tag {sent}" in str(results[1]) and f"expected tag {expected}" in str(results[1])
    assert isinstance(results[0], PeerClosed)


def test_bad_lists_and_layouts_are_refused_with_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="do not split evenly into 3 stages"):
        split_blocks(transformer_blocks(2), 3)
    assert rank_stages(1, 2, 3) == [1, 3, 5]

    async def main() -> None:
        async with open_group("inproc", 2) as world:
            stage = _stage(world[0])
            inputs, _ = batches(1, 2)[0][0]
            with pytest.raises(ValueError, match="holds stages \\[0\\], not stage 1"):
                await stage.run_schedule([Action(ActionKind.FORWARD, 1, 0)], inputs)
            stage = _stage(world[0])
            with pytest.raises(RuntimeError, match="no forward of micro-batch 0"):
                await stage.run_schedule([Action(ActionKind.BACKWARD, 0, 0)], inputs)
            stage = _stage(world[0])
            with pytest.raises(RuntimeError, match="forwards never backed"):
                await stage.run_schedule(
                    [Action(ActionKind.FORWARD, 0, 0), Action(ActionKind.FORWARD, 0, 1)], inputs
                )
            stage = _stage(world[0], shape=(MICRO_BATCH, SEQ, D_MODEL + 1))
            with pytest.raises(ValueError, match="the pipeline declares"):
                await stage.run_schedule([Action(ActionKind.FORWARD, 0, 0)], inputs)

    trio.run(main)


def test_ordered_gradients_fold_in_micro_batch_order_whatever_the_arrival() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(1000) * 10 ** (k % 7) for k in range(6)]

    def fold(order: list[int]) -> torch.Tensor:
        param = torch.nn.Parameter(torch.zeros(1000))
        folder = OrderedGradients(0, [param])
        folder.start(6)
        for k in order:
            folder.add(k, [grads[k].clone()])
        assert folder.missing() == []
        assert param.grad is not None
        return param.grad

    ascending = fold(list(range(6)))
    expected = grads[0].clone()
    for g in grads[1:]:
        expected.add_(g)
    assert torch.equal(ascending, expected)
    assert torch.equal(fold([5, 3, 1, 0, 2, 4]), expected)
    param = torch.nn.Parameter(torch.zeros(3))
    folder = OrderedGradients(7, [param])
    folder.start(2)
    folder.add(1, [torch.ones(3)])
    assert param.grad is None and folder.missing() == [0, 1]
    with pytest.raises(ValueError, match="stage 7: weight gradients of micro-batch 1 computed"):
        folder.add(1, [torch.ones(3)])


def test_split_microbatches() -> None:
    parts = split_microbatches(torch.arange(12).view(6, 2), 3)
    assert [p.tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    with pytest.raises(ValueError, match="does not split into 4"):
        split_microbatches(torch.zeros(6), 4)


def test_on_action_sees_every_action_in_list_order_on_the_compute_thread() -> None:
    """The public per-action hook: once per action, with its start and end, called on the
    step's compute thread (not trio's): compute and receives in list order, sends in list
    order among themselves (a send leaves, and is reported, as soon as its tensor exists)."""
    lists = one_f_one_b(2, 2)
    inputs, targets = batches(1, 2)[0][0]
    seen: dict[int, list[tuple[Action, int, int, int, bool]]] = {0: [], 1: []}

    class Recording(PipelineStage):
        def on_action(self, step: int, action: Action, started_ns: int, ended_ns: int) -> None:
            on_trio = trio.lowlevel.in_trio_run()
            seen[self.rank].append((action, step, started_ns, ended_ns, on_trio))

    trio.run(partial(_run_stages, "inproc", Recording, lists, inputs, targets, step=7))
    for rank in (0, 1):
        actions = [entry[0] for entry in seen[rank]]
        assert sorted(actions, key=lists[rank].index) == list(lists[rank])  # each action once
        computes = [a for a in actions if not a.kind.is_send]
        assert computes == [a for a in lists[rank] if not a.kind.is_send]  # in list order
        sends = [a for a in actions if a.kind.is_send]
        assert sends == [a for a in lists[rank] if a.kind.is_send]
        assert all(
            step == 7 and start <= end and not on_trio
            for _, step, start, end, on_trio in seen[rank]
        )
        ends = [end for *_, end, _ in seen[rank]]
        assert ends == sorted(ends)


@pytest.mark.parametrize("kind", ["inproc", "tcp"])
def test_receive_buffers_are_held_only_for_messages_that_came(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1F1B, 2 stages, 8 micro-batches: a rank's receive buffers are allocated as its peer's
    messages come, not all 8 when the step starts, so at every receive the walk makes the
    buffers allocated but not yet taken stay within 1F1B's in-flight bound (p = 2) plus the
    one each receiver waits on; the weights stay the reference's bits."""
    import paramsync.actors.parallel.pipeline as pipeline_module

    m = 8
    lists = one_f_one_b(2, m)
    inputs, targets = batches(1, m)[0][0]
    allocated = {0: 0, 1: 0}
    ahead: dict[int, list[int]] = {0: [], 1: []}
    allocate = pipeline_module._Posted.allocate

    def counted(self: object) -> torch.Tensor:
        rank = 1 if self.action.kind is ActionKind.RECV_ACTIVATION else 0  # type: ignore[attr-defined]
        if self.buffer is None:  # type: ignore[attr-defined]
            allocated[rank] += 1
        return allocate(self)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline_module._Posted, "allocate", counted)

    class Watching(PipelineStage):
        taken = 0

        def on_action(self, step: int, action: Action, started_ns: int, ended_ns: int) -> None:
            if action.kind.is_recv:
                self.taken += 1
                ahead[self.rank].append(allocated[self.rank] - self.taken)

    trio.run(_run_stages, kind, Watching, lists, inputs, targets)
    for rank in (0, 1):
        assert len(ahead[rank]) == m  # every receive of the rank's list seen
        assert max(ahead[rank]) <= 2, (rank, ahead[rank])  # all 8 posted at once would be 7
        assert allocated[rank] == m


def test_a_step_cancelled_while_waiting_for_a_receive_ends_and_breaks_the_stage() -> None:
    """No ``recv_seconds`` and a peer that never sends: the caller's deadline cancels the step;
    the compute thread waiting for the receive is woken (nothing hangs), the stage's groups are
    closed and it refuses further steps."""

    async def main() -> bool:
        async with open_group("inproc", 2) as world:
            stage = _stage(world[1])
            with trio.move_on_after(5.0) as scope:
                await stage.run_schedule(one_f_one_b(2, 2)[1], None, batches(1, 2)[0][0][1])
            with pytest.raises(RuntimeError, match="previous step failed"):
                await stage.run_schedule(one_f_one_b(2, 2)[1], None, batches(1, 2)[0][0][1])
            return scope.cancelled_caught

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_step_cancelled_on_lent_links_wakes_every_thread_and_breaks_the_stage() -> None:
    """Over TCP (receive threads blocked on the lent connections, rank 0 never sends): the
    caller's deadline cancels the step, the links are shut down so the threads wake, and the
    stage refuses further steps."""

    async def main() -> bool:
        async with open_group("tcp", 2) as world:
            stage = _stage(world[1])
            with trio.fail_after(SECONDS):
                with trio.move_on_after(0.5) as scope:
                    await stage.run_schedule(one_f_one_b(2, 2)[1], None, batches(1, 2)[0][0][1])
                with pytest.raises(RuntimeError, match="previous step failed"):
                    await stage.run_schedule(one_f_one_b(2, 2)[1], None, batches(1, 2)[0][0][1])
            return scope.cancelled_caught

    assert trio.run(main)


def test_a_send_leaves_as_soon_as_its_tensor_is_computed_not_when_the_list_reaches_it() -> None:
    """Rank 0's list places both sends after both forwards (as a list written for rendezvous
    channels may): the first activation leaves right after its forward, before the second
    forward runs; the peer gets the same messages in the same order, the weights the same
    bits as with the sends in place."""
    F, S = ActionKind.FORWARD, ActionKind.SEND_ACTIVATION
    plain = gpipe(2, 2)
    late = [Action(F, 0, 0), Action(F, 0, 1), Action(S, 0, 0, 1), Action(S, 0, 1, 1)]
    late += plain[0][4:]
    inputs, targets = batches(1, 2)[0][0]

    async def run(lists: list[list[Action]]) -> tuple[list[Action], list[torch.Tensor]]:
        order: list[Action] = []

        class Recording(PipelineStage):
            def on_action(self, step: int, action: Action, started: int, ended: int) -> None:
                if self.rank == 0:
                    order.append(action)

        stages = await _run_stages("inproc", Recording, lists, inputs, targets)
        return order, [p.grad for p in stages[1].parameters() if p.grad is not None]

    order, late_grads = trio.run(run, [late, plain[1]])
    assert [str(a) for a in order[:4]] == ["0F0", "0SEND_F0@1", "0F1", "0SEND_F1@1"]
    _, plain_grads = trio.run(run, plain)
    assert len(late_grads) == len(plain_grads) > 0
    assert all(torch.equal(a, b) for a, b in zip(late_grads, plain_grads, strict=True))
