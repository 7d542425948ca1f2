"""The coordinator's control plane at scale: N simulated workers driving one `CoordinatorCore`.

No sockets and no trio: the workers are simulated in this process and fed to the sans-I/O core
through the real events, as the shell feeds it. Each worker joins, then every step reports each
of its ``--buckets`` buckets ready (the first step with the full spec and a go per bucket, later
steps ``cached`` against the epoch's response cache, as real workers do), optionally a
``reduced`` (``--elastic``: the apply barrier), then a packed digest (``--digest-interval``
steps; its tensor names listed once per epoch) or a ``step_done``. Each worker count is timed
twice: feeding the dataclasses directly (the core alone: sequencing and the digest verdict),
and with ``--wire`` (the default) through every report's real CBOR frame, the worker side
encoding it (``to_wire`` + ``encode_frame_bytes``, untimed) and the coordinator side decoding
it (``decode_frame`` + ``event_from_wire``, timed, as the shell does).

Per step it times the coordinator's work from the first worker's report to the commit
(sequencing every go, the apply barrier, the digest verdict and the commit): every report of
the step is built (and encoded) first, then the clock runs while they are decoded and handled.
It prints the median and p99 over the steps for each worker count, and, for the largest count,
the memory (``--memory-probe``: the resident set, or tracemalloc's current and peak Python
heap) sampled every ``--sample-every`` steps over ``--memory-steps`` steps, to show the core
keeps no history that grows per step. The target (``--target-ms``, 5 ms) is checked against the
core's p99 at the largest count; the exit status is 1 when it is missed.

    python benchmarks/control_plane.py                     # 8..256 workers, 10,000-step memory
    python benchmarks/control_plane.py --workers 64 --steps 200 --memory-steps 0
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import tracemalloc
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from paramsync.runtime.coordinator.core import CoordinatorCore  # noqa: E402
from paramsync.runtime.coordinator.events import (  # noqa: E402
    Abort,
    Action,
    Broadcast,
    Event,
    Send,
    agreement_hash,
    spec_hash,
)
from paramsync.runtime.coordinator.host_driver import HostDriver  # noqa: E402
from paramsync.runtime.coordinator.host_fold import HostFold  # noqa: E402
from paramsync.runtime.coordinator.root_core import RootCore  # noqa: E402
from paramsync.runtime.coordinator.root_driver import RootDriver  # noqa: E402
from paramsync.runtime.coordinator.run_state import RunState  # noqa: E402
from paramsync.runtime.coordinator.tree_events import FromRoot, Up  # noqa: E402
from paramsync.runtime.protocol.messages import (  # noqa: E402
    Apply,
    Commit,
    Digest,
    Go,
    Joined,
    Ready,
    Reduced,
    StartRun,
    StepDone,
    WireMessage,
    event_from_wire,
    host_event_from_wire,
    root_message_from_wire,
)
from paramsync.runtime.protocol.wire import decode_frame, encode_frame_bytes  # noqa: E402

DIGEST_BYTES = 16
"""A per-tensor digest's size (xxh3-128), as the workers pack them."""


def signature(tensors: int) -> tuple[tuple[str, tuple[int, ...], str, bool], ...]:
    """A model of ``tensors`` parameters (names and shapes like a small transformer's)."""
    return tuple(
        (f"layers.{i // 4}.p{i % 4}.weight", (64, 64), "float32", True) for i in range(tensors)
    )


def bucket_specs(buckets: int, tensors: int) -> list[tuple[tuple[tuple[int, ...], str], ...]]:
    """The parameters split into ``buckets`` buckets, as a worker's bucketer would."""
    per, extra = divmod(tensors, buckets)
    specs = []
    for bucket in range(buckets):
        count = per + (1 if bucket < extra else 0)
        specs.append(tuple(((64, 64), "float32") for _ in range(max(count, 1))))
    return specs


