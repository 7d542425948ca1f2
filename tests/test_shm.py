"""The shared-memory data plane (`paramsync.runtime.transport.shm`): property tests against a
float64 reference and bitwise against the TCP ring, setup and fallback, cleanup of the segment, and
failures that must end in a clear error, never a hang.

In-process groups are real TCP meshes with the plane attached; the multi-process tests start
real worker processes on this host.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from conftest import bitwise_equal, free_port, run_ranks, run_ranks_capture
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from test_collectives import REDUCE_DTYPES, check_identical, check_reduced, make_inputs, numels

from paramsync.runtime.collectives.ring import all_reduce, barrier
from paramsync.runtime.errors import CollectiveError, PeerClosed, ProtocolError, StallError
from paramsync.runtime.protocol.wire import decode_frame
from paramsync.runtime.transport import shm as shm_module
from paramsync.runtime.transport.base import InProcessTransport, Transport
from paramsync.runtime.transport.capabilities import SharedMemoryHolder
from paramsync.runtime.transport.shm import (
    SHM_DIR,
    SharedMemoryPlane,
    attach_shared_memory,
    host_identity,
)
from paramsync.runtime.transport.tcp import TcpTransport

ROOT = Path(__file__).resolve().parent.parent
MAX_STEPS = 24
"""Steps per all-reduce at most: small steps on small tensors only, so a run stays fast."""

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")


@dataclass(frozen=True)
class ShmCase:
    n: int
    dtype: torch.dtype
    numel: int
    step_bytes: int
    seed: int
    op: str
    two_d: bool = False
    threaded: bool = False


@st.composite
def shm_cases(draw: st.DrawFn) -> ShmCase:
    """A group of 1-8 ranks, a length (mostly not a multiple of n), and a step small enough
    to cut the tensor into many steps (at most MAX_STEPS)."""
    n = draw(st.integers(1, 8))
    dtype = draw(st.sampled_from(REDUCE_DTYPES))
    numel = draw(numels(n, 300_000, ("tiny", "small", "medium", "small", "large")))
    itemsize = torch.empty((), dtype=dtype).element_size()
    floor = max(64 * n, -(-numel * itemsize // MAX_STEPS))
    step = max(floor, draw(st.integers(64 * n, 64 * 1024)))
    return ShmCase(
        n=n,
        dtype=dtype,
        numel=numel,
        step_bytes=step,
        seed=draw(st.integers(0, 2**31 - 1)),
        op=draw(st.sampled_from(("sum", "avg"))),
        threaded=draw(st.booleans()),
    )


def _reduce_both_ways(case: ShmCase) -> tuple[list, list, list, list]:
    """All-reduce the case's inputs on the plane, then again on the TCP ring (plane detached).

    Returns (inputs, plane results, ring results, planes). ``small_bytes=0`` keeps every
    nonempty tensor off the one-round path, so the plane sees tensors of every size."""
    inputs = make_inputs(case)  # type: ignore[arg-type]
    via_shm = [t.clone() for t in inputs]
    via_ring = [t.clone() for t in inputs]

    def reducer(tensors: list[torch.Tensor]) -> Callable[[Transport], Awaitable[torch.Tensor]]:
        async def reduce(transport: Transport) -> torch.Tensor:
            mine = tensors[transport.rank]
            return await all_reduce(transport, mine, case.op, small_bytes=0)  # type: ignore[arg-type]

        return reduce

    async def main() -> list:
        async with TcpTransport.open_group(
            case.n,
            shared_memory=True,
            step_bytes=case.step_bytes,
            min_bytes=0,
            threaded=case.threaded,
        ) as group:
            planes = [t.shared_memory for t in group]
            await run_ranks(group, reducer(via_shm))
            for transport in group:
                transport.shared_memory = None
            await run_ranks(group, reducer(via_ring))
            for transport, plane in zip(group, planes):
                transport.shared_memory = plane
            await run_ranks(group, barrier)  # still in step after both
            return planes

    planes = trio.run(main)
    return inputs, via_shm, via_ring, planes


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=shm_cases())
def test_plane_matches_reference_and_is_bitwise_the_ring(case: ShmCase) -> None:
    note(repr(case))
    inputs, via_shm, via_ring, planes = _reduce_both_ways(case)
    if case.n > 1:
        assert all(isinstance(plane, SharedMemoryPlane) for plane in planes)
        assert all(plane.threaded == case.threaded for plane in planes)
        note(f"steps of {planes[0].layout.step_bytes} bytes")
    check_reduced(via_shm[0], inputs, case.op)
    check_identical(via_shm)
    for rank in range(case.n):
        assert bitwise_equal(via_shm[rank], via_ring[rank]), f"rank {rank}: plane != ring"


@pytest.mark.parametrize("threaded", [False, True], ids=["event-loop", "threaded"])
async def test_whole_and_split_all_reduces_back_to_back_stay_bitwise_the_ring(
    threaded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small all-reduces take one signal (every rank sums the whole tensor), larger ones a
    signal per step and one more; the areas alternate with the plane's signal count across
    all-reduces of either kind. Mixed back to back, with ranks racing ahead of each other,
    every result is bitwise the ring's and the signals are counted as said."""
    monkeypatch.setattr(shm_module, "WHOLE_REDUCE_MAX_BYTES", 64 * 1024)
    n, step = 3, 3 * 8192  # an 8 KiB piece per rank: 6144 float32s a segment per step
    sizes = [5_000, 16_001, 30_000, 7, 60_000, 16_384, 3_000, 100_003, 12_000, 12_000]
    ops = ["avg", "sum"] * 5
    gen = torch.Generator().manual_seed(7)
    inputs = [[torch.randn(size, generator=gen) for _ in range(n)] for size in sizes]
    expected_signals = 0
    for size in sizes:
        longest = (size + n - 1) // n  # segment 0's length
        steps = max(1, (longest + 2047) // 2048)
        whole = steps == 1 and size * 4 <= 64 * 1024
        expected_signals += 1 if whole else steps + 1

    async def run_all(group: list[TcpTransport], on_plane: bool) -> list[list[torch.Tensor]]:
        async def rank_fn(transport: Transport) -> list[torch.Tensor]:
            out = []
            for index, (tensors, op) in enumerate(zip(inputs, ops)):
                if on_plane and transport.rank == index % n:
                    await trio.sleep(0.01)  # this rank comes last to this one
                mine = tensors[transport.rank].clone()
                out.append(await all_reduce(transport, mine, op, small_bytes=0))  # type: ignore[arg-type]
            return out

        return await run_ranks(group, rank_fn)

    async with TcpTransport.open_group(
        n, shared_memory=True, step_bytes=step, min_bytes=0, threaded=threaded
    ) as group:
        planes = [t.shared_memory for t in group]
        via_plane = await run_all(group, True)
        assert all(plane is not None and plane._signals == expected_signals for plane in planes)
        for transport in group:
            transport.shared_memory = None
        via_ring = await run_all(group, False)
    for rank in range(n):
        for index, (got, want) in enumerate(zip(via_plane[rank], via_ring[rank])):
            assert bitwise_equal(got, want), f"rank {rank}, all-reduce {index}: plane != ring"


async def test_segment_file_is_unlinked_once_attached_and_unmapped_on_close() -> None:
    async with TcpTransport.open_group(3, shared_memory=True) as group:
        planes = [t.shared_memory for t in group]
        assert all(isinstance(plane, SharedMemoryPlane) for plane in planes)
        paths = {plane.path for plane in planes}  # type: ignore[union-attr]
        assert len(paths) == 1
        (path,) = paths
        assert path.startswith(SHM_DIR + "/paramsync-")
        assert not os.path.exists(path)  # noqa: ASYNC240 - a quick local check
        maps = Path("/proc/self/maps").read_text()  # noqa: ASYNC240
        assert f"{path} (deleted)" in maps  # mapped, yet gone from the file system

        async def reduce(transport: Transport) -> torch.Tensor:
            return await all_reduce(transport, torch.ones(100_000, dtype=torch.float64))

        assert all(torch.equal(r, torch.full_like(r, 3.0)) for r in await run_ranks(group, reduce))
    assert all(plane.closed for plane in planes)  # type: ignore[union-attr]
    assert all(t.shared_memory is None for t in group)
    assert path not in Path("/proc/self/maps").read_text()  # noqa: ASYNC240 - unmapped


async def test_abort_drops_the_plane() -> None:
    async with TcpTransport.open_group(2, shared_memory=True) as group:
        plane = group[0].shared_memory
        assert plane is not None
        group[0].abort()
        assert plane.closed and group[0].shared_memory is None
        assert group[1].shared_memory is not None  # the peer's own plane is its own business


async def test_host_mismatch_falls_back_to_tcp() -> None:
    async with TcpTransport.open_group(3) as group:

        async def attach(transport: Transport) -> object:
            host = "host-a" if transport.rank < 2 else "host-b"
            return await attach_shared_memory(transport, want=True, host=host)  # type: ignore[arg-type]

        assert await run_ranks(group, attach) == [None, None, None]
        assert all(t.shared_memory is None for t in group)
        tensors = [torch.full((100_000,), float(rank + 1)) for rank in range(3)]

        async def reduce(transport: Transport) -> torch.Tensor:
            return await all_reduce(transport, tensors[transport.rank])

        results = await run_ranks(group, reduce)
        assert all(torch.equal(r, torch.full((100_000,), 6.0)) for r in results)


async def test_one_rank_opting_out_turns_the_plane_off_for_all() -> None:
    async with TcpTransport.open_group(3) as group:

        async def attach(transport: Transport) -> object:
            return await attach_shared_memory(transport, want=transport.rank != 1)  # type: ignore[arg-type]

        assert await run_ranks(group, attach) == [None, None, None]


async def test_paramsync_shm_env_decides_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    async with TcpTransport.open_group(2) as group:
        monkeypatch.setenv("PARAMSYNC_SHM", "0")
        assert await run_ranks(group, attach_shared_memory) == [None, None]
        monkeypatch.setenv("PARAMSYNC_SHM", "1")
        planes = await run_ranks(group, attach_shared_memory)
        assert all(isinstance(plane, SharedMemoryPlane) for plane in planes)


class FramedInProcess(InProcessTransport, SharedMemoryHolder):
    """An in-process transport that declares pre-encoded frames and a shared-memory plane but
    lends no polled links: the plane must run on it through the interfaces alone."""

    stall_seconds = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shared_memory = None

    async def send_frame(self, peer: int, frame: bytes) -> None:
        self.check_peer(peer)
        await self._senders[peer].send(frame)

    async def recv_matching(self, peer: int, expected: bytes) -> dict[str, Any] | None:
        self.check_peer(peer)
        frame = await self._receivers[peer].receive()
        return None if frame == expected else decode_frame(frame, self.max_frame)

    async def aclose(self) -> None:
        if self.shared_memory is not None:
            self.shared_memory.close()
            self.shared_memory = None
        await super().aclose()


async def test_the_plane_runs_on_any_holder_and_refuses_other_transports() -> None:
    """shm depends on the capability interfaces, not on TCP: it attaches to any
    SharedMemoryHolder, refuses a transport that is none by name, and a threaded plane on a
    holder that lends no polled links refuses to run rather than probe for them."""
    plain = InProcessTransport.create_group(2)
    with pytest.raises(CollectiveError, match="InProcessTransport cannot carry a shared-memory"):
        await attach_shared_memory(plain[0])  # type: ignore[arg-type]
    group = FramedInProcess.create_group(2)
    try:
        planes = await run_ranks(
            group,
            lambda t: attach_shared_memory(t, want=True, min_bytes=0),  # type: ignore[arg-type]
        )
        assert all(isinstance(plane, SharedMemoryPlane) for plane in planes)
        tensors = [torch.arange(50_000, dtype=torch.float32) * (rank + 1) for rank in range(2)]
        await run_ranks(group, lambda t: all_reduce(t, tensors[t.rank], small_bytes=0))
        assert all(torch.equal(t, torch.arange(50_000, dtype=torch.float32) * 3) for t in tensors)
        for plane in planes:
            plane.threaded = True
        with pytest.raises(CollectiveError, match="needs polled links"):
            await all_reduce(group[0], tensors[0], small_bytes=0)
    finally:
        for transport in [*plain, *group]:
            await transport.aclose()
    assert all(plane.closed for plane in planes)


def imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, at its top or inside a function."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


def test_shm_imports_neither_tcp_nor_the_collectives() -> None:
    """The layering: the plane sits on the capability interfaces (no tcp <-> shm cycle), and
    no transport module imports the collectives or anything else above it."""
    transport = ROOT / "runtime" / "transport"
    for name in ("shm.py", "capabilities.py", "segments.py", "base.py"):
        assert "paramsync.runtime.transport.tcp" not in imported_modules(transport / name), name
    above = (
        "paramsync.runtime.collectives",
        "paramsync.runtime.actor",
        "paramsync.runtime.coordinator",
        "paramsync.runtime.cli",
        "paramsync.actors",
    )
    for path in transport.glob("*.py"):
        wrong = [m for m in imported_modules(path) if m.startswith(above)]
        assert not wrong, f"{path.name} imports {wrong} from above the transport layer"


THREADED = pytest.mark.parametrize("threaded", [False, True], ids=["event-loop", "threaded"])


@THREADED
async def test_silent_peer_is_a_stall_error_naming_it(threaded: bool) -> None:
    async with TcpTransport.open_group(
        3, shared_memory=True, min_bytes=0, threaded=threaded
    ) as group:
        for transport in group:
            transport.stall_seconds = 0.5
        tensor = torch.ones(50_000)

        async def rank_fn(transport: Transport) -> object:
            if transport.rank == 2:
                await trio.sleep(1.5)  # alive, never joins the all-reduce
                return None
            return await all_reduce(transport, tensor.clone())

        start = time.monotonic()
        results = await run_ranks_capture(group, rank_fn, seconds=10)
        assert time.monotonic() - start < 5
        failures = [r for r in results[:2] if isinstance(r, ProtocolError)]
        assert len(failures) == 2, results
        assert any(isinstance(r, StallError) and r.peer == 2 for r in failures), failures


@THREADED
async def test_ranks_out_of_step_fail_instead_of_hanging(threaded: bool) -> None:
    async with TcpTransport.open_group(
        2, shared_memory=True, min_bytes=0, threaded=threaded
    ) as group:
        group[1].shared_memory = None  # rank 1 takes the ring, rank 0 the plane
        for transport in group:
            transport.stall_seconds = 5

        async def rank_fn(transport: Transport) -> object:
            return await all_reduce(transport, torch.ones(100_000))

        results = await run_ranks_capture(group, rank_fn, seconds=15)
        assert all(isinstance(r, ProtocolError) for r in results), results


@THREADED
async def test_a_signal_of_another_collective_is_named_not_taken(threaded: bool) -> None:
    """A well-formed signal for another op fails the all-reduce naming the peer and both ops."""
    async with TcpTransport.open_group(
        2, shared_memory=True, min_bytes=0, threaded=threaded
    ) as group:
        group[1].next_op_id()  # rank 1 is one collective ahead

        async def rank_fn(transport: Transport) -> object:
            return await all_reduce(transport, torch.ones(100_000))

        results = await run_ranks_capture(group, rank_fn, seconds=15)
        assert isinstance(results[0], ProtocolError) and results[0].peer == 1, results
        assert "sent shm_step op 1 step 0 during shared-memory all-reduce op 0" in str(results[0])


async def test_a_cancelled_threaded_all_reduce_returns_at_once_and_breaks_the_transport() -> None:
    async with TcpTransport.open_group(2, shared_memory=True, min_bytes=0, threaded=True) as group:
        started = time.monotonic()
        with trio.move_on_after(0.3):  # rank 1 never joins
            await all_reduce(group[0], torch.ones(100_000))
        assert time.monotonic() - started < 3
        assert group[0].shared_memory is None  # aborted: the plane is dropped
        assert (await group[1].recv(0))["kind"] == "shm_step"  # sent before the wait
        with pytest.raises(PeerClosed):
            await group[1].recv(0)  # then the peer sees the break at once


async def test_a_peer_that_closes_mid_all_reduce_is_named() -> None:
    async with TcpTransport.open_group(3, shared_memory=True, min_bytes=0, threaded=True) as group:

        async def rank_fn(transport: Transport) -> object:
            if transport.rank == 2:
                await trio.sleep(0.2)
                await transport.aclose()
                return None
            return await all_reduce(transport, torch.ones(100_000))

        results = await run_ranks_capture(group, rank_fn, seconds=15)
        assert all(isinstance(r, PeerClosed) for r in results[:2]), results
        assert any(r.peer == 2 for r in results[:2]), results  # type: ignore[union-attr]


# --------------------------------------------------------------------------- real processes

_WORKER = r"""
import json, os, sys, time
import torch, trio
from paramsync.runtime import DistributedConfig, TcpTransport, all_reduce

rank, world, port, loops = (int(arg) for arg in sys.argv[1:5])

async def main():
    config = DistributedConfig(world, rank, f"127.0.0.1:{port}")
    secret = "shm-tests-secret-0123456789"  # 16 bytes: the shortest a shared secret may be
    async with TcpTransport.connect(config, secret=secret, join_seconds=30) as transport:
        plane = transport.shared_memory
        transport.stall_seconds = 20
        attached = plane is not None
        report = {"attached": attached, "path_left": attached and os.path.exists(plane.path)}
        gen = torch.Generator().manual_seed(rank)
        data = torch.randn(300_001, generator=gen, dtype=torch.float64).to(torch.float32)
        out = await all_reduce(transport, data.clone(), "avg")
        report["sum"] = float(out.double().sum())
        report["bytes"] = out.numpy().tobytes().hex()[:4096]
        print(json.dumps(report), flush=True)
        big = torch.ones(4 << 20)
        started = time.monotonic()
        try:
            for _ in range(loops):
                await all_reduce(transport, big)
        except Exception as exc:
            error = {"error": type(exc).__name__, "peer": getattr(exc, "peer", None)}
            error.update(message=str(exc), after=time.monotonic() - started)
            print(json.dumps(error), flush=True)
            sys.exit(3)

trio.run(main)
"""


def _start_workers(world: int, loops: int) -> list[subprocess.Popen[str]]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PARAMSYNC_SHM="1")
    return [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(rank), str(world), str(port), str(loops)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]


