"""The torch backend under the coordinator tree: plain torch scripts
(tests/torch_backend_worker.py) on several hosts, faked on this machine with
``PARAMSYNC_HOST_KEY`` (``TORCHDIST_FAKE_HOSTS``) and the tree forced
(``PARAMSYNC_COORDINATOR_KIND=tree``); across network namespaces in the soak run.

Each host's first rank runs the host's sub-coordinator, rank 0 the root as well; every rank
joins its host's. Training is bitwise what the flat coordinator's group trains, a stalled call
and a killed rank are named as the flat coordinator names them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_torch_backend import error_line, launch

from paramsync.actors.torch_backend.tree import coordinator_kind, host_key, plan
from paramsync.runtime.errors import ConfigError
from paramsync.runtime.testing.netns import unavailable_reason, virtual_hosts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import torchrun_hosts  # benchmarks/torchrun_hosts.py: the torchrun c10d trials

_NETNS = unavailable_reason()

TREE = {"PARAMSYNC_COORDINATOR_KIND": "tree", "TORCHDIST_FAKE_HOSTS": "2"}


def hosted(out: Path, world: int) -> list[dict[str, Any]]:
    """Which coordinators of the world group each rank ran (``rank<r>.tree.json``)."""
    return [json.loads((out / f"rank{r}.tree.json").read_text()) for r in range(world)]


def ran_the_tree(out: Path) -> None:
    """4 ranks on 2 fake hosts ran the world group under the tree: ranks 0 and 2 a
    sub-coordinator each, rank 0 the root, which saw both hosts."""
    ran = hosted(out, 4)
    assert [h["sub"] for h in ran] == ["fake0", None, "fake1", None], ran
    assert ran[0]["root_hosts"] == ["fake0", "fake1"] and not ran[0]["flat"], ran


@pytest.mark.parametrize(
    ("world", "subs"),
    [
        pytest.param(2, ["fake0", "fake1"], id="2 ranks, one a host"),
        pytest.param(4, ["fake0", None, "fake1", None], id="4 ranks", marks=pytest.mark.soak),
    ],
)
def test_ddp_under_the_tree_trains_bitwise_as_the_flat_coordinator(
    tmp_path: Path, world: int, subs: list[str | None]
) -> None:
    """Ranks on 2 fake hosts: DDP trains 4 steps on the world group (the tree), then 4 on a
    flat group of the same ranks; every rank ends both bitwise alike."""
    results = launch("tree_train", world, tmp_path, seconds=120, **TREE)
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{output[-3000:]}"
    ran = hosted(tmp_path, world)
    assert [h["sub"] for h in ran] == subs  # each host's first rank runs its sub
    assert ran[0]["root_hosts"] == ["fake0", "fake1"]  # the root on rank 0 saw hosts
    assert not any(h["flat"] for h in ran)  # no flat coordinator for the world group
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    names = [k for k in states[0] if k.startswith("tree/")]
    assert names
    for state in states:
        for name in names:
            flat = name.replace("tree/", "flat/", 1)
            assert torch.equal(state[name], states[0][name]), name
            assert torch.equal(state[name], state[flat]), name


def test_the_layout_comes_from_what_every_rank_published() -> None:
    published = [("auto", "b"), ("auto", "a"), ("auto", "b"), ("auto", "a")]
    layout = plan("0", published, 3)
    assert layout is not None
    assert layout.hosts == (("b", (0, 2)), ("a", (1, 3)))
    assert layout.index == 1 and not layout.first and layout.name == "a"
    assert plan("0", [("auto", "a"), ("auto", "a")], 0) is None  # one host: flat
    assert plan("0", [("tree", "a"), ("tree", "a")], 1) is not None  # forced
    assert plan("0", [("flat", "a"), ("flat", "b")], 1) is None
    with pytest.raises(ConfigError, match=r"ranks \[0, 2\] say 'auto'; ranks \[1\] say 'flat'"):
        plan("0", [("auto", "a"), ("flat", "b"), ("auto", "b")], 0)
    with pytest.raises(ConfigError, match="PARAMSYNC_COORDINATOR_KIND='star': expected one"):
        coordinator_kind({"PARAMSYNC_COORDINATOR_KIND": "star"})
    assert coordinator_kind({}) == "auto"
    assert host_key({"PARAMSYNC_HOST_KEY": "rack1", "GROUP_RANK": "3"}) == "rack1"
    assert host_key({"GROUP_RANK": "3"}) == "node3"  # torchrun's node


@pytest.mark.soak
def test_a_stalled_call_is_named_with_its_ranks_under_the_tree(tmp_path: Path) -> None:
    results = launch("stall", 4, tmp_path, seconds=60, TORCHDIST_TIMEOUT="4", **TREE)
    ran_the_tree(tmp_path)
    assert results[0][0] == 3, results[0]
    seconds, line = error_line(tmp_path, 0)
    assert "allreduce" in line and "ranks [1] did not call it" in line, line
    assert "ranks [0, 2, 3] waited in it" in line, line
    assert seconds < 4 + 6, seconds


@pytest.mark.soak
@pytest.mark.parametrize(
    ("killed", "expected"),
    [
        pytest.param(3, {r: "rank 3 disconnected" for r in (0, 1, 2)}, id="a worker"),
        pytest.param(
            2,
            {
                0: "host 'fake1' (ranks [2, 3]) disconnected",
                1: "host 'fake1' (ranks [2, 3]) disconnected",
                3: "rank 2 (host 127.0.0.1), which hosts the sub-coordinator of host 'fake1' "
                "(ranks [2, 3]), is gone",
            },
            id="a host's sub-coordinator",
        ),
        pytest.param(
            0,
            {
                1: "rank 0 (host 127.0.0.1), which hosts the sub-coordinator of host 'fake0' "
                "(ranks [0, 1]), is gone",
                2: "host 'fake1' lost the root coordinator on rank 0 (host 127.0.0.1)",
                3: "host 'fake1' lost the root coordinator on rank 0 (host 127.0.0.1)",
            },
            id="the root's rank",
        ),
    ],
)
def test_a_killed_rank_is_named_under_the_tree(
    tmp_path: Path, killed: int, expected: dict[int, str]
) -> None:
    """4 ranks on 2 fake hosts train under DDP; one is SIGKILLed after a backward: a worker
    is named by its host, a host's first rank (its sub-coordinator) as the host and its
    ranks, rank 0 (the root) as the root's rank; every survivor exits with one line."""
    started = time.monotonic()
    results = launch(
        "kill",
        4,
        tmp_path,
        seconds=90,
        TORCHDIST_TIMEOUT="30",
        TORCHDIST_KILL_RANK=str(killed),
        **TREE,
    )
    ran_the_tree(tmp_path)
    assert results[killed][0] == -9, results[killed]
    for rank, words in expected.items():
        assert results[rank][0] == 3, results[rank]
        seconds, line = error_line(tmp_path, rank)
        assert words in line, line
        assert seconds < 30, seconds
    assert time.monotonic() - started < 90


