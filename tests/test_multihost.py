"""Real multi-host runs on one machine: ranks in Linux network namespaces on a bridge.

Each namespace is a host (`paramsync.runtime.testing.netns`): its own network stack and address, the
kernel and ``/dev/shm`` shared with the others. The runs use ``paramsync launch --nnodes``,
one launcher per namespace, on `multihost_job` (a small MLP whose gradient buckets take the
ring), and compare with one process training on the whole batch. The torchrun runs use
``torchrun --nnodes 2``, one a namespace: a paramsync script with static rendezvous, and torch
DDP on the ``paramsync`` backend with c10d rendezvous (`benchmarks/torchrun_hosts.py`: against
gloo, a host lost, hosts that resolve their own name to loopback). Skipped, with the reason,
where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import multihost_job as job
import pytest
import torch

from paramsync.runtime.testing.netns import Shaping, VirtualHost, unavailable_reason, virtual_hosts

ROOT = Path(__file__).resolve().parent.parent
JOB = Path(job.__file__).resolve()
sys.path.insert(0, str(ROOT / "benchmarks"))
import torchrun_hosts  # noqa: E402  (benchmarks/torchrun_hosts.py: the torchrun c10d trials)

PORT = 29517
TIMEOUT = 240.0

_REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"no network namespaces: {_REASON}")


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHELASTIC_", "PARAMSYNC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(PARAMSYNC_SECRET=secrets.token_hex(16), OMP_NUM_THREADS="1", **extra)
    return env


class Run:
    """Processes started in namespaces, each logging to a file of ``out``; all killed at the
    end (the namespaces' teardown kills any left too)."""

    def __init__(self, out: Path, env: dict[str, str]) -> None:
        self.out, self.env = out, env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, host: VirtualHost, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.out / f"{name}.log", "wb")
        proc = host.popen(argv, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs[name] = proc
        return proc

    def launch(self, name: str, host: VirtualHost, flags: list[str], job_args: list[str]) -> None:
        argv = [sys.executable, "-m", "paramsync.runtime.cli.main", "launch", *flags]
        self.start(name, host, [*argv, "--", str(JOB), str(self.out), *job_args])

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}:\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.out.glob("*.log"))
        )

    def wait(self, *names: str, timeout: float = TIMEOUT) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for name in names:
            try:
                codes[name] = self.procs[name].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} did not finish within {timeout} s\n{self.logs()}")
        return codes

    def wait_for(self, what: str, condition: Any, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                pytest.fail(f"waited {timeout} s for {what}\n{self.logs()}")
            time.sleep(0.05)

    def step_of(self, rank: int) -> int:
        path = self.out / f"step{rank}"
        text = path.read_text().strip() if path.exists() else ""
        return int(text) if text else -1

    def results(self, world: int) -> list[dict[str, Any]]:
        return [json.loads((self.out / f"rank{r}.json").read_text()) for r in range(world)]

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@contextmanager
def run_in(tmp_path: Path) -> Iterator[Run]:
    run = Run(tmp_path, _env())
    try:
        yield run
    finally:
        run.kill_all()


def check_parity(results: list[dict[str, Any]], steps: int) -> None:
    """Every rank holds the same bytes, and they equal one process's training."""
    expected = job.reference(steps)
    first = results[0]["params"]
    for result in results:
        assert result["params"] == first, f"rank {result['rank']} differs from rank 0"
        for name, value in job.decode_params(result["params"]).items():
            torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-5, msg=name)


def launch_flags(node: int, coordinator: str, *extra: str) -> list[str]:
    return [
        "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
        "--coordinator", coordinator, *extra,
    ]  # fmt: skip


