"""Uneven inputs (``TrainerOptions(join=True)``, `DistributedTrainer.join`): a worker whose data
ends first does not hang the others.

The semantics (torch DDP's ``Join`` with its default ``divide_by_initial_world_size=True``):
every step starts by counting the workers that still have data; a worker out of data takes
part with zero gradients, the average still divides by the world size, every worker applies
the same optimizer step, and once no worker has data all stop at the same step.

* Parity: shards of different lengths over 2 and 3 workers (over both transports) reach the
  weights and optimizer state of ONE plain-torch process that, at step s, trains on
  ``sum(mean loss of each shard still active at s) / world_size``, bitwise identical on every
  rank, within a trio deadline; each worker took ``longest - its own`` steps joined.
* Combined with clipping and unused parameters (the joined worker uses none).
* ``fit`` with a different number of steps per worker ends on every worker at the same step.
* Without ``join`` a worker that stops early fails the run with a clear error, not a hang;
  ``join()`` without the option is refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio
from test_trainer import (
    OPTIMIZERS,
    RUN_SECONDS,
    RecordingDataset,
    clone_state,
    leaves,
    mlp,
    mse_loss,
    optimizer_tensors,
    raw,
    run_expecting_failure,
    tiny_replica,
)
from torch import nn

from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions
from paramsync.actors.train.worker import train_in_process
from paramsync.runtime.coordinator.service import CoordinatorOptions
from paramsync.runtime.transport.tcp import TcpTransport

PER_RANK = 4


def shards(lengths: list[int], seed: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each rank's own list of (x, y) batches: ``lengths[rank]`` of them."""
    gen = torch.Generator().manual_seed(seed)
    return [
        [
            (torch.randn(PER_RANK, 5, generator=gen), torch.randn(PER_RANK, 3, generator=gen))
            for _ in range(length)
        ]
        for length in lengths
    ]


def reference_join(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[list[tuple[torch.Tensor, torch.Tensor]]],
    clip: float | None = None,
) -> list[float]:
    """One process: step s's loss sums the mean losses of the shards that still have a batch
    at s and divides by the world size (zeros from the joined ones). Returns the norms."""
    world_size, norms = len(data), []
    for step in range(max(len(batches) for batches in data)):
        optimizer.zero_grad()
        active = [batches[step] for batches in data if step < len(batches)]
        loss = sum(mse_loss(model, batch) for batch in active) / world_size
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
    return norms


