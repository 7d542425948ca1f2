"""Which inner torch group a ``paramsync`` group hands a call's bytes to
(`paramsync.actors.torch_backend.inner`): the kind asked for, and the route of each call."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from paramsync.actors.torch_backend.inner import INNER_ENV, inner_kind, route_for
from paramsync.runtime.errors import ConfigError


def test_the_kind_comes_from_pg_options_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(INNER_ENV, raising=False)
    assert inner_kind() == "auto"
    monkeypatch.setenv(INNER_ENV, " Gloo ")
    assert inner_kind() == "gloo"
    assert inner_kind("native") == "native"
    assert inner_kind({"inner": "auto"}) == "auto"
    assert inner_kind({"other": 1}) == "gloo"


def test_an_unknown_kind_is_one_line_naming_where_it_came_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(INNER_ENV, "mpi")
    with pytest.raises(ConfigError, match=f"{INNER_ENV}='mpi': use one of auto, nccl"):
        inner_kind()
    with pytest.raises(ConfigError, match="pg_options 3"):
        inner_kind(3)


@pytest.mark.skipif(torch.distributed.is_nccl_available(), reason="this torch has NCCL")
def test_nccl_asked_of_a_torch_without_it_is_refused() -> None:
    with pytest.raises(ConfigError, match="pg_options=nccl: this torch has no NCCL"):
        inner_kind("nccl")


def test_cpu_tensors_go_to_gloo_only_when_asked() -> None:
    floats = [torch.ones(3), torch.ones(2, dtype=torch.complex64)]
    assert route_for("gloo", floats, nccl=False) == "gloo"
    assert route_for("auto", floats, nccl=True) is None
    assert route_for("nccl", floats, nccl=True) is None
    assert route_for("native", floats, nccl=True) is None


def test_what_gloo_does_not_take_stays_native() -> None:
    assert route_for("gloo", [torch.ones(3, dtype=torch.int16)], nccl=False) is None
    assert route_for("gloo", [], nccl=False) is None  # a barrier
    meta = torch.ones(3, device="meta")
    assert route_for("gloo", [torch.ones(3), meta], nccl=False) is None  # mixed devices


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_tensors_go_to_nccl_unless_native() -> None:
    on_gpu = [torch.ones(3, device="cuda")]
    for kind in ("auto", "nccl", "gloo"):
        assert route_for(kind, on_gpu, nccl=True) == "nccl"
    assert route_for("native", on_gpu, nccl=True) is None
    assert route_for("auto", on_gpu, nccl=False) is None
    assert route_for("auto", [*on_gpu, torch.ones(3)], nccl=True) is None


def test_pg_options_choose_the_inner_group_of_each_group() -> None:
    """torch hands ``pg_options`` of ``init_process_group`` and ``new_group`` to the backend:
    each group takes the kind it names (one rank; the calls counted by plane)."""
    code = (
        "import torch, torch.distributed as dist\n"
        "store = dist.TCPStore('127.0.0.1', 0, 1, True)\n"
        "dist.init_process_group('paramsync', store=store, rank=0, world_size=1,\n"
        "                        pg_options={'inner': 'gloo'})\n"
        "t = torch.ones(4)\n"
        "dist.all_reduce(t)\n"
        "sub = dist.new_group([0], pg_options='native')\n"
        "dist.all_reduce(t, group=sub)\n"
        "print(dict(dist.group.WORLD.calls_by_plane), dict(sub.calls_by_plane), t.tolist())\n"
        "dist.destroy_process_group()\n"
    )
    env = dict(os.environ, PARAMSYNC_SECRET="inner-tests-Secret-0123456789-abcdefghijklmn")
    env.pop(INNER_ENV, None)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "{'gloo': 1} {'native': 1} [1.0, 1.0, 1.0, 1.0]"
