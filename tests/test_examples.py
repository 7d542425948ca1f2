"""The examples in examples/ run end to end and train.

Each test runs an example the way its README says, as subprocesses from the repository root,
with few steps, and checks the exit codes and that the loss went down. A hung example fails on
the subprocess timeout instead of hanging the suite.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 120  # seconds; each example takes well under 30 s even on a busy 2-core machine


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    # A script's own directory (examples/) heads sys.path, not the root: without this, the
    # examples would import an installed paramsync rather than this checkout's.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.pop("PARAMSYNC_ROLE", None)
    return env


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_embedded_trio_app_trains_with_its_own_tasks() -> None:
    out = _run(["examples/embedded_trio_app.py", "--steps", "20", "--heartbeat", "0.2"]).stdout
    finished = re.search(r"steps per rank \[20, 20\].*rank 0 loss ([\d.]+) -> ([\d.]+)", out)
    assert finished, out
    assert float(finished[2]) < float(finished[1]), out
    assert "[app] sample from the trained model:" in out, out


def test_embedded_trio_app_stops_every_rank_at_the_same_step() -> None:
    out = _run(["examples/embedded_trio_app.py", "--steps", "100000", "--stop-after", "1.5"]).stdout
    assert "[app] time budget spent" in out, out
    [a, b] = re.search(r"steps per rank \[(\d+), (\d+)\]", out).groups()
    assert a == b and 0 < int(a) < 100000, out


def test_own_training_loop_under_launch() -> None:
    out = _run(
        [
            "-m",
            "paramsync.runtime.cli.main",
            "launch",
            "--nproc",
            "2",
            "--",
            "examples/own_training_loop.py",
            "--steps",
            "40",
            "--log-every",
            "10",
        ]
    ).stdout
    before = re.search(r"rank 0 of 2: .* before training: loss ([\d.]+)", out)
    after = re.search(r"rank 0 of 2: after 40 steps: loss ([\d.]+)", out)
    assert before and after, out
    assert float(after[1]) < float(before[1]), out
    assert len(re.findall(r"^step +\d+  train loss", out, re.M)) == 5, out  # rank 0 only


def _check_ddp_style_loop(out: str, steps: int) -> None:
    before = re.search(r"rank 0 of 2: .* before training: loss ([\d.]+)", out)
    after = re.search(rf"rank 0 of 2: after {steps} steps: loss ([\d.]+)", out)
    assert before and after, out
    assert float(after[1]) < float(before[1]), out
    assert len(re.findall(r"^step +\d+  train loss", out, re.M)) == 5, out  # rank 0 only


def test_ddp_style_loop_under_launch_with_no_sync_accumulation() -> None:
    """The DDP-shaped wrapper: the user's own loss.backward(); optimizer.step() loop, the
    first of two micro-batches per step under no_sync()."""
    args = ["examples/ddp_style_loop.py", "--steps", "40", "--log-every", "10"]
    out = _run(
        [
            "-m",
            "paramsync.runtime.cli.main",
            "launch",
            "--nproc",
            "2",
            "--",
            *args,
            "--accumulate",
            "2",
        ]
    ).stdout
    _check_ddp_style_loop(out, 40)


@pytest.mark.soak
def test_ddp_style_loop_under_torchrun() -> None:
    args = ["examples/ddp_style_loop.py", "--steps", "40", "--log-every", "10"]
    _check_ddp_style_loop(_torchrun(args).stdout, 40)


TORCH_TEARDOWN_ABORT = "terminate called without an active exception"
"""What torch's own gloo teardown prints when it aborts a rank after its script has finished
(seen here about once in 17 runs of the `--torch-ddp` reference, never on paramsync's runs)."""


def _torchrun(
    args: list[str], *, teardown_abort_ok: bool = False, **extra: str
) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node 2 ARGS`` on a free port, from the repository root.
    ``teardown_abort_ok``: torch's own DDP reference may abort in torch's teardown after its
    script printed its last line (the run's figures are complete; the exit is torch's)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed")
    env = _env(PARAMSYNC_SECRET=secrets.token_hex(16), **extra)
    for name in [name for name in env if name.startswith("TORCHELASTIC_")]:
        del env[name]
    with socket.socket() as probe:  # a free port for torchrun's store
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    flags = ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    proc = subprocess.run(
        [str(torchrun), *flags, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    aborted_after_the_end = (
        teardown_abort_ok and TORCH_TEARDOWN_ABORT in proc.stderr and "final loss" in proc.stdout
    )
    assert proc.returncode == 0 or aborted_after_the_end, (
        f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    )
    return proc


def _final(out: str) -> tuple[float, str]:
    found = re.search(r"final loss ([\d.]+) checksum (-?[\d.]+) world 2", out)
    assert found, out
    return float(found[1]), found[2]


def test_a_torch_ddp_script_runs_with_its_import_changed() -> None:
    """examples/torch_ddp_script.py, written for torch DDP (init_process_group first, the
    optimizer built before wrapping and never wrapped, ``DDP(model, device_ids=None)``,
    accumulation through require_backward_grad_sync, clip_grad_norm_ between backward and step,
    destroy_process_group last), under torchrun with paramsync's DDP, with torch's own, and
    under ``paramsync launch``: all three end at the same loss and weights (the checksum printed
    to 9 decimals), and the paramsync runs checked every step (C-DDP-001)."""
    script = ["examples/torch_ddp_script.py", "--steps", "30"]
    ours = _final(_torchrun(script).stdout)
    torchs = _final(_torchrun([*script, "--torch-ddp"], teardown_abort_ok=True).stdout)
    launched = _final(
        _run(["-m", "paramsync.runtime.cli.main", "launch", "--nproc", "2", "--", *script]).stdout
    )
    assert ours[0] == pytest.approx(torchs[0], rel=1e-5), (ours, torchs)
    assert float(ours[1]) == pytest.approx(float(torchs[1]), rel=1e-6, abs=1e-6), (ours, torchs)
    assert launched == ours


@pytest.mark.soak
def test_torch_ddp_runs_on_the_paramsync_backend() -> None:
    """The same script with torch's own DDP and only the backend's name changed,
    ``init_process_group("paramsync")``, under torchrun and under ``paramsync launch``: the loss
    and weights of torch DDP on gloo (float tolerance: the all-reduce's summation order
    differs), and the two paramsync runs agree bitwise."""
    script = ["examples/torch_ddp_script.py", "--steps", "30", "--torch-ddp"]
    on_gloo = _final(_torchrun(script, teardown_abort_ok=True).stdout)
    ours = [*script, "--backend", "paramsync"]
    on_paramsync = _final(_torchrun(ours).stdout)
    launched = _final(
        _run(["-m", "paramsync.runtime.cli.main", "launch", "--nproc", "2", "--", *ours]).stdout
    )
    assert on_paramsync[0] == pytest.approx(on_gloo[0], rel=1e-5), (on_paramsync, on_gloo)
    assert float(on_paramsync[1]) == pytest.approx(float(on_gloo[1]), rel=1e-6, abs=1e-6)
    assert launched == on_paramsync


def test_daemons_by_hand(tmp_path: Path) -> None:
    """The commands of examples/daemons_by_hand.md, on a port the coordinator picks."""
    env = _env(PARAMSYNC_SECRET=secrets.token_hex(16))
    port_file = tmp_path / "port"
    port = str(port_file)
    cli = [sys.executable, "-m", "paramsync.runtime.cli.main"]
    coordinator = subprocess.Popen(
        [*cli, "coordinator", "--world-size", "2", "--bind", "127.0.0.1:0", "--port-file", port],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    workers: list[subprocess.Popen[str]] = []
    try:
        deadline = time.monotonic() + TIMEOUT
        while not port_file.exists() or not port_file.read_text().strip():
            assert coordinator.poll() is None, coordinator.communicate()[0]
            assert time.monotonic() < deadline, "the coordinator never listened"
            time.sleep(0.1)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        flags = ["--world-size=2", f"--coordinator={address}", "--steps=8", "--corpus-bytes=200000"]
        for rank in range(2):
            workers.append(
                subprocess.Popen(
                    [*cli, "worker", f"--rank={rank}", *flags],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outputs = [worker.communicate(timeout=TIMEOUT)[0] for worker in workers]
        coordinator_log = coordinator.communicate(timeout=TIMEOUT)[0]
    finally:
        for proc in [*workers, coordinator]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [w.returncode for w in workers] == [0, 0], outputs
    assert coordinator.returncode == 0, coordinator_log
    assert "run finished" in coordinator_log, coordinator_log
    losses = [float(x) for x in re.findall(r"loss=([\d.]+)", outputs[0])]
    assert "8/8" in outputs[0] and len(losses) >= 2, outputs[0]
    assert losses[-1] < losses[0], outputs[0]
    assert "training (2 workers)" not in outputs[1], outputs[1]  # only rank 0 reports
