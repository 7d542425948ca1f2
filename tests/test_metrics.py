"""Prometheus metrics: a live coordinator and two workers scraped over HTTP, and each feed.

The endpoints are scraped with urllib (on a thread: prometheus-client's server answers from
its own) and parsed with ``prometheus_client.parser``, between training steps, to show the
metrics move with the run.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

import pytest
import torch
import trio
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from paramsync.actors.train.trainer import TrainerOptions
from paramsync.actors.train.worker import join_run
from paramsync.runtime.cli.main import build_parser
from paramsync.runtime.config import DistributedConfig
from paramsync.runtime.coordinator.events import Disconnected, Tick
from paramsync.runtime.coordinator.service import Coordinator, CoordinatorOptions
from paramsync.runtime.observe.metrics import (
    METRICS_HOST_ENV,
    METRICS_PORT_ENV,
    Metrics,
    MetricsTrace,
    metrics_host_from_env,
    metrics_port_from_env,
    serve_metrics,
)
from paramsync.runtime.observe.trace import TraceRecorder
from paramsync.runtime.protocol.messages import Joined

SECRET = "metrics-tests-secret"
SIG = (("w", (2, 3), "float32", True),)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of a scrape: (name, sorted labels) -> value."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def scrape(address: tuple[str, int]) -> Samples:
    url = f"http://127.0.0.1:{address[1]}/metrics"

    def get() -> str:
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            return response.read().decode()

    return parse(await trio.to_thread.run_sync(get))


def replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(2, 3, generator=gen), torch.randn(2, 2, generator=gen)


def mse(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = data
    return ((model(x) - y) ** 2).mean()


async def test_a_live_run_is_scraped_and_its_metrics_move() -> None:
    world_size, steps = 2, 6
    metrics = Metrics("coordinator")
    coordinator = Coordinator(world_size, secret=SECRET, metrics=metrics)
    scrapes: dict[str, list[Samples]] = {"coordinator": [], "0": [], "1": []}
    trained = [0] * steps
    at_step = [trio.Event() for _ in range(steps)]
    scraped = [trio.Event() for _ in range(steps)]
    worker_addresses: dict[int, tuple[str, int]] = {}

    async def worker(rank: int, address: tuple[str, int]) -> None:
        model, optimizer = replica(rank)
        config = DistributedConfig(world_size, rank, f"{address[0]}:{address[1]}")
        options = TrainerOptions(metrics_port=0, metrics_host="127.0.0.1", bucket_bytes=32)
        async with join_run(model, optimizer, mse, config, secret=SECRET, options=options) as t:
            assert t.metrics_address is not None
            worker_addresses[rank] = t.metrics_address
            for step in range(steps):
                await t.train_batch(batch(step))
                trained[step] += 1
                if trained[step] == world_size:
                    at_step[step].set()
                await scraped[step].wait()  # hold the run still while it is scraped

    async def observe(coordinator_metrics: tuple[str, int]) -> None:
        for step in range(steps):
            await at_step[step].wait()
            if step in (1, steps - 1):
                scrapes["coordinator"].append(await scrape(coordinator_metrics))
                for rank, address in sorted(worker_addresses.items()):
                    scrapes[str(rank)].append(await scrape(address))
            scraped[step].set()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            served = await nursery.start(serve_metrics, metrics, 0, "127.0.0.1")
            address = await nursery.start(coordinator.serve_tcp, "127.0.0.1", 0)
            for rank in range(world_size):
                nursery.start_soon(worker, rank, address)
            await observe(served)
            await coordinator.finished.wait()
            nursery.cancel_scope.cancel()

    early, late = scrapes["coordinator"]
    assert value(late, "paramsync_info", role="coordinator", rank="") == 1
    assert value(late, "paramsync_epoch") == 1 and value(late, "paramsync_members") == 2
    assert value(late, "paramsync_steps_total") > value(early, "paramsync_steps_total") >= 1
    assert value(late, "paramsync_step") > value(early, "paramsync_step")
    assert value(late, "paramsync_step_seconds_count") > value(
        early, "paramsync_step_seconds_count"
    )
    digest_checks = value(late, "paramsync_digest_check_seconds_count")
    assert digest_checks > value(early, "paramsync_digest_check_seconds_count")
    assert value(late, "paramsync_stalls_total") == 0
    assert value(late, "paramsync_refused_connections_total", reason="handshake") == 0
    for rank in ("0", "1"):
        early, late = scrapes[rank]
        assert value(late, "paramsync_info", role="worker", rank=rank) == 1
        assert value(late, "paramsync_epoch") == 1 and value(late, "paramsync_members") == 2
        assert value(late, "paramsync_steps_total") - value(early, "paramsync_steps_total") == 4
        sent = [
            (key[1], v) for key, v in late.items() if key[0] == "paramsync_allreduce_bytes_total"
        ]
        assert len(sent) >= 2, sent  # 32-byte buckets: the model's tensors in several
        for labels, total in sent:
            before = early[("paramsync_allreduce_bytes_total", labels)]
            assert total > before > 0
            seconds = ("paramsync_allreduce_seconds_count", labels)
            assert late[seconds] > early[seconds] > 0
        for phase in ("forward", "backward", "optimizer"):
            count = ("paramsync_phase_seconds_count", (("phase", phase),))
            assert late[count] > early[count] > 0, phase
        digests = value(late, "paramsync_digest_check_seconds_count")
        assert digests > value(early, "paramsync_digest_check_seconds_count")
    # The endpoints stopped with their nurseries.
    for address in (served, *worker_addresses.values()):
        with pytest.raises(urllib.error.URLError):
            await scrape(address)


async def test_stalls_refusals_and_rejoins_are_counted() -> None:
    """The shell feeds them from the core's answers: a stall report, a refused join, and a
    worker that joins an elastic run already started."""
    metrics = Metrics("coordinator")
    options = CoordinatorOptions(min_workers=2, stall_seconds=1.0, heartbeat_deadline=100.0)
    coordinator = Coordinator(3, options, secret=SECRET, metrics=metrics)

    def feed(event: Any) -> None:
        coordinator._apply(coordinator._handle_measured(event))

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    for rank in range(3):
        feed(Joined(rank, SIG, ("127.0.0.1", 9000 + rank), now=0.0))
    assert coordinator.core.view.epoch == 1
    assert sample("paramsync_epoch") == 1 and sample("paramsync_members") == 3
    feed(Joined(1, SIG, ("127.0.0.1", 9101), now=0.0))  # rank 1 has joined: refused
    assert sample("paramsync_refused_connections_total", reason="join") == 1
    feed(Tick(1.0))
    feed(Tick(3.0))  # nothing moved for 2 s > stall_seconds
    assert sample("paramsync_stalls_total") == 1
    coordinator._apply(coordinator.core.handle(Disconnected(2, "gone")))
    assert sample("paramsync_epoch") == 2 and sample("paramsync_members") == 2
    assert sample("paramsync_rejoins_total") == 0
    feed(Joined(2, SIG, ("127.0.0.1", 9002), now=4.0))
    assert sample("paramsync_rejoins_total") == 1
    assert sample("paramsync_epoch") == 3 and sample("paramsync_members") == 3


def test_a_metrics_trace_feeds_the_metrics_and_still_records() -> None:
    metrics = Metrics("worker", rank=3)
    inner = TraceRecorder("rank 3", pid=3)
    trace = MetricsTrace(inner, metrics)
    with trace.span("all-reduce", actor="gradient-comm", bucket=1, bytes=400):
        pass
    with trace.span("forward", actor="compute", step=0):
        pass
    trace.complete("digest", 0, 2_000_000, actor="optimizer", step=0)
    samples = parse(_exposition(metrics))
    assert value(samples, "paramsync_allreduce_bytes_total", bucket="1") == 400
    assert value(samples, "paramsync_allreduce_seconds_count", bucket="1") == 1
    assert value(samples, "paramsync_phase_seconds_count", phase="forward") == 1
    assert value(samples, "paramsync_digest_check_seconds_sum") == pytest.approx(0.002)
    assert [e["name"] for e in trace.events() if e["ph"] == "X"] == [
        "all-reduce",
        "forward",
        "digest",
    ]
    # A disabled trace records nothing, and the spans still feed the metrics.
    quiet = MetricsTrace(TraceRecorder.disabled(), metrics)
    with quiet.span("forward", actor="compute"):
        pass
    assert len(quiet) == 0
    samples = parse(_exposition(metrics))
    assert value(samples, "paramsync_phase_seconds_count", phase="forward") == 2


def _exposition(metrics: Metrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()


def test_the_flag_is_off_by_default_and_checked() -> None:
    parser = build_parser()
    args = parser.parse_args(["coordinator", "--world-size", "2"])
    assert args.metrics_port is None
    args = parser.parse_args(["coordinator", "--world-size", "2", "--metrics-port", "9400"])
    assert args.metrics_port == 9400 and args.metrics_host == "127.0.0.1"
    with pytest.raises(ValueError, match="metrics_port must be a port number"):
        TrainerOptions(metrics_port=70000)
    with pytest.raises(ValueError, match="role"):
        Metrics("observer")


def test_the_endpoint_binds_loopback_unless_another_address_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The endpoint is unauthenticated HTTP: it listens on 127.0.0.1 by default (the flag, the
    environment and `serve_metrics` alike), and on another address only when one is named."""
    parser = build_parser()
    for command in (["coordinator", "--world-size", "2"], ["worker"]):
        assert parser.parse_args([*command, "--metrics-port", "0"]).metrics_host == "127.0.0.1"
    named = parser.parse_args(["worker", "--metrics-port", "0", "--metrics-host", "0.0.0.0"])
    assert named.metrics_host == "0.0.0.0"
    monkeypatch.delenv(METRICS_HOST_ENV, raising=False)
    assert metrics_host_from_env() == "127.0.0.1"
    monkeypatch.setenv(METRICS_HOST_ENV, "::")
    assert metrics_host_from_env() == "::"

    async def main() -> tuple[str, int]:
        async with trio.open_nursery() as nursery:
            bound: tuple[str, int] = await nursery.start(serve_metrics, Metrics("worker"), 0)
            nursery.cancel_scope.cancel()
        return bound

    assert trio.run(main)[0] == "127.0.0.1"


def test_the_worker_flag_reaches_the_trainer_through_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(METRICS_PORT_ENV, raising=False)
    assert metrics_port_from_env() is None
    monkeypatch.setenv(METRICS_PORT_ENV, "9401")
    assert metrics_port_from_env() == 9401
    monkeypatch.setenv(METRICS_PORT_ENV, "ninety")
    with pytest.raises(ValueError, match=f"{METRICS_PORT_ENV}='ninety' is not a port number"):
        metrics_port_from_env()
    args = build_parser().parse_args(["worker", "--metrics-port", "9402"])
    assert args.metrics_port == 9402