def test_four_ranks_on_two_hosts_equal_one_process(tmp_path: Path) -> None:
    """2 namespaces x 2 ranks, node 0 hosting the coordinator: every rank ends with the
    weights of one process, and the shared-memory plane never spans the two hosts."""
    steps = 6
    with virtual_hosts(2) as (a, b), run_in(tmp_path) as run:
        coordinator = f"{a.address}:{PORT}"
        run.launch("node0", a, launch_flags(0, coordinator), [str(steps)])
        # Node 1 names its address (--advertise-addr); node 0's workers take their route's.
        flags = launch_flags(1, coordinator, "--advertise-addr", b.address)
        run.launch("node1", b, flags, [str(steps)])
        codes = run.wait("node0", "node1")
        assert codes == {"node0": 0, "node1": 0}, run.logs()
        results = run.results(4)
    check_parity(results, steps)
    hosts = {r["rank"]: r["host"] for r in results}
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts  # the namespaces are the hosts
    for result in results:  # ranks on two hosts: the TCP ring for all (no plane)
        assert result["planes"] == ["None"], result["planes"]
        assert result["summary"]["final_step"] == steps


@pytest.mark.soak  # a kill-and-rejoin trial across namespaces: make soak
def test_a_remote_worker_killed_is_restarted_and_rejoins_live(tmp_path: Path) -> None:
    """SIGKILL of rank 3 (on node 1, not the coordinator's): node 1's launcher starts it
    again (--max-restarts 1), the others train on without it, and it rejoins live with their
    state; every rank ends with the same weights."""
    steps = 4
    with virtual_hosts(2) as (a, b), run_in(tmp_path) as run:
        coordinator = f"{a.address}:{PORT}"
        flags = ["--max-restarts", "1", "--heartbeat-deadline", "5"]
        job_args = [str(steps), "--until-rejoined", "--step-sleep", "0.05"]
        for node, host in enumerate((a, b)):
            run.launch(f"node{node}", host, launch_flags(node, coordinator, *flags), job_args)
        run.wait_for("rank 3's second step", lambda: run.step_of(3) >= 2)
        victim = int((tmp_path / "pid3").read_text())
        os.kill(victim, signal.SIGKILL)
        codes = run.wait("node0", "node1")
        assert codes == {"node0": 0, "node1": 0}, run.logs()
        results = run.results(4)
        node1_log = (tmp_path / "node1.log").read_text()
    assert "worker rank 3" in node1_log and "restarting it" in node1_log, node1_log
    assert results[3]["restarted"] and not any(r["restarted"] for r in results[:3])
    assert len({json.dumps(r["params"]) for r in results}) == 1, "the ranks' weights differ"
    assert len({r["summary"]["digest"] for r in results}) == 1
    epochs = [tuple(e["members"]) for e in results[0]["summary"]["epochs"]]
    assert epochs[0] == (0, 1, 2, 3) and (0, 1, 2) in epochs and epochs[-1] == (0, 1, 2, 3)


@pytest.mark.soak
def test_the_coordinator_on_its_own_host_restarted_the_run_finishes(tmp_path: Path) -> None:
    """The coordinator daemon in a third namespace is SIGKILLed mid-run and started again
    at the same address: the workers on the other two hosts redial, rejoin, and finish with the
    weights of one process. ~70 s under load (make soak; the one-host form of this trial runs
    in make test: tests/test_fault_trials.py)."""
    steps = 12
    with virtual_hosts(3) as (a, b, c), run_in(tmp_path) as run:
        bind = f"{c.address}:{PORT}"
        daemon = [
            sys.executable, "-m", "paramsync.runtime.cli.main", "coordinator", "--world-size", "4",
            "--bind", bind, "--heartbeat-deadline", "5",
        ]  # fmt: skip
        run.start("coordinator", c, daemon)
        job_args = [str(steps), "--step-sleep", "0.1"]
        for node, host in enumerate((a, b)):
            flags = launch_flags(node, bind, "--no-coordinator")
            run.launch(f"node{node}", host, flags, job_args)
        run.wait_for("step 3 on every rank", lambda: min(map(run.step_of, range(4))) >= 3)
        run.procs["coordinator"].send_signal(signal.SIGKILL)
        assert run.wait("coordinator") == {"coordinator": -9}
        run.start("restarted", c, daemon)
        codes = run.wait("node0", "node1", "restarted")
        assert codes == {"node0": 0, "node1": 0, "restarted": 0}, run.logs()
        results = run.results(4)
    check_parity(results, steps)
    epochs = results[0]["summary"]["epochs"]
    assert len(epochs) == 2 and all(e["members"] == [0, 1, 2, 3] for e in epochs), epochs


