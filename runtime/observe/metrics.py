"""Prometheus metrics of one paramsync process (the coordinator, or one worker).

Off by default, and on loopback unless another address is named (`DEFAULT_METRICS_HOST`).
`Metrics` holds a registry of its own (so a coordinator and workers sharing a
process, as in tests, each expose theirs) with every metric declared once here, under
Prometheus names (``paramsync_`` prefix, base units, ``_total`` counters). `serve_metrics` is
a trio task that serves the registry over HTTP (prometheus-client's server, on a thread of its
own) until it is cancelled with its nursery. `MetricsTrace` is a `TraceRecorder` that also
turns the worker's trace spans (forward, backward, all-reduce per bucket, digest, ...) into
histograms, so the trainer feeds metrics where it already times its phases; it times spans
even when the trace itself records nothing.

Each update is one prometheus-client call (its own lock per metric); nothing is computed on
the hot path beyond reading the clock a span already reads.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily

from paramsync.runtime.observe.admission_tally import TALLY
from paramsync.runtime.observe.trace import Span, TraceRecorder

__all__ = [
    "DEFAULT_METRICS_HOST",
    "METRICS_HOST_ENV",
    "METRICS_PORT_ENV",
    "Metrics",
    "MetricsTrace",
    "check_port",
    "metrics_host_from_env",
    "metrics_port_from_env",
    "serve_metrics",
]

METRICS_PORT_ENV = "PARAMSYNC_METRICS_PORT"
"""Set by ``paramsync worker --metrics-port``: the port a worker's trainer serves metrics on."""
METRICS_HOST_ENV = "PARAMSYNC_METRICS_HOST"
"""Set by ``paramsync worker --metrics-host``: the address it listens on."""
DEFAULT_METRICS_HOST = "127.0.0.1"
"""Where the metrics endpoint listens unless another address is named: loopback, because the
endpoint is plain, unauthenticated HTTP (a scraper on another host needs ``--metrics-host``)."""

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Histogram buckets (seconds): a control message's half a millisecond to a slow step's 10 s."""

ALLREDUCE_SPAN = "all-reduce"
DIGEST_SPAN = "digest"


class Metrics:
    """The metrics of one process, in a registry of their own. ``role``: "coordinator" or
    "worker" (a constant label, ``paramsync_info``); ``rank``: a worker's rank."""

    def __init__(self, role: str, rank: int | None = None) -> None:
        if role not in ("coordinator", "worker"):
            raise ValueError(f"metrics role must be 'coordinator' or 'worker', got {role!r}")
        self.role = role
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        info = Gauge(
            "paramsync_info", "This process's role in the run.", ["role", "rank"], registry=r
        )
        info.labels(role=role, rank="" if rank is None else str(rank)).set(1)
        self.step_seconds = Histogram(
            "paramsync_step_seconds",
            "Seconds per training step (worker: its step loop; coordinator: commit to commit).",
            buckets=_SECONDS,
            registry=r,
        )
        self.steps = Counter("paramsync_steps_total", "Steps committed or run.", registry=r)
        self.step = Gauge("paramsync_step", "The last step committed or run.", registry=r)
        self.phase_seconds = Histogram(
            "paramsync_phase_seconds",
            "Seconds per phase of a worker's step (forward, backward, optimizer, grad-wait...).",
            ["phase"],
            buckets=_SECONDS,
            registry=r,
        )
        self.allreduce_bytes = Counter(
            "paramsync_allreduce_bytes_total",
            "Bytes all-reduced, per gradient bucket (the payload each rank contributes).",
            ["bucket"],
            registry=r,
        )
        self.allreduce_seconds = Histogram(
            "paramsync_allreduce_seconds",
            "Seconds per all-reduce of a gradient bucket.",
            ["bucket"],
            buckets=_SECONDS,
            registry=r,
        )
        self.digest_check_seconds = Histogram(
            "paramsync_digest_check_seconds",
            "Seconds per digest check (worker: hashing its state; coordinator: the verdict).",
            buckets=_SECONDS,
            registry=r,
        )
        self.epoch = Gauge("paramsync_epoch", "The membership epoch.", registry=r)
        self.members = Gauge("paramsync_members", "Members of the current epoch.", registry=r)
        self.stalls = Counter(
            "paramsync_stalls_total",
            "Stalled steps reported (nothing moved for stall_seconds).",
            registry=r,
        )
        self.rejoins = Counter(
            "paramsync_rejoins_total", "Workers that joined a run already started.", registry=r
        )
        self.refused = Counter(
            "paramsync_refused_connections_total",
            "Connections refused (reason: handshake = failed authentication or protocol; "
            "join = a join the coordinator turned down).",
            ["reason"],
            registry=r,
        )
        for reason in ("handshake", "join"):
            self.refused.labels(reason=reason)
        r.register(_AdmissionCollector(role))
        self._bucket_labels: dict[int, tuple[Any, Any]] = {}
        self._phase_labels: dict[str, Any] = {}

    # ------------------------------------------------------------------- feeding

    def observe_step(self, step: int, seconds: float | None) -> None:
        """Step ``step`` ended (``seconds``: its duration; None: not known, the first one)."""
        if seconds is not None:
            self.step_seconds.observe(seconds)
        self.steps.inc()
        self.step.set(step)

    def observe_epoch(self, epoch: int, members: int) -> None:
        self.epoch.set(epoch)
        self.members.set(members)

    def observe_allreduce(self, bucket: int, nbytes: int, seconds: float) -> None:
        labels = self._bucket_labels.get(bucket)
        if labels is None:  # children looked up once per bucket, not per step
            key = str(bucket)
            labels = (self.allreduce_bytes.labels(bucket=key), self.allreduce_seconds.labels(key))
            self._bucket_labels[bucket] = labels
        labels[0].inc(nbytes)
        labels[1].observe(seconds)

    def observe_phase(self, phase: str, seconds: float) -> None:
        child = self._phase_labels.get(phase)
        if child is None:
            child = self._phase_labels[phase] = self.phase_seconds.labels(phase=phase)
        child.observe(seconds)

    def observe_span(self, name: str, seconds: float, args: dict[str, Any]) -> None:
        """A trace span closed: an all-reduce (per bucket), a digest, or another phase."""
        if name == ALLREDUCE_SPAN and "bucket" in args:
            self.observe_allreduce(int(args["bucket"]), int(args.get("bytes", 0)), seconds)
        elif name == DIGEST_SPAN:
            self.digest_check_seconds.observe(seconds)
        else:
            self.observe_phase(name, seconds)


