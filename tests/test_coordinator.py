"""The coordinator shell with real workers: refusals, dead and silent workers, diverged weights,
garbage on the control link.

Everything runs in one trio run: in-process `MemoryLink` pairs handed to `serve_links`, or real
TCP with `serve_tcp` on 127.0.0.1 port 0 and `join_run`. Raw ranks (a hand-driven link that
joins and then misbehaves) stand in for broken or hostile workers. Every run has a deadline.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import cbor2
import pytest
import torch
import trio
from torch import nn

from paramsync.actors.client.client import CoordinatorClient, RunAborted
from paramsync.actors.state.digest import state_digest
from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions
from paramsync.actors.train.worker import join_run, train_in_process
from paramsync.runtime.config import DistributedConfig
from paramsync.runtime.coordinator.events import model_signature
from paramsync.runtime.coordinator.run_state import RunState
from paramsync.runtime.coordinator.service import Coordinator, CoordinatorOptions, RunFailed
from paramsync.runtime.errors import PeerClosed
from paramsync.runtime.observe.trace import TraceRecorder
from paramsync.runtime.protocol.handshake import Identity, load_secret
from paramsync.runtime.protocol.messages import StartRun
from paramsync.runtime.protocol.wire import PROTOCOL_VERSION
from paramsync.runtime.transport.base import InProcessTransport
from paramsync.runtime.transport.link import MemoryLink
from paramsync.runtime.transport.tcp import DEFAULT_GROUP, Connection, dial

SECRET = "coordinator-tests-secret"
RUN_SECONDS = 20.0


# --------------------------------------------------------------------------- helpers


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, generator=gen), torch.randn(2, 2, generator=gen)


def leaves(error: BaseException | None) -> list[BaseException]:
    if error is None:
        return []
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaves(inner)]
    return [error]


def find(error: BaseException | None, kind: type[BaseException]) -> BaseException | None:
    return next((leaf for leaf in leaves(error) if isinstance(leaf, kind)), None)


def join_params(model: nn.Module) -> list[list[Any]]:
    return [[n, list(s), d, g] for n, s, d, g in model_signature(model.named_parameters())]


async def wait_for(predicate: Callable[[], bool], seconds: float = 5.0) -> None:
    with trio.fail_after(seconds):
        while not predicate():  # noqa: ASYNC110 - polling state owned by the coordinator
            await trio.sleep(0.005)


async def run_link_worker(
    link: MemoryLink,
    rank: int,
    world_size: int,
    transport: InProcessTransport,
    steps: int,
    model: nn.Module | None = None,
    fold: bool = False,
    options: TrainerOptions | None = None,
) -> int:
    """A real worker on an in-process control link (what train_in_process does per rank)."""
    model = model or mlp(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    client = CoordinatorClient(link, rank)
    try:
        await client.join(
            model_signature(model.named_parameters()), ("in-process", rank + 1), fold=fold
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(client.serve)
            config = DistributedConfig(world_size, rank)
            async with DistributedTrainer.open(
                model, optimizer, loss_fn, config, transport, client, options=options
            ) as trainer:
                for step in range(steps):
                    await trainer.train_batch(batch(step + 10 * rank))
                await trainer.verified()
                await client.finished(trainer.step)
        return trainer.step
    finally:
        with trio.CancelScope(shield=True):
            await link.aclose()


class Outcomes(dict):
    """What each party of a run ended with: a result, or the exception it raised."""

    async def capture(self, name: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        try:
            self[name] = await fn(*args, **kw)
        except BaseException as exc:
            if isinstance(exc, trio.Cancelled):
                raise
            self[name] = exc


async def tcp_worker(
    address: tuple[str, int],
    rank: int,
    world_size: int,
    steps: int,
    model: nn.Module | None = None,
    on_step: Callable[[DistributedTrainer, int], Any] | None = None,
) -> int:
    model = model or mlp(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = DistributedConfig(world_size, rank, f"{address[0]}:{address[1]}")
    async with join_run(model, optimizer, loss_fn, config, secret=SECRET) as trainer:
        for step in range(steps):
            await trainer.train_batch(batch(step + 10 * rank))
            if on_step is not None:
                await on_step(trainer, step)
        return trainer.step


async def dial_coordinator(address: tuple[str, int], rank: int, world_size: int) -> Connection:
    """An authenticated control connection as ``rank``, driven by hand."""
    conn, _ = await dial(
        address, load_secret(SECRET, {}), Identity(DEFAULT_GROUP, world_size, rank)
    )
    return conn


async def serve_tcp(
    coordinator: Coordinator,
    outcomes: Outcomes,
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """serve_tcp on 127.0.0.1 port 0, its outcome recorded as "coordinator"."""
    try:
        await coordinator.serve_tcp("127.0.0.1", 0, task_status=task_status)
        outcomes["coordinator"] = None
    except BaseException as exc:
        if isinstance(exc, trio.Cancelled):
            raise
        outcomes["coordinator"] = exc


async def serve_links(coordinator: Coordinator, outcomes: Outcomes, pairs: list[Any]) -> None:
    await outcomes.capture(
        "coordinator", coordinator.serve_links, {r: p[0] for r, p in enumerate(pairs)}
    )


# --------------------------------------------------------------------------- model mismatch


REFERENCE = lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))  # noqa: E731


def _frozen_bias() -> nn.Module:
    model = REFERENCE()
    model[0].bias.requires_grad_(False)
    return model


MISMATCHES = {
    "shape": (lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 5)), "'2.weight'"),
    "missing": (
        lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2, bias=False)),
        "'2.bias': missing",
    ),
    "extra": (
        lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2), nn.Linear(2, 2)),
        "'3.weight': extra",
    ),
    "dtype": (lambda: REFERENCE().double(), "'0.weight': dtype"),
    "requires_grad": (_frozen_bias, "'0.bias': requires_grad"),
}


@pytest.mark.parametrize("mismatch", sorted(MISMATCHES))
async def test_model_mismatch_is_refused_naming_the_first_difference(mismatch: str) -> None:
    make_model, expected = MISMATCHES[mismatch]
    coordinator = Coordinator(2)
    pairs = [MemoryLink.pair("coordinator", f"rank {r}") for r in range(2)]
    outcomes = Outcomes()

    async def join(rank: int, model: nn.Module) -> None:
        client = CoordinatorClient(pairs[rank][1], rank)
        try:
            await client.join(model_signature(model.named_parameters()), ("in-process", rank + 1))
        finally:
            await pairs[rank][1].aclose()

    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                outcomes.capture,
                "coordinator",
                coordinator.serve_links,
                {r: p[0] for r, p in enumerate(pairs)},
            )
            nursery.start_soon(outcomes.capture, "rank 0", join, 0, REFERENCE())
            await wait_for(lambda: coordinator.core.view.members == (0,))
            await outcomes.capture("rank 1", join, 1, make_model())
            refused = outcomes["rank 1"]
            assert isinstance(refused, RunAborted), refused
            assert "rank 1" in str(refused) and expected in str(refused), str(refused)
            # The refusal leaves the run in rendezvous: rank 0 still waits for a rank 1.
            assert coordinator.state is RunState.RENDEZVOUS
            assert coordinator.core.view.members == (0,)
            coordinator.stop("the test is over")
    assert isinstance(outcomes["coordinator"], RunFailed)
    assert isinstance(outcomes["rank 0"], RunAborted)
    assert "the test is over" in str(outcomes["rank 0"])


async def test_refused_worker_can_rejoin_with_the_right_model_over_tcp() -> None:
    coordinator = Coordinator(2, secret=SECRET)
    outcomes = Outcomes()
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(coordinator.serve_tcp, "127.0.0.1", 0)
            nursery.start_soon(outcomes.capture, "rank 0", tcp_worker, address, 0, 2, 3)
            await wait_for(lambda: coordinator.core.view.members == (0,))
            wrong = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 7))
            await outcomes.capture("wrong", tcp_worker, address, 1, 2, 3, wrong)
            await outcomes.capture("rank 1", tcp_worker, address, 1, 2, 3)
    refused = find(outcomes["wrong"], RunAborted)
    assert refused is not None, outcomes["wrong"]
    assert "'2.weight'" in str(refused) and "shape" in str(refused)
    assert outcomes["rank 0"] == 3 and outcomes["rank 1"] == 3
    assert coordinator.state is RunState.FINISHED


# --------------------------------------------------------------------------- liveness


async def test_a_worker_waiting_in_rendezvous_keeps_heartbeating() -> None:
    """The protocol says heartbeats flow "from join on": rank 0 waiting longer than the
    deadline for a slow rank 1 (importing torch, loading data) must not abort the run."""
    coordinator = Coordinator(2, CoordinatorOptions(heartbeat_deadline=0.5))
    pairs = [MemoryLink.pair("coordinator", f"rank {r}") for r in range(2)]
    transports = InProcessTransport.create_group(2)
    outcomes = Outcomes()

    async def late_worker(rank: int, delay: float) -> int:
        if delay:  # counted from rank 0's join
            await wait_for(lambda: coordinator.core.view.members == (0,))
            await trio.sleep(delay)
        return await run_link_worker(pairs[rank][1], rank, 2, transports[rank], 2)

    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                outcomes.capture,
                "coordinator",
                coordinator.serve_links,
                {r: p[0] for r, p in enumerate(pairs)},
            )
            nursery.start_soon(outcomes.capture, "rank 0", late_worker, 0, 0.0)
            nursery.start_soon(outcomes.capture, "rank 1", late_worker, 1, 1.5)
    assert outcomes["coordinator"] is None, outcomes["coordinator"]
    assert outcomes["rank 0"] == 2 and outcomes["rank 1"] == 2, outcomes


async def test_silent_in_process_worker_stops_the_run_within_the_heartbeat_deadline() -> None:
    """Rank 1 joins, then never speaks again: the run stops naming rank 1, in deadline time."""
    deadline = 0.5
    coordinator = Coordinator(2, CoordinatorOptions(heartbeat_deadline=deadline))
    outcomes = Outcomes()
    pairs = [MemoryLink.pair("coordinator", f"rank {r}") for r in range(2)]
    transports = InProcessTransport.create_group(2)
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_links, coordinator, outcomes, pairs)
            nursery.start_soon(
                outcomes.capture, "rank 0", run_link_worker, pairs[0][1], 0, 2, transports[0], 5
            )
            link = pairs[1][1]
            await link.send("join", {"host": "in-process", "port": 2, "params": join_params(mlp())})
            joined_at = trio.current_time()
            await coordinator.finished.wait()  # rank 1 now says nothing at all
            stopped_at = trio.current_time()
            await link.aclose()
    failed = outcomes["coordinator"]
    assert isinstance(failed, RunFailed), failed
    assert "rank 1 missed heartbeats" in str(failed) and "rank 0" not in str(failed), failed
    assert deadline <= stopped_at - joined_at < deadline + 1.5, stopped_at - joined_at
    rank0 = find(outcomes["rank 0"], RunAborted)
    assert rank0 is not None and "rank 1 missed heartbeats" in str(rank0), outcomes["rank 0"]


async def test_hung_tcp_worker_stops_the_run_within_the_heartbeat_deadline() -> None:
    """Rank 1 trains one step, then hangs (user code stuck, heartbeats stop): the coordinator
    aborts naming rank 1 within the deadline, and rank 0, waiting for rank 1's gradients,
    stops with that reason instead of hanging."""
    deadline = 0.5
    coordinator = Coordinator(2, CoordinatorOptions(heartbeat_deadline=deadline), secret=SECRET)
    outcomes = Outcomes()
    hung_at: list[float] = []

    async def hang(trainer: DistributedTrainer, step: int) -> None:
        if step == 1:
            trainer.run.client.heartbeat_seconds = 3600.0  # at most one more heartbeat
            hung_at.append(trio.current_time())
            await trio.sleep_forever()

    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve_tcp, coordinator, outcomes)
            nursery.start_soon(outcomes.capture, "rank 0", tcp_worker, address, 0, 2, 10)
            nursery.start_soon(
                outcomes.capture, "rank 1", tcp_worker, address, 1, 2, 10, None, hang
            )
            await coordinator.finished.wait()
            stopped_at = trio.current_time()
    failed = outcomes["coordinator"]
    assert isinstance(failed, RunFailed), failed
    assert "rank 1 missed heartbeats" in str(failed) and "rank 0" not in str(failed), failed
    assert stopped_at - hung_at[0] < deadline + 1.5, stopped_at - hung_at[0]
    rank0 = find(outcomes["rank 0"], RunAborted)
    assert rank0 is not None and "rank 1 missed heartbeats" in str(rank0), outcomes["rank 0"]


async def test_worker_dying_before_the_mesh_forms_does_not_strand_the_others() -> None:
    """Rank 1 joins the control plane, then dies before connecting its data plane. The
    coordinator aborts at once naming rank 1; rank 0, waiting in join_run for rank 1's data
    connection, must stop with that reason, not sit out join_run's 120 s join deadline."""
    coordinator = Coordinator(2, CoordinatorOptions(heartbeat_deadline=1.0), secret=SECRET)
    outcomes = Outcomes()
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve_tcp, coordinator, outcomes)
            nursery.start_soon(outcomes.capture, "rank 0", tcp_worker, address, 0, 2, 3)
            await wait_for(lambda: coordinator.core.view.members == (0,))
            conn = await dial_coordinator(address, 1, 2)
            await conn.send("join", {"host": "127.0.0.1", "port": 9, "params": join_params(mlp())})
            start = await conn.recv()
            assert start["kind"] == "start_run"
            await conn.aclose()  # rank 1 dies
            died_at = trio.current_time()
            try:
                await wait_for(lambda: "rank 0" in outcomes, seconds=3.0)
            except trio.TooSlowError:
                pass
            waited = trio.current_time() - died_at
            stranded = "rank 0" not in outcomes
            nursery.cancel_scope.cancel()
    reason = coordinator.core.view.abort_reason or ""
    assert coordinator.state is RunState.ABORTED and "rank 1 disconnected" in reason, reason
    assert not stranded, f"rank 0 still stuck in join_run {waited:.1f} s after rank 1 died"
    rank0 = find(outcomes["rank 0"], RunAborted)
    assert rank0 is not None and "rank 1" in str(rank0), outcomes["rank 0"]


