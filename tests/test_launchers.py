"""The DDP import swap under any launcher, and a rank's death under it.

What each launcher's variables mean (`paramsync.runtime.launcher_env`, through
`DistributedTrainConfig.from_env`) and where the coordinator is met
(`paramsync.actors.train.rendezvous`) are checked in this process. Then
tests/launcher_worker.py, a torch DDP script with its import swapped, runs as two processes
under each launcher's variables, set here as the launcher sets them: a hand-written launcher
with torch's (after the script's own ``init_process_group``, whose TCP store holds
MASTER_PORT), Slurm's and Open MPI's (torchrun's is tests/test_examples.py's). A rank
SIGKILLed mid-run: the survivor ends within the heartbeat deadline on one line naming it,
whether the dead rank hosted the coordinator (rank 0) or not (rank 1), and never reports the
step dropped by a membership change after the run ended.

The default suite runs the hand-written launcher with rank 0 killed (one two-process run:
the store rendezvous and rank 0's death); the other shapes are ``make soak``'s.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import trio
import trio.testing

from paramsync.actors.client.client import CoordinatorClient, CoordinatorLost
from paramsync.actors.train import rendezvous
from paramsync.actors.train.rendezvous import GROUP_STORE_KEY, find_rendezvous
from paramsync.runtime.errors import ConfigError
from paramsync.runtime.launcher_env import Launcher, launcher_env, slurm_root_node
from paramsync.runtime.protocol.messages import StartRun
from paramsync.runtime.train_config import DistributedTrainConfig
from paramsync.runtime.transport.link import MemoryLink

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("launcher_worker.py")
SECONDS = 150
SURVIVOR_BOUND = 15.0
"""Seconds the survivor of a SIGKILL may take to end (the heartbeat deadline is 10 s; the
coordinator's redial window, which rank 0's coordinator no longer gets, was 60 s)."""

SLURM = {
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODELIST": "gpu[07-08,11]",
    "SLURM_JOB_ID": "4721234",
}
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "3",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
}


# -- what each launcher's variables say --------------------------------------------------------


def test_slurm_variables_give_the_rank_and_rank_0s_node_as_lightning_reads_them() -> None:
    config = DistributedTrainConfig.from_env(SLURM)
    assert (config.rank, config.world_size, config.local_rank) == (1, 4, 1)
    assert config.coordinator_addr == "gpu07:16234"  # 15000 + the job id's last four digits
    assert not config.is_coordinator
    mine = DistributedTrainConfig.from_env(dict(SLURM, MASTER_ADDR="head", MASTER_PORT="2222"))
    assert mine.coordinator_addr == "head:2222"
    job = {k: v for k, v in SLURM.items() if k not in ("SLURM_NODELIST", "SLURM_JOB_ID")}
    assert DistributedTrainConfig.from_env(
        dict(job, SLURM_JOB_NODELIST="n1,n2")
    ).coordinator_addr == ("n1:12910")


@pytest.mark.parametrize(
    ("nodes", "root"),
    [
        ("host0 host1", "host0"),
        ("host0,host1", "host0"),
        ("host[5-9]", "host5"),
        ("host[5]", "host5"),
        ("gpu[07-08,11],cpu3", "gpu07"),
    ],
)
def test_the_root_node_is_the_first_of_the_node_list(nodes: str, root: str) -> None:
    assert slurm_root_node(nodes) == root


def test_open_mpi_variables_give_the_rank_and_loopback_on_one_node() -> None:
    config = DistributedTrainConfig.from_env(OPEN_MPI)
    assert (config.rank, config.world_size, config.local_rank) == (2, 3, 2)
    assert config.coordinator_addr == "127.0.0.1:29500"
    found = launcher_env(OPEN_MPI)
    assert found is not None and found.launcher is Launcher.OPEN_MPI


def test_torchs_variables_win_over_the_launchers() -> None:
    env = dict(SLURM, RANK="0", WORLD_SIZE="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="29400")
    assert launcher_env(env) is None
    config = DistributedTrainConfig.from_env(env)
    assert (config.rank, config.world_size, config.coordinator_addr) == (0, 2, "10.0.0.1:29400")
    # An interactive allocation's shell is no Slurm task (Lightning's rule).
    assert launcher_env(dict(SLURM, SLURM_JOB_NAME="interactive")) is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (dict(SLURM, SLURM_PROCID="4"), "SLURM_PROCID=4 is not below SLURM_NTASKS=4"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_NTASKS"}, "SLURM_NTASKS is not set"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_LOCALID"}, "SLURM_LOCALID is not set"),
        (dict(SLURM, SLURM_NTASKS="four"), "SLURM_NTASKS='four' is not a non-negative"),
        (
            {k: v for k, v in SLURM.items() if k != "SLURM_NODELIST"},
            "neither SLURM_NODELIST nor SLURM_JOB_NODELIST",
        ),
        (dict(SLURM, SLURM_JOB_ID="12_3"), "SLURM_JOB_ID='12_3' is not a job number"),
        (dict(SLURM, MASTER_PORT="99999"), "MASTER_PORT='99999' is not in 0-65535"),
        (
            dict(OPEN_MPI, OMPI_COMM_WORLD_LOCAL_SIZE="1"),
            "set MASTER_ADDR to it (mpirun -x MASTER_ADDR",
        ),
        (dict(OPEN_MPI, OMPI_COMM_WORLD_LOCAL_RANK="3"), "OMPI_COMM_WORLD_LOCAL_RANK=3 is not"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE is not set"),
    ],
)
def test_missing_or_contradictory_launcher_variables_are_one_line_naming_them(
    env: Mapping[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        DistributedTrainConfig.from_env(env)
    assert "\n" not in str(caught.value)


# -- where the coordinator is met --------------------------------------------------------------


def _rebuild(rank: int, world: int) -> DistributedTrainConfig:
    return DistributedTrainConfig(world_size=world, rank=rank)


def test_without_a_torch_group_the_coordinator_listens_where_the_environment_says() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29999"}
    config = DistributedTrainConfig.from_env(env)
    meet = find_rendezvous(config, _rebuild, role_given=False, environ=env)
    assert (meet.host, meet.port, meet.publish, meet.lookup) == ("10.1.1.1", 29999, None, None)
    assert meet.host_rank == 0 and not meet.daemon  # rank 0's: not redialed
    worker = find_rendezvous(config, _rebuild, role_given=True, environ=env)
    assert worker.daemon  # PARAMSYNC_ROLE=worker: a `paramsync coordinator` daemon, redialed
    launched = dict(env, PARAMSYNC_COORDINATOR_ADDR="10.1.1.2:4000")
    config = DistributedTrainConfig.from_env(launched)
    assert find_rendezvous(config, _rebuild, role_given=False, environ=launched).daemon


@pytest.fixture
def one_rank_group() -> object:
    """A one-rank gloo default group over a TCP store of this process."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = dist.TCPStore("localhost", port, 1, True, timedelta(seconds=10))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield store
    finally:
        dist.destroy_process_group()


