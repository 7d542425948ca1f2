"""paramsync as a torch.distributed backend: plain torch scripts (tests/torch_backend_worker.py).

* every collective torch's API offers gives bitwise the same result on every rank, and the
  value a single process computes (the reduce ops, dtypes, async works, groups, objects);
* ranks that call different collectives, or different shapes, are stopped with an error that
  names the ranks and both calls;
* a replica nudged after an optimizer step is caught at that step, naming the rank and tensor
  (C-DDP-001 over torch DDP);
* a rank SIGKILLed in the middle of training, or one that stalls, is named to every survivor
  within the deadline: nothing hangs;
* the backend's registration at ``import torch`` costs little and never breaks it.

The collectives also run in wrapper mode (``PARAMSYNC_TORCH_INNER=gloo``: the bytes through an
inner gloo group, the coordinator's agreement and proof unchanged); the soak run (``-m soak``)
runs the other scenarios in wrapper mode too: DDP, the mismatches, the nudged replica, the
killed ranks, the stall and the idle group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from rank_processes import run_ranks
from torch_backend_worker import REDUCE_OPS, values

WORKER = Path(__file__).with_name("torch_backend_worker.py")
PER_RANK = ("recv", "subgroup", "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single")
"""Results that differ by rank by design (each rank's own part)."""
SECRET = "torch-backend-tests-Secret-0123456789-abcdefghij"

INNER = pytest.mark.parametrize("inner", ["native", pytest.param("gloo", id="gloo-inside")])
"""Run on the native plane and in wrapper mode (an inner gloo group carries the bytes)."""
INNER_SOAK = pytest.mark.parametrize(
    "inner", ["native", pytest.param("gloo", id="gloo-inside", marks=pytest.mark.soak)]
)
"""As `INNER`, wrapper mode in the soak run only."""

FLOAT_SUMS = (
    "allreduce/big",
    "allreduce/bfloat16",
    "allreduce/complex64",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "async",
)
"""Results that sum floating point values of 3 ranks (besides ``allreduce/{sum,avg,product}``
of a float dtype): gloo sums in another order than paramsync's ring, so they agree with the
native plane's within rounding, and bitwise across ranks."""


def launch(
    scenario: str, world: int, out: Path, *, seconds: float = 120, **env_extra: str
) -> list[tuple[int, str]]:
    """Run ``scenario`` on ``world`` ranks; returns each rank's (exit code, output)."""
    env = dict(os.environ, PARAMSYNC_SECRET=SECRET, OMP_NUM_THREADS="1", **env_extra)
    store = str(out / "store")
    return run_ranks(
        [
            [sys.executable, str(WORKER), scenario, str(rank), str(world), store, str(out)]
            for rank in range(world)
        ],
        env,
        seconds=seconds,
    )


def error_line(out: Path, rank: int) -> tuple[float, str]:
    seconds, line = (out / f"rank{rank}.err").read_text().splitlines()[:2]
    return float(seconds), line


def planes(out: Path, rank: int) -> dict[str, int]:
    """How many of the world group's calls each plane ran on ``rank``."""
    counts: dict[str, int] = json.loads((out / f"rank{rank}.planes.json").read_text())
    return counts


Run = tuple[list[dict[str, torch.Tensor]], list[dict[str, int]]]


@pytest.fixture(scope="module")
def collective_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """The collectives scenario on 3 ranks with an inner group (run once per kind): each
    rank's results and calls by plane."""
    runs: dict[str, Run] = {}

    def run(inner: str) -> Run:
        if inner not in runs:
            out = tmp_path_factory.mktemp(f"torch-backend-collectives-{inner}")
            world = 3
            results = launch("collectives", world, out, PARAMSYNC_TORCH_INNER=inner)
            for rank, (code, output) in enumerate(results):
                assert code == 0, f"rank {rank} exited {code}:\n{output[-3000:]}"
            runs[inner] = (
                [torch.load(out / f"rank{rank}.pt") for rank in range(world)],
                [planes(out, rank) for rank in range(world)],
            )
        return runs[inner]

    return run


@pytest.fixture(scope="module", params=["native", pytest.param("gloo", id="gloo-inside")])
def collective_results(
    request: pytest.FixtureRequest, collective_runs: Callable[[str], Run]
) -> list[dict[str, torch.Tensor]]:
    return collective_runs(request.param)[0]


def test_every_rank_gets_bitwise_the_same_results(
    collective_results: list[dict[str, torch.Tensor]],
) -> None:
    first = collective_results[0]
    for rank, result in enumerate(collective_results[1:], start=1):
        for key in first:
            if key in PER_RANK:
                continue
            assert torch.equal(result[key], first[key]), f"rank {rank} differs in {key}"
    assert torch.equal(collective_results[1]["subgroup"], collective_results[2]["subgroup"])


def test_results_are_the_single_process_values(
    collective_results: list[dict[str, torch.Tensor]],
) -> None:
    world = len(collective_results)
    got = collective_results[0]
    inputs = {
        dtype: [values(r, dtype) for r in range(world)]
        for dtype in (torch.float32, torch.float64, torch.int64, torch.int32)
    }
    for name in REDUCE_OPS:
        for dtype, rows in inputs.items():
            key = f"allreduce/{name}/{dtype}"
            if key not in got:
                continue
            stacked = torch.stack(rows)
            expected = {
                "sum": lambda s: s.sum(0),
                "avg": lambda s: s.mean(0),
                "product": lambda s: s.prod(0),
                "min": lambda s: s.min(0).values,
                "max": lambda s: s.max(0).values,
                "band": lambda s: s[0] & s[1] & s[2],
                "bor": lambda s: s[0] | s[1] | s[2],
                "bxor": lambda s: s[0] ^ s[1] ^ s[2],
            }[name](stacked)
            if dtype.is_floating_point:
                torch.testing.assert_close(got[key], expected.to(dtype), msg=key)
            else:
                assert torch.equal(got[key], expected.to(dtype)), key
    for root in range(world):
        assert torch.equal(got[f"broadcast/{root}"], values(root, torch.float32))
    rows = torch.stack([values(r, torch.float32) for r in range(world)])
    assert torch.equal(got["allgather"], rows)
    assert torch.equal(got["allgather_into_tensor"], rows.view(-1))
    summed = torch.stack([values(r, torch.float32, 8 * world) for r in range(world)]).sum(0)
    for rank, result in enumerate(collective_results):
        torch.testing.assert_close(result["reduce_scatter_tensor"], summed[8 * rank : 8 * rank + 8])
        torch.testing.assert_close(result["reduce_scatter"], summed[8 * rank : 8 * rank + 8])
        expected_a2a = torch.cat(
            [
                torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32) + 100 * src
                for src in range(world)
            ]
        )
        assert torch.equal(result["all_to_all_single"], expected_a2a)
        assert torch.equal(result["objects"], torch.arange(world))
    assert torch.equal(collective_results[1]["recv"], torch.full((5,), 7.0))
    torch.testing.assert_close(
        got["allreduce/big"],
        torch.stack([values(r, torch.float32, 300_000) for r in range(world)]).sum(0),
    )