async def test_killed_worker_mid_training_over_tcp_stops_the_run_naming_its_rank() -> None:
    """Rank 1's task dies after two steps (its sockets close, as when a process is killed);
    the others, mid-step, stop promptly with the coordinator's reason naming rank 1."""
    world_size = 3
    coordinator = Coordinator(world_size, CoordinatorOptions(heartbeat_deadline=5.0), secret=SECRET)
    outcomes = Outcomes()
    killed_at: list[float] = []

    async def rank1(address: tuple[str, int]) -> None:
        with trio.CancelScope() as scope:

            async def maybe_die(trainer: DistributedTrainer, step: int) -> None:
                if step == 1:
                    killed_at.append(trio.current_time())
                    scope.cancel()
                    await trio.lowlevel.checkpoint()

            await tcp_worker(address, 1, world_size, 10, on_step=maybe_die)
        return "killed"

    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve_tcp, coordinator, outcomes)
            for rank in (0, 2):
                nursery.start_soon(
                    outcomes.capture, f"rank {rank}", tcp_worker, address, rank, 3, 10
                )
            nursery.start_soon(outcomes.capture, "rank 1", rank1, address)
            await coordinator.finished.wait()
            stopped_at = trio.current_time()
    assert outcomes["rank 1"] == "killed"
    failed = outcomes["coordinator"]
    assert isinstance(failed, RunFailed) and "rank 1 disconnected" in str(failed), failed
    assert stopped_at - killed_at[0] < 3.0  # a closed socket is noticed at once (deadline 5 s)
    for rank in (0, 2):
        error = outcomes[f"rank {rank}"]
        assert not isinstance(error, int), f"rank {rank} trained on without rank 1"
        aborted = find(error, RunAborted)
        assert aborted is not None and "rank 1 disconnected" in str(aborted), repr(error)


