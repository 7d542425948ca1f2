"""A membership change under torch DDP's loop: the step in flight is dropped cleanly.

A coordinator daemon with ``--min-workers 2`` and three worker processes running
tests/ddp_elastic_worker.py (torch DDP's loop with paramsync's class): rank 2 is SIGKILLed after
the backward of its step 3, before its optimizer step. The survivors' step 3 is dropped by the
new epoch (its gradients zeroed, or ``step()`` returning False through ``wrap_optimizer``),
they run their loop to its end in the new epoch, and:

* both survivors exit 0 and hold bitwise the same parameters (every step checked, C-DDP-001);
* the coordinator exits 0 (the run finished with its members);
* through ``wrap_optimizer``, exactly one ``step()`` returned False on each survivor, and the
  trainer took one step fewer than the loop ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("ddp_elastic_worker.py")
SECONDS = 120


@pytest.mark.parametrize(
    "wrapped",
    [False, pytest.param(True, marks=pytest.mark.soak)],  # wrap_optimizer: make soak
    ids=["unwrapped", "wrap_optimizer"],
)
def test_a_lost_worker_drops_the_step_and_the_survivors_go_on_identical(
    tmp_path: Path, wrapped: bool
) -> None:
    env = dict(os.environ, PARAMSYNC_SECRET="elastic-tests-secret-0123456789", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(WORKER.parent), env.get("PYTHONPATH", "")])
    port_file = tmp_path / "port"
    coordinator = subprocess.Popen(
        [
            *(
                sys.executable,
                "-m",
                "paramsync.runtime.cli.main",
                "coordinator",
                "--world-size",
                "3",
            ),
            *("--min-workers", "2", "--bind", "127.0.0.1:0", "--port-file", str(port_file)),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            assert time.monotonic() < deadline, "the coordinator did not start"
            assert coordinator.poll() is None, coordinator.communicate()[0]
            time.sleep(0.05)
        port = port_file.read_text().strip()
        workers = []
        for rank in range(3):
            worker_env = dict(
                env,
                RANK=str(rank),
                WORLD_SIZE="3",
                PARAMSYNC_COORDINATOR_ADDR=f"127.0.0.1:{port}",
                PARAMSYNC_ROLE="worker",
            )
            args = [str(tmp_path), "2", "3"] + (["--wrapped"] if wrapped else [])
            workers.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), *args],
                    cwd=ROOT,
                    env=worker_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outputs = [w.communicate(timeout=SECONDS)[0] for w in workers]
        assert workers[2].returncode == -9, outputs[2][-2000:]
        for rank in (0, 1):
            assert workers[rank].returncode == 0, f"rank {rank}:\n{outputs[rank][-3000:]}"
        log = coordinator.communicate(timeout=SECONDS)[0]
        assert coordinator.returncode == 0, log[-3000:]
    finally:
        for proc in [coordinator, *locals().get("workers", [])]:
            proc.kill()
    first, second = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1))
    for name, value in first.items():
        assert torch.equal(value, second[name]), f"the survivors differ in {name}"
    summaries = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for summary in summaries:
        assert summary["world"] == 2, summary
        if wrapped:
            assert summary["taken"].count(False) == 1, summary
            assert summary["step"] == len(summary["taken"]) - 1, summary
        else:
            assert summary["taken"] == [None] * len(summary["taken"]), summary
