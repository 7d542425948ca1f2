"""The identical-state proof (C-DDP-001) under torch's own parallelisms on the paramsync
backend: FSDP2 (``fully_shard``), HSDP (4 ranks: 2 replicas x 2 shards) and tensor parallelism
(``parallelize_module`` with replicated LayerNorm parameters), tests/torchdist_worker.py.

* each trains to the weights gloo trains to (within 1e-5), the proof on, nothing flagged;
* a replica changed silently after an optimizer step (HSDP: one replica's shard; tensor
  parallelism: one rank's LayerNorm weight) stops the run at the next step, naming the step,
  the tensor and the global ranks that hold it;
* global rank 0 says once what is proven and what is not (a pure FSDP shard has no replica).

Multi-process runs of 2 and 4 ranks: the tensor-parallel nudge runs in the default suite, the
rest in ``make soak``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from rank_processes import run_ranks

WORKER = Path(__file__).with_name("torchdist_worker.py")
SECRET = "torch-proof-tests-Secret-0123456789-abcdefghijklm"


def launch(
    scenario: str, backend: str, world: int, out: Path, *extra: str, seconds: float = 180
) -> list[tuple[int, str]]:
    """Run ``scenario`` on ``world`` ranks of ``backend``; each rank's (exit code, output)."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PARAMSYNC_SECRET=SECRET, OMP_NUM_THREADS="1")
    command = [sys.executable, str(WORKER), scenario, backend]
    return run_ranks(
        [
            [*command, str(rank), str(world), str(out / "store"), str(out), *extra]
            for rank in range(world)
        ],
        env,
        seconds=seconds,
    )


def error_line(out: Path, rank: int) -> str:
    return (out / f"rank{rank}.err").read_text().splitlines()[1]


def trained(
    scenario: str, backend: str, world: int, out: Path
) -> tuple[list[dict[str, torch.Tensor]], list[str]]:
    """Each rank's full state after 5 steps, and its output."""
    results = launch(scenario, backend, world, out, "5")
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"{backend} rank {rank} exited {code}:\n{output[-3000:]}"
    states = [torch.load(out / f"rank{rank}.pt") for rank in range(world)]
    return states, [output for _, output in results]


@pytest.mark.soak
@pytest.mark.parametrize(
    ("scenario", "world", "proven", "unproven"),
    [
        ("fsdp", 2, "nothing", "6 parameters sharded on every mesh dimension"),
        (
            "hsdp",
            4,
            "6 DTensor parameters replicated over mesh dimension 'replicate' and their "
            "optimizer state, across ranks [0, 2] and [1, 3]",
            None,
        ),
        (
            "tp",
            2,
            "2 DTensor parameters replicated over mesh dimension 'tp' and their optimizer "
            "state, across ranks [0, 1]",
            "3 parameters sharded on every mesh dimension",
        ),
    ],
)
def test_trains_as_gloo_does_with_the_proof_on(
    tmp_path: Path, scenario: str, world: int, proven: str, unproven: str | None
) -> None:
    ours, outputs = trained(scenario, "paramsync", world, tmp_path / "paramsync")
    gloo, _ = trained(scenario, "gloo", world, tmp_path / "gloo")
    for rank in range(world):
        for key, value in gloo[rank].items():
            assert torch.allclose(ours[rank][key], value, rtol=0, atol=1e-5), (rank, key)
    # Every rank's full weights are bitwise the same on the backend.
    for rank in range(1, world):
        for key, value in ours[0].items():
            assert torch.equal(ours[rank][key], value), (rank, key)
    assert "FutureWarning" not in "".join(outputs)
    notice = [
        line
        for output in outputs
        for line in output.splitlines()
        if line.startswith("paramsync: the identical-state proof")
    ]
    assert len(notice) == 1, notice  # once, on global rank 0
    assert proven in notice[0], notice[0]
    if unproven is not None:
        assert f"Not proven: {unproven}" in notice[0], notice[0]
    else:
        assert "Not proven" not in notice[0], notice[0]


@pytest.mark.soak
def test_a_nudged_hsdp_shard_is_named_at_the_next_step(tmp_path: Path) -> None:
    """Rank 2 (replica 1) changes its shard of ``0.weight`` after step 2; rank 0 (replica 0)
    holds the same shard: both are stopped at step 3, naming the tensor and ranks 0 and 2."""
    results = launch("hsdp", "paramsync", 4, tmp_path, "6", "2")
    assert [code for code, _ in results] == [3, 3, 3, 3], results
    for rank in (0, 2):
        line = error_line(tmp_path, rank)
        assert "step 3:" in line and "'param/0.weight'" in line, line
        assert "global ranks [0, 2]" in line, line


def test_a_nudged_tensor_parallel_layernorm_is_named_at_the_next_step(tmp_path: Path) -> None:
    """Rank 1 changes its replicated LayerNorm weight after step 2: both tensor-parallel ranks
    are stopped at step 3, naming the tensor."""
    results = launch("tp", "paramsync", 2, tmp_path, "6", "2")
    assert [code for code, _ in results] == [3, 3], results
    for rank in (0, 1):
        line = error_line(tmp_path, rank)
        assert "step 3:" in line and "'param/LayerNorm.weight[" in line, line
        assert "ranks [0]" in line and "ranks [1]" in line, line
    assert "FutureWarning" not in results[0][1] + results[1][1]