async def test_coordinator_stop_tells_every_worker_the_reason() -> None:
    outcomes = Outcomes()
    coordinator = Coordinator(2)
    pairs = [MemoryLink.pair("coordinator", f"rank {r}") for r in range(2)]
    transports = InProcessTransport.create_group(2)
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_links, coordinator, outcomes, pairs)
            for rank in range(2):
                nursery.start_soon(
                    outcomes.capture,
                    f"rank {rank}",
                    run_link_worker,
                    pairs[rank][1],
                    rank,
                    2,
                    transports[rank],
                    10**6,
                )
            await wait_for(lambda: coordinator.core.view.step >= 2)
            coordinator.stop("stopped by SIGTERM (test)")
    assert isinstance(outcomes["coordinator"], RunFailed)
    assert "stopped by SIGTERM (test)" in str(outcomes["coordinator"])
    for rank in range(2):
        aborted = find(outcomes[f"rank {rank}"], RunAborted)
        assert aborted is not None and "stopped by SIGTERM (test)" in str(aborted)


# --------------------------------------------------------------------------- digests


class TamperingSGD(torch.optim.SGD):
    """SGD that, on one rank and one step, changes one tensor after the real step."""

    def __init__(self, params: Any, rank: int, tamper: Callable[[int, int], None]) -> None:
        super().__init__(params, lr=0.05, momentum=0.9)
        self.rank = rank
        self.tamper = tamper
        self.steps = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        result = super().step(closure)
        self.tamper(self.rank, self.steps)
        self.steps += 1
        return result


