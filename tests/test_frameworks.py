"""Lightning, Accelerate and the HF Trainer run on the paramsync backend by the README's paths.

Each framework is one job of 2 CPU processes (tests/frameworks_worker.py), started as the
README starts it (Lightning and the HF Trainer under torchrun, Accelerate under its own
``accelerate launch --multi_gpu --num_processes 2``), running the framework's own training
loop three times: on gloo, on paramsync, and on paramsync with rank 1 nudging one weight before
optimizer step 2; the Accelerate job then runs Accelerate's DistributedType.NO on paramsync
(``InitProcessGroupKwargs(backend="paramsync")`` without ``cpu=True``), which the backend
refuses as not data-parallel. Nothing is downloaded: the models are built from code or a
config, the data is generated. Checked: paramsync's final weights are bitwise gloo's (and
training moved them), paramsync's two ranks end bitwise identical with the identical-state
proof on, the nudge is caught at step 2, each rank's error naming rank 1 and the tensor nudged,
and the run that is not data-parallel stops at its 21st optimizer step with one line on each
rank. The frameworks come with the ``frameworks`` extra (installed by ``make setup``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "frameworks_worker.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
ACCELERATE = Path(sys.executable).with_name("accelerate")
TIMEOUT = 300  # seconds; a job takes 30-40 s on a busy 2-core machine
DIVERGE_STEP = 2

pytestmark = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")

FRAMEWORKS = {
    # framework: (the module it needs, the tensor rank 1 nudges, as the proof names it)
    "lightning": ("lightning", "net.layers.0.weight"),
    "accelerate": ("accelerate", "layers.0.weight"),
    "transformers": ("transformers", "transformer.h.1.mlp.c_fc.weight"),
}


def _env() -> dict[str, str]:
    """This checkout's code first, a fresh secret, no launcher variables of an enclosing run,
    the proof on (its default)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHELASTIC_", "PARAMSYNC_", "ACCELERATE_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PARAMSYNC_SECRET"] = secrets.token_hex(16)
    env["OMP_NUM_THREADS"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"  # nothing is fetched; a fetch would fail, not wait
    return env


def _torchrun(args: list[str], timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    return _run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", *args], timeout)


def _accelerate_launch(args: list[str]) -> subprocess.CompletedProcess[str]:
    """Accelerate's launcher, as the README gives it: ``--multi_gpu`` is the launcher that
    starts local processes (torchrun underneath; ``--cpu`` starts one unless MPI starts
    them); the script's ``Accelerator(cpu=True)`` runs them on the CPU."""
    launch = [str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return _run([*launch, "--main_process_port", "0", *args], TIMEOUT)


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _weights(folder: Path) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(folder / f"rank{rank}.safetensors")) for rank in (0, 1)]


Job = tuple[subprocess.CompletedProcess[str], Path]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Job]:
    """Each framework's job, run once for the tests that read it: its process and folder."""
    done: dict[str, Job] = {}

    def job(framework: str) -> Job:
        if framework not in done:
            module, _ = FRAMEWORKS[framework]
            if importlib.util.find_spec(module) is None:
                pytest.skip(f"{module} is not installed (pip install -e '.[frameworks]')")
            out = tmp_path_factory.mktemp(framework)
            runs = [str(WORKER), framework, str(out), "gloo", "paramsync"]
            diverge = f"paramsync@{DIVERGE_STEP}"  # last: its failed group outlives its run
            if framework == "accelerate":
                if not ACCELERATE.exists():
                    pytest.skip("accelerate's launcher is not installed")
                done[framework] = (_accelerate_launch([*runs, "notparallel", diverge]), out)
            else:
                done[framework] = (_torchrun([*runs, diverge]), out)
        return done[framework]

    return job


SOAK_FRAMEWORKS = frozenset({"lightning", "transformers"})
"""Run by ``make soak`` only (each a job of about 7 s): the default suite keeps Accelerate's,
whose job crosses the same backend and proof paths and also carries the not-data-parallel
refusal."""


