"""The calls of torch's own ``distributed_test.py`` at the backend's edges, each as torch's
gloo tests make it (tests/torch_backend_edges_worker.py, one launch for them all):

* ``batch_isend_irecv`` with every ``irecv`` posted before its ``isend`` completes (it hung
  until torch's 60 s harness timeout), without and with tags;
* ``all_to_all_single`` with each rank's own unequal splits, real and complex (refused as a
  mismatch before: only rank i's send split j and rank j's receive split i must agree);
* ``all_reduce`` (SUM) of sparse COO tensors, as gloo sums them;
* ``monitored_barrier``: passed by every rank, then rank 0 names the rank that did not arrive
  (gloo's words) and the group goes on;
* a barrier only some ranks call is named within the group's timeout: the barrier, and the
  ranks that did not call it; so is a receive whose sender never sends (it hung).

The default run has 2 ranks; the soak run 3 (an arrived rank that gets no answer from rank 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("torch_backend_edges_worker.py")
SECRET = "torch-backend-edges-Secret-0123456789-abcdefghij"
SECTIONS = "p2p,alltoall,sparse,monitored,barrier_timeout,recv_alone"
P2P_SECONDS = 5
"""A batch of point-to-point requests that takes longer hangs (a few seconds: it takes
milliseconds)."""

Results = list[dict[str, Any]]


def launch(world: int, out: Path, seconds: float = 120) -> Results:
    """Every section on ``world`` ranks; each rank's results (its exit code under "exit")."""
    env = dict(
        os.environ,
        PARAMSYNC_SECRET=SECRET,
        OMP_NUM_THREADS="1",
        EDGES_P2P_SECONDS=str(P2P_SECONDS),
    )
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                SECTIONS,
                str(rank),
                str(world),
                str(out / "store"),
                str(out),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + seconds
    results = []
    for rank, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        path = out / f"rank{rank}.json"
        result = json.loads(path.read_text()) if path.exists() else {}
        results.append({**result, "exit": proc.returncode, "output": output[-3000:]})
    return results


@pytest.fixture(
    scope="module", params=[2, pytest.param(3, marks=pytest.mark.soak)], ids=lambda n: f"{n}ranks"
)
def edges(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Results:
    return launch(request.param, tmp_path_factory.mktemp(f"edges{request.param}"))


def section(results: Results, name: str) -> Callable[[int], dict[str, Any]]:
    def of(rank: int) -> dict[str, Any]:
        got = results[rank].get(name)
        assert got is not None, f"rank {rank} did not reach {name}:\n{results[rank]['output']}"
        assert "error" not in got, f"rank {rank}, {name}: {got['error']}"
        return got

    return of


def test_irecv_posted_before_isend_completes(edges: Results) -> None:
    """torch's test_batch_isend_irecv_gloo and _tags: each rank posts irecv, then isend."""
    of = section(edges, "p2p")
    world = len(edges)
    for rank in range(world):
        got = of(rank)
        for tagged in ("False", "True"):
            for peer in range(world):
                if peer != rank:
                    want = [[float(peer)] * 3] * (peer + 1)
                    assert got[f"received/{tagged}"][str(peer)] == want, (rank, tagged, peer)
    assert all(r["exit"] == 0 for r in edges), [r["output"] for r in edges]


def test_all_to_all_single_takes_each_ranks_own_unequal_splits(edges: Results) -> None:
    of = section(edges, "alltoall")
    world = len(edges)
    for rank in range(world):
        got = of(rank)
        # rank r receives r + 1 rows from every rank p, each row p's value
        rows = [[float(p)] * 2 for p in range(world) for _ in range(rank + 1)]
        assert got["torch.float32"] == rows
        assert got["torch.complex64"] == [[[v, 0.0] for v in row] for row in rows]


def test_sparse_all_reduce_sums_as_gloo_does(edges: Results) -> None:
    of = section(edges, "sparse")
    for rank in range(len(edges)):
        assert of(rank)["equal"] == [True] * 6


def test_monitored_barrier_names_the_rank_that_did_not_arrive(edges: Results) -> None:
    of = section(edges, "monitored")
    for rank in range(len(edges)):
        got = of(rank)
        assert got["passed"] and got["after"], got  # the group goes on after the verdict
    zero = of(0)
    assert "Rank 1 failed to pass monitoredBarrier in 500 ms" in zero["away"], zero
    assert 0.4 < zero["away_seconds"] < 10, zero
    for rank in range(2, len(edges)):
        line = of(rank)["away"]
        assert f"Rank {rank} successfully reached monitoredBarrier, but received errors" in line


def test_a_barrier_some_ranks_skip_is_named_within_the_timeout(edges: Results) -> None:
    got = section(edges, "barrier_timeout")(0)
    others = list(range(1, len(edges)))
    assert f"barrier() (step 0, call 0): ranks {others} did not call it" in got["line"], got
    assert " timeout " in got["line"], got  # torch's test matches " (Timed out|closed|timeout) "
    assert 0.9 < got["seconds"] < 10, got


def test_a_receive_nobody_sends_is_named_within_the_timeout(edges: Results) -> None:
    got = section(edges, "recv_alone")(0)
    assert (
        "recv(from 1 tag 0) of [[2] float32] did not complete within the group's timeout "
        in (got["line"])
    ), got
    assert "rank 1 sent it nothing" in got["line"], got
    assert 0.9 < got["seconds"] < P2P_SECONDS, got