def _expected_average(world: int) -> torch.Tensor:
    rows = [
        torch.randn(300_001, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        .to(torch.float32)
        .double()
        for rank in range(world)
    ]
    return torch.stack(rows).mean(0)


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[list[subprocess.Popen[str]], list[dict]]]:
    """Three worker processes that attached, reduced once and reported, now looping on
    all-reduces of 16 MiB (one start for both tests below: importing torch is slow)."""
    procs = _start_workers(3, loops=1_000_000)
    try:
        reports = []
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line, proc.communicate(timeout=30)[1]
            reports.append(json.loads(line))
        yield procs, reports
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)


def test_processes_attach_reduce_and_agree(workers: tuple[list, list[dict]]) -> None:
    _, reports = workers
    assert all(r["attached"] for r in reports)
    assert not any(r["path_left"] for r in reports)
    assert len({r["bytes"] for r in reports}) == 1  # bitwise identical on every rank
    assert reports[0]["sum"] == pytest.approx(float(_expected_average(3).sum()), abs=1e-2)


def test_killed_peer_fails_the_others_with_a_clear_error(
    workers: tuple[list[subprocess.Popen[str]], list[dict]],
) -> None:
    procs, _ = workers
    time.sleep(0.3)  # all three are deep in the loop of 16 MiB all-reduces
    procs[2].send_signal(signal.SIGKILL)
    started = time.monotonic()
    errors = []
    for proc in procs[:2]:
        out, err = proc.communicate(timeout=15)
        assert proc.returncode == 3, err
        errors.append(json.loads(out.strip().splitlines()[-1]))
    assert time.monotonic() - started < 15
    assert all(e["error"] in ("PeerClosed", "StallError") for e in errors), errors
    assert any(e["peer"] == 2 and "peer 2" in e["message"] for e in errors), errors