@pytest.mark.parametrize(
    "framework",
    [
        pytest.param(name, marks=pytest.mark.soak) if name in SOAK_FRAMEWORKS else name
        for name in sorted(FRAMEWORKS)
    ],
)
def test_the_framework_trains_on_paramsync_as_on_gloo_and_a_divergence_is_named(
    framework: str, jobs: Callable[[str], Job]
) -> None:
    _, nudged = FRAMEWORKS[framework]
    proc, tmp_path = jobs(framework)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{proc.stderr[-6000:]}"
    for run in ("gloo", "paramsync"):
        for rank in (0, 1):
            assert f"[{run}] rank {rank}: done after 6 steps" in out, out

    initial = load_file(str(tmp_path / "paramsync" / "initial.safetensors"))
    gloo, paramsync = _weights(tmp_path / "gloo"), _weights(tmp_path / "paramsync")
    assert sorted(paramsync[0]) == sorted(gloo[0]) == sorted(initial)
    for name in paramsync[0]:
        # paramsync's ranks: bitwise the same state (the proof held at every step), and
        # bitwise torch DDP's on gloo
        assert torch.equal(paramsync[0][name], paramsync[1][name]), name
        assert torch.equal(paramsync[0][name], gloo[0][name]), name
    moved = [n for n in initial if not torch.equal(initial[n], paramsync[0][n])]
    assert nudged in moved and len(moved) >= len(initial) // 2, moved

    # The nudge: caught at the step it happened, rank 1 and the tensor named on both ranks.
    diverged = (
        rf"step {DIVERGE_STEP}: parameter digests diverged with no majority: ranks \[0\] have "
        rf"[0-9a-f]+, ranks \[1\] have [0-9a-f]+; rank 1 first differs from rank 0 at tensor "
        rf"'param/{re.escape(nudged)}'"
    )
    for rank in (0, 1):
        lines = [line for line in out.splitlines() if f"[diverge] rank {rank}: stopped:" in line]
        assert len(lines) == 1, out
        assert f"paramsync group 0, rank {rank}" in lines[0], lines[0]
        assert "coordinator stopped the run" in lines[0], lines[0]
        assert re.search(diverged, lines[0]), lines[0]
        assert not (tmp_path / "diverge" / f"rank{rank}.safetensors").exists()
    assert "Segmentation fault" not in proc.stderr and "SIGSEGV" not in proc.stderr


def test_accelerate_not_data_parallel_on_paramsync_is_refused_with_one_line(
    jobs: Callable[[str], Job],
) -> None:
    """Accelerate's DistributedType.NO on a paramsync group of 2 (a third-party backend named
    on the CPU without ``cpu=True``): every rank steps on its own share of the data and no
    gradient is reduced. Each rank is refused at its 21st optimizer step (20 local steps
    allowed), with one line naming its rank, the world size and the likely cause."""
    proc, out = jobs("accelerate")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    # The two ranks share the launcher's output, which may join one rank's line to the
    # other's: each report is cut at the next one's prefix.
    reports = re.split(r"(?=\[\w+\] rank \d: )", proc.stdout)
    for rank in (0, 1):
        prefix = f"[notparallel] rank {rank}:"
        lines = [report.strip() for report in reports if report.startswith(prefix)]
        assert len(lines) == 1, proc.stdout
        assert lines[0].startswith(
            f"[notparallel] rank {rank}: stopped: NotDataParallel: paramsync group 0, rank "
            f"{rank} of 2: optimizer step 21 applies this rank's own gradients"
        ), lines[0]
        assert "DistributedType.NO" in lines[0] and "Accelerator(cpu=True)" in lines[0]
        assert not (out / "notparallel" / f"rank{rank}.safetensors").exists()


_INIT_TWICE = """
import datetime, os, time, torch, torch.distributed as dist
for attempt in range(2):
    if attempt == 1 and os.environ["RANK"] == "0":
        time.sleep(2)  # rank 1 looks for the second group's coordinator first
    dist.init_process_group("paramsync", timeout=datetime.timedelta(seconds=30))
    value = torch.ones(3) * (attempt + 1)
    dist.all_reduce(value)
    print(f"rank {os.environ['RANK']} group {attempt}: {value.tolist()}", flush=True)
    dist.destroy_process_group()
"""


@pytest.mark.soak
def test_the_default_group_made_twice_in_one_job_finds_its_own_coordinator(
    tmp_path: Path,
) -> None:
    """The framework jobs above make the default paramsync group again after destroying it.
    torch names it "0" again, in the same store: the second group must find its own
    coordinator, not the first one's (gone), even when rank 1 looks before rank 0 publishes."""
    script = tmp_path / "init_twice.py"
    script.write_text(_INIT_TWICE)
    proc = _torchrun([str(script)], timeout=120)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    for rank in (0, 1):
        assert f"rank {rank} group 0: [2.0, 2.0, 2.0]" in proc.stdout, proc.stdout
        assert f"rank {rank} group 1: [4.0, 4.0, 4.0]" in proc.stdout, proc.stdout