def test_virtual_hosts_reach_each_other_only_and_are_removed_even_on_failure() -> None:
    shaping = Shaping(1_000_000_000)
    with pytest.raises(RuntimeError, match="inside"), virtual_hosts(2, shaping=shaping) as hosts:
        a, b = hosts
        assert a.address != b.address and a.namespace != b.namespace
        listen = (
            "import socket; s = socket.create_server(('0.0.0.0', 5555)); "
            "c, peer = s.accept(); print(peer[0], c.recv(5).decode())"
        )
        server = b.popen([sys.executable, "-c", listen], stdout=subprocess.PIPE)
        dial = (
            "import socket, time\n"
            "for _ in range(200):\n"
            "    try:\n"
            f"        socket.create_connection(('{b.address}', 5555)).sendall(b'hello'); break\n"
            "    except OSError: time.sleep(0.05)\n"
        )
        subprocess.run(a.command([sys.executable, "-c", dial]), check=True, timeout=60)
        out, _ = server.communicate(timeout=60)
        assert out.decode().split() == [a.address, "hello"]  # from a's own address
        qdiscs = subprocess.run(
            ["tc", "qdisc", "show", "dev", a.outer_veth], capture_output=True, text=True
        ).stdout
        assert "tbf" in qdiscs and "rate 1Gbit" in qdiscs, qdiscs
        inside = subprocess.run(
            a.command(["tc", "qdisc", "show", "dev", a.inner_veth]), capture_output=True, text=True
        ).stdout
        assert "tbf" in inside, inside
        # The bridge has no address here: the caller's namespace has no route through it.
        route = subprocess.run(["ip", "route", "get", b.address], capture_output=True, text=True)
        assert "psb" not in route.stdout, route.stdout
        raise RuntimeError("inside")  # the context must still remove everything
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert a.namespace not in names and b.namespace not in names
    assert a.outer_veth not in links and b.outer_veth not in links


def test_torchrun_on_two_hosts_runs_a_paramsync_script(tmp_path: Path) -> None:
    """``torchrun --nnodes 2 --node-rank R --master-addr ...`` on each host, unchanged
    example: rank 0 (host a) hosts the coordinator on MASTER_ADDR, rank 1 finds its port in
    torchrun's store, and both train together."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed")
    with virtual_hosts(2) as (a, b), run_in(tmp_path) as run:
        for node, host in enumerate((a, b)):
            argv = [
                str(torchrun), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
                "1", "--master-addr", a.address, "--master-port", str(PORT),
                str(ROOT / "examples" / "own_training_loop.py"), "--steps", "20",
                "--log-every", "10",
            ]  # fmt: skip
            run.start(f"node{node}", host, argv)
        codes = run.wait("node0", "node1")
        assert codes == {"node0": 0, "node1": 0}, run.logs()
        out = (tmp_path / "node0.log").read_text()
    assert "rank 0 of 2: after 20 steps" in out, out


@pytest.mark.soak
def test_the_multihost_benchmark_runs_both_systems_on_a_shaped_link(tmp_path: Path) -> None:
    """A tiny run of benchmarks/multihost.py: both systems, one shaped rate, a JSON table
    (~30 s under load: make soak)."""
    out = tmp_path / "multihost.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "multihost.py"), "--rates", "1gbit",
        "--layouts", "2x1", "--sizes", "1MiB", "--rounds", "1", "--repeats", "1",
        "--json", str(out),
    ]  # fmt: skip
    result = subprocess.run(
        command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    assert row["rate_bits"] == 10**9 and row["layout"] == "2x1" and row["bytes"] == 1 << 20
    for system in ("paramsync", "gloo"):
        # Shaped: never above the link's rate (tbf's burst lets a little through at once).
        assert 0 < row[system]["fraction_of_rate"] < 1.5, row


# torch DDP on the backend under torchrun's c10d rendezvous (benchmarks/torchrun_hosts.py).


def readme_torchrun_commands() -> list[list[str]]:
    """The two ``torchrun ... --rdzv-backend c10d`` commands of README's "Several machines"."""
    text = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```sh\n(.*?)```", text, re.S) if "--rdzv-backend c10d" in b]
    assert len(blocks) == 1, "README has no (or several) torchrun c10d blocks"
    joined = blocks[0].replace("\\\n", " ")
    commands = [shlex.split(line) for line in joined.splitlines() if line.startswith("torchrun ")]
    assert len(commands) == 2, commands
    return commands