@pytest.mark.soak  # two torchrun jobs of two namespaces x 2 ranks, ~40 s under load
@pytest.mark.skipif(_NETNS is not None, reason=f"no network namespaces: {_NETNS}")
def test_torchrun_on_two_hosts_runs_the_tree_by_default_bitwise_as_the_flat_coordinator(
    tmp_path: Path,
) -> None:
    """``torchrun --nnodes 2 --nproc-per-node 2``, one node a network namespace, torch DDP on
    the backend: the group spans two hosts, so ``auto`` runs the coordinator tree (each node's
    first rank a sub-coordinator, rank 0 the root); its weights are bitwise those of the same
    job on the flat coordinator (``PARAMSYNC_COORDINATOR_KIND=flat``)."""
    states: dict[str, list[dict[str, Any]]] = {}
    with virtual_hosts(2) as hosts:
        for kind in ("auto", "flat"):
            out = tmp_path / kind
            codes = torchrun_hosts.train_on_two_hosts(
                hosts, out, "paramsync", nproc=2, env={"PARAMSYNC_COORDINATOR_KIND": kind}
            )
            logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in out.glob("*.log"))
            assert codes == [0, 0], f"{kind}: {codes}\n{logs}"
            states[kind] = [torch.load(out / f"rank{rank}.pt") for rank in range(4)]
    tree = [states["auto"][rank]["coordinators"] for rank in range(4)]
    assert [h["sub"] for h in tree] == ["node0", None, "node1", None], tree
    assert tree[0]["root_hosts"] == ["node0", "node1"], tree
    assert not any(h["flat"] for h in tree), tree
    flat = [states["flat"][rank]["coordinators"] for rank in range(4)]
    assert [h["flat"] for h in flat] == [True, False, False, False], flat
    for rank in range(4):
        ours, theirs = states["auto"][rank]["state"], states["flat"][rank]["state"]
        for name, value in ours.items():
            assert torch.equal(value, theirs[name]), f"rank {rank}: {name} differs"
            assert torch.equal(value, states["auto"][0]["state"][name]), name
