"""A paramsync script under torchrun as it is: single node, CPU, loopback.

torchrun's agent holds MASTER_PORT with its own store, so rank 0's coordinator listens on a
port of its own and publishes the number in that store (`paramsync.runtime.cli.torchrun`). These
tests run the real torchrun of the venv on `examples/own_training_loop.py` and on small scripts, and
the store exchange against a real TCPStore in this process.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from paramsync.runtime.cli.torchrun import COORDINATOR_PORT_ENV, TorchrunEnv, run_id_from_env
from paramsync.runtime.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
TIMEOUT = 180  # seconds; each run takes well under 30 s even on a busy 2-core machine
SECRET = secrets.token_hex(16)

pytestmark = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")


def _env(**extra: str) -> dict[str, str]:
    """This checkout's code first (the script's own directory is not the root), no launcher
    variables of an enclosing run, one thread per worker."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHELASTIC_", "PARAMSYNC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _torchrun(
    args: list[str], env: dict[str, str], port: int | None = None
) -> subprocess.CompletedProcess[str]:
    flags = ["--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    if port is not None:
        flags += ["--master-port", str(port)]
    return subprocess.run(
        [str(TORCHRUN), *flags, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def _free_port_below_a_free_port() -> tuple[int, socket.socket]:
    """A free port P with P + 1 held by a listening socket (returned, to be closed)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port >= 65535:
            continue
        blocker = socket.socket()
        try:
            blocker.bind(("127.0.0.1", port + 1))
        except OSError:
            blocker.close()
            continue
        blocker.listen()
        return port, blocker
    raise RuntimeError("no pair of free ports found")


@pytest.mark.soak
def test_own_training_loop_runs_unchanged_under_torchrun_with_master_port_plus_one_busy() -> None:
    """The example of `paramsync launch`, as it is, under torchrun: rank 0 hosts the
    coordinator, MASTER_PORT is torchrun's store, and MASTER_PORT + 1 being taken does not
    matter (the coordinator's port is a free one, exchanged through the store)."""
    port, blocker = _free_port_below_a_free_port()
    try:
        proc = _torchrun(
            ["examples/own_training_loop.py", "--steps", "40", "--log-every", "10"],
            _env(PARAMSYNC_SECRET=SECRET),
            port=port,
        )
    finally:
        blocker.close()
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{proc.stderr[-4000:]}"
    before = re.search(r"rank 0 of 2: .* before training: loss ([\d.]+)", out)
    after = re.search(r"rank 0 of 2: after 40 steps: loss ([\d.]+)", out)
    assert before and after, out
    assert float(after[1]) < float(before[1]), out
    assert len(re.findall(r"^step +\d+  train loss", out, re.M)) == 5, out  # rank 0 only
    assert SECRET not in out + proc.stderr


def test_a_missing_secret_under_torchrun_is_one_line_and_exit_2_on_every_rank() -> None:
    proc = _torchrun(["examples/own_training_loop.py", "--steps", "5"], _env())
    line = (
        "paramsync: no shared secret: set PARAMSYNC_SECRET, or PARAMSYNC_SECRET_FILE to a file "
        "holding one"
    )
    assert proc.stderr.count(line) == 2, proc.stderr  # once per rank
    assert "ExceptionGroup" not in proc.stderr, proc.stderr
    assert "exitcode  : 2" in proc.stderr, proc.stderr  # torchrun's report of the ranks
    assert proc.returncode != 0


def test_paramsync_worker_under_torchrun_hosts_the_coordinator_on_rank_0(tmp_path: Path) -> None:
    """``paramsync worker`` (the built-in job) under torchrun: no coordinator daemon, rank 0
    hosts one, and both ranks end at the same step with the same weights."""
    summary = str(tmp_path / "s{rank}.json")
    proc = _torchrun(
        [
            "-m",
            "paramsync.runtime.cli.main",
            "worker",
            "--steps=3",
            "--batch-size=4",
            "--d-model=32",
            "--layers=1",
            "--corpus-bytes=200000",
            "--no-progress",
            f"--summary-json={summary}",
        ],
        _env(PARAMSYNC_SECRET=SECRET),
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    ranks = [json.loads((tmp_path / f"s{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["final_step"] for r in ranks] == [3, 3], ranks
    assert ranks[0]["digest"] == ranks[1]["digest"], ranks


RESTARTING_SCRIPT = """
import os, sys
import torch
from paramsync.actors.train.run import run_script, trainer_from_env
from paramsync.actors.train.trainer import TrainerOptions

async def main() -> None:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
    options = TrainerOptions(max_steps=6)
    async with trainer_from_env(model, optimizer, loss_fn, options=options) as t:
        rank = t.dist_config.rank
        for step in range(6):
            await t.train_batch((x[rank::2], y[rank::2]))
            if attempt == 0 and rank == 1 and step == 2:
                print("rank 1 crashes in attempt 0", flush=True)
                os._exit(1)
        await t.verified()
        print(f"rank {rank} finished attempt {attempt} at step {t.step}", flush=True)

run_script(main)
"""


@pytest.mark.soak
def test_max_restarts_restarts_the_run_with_a_new_coordinator(tmp_path: Path) -> None:
    """torchrun restarts every rank of a failed attempt: the new attempt's rank 0 hosts a new
    coordinator and publishes its port under the new attempt's key, so nobody dials the old
    one, and the run finishes."""
    script = tmp_path / "restarting.py"
    script.write_text(RESTARTING_SCRIPT)
    proc = _torchrun(["--max-restarts", "1", str(script)], _env(PARAMSYNC_SECRET=SECRET))
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{proc.stderr[-4000:]}"
    assert "rank 1 crashes in attempt 0" in out, out
    assert "rank 0 finished attempt 1 at step 6" in out, out
    assert "rank 1 finished attempt 1 at step 6" in out, out


@pytest.mark.soak
def test_run_script_prints_a_configuration_error_as_one_line_with_exit_2() -> None:
    """Without torchrun or a launcher: a bad MASTER_ADDR, then no secret; each is one line on
    stderr naming what to set, exit code 2, no traceback."""
    script = ["examples/own_training_loop.py", "--steps", "1"]
    bad_addr = subprocess.run(
        [sys.executable, *script],
        cwd=ROOT,
        env=_env(PARAMSYNC_SECRET=SECRET, MASTER_ADDR="no such host"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert bad_addr.returncode == 2, bad_addr.stderr
    assert bad_addr.stderr.strip().splitlines() == [
        "paramsync: environment variable MASTER_ADDR='no such host' is not a host name"
    ]
    no_secret = subprocess.run(
        [sys.executable, *script],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert no_secret.returncode == 2, no_secret.stderr
    [line] = no_secret.stderr.strip().splitlines()
    assert line.startswith("paramsync: no shared secret: set PARAMSYNC_SECRET"), line


def test_a_taken_coordinator_port_is_one_line_naming_master_port() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "examples/own_training_loop.py", "--steps", "1"],
            cwd=ROOT,
            env=_env(
                PARAMSYNC_SECRET=SECRET,
                RANK="0",
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert f"cannot listen on 127.0.0.1:{port}" in line and "MASTER_PORT" in line, line


# The store exchange, against a real TCPStore in this process.


def _env_of(store_port: int, **extra: str) -> TorchrunEnv:
    env = TorchrunEnv.from_env(
        {
            "TORCHELASTIC_RUN_ID": "run-x",
            "TORCHELASTIC_RESTART_COUNT": "3",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store_port),
            **extra,
        }
    )
    assert env is not None
    return env


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )


def test_only_the_port_number_goes_into_the_store(store: dist.TCPStore) -> None:
    env = _env_of(store.port)
    keys_before = store.num_keys()
    env.publish_coordinator_port(41234)
    assert store.num_keys() == keys_before + 1
    assert env.store_key == "paramsync/run-x/attempt_3/coordinator_port"
    assert store.get(env.store_key) == b"41234"
    assert env.lookup_coordinator_port(seconds=5) == 41234


def test_each_restart_attempt_reads_its_own_key(store: dist.TCPStore) -> None:
    _env_of(store.port).publish_coordinator_port(40000)
    later = _env_of(store.port, TORCHELASTIC_RESTART_COUNT="4")
    with pytest.raises(ConfigError, match=COORDINATOR_PORT_ENV):
        later.lookup_coordinator_port(seconds=0.5)


def test_a_bad_port_in_the_store_is_refused_by_name(store: dist.TCPStore) -> None:
    env = _env_of(store.port)
    store.set(env.store_key, "70000")
    with pytest.raises(ConfigError, match="torchrun store key paramsync/run-x/attempt_3"):
        env.lookup_coordinator_port(seconds=5)


def test_the_environment_says_whether_this_is_torchrun() -> None:
    assert TorchrunEnv.from_env({"RANK": "0", "MASTER_PORT": "29500"}) is None
    env = _env_of(29500, **{COORDINATOR_PORT_ENV: "29600"})
    assert env.coordinator_port == 29600 and env.store_address == "127.0.0.1:29500"
    with pytest.raises(ConfigError, match=f"{COORDINATOR_PORT_ENV}='x'"):
        _env_of(29500, **{COORDINATOR_PORT_ENV: "x"})
    with pytest.raises(ConfigError, match="MASTER_PORT"):
        TorchrunEnv.from_env({"TORCHELASTIC_RUN_ID": "r", "MASTER_ADDR": "h"})
    # No agent store on MASTER_PORT: the coordinator takes it, no exchange.
    assert _env_of(29500, TORCHELASTIC_USE_AGENT_STORE="False").coordinator_port == 29500
    assert _env_of(29500, TORCHELASTIC_USE_AGENT_STORE="True").coordinator_port is None
    assert run_id_from_env({"TORCHELASTIC_RUN_ID": "abc"}) == "abc"
    assert run_id_from_env({"TORCHELASTIC_RUN_ID": "abc", "PARAMSYNC_RUN_ID": "mine"}) == "mine"
    assert run_id_from_env({"TORCHELASTIC_RUN_ID": "none"}) is None


# A first run's mistakes that only show while joining, in this process.


async def test_a_world_size_larger_than_the_ranks_started_is_a_config_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WORLD_SIZE=2 but only rank 0 runs: after ``join_seconds`` the wait ends in one
    `ConfigError` naming WORLD_SIZE, not an exception group of cancellations."""
    import torch

    from paramsync.actors.train.run import trainer_from_env

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PARAMSYNC_SECRET": SECRET,
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("TORCHELASTIC_RUN_ID", "PARAMSYNC_ROLE", "PARAMSYNC_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"all 2 ranks: start every rank, or set WORLD_SIZE"):
        async with trainer_from_env(model, optimizer, lambda m, b: m(b).sum(), join_seconds=1.0):
            pytest.fail("the run started with one of its two ranks")