class SimulatedRun:
    """``workers`` simulated workers of one run and the core they report to.

    ``feed`` gives the core one report the way the shell would (decoded from its CBOR frame
    when ``wire``); `step` plays one whole step and returns the seconds the coordinator spent
    on it, from the first report to the commit.
    """

    def __init__(
        self,
        workers: int,
        *,
        buckets: int = 6,
        tensors: int = 48,
        digest_interval: int = 1,
        elastic: bool = False,
        wire: bool = True,
        fold: bool = False,
    ) -> None:
        self.workers = workers
        self.fold = fold
        self.buckets = buckets
        self.wire = wire
        self.elastic = elastic
        self.tensors = tuple(name for name, *_ in signature(tensors))
        self.specs = bucket_specs(buckets, tensors)
        self.hashes = [spec_hash(spec) for spec in self.specs]
        self.agreement = agreement_hash(dict(enumerate(self.hashes)))
        self.core = CoordinatorCore(
            workers,
            signature=signature(tensors),
            digest_interval=digest_interval,
            heartbeat_deadline=60.0,
            min_workers=workers - 1 if elastic else None,
        )
        self.epoch = 0
        self.next_step = 0
        self._named: set[int] = set()
        self.last_cpu_seconds = 0.0
        """The CPU time of this thread in the last `step` (its wall time less preemption)."""
        self._join(signature(tensors))

    # ------------------------------------------------------------------- the shell's side

    def feed(self, report: WireMessage | bytes, rank: int) -> list[Action]:
        """Hand the core one report of ``rank`` (a frame is decoded first, as the shell does)."""
        if isinstance(report, bytes):
            event: Event = event_from_wire(decode_frame(report, tensors=False), rank=rank, now=0.0)
        else:
            event = report  # type: ignore[assignment]
        return self.core.handle(event)

    def _encoded(self, message: WireMessage) -> WireMessage | bytes:
        if not self.wire:
            return message
        kind, fields = message.to_wire()
        return encode_frame_bytes(kind, fields)

    # ------------------------------------------------------------------- the workers' side

    def _join(self, sig: Any) -> None:
        actions: list[Action] = []
        for rank in range(self.workers):
            join = Joined(rank, sig, ("10.0.0.1", 20_000 + rank), now=0.0, fold=self.fold)
            actions = self.feed(self._encoded(join) if self.wire else join, rank)
        start = [a for a in actions if isinstance(a, Broadcast) and isinstance(a.message, StartRun)]
        if self.core.view.state is not RunState.RUNNING or not start:
            raise RuntimeError(f"the run did not start: {actions!r}")
        self.epoch = self.core.view.epoch

    def reports(self, step: int) -> list[tuple[int, WireMessage | bytes]]:
        """Every report of ``step``, in arrival order: the buckets ready in backward order
        (bucket-major: each bucket reaches every worker at about the same time), then the
        step ends."""
        cached = step > 0
        folded = self.agreement if cached and self.fold else ""
        out: list[tuple[int, WireMessage | bytes]] = []
        for bucket in reversed(range(self.buckets) if not folded else ()):
            spec: Any = self.hashes[bucket] if cached else self.specs[bucket]
            for rank in range(self.workers):
                ready = Ready(rank, step, bucket, spec, self.epoch, cached=cached)
                out.append((rank, self._encoded(ready)))
        if self.elastic:
            for rank in range(self.workers):
                out.append((rank, self._encoded(Reduced(rank, step, self.epoch, folded))))
            folded = ""  # each rank's reduced report carried its folded buckets
        digest_step = self.core.view.is_digest_step(step)
        for rank in range(self.workers):
            end: WireMessage
            if digest_step:
                packed = bytes([step % 251]) * (DIGEST_BYTES * len(self.tensors))
                names = None if rank in self._named else self.tensors
                self._named.add(rank)
                end = Digest(rank, step, b"d%015d" % step, (), self.epoch, packed, names, folded)
            else:
                end = StepDone(rank, step, self.epoch, folded)
            out.append((rank, self._encoded(end)))
        return out

    def step(self) -> float:
        """Play the next step; the coordinator's seconds from its first report to its commit."""
        step = self.next_step
        reports = self.reports(step)
        gos = applies = commits = 0
        start, start_cpu = time.perf_counter(), time.thread_time()
        for rank, report in reports:
            for action in self.feed(report, rank):
                if isinstance(action, Broadcast):
                    message = action.message
                    if isinstance(message, Go):
                        gos += 1
                    elif isinstance(message, Apply):
                        applies += 1
                    elif isinstance(message, Commit):
                        commits += 1
                elif isinstance(action, Abort):
                    raise RuntimeError(f"step {step}: the coordinator aborted: {action.reason}")
                else:
                    raise RuntimeError(f"step {step}: unexpected action {action!r}")
        elapsed = time.perf_counter() - start
        self.last_cpu_seconds = time.thread_time() - start_cpu
        expected_gos = self.buckets if step == 0 else 0
        if commits != 1 or gos != expected_gos or applies != int(self.elastic):
            raise RuntimeError(
                f"step {step}: {commits} commit(s), {gos} go(s), {applies} apply(s); expected "
                f"1, {expected_gos}, {int(self.elastic)}"
            )
        self.next_step += 1
        return elapsed


