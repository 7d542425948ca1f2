"""What the identical-state proof covers (`paramsync.actors.torch_backend.proof_targets`) and
the line that says so (`proof_notice`), in one process: torch's fake process group stands in
for 4 ranks (rank 0), so FSDP2, HSDP, tensor parallelism and DDP are built as torch builds
them, without a collective running."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from paramsync.actors.torch_backend import proof_targets
from paramsync.actors.torch_backend.proof_notice import notice
from paramsync.actors.torch_backend.proof_targets import LOCAL, OTHER_GROUP, SHARDED, plan_for

WATCHED: set[int] = set()
"""The ids of the groups the tests call proven (paramsync's, with the proof on)."""


def watched(group: Any) -> bool:
    return id(group) in WATCHED


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    proof_targets.install(watched)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def clean_watch() -> Iterator[None]:
    WATCHED.clear()
    yield
    WATCHED.clear()


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    )


def test_hsdp_shards_are_compared_across_the_replicas_holding_them(world: None) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = mlp()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    WATCHED.update({id(mesh.get_group(0)), id(mesh.get_group(1))})
    plan = plan_for(torch.optim.AdamW(model.parameters()), watched)
    (entry,) = plan.replicated
    assert entry.group is mesh.get_group(0)
    assert entry.dimension == "'replicate'" and entry.replicas == [[0, 2], [1, 3]]
    # Named by their fully qualified names, from torch's registry of fully_shard's modules.
    assert [name for name, _ in entry.params] == [
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "2.weight",
        "2.bias",
    ]
    assert plan.bare == [mesh.get_group(1)] and plan.unproven == {} and plan.ddp == []
    line = notice(plan)
    assert "6 DTensor parameters replicated over mesh dimension 'replicate'" in line, line
    assert "across ranks [0, 2] and [1, 3]" in line and "Not proven" not in line, line
    # The replicate dimension on another backend: nothing claimed there, said so.
    WATCHED.discard(id(mesh.get_group(0)))
    plan = plan_for(torch.optim.AdamW(model.parameters()), watched)
    assert plan.replicated == [] and plan.unproven == {OTHER_GROUP: 6}


def test_pure_fsdp_shards_are_said_to_be_unproven(world: None) -> None:
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
    model = mlp()
    fully_shard(model, mesh=mesh)
    WATCHED.add(id(mesh.get_group(0)))
    plan = plan_for(torch.optim.SGD(model.parameters()), watched)
    assert plan.replicated == [] and plan.bare == [mesh.get_group(0)]
    assert plan.unproven == {SHARDED: 6}
    line = notice(plan)
    assert "compares after every optimizer step: nothing. Not proven: 6 parameters sharded" in line


def test_tensor_parallel_replicated_layernorm_is_proven(world: None) -> None:
    from torch.distributed.tensor import distribute_module

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Linear(16, 8, bias=False), torch.nn.LayerNorm(8)
    )
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    distribute_module(model[2], mesh)
    head = torch.nn.Linear(8, 2)  # a rank-local head, stepped by the same optimizer
    WATCHED.add(id(mesh.get_group(0)))
    plan = plan_for(torch.optim.AdamW([*model.parameters(), *head.parameters()]), watched)
    (entry,) = plan.replicated
    # Named by the class and attribute torch registered them under, and their index.
    assert [name for name, _ in entry.params] == ["LayerNorm.weight[3]", "LayerNorm.bias[4]"]
    assert plan.unproven == {SHARDED: 3, LOCAL: 2}
    # An optimizer built from named parameters names them fully.
    plan = plan_for(torch.optim.AdamW(model.named_parameters()), watched)
    assert [name for name, _ in plan.replicated[0].params] == ["2.weight", "2.bias"]


def test_ddp_modules_are_found_at_construction_and_held_weakly(world: None) -> None:
    from torch.nn.parallel import DistributedDataParallel

    group = dist.group.WORLD
    first = DistributedDataParallel.__init__
    proof_targets.install(watched)  # again: the constructor is wrapped once
    assert DistributedDataParallel.__init__ is first
    assert not hasattr(first.__wrapped__, "__wrapped__")  # type: ignore[attr-defined]
    other = DistributedDataParallel(mlp())  # on a group not proven: left alone
    assert other not in proof_targets.ddp_modules()
    WATCHED.add(id(group))
    ddp = DistributedDataParallel(mlp())
    assert ddp in proof_targets.ddp_modules()
    optimizer = torch.optim.AdamW(ddp.parameters())
    plan = plan_for(optimizer, watched)
    assert plan.ddp == [(ddp.module, group)] and plan.unproven == {}
    assert "a torch DDP module (6 parameters, its buffers and their optimizer state)" in notice(
        plan
    )
    del ddp, plan, optimizer
    gc.collect()
    assert proof_targets.ddp_modules() == []


def test_planning_never_scans_the_heap(world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> list[Any]:
        raise AssertionError("gc.get_objects() called")

    monkeypatch.setattr(gc, "get_objects", refuse)
    model = mlp()
    plan = plan_for(torch.optim.SGD(model.parameters()), watched)
    assert plan.unproven == {LOCAL: 6}
    assert notice(plan).endswith("nothing. Not proven: 6 parameters " + LOCAL + ".")