def test_gloo_inside_carries_the_bytes_alike_with_the_native_plane(
    collective_runs: Callable[[str], Run],
) -> None:
    """In wrapper mode the inner gloo group carries every collective but the barrier, and each
    result is bitwise the native plane's, floating point sums aside (another summation
    order: equal within rounding)."""
    native, _ = collective_runs("native")
    wrapped, counts = collective_runs("gloo")
    for rank, count in enumerate(counts):
        # The barrier, and rank 0's send and rank 1's receive: gloo's point-to-point waits
        # for the receiver, so it stays on the native plane.
        assert count["gloo"] >= 35 and count["native"] == (2 if rank < 2 else 1), (rank, count)
    for rank in range(len(native)):
        for key, expected in native[rank].items():
            got = wrapped[rank][key]
            sums = key.endswith(("/torch.float32", "/torch.float64")) and key.startswith(
                ("allreduce/sum/", "allreduce/avg/", "allreduce/product/")
            )
            if key == "allreduce/bfloat16":
                # Each order rounds twice to bfloat16, by at most half a step (2**-5 for the
                # partial sums here, all below 8): the two sums are within 2**-4.
                difference = (got.float() - expected.float()).abs().max().item()
                assert difference <= 2**-4, f"rank {rank}: {key} differs by {difference}"
            elif sums or key in FLOAT_SUMS:
                torch.testing.assert_close(got, expected, msg=f"rank {rank}: {key}")
            else:
                assert torch.equal(got, expected), f"rank {rank}: {key}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_tensors_go_through_nccl_inside(tmp_path: Path) -> None:
    """On one GPU (NCCL refuses two ranks on one device): every collective on CUDA tensors
    runs on the inner NCCL group, the tensors never leaving the device, with the single
    process's values; DDP trains on it and the proof runs every step."""
    results = launch("collectives", 1, tmp_path, TORCHDIST_DEVICE="cuda")
    assert results[0][0] == 0, results[0][1][-3000:]
    got = torch.load(tmp_path / "rank0.pt")
    for name in ("sum", "max", "bxor"):
        dtype = torch.int64
        assert torch.equal(got[f"allreduce/{name}/{dtype}"], values(0, dtype)), name
    assert torch.equal(got["allgather"], values(0, torch.float32).view(1, -1))
    assert torch.equal(got["all_to_all_single"], torch.arange(4, dtype=torch.float32))
    assert planes(tmp_path, 0)["nccl"] >= 30, planes(tmp_path, 0)
    trained = launch("train", 1, tmp_path / "train", TORCHDIST_DEVICE="cuda")
    assert trained[0][0] == 0, trained[0][1][-3000:]
    assert planes(tmp_path / "train", 0)["nccl"] > 6


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two NVIDIA GPUs")
def test_cuda_tensors_through_nccl_are_bitwise_alike(tmp_path: Path) -> None:
    """The collectives on CUDA tensors, 2 ranks on 2 GPUs through the inner NCCL group: every
    rank gets bitwise the same results, and the point-to-point message."""
    results = launch("collectives", 2, tmp_path, TORCHDIST_DEVICE="cuda")
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{output[-3000:]}"
    ours = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for key in ours[0]:
        if key not in PER_RANK:
            assert torch.equal(ours[0][key], ours[1][key]), key
    assert torch.equal(ours[1]["recv"], torch.full((5,), 7.0))
    assert all(planes(tmp_path, rank)["nccl"] >= 30 for rank in range(2))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_tensors_are_reduced_bitwise_alike(tmp_path: Path) -> None:
    """The same collectives on CUDA tensors (2 ranks sharing the GPU, staged through host
    memory on the native plane): every rank gets bitwise the same results, and the
    point-to-point message."""
    results = launch(
        "collectives", 2, tmp_path, TORCHDIST_DEVICE="cuda", PARAMSYNC_TORCH_INNER="native"
    )
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{output[-3000:]}"
    ours = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for key in ours[0]:
        if key not in PER_RANK:
            assert torch.equal(ours[0][key], ours[1][key]), key
    assert torch.equal(ours[1]["recv"], torch.full((5,), 7.0))


