"""`DistributedDataParallel`: the user's own ``loss.backward(); optimizer.step()`` loop.

Every run is a coordinator and N workers in one trio run (`train_in_process`); each worker wraps
its trainer (`DistributedDataParallel.around`) and runs a plain, synchronous torch loop in a
thread of its own, as a DDP script would.

* Parity: N = 1..4 workers with B samples each reach the weights and optimizer state of ONE
  plain-torch process training rank 0's initial model on the concatenated N*B batch (SGD with
  momentum and Adam, one bucket per parameter and one for all), and the ranks hold
  bitwise-identical parameters and optimizer state after every step (C-DDP-001); `no_sync`
  accumulation matches one step on the whole batch too; with a BatchNorm model the own loop
  ends bitwise where `train_batch` does, in every buffer mode.
* Unused parameters behave as with torch DDP's ``find_unused_parameters`` (or fail naming them).
* Overlap: a bucket's all-reduce finishes while the user's backward is still running.
* C-DDP-001: a rank whose weights drift is caught by the coordinator's check, which stops the
  run naming the tensor.
* Misuse fails with an error saying what to do.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import trio
from ddp_reference import bn_batches, bn_model, bn_optimizer, mse
from ddp_reference import shard as bn_shard
from torch import nn

from paramsync.actors import DistributedDataParallel
from paramsync.actors.client.client import RunAborted
from paramsync.actors.train.ddp_arguments import torch_comm_hook, torch_ddp_options
from paramsync.actors.train.ddp_wrapper import DistributedOptimizer
from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions
from paramsync.actors.train.worker import train_in_process

RUN_SECONDS = 60.0
"""Deadline of one whole run: far beyond a healthy run of these tiny models on 2 cores."""
STEPS = 4
PER_RANK = 4
BIG_BUCKET = 1 << 20

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def mlp(seed: int) -> nn.Module:
    """A Tanh MLP whose initial weights depend only on ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3))


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, bytes]:
    """Every parameter's and optimizer state tensor's bytes, by name."""
    names = {id(p): name for name, p in model.named_parameters()}
    out = {f"param/{name}": raw(p) for name, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{names[id(param)]}/{key}"] = raw(value)
    return out


def leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaves(inner)]
    return [error]


def batches(world_size: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4321 + world_size)
    n = world_size * PER_RANK
    return [
        (torch.randn(n, 5, generator=gen), torch.randn(n, 3, generator=gen)) for _ in range(steps)
    ]


def shard(batch: tuple[torch.Tensor, ...], rank: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[rank * PER_RANK : (rank + 1) * PER_RANK] for t in batch)


def dummy_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    raise AssertionError("the own-loop tests never call train_batch")


Loop = Callable[[DistributedDataParallel, DistributedOptimizer], Any]