def test_after_init_process_group_rank_0_publishes_its_coordinator_in_the_groups_store(
    one_rank_group: object,
) -> None:
    """The script's own store holds MASTER_PORT: the coordinator takes a free port and its
    address goes through the default group's store; the rank and world size are the
    group's (an ``mp.spawn`` script sets no RANK)."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    config = DistributedTrainConfig.from_env(env)
    meet = find_rendezvous(config, _rebuild, role_given=False, environ=env)
    assert (meet.host, meet.port, meet.host_rank) == ("127.0.0.1", 0, 0)
    # No MASTER_ADDR (``init_method="tcp://HOST:PORT"``): the store's host is rank 0's.
    assert find_rendezvous(config, _rebuild, role_given=False, environ={}).host == "localhost"
    assert meet.publish is not None and meet.lookup is not None
    meet.publish("127.0.0.1", 4321)
    assert meet.lookup(5.0) == ("127.0.0.1", 4321)
    key = [
        k
        for k in (GROUP_STORE_KEY, *(f"{GROUP_STORE_KEY}/{n}" for n in range(2, 9)))
        if dist.distributed_c10d._get_default_store().check([k])
    ]
    assert key, "nothing published under the trainer's key"
    # The next trainer of this process reads a key of its own.
    again = find_rendezvous(config, _rebuild, role_given=False, environ=env)
    assert again.lookup is not None
    with pytest.raises(ConfigError, match="did not publish its coordinator's address"):
        again.lookup(0.2)


def test_a_group_made_with_arguments_gives_the_rank_and_world_size() -> None:
    """``mp.spawn``'s shape: no variable names the rank, ``init_process_group(rank=1,
    world_size=2)`` does: the configuration is resolved again with the group's numbers (the
    role follows the rank)."""
    config = DistributedTrainConfig.from_env({})
    placed = rendezvous._with_group_place(config, 1, 2, {}, _rebuild)
    assert (placed.rank, placed.world_size, placed.is_coordinator) == (1, 2, False)
    assert rendezvous._with_group_place(config, 0, 1, {}, _rebuild) is config


def test_a_rank_the_environment_contradicts_is_one_line_naming_both(one_rank_group: object) -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2"}
    config = DistributedTrainConfig.from_env(env)
    with pytest.raises(ConfigError, match=r"says rank 0 of 1, but .* says rank 1 of 2"):
        find_rendezvous(config, _rebuild, role_given=False, environ=env)


# -- a coordinator lost with the rank that hosted it ----------------------------------------------


@pytest.mark.parametrize("how", ["closed", "silent"])
async def test_a_coordinator_hosted_by_rank_0_is_lost_with_it_at_once_naming_it(
    autojump_clock: trio.testing.MockClock, how: str
) -> None:
    """Its connection closed (rank 0 SIGKILLed) or silent past the heartbeat deadline (rank
    0's host gone): the worker does not redial a coordinator that cannot come back; it ends
    on one error naming rank 0, within the deadline."""
    coordinator, worker = MemoryLink.pair("worker", "coordinator")
    client = CoordinatorClient(worker, rank=1, heartbeat_seconds=100.0, host_rank=0)
    client.begin_epoch(
        StartRun(addresses=(("127.0.0.1", 1),) * 2, ring=(0, 1), heartbeat_deadline=3)
    )
    if how == "closed":
        await coordinator.aclose()
    started = trio.current_time()
    with pytest.raises(CoordinatorLost) as caught:
        with trio.fail_after(10):
            try:
                await client.serve()
            except BaseExceptionGroup as group:
                [leaf] = group.exceptions
                raise leaf from None
    assert trio.current_time() - started <= 3.5
    assert str(caught.value).startswith("rank 0 is lost, and the run's coordinator with it")
    assert caught.value.peer == "rank 0" and "\n" not in str(caught.value)


# -- two processes under each launcher's variables ---------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _base_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "OMPI_", "TORCHELASTIC_", "PARAMSYNC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", PARAMSYNC_SECRET="launcher-tests-secret-0123456789abcdef")
    return env


def _torch_vars(rank: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _slurm_vars(rank: int, port: int) -> dict[str, str]:
    # srun's variables; the coordinator's port is Lightning's, derived from the job id.
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": str(rank),
        "SLURM_NODELIST": "127.0.0.1",
        "SLURM_JOB_ID": f"77{port - 15000:04d}",
        "SLURM_JOB_NAME": "train",
    }


def _open_mpi_vars(rank: int, port: int) -> dict[str, str]:
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_PORT": str(port),
    }


def _slurm_port() -> int:
    """A free port in 15000-24999 (Slurm's derived range)."""
    for _ in range(200):
        port = _free_port()
        if 15000 <= port < 25000:
            return port
    with socket.socket() as probe:
        for port in range(15000 + os.getpid() % 9000, 25000):
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 15000-24999")


def _start(
    variables: dict[str, str] | list[dict[str, str]], args: list[str]
) -> list[subprocess.Popen[str]]:
    per_rank = variables if isinstance(variables, list) else [variables, variables]
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), *args],
            cwd=ROOT,
            env={**_base_env(), **mine},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for mine in per_rank
    ]