def readme_command(hosts: list[VirtualHost]) -> torchrun_hosts.Command:
    """Node ``node`` runs README's command for its host: its addresses those of the
    namespaces, one rank a host (the sums of two ranks are bitwise gloo's in any order),
    ``train.py`` the job; plus ``is_host`` (torch cannot tell a namespace's address as its
    own, as README says)."""
    commands = readme_torchrun_commands()
    readme_hosts = ["10.0.0.1", "10.0.0.2"]

    def command(node: int, script: list[str]) -> list[str]:
        argv = [sys.executable, "-m", "torch.distributed.run"]
        for word in commands[node][1:]:
            for readme_host, host in zip(readme_hosts, hosts, strict=True):
                word = word.replace(readme_host, host.address)
            argv += script if word == "train.py" else [word]
        argv[argv.index("--nproc-per-node") + 1] = "1"
        index = argv.index(str(script[0]))
        return [*argv[:index], "--rdzv-conf", f"is_host={int(node == 0)}", *argv[index:]]

    return command


@pytest.mark.soak  # two torchrun jobs of two hosts, ~60 s under load: make soak
def test_torch_ddp_on_the_backend_under_torchrun_c10d_on_two_hosts_equals_gloo_bitwise(
    tmp_path: Path,
) -> None:
    """README's two torchrun commands, one a namespace, c10d rendezvous on host a: torch DDP
    on the paramsync backend, under the coordinator tree (chosen by ``auto``: the group
    spans two hosts), ends, on both hosts, with bitwise the weights of the same commands on
    gloo, and training moved them."""
    states: dict[str, list[dict[str, Any]]] = {}
    with virtual_hosts(2) as hosts:
        command = readme_command(hosts)
        for backend in ("paramsync", "gloo"):
            out = tmp_path / backend
            codes = torchrun_hosts.train_on_two_hosts(hosts, out, backend, command=command)
            logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in out.glob("*.log"))
            assert codes == [0, 0], f"{backend}: {codes}\n{logs}"
            states[backend] = [torch.load(out / f"rank{rank}.pt") for rank in (0, 1)]
    hosted = [states["paramsync"][rank]["coordinators"] for rank in (0, 1)]
    assert [h["sub"] for h in hosted] == ["node0", "node1"], hosted  # each node's first rank
    assert hosted[0]["root_hosts"] == ["node0", "node1"] and not hosted[0]["flat"], hosted
    for rank in (0, 1):
        ours, gloos = states["paramsync"][rank], states["gloo"][rank]
        assert ours["world"] == gloos["world"] == 2
        assert sorted(ours["state"]) == sorted(gloos["state"])
        for name, value in ours["state"].items():
            assert torch.equal(value, gloos["state"][name]), f"rank {rank}: {name} differs"
            assert not torch.equal(value, ours["initial"][name]), f"{name} never moved"


HEARTBEAT_DEADLINE = 3.0
CHECK_PERIOD = min(1.0, HEARTBEAT_DEADLINE / 4)
"""How often the coordinator looks for silent ranks (`Coordinator._ticker`)."""