async def own_loop(trainer: DistributedTrainer, loop: Loop) -> Any:
    """Wrap ``trainer`` and run the synchronous ``loop(model, optimizer)`` in a thread (given up
    on when the test's deadline cancels it, so a hang fails instead of hanging the suite)."""
    model, optimizer = DistributedDataParallel.around(trainer)
    return await trio.to_thread.run_sync(loop, model, optimizer, abandon_on_cancel=True)


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("optimizer_name", ["sgd-momentum", "adam"])
@pytest.mark.parametrize("bucket_bytes", [1, BIG_BUCKET], ids=["bucket-per-param", "one-bucket"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
async def test_parity_with_one_process_on_the_concatenated_batch(
    world_size: int, bucket_bytes: int, optimizer_name: str
) -> None:
    data = batches(world_size)

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(rank)  # different weights per rank: rank 0's must be broadcast
        return model, OPTIMIZERS[optimizer_name](model.parameters())

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        rank = trainer.run.rank

        def loop(model: DistributedDataParallel, optimizer: DistributedOptimizer) -> Any:
            history, taken = [], []
            for batch in data:
                inputs, targets = shard(batch, rank)
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(inputs), targets)
                loss.backward()
                taken.append(optimizer.step())
                model.verified()  # this step's digests agreed on every rank
                history.append(state_bytes(trainer.model, trainer.run.optimizer))
            return {"history": history, "taken": taken, "step": trainer.step}

        return await own_loop(trainer, loop)

    options = TrainerOptions(bucket_bytes=bucket_bytes)
    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(
            world_size, make_replica, dummy_loss, body, options=options
        )

    reference = mlp(0)
    ref_optimizer = OPTIMIZERS[optimizer_name](reference.parameters())
    ref_history = []
    for inputs, targets in data:
        ref_optimizer.zero_grad()
        nn.functional.mse_loss(reference(inputs), targets).backward()
        ref_optimizer.step()
        ref_history.append({k: v.clone() for k, v in reference.state_dict().items()})

    for rank, result in enumerate(results):
        assert result["taken"] == [True] * STEPS and result["step"] == STEPS
        for step, (mine, first) in enumerate(zip(result["history"], results[0]["history"])):
            assert mine.keys() == first.keys()
            for name, value in mine.items():  # C-DDP-001: bitwise, after every step
                assert value == first[name], f"rank {rank} step {step}: {name} differs"
    # Rank 0's final weights are one process's on the whole batch (closeness: summation order).
    final = results[0]["history"][-1]
    for name, value in ref_history[-1].items():
        ours = torch.frombuffer(bytearray(final[f"param/{name}"]), dtype=value.dtype)
        torch.testing.assert_close(ours.reshape(value.shape), value, rtol=1e-5, atol=1e-6)


async def test_no_sync_accumulation_matches_one_step_on_the_whole_batch() -> None:
    """Two micro-batches per step, the first under ``no_sync()``: the gradient of their mean
    loss, averaged over 2 workers, is the 4-way mean: one process's step on all of it."""
    world_size, micro = 2, 2
    data = batches(world_size, steps=3)

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(rank)
        return model, OPTIMIZERS["adam"](model.parameters())

    async def body(trainer: DistributedTrainer) -> dict[str, bytes]:
        rank = trainer.run.rank

        def loop(model: DistributedDataParallel, optimizer: DistributedOptimizer) -> Any:
            for batch in data:
                inputs, targets = shard(batch, rank)
                optimizer.zero_grad()
                parts = list(zip(inputs.chunk(micro), targets.chunk(micro)))
                with model.no_sync():
                    for x, y in parts[:-1]:
                        (nn.functional.mse_loss(model(x), y) / micro).backward()
                x, y = parts[-1]
                (nn.functional.mse_loss(model(x), y) / micro).backward()
                assert optimizer.step()
            model.verified()
            return state_bytes(trainer.model, trainer.run.optimizer)

        return await own_loop(trainer, loop)

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(world_size, make_replica, dummy_loss, body)
    assert results[0] == results[1]
    reference = mlp(0)
    ref_optimizer = OPTIMIZERS["adam"](reference.parameters())
    for inputs, targets in data:
        ref_optimizer.zero_grad()
        nn.functional.mse_loss(reference(inputs), targets).backward()
        ref_optimizer.step()
    for name, value in reference.named_parameters():
        ours = torch.frombuffer(bytearray(results[0][f"param/{name}"]), dtype=value.dtype)
        torch.testing.assert_close(ours.reshape(value.shape), value.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("buffer_sync", ["broadcast", "average", "local"])
async def test_the_users_loop_takes_train_batchs_very_steps_buffers_included(
    buffer_sync: str,
) -> None:
    """A BatchNorm model (running statistics updated by the user's own forward): the own loop
    ends bitwise where `train_batch` (checked against torch DDP in tests/test_buffers.py) ends,
    parameters, buffers and optimizer state, on every rank."""
    world_size = 2
    data = bn_batches(world_size)

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = bn_model(100 + rank)
        return model, bn_optimizer(model)

    def final(trainer: DistributedTrainer) -> dict[str, bytes]:
        out = state_bytes(trainer.model, trainer.run.optimizer)
        out.update({f"buffer/{k}": raw(v) for k, v in trainer.model.named_buffers()})
        return out

    async def by_train_batch(trainer: DistributedTrainer) -> dict[str, bytes]:
        for batch in data:
            await trainer.train_batch(bn_shard(batch, trainer.run.rank))
        await trainer.verified()
        return final(trainer)

    async def by_own_loop(trainer: DistributedTrainer) -> dict[str, bytes]:
        def loop(model: DistributedDataParallel, optimizer: DistributedOptimizer) -> None:
            for batch in data:
                optimizer.zero_grad()
                mse(model, bn_shard(batch, trainer.run.rank)).backward()
                assert optimizer.step()
            model.verified()

        await own_loop(trainer, loop)
        return final(trainer)

    options = TrainerOptions(buffer_sync=buffer_sync)  # type: ignore[arg-type]
    with trio.fail_after(RUN_SECONDS):
        ours = await train_in_process(world_size, make_replica, mse, by_own_loop, options=options)
        theirs = await train_in_process(
            world_size, make_replica, mse, by_train_batch, options=options
        )
    for rank in range(world_size):
        assert ours[rank].keys() == theirs[rank].keys()
        for name, value in ours[rank].items():
            assert value == theirs[rank][name], f"{buffer_sync} rank {rank}: {name} differs"


# --------------------------------------------------------------------------- overlap


async def test_a_bucket_is_all_reduced_while_the_users_backward_still_runs() -> None:
    """One bucket per parameter. The hook on the input's gradient runs inside backward, after
    the last layers' gradients were accumulated and before backward returns; it waits there
    until the step has finished reducing a bucket. Without the overlap (buckets handed over
    only when backward returned, or in step()) the wait would time out."""
    world_size = 2
    data = batches(world_size, steps=3)

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(rank)
        return model, OPTIMIZERS["sgd-momentum"](model.parameters())

    async def body(trainer: DistributedTrainer) -> list[int]:
        rank = trainer.run.rank

        def loop(model: DistributedDataParallel, optimizer: DistributedOptimizer) -> list[int]:
            seen = []
            for batch in data:
                inputs, targets = shard(batch, rank)
                inputs = inputs.clone().requires_grad_(True)
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(inputs), targets)
                own = model._steps.own
                assert own is not None

                def during_backward(grad: torch.Tensor, own: Any = own) -> None:
                    deadline = time.monotonic() + 20.0
                    while own.state.reduced == 0 and time.monotonic() < deadline:
                        time.sleep(0.002)  # wait for the trio thread's all-reduce
                    seen.append(own.state.reduced)

                inputs.register_hook(during_backward)
                loss.backward()
                assert optimizer.step()
            return seen

        return await own_loop(trainer, loop)

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(
            world_size, make_replica, dummy_loss, body, options=TrainerOptions(bucket_bytes=1)
        )
    buckets = 6  # 3 Linear layers: a weight and a bias each
    for rank, seen in enumerate(results):
        assert len(seen) == 3
        # Reduced during backward, but not all: the first layer's weight was still to come.
        assert all(0 < count < buckets for count in seen), f"rank {rank}: {seen}"


async def test_a_step_crosses_into_the_trio_thread_once_after_the_first() -> None:
    """optimizer.step() begins the next step in the event loop while it is there anyway, so
    the next forward starts it without a crossing of its own: after the first step, two
    crossings a step, the end of backward (its all-reduce awaited, torch DDP's finalization)
    and step(). A step the trainer may not run (max_steps reached) is not handed out: the
    forward crosses and fails as before."""
    world_size = 2
    steps = 4
    data = batches(world_size, steps=steps)

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(rank)
        return model, OPTIMIZERS["adam"](model.parameters())

    async def body(trainer: DistributedTrainer) -> list[int]:
        rank = trainer.run.rank

        def loop(model: DistributedDataParallel, optimizer: DistributedOptimizer) -> list[int]:
            cross = model._link.cross
            assert cross is not None
            calls: list[str] = []

            def counted(fn: Callable[..., Any], *args: Any) -> Any:
                called = args[0] if fn == trainer.own_loop.caller_crossing else fn  # what it runs
                calls.append(getattr(called, "func", called).__name__)
                return cross(fn, *args)

            model._link.cross = counted
            crossings = []
            for batch in data:
                inputs, targets = shard(batch, rank)
                before = len(calls)
                optimizer.zero_grad()
                nn.functional.mse_loss(model(inputs), targets).backward()
                assert optimizer.step()
                crossings.append(len(calls) - before)
            assert calls[0] == "begin_own_step" and calls.count("begin_own_step") == 1
            with pytest.raises(RuntimeError, match="max_steps=4 already reached"):
                model(data[0][0][:PER_RANK])
            return crossings

        return await own_loop(trainer, loop)

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(
            world_size,
            make_replica,
            dummy_loss,
            body,
            options=TrainerOptions(max_steps=steps),
        )
    for crossings in results:
        assert crossings == [3, 2, 2, 2]


# --------------------------------------------------------------------------- C-DDP-001


async def test_the_identical_weights_check_catches_a_rank_that_diverges() -> None:
    """Rank 1 nudges a weight of its own between steps (a bug in a user's loop: an in-place
    edit on one rank only): the next digest differs and the coordinator stops the run, which
    surfaces in the loops as RunAborted naming the tensor."""
    world_size = 2
    data = batches(world_size, steps=8)

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(rank)
        return model, OPTIMIZERS["sgd-momentum"](model.parameters())

    async def body(trainer: DistributedTrainer) -> None:
        rank = trainer.run.rank

        def loop(model: DistributedDataParallel, optimizer: DistributedOptimizer) -> None:
            for step, batch in enumerate(data):
                inputs, targets = shard(batch, rank)
                optimizer.zero_grad()
                nn.functional.mse_loss(model(inputs), targets).backward()
                optimizer.step()
                model.verified()
                if rank == 1 and step == 2:
                    with torch.no_grad():
                        model.module[2].bias.add_(1e-3)

        await own_loop(trainer, loop)

    with trio.fail_after(RUN_SECONDS):
        try:
            await train_in_process(world_size, make_replica, dummy_loss, body)
        except BaseException as exc:
            aborted = [leaf for leaf in leaves(exc) if isinstance(leaf, RunAborted)]
        else:
            pytest.fail("the run did not stop")
    assert aborted, "expected the coordinator to abort the run"
    assert "2.bias" in str(aborted[0]), str(aborted[0])


# --------------------------------------------------------------------------- unused parameters


class WithSpare(nn.Module):
    """An MLP and a ``spare`` layer no forward uses."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = mlp(seed)
        self.spare = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("find_unused", [True, False])
async def test_unused_parameters_as_torch_ddp(find_unused: bool) -> None:
    """With ``find_unused_parameters`` a parameter no rank used gets no gradient and never
    changes, and the replicas stay identical; without it, ``step()`` fails naming it."""
    world_size = 2
    data = batches(world_size, steps=3)

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = WithSpare(rank)
        return model, OPTIMIZERS["sgd-momentum"](model.parameters())

    async def body(trainer: DistributedTrainer) -> dict[str, bytes]:
        rank = trainer.run.rank
        spare = raw(trainer.model.spare.weight)

        def loop(model: DistributedDataParallel, optimizer: DistributedOptimizer) -> Any:
            for batch in data:
                inputs, targets = shard(batch, rank)
                optimizer.zero_grad()
                nn.functional.mse_loss(model(inputs), targets).backward()
                assert optimizer.step()
            model.verified()
            assert sorted(trainer.unused_parameters) == ["spare.bias", "spare.weight"]
            assert raw(trainer.model.spare.weight) == spare  # as broadcast, never stepped
            return state_bytes(trainer.model, trainer.run.optimizer)

        return await own_loop(trainer, loop)

    options = TrainerOptions(find_unused_parameters=find_unused)
    with trio.fail_after(RUN_SECONDS):
        if find_unused:
            results = await train_in_process(
                world_size, make_replica, dummy_loss, body, options=options
            )
            assert results[0] == results[1]
            return
        try:
            await train_in_process(world_size, make_replica, dummy_loss, body, options=options)
        except BaseException as exc:
            messages = [str(leaf) for leaf in leaves(exc)]
        else:
            pytest.fail("a step with unused parameters went through")
    assert any("spare.weight" in m and "find_unused_parameters" in m for m in messages), messages


# --------------------------------------------------------------------------- misuse


async def test_misuse_fails_saying_what_to_do() -> None:
    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(rank)
        return model, OPTIMIZERS["sgd-momentum"](model.parameters())

    async def body(trainer: DistributedTrainer) -> list[str]:
        def loop(model: DistributedDataParallel, optimizer: DistributedOptimizer) -> list[str]:
            errors = []
            x, y = torch.randn(4, 5), torch.randn(4, 3)
            with pytest.raises(RuntimeError, match="before any forward") as info:
                optimizer.step()
            errors.append(str(info.value))
            with pytest.raises(TypeError, match="closures"):
                optimizer.step(lambda: 0.0)
            with model.no_sync():
                nn.functional.mse_loss(model(x), y).backward()
            with pytest.raises(RuntimeError, match="all under no_sync"):
                optimizer.step()
            # The step is still open: finish it properly.
            nn.functional.mse_loss(model(x), y).backward()
            with pytest.raises(RuntimeError, match="after the step's synchronizing one"):
                model(x)
            assert optimizer.step()
            with torch.no_grad():  # evaluation: no step begins
                model(x)
            assert model._steps.own is None
            nn.functional.mse_loss(model(x), y).backward()
            assert optimizer.step()
            model.verified()
            return errors

        return await own_loop(trainer, loop)

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(1, make_replica, dummy_loss, body)
    assert results[0]


def test_options_a_users_loop_owns_are_refused() -> None:
    """train_batch's options are refused before anything joins; torch DDP's arguments map to
    the trainer's options (tests/test_ddp_contract.py checks each against torch DDP)."""
    model = mlp(0)
    with pytest.raises(ValueError, match="no_sync"):
        DistributedDataParallel(model, options=TrainerOptions(accumulation_steps=2))
    with pytest.raises(ValueError, match="join"):
        DistributedDataParallel(model, options=TrainerOptions(join=True))
    ddp_style = torch_ddp_options(
        TrainerOptions(), find_unused_parameters=True, broadcast_buffers=False, bucket_cap_mb=0.5
    )
    assert ddp_style.find_unused_parameters
    assert ddp_style.buffer_sync == "local"
    assert ddp_style.bucket_bytes == 512 * 1024
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DistributedDataParallel(model, bucket_cap_mb=0)
    assert not math.isnan(float(model(torch.randn(1, 5)).sum().detach()))


def test_torch_comm_hooks_map_to_paramsyncs_reducers_and_others_are_refused() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    assert torch_comm_hook(None, default_hooks.allreduce_hook) == ("none", 1, 2)
    assert torch_comm_hook(None, default_hooks.fp16_compress_hook) == ("fp16", 1, 2)
    assert torch_comm_hook(None, default_hooks.bf16_compress_hook) == ("bf16", 1, 2)
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=3, start_powerSGD_iter=7)
    assert torch_comm_hook(state, powerSGD_hook.powerSGD_hook) == ("powersgd", 3, 7)

    def my_hook(state: object, bucket: object) -> object:
        raise AssertionError("never called")

    with pytest.raises(ValueError, match="my_hook is not supported"):
        torch_comm_hook(None, my_hook)
    with pytest.raises(ValueError, match="batched_powerSGD_hook is not supported"):
        torch_comm_hook(state, powerSGD_hook.batched_powerSGD_hook)
    no_feedback = powerSGD_hook.PowerSGDState(None, use_error_feedback=False)
    with pytest.raises(ValueError, match="use_error_feedback=False is not supported"):
        torch_comm_hook(no_feedback, powerSGD_hook.powerSGD_hook)
    with pytest.raises(ValueError, match="needs a PowerSGDState"):
        torch_comm_hook(None, powerSGD_hook.powerSGD_hook)