def test_host_identity_is_the_users_word_when_given() -> None:
    assert host_identity({"PARAMSYNC_HOST_ID": "rack4-node7"}) == "id:rack4-node7"
    assert host_identity({"PARAMSYNC_HOST_ID": "a"}) != host_identity({"PARAMSYNC_HOST_ID": "b"})
    long = host_identity({"PARAMSYNC_HOST_ID": "x" * 1000})
    assert len(long) < 512 and long != host_identity({"PARAMSYNC_HOST_ID": "x" * 999})
    assert host_identity({"PARAMSYNC_HOST_ID": "  "}) == host_identity({})  # blank: not given


def test_host_identity_names_the_network_namespace() -> None:
    """Ranks in two network namespaces of one kernel share /dev/shm but are two hosts."""
    mine = host_identity({})
    assert os.readlink("/proc/self/ns/net") in mine
    script = "from paramsync.runtime.transport.shm import host_identity; print(host_identity({}))"
    same = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert same.stdout.strip() == mine  # another process of this namespace: the same host
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to start a process in a new network namespace")
    other = subprocess.run(
        [unshare, "--net", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if other.returncode != 0:
        pytest.skip(f"unshare --net failed here: {other.stderr.strip()[-200:]}")
    assert other.stdout.strip() != mine
    assert other.stdout.split("/")[0] == mine.split("/")[0]  # one kernel: one boot id