class _AdmissionCollector:
    """The admission gates' counts of failed authentications and throttled connections
    (`paramsync.runtime.observe.admission_tally`): the coordinator's, or for a worker those of
    every other listener of its process."""

    def __init__(self, role: str) -> None:
        self._coordinator = role == "coordinator"

    def _mine(self, endpoint: str) -> bool:
        return (endpoint == "coordinator") == self._coordinator

    def collect(self) -> list[CounterMetricFamily]:
        failed = CounterMetricFamily(
            "paramsync_failed_authentications",
            "Handshakes whose peer failed to prove the secret (a guess, or a wrong secret).",
            value=TALLY.failed(self._mine),
        )
        throttled = CounterMetricFamily(
            "paramsync_throttled_connections",
            "Connections refused before any handshake work because their source spent its "
            "budget of failed authentications (scope=source) or every source did (global).",
            labels=["scope"],
        )
        for scope, count in TALLY.refused(self._mine).items():
            throttled.add_metric([scope], count)
        return [failed, throttled]


class _MetricsSpan(Span):
    """A span that feeds `Metrics` when it closes, and the wrapped trace when that records."""

    __slots__ = ("_inner", "_metrics")

    def __init__(self, trace: MetricsTrace, name: str, actor: str, args: dict[str, Any]):
        inner = trace.inner
        super().__init__(inner, name, inner.tid(actor) if inner.enabled else 0, args)
        self._inner = inner
        self._metrics = trace.metrics

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        end = time.perf_counter_ns()
        self._metrics.observe_span(self._name, (end - self._start) / 1e9, self._args)
        if self._inner.enabled:
            if exc_type is not None:
                self._args["error"] = exc_type.__name__
            self._inner.record_span(self._name, self._tid, self._start, end, self._args)