async def run_tampered(
    world_size: int,
    bad_rank: int,
    bad_step: int,
    change: Callable[[nn.Module, torch.optim.Optimizer], None],
    options: CoordinatorOptions | None = None,
) -> tuple[BaseException, list[int]]:
    models: dict[int, tuple[nn.Module, torch.optim.Optimizer]] = {}
    progress: list[int] = []

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(rank)

        def tamper(my_rank: int, step: int) -> None:
            if my_rank == bad_rank and step == bad_step:
                change(*models[my_rank])

        optimizer = TamperingSGD(model.parameters(), rank, tamper)
        models[rank] = (model, optimizer)
        return model, optimizer

    async def body(trainer: DistributedTrainer) -> None:
        for step in range(6):
            await trainer.train_batch(batch(step + 10 * trainer.dist_config.rank))
            progress.append(trainer.step)

    with trio.fail_after(RUN_SECONDS):
        try:
            await train_in_process(
                world_size, make_replica, loss_fn, body, coordinator_options=options
            )
        except BaseException as exc:
            return exc, progress
    pytest.fail("a diverged run finished")


def bump_last_bias(model: nn.Module, _optimizer: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        model[2].bias.add_(1e-3)


async def test_diverged_minority_aborts_naming_step_rank_and_first_tensor() -> None:
    error, progress = await run_tampered(3, bad_rank=1, bad_step=2, change=bump_last_bias)
    failed = find(error, RunAborted)  # the coordinator's reason, as every worker got it
    assert failed is not None, error
    text = str(failed)
    assert "step 2" in text and "ranks [1] differ from the majority (ranks [0, 2])" in text, text
    assert "rank 1 first differs from rank 0 at tensor 'param/2.bias'" in text, text
    # Steps 0-2 ran (step 2's check overlaps step 3); step 3 never completed anywhere.
    assert max(progress) == 3
    for leaf in leaves(error):
        if isinstance(leaf, RunAborted):
            assert "step 2" in str(leaf)


async def test_diverged_pair_without_majority_names_both_groups_and_the_tensor() -> None:
    error, _ = await run_tampered(2, bad_rank=1, bad_step=2, change=bump_last_bias)
    failed = find(error, RunAborted)  # the coordinator's reason, as every worker got it
    assert failed is not None, error
    text = str(failed)
    assert "step 2" in text and "no majority" in text, text
    assert "rank 1 first differs from rank 0 at tensor 'param/2.bias'" in text, text


async def test_diverged_optimizer_state_alone_is_caught() -> None:
    """The weights agree; only rank 2's momentum buffer differs: still C-DDP-001 broken."""

    def bump_momentum(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.state[model[0].weight]["momentum_buffer"].mul_(1.5)

    error, _ = await run_tampered(3, bad_rank=2, bad_step=1, change=bump_momentum)
    failed = find(error, RunAborted)  # the coordinator's reason, as every worker got it
    assert failed is not None, error
    text = str(failed)
    assert "step 1" in text and "ranks [2]" in text, text
    assert "tensor 'optim/0.weight/momentum_buffer'" in text, text


@pytest.mark.parametrize("mode", ["verified-each-step", "no-overlap"])
async def test_resync_restores_a_diverged_minority_to_the_majoritys_exact_state(mode: str) -> None:
    """CoordinatorOptions(resync=True): rank 1's tampered state is replaced by rank 0's, the
    run goes on, and every rank follows the very trajectory of an untampered run. (The step
    after the divergence must not compute on the diverged weights: wait for verification
    after each step, or turn verify_overlap off.)"""
    options = TrainerOptions(verify_overlap=mode != "no-overlap")

    async def digests(tamper: bool) -> list[list[str]]:
        models: dict[int, tuple[nn.Module, torch.optim.Optimizer]] = {}

        def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
            model = mlp(rank)

            def maybe_tamper(my_rank: int, step: int) -> None:
                if tamper and my_rank == 1 and step == 2:
                    bump_last_bias(*models[my_rank])

            optimizer = TamperingSGD(model.parameters(), rank, maybe_tamper)
            models[rank] = (model, optimizer)
            return model, optimizer

        async def body(trainer: DistributedTrainer) -> list[str]:
            seen = []
            for step in range(5):
                await trainer.train_batch(batch(step + 10 * trainer.dist_config.rank))
                if mode == "verified-each-step":
                    await trainer.verified()  # the re-sync (if any) is done: state is final
                seen.append(state_digest(trainer.model, trainer.run.optimizer).digest.hex())
            return seen

        with trio.fail_after(RUN_SECONDS):
            return await train_in_process(
                3,
                make_replica,
                loss_fn,
                body,
                options=options,
                coordinator_options=CoordinatorOptions(resync=True),
            )

    clean = await digests(tamper=False)
    healed = await digests(tamper=True)
    assert clean[0] == clean[1] == clean[2]
    assert healed == clean


# --------------------------------------------------------------------------- garbage


async def test_garbage_from_a_joined_in_process_worker_aborts_naming_its_rank() -> None:
    coordinator = Coordinator(2)
    pairs = [MemoryLink.pair("coordinator", f"rank {r}") for r in range(2)]
    transports = InProcessTransport.create_group(2)
    outcomes = Outcomes()
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_links, coordinator, outcomes, pairs)
            nursery.start_soon(
                outcomes.capture, "rank 0", run_link_worker, pairs[0][1], 0, 2, transports[0], 5
            )
            raw = pairs[1][1]
            await raw.send("join", {"host": "in-process", "port": 2, "params": join_params(mlp())})
            await wait_for(lambda: coordinator.state is RunState.RUNNING)
            await raw.send_raw(b"\x00\x00\x00\x05\x00\x00\x00\x00\xff\xfe\xfd\xfc\xfb")
            await coordinator.finished.wait()
            await raw.aclose()
    failed = outcomes["coordinator"]
    assert isinstance(failed, RunFailed), failed
    assert "rank 1 sent a malformed message" in str(failed), failed
    rank0 = find(outcomes["rank 0"], RunAborted)
    assert rank0 is not None and "rank 1" in str(rank0)


UNKNOWN_KIND = cbor2.dumps({"v": PROTOCOL_VERSION, "kind": "gimme-weights"})

GARBAGE = {
    "bytes": lambda conn: conn.stream.send_all(b"\xff" * 64),
    "wrong-kind": lambda conn: conn.send("go", {"step": 0, "bucket": 0, "seq": 0}),
    "bad-field": lambda conn: conn.send("ready", {"step": -5, "bucket": 0, "spec": []}),
    # Sent as the authenticated peer sends any frame (with its tag: frame authentication),
    # so what the coordinator refuses is the message itself.
    "unknown-kind": lambda conn: conn.send_frame(
        struct.pack(">II", len(UNKNOWN_KIND), 0) + UNKNOWN_KIND
    ),
}


@pytest.mark.parametrize("garbage", sorted(GARBAGE))
async def test_garbage_from_an_authenticated_tcp_worker_aborts_naming_its_rank(
    garbage: str,
) -> None:
    """Both ranks are hand-driven control connections (a real rank 0 would be stuck forming
    its data mesh with the fake rank 1); rank 0 must be told the run stopped, naming rank 1."""
    coordinator = Coordinator(2, secret=SECRET)
    outcomes = Outcomes()
    params = join_params(mlp())
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve_tcp, coordinator, outcomes)
            good = await dial_coordinator(address, 0, 2)
            await good.send("join", {"host": "10.0.0.1", "port": 1, "params": params})
            conn = await dial_coordinator(address, 1, 2)
            await conn.send("join", {"host": "10.0.0.2", "port": 2, "params": params})
            assert (await good.recv())["kind"] == "start_run"
            await GARBAGE[garbage](conn)
            told = await good.recv()
            await coordinator.finished.wait()
            await conn.aclose()
            await good.aclose()
    failed = outcomes["coordinator"]
    assert isinstance(failed, RunFailed), failed
    assert "rank 1" in str(failed) and "rank 0" not in str(failed), failed
    assert told["kind"] == "abort" and told["reason"] == str(failed), told