class TreeRun:
    """``workers`` simulated workers on ``hosts`` hosts (as even as they split), a `HostFold`
    per host and a `RootCore` above them, each driven by its driver as the tree's shells drive
    it (`HostDriver`, `RootDriver`), every message a real CBOR frame both ways.

    `step` plays one step: each worker's reports are built and encoded first (untimed); then
    each host's sub-coordinator is timed decoding its workers' frames, folding them and
    encoding its report to the root, and the root is timed decoding the hosts' frames,
    deciding and encoding its answer (once: the same frame goes to every host), and each host
    again taking the answer and fanning it out. It returns the root's seconds and keeps each
    host's in ``host_seconds``. A frame is decoded as the tree's shells decode one
    (`paramsync.runtime.coordinator.tree_service`): its item by `decode_item` with no tensors
    taken (what a control link's ``recv`` does once the frame's authentication tag checked,
    which is the transport's and not timed here), then `event_from_wire`,
    `host_event_from_wire` or `root_message_from_wire`."""

    def __init__(
        self,
        workers: int,
        hosts: int,
        *,
        buckets: int = 6,
        tensors: int = 48,
        digest_interval: int = 1,
        fold: bool = True,
    ) -> None:
        if not 1 <= hosts <= workers:
            raise ValueError(f"--hosts must be in [1, {workers}], got {hosts}")
        self.workers, self.buckets, self.fold = workers, buckets, fold
        self.tensors = tuple(name for name, *_ in signature(tensors))
        self.specs = bucket_specs(buckets, tensors)
        self.hashes = [spec_hash(spec) for spec in self.specs]
        self.agreement = agreement_hash(dict(enumerate(self.hashes)))
        self.interval = digest_interval
        core = RootCore(workers, digest_interval=digest_interval, heartbeat_deadline=60.0)
        self.root = RootDriver(core)
        self.groups = [list(range(workers))[h::hosts] for h in range(hosts)]
        self.hosts = [
            HostDriver(
                HostFold(f"node{h}", h, ranks, world_size=workers, elastic=False),
                heartbeat_deadline=60.0,
            )
            for h, ranks in enumerate(self.groups)
        ]
        self.epoch = 0
        self.next_step = 0
        self._named: set[int] = set()
        self._up: deque[tuple[int, bytes]] = deque()
        self._down: list[tuple[tuple[int, ...], bytes]] = []
        self._answers: list[Any] = []
        self.host_seconds: list[float] = []
        self.host_cpu_seconds: list[float] = []
        self.last_cpu_seconds = 0.0
        sig = signature(tensors)
        for h, ranks in enumerate(self.groups):
            frames = [
                (r, self._frame(Joined(r, sig, ("10.0.0.1", 20_000 + r), now=0.0, fold=fold)))
                for r in ranks
            ]
            self._host_step(h, frames)
        self._deliver()
        for h in range(hosts):
            self._fan_out(h)
        self._down.clear()
        if self.root.state is not RunState.RUNNING:
            raise RuntimeError(f"the tree did not start: {self.root.abort_reason}")
        self.epoch = self.root.epoch

    @staticmethod
    def _frame(message: WireMessage) -> bytes:
        kind, fields = message.to_wire()
        return encode_frame_bytes(kind, fields)

    def _host_step(self, h: int, frames: list[tuple[int, bytes]]) -> None:
        """Host ``h`` takes its workers' frames; its frames up are queued for the root."""
        host, up = self.hosts[h], self._up
        for rank, data in frames:
            for action in host.handle(
                event_from_wire(decode_frame(data, tensors=False), rank=rank, now=0.0)
            ):
                if isinstance(action, Up):
                    up.append((h, self._frame(action.message)))

    def _deliver(self) -> None:
        """The root takes the queued host frames; its answers (one frame each) are queued
        for the hosts (`_fan_out`)."""
        root = self.root
        while self._up:
            h, data = self._up.popleft()
            for action in root.handle(
                host_event_from_wire(decode_frame(data, tensors=False), host=h)
            ):
                if isinstance(action, Broadcast):
                    hosts, message = root.members, action.message
                elif isinstance(action, Send):
                    hosts, message = (action.rank,), action.message
                else:
                    raise RuntimeError(f"the root answered {action!r}")
                self._answers.append(message)
                self._down.append((hosts, self._frame(message)))

    def _fan_out(self, h: int) -> None:
        """Host ``h`` takes the root's answers and fans them out (its reports go up)."""
        for hosts, data in self._down:
            if h in hosts:
                message = root_message_from_wire(decode_frame(data, tensors=False))
                for action in self.hosts[h].handle(FromRoot(message)):
                    if isinstance(action, Up):
                        self._up.append((h, self._frame(action.message)))

    def reports(self, step: int) -> list[tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]]:
        """Each host's workers' frames of ``step`` (as `SimulatedRun.reports` builds them):
        its bucket reports, then its step ends (which follow the root's gos)."""
        cached = step > 0
        folded = self.agreement if cached and self.fold else ""
        out = []
        digest_step = step % self.interval == 0
        for ranks in self.groups:
            readies, ends = [], []
            for bucket in reversed(range(self.buckets) if not folded else ()):
                spec: Any = self.hashes[bucket] if cached else self.specs[bucket]
                for rank in ranks:
                    ready = Ready(rank, step, bucket, spec, self.epoch, cached=cached)
                    readies.append((rank, self._frame(ready)))
            for rank in ranks:
                end: WireMessage
                if digest_step:
                    packed = bytes([step % 251]) * (DIGEST_BYTES * len(self.tensors))
                    names = None if rank in self._named else self.tensors
                    self._named.add(rank)
                    digest = b"d%015d" % step
                    end = Digest(rank, step, digest, (), self.epoch, packed, names, folded)
                else:
                    end = StepDone(rank, step, self.epoch, folded)
                ends.append((rank, self._frame(end)))
            out.append((readies, ends))
        return out

    def step(self) -> float:
        """Play the next step; the root's seconds (decoding, deciding, encoding its answer)."""
        step = self.next_step
        per_host = self.reports(step)
        gc.collect(1)  # the collector's young objects are this step's reports: passed over now
        self.host_seconds = [0.0] * len(per_host)
        self.host_cpu_seconds = [0.0] * len(per_host)
        root = root_cpu = 0.0
        self._answers = []
        for phase in (0, 1):  # the bucket reports (and their gos), then the step ends
            for h, frames in enumerate(per_host):
                start, start_cpu = time.perf_counter(), time.thread_time()
                self._host_step(h, frames[phase])
                self.host_seconds[h] += time.perf_counter() - start
                self.host_cpu_seconds[h] += time.thread_time() - start_cpu
            start, start_cpu = time.perf_counter(), time.thread_time()
            self._deliver()
            root += time.perf_counter() - start
            root_cpu += time.thread_time() - start_cpu
            for h in range(len(per_host)):
                start, start_cpu = time.perf_counter(), time.thread_time()
                self._fan_out(h)
                self.host_seconds[h] += time.perf_counter() - start
                self.host_cpu_seconds[h] += time.thread_time() - start_cpu
            self._down.clear()
        answers = self._answers
        self.last_cpu_seconds = root_cpu
        if not any(isinstance(a, Commit) and a.step == step for a in answers):
            raise RuntimeError(f"step {step}: no commit; the root: {self.root.abort_reason}")
        self.next_step += 1
        return root