@pytest.mark.soak  # a torchrun job of two hosts a case, ~35 s under load: make soak
@pytest.mark.parametrize(
    ("way", "lost"),
    [("kill", "node1"), ("link", "node1"), ("kill", "node0"), ("link", "node0")],
)
def test_a_host_lost_under_torchrun_is_named_on_the_other_host(
    tmp_path: Path, way: str, lost: str
) -> None:
    """Two ranks a host, torch DDP on the backend under the coordinator tree; one host dies
    mid-training (every process in its namespace SIGKILLed, or its link down). Each rank of
    the other host fails its collective with one line naming the lost host and its ranks (or
    rank 0, which ran the root, and its host): at once on a kill (the kernel closes the
    sockets), within the heartbeat deadline of silence, plus one check of the clock, on a
    link down."""
    with virtual_hosts(2) as hosts:
        loss = torchrun_hosts.host_loss_trial(
            hosts, tmp_path, way=way, lost=lost, nproc=2, heartbeat_deadline=HEARTBEAT_DEADLINE
        )
    dead = hosts[int(lost[-1])].address
    assert sorted(loss.lines) == ([0, 1] if lost == "node1" else [2, 3]), loss
    for rank, line in loss.lines.items():
        assert line.startswith(f"paramsync group 0, rank {rank}"), line
        if lost == "node1":  # the root (rank 0's) names the host lost and its ranks
            assert "coordinator stopped the run: host 'node1' (ranks [2, 3])" in line, line
        else:  # the root went with host a: host b's sub-coordinator names it and its host
            assert f"host 'node1' lost the root coordinator on rank 0 (host {dead})" in line
        bound = 2.0 if way == "kill" else HEARTBEAT_DEADLINE + CHECK_PERIOD + 1.0
        assert loss.seconds[rank] < bound, (loss.seconds, line)


@contextmanager
def names_on_loopback(hosts: list[VirtualHost], names: list[str]) -> Iterator[None]:
    """Each host resolves its own name to 127.0.1.1 (Debian's ``/etc/hosts``) and the other
    hosts' names to their addresses (their DNS): ``/etc/netns/<namespace>/hosts``, which
    ``ip netns exec`` puts in place of ``/etc/hosts``; removed on exit."""
    folders = [Path("/etc/netns") / host.namespace for host in hosts]
    try:
        for index, folder in enumerate(folders):
            folder.mkdir(parents=True)
            lines = ["127.0.0.1 localhost"] + [
                f"{'127.0.1.1' if other == index else host.address} {names[other]}"
                for other, host in enumerate(hosts)
            ]
            (folder / "hosts").write_text("\n".join(lines) + "\n")
        yield
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.soak  # a torchrun job of two hosts, ~30 s under load: make soak
def test_hosts_whose_own_name_is_loopback_train_on_the_backend(tmp_path: Path) -> None:
    """``--local-addr nodea`` / ``nodeb``, each host resolving its own name to 127.0.1.1 as
    Debian's /etc/hosts does: MASTER_ADDR is ``nodea``, which torch's store (listening on
    every interface) serves; rank 0's coordinator and the mesh listeners of host a's ranks
    listen on every interface and are told by that name, so host b reaches them (they listened
    on 127.0.1.1 and host b retried until the group's timeout)."""
    names = ["nodea", "nodeb"]
    with virtual_hosts(2) as hosts, names_on_loopback(hosts, names):
        endpoint = f"{hosts[0].address}:{torchrun_hosts.RDZV_PORT}"

        def command(node: int, script: list[str]) -> list[str]:
            argv = torchrun_hosts.torchrun_argv(node, names[node], endpoint, "names", 1, [])
            return [*argv[: argv.index(str(torchrun_hosts.THIS))], *script]

        codes = torchrun_hosts.train_on_two_hosts(
            hosts, tmp_path, "paramsync", command=command, timeout=150
        )
        logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in tmp_path.glob("*.log"))
        assert codes == [0, 0], f"{codes}\n{logs}"
    ranks = [torch.load(tmp_path / f"rank{rank}.pt")["state"] for rank in (0, 1)]
    assert all(torch.equal(ranks[0][name], ranks[1][name]) for name in ranks[0])


