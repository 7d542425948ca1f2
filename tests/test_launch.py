"""``paramsync`` as a user runs it: real processes, real sockets, exit codes and messages.

The CLI runs as ``python -m paramsync.runtime.cli.main`` from the repository root, so the tests need
no installed console script. Every process has a timeout well under 30 s.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paramsync.runtime.cli.launch import LaunchPlan
from paramsync.runtime.cli.main import build_parser
from paramsync.runtime.config import ADVERTISE_ENV, advertised_host

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "paramsync.runtime.cli.main"]


def run_cli(
    *args: str, timeout: float = 30.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        cwd=ROOT,
        env=env if env is not None else dict(os.environ),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def env_without_secret() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PARAMSYNC_SECRET", None)
    env.pop("PARAMSYNC_SECRET_FILE", None)
    return env


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), ["coordinator", "worker", "launch"]),
        (("launch",), ["--nproc", "--summary-json", "--master-port", "--coordinator-kind"]),
        (("coordinator",), ["--world-size", "--bind", "--heartbeat-deadline", "--tree"]),
    ],
    ids=["paramsync", "launch", "coordinator"],
)
def test_help_exits_zero(args: tuple[str, ...], expected: list[str]) -> None:
    result = run_cli(*args, "--help")
    assert result.returncode == 0, result.stderr
    for word in expected:
        assert word in result.stdout


def test_launch_trains_the_lm_job_and_merges_identical_summaries(tmp_path: Path) -> None:
    merged_path = tmp_path / "merged.json"
    result = run_cli(
        "launch",
        "--nproc",
        "2",
        "--summary-json",
        str(merged_path),
        "--",
        "-m",
        "paramsync.actors.demo_job.job",
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--d-model",
        "32",
        "--layers",
        "1",
        "--corpus-bytes",
        "200000",
        "--no-progress",
        "--summary-json",
        str(tmp_path / "s{rank}.json"),
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    merged = json.loads(merged_path.read_text())
    assert merged["world_size"] == 2
    assert merged["final_step"] == 3
    assert merged["digests_identical"] is True
    assert set(merged["digests"]) == {"0", "1"}
    assert all(len(d) == 32 for d in merged["digests"].values())  # XXH3-128 hex
    assert [rank["rank"] for rank in merged["ranks"]] == [0, 1]
    for rank in (0, 1):
        own = json.loads((tmp_path / f"s{rank}.json").read_text())
        assert own["rank"] == rank and own["world_size"] == 2 and own["final_step"] == 3
        # The job's own summary describes the same final state as the launcher's: the digest
        # of the weights after step 3, not one from a step whose check was still in flight.
        assert own["digest"] == merged["digests"][str(rank)], (
            f"rank {rank}'s --summary-json digest is stale"
        )


def test_launch_stops_the_run_and_names_the_failed_rank(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    sys.exit(1)\n"
        "time.sleep(120)  # rank 0 would run on: the launcher must stop it\n"
    )
    started = time.monotonic()
    result = run_cli("launch", "--nproc", "2", "--", str(script), timeout=30)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert "rank 1" in result.stderr, result.stderr
    assert elapsed < 25, f"launch took {elapsed:.1f} s: rank 0 was not stopped"


def test_launch_with_nothing_to_launch_is_a_usage_error() -> None:
    result = run_cli("launch", "--nproc", "2", timeout=30)
    assert result.returncode == 2
    assert "nothing to launch" in result.stderr


def test_coordinator_without_a_secret_exits_2_naming_the_variable() -> None:
    result = run_cli(
        "coordinator", "--world-size", "2", "--bind", "127.0.0.1:0", env=env_without_secret()
    )
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "PARAMSYNC_SECRET" in result.stderr


def test_coordinator_with_a_bad_world_size_exits_2() -> None:
    env = dict(os.environ, PARAMSYNC_SECRET="launch-tests-secret")
    result = run_cli("coordinator", "--world-size", "0", "--bind", "127.0.0.1:0", env=env)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "world_size" in result.stderr


def _error_lines(stderr: str) -> list[str]:
    """The lines a user reads: no traceback, no exception group, only log lines."""
    assert "Traceback" not in stderr and "ExceptionGroup" not in stderr, stderr
    return [line for line in stderr.splitlines() if " ERROR " in line]


def test_launch_with_a_short_secret_exits_2_before_starting_anything() -> None:
    env = dict(env_without_secret(), PARAMSYNC_SECRET="short")
    result = run_cli("launch", "--nproc", "2", "--", "examples/own_training_loop.py", env=env)
    assert result.returncode == 2, (result.returncode, result.stderr)
    [line] = _error_lines(result.stderr)
    assert "bad configuration: the shared secret must be at least" in line, line
    assert "PARAMSYNC_SECRET" in line, line  # names what to set
    assert "launched" not in result.stderr


def test_launch_exits_2_when_a_worker_exits_2(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys\n"
        "if os.environ['RANK'] == '1':\n"
        "    print('paramsync: set SOMETHING', file=sys.stderr)\n"
        "    sys.exit(2)\n"
        "import time; time.sleep(120)\n"
    )
    result = run_cli("launch", "--nproc", "2", "--", str(script), timeout=30)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "paramsync: set SOMETHING" in result.stderr
    assert "worker rank 1" in result.stderr and "bad configuration" in result.stderr


def test_launch_keeps_a_secret_file_as_it_is(tmp_path: Path) -> None:
    """The user's PARAMSYNC_SECRET_FILE reaches every child as it is: no secret of the
    launcher's own is put into their environment, and the run trains with the file's; the
    coordinator kind asked reaches them too."""
    secret_file = tmp_path / "secret"
    secret_file.write_text(os.urandom(16).hex())
    secret_file.chmod(0o600)
    script = tmp_path / "check_env.py"
    script.write_text(
        "import os, runpy, sys\n"
        "assert 'PARAMSYNC_SECRET' not in os.environ, 'the launcher put a secret in the env'\n"
        # The kind asked reaches the workers, for the groups a script makes itself.
        "assert os.environ['PARAMSYNC_COORDINATOR_KIND'] == 'flat', os.environ\n"
        f"sys.argv = ['own_training_loop.py', '--steps', '4']\n"
        f"runpy.run_path({str(ROOT / 'examples/own_training_loop.py')!r}, run_name='__main__')\n"
    )
    env = dict(env_without_secret(), PARAMSYNC_SECRET_FILE=str(secret_file))
    env["PYTHONPATH"] = str(ROOT)
    result = run_cli(
        "launch", "--nproc", "2", "--coordinator-kind", "flat", "--", str(script), env=env,
        timeout=90,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "after 4 steps" in result.stdout, result.stdout


def test_worker_without_a_secret_is_one_line_and_exit_2() -> None:
    result = run_cli(
        "worker",
        "--rank",
        "0",
        "--world-size",
        "2",
        "--coordinator",
        "127.0.0.1:9",
        "--steps",
        "1",
        "--corpus-bytes",
        "200000",
        env=env_without_secret(),
        timeout=60,
    )
    assert result.returncode == 2, (result.returncode, result.stderr)
    [line] = _error_lines(result.stderr)
    assert "bad configuration: no shared secret: set PARAMSYNC_SECRET" in line, line


def test_a_worker_with_another_world_size_is_one_line_and_exit_2(tmp_path: Path) -> None:
    env = dict(env_without_secret(), PARAMSYNC_SECRET=os.urandom(16).hex())
    port_file = tmp_path / "port"
    coordinator = subprocess.Popen(
        [
            *CLI,
            "coordinator",
            "--world-size",
            "2",
            "--bind",
            "127.0.0.1:0",
            "--port-file",
            str(port_file),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            assert coordinator.poll() is None, "the coordinator exited"
            assert time.monotonic() < deadline, "the coordinator never listened"
            time.sleep(0.1)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        result = run_cli(
            "worker",
            "--rank",
            "1",
            "--world-size",
            "3",
            "--coordinator",
            address,
            "--steps",
            "1",
            "--corpus-bytes",
            "200000",
            env=env,
            timeout=60,
        )
    finally:
        coordinator.kill()
        coordinator.wait()
    assert result.returncode == 2, (result.returncode, result.stderr)
    [line] = _error_lines(result.stderr)
    assert "world size 3 does not match this group's 2" in line and "WORLD_SIZE" in line, line


def test_coordinator_on_a_taken_port_is_one_line_naming_bind() -> None:
    env = dict(env_without_secret(), PARAMSYNC_SECRET=os.urandom(16).hex())
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_cli("coordinator", "--world-size", "2", "--bind", f"127.0.0.1:{port}", env=env)
    assert result.returncode == 2, (result.returncode, result.stderr)
    [line] = _error_lines(result.stderr)
    assert f"cannot listen on 127.0.0.1:{port}" in line and "--bind" in line, line


def _plan(*flags: str) -> LaunchPlan:
    args = build_parser().parse_args(["launch", *flags, "--", "job.py"])
    return LaunchPlan.from_args(args)


def test_a_node_of_a_multi_node_launch_runs_its_own_ranks() -> None:
    plan = _plan("--nnodes", "3", "--node-rank", "1", "--nproc-per-node", "4", "--coordinator",
                 "10.0.0.5:29600")  # fmt: skip
    assert plan.world_size == 12 and list(plan.ranks) == [4, 5, 6, 7]
    assert (plan.host, plan.port) == ("10.0.0.5", 29600)
    assert not plan.hosts_coordinator  # node 1: node 0 runs it
    assert plan.min_workers is None  # static unless restarts are asked for
    node0 = _plan("--nnodes", "3", "--node-rank", "0", "--nproc", "4", "--coordinator", "n0")
    assert node0.hosts_coordinator and node0.port == 29500  # torchrun's default port
    elsewhere = _plan("--nnodes", "2", "--nproc", "1", "--coordinator", "n0:1", "--no-coordinator")
    assert not elsewhere.hosts_coordinator


def test_torchruns_names_for_the_coordinators_address_are_accepted() -> None:
    by_master = _plan("--nnodes", "2", "--nproc", "1", "--master-addr", "10.1.2.3",
                      "--master-port", "29999")  # fmt: skip
    by_rdzv = _plan("--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", "10.1.2.3:29999")
    assert (by_master.host, by_master.port) == (by_rdzv.host, by_rdzv.port) == ("10.1.2.3", 29999)


def test_max_restarts_makes_the_run_elastic_down_to_one_node_less() -> None:
    multi = _plan("--nnodes", "2", "--nproc", "2", "--coordinator", "h:1", "--max-restarts", "3")
    assert multi.max_restarts == 3 and multi.min_workers == 2
    single = _plan("--nproc", "3", "--max-restarts", "1")
    assert single.min_workers == 2
    given = _plan("--nproc", "3", "--max-restarts", "1", "--min-workers", "3")
    assert given.min_workers == 3


def test_the_coordinator_tree_is_the_default_past_one_node_and_can_be_forced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PARAMSYNC_COORDINATOR_KIND", raising=False)
    nodes = ("--nnodes", "2", "--nproc", "2", "--coordinator", "10.0.0.5:1")
    assert _plan(*nodes).tree  # a sub-coordinator per node, the root on node 0
    assert not _plan("--nproc", "2").tree  # one node: the flat coordinator
    assert not _plan(*nodes, "--coordinator-kind", "flat").tree
    assert _plan(*nodes, "--coordinator-kind", "flat").coordinator_kind == "flat"
    assert _plan(*nodes).coordinator_kind == "auto"  # the workers' groups decide by hosts
    assert _plan("--nproc", "2", "--coordinator-kind", "tree").tree  # forced, one node too
    # Restarted workers rejoin a running run, which the tree does not take: flat.
    assert not _plan(*nodes, "--max-restarts", "1").tree
    # A coordinator started by hand is flat unless the launch says it is the tree's root.
    assert not _plan(*nodes, "--no-coordinator").tree
    assert _plan(*nodes, "--no-coordinator", "--coordinator-kind", "tree").tree
    monkeypatch.setenv("PARAMSYNC_COORDINATOR_KIND", "tree")
    assert _plan("--nproc", "2").tree
    assert not _plan("--nproc", "2", "--coordinator-kind", "flat").tree  # the flag wins
    monkeypatch.setenv("PARAMSYNC_COORDINATOR_KIND", "bushy")
    with pytest.raises(ValueError, match=r"PARAMSYNC_COORDINATOR_KIND.*'bushy'"):
        _plan("--nproc", "2")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--nproc", "2", "--coordinator-kind", "tree", "--max-restarts", "1"),
            "a worker restarted alone cannot rejoin the coordinator tree",
        ),
        (("--nnodes", "2", "--nproc", "1"), "needs the coordinator's address"),
        (("--nnodes", "2", "--nproc", "1", "--coordinator", "127.0.0.1:5"), "loopback"),
        (("--nnodes", "2", "--node-rank", "2", "--nproc", "1"), "--node-rank must be in 0..1"),
        (
            (
                "--nproc",
                "0",
            ),
            "--nproc-per-node",
        ),
        (("--nproc", "1", "--max-restarts", "-1"), "--max-restarts"),
        (("--nproc", "1", "--coordinator", "h:1", "--master-addr", "g"), "give one"),
        (("--nproc", "2", "--min-workers", "3"), "--min-workers must be in 1..2"),
        (("--nproc", "1", "--advertise-addr", "a b"), "PARAMSYNC_ADVERTISE_ADDR"),
        (("--nproc", "1", "--coordinator", "h:x"), "--coordinator"),
    ],
)
def test_bad_launch_flags_are_named(flags: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _plan(*flags)


def test_a_multi_node_launch_without_a_shared_secret_exits_2() -> None:
    result = run_cli(
        "launch", "--nnodes", "2", "--node-rank", "1", "--nproc", "1", "--coordinator",
        "10.9.9.9:29500", "--", "job.py", env=env_without_secret(),
    )  # fmt: skip
    assert result.returncode == 2, (result.returncode, result.stderr)
    [line] = _error_lines(result.stderr)
    assert "same value on each" in line and "PARAMSYNC_SECRET" in line, line


def test_the_advertised_address_is_a_host_without_a_port() -> None:
    assert advertised_host({}) is None and advertised_host({ADVERTISE_ENV: " "}) is None
    assert advertised_host({ADVERTISE_ENV: "10.0.0.7"}) == "10.0.0.7"
    assert advertised_host({ADVERTISE_ENV: "[fe80::1]"}) == "fe80::1"
    assert advertised_host({ADVERTISE_ENV: "node-7.cluster"}) == "node-7.cluster"
    with pytest.raises(ValueError, match=re.escape("PARAMSYNC_ADVERTISE_ADDR='10.0.0.7:80'")):
        advertised_host({ADVERTISE_ENV: "10.0.0.7:80"})


def test_the_launcher_the_command_line_and_the_coordinator_import_no_torch() -> None:
    # The launcher starts its processes before anything else, and the coordinator must be up
    # before any worker joins; importing torch first (1.2 s and 220 MB on this machine, and a
    # heavier exit) delayed every run. Only a worker needs torch.
    code = (
        "import sys; from paramsync.runtime.cli.main import build_parser; "
        "import paramsync.runtime.cli.launch; "
        "import paramsync.runtime.cli.daemons, paramsync.runtime.coordinator.service; "
        "from paramsync import runtime; runtime.ParamsyncError; runtime.Coordinator; "
        "build_parser(job_flags=False).parse_args(['launch', '--nproc', '2', '--', 'x.py']); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_lazy_package_names_resolve_to_their_modules() -> None:
    from paramsync import runtime
    from paramsync.runtime.coordinator.service import Coordinator

    assert runtime.Coordinator is Coordinator
    assert sorted(runtime.__all__) == sorted(runtime._WHERE)
    assert set(runtime.__all__) <= set(dir(runtime))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        runtime.nothing  # noqa: B018


@pytest.mark.soak  # two timed launches, about 8 s: make soak
def test_the_launch_time_benchmark_times_a_run_against_a_baseline() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "launch_time.py"), "--rounds", "1"]
    command += ["--steps", "3", "--baseline", str(ROOT)]  # this checkout as its own baseline
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    for name in ("this code", "baseline"):
        line = next(line for line in lines if line.strip().startswith(name + " "))
        launched = float(line.split("launched after")[1].split("s,")[0])
        exited = float(line.split("exited after")[1].split("s")[0])
        assert 0 < launched < exited, line
    assert "this code / baseline, round by round: x" in done.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--tree", "host"), "--tree host needs --root HOST:PORT, --host-index and --host-ranks"),
        (
            ("--tree", "host", "--root", "10.0.0.5:1", "--host-index", "4", "--host-ranks", "0-1"),
            "--host-index must be in 0..3, got 4",
        ),
        (
            ("--tree", "host", "--root", "10.0.0.5:1", "--host-index", "1", "--host-ranks", "2-9"),
            "--host-ranks '2-9': not ranks of 0..3",
        ),
        (
            ("--tree", "host", "--root", "10.0.0.5:1", "--host-index", "1", "--host-ranks", "x"),
            "--host-ranks 'x': expected A-B or a,b,c (world ranks)",
        ),
    ],
)
def test_a_sub_coordinators_bad_flags_are_one_line_and_exit_2(
    flags: tuple[str, ...],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from paramsync.runtime.cli.main import main

    monkeypatch.setenv("PARAMSYNC_SECRET", os.urandom(16).hex())
    with caplog.at_level(logging.ERROR, logger="paramsync.daemon"):
        code = main(["coordinator", "--world-size", "4", "--bind", "127.0.0.1:0", *flags])
    assert code == 2
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line == f"bad configuration: {message}", line