def _outputs(procs: list[subprocess.Popen[str]]) -> list[str]:
    try:
        return [proc.communicate(timeout=SECONDS)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()


def _trained(procs: list[subprocess.Popen[str]]) -> None:
    outputs = _outputs(procs)
    finals = []
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{out[-3000:]}"
        found = re.search(rf"final rank {rank} world 2 checksum (\S+)", out)
        assert found, out[-3000:]
        finals.append(found[1])
    assert finals[0] == finals[1], finals  # every step checked: bitwise the same weights


def _killed(procs: list[subprocess.Popen[str]], dead: int) -> str:
    """Wait for rank ``dead`` to die by SIGKILL; the survivor's output, checked to end within
    `SURVIVOR_BOUND` of the death on one line naming the dead rank."""
    survivor = procs[1 - dead]
    deadline = time.monotonic() + SECONDS
    while procs[dead].poll() is None:
        assert time.monotonic() < deadline, "the rank to kill never died"
        time.sleep(0.02)
    died = time.monotonic()
    try:
        survivor.wait(timeout=SECONDS)
    finally:
        ended = time.monotonic()
        outputs = _outputs(procs)
    out = outputs[1 - dead]
    assert procs[dead].returncode == -9, outputs[dead][-2000:]
    assert survivor.returncode == 1, out[-3000:]
    assert ended - died < SURVIVOR_BOUND, f"the survivor took {ended - died:.1f} s:\n{out[-3000:]}"
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out[-3000:]
    print(f"rank {dead} SIGKILLed: rank {1 - dead} ended {ended - died:.2f} s later: {errors[0]}")
    assert "retry_scheduled" not in out.split("step 0", 1)[-1], out[-3000:]
    assert "dropped by a membership change" not in out, out[-3000:]
    return errors[0]


def test_a_hand_launched_script_meets_through_its_own_store_and_rank_0s_death_ends_it_at_once() -> (
    None
):
    """Row 2 and 3 of issue 40 in one run: torch's variables set by hand, the script's own
    ``init_process_group`` on MASTER_PORT, paramsync's DDP joined through that group's store;
    rank 0, which hosts the coordinator, SIGKILLed at step 3: rank 1 ends within the bound
    (not after a 60 s redial window), its one error line naming rank 0."""
    port = _free_port()
    procs = _start([_torch_vars(r, port) for r in (0, 1)], ["--init", "env", "--kill", "0", "3"])
    line = _killed(procs, dead=0)
    assert "rank 0 is lost, and the run's coordinator with it" in line, line


@pytest.mark.soak  # two processes each (about 10 s apiece on 2 cores): make soak
@pytest.mark.parametrize(
    ("shape", "init"),
    [
        ("torch", "env"),
        ("torch", None),
        ("slurm", None),
        ("slurm", "tcp"),
        ("open_mpi", None),
        ("open_mpi", "tcp"),
        ("spawn", "tcp"),
    ],
)
def test_the_import_swap_trains_under_each_launchers_variables(
    shape: str, init: str | None
) -> None:
    """Two ranks train to bitwise identical weights under each launcher's variables: with the
    script's own ``init_process_group`` (``env``: torch's variables; ``tcp``: the rank and
    world size the script reads from Slurm's or Open MPI's, as its scripts do, or, for
    ``mp.spawn``'s shape, from its arguments with no variable at all) or without."""
    port = _slurm_port() if shape == "slurm" else _free_port()
    if shape == "spawn":  # mp.spawn's shape: the rank is an argument, no variable says it
        store = f"tcp://127.0.0.1:{_free_port()}"
        procs = [_start([{}], ["--init", store, "--place", str(r), "2"])[0] for r in (0, 1)]
        _trained(procs)
        return
    make = {"torch": _torch_vars, "slurm": _slurm_vars, "open_mpi": _open_mpi_vars}[shape]
    args = []
    if init == "env":
        args = ["--init", "env"]
    elif init == "tcp":
        args = ["--init", f"tcp://127.0.0.1:{_free_port()}"]
    _trained(_start([make(r, port) for r in (0, 1)], args))


@pytest.mark.soak
@pytest.mark.parametrize("dead", [0, 1])
def test_a_killed_rank_is_one_account_without_a_torch_group(dead: int) -> None:
    """A rank SIGKILLed at step 3, the script calling no ``init_process_group`` (rank 0's
    coordinator then listens on MASTER_PORT itself): the survivor ends within the bound on
    one line naming the dead rank: rank 0's coordinator died with it and is not redialed;
    rank 1's death makes rank 0's coordinator abort the run. Neither survivor says a step
    was dropped by a membership change, since none happened."""
    port = _free_port()
    procs = _start([_torch_vars(r, port) for r in (0, 1)], ["--kill", str(dead), "3"])
    line = _killed(procs, dead=dead)
    if dead == 0:
        assert "rank 0 is lost, and the run's coordinator with it" in line, line
    else:
        assert "RunAborted: coordinator stopped the run: rank 1 disconnected" in line, line
