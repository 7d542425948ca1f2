"""Which inner torch group a ``paramsync`` group hands a call's bytes to
(`paramsync.actors.torch_backend.inner`): the kind asked for, and the route of each call."""

from __future__ import annotations

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