async def test_garbage_before_join_is_refused_and_the_rank_may_join_properly() -> None:
    coordinator = Coordinator(2, secret=SECRET)
    outcomes = Outcomes()
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve_tcp, coordinator, outcomes)
            conn = await dial_coordinator(address, 1, 2)
            await conn.send("ready", {"epoch": 1, "step": 0, "bucket": 0, "spec": []})
            refusal = await conn.recv()
            assert refusal["kind"] == "join_refused" and "rank 1" in refusal["reason"], refusal
            await conn.aclose()
            nursery.start_soon(outcomes.capture, "rank 0", tcp_worker, address, 0, 2, 2)
            nursery.start_soon(outcomes.capture, "rank 1", tcp_worker, address, 1, 2, 2)
    assert outcomes == {"coordinator": None, "rank 0": 2, "rank 1": 2}


async def test_an_authenticated_peer_that_never_joins_loses_its_slot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Authentication alone does not hold a rank: without a join within the heartbeat deadline
    the connection is dropped, and the real worker of that rank gets in."""
    coordinator = Coordinator(2, CoordinatorOptions(heartbeat_deadline=0.5), secret=SECRET)
    outcomes = Outcomes()
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve_tcp, coordinator, outcomes)
            squatter = await dial_coordinator(address, 1, 2)
            with pytest.raises(PeerClosed):
                await squatter.recv()  # dropped, not answered
            nursery.start_soon(outcomes.capture, "rank 0", tcp_worker, address, 0, 2, 2)
            nursery.start_soon(outcomes.capture, "rank 1", tcp_worker, address, 1, 2, 2)
    assert outcomes == {"coordinator": None, "rank 0": 2, "rank 1": 2}
    assert "rank 1 authenticated but sent no join within 0.5 s" in caplog.text


async def test_unauthenticated_connections_are_refused_and_the_run_completes() -> None:
    coordinator = Coordinator(2, secret=SECRET)
    outcomes = Outcomes()
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve_tcp, coordinator, outcomes)
            # Raw garbage instead of a handshake.
            stream = await trio.open_tcp_stream(*address)
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 100)
            # A dialer with the wrong secret, claiming rank 0.
            with pytest.raises(Exception, match=r"secret|refused"):
                await dial(address, b"not-the-right-secret", Identity(DEFAULT_GROUP, 2, 0))
            await wait_for(lambda: coordinator.hostile_refused >= 2)
            await stream.aclose()
            nursery.start_soon(outcomes.capture, "rank 0", tcp_worker, address, 0, 2, 3)
            nursery.start_soon(outcomes.capture, "rank 1", tcp_worker, address, 1, 2, 3)
    assert outcomes == {"coordinator": None, "rank 0": 3, "rank 1": 3}
    assert coordinator.state is RunState.FINISHED


async def test_a_member_that_does_not_fold_keeps_everyone_reporting_each_bucket() -> None:
    """Folding cached reports into step reports needs every member: one worker without the
    response cache joins without the offer, the epoch starts with ``fold`` off, and the run
    trains to the end (folding peers would never report the buckets it waits a go for)."""
    world_size, steps = 3, 4
    coordinator = Coordinator(world_size)
    pairs = [MemoryLink.pair("coordinator", f"rank {rank}") for rank in range(world_size)]
    transports = InProcessTransport.create_group(world_size)
    outcomes = Outcomes()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                coordinator.serve_links, {r: pair[0] for r, pair in enumerate(pairs)}
            )
            for rank in range(world_size):
                nursery.start_soon(
                    outcomes.capture,
                    rank,
                    run_link_worker,
                    pairs[rank][1],
                    rank,
                    world_size,
                    transports[rank],
                    steps,
                    None,
                    rank != 1,
                    TrainerOptions(response_cache=rank != 1),
                )
    assert [outcomes[rank] for rank in range(world_size)] == [steps] * world_size
    assert coordinator.core.view.state is RunState.FINISHED


async def test_a_client_offering_to_fold_needs_the_response_cache() -> None:
    link, _ = MemoryLink.pair()
    client = CoordinatorClient(link, 0)
    client.fold = True
    client.start = StartRun((("h", 1),), (0,), fold=True)
    model = mlp(0)
    with pytest.raises(ValueError, match="response_cache is off"):
        DistributedTrainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn,
            DistributedConfig(1, 0),
            client,
            TrainerOptions(response_cache=False),
            TraceRecorder.disabled(),
            lambda start: None,  # type: ignore[arg-type,return-value]
        )
