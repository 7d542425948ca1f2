"""One rank of the calls at the edges of torch's own suite, on the ``paramsync`` backend
(tests/test_torch_backend_edges.py).

    python torch_backend_edges_worker.py SECTIONS RANK WORLD STORE OUT

Plain torch code, as torch's ``distributed_test.py`` writes it for gloo. ``SECTIONS`` is a
comma-separated list of:

* ``p2p``: ``batch_isend_irecv`` with each rank's ``irecv`` posted before its ``isend`` (to
  every other rank, without and with tags); every request must finish within
  ``EDGES_P2P_SECONDS`` (a hang is recorded as ``timed out``, and the rank ends there);
* ``alltoall``: ``all_to_all_single`` with per-rank unequal splits, real and complex;
* ``sparse``: ``all_reduce`` (SUM) of sparse COO tensors of torch's own test cases;
* ``monitored``: ``monitored_barrier`` passed by every rank, then with rank 1 away;
* ``barrier_timeout``: a barrier only rank 0 calls, on a group with a 1 s timeout;
* ``recv_alone``: a receive from a rank that never sends, on a group with a 1 s timeout.

Each section runs on a group of its own (a section that breaks its group leaves the others
alone) and records what it saw in OUT/rank<r>.json: the results, or the one error line.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import simple_sparse_reduce_tests

P2P_SECONDS = float(os.environ.get("EDGES_P2P_SECONDS", "5"))
"""How long a batch of point-to-point requests may take before it counts as a hang."""


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


def _wait_all(requests: list[Any], seconds: float) -> bool:
    """Wait for ``requests`` in a helper thread; whether all finished within ``seconds``."""
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            for request in requests:
                request.wait()
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(seconds)
    if errors:
        raise errors[0]
    return not waiter.is_alive()


def p2p(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group()
    out: dict[str, Any] = {}
    for tagged in (False, True):
        ops, received = [], {}
        for peer in range(world):
            if peer == rank:
                continue
            received[peer] = torch.full((peer + 1, 3), -1.0)
            tags = {"tag": peer} if tagged else {}
            ops.append(dist.P2POp(dist.irecv, received[peer], peer, group, **tags))
            send_tags = {"tag": rank} if tagged else {}
            ops.append(
                dist.P2POp(
                    dist.isend, torch.full((rank + 1, 3), float(rank)), peer, group, **send_tags
                )
            )
        started = time.monotonic()
        if not _wait_all(dist.batch_isend_irecv(ops), P2P_SECONDS):
            return {"error": f"timed out after {P2P_SECONDS:g} s (tags: {tagged})"}
        out[f"seconds/{tagged}"] = round(time.monotonic() - started, 3)
        out[f"received/{tagged}"] = {str(p): t.tolist() for p, t in received.items()}
    return out


def alltoall(rank: int, world: int) -> dict[str, Any]:
    """torch's _test_all_to_all_single_unequal_split_helper: rank r sends i + 1 rows to rank
    i and receives r + 1 rows from every rank."""
    group = dist.new_group()
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.complex64):
        in_splits = [i + 1 for i in range(world)]
        out_splits = [rank + 1 for _ in range(world)]
        source = torch.ones(sum(in_splits), 2, dtype=dtype) * rank
        dest = torch.empty(sum(out_splits), 2, dtype=dtype)
        dist.all_to_all_single(dest, source, out_splits, in_splits, group=group)
        out[str(dtype)] = torch.view_as_real(dest).tolist() if dtype.is_complex else dest.tolist()
    return out


def sparse(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group()
    equal = []
    for inputs, outputs in simple_sparse_reduce_tests(rank, world, num_inputs=1):
        tensor = inputs[0]
        dist.all_reduce(tensor, dist.ReduceOp.SUM, group)
        equal.append(torch.equal(tensor.to_dense(), outputs[0].to_dense()))
    return {"equal": equal}


def monitored(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group()
    out: dict[str, Any] = {}
    dist.monitored_barrier(group, timeout=timedelta(seconds=5))
    dist.monitored_barrier(group, timeout=timedelta(seconds=5), wait_all_ranks=True)
    out["passed"] = True
    if rank != 1:
        started = time.monotonic()
        try:
            dist.monitored_barrier(group, timeout=timedelta(seconds=0.5))
            out["away"] = "passed"
        except RuntimeError as exc:
            out["away"] = _line(exc)
        out["away_seconds"] = round(time.monotonic() - started, 3)
    dist.all_reduce(torch.ones(2), group=group)  # the group goes on
    out["after"] = True
    return out


def barrier_timeout(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group(timeout=timedelta(seconds=1))
    if rank != 0:
        return {}
    started = time.monotonic()
    try:
        dist.barrier(group)
        return {"error": "the barrier passed"}
    except RuntimeError as exc:
        return {"line": _line(exc), "seconds": round(time.monotonic() - started, 3)}


def recv_alone(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 receives from rank 1, which never sends, on a group with a 1 s timeout."""
    group = dist.new_group(timeout=timedelta(seconds=1))
    if rank != 0:
        return {}
    started = time.monotonic()
    try:
        if not _wait_all([dist.irecv(torch.empty(2), src=1, group=group)], P2P_SECONDS):
            return {"error": f"timed out after {P2P_SECONDS:g} s"}
        return {"error": "the receive completed"}
    except RuntimeError as exc:
        return {"line": _line(exc), "seconds": round(time.monotonic() - started, 3)}


SECTIONS = {
    "p2p": p2p,
    "alltoall": alltoall,
    "sparse": sparse,
    "monitored": monitored,
    "barrier_timeout": barrier_timeout,
    "recv_alone": recv_alone,
}


def main() -> None:
    sections, rank, world, store, out_dir = sys.argv[1:6]
    rank_i, world_i = int(rank), int(world)
    dist.init_process_group(
        "paramsync",
        init_method=f"file://{store}",
        rank=rank_i,
        world_size=world_i,
        timeout=timedelta(seconds=float(os.environ.get("EDGES_TIMEOUT", "30"))),
    )
    results: dict[str, Any] = {}
    path = Path(out_dir) / f"rank{rank}.json"
    broken = False
    for name in sections.split(","):
        try:
            results[name] = SECTIONS[name](rank_i, world_i)
        except Exception as exc:
            results[name] = {"error": _line(exc)}
        path.write_text(json.dumps(results))
        if "timed out" in str(results[name].get("error", "")):
            broken = True
            break  # the rank's calls are stuck: it ends here
    if broken:
        os._exit(4)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