def time_tree(run: TreeRun, steps: int, warmup: int, *, freeze: bool = True) -> dict[str, float]:
    """The root's and the sub-coordinators' milliseconds a step (median, p99 over steps; the
    hosts' over every host of every step).

    ``freeze``: what exists once the warm-up steps ran (every host's and the root's state,
    and this benchmark's own) is left out of the cyclic garbage collector's passes while the
    steps are timed (`gc.freeze`; the collector runs as usual over everything made after).
    This one process holds a whole tree and its 4,096 simulated workers, which a deployment
    spreads over hundreds of processes: a pass over all of them would be charged to whichever
    host or root happens to be timed when it starts."""
    for _ in range(warmup):
        run.step()
    gc.collect()
    if freeze:
        gc.freeze()
    root_ms, host_ms, root_cpu, host_cpu = [], [], [], []
    try:
        for _ in range(steps):
            root_ms.append(run.step() * 1e3)
            root_cpu.append(run.last_cpu_seconds * 1e3)
            host_ms += [s * 1e3 for s in run.host_seconds]
            host_cpu += [s * 1e3 for s in run.host_cpu_seconds]
    finally:
        gc.unfreeze()
    return {
        "root_median_ms": statistics.median(root_ms),
        "root_p99_ms": percentile(root_ms, 0.99),
        "root_cpu_median_ms": statistics.median(root_cpu),
        "root_cpu_p99_ms": percentile(root_cpu, 0.99),
        "host_median_ms": statistics.median(host_ms),
        "host_p99_ms": percentile(host_ms, 0.99),
        "host_cpu_median_ms": statistics.median(host_cpu),
        "host_cpu_p99_ms": percentile(host_cpu, 0.99),
    }


