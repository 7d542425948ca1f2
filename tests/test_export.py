"""Saving the trained model (issue 14): `DistributedTrainer.state_dict` and `save_safetensors`.

* ``state_dict()`` of a trained BatchNorm model (parameters, running statistics, the counter)
  is plain CPU copies under the model's own names: it loads strictly into a fresh plain module,
  into torch DDP's ``.module`` and through DDP's own ``load_state_dict`` (gloo, one process),
  and each of them then computes what the trained replica computes.
* ``save_safetensors`` writes the same tensors, readable by ``safetensors.torch.load_file``,
  with the step in its metadata; tied weights (one tensor under two names) are written as two
  copies, which safetensors accepts, and load back into the tied model.
* A model wrapped in ``nn.DataParallel`` exports without its ``module.`` prefix.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import trio
from ddp_reference import PER_RANK, bn_batches, bn_model, bn_optimizer, mse, shard
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paramsync.actors.demo_job.model import CharTransformer
from paramsync.actors.train.trainer import DistributedTrainer
from paramsync.actors.train.worker import train_in_process

RUN_SECONDS = 30.0


def same_outputs(a: nn.Module, b: nn.Module, x: torch.Tensor) -> None:
    a.eval()
    b.eval()
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


async def train_bn(world_size: int, tmp_path: Path) -> list[dict[str, Any]]:
    data = bn_batches(world_size)

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = bn_model(rank)
        return model, bn_optimizer(model)

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        rank = trainer.dist_config.rank
        for batch in data[:3]:
            await trainer.train_batch(shard(batch, rank))
        await trainer.verified()
        path = trainer.save_safetensors(tmp_path / f"rank{rank}.safetensors")
        return {"state": trainer.state_dict(), "model": trainer.model, "path": path}

    with trio.fail_after(RUN_SECONDS):
        return await train_in_process(world_size, make_replica, mse, body)


async def test_state_dict_loads_into_a_plain_module_and_into_torch_ddp(tmp_path: Path) -> None:
    results = await train_bn(2, tmp_path)
    trained, state = results[0]["model"], results[0]["state"]
    live = trained.state_dict()
    assert list(state) == list(live)  # the model's own names, in order, nothing prefixed
    assert "norm.num_batches_tracked" in state and int(state["norm.num_batches_tracked"]) == 3
    for name, value in state.items():
        assert value.device.type == "cpu" and value.is_contiguous(), name
        assert torch.equal(value, live[name]), name
        assert value.data_ptr() != live[name].data_ptr(), f"{name} shares the live storage"
    x = torch.randn(2 * PER_RANK, 5, generator=torch.Generator().manual_seed(1))

    plain = bn_model(99)
    plain.load_state_dict(state)  # strict
    same_outputs(plain, trained, x)

    port = _free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(bn_model(98))
        ddp.module.load_state_dict(state)
        same_outputs(ddp.module, trained, x)
        again = DistributedDataParallel(bn_model(97))
        again.load_state_dict({f"module.{name}": value for name, value in state.items()})
        same_outputs(again, trained, x)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_save_safetensors_writes_the_state_dict_with_its_step(tmp_path: Path) -> None:
    results = await train_bn(2, tmp_path)
    for result in results:
        loaded = load_file(str(result["path"]))
        assert loaded.keys() == result["state"].keys()
        for name, value in result["state"].items():
            assert torch.equal(loaded[name], value), name
        with safe_open(str(result["path"]), framework="pt") as file:
            metadata = file.metadata()
        assert metadata["format"] == "pt" and metadata["paramsync_step"] == "3"
    fresh = bn_model(5)
    fresh.load_state_dict(load_file(str(results[1]["path"])))
    same_outputs(fresh, results[0]["model"], torch.randn(3, 5))


async def test_tied_weights_export_as_two_copies_and_load_back_tied(tmp_path: Path) -> None:
    vocab, context = 11, 8

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = CharTransformer(vocab, 16, 2, 1, context, tie_weights=True, seed=rank)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, vocab, (4, context), generator=gen)
    targets = torch.randint(0, vocab, (4, context), generator=gen)

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        for _ in range(2):
            await trainer.train_batch((idx, targets))
        await trainer.verified()
        path = trainer.save_safetensors(tmp_path / "tied.safetensors")
        return {"state": trainer.state_dict(), "model": trainer.model, "path": path}

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return model.loss(*batch)

    with trio.fail_after(RUN_SECONDS):
        (result,) = await train_in_process(1, make_replica, loss, body)
    state = result["state"]
    assert torch.equal(state["tok_emb.weight"], state["head.weight"])
    assert state["tok_emb.weight"].data_ptr() != state["head.weight"].data_ptr()
    fresh = CharTransformer(vocab, 16, 2, 1, context, tie_weights=True, seed=7)
    fresh.load_state_dict(load_file(str(result["path"])))
    assert fresh.head.weight is fresh.tok_emb.weight  # still one tensor
    same_outputs(fresh, result["model"], idx)


async def test_a_wrapped_model_exports_without_the_wrapper_prefix() -> None:
    data = bn_batches(1)

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        wrapped = nn.DataParallel(bn_model(rank))  # on CPU it just calls the module
        return wrapped, bn_optimizer(wrapped)

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        for batch in data[:2]:
            await trainer.train_batch(shard(batch, 0))
        await trainer.verified()
        return {"state": trainer.state_dict(), "model": trainer.model}

    with trio.fail_after(RUN_SECONDS):
        (result,) = await train_in_process(1, make_replica, mse, body)
    assert all(name.startswith("module.") for name in result["model"].state_dict())
    assert list(result["state"]) == list(bn_model(0).state_dict())
    plain = bn_model(50)
    plain.load_state_dict(result["state"])
    same_outputs(plain, result["model"].module, torch.randn(4, 5))


async def test_save_safetensors_refuses_metadata_that_is_not_text(tmp_path: Path) -> None:
    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = bn_model(0)
        return model, bn_optimizer(model)

    async def body(trainer: DistributedTrainer) -> dict[str, str]:
        with pytest.raises(TypeError, match="metadata 'note' must be a str, got int"):
            trainer.save_safetensors(tmp_path / "bad.safetensors", {"note": 3})  # type: ignore[dict-item]
        assert not (tmp_path / "bad.safetensors").exists()
        path = trainer.save_safetensors(tmp_path / "good.safetensors", {"note": "three"})
        with safe_open(str(path), framework="pt") as file:
            return file.metadata()

    with trio.fail_after(RUN_SECONDS):
        (metadata,) = await train_in_process(1, make_replica, mse, body)
    assert metadata == {"note": "three", "format": "pt", "paramsync_step": "0"}
