"""torch DDP's contract, under torch DDP (gloo) and paramsync in the same test.

tests/ddp_contract_worker.py holds each loop once, written for torch DDP: the optimizer built
before the model is wrapped and stepped unwrapped, the gradients clipped, edited or unscaled
between ``backward()`` and ``step()``, accumulation through ``require_backward_grad_sync`` and
``no_sync()``, a ``GradScaler`` skipping an overflowed step, ``torch.compile`` before and after
wrapping. Two processes run every case under torch DDP on gloo while two more run it under
paramsync's `DistributedDataParallel`; then:

* paramsync's ranks end bitwise identical (C-DDP-001: the coordinator also checked every step);
* paramsync's final weights and per-step losses are torch DDP's within float tolerance (the
  all-reduce's summation order differs);
* the loss scaler's final scale is torch DDP's exactly: the same steps were skipped.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ddp_contract_worker import CASES
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("ddp_contract_worker.py")
WORLD = 2
SECONDS = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_cases(out: Path, cases: list[str], device: str = "cpu") -> Path:
    """Every case under both implementations, 2 ranks each (the four processes at once)."""
    env = dict(os.environ, PARAMSYNC_SECRET="contract-tests-secret-0123456789", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent), env.get("PYTHONPATH", "")])
    env["CONTRACT_DEVICE"] = device
    torch_port = str(free_port())
    paramsync_ports = ",".join(str(free_port()) for _ in cases)
    procs = []
    for impl, ports in (("torch", torch_port), ("paramsync", paramsync_ports)):
        for rank in range(WORLD):
            command = [sys.executable, str(WORKER), impl, str(rank), str(WORLD), ports, str(out)]
            procs.append(
                subprocess.Popen(
                    [*command, ",".join(cases)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
    failures = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        if proc.returncode != 0:
            failures.append(f"{proc.args[2:4]} exited {proc.returncode}:\n{output[-3000:]}")
    for proc in procs:
        proc.kill()
    assert not failures, "\n".join(failures)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_cases(tmp_path_factory.mktemp("ddp-contract"), list(CASES))


def check_case(results: Path, case: str) -> None:
    """paramsync's ranks bitwise identical; its weights and losses torch DDP's."""
    ours = [load_file(str(results / f"{case}-paramsync-rank{r}.safetensors")) for r in range(WORLD)]
    theirs = [load_file(str(results / f"{case}-torch-rank{r}.safetensors")) for r in range(WORLD)]
    for name, value in ours[0].items():  # C-DDP-001, and the same losses on both sides
        if name.startswith("param/"):
            assert torch.equal(value, ours[1][name]), f"{case}: paramsync ranks differ in {name}"
        torch.testing.assert_close(
            value, theirs[0][name], rtol=1e-4, atol=1e-5, msg=f"{case}: {name}"
        )
    for rank in range(WORLD):
        torch.testing.assert_close(
            ours[rank]["losses"], theirs[rank]["losses"], rtol=1e-4, atol=1e-5
        )
    if case == "scaler":  # the same steps skipped: the scale halved once, grown the same
        assert ours[0]["losses"][-1] == theirs[0]["losses"][-1]


@pytest.mark.parametrize("case", list(CASES))
def test_paramsync_is_torch_ddp_in_the_users_own_loop(results: Path, case: str) -> None:
    check_case(results, case)


CUDA_CASES = ["clip", "accumulate", "surgery", "scaler", "uneven", "fp16_hook"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_with_device_ids(tmp_path: Path) -> None:
    """The same loops with each rank's model on the GPU (2 ranks sharing it), wrapped with
    ``device_ids=[0]``: CUDA gradients averaged before backward returns, a CUDA GradScaler."""
    out = run_cases(tmp_path, CUDA_CASES, device="cuda")
    for case in CUDA_CASES:
        check_case(out, case)


@pytest.mark.soak
def test_torch_compile_with_inductor(tmp_path: Path) -> None:
    """torch.compile's default backend after wrapping (C++ kernels compiled in every rank)."""
    check_case(run_cases(tmp_path, ["inductor"]), "inductor")