def _cell(row: dict[str, float], who: str) -> str:
    """``median / p99 (cpu median / cpu p99)`` of ``who`` ("root", "host", "" for flat)."""
    p = f"{who}_" if who else ""
    return (
        f"{row[p + 'median_ms']:.3f} / {row[p + 'p99_ms']:.3f} "
        f"({row[p + 'cpu_median_ms']:.3f} / {row[p + 'cpu_p99_ms']:.3f})"
    )


def tree_main(args: argparse.Namespace) -> int:
    """``--hosts``: the tree at each count of hosts, against the flat core at the same N."""
    options = {"buckets": args.buckets, "tensors": args.tensors, "fold": args.fold}
    print(
        f"coordinator tree: {args.buckets} buckets, {args.tensors} tensors, digest every "
        f"{args.digest_interval} step(s), fold={args.fold}, {args.steps} timed steps; every "
        "report a CBOR frame, decoding timed"
    )
    print("ms a step, wall median / p99 (the thread's cpu median / p99)")
    print(f"{'workers':>8} {'hosts':>6} {'root':>34} {'one host':>34} {'flat core +CBOR':>34}")
    rows: list[dict[str, Any]] = []
    ok = True
    misses: list[str] = []
    for workers in args.workers:
        flat = time_steps(
            SimulatedRun(workers, **options, digest_interval=args.digest_interval, wire=True),
            args.flat_steps,
            min(args.warmup, 3),
        )
        for hosts in args.hosts:
            run = TreeRun(workers, hosts, **options, digest_interval=args.digest_interval)
            tree = time_tree(run, args.steps, args.warmup, freeze=args.freeze)
            rows.append({"workers": workers, "hosts": hosts, "tree": tree, "flat_wire": flat})
            print(
                f"{workers:>8} {hosts:>6} {_cell(tree, 'root'):>34} {_cell(tree, 'host'):>34} "
                f"{_cell(flat, ''):>34}"
            )
            clock = "" if args.target_clock == "wall" else "cpu_"
            for who, target in (("root", args.target_ms), ("host", 1.0)):
                p99 = tree[f"{who}_{clock}p99_ms"]
                if p99 >= target:
                    ok = False
                    misses.append(
                        f"{'the root' if who == 'root' else 'a host'} at {workers} workers on "
                        f"{hosts} hosts: p99 {p99:.3f} ms >= {target} ms"
                    )
    verdict = f"root p99 < {args.target_ms} ms, host p99 < 1 ms ({args.target_clock} time)"
    print(("met: " if ok else "MISSED: ") + verdict)
    for miss in misses:
        print(f"  missed: {miss}")
    result: dict[str, Any] = {"options": options, "steps": args.steps, "tree": rows}
    result["missed"] = misses
    if args.memory_steps > 0:
        workers, hosts = max(args.workers), max(args.hosts)
        print(f"memory of the tree at {workers} workers on {hosts} hosts (rss):")
        run = TreeRun(workers, hosts, **options, digest_interval=args.digest_interval)
        run.step()
        samples = []
        for sample in memory_samples(run, args.memory_steps, args.sample_every):  # type: ignore[arg-type]
            samples.append(sample)  # printed as it comes: a long probe shows its progress
            print(f"{sample['step']:>8} {sample['current_bytes'] / 1024:>12.1f} KiB", flush=True)
        first, last = samples[min(1, len(samples) - 1)], samples[-1]
        growth = last["current_bytes"] - first["current_bytes"]
        print(f"growth from step {first['step']} to step {last['step']}: {growth} bytes")
        result["memory"] = {
            "workers": workers,
            "hosts": hosts,
            "samples": samples,
            "growth_bytes": growth,
        }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def time_steps(run: SimulatedRun, steps: int, warmup: int) -> dict[str, float]:
    """Play ``warmup`` then ``steps`` steps; per-step milliseconds (median, p99, max) of wall
    time, and of this thread's CPU time (the same on an idle core; on a shared machine the
    wall time also counts the time other processes held the core)."""
    for _ in range(warmup):
        run.step()
    gc.collect()
    ms, cpu_ms = [], []
    for _ in range(steps):
        ms.append(run.step() * 1e3)
        cpu_ms.append(run.last_cpu_seconds * 1e3)
    reports = len(run.reports(run.next_step))
    return {
        "median_ms": statistics.median(ms),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": max(ms),
        "cpu_median_ms": statistics.median(cpu_ms),
        "cpu_p99_ms": percentile(cpu_ms, 0.99),
        "reports_per_step": reports,
        "us_per_report": statistics.median(ms) * 1e3 / reports,
    }