@INNER_SOAK
def test_ranks_calling_different_collectives_are_named(tmp_path: Path, inner: str) -> None:
    results = launch("mismatch_op", 2, tmp_path, seconds=60, PARAMSYNC_TORCH_INNER=inner)
    assert [code for code, _ in results] == [3, 3], results
    on = " on gloo" if inner == "gloo" else ""  # the plane is part of the call
    for rank in range(2):
        _, line = error_line(tmp_path, rank)
        assert f"ranks [0] report 'allreduce(sum){on}' of [(4,), float32]" in line, line
        assert f"ranks [1] report 'broadcast(root 0){on}' of [(4,), float32]" in line, line


@INNER_SOAK
def test_cached_calls_in_different_orders_are_refused_and_named(tmp_path: Path, inner: str) -> None:
    """Calls the members agreed on before start at once (the response cache); ranks that then
    call them in different orders are still refused before any result is returned (each
    call's frames carry its hash) and stopped with both calls named."""
    results = launch("mismatch_cached", 2, tmp_path, seconds=60, PARAMSYNC_TORCH_INNER=inner)
    assert [code for code, _ in results] == [3, 3], results
    assert not list(tmp_path.glob("rank*.pt"))
    lines = [error_line(tmp_path, rank)[1] for rank in range(2)]
    on = " on gloo" if inner == "gloo" else ""
    named = [
        f"'allreduce(sum){on}'" in line and f"'broadcast(root 0){on}'" in line for line in lines
    ]
    assert any(named), lines


@INNER_SOAK
def test_ranks_calling_different_shapes_are_named(tmp_path: Path, inner: str) -> None:
    results = launch("mismatch_shape", 2, tmp_path, seconds=60, PARAMSYNC_TORCH_INNER=inner)
    assert [code for code, _ in results] == [3, 3], results
    _, line = error_line(tmp_path, 0)
    on = " on gloo" if inner == "gloo" else ""
    assert f"ranks [0] report 'allreduce(sum){on}' of [(4,), float32]" in line, line
    assert f"ranks [1] report 'allreduce(sum){on}' of [(5,), float32]" in line, line