@pytest.mark.parametrize(
    ("argument", "value", "named"),
    [
        ("mixed_precision", object(), "mixed_precision is not supported"),
        ("device_mesh", object(), "device_mesh is not supported"),
        ("delay_all_reduce_named_params", [], "delay_all_reduce_named_params is not supported"),
        ("param_to_hook_all_reduce", object(), "param_to_hook_all_reduce is not supported"),
        ("bucket_cap_mb_list", [1], "bucket_cap_mb_list is not supported"),
        ("skip_all_reduce_unused_params", True, "skip_all_reduce_unused_params=True"),
        ("process_group", object(), "process_group must be None"),
    ],
)
def test_torch_ddp_arguments_that_cannot_apply_are_refused_naming_them(
    argument: str, value: object, named: str
) -> None:
    """Before anything joins: one line naming the argument and why."""
    with pytest.raises(ValueError, match=named):
        DistributedDataParallel(mlp(0), **{argument: value})


def test_device_ids_follow_torch_ddps_rules() -> None:
    from paramsync.actors.train.ddp_arguments import device_args

    cpu_model = mlp(0)
    assert device_args(cpu_model, None, None).input_device is None
    with pytest.raises(ValueError, match=r"device_ids=\[0\] only applies to a module on one"):
        device_args(cpu_model, [0], None)
    with pytest.raises(ValueError, match="output_device=0 needs a module on one accelerator"):
        device_args(cpu_model, None, 0)
    ddp_style = torch_ddp_options(TrainerOptions(), static_graph=True, forward_sync_buffers=True)
    assert ddp_style.find_unused_parameters and ddp_style.buffer_sync == "broadcast"
    with pytest.raises(ValueError, match="disagree"):
        torch_ddp_options(TrainerOptions(), broadcast_buffers=True, forward_sync_buffers=False)
    with pytest.raises(ValueError, match=r"already wrapped by torch\.nn\.parallel"):
        DistributedDataParallel(
            torch.nn.parallel.DistributedDataParallel.__new__(
                torch.nn.parallel.DistributedDataParallel
            )
        )