def tree_flags(node: int, coordinator: str, *extra: str) -> list[str]:
    return [
        "--nnodes", "3", "--node-rank", str(node), "--nproc-per-node", "2",
        "--coordinator", coordinator, *extra,
    ]  # fmt: skip


def launch_three(
    run: Run, hosts: list[VirtualHost], steps: int, *extra: str, sleep: float = 0.05
) -> None:
    coordinator = f"{hosts[0].address}:{PORT}"
    for node, host in enumerate(hosts):
        flags = tree_flags(node, coordinator, *extra)
        run.launch(f"node{node}", host, flags, [str(steps), "--step-sleep", str(sleep)])


@pytest.mark.soak  # two launches of 3 namespaces x 2 ranks (~200 s under load): make soak
def test_the_coordinator_tree_on_three_hosts_trains_bitwise_as_the_flat_coordinator(
    tmp_path: Path,
) -> None:
    """3 namespaces x 2 ranks under ``paramsync launch --nnodes 3``: a sub-coordinator on
    each node (the tree is the default past one node), the root on node 0. The run ends
    bitwise identical to the same launch with ``--coordinator-kind flat``, and equal to one
    process's training."""
    steps = 8
    outcomes: dict[str, list[dict[str, Any]]] = {}
    for kind in ("tree", "flat"):
        out = tmp_path / kind
        out.mkdir()
        with virtual_hosts(3) as hosts, run_in(out) as run:
            launch_three(run, hosts, steps, "--coordinator-kind", kind)
            codes = run.wait("node0", "node1", "node2")
            assert codes == {"node0": 0, "node1": 0, "node2": 0}, run.logs()
            outcomes[kind] = run.results(6)
            node0_log = (out / "node0.log").read_text()
        launched = "the root coordinator" if kind == "tree" else "launched the coordinator"
        assert launched in node0_log, node0_log
    tree, flat = outcomes["tree"], outcomes["flat"]
    assert [r["params"] for r in tree] == [r["params"] for r in flat]  # bit for bit
    check_parity(tree, steps)


@pytest.mark.soak  # 3 namespaces x 2 ranks, one killed mid-run (~100 s under load): make soak
def test_the_coordinator_tree_loses_a_whole_host_and_the_run_goes_on(tmp_path: Path) -> None:
    """An elastic run (``--min-workers 4``) under the tree loses node 2's whole namespace
    mid-run (every process in it killed): the root names the host and its ranks once, and the
    4 survivors on 2 hosts finish every step together, holding one state. (The step in flight
    when the host died is retrained on the survivors' shards of it: not one process's run.)"""
    steps = 16
    out = tmp_path
    with virtual_hosts(3) as hosts, run_in(out) as run:
        launch_three(run, hosts, steps, "--min-workers", "4", "--heartbeat-deadline", "5")
        run.wait_for("step 3 on every rank", lambda: min(map(run.step_of, range(6))) >= 3)
        for pid in hosts[2].pids():  # node 2's machine is gone: every process in it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        codes = run.wait("node0", "node1")
        assert codes == {"node0": 0, "node1": 0}, run.logs()
        survivors = run.results(4)
        node0_log = (out / "node0.log").read_text()
    assert len({json.dumps(r["params"]) for r in survivors}) == 1, "the survivors differ"
    assert len({r["summary"]["digest"] for r in survivors}) == 1
    assert all(r["summary"]["final_step"] == steps for r in survivors)
    lines = node0_log.splitlines()
    lost = [line for line in lines if "ERROR" in line and "(ranks [4, 5]) disconnected" in line]
    assert len(lost) == 1 and "host 'node2" in lost[0], node0_log[-4000:]  # the root's report
    opened = [line for line in lines if "epoch 2 starts" in line]
    assert len(opened) == 1 and "with ranks [0, 1, 2, 3]" in opened[0], node0_log[-4000:]
    epochs = [tuple(e["members"]) for e in survivors[0]["summary"]["epochs"]]
    assert epochs == [(0, 1, 2, 3, 4, 5), (0, 1, 2, 3)], epochs