@pytest.mark.soak  # a refused join waits out the group's timeout, about 4 s: make soak
def test_ranks_asking_for_different_inner_groups_are_refused_at_joining(tmp_path: Path) -> None:
    """Rank 1 asks for the native plane where rank 0 asks for gloo inside: the coordinator
    refuses rank 1 at joining, naming the setting; rank 0 stops at the group's timeout."""
    results = launch(
        "idle",
        2,
        tmp_path,
        seconds=60,
        TORCHDIST_TIMEOUT="2",
        PARAMSYNC_TORCH_INNER="gloo",
        TORCHDIST_RANK1_INNER="native",
    )
    assert results[0][0] not in (0, None, -9) and results[1][0] not in (0, None, -9), results
    assert (
        "at parameter 'torch.distributed group 0: inner torch group (PARAMSYNC_TORCH_INNER)': "
        "dtype native vs gloo" in results[1][1]
    ), results[1][1][-2000:]


@INNER_SOAK
def test_ddp_replicas_end_bitwise_identical(tmp_path: Path, inner: str) -> None:
    results = launch("train", 2, tmp_path, PARAMSYNC_TORCH_INNER=inner)
    assert [code for code, _ in results] == [0, 0], results
    # The scenario ends without destroy_process_group: each rank's group is closed at its
    # interpreter's exit as destroy_process_group would, so no rank hears another was lost.
    for rank, (_, output) in enumerate(results):
        for word in ("disconnected", "Traceback", "lost", "loop stopped"):
            assert word not in output, f"rank {rank}: {output[-3000:]}"
    # Rank 0 says once what the proof covers; no rank warns (no search of the heap meets
    # torch's deprecated reduce_op).
    notices = [
        (rank, line)
        for rank, (_, output) in enumerate(results)
        for line in output.splitlines()
        if line.startswith("paramsync: the identical-state proof")
    ]
    assert len(notices) == 1 and notices[0][0] == 0, notices
    covered = "a torch DDP module (4 parameters, its buffers and their optimizer state) across"
    assert f"{covered} ranks [0, 1]." in notices[0][1], notices
    assert "FutureWarning" not in results[0][1] + results[1][1]
    # Every gradient bucket of the 6 steps went through the plane asked for.
    assert all(planes(tmp_path, rank).get(inner, 0) >= 6 for rank in range(2))
    states = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key


@INNER_SOAK
def test_state_ddp_does_not_replicate_is_never_flagged(tmp_path: Path, inner: str) -> None:
    """A rank-local head, different on every rank, stepped by the DDP module's optimizer:
    the proof compares the module and its part of the optimizer only."""
    results = launch("local_head", 2, tmp_path, PARAMSYNC_TORCH_INNER=inner)
    assert [code for code, _ in results] == [0, 0], results


@INNER_SOAK
def test_a_nudged_replica_is_caught_at_that_step(tmp_path: Path, inner: str) -> None:
    results = launch("nudge", 2, tmp_path, PARAMSYNC_TORCH_INNER=inner)
    assert [code for code, _ in results] == [3, 3], results
    for rank in range(2):
        _, line = error_line(tmp_path, rank)
        assert "step 4" in line and "rank 1" in line and "2.bias" in line, line


@pytest.mark.parametrize(
    ("killed", "inner"),
    [
        pytest.param(1, "native", id="a member"),
        pytest.param(0, "native", id="the coordinator's host"),
        pytest.param(1, "gloo", id="a member, gloo inside", marks=pytest.mark.soak),
        pytest.param(0, "gloo", id="the coordinator's host, gloo inside", marks=pytest.mark.soak),
    ],
)
def test_a_killed_rank_is_named_to_every_survivor(tmp_path: Path, killed: int, inner: str) -> None:
    """3 ranks train under torch DDP; one is SIGKILLed after a backward. Every survivor exits
    with one line naming it, well within the deadline (the heartbeat deadline, 10 s)."""
    started = time.monotonic()
    results = launch(
        "kill",
        3,
        tmp_path,
        seconds=90,
        TORCHDIST_TIMEOUT="30",
        TORCHDIST_KILL_RANK=str(killed),
        PARAMSYNC_TORCH_INNER=inner,
    )
    assert results[killed][0] == -9, results[killed]
    for rank in {0, 1, 2} - {killed}:
        assert results[rank][0] == 3, results[rank]
        seconds, line = error_line(tmp_path, rank)
        assert f"rank {killed}" in line, line
        if killed == 0:  # the coordinator went with it: named with its host
            assert "rank 0 (host 127.0.0.1), which hosts the group's coordinator" in line, line
        assert seconds < 30, seconds
    assert time.monotonic() - started < 90