async def run_uneven(
    lengths: list[int],
    optimizer_name: str,
    options: TrainerOptions,
    transport: str = "inproc",
) -> list[dict[str, Any]]:
    world_size = len(lengths)
    data = shards(lengths, seed=sum(lengths))

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(rank, widths=(5, 6, 3))
        return model, OPTIMIZERS[optimizer_name](model.parameters())

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        losses = [await trainer.train_batch(batch) for batch in data[trainer.run.rank]]
        joined = await trainer.join()
        await trainer.verified()
        return {
            "losses": losses,
            "joined": joined,
            "step": trainer.step,
            "params": clone_state(trainer.model),
            "optim": optimizer_tensors(trainer.model, trainer.run.optimizer),
            "norms": list(trainer.grad_norms),
            "summary": trainer.summary(),
        }

    with trio.fail_after(RUN_SECONDS):
        if transport == "tcp":
            async with TcpTransport.open_group(world_size) as transports:
                results = await train_in_process(
                    world_size,
                    make_replica,
                    mse_loss,
                    body,
                    options=options,
                    transports=list(transports),
                )
        else:
            results = await train_in_process(
                world_size, make_replica, mse_loss, body, options=options
            )

    reference = mlp(0, widths=(5, 6, 3))
    ref_optimizer = OPTIMIZERS[optimizer_name](reference.parameters())
    ref_norms = reference_join(reference, ref_optimizer, data, options.clip_grad_norm)
    ref_params, ref_optim = clone_state(reference), optimizer_tensors(reference, ref_optimizer)
    longest = max(lengths)
    for rank, result in enumerate(results):
        assert result["step"] == longest, f"rank {rank} stopped at step {result['step']}"
        assert result["joined"] == longest - lengths[rank]
        assert result["summary"]["joined_steps"] == longest - lengths[rank]
        assert len(result["losses"]) == lengths[rank]
        for name, value in ref_params.items():
            torch.testing.assert_close(
                result["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}"
            )
        for name, value in ref_optim.items():
            torch.testing.assert_close(
                result["optim"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}"
            )
        for name, value in result["params"].items():
            assert raw(value) == raw(results[0]["params"][name]), f"rank {rank} {name} differs"
        assert result["summary"]["digest"] == results[0]["summary"]["digest"]
        if options.clip_grad_norm is not None:
            assert [n for _, n in result["norms"]] == pytest.approx(ref_norms, rel=1e-5)
            assert result["norms"] == results[0]["norms"]
    return results


@pytest.mark.parametrize("optimizer_name", ["sgd-momentum", "adam"])
@pytest.mark.parametrize(
    "lengths", [[2, 5], [5, 2], [3, 3], [1, 4, 2], [4, 0, 4]], ids=lambda ls: "-".join(map(str, ls))
)
async def test_uneven_shards_join_and_match_the_reference(
    lengths: list[int], optimizer_name: str
) -> None:
    await run_uneven(lengths, optimizer_name, TrainerOptions(join=True, bucket_bytes=64))


async def test_uneven_shards_over_tcp() -> None:
    await run_uneven([3, 1, 2], "adam", TrainerOptions(join=True, bucket_bytes=64), "tcp")


async def test_uneven_shards_with_clipping_unused_parameters_and_accumulation() -> None:
    """The joined worker's zero gradients count in the average the norm is taken of; with
    ``find_unused_parameters`` it reports every parameter unused and the others' gradients
    still reduce (trunk and head used by the workers with data)."""
    results = await run_uneven(
        [2, 4, 1],
        "sgd-momentum",
        TrainerOptions(
            join=True,
            clip_grad_norm=0.05,
            find_unused_parameters=True,
            accumulation_steps=2,
            bucket_bytes=1,
        ),
    )
    assert all(len(result["norms"]) == 4 for result in results)


async def test_fit_with_different_step_counts_ends_on_every_worker_at_the_same_step() -> None:
    """``fit`` ends by joining: the worker given fewer steps follows the others to the end."""
    steps = {0: 2, 1: 5, 2: 3}

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        history = await trainer.fit(RecordingDataset(60), 2, steps=steps[trainer.run.rank])
        await trainer.verified()
        return {
            "history": [s for s, _ in history],
            "step": trainer.step,
            "joined": trainer.run.history.joined_steps,
            "digest": trainer.summary()["digest"],
        }

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(
            3, tiny_replica, mse_loss, body, options=TrainerOptions(join=True)
        )
    for rank, result in enumerate(results):
        assert result["history"] == list(range(steps[rank]))
        assert result["step"] == 5
        assert result["joined"] == 5 - steps[rank]
        assert result["digest"] == results[0]["digest"]


async def test_joined_workers_stop_at_max_steps() -> None:
    async def body(trainer: DistributedTrainer) -> tuple[int, int]:
        gen = torch.Generator().manual_seed(trainer.run.rank)
        for _ in range(1 if trainer.run.rank else 10):
            if trainer.run.reached_max_steps:
                break
            await trainer.train_batch(
                (torch.randn(2, 3, generator=gen), torch.randn(2, 2, generator=gen))
            )
        return await trainer.join(), trainer.step

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(
            2, tiny_replica, mse_loss, body, options=TrainerOptions(join=True, max_steps=4)
        )
    assert results == [(0, 4), (3, 4)]


async def test_without_join_a_worker_stopping_early_stalls_and_the_stall_deadline_ends_it() -> None:
    """Without the option nothing steps in for the worker that stopped: its peers wait in their
    next all-reduce. The coordinator sees step 1 stall and, past its stall deadline, aborts the
    run: a bounded failure (and the reason to use ``join``)."""

    async def body(trainer: DistributedTrainer) -> None:
        gen = torch.Generator().manual_seed(trainer.run.rank)
        for _ in range(1 if trainer.run.rank == 0 else 3):
            await trainer.train_batch(
                (torch.randn(2, 3, generator=gen), torch.randn(2, 2, generator=gen))
            )

    error = await run_expecting_failure(
        lambda: train_in_process(
            2,
            tiny_replica,
            mse_loss,
            body,
            coordinator_options=CoordinatorOptions(stall_seconds=0.5, stall_deadline=0.5),
        ),
        seconds=15,
    )
    stalls = [str(leaf) for leaf in leaves(error) if "stalled" in str(leaf)]
    assert stalls and all("step 1: ranks" in text for text in stalls), repr(error)


async def test_join_needs_the_option() -> None:
    async def body(trainer: DistributedTrainer) -> str:
        with pytest.raises(RuntimeError, match="join=True"):
            await trainer.join()
        return "refused"

    with trio.fail_after(RUN_SECONDS):
        assert await train_in_process(2, tiny_replica, mse_loss, body) == ["refused"] * 2