class MetricsTrace(TraceRecorder):
    """The trace recorder ``inner``, also feeding ``metrics`` from every span it times.

    Everything recorded still goes to ``inner`` (write that one, or this: the same events);
    spans are timed even when ``inner`` is disabled, for the metrics only."""

    def __init__(self, inner: TraceRecorder, metrics: Metrics) -> None:
        # No recorder state of its own: every recording call below goes to ``inner``.
        self.inner = inner
        self.metrics = metrics

    process_name = property(lambda self: self.inner.process_name)
    pid = property(lambda self: self.inner.pid)
    epoch_ns = property(lambda self: self.inner.epoch_ns)
    max_events = property(lambda self: self.inner.max_events)

    @property
    def enabled(self) -> bool:
        return self.inner.enabled

    @property
    def dropped(self) -> int:
        return self.inner.dropped

    def __len__(self) -> int:
        return len(self.inner)

    def now_us(self) -> float:
        return self.inner.now_us()

    def tid(self, actor: str) -> int:
        return self.inner.tid(actor)

    def span(self, name: str, actor: str = "main", **args: Any) -> Span:
        return _MetricsSpan(self, name, actor, args)

    def complete(
        self, name: str, start_ns: int, end_ns: int, actor: str = "main", **args: Any
    ) -> None:
        if end_ns < start_ns:
            raise ValueError(f"span {name!r} ends ({end_ns}) before it starts ({start_ns})")
        self.metrics.observe_span(name, (end_ns - start_ns) / 1e9, args)
        self.inner.complete(name, start_ns, end_ns, actor, **args)

    def instant(self, name: str, actor: str = "main", scope: str = "t", **args: Any) -> None:
        self.inner.instant(name, actor, scope, **args)

    def counter(self, name: str, **values: float) -> None:
        self.inner.counter(name, **values)

    def metadata(self) -> list[dict[str, Any]]:
        return self.inner.metadata()

    def events(self) -> list[dict[str, Any]]:
        return self.inner.events()

    def to_json(self) -> dict[str, Any]:
        return self.inner.to_json()

    def write(self, path: str | os.PathLike[str]) -> Path:
        return self.inner.write(path)

    def clear(self) -> None:
        self.inner.clear()


def metrics_port_from_env() -> int | None:
    """The port ``paramsync worker --metrics-port`` asked for (None: metrics off)."""
    text = os.environ.get(METRICS_PORT_ENV, "").strip()
    if not text:
        return None
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"{METRICS_PORT_ENV}={text!r} is not a port number") from None
    check_port(port, METRICS_PORT_ENV)
    return port


def metrics_host_from_env(default: str = DEFAULT_METRICS_HOST) -> str:
    """The address ``paramsync worker --metrics-host`` asked for (``default``: loopback)."""
    return os.environ.get(METRICS_HOST_ENV, "").strip() or default


def check_port(port: int, what: str = "metrics port") -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"{what} must be a port number in 0..65535, got {port!r}")


async def serve_metrics(
    metrics: Metrics,
    port: int,
    host: str = DEFAULT_METRICS_HOST,
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``metrics`` at ``http://host:port/metrics`` until cancelled (start it with
    ``nursery.start``: ``task_status`` receives the bound address; port 0 picks a free one).

    The HTTP server is prometheus-client's, answering on a daemon thread of its own; this
    task owns it and shuts it down when its nursery is cancelled."""
    check_port(port)
    server, thread = start_http_server(port, addr=host, registry=metrics.registry)
    try:
        bound = server.server_address
        task_status.started((str(bound[0]), int(bound[1])))
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):
            # shutdown() waits for serve_forever's loop to notice (up to half a second): off
            # the event loop, so the rest of the process winds down meanwhile.
            await trio.to_thread.run_sync(server.shutdown)
        server.server_close()
        thread.join()