@INNER_SOAK
def test_a_stalled_rank_is_named_within_the_deadline(tmp_path: Path, inner: str) -> None:
    results = launch(
        "stall", 2, tmp_path, seconds=60, TORCHDIST_TIMEOUT="4", PARAMSYNC_TORCH_INNER=inner
    )
    assert [code for code, _ in results] == [3, 3], results
    seconds, line = error_line(tmp_path, 0)
    assert "[1]" in line or "rank 1" in line, line
    assert seconds < 4 + 6, seconds


@pytest.mark.soak  # sleeps past the group's timeout by design
@INNER_SOAK
def test_a_group_idle_past_its_timeout_is_not_stalled(tmp_path: Path, inner: str) -> None:
    """Only a call some ranks made and others did not counts as a stall: ranks that all sit
    between calls longer than the group's timeout go on."""
    results = launch(
        "idle", 2, tmp_path, seconds=90, TORCHDIST_TIMEOUT="3", PARAMSYNC_TORCH_INNER=inner
    )
    assert [code for code, _ in results] == [0, 0], results


def _python(code: str, **env_extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, **env_extra)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_import_torch_registers_the_backend_and_stays_cheap() -> None:
    """``import torch`` registers the backend by loading the package root and the entry point
    alone (no trio, no engine); registering again after a reload works the same way. What it
    costs is what those two small modules cost, not a timing taken here."""
    code = (
        "import importlib, sys\n"
        "import torch, torch.distributed as dist\n"
        "print('paramsync' in dist.Backend.backend_list)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('paramsync', 'trio'))))\n"
        "from paramsync import torch_entry as entry\n"
        "for _ in range(3):\n"
        "    importlib.reload(entry)\n"
        "    dist.Backend.backend_list.remove('paramsync')\n"
        "    entry.register()\n"
        "print('paramsync' in dist.Backend.backend_list)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('paramsync', 'trio'))))\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    registered, modules, again, modules_after = done.stdout.splitlines()
    assert registered == again == "True"
    assert modules == modules_after == "['paramsync', 'paramsync.torch_entry']"


def test_autoload_off_leaves_the_backend_out() -> None:
    done = _python(
        "import torch.distributed as dist; print('paramsync' in dist.Backend.backend_list)",
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
    )
    assert done.returncode == 0 and done.stdout.strip() == "False", done


def test_a_broken_registration_never_breaks_import_torch() -> None:
    code = (
        "import torch.distributed as dist\n"
        "from paramsync import torch_entry as entry\n"
        "dist.Backend.backend_list.remove('paramsync')\n"
        "def boom(*a, **k): raise RuntimeError('broken')\n"
        "dist.Backend.register_backend = boom\n"
        "entry.register()\n"
        "print('paramsync' in dist.Backend.backend_list)\n"
    )
    done = _python(code)
    assert done.returncode == 0 and done.stdout.strip() == "False", done


def test_the_backend_loop_winds_down_before_the_interpreter_does() -> None:
    """A script that never destroys its group: by the time the interpreter shuts down, the
    loop's daemon thread has ended (one frozen inside a torch operation would end the process
    with ``terminate called without an active exception``). The probe is the first exit
    handler registered, so it runs after every other."""
    code = (
        "import atexit, threading\n"
        "def last():\n"
        "    alive = [t for t in threading.enumerate() if t.name == 'paramsync-backend']\n"
        "    print('loop alive at exit:', any(t.is_alive() for t in alive), flush=True)\n"
        "atexit.register(last)\n"
        "import torch, torch.distributed as dist\n"
        "store = dist.TCPStore('127.0.0.1', 0, 1, True)\n"
        "dist.init_process_group('paramsync', store=store, rank=0, world_size=1)\n"
        "t = torch.ones(4)\n"
        "dist.all_reduce(t)\n"
        "print('sum', t.tolist(), flush=True)\n"
    )
    done = _python(code, PARAMSYNC_SECRET=SECRET)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["sum [1.0, 1.0, 1.0, 1.0]", "loop alive at exit: False"]


def test_no_secret_is_one_line_naming_the_variable(tmp_path: Path) -> None:
    code = (
        "import os, torch.distributed as dist\n"
        "os.environ.pop('PARAMSYNC_SECRET', None); os.environ.pop('PARAMSYNC_SECRET_FILE', None)\n"
        f"dist.init_process_group('paramsync', init_method='file://{tmp_path}/store', "
        "rank=0, world_size=1)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMSYNC_SECRET")}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "PARAMSYNC_SECRET" in done.stderr.splitlines()[-1], done.stderr[-2000:]