@pytest.mark.soak  # 3 namespaces x 2 ranks, a sub-coordinator killed (~100 s under load)
def test_a_killed_sub_coordinator_is_restarted_and_its_host_rejoins(tmp_path: Path) -> None:
    """An elastic run under the tree: node 1's sub-coordinator alone is SIGKILLed mid-run.
    The root names the host and its ranks once and the others go on; node 1's launcher starts
    the sub-coordinator again at its address, node 1's workers redial it with their state, and
    the host rejoins in a new epoch, taking the survivors' state: all 6 ranks finish together
    with one state. The steps are slow (0.5 s each) so that the others still run when the
    restarted sub-coordinator is up (a Python start under load)."""
    steps = 60
    with virtual_hosts(3) as hosts, run_in(tmp_path) as run:
        flags = ("--min-workers", "4", "--heartbeat-deadline", "5")
        launch_three(run, hosts, steps, *flags, sleep=0.5)
        run.wait_for("step 3 on every rank", lambda: min(map(run.step_of, range(6))) >= 3)
        node1_log = (tmp_path / "node1.log").read_text()
        [pid] = re.findall(r"node 1's sub-coordinator \(pid (\d+)\)", node1_log)
        os.kill(int(pid), signal.SIGKILL)
        codes = run.wait("node0", "node1", "node2")
        assert codes == {"node0": 0, "node1": 0, "node2": 0}, run.logs()
        results = run.results(6)
        node0_log = (tmp_path / "node0.log").read_text()
        node1_log = (tmp_path / "node1.log").read_text()
    assert "restarting it (restart 1 of 3)" in node1_log, node1_log[-4000:]
    assert len({json.dumps(r["params"]) for r in results}) == 1, "the ranks' weights differ"
    assert len({r["summary"]["digest"] for r in results}) == 1
    lines = node0_log.splitlines()
    lost = [line for line in lines if "ERROR" in line and "(ranks [2, 3]) disconnected" in line]
    assert len(lost) == 1, node0_log[-4000:]
    epochs = [tuple(e["members"]) for e in results[0]["summary"]["epochs"]]
    assert epochs == [(0, 1, 2, 3, 4, 5), (0, 1, 4, 5), (0, 1, 2, 3, 4, 5)], epochs


@pytest.mark.soak  # 3 namespaces x 2 ranks, one replica nudged (~70 s under load)
def test_a_nudged_worker_on_one_host_is_named_by_the_root_with_its_rank(tmp_path: Path) -> None:
    """Under the tree, rank 3 (node 1) adds 1e-3 to a bias after step 2: the root's digest
    check, from the hosts' folded digest groups, stops the run naming rank 3 and the tensor,
    and every node's launcher fails."""
    with virtual_hosts(3) as hosts, run_in(tmp_path) as run:
        coordinator = f"{hosts[0].address}:{PORT}"
        for node, host in enumerate(hosts):
            flags = tree_flags(node, coordinator)
            run.launch(f"node{node}", host, flags, ["8", "--step-sleep", "0.05", "--nudge", "3:2"])
        codes = run.wait("node0", "node1", "node2")
        node0_log = (tmp_path / "node0.log").read_text()
    assert all(code != 0 for code in codes.values()), codes
    lines = node0_log.splitlines()
    named = [line for line in lines if "ranks [3] differ from the majority" in line]
    assert named, node0_log[-4000:]
    assert "rank 3 first differs from rank 0 at tensor 'param/2.bias'" in named[0], named[0]