def _rss_bytes() -> int:
    """This process's resident set size (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def memory_samples(
    run: SimulatedRun, steps: int, every: int, probe: str = "rss"
) -> Iterator[dict[str, int]]:
    """Play ``steps`` steps; the memory every ``every`` steps, from the first (right after
    the start). ``probe``: "rss" (the resident set, no overhead) or "tracemalloc" (the Python
    heap allocated since the first sample, current and peak; slows each step several
    times)."""
    traced = probe == "tracemalloc"
    gc.collect()
    if traced:
        tracemalloc.start()
    try:
        if traced:
            tracemalloc.reset_peak()
        for index in range(steps + 1):
            if index % every == 0:
                gc.collect()
                if traced:
                    current, peak = tracemalloc.get_traced_memory()
                    tracemalloc.reset_peak()
                else:
                    current = peak = _rss_bytes()
                yield {"step": run.next_step, "current_bytes": current, "peak_bytes": peak}
            if index < steps:
                run.step()
    finally:
        if traced:
            tracemalloc.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    parser.add_argument("--steps", type=int, default=300, help="timed steps per worker count")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--buckets", type=int, default=6)
    parser.add_argument("--tensors", type=int, default=48, help="parameters of the model")
    parser.add_argument("--digest-interval", type=int, default=1)
    parser.add_argument("--elastic", action="store_true", help="apply barrier (reduced/apply)")
    parser.add_argument(
        "--fold",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="workers fold their cached bucket reports into their step report (the trainer's "
        "default with the response cache); --no-fold: one cached ready per bucket",
    )
    parser.add_argument(
        "--wire",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time each count with every report decoded from its CBOR frame",
    )
    parser.add_argument("--memory-steps", type=int, default=10_000)
    parser.add_argument("--sample-every", type=int, default=1000)
    parser.add_argument(
        "--memory-probe",
        choices=["rss", "tracemalloc"],
        default="rss",
        help="resident set (default) or the traced Python heap (several times slower)",
    )
    parser.add_argument(
        "--target-ms", type=float, default=5.0, help="the core's p99 at the largest N"
    )
    parser.add_argument(
        "--target-clock",
        choices=["wall", "cpu"],
        default="wall",
        help="check the target against wall time (default) or the thread's CPU time (on a "
        "machine shared with other work)",
    )
    parser.add_argument(
        "--hosts",
        type=int,
        nargs="+",
        help="time the coordinator tree (a sub-coordinator per host under a root) at each "
        "count of hosts, against the flat coordinator with decoding at the same --workers",
    )
    parser.add_argument(
        "--flat-steps", type=int, default=50, help="timed steps of the flat core with --hosts"
    )
    parser.add_argument(
        "--freeze",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --hosts: leave what exists before the timed steps (the whole simulated "
        "tree) out of the garbage collector's passes while they are timed (gc.freeze)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.hosts:
        return tree_main(args)

    options = {
        "buckets": args.buckets,
        "tensors": args.tensors,
        "digest_interval": args.digest_interval,
        "elastic": args.elastic,
        "fold": args.fold,
    }
    print(
        f"control plane: {args.buckets} buckets, {args.tensors} tensors, digest every "
        f"{args.digest_interval} step(s), elastic={args.elastic}, fold={args.fold}, "
        f"{args.steps} timed steps; "
        "per step, from the first report to the commit"
    )
    head = f"{'workers':>8} {'reports':>8} {'core median ms':>15} {'p99 ms':>8} {'us/report':>10}"
    head += f" {'cpu median ms':>14} {'cpu p99 ms':>11}"
    print(head + (f" {'+CBOR median ms':>16} {'p99 ms':>8}" if args.wire else ""))
    rows = []
    for workers in args.workers:
        core = time_steps(SimulatedRun(workers, **options, wire=False), args.steps, args.warmup)
        row: dict[str, Any] = {"workers": workers, "core": core}
        line = (
            f"{workers:>8} {core['reports_per_step']:>8} {core['median_ms']:>15.3f} "
            f"{core['p99_ms']:>8.3f} {core['us_per_report']:>10.2f} "
            f"{core['cpu_median_ms']:>14.3f} {core['cpu_p99_ms']:>11.3f}"
        )
        if args.wire:
            wire = time_steps(SimulatedRun(workers, **options, wire=True), args.steps, args.warmup)
            row["wire"] = wire
            line += f" {wire['median_ms']:>16.3f} {wire['p99_ms']:>8.3f}"
        rows.append(row)
        print(line)
    result: dict[str, Any] = {"options": options, "steps": args.steps, "timing": rows}
    ok = True
    largest = max(args.workers)
    top = next(r for r in rows if r["workers"] == largest)["core"]
    p99 = top["p99_ms"] if args.target_clock == "wall" else top["cpu_p99_ms"]
    verdict = f"core p99 ({args.target_clock}) {p99:.3f} ms at {largest} workers"
    if p99 >= args.target_ms:
        ok = False
        print(f"MISSED: {verdict} >= {args.target_ms} ms")
    else:
        print(f"met: {verdict} < {args.target_ms} ms")
    if args.memory_steps > 0:
        probe = args.memory_probe
        print(f"memory at {largest} workers over {args.memory_steps} steps ({probe}, core only):")
        print(f"{'step':>8} {'current KiB':>12} {'peak KiB':>10}")
        run = SimulatedRun(largest, **options, wire=False)
        run.step()  # step 0 negotiates every bucket; the steady state starts after it
        samples = []
        for sample in memory_samples(run, args.memory_steps, args.sample_every, probe):
            samples.append(sample)
            print(
                f"{sample['step']:>8} {sample['current_bytes'] / 1024:>12.1f} "
                f"{sample['peak_bytes'] / 1024:>10.1f}"
            )
        first, last = samples[min(1, len(samples) - 1)], samples[-1]
        growth = last["current_bytes"] - first["current_bytes"]
        print(f"growth from step {first['step']} to step {last['step']}: {growth} bytes")
        result["memory"] = {
            "workers": largest,
            "probe": probe,
            "samples": samples,
            "growth_bytes": growth,
        }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
