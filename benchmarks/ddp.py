"""Training benchmark: paramsync against torch DistributedDataParallel, same run.

Both systems train the same model (the built-in `CharTransformer`: d_model 128, 2 layers,
4 heads, context 64, tied embeddings) from the same initial weights on the same data (the
stdlib character corpus, each rank its `shard`), with the same per-worker batch (16), the same
optimizer (AdamW, lr 3e-3) and the same world size, one OS process per worker, on the CPU
(``--device cuda``: on the GPUs, ``rank % device_count`` each, so that 2 workers share one GPU),
one intra-op thread per worker (OMP_NUM_THREADS=1 and torch.set_num_threads(1)).

- paramsync: a separate coordinator process (``python -m paramsync.runtime.cli.main coordinator``)
  and N worker processes that join it through `paramsync.actors.train.worker.join_run` and call
  `DistributedTrainer.train_batch` once per step (the identical-weights digest check included, every
  ``--digest-interval`` steps, 1 by default);
- DDP: N processes in a gloo process group (``--ddp-backend nccl``: NCCL, with ``--device cuda``;
  NCCL takes one rank per GPU, so N GPUs for N ranks), the model wrapped in
  ``torch.nn.parallel.DistributedDataParallel``;
- with ``--plain``, a plain torch loop: N processes each training the same model with the same
  loop, with no process group and no DDP at all (``--worlds 1 --plain``: the fixed cost a step of
  DDP and of paramsync over a plain loop, with one worker; rank 0's CPU time a step for each);
- the limit: N processes training their replicas with no communication at all (a barrier before
  the first step and after the last only): what the machine allows, so that both systems'
  overhead over the physical limit is printed, paired round by round;
- paramsync over torch.distributed (``data_plane = "torch"``,
  `paramsync.runtime.transport.torch_plane`): the same paramsync workers and coordinator, the
  buckets reduced by a gloo group instead of paramsync's own TCP ring and shared-memory plane; its
  step time against DDP's and plain paramsync's, round by round (``--no-torch-plane`` leaves it
  out);
- with ``--own-loop``, paramsync's DDP-shaped entry (`paramsync.actors.DistributedDataParallel`: the
  user's own ``loss.backward(); optimizer.step()`` loop in the main thread, the trainer's trio
  loop in a background thread, as a torchrun script runs it), against ``train_batch`` round by
  round;
- with ``--torchft``, torchft (the ``bench`` extra; `benchmarks/torchft_peer.py`): one replica
  group per worker process, each with its `torchft.Manager` on a ``ProcessGroupGloo``, the model
  in ``torchft.DistributedDataParallel`` and the optimizer in ``torchft.Optimizer``, a
  lighthouse (``torchft_lighthouse``) started for the run with ``min_replicas`` the world size;
  the same loop as DDP's (``zero_grad`` starts the step's quorum, ``step`` commits it), and the
  ratio paramsync / torchft round by round;
- with ``--baseline PATH``, the paramsync systems again with the code of another checkout at
  PATH (its ``runtime`` and ``actors`` on PYTHONPATH, this script's workers), in the same
  rounds: an A/B of two versions, paired round by round.

``--model mlp`` is a tiny model (an embedding and a two-layer MLP per position, ~20 k
parameters) whose step is a few milliseconds: what a step costs beyond forward and backward
weighs most there.

``--comm-hook fp16|bf16|powersgd`` compresses the gradients in both systems alike: DDP
registers torch's hook (``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``, or
``powerSGD_hook`` with a ``PowerSGDState`` of ``--powersgd-rank`` and
``--powersgd-start-iter``), paramsync workers get the ``comm_hook`` option with the same
settings; each system's bytes all-reduced per step (rank 0, timed steps) are counted by wrapping
the all-reduce its hook calls (DDP with no hook reduces in C++: its gradients' size is shown).

Per system and world size: ``--warmup`` untimed steps, then ``--steps`` timed ones. Rank 0
takes the time between the ends of consecutive steps; the table shows the median of those step
times (pooled over rounds), the overall steps/s of the timed steps (median over rounds; for
paramsync it includes waiting for the last step's digest check), the paramsync/DDP step-time
ratio, and rank 0's final loss for each, with the largest difference between the two loss
curves (both are exact data-parallel training from the same start, so they should agree up to
floating-point summation order). The systems alternate round by round so that drift in machine
load hits both alike.

    python benchmarks/ddp.py --json out/ddp.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
"""``--comm-hook`` choices (`paramsync.runtime.collectives.compression.COMM_HOOKS`; not imported
here: the driver imports no torch)."""
SYSTEMS = ("ddp", "paramsync", "limit")
LIMIT = "limit"
PLAIN = "plain"
"""A plain torch loop (``--plain``): the same processes, model, data and loop as DDP's, with no
process group and no DDP."""
DDP_BACKENDS = ("gloo", "nccl")
OWN_LOOP = "own-loop"
"""paramsync's DDP-shaped entry (``--own-loop``): `paramsync.actors.DistributedDataParallel` with
the user's loop in the main thread, the trainer in its background trio thread."""
BASELINE = "@baseline"
"""Suffix of a paramsync system run with ``--baseline``'s code (``paramsync@baseline``)."""
"""The physical limit: the same processes, model, data and steps, each rank training its own
replica with no communication at all during the steps (a gloo barrier before the first step
and after the last only, so that the ranks compete for the cores as the other systems' do)."""
UNCHECKED = "paramsync-unchecked"
"""paramsync with the weight check off (``--check-cost``): same workers, a coordinator that
checks digests only every 1000000 steps."""
VARIANT = "paramsync-variant"
"""paramsync with the ``--variant`` trainer options on top of ``--option`` (an A/B of an option
in the same rounds, paired with the plain paramsync run of each round)."""
TORCHFT = "torchft"
"""torchft's Manager, DistributedDataParallel and Optimizer on ProcessGroupGloo (``--torchft``)."""
TORCH = "paramsync-torch"
"""paramsync with ``data_plane = "torch"``: its data plane a torch.distributed gloo group."""
SPLIT = "paramsync-split"
"""paramsync checking every ``--check-split`` steps (``K``): the check's cost measured within
one run, each checked step against its unchecked neighbours (`_split_check_cost`)."""
LABELS = {
    "ddp": "DDP",
    PLAIN: "plain torch loop",
    "paramsync": "paramsync",
    LIMIT: "no communication (limit)",
    UNCHECKED: "paramsync, check off",
    VARIANT: "paramsync, variant",
    SPLIT: "paramsync, check every K steps",
    OWN_LOOP: "paramsync, own loop (DDP-shaped)",
    "paramsync" + BASELINE: "paramsync, baseline code",
    OWN_LOOP + BASELINE: "paramsync, own loop, baseline code",
    TORCH: "paramsync over torch.distributed",
    TORCHFT: "torchft (gloo)",
}
LAUNCH_SECONDS = 600.0
POLL_SECONDS = 0.05
"""How often the driver checks its processes (and samples the coordinator's CPU time)."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------- workers


def _conv_batchnorm_model(vocab_size: int, d_model: int, layers: int, seed: int):
    """``--model batchnorm``: a character model whose buffers matter (BatchNorm's running
    statistics, per rank during training): embedding, then per layer a width-3 convolution,
    BatchNorm1d and ReLU, then a linear head; logits for every position, as CharTransformer's."""
    import torch
    from torch import nn

    class CharConvBatchNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            generator_state = torch.random.get_rng_state()
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab_size, d_model)
            self.blocks = nn.ModuleList(
                nn.Sequential(
                    nn.Conv1d(d_model, d_model, 3, padding=1),
                    nn.BatchNorm1d(d_model),
                    nn.ReLU(),
                )
                for _ in range(layers)
            )
            self.head = nn.Linear(d_model, vocab_size)
            torch.random.set_rng_state(generator_state)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.embed(idx).transpose(1, 2)  # [batch, channels, positions]
            for block in self.blocks:
                x = x + block(x)
            return self.head(x.transpose(1, 2))

        def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            logits = self(idx)
            return nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
            )

        def num_parameters(self) -> int:
            return sum(p.numel() for p in self.parameters())

    return CharConvBatchNorm()


def _mlp_model(vocab_size: int, d_model: int, seed: int):
    """``--model mlp``: a tiny character model (embedding, then a two-layer MLP per position),
    whose step is short enough that a step's fixed costs show."""
    import torch
    from torch import nn

    class CharMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            generator_state = torch.random.get_rng_state()
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab_size, d_model)
            self.hidden = nn.Linear(d_model, 2 * d_model)
            self.head = nn.Linear(2 * d_model, vocab_size)
            torch.random.set_rng_state(generator_state)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.hidden(self.embed(idx))))

        def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            logits = self(idx)
            return nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
            )

        def num_parameters(self) -> int:
            return sum(p.numel() for p in self.parameters())

    return CharMLP()


def _setup(args: argparse.Namespace):
    """The model, optimizer, dataset and this rank's shard: identical for both systems."""
    import torch

    from paramsync.actors.demo_job.corpus import load_char_dataset
    from paramsync.actors.demo_job.model import CharTransformer
    from paramsync.actors.graph.sampler import shard

    torch.set_num_threads(1)
    device = _device(args)
    torch.manual_seed(args.seed)
    vocab, dataset = load_char_dataset(args.context, max_bytes=args.corpus_bytes)
    if args.model == "batchnorm":
        model = _conv_batchnorm_model(len(vocab), args.d_model, args.layers, args.seed)
    elif args.model == "mlp":
        model = _mlp_model(len(vocab), args.d_model, args.seed)
    else:
        model = CharTransformer(
            len(vocab), args.d_model, args.heads, args.layers, args.context, seed=args.seed
        )
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    indices = shard(len(dataset), args.rank, args.world, args.seed)
    per_epoch = len(indices) // args.batch_size
    if per_epoch == 0:
        raise SystemExit(f"rank {args.rank}: the shard holds no full batch of {args.batch_size}")

    def batch(step: int):
        # Epoch after epoch through this rank's shard, like DataLoaderActor.
        epoch, index = divmod(step, per_epoch)
        order = (
            indices if epoch == 0 else shard(len(dataset), args.rank, args.world, args.seed, epoch)
        )
        start = index * args.batch_size
        inputs, targets = dataset.batch(order[start : start + args.batch_size])
        return inputs.to(device), targets.to(device)

    info = {"vocab_size": len(vocab), "parameters": model.num_parameters()}
    return model, optimizer, batch, info


def _device(args: argparse.Namespace):
    """This rank's device (``--device``): the CPU, or GPU ``rank % device_count`` (so that
    several ranks share one GPU when there are fewer GPUs than ranks)."""
    import torch

    if args.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    device = torch.device("cuda", args.rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _result(
    ends: list[float],
    losses: list[float],
    warmup: int,
    overall: float,
    info: dict,
    cpu: tuple[float, float],
) -> dict:
    step_seconds = [b - a for a, b in zip(ends[warmup - 1 :], ends[warmup:])]
    timed = len(ends) - warmup
    return {
        "step_seconds": step_seconds,
        "steps_per_second": timed / overall,
        "losses": losses,
        # This process's CPU time (all its threads) over the timed steps, and the window's
        # monotonic start and end, so the driver can charge the coordinator's CPU to it.
        "cpu_seconds_per_step": (cpu[1] - cpu[0]) / timed,
        "window": [ends[warmup - 1], ends[warmup - 1] + overall],
        **info,
    }


_KEEP_ALIVE: list[object] = []
"""torch objects a DDP rank must not destroy before it exits (see `_run_worker`)."""


def _worker_ddp(args: argparse.Namespace, *, communicate: bool = True, group: bool = True) -> dict:
    """One rank of torch DDP (on ``--ddp-backend``); with ``communicate=False``, of the limit:
    the same process and loop training its own replica, nothing crossing between ranks but a
    gloo barrier before the first step and one after the last (so the ranks compete for the
    cores as DDP's do); with ``group=False`` too, of the plain loop: no process group at all."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model, optimizer, batch, info = _setup(args)
    if not group:
        return _plain_loop(args, model, optimizer, batch, info)
    backend = args.ddp_backend if communicate else "gloo"
    if backend == "nccl" and args.world > torch.cuda.device_count():
        raise SystemExit(
            f"--ddp-backend nccl: NCCL refuses two ranks on one device; {args.world} ranks need "
            f"{args.world} GPUs, this machine has {torch.cuda.device_count()}"
        )
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
    )
    try:
        if communicate:
            forward = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
            _KEEP_ALIVE.append(forward)  # until os._exit: see _run_worker
            counter = _register_ddp_hook(forward, args)
        else:
            forward, counter = model, [0]
            dist.barrier()  # start together; nothing crosses between ranks until the end
        ends: list[float] = []
        losses: list[float] = []
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                counter[0] = 0
            inputs, targets = batch(step)
            optimizer.zero_grad()
            logits = forward(inputs)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
            )
            loss.backward()  # DDP all-reduces the gradient buckets during backward
            if args.clip_grad_norm is not None:  # the averaged gradients, every rank alike
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            optimizer.step()
            losses.append(float(loss.detach()))
            ends.append(time.perf_counter())
            if step == args.warmup - 1:
                cpu_start = time.process_time()
        overall = ends[-1] - ends[args.warmup - 1]
        cpu = (cpu_start, time.process_time())
        dist.barrier()
    finally:
        dist.destroy_process_group()
    result = _result(ends, losses, args.warmup, overall, info, cpu)
    result["ddp_backend"] = backend
    if not communicate:
        result["allreduce_bytes_per_step"] = 0
    elif args.comm_hook == "none":  # the C++ reducer all-reduces every gradient in float32
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        result["allreduce_bytes_per_step"] = grads
    else:
        result["allreduce_bytes_per_step"] = counter[0] / args.steps
    return result


def _plain_loop(args: argparse.Namespace, model, optimizer, batch, info: dict) -> dict:
    """The plain loop's rank: DDP's loop over the bare model, no process group."""
    import torch

    ends: list[float] = []
    losses: list[float] = []
    for step in range(args.warmup + args.steps):
        inputs, targets = batch(step)
        optimizer.zero_grad()
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )
        loss.backward()
        if args.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        optimizer.step()
        losses.append(float(loss.detach()))  # reads the loss: the step's kernels are done
        ends.append(time.perf_counter())
        if step == args.warmup - 1:
            cpu_start = time.process_time()
    overall = ends[-1] - ends[args.warmup - 1]
    result = _result(ends, losses, args.warmup, overall, info, (cpu_start, time.process_time()))
    result["allreduce_bytes_per_step"] = 0
    return result


def _worker_torchft(args: argparse.Namespace) -> dict:
    """One replica group of torchft (one process): DDP's loop with torchft's wrappers, as its
    ``train_ddp.py`` runs on the CPU. ``zero_grad`` starts the step's quorum (asynchronous,
    overlapping the forward), the gradients are averaged through the Manager's all-reduce in
    DDP's comm hook, and ``step`` steps the optimizer only if the quorum's ``should_commit``
    agrees. Every replica must commit every step: a step that is not committed stops the run."""
    import torch
    import torchft_peer

    if args.comm_hook != "none":
        raise SystemExit("--torchft runs with --comm-hook none only")
    model, optimizer, batch, info = _setup(args)
    manager, forward, wrapped, store = torchft_peer.make_manager(
        model, optimizer, replica=args.rank, lighthouse=args.lighthouse, min_replica_size=args.world
    )
    _KEEP_ALIVE.extend((forward, store))  # until os._exit: see _run_worker
    ends: list[float] = []
    losses: list[float] = []
    for step in range(args.warmup + args.steps):
        inputs, targets = batch(step)
        wrapped.zero_grad()
        logits = forward(inputs)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )
        loss.backward()  # the comm hook all-reduces each bucket through the Manager
        if args.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        wrapped.step()  # should_commit, then the optimizer step
        if manager.current_step() != step + 1:
            raise SystemExit(
                f"torchft replica {args.rank}: step {step} was not committed "
                f"(manager at step {manager.current_step()}, errored: {manager.errored()})"
            )
        losses.append(float(loss.detach()))
        ends.append(time.perf_counter())
        if step == args.warmup - 1:
            cpu_start = time.process_time()
    overall = ends[-1] - ends[args.warmup - 1]
    cpu = (cpu_start, time.process_time())
    result = _result(ends, losses, args.warmup, overall, info, cpu)
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    result["allreduce_bytes_per_step"] = grads
    manager.shutdown(wait=False)
    return result


def _register_ddp_hook(ddp, args: argparse.Namespace) -> list[int]:
    """Register torch's hook for ``--comm-hook`` on ``ddp``; returns a counter of the bytes the
    hook all-reduces (``torch.distributed.all_reduce`` wrapped: the hooks call it)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    counter = [0]
    if args.comm_hook == "none":
        return counter
    original = dist.all_reduce

    def counting_all_reduce(tensor, *rest, **kwargs):
        counter[0] += tensor.numel() * tensor.element_size()
        return original(tensor, *rest, **kwargs)

    dist.all_reduce = counting_all_reduce
    if args.comm_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.comm_hook == "bf16":
        # torch refuses its bf16 hook by name unless NCCL runs it; gloo sums bfloat16 on CPU.
        def cpu_bf16_compress_hook(state, bucket):
            return default_hooks.bf16_compress_hook(state, bucket)

        ddp.register_comm_hook(None, cpu_bf16_compress_hook)
    else:
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=args.powersgd_start_iter,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return counter


def _worker_paramsync(args: argparse.Namespace) -> dict:
    import trio

    from paramsync.actors.train.worker import join_run
    from paramsync.runtime.config import DistributedConfig
    from paramsync.runtime.observe.trace import TraceRecorder

    model, optimizer, batch, info = _setup(args)

    def loss_fn(model, micro_batch):
        inputs, targets = micro_batch
        return model.loss(inputs, targets)

    async def main() -> dict:
        config = DistributedConfig(args.world, args.rank, f"127.0.0.1:{args.port}")
        options = _paramsync_options(args)
        counter = _count_paramsync_all_reduce()
        ends: list[float] = []
        losses: list[float] = []
        numbers: list[int] = []
        trace = (
            TraceRecorder(f"rank {args.rank}", pid=args.rank)
            if args.trace or args.record_phases
            else TraceRecorder.disabled()
        )
        async with join_run(
            model, optimizer, loss_fn, config, options=options, trace=trace
        ) as trainer:
            for step in range(args.warmup + args.steps):
                numbers.append(trainer.step)  # the trainer's number for the step run next
                losses.append(await trainer.train_batch(batch(step)))
                ends.append(time.perf_counter())
                if step == args.warmup - 1:
                    counter[0] = 0
                    cpu_start = time.process_time()
                    check_start = _run_of(trainer).check_cost.hash_cpu_seconds
                    loop_start = (time.thread_time(), task_steps.count)
            # train_batch returns before its step's digest check ends (it overlaps the next
            # step); count the last one's wait in the overall time.
            await trainer.verified()
            overall = time.perf_counter() - ends[args.warmup - 1]
            cpu = (cpu_start, time.process_time())
            check = _run_of(trainer).check_cost.hash_cpu_seconds - check_start
            loop_cpu = time.thread_time() - loop_start[0]  # this task runs on the loop's thread
            loop_steps = task_steps.count - loop_start[1]
        if args.trace:
            trace.write(Path(args.trace) / f"paramsync-n{args.world}-rank{args.rank}.json")
        result = _result(ends, losses, args.warmup, overall, info, cpu)
        result["step_numbers"] = numbers[args.warmup :]  # each of step_seconds' steps
        result["allreduce_bytes_per_step"] = counter[0] / args.steps
        if args.record_phases:
            result["phase_seconds"] = _phase_seconds(trace.events(), result["step_numbers"])
        # The CPU time this worker spent hashing its state for the check (its own accounting).
        result["hash_cpu_seconds_per_step"] = check / args.steps
        # The event loop's own thread (actors, messages, the shared-memory plane's copies and
        # signals; not the compute thread): its CPU time and trio task steps a step.
        result["event_loop_cpu_seconds_per_step"] = loop_cpu / args.steps
        result["task_steps_per_step"] = loop_steps / args.steps
        return result

    class TaskSteps(trio.abc.Instrument):
        def __init__(self) -> None:
            self.count = 0

        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            self.count += 1

    task_steps = TaskSteps()
    return trio.run(main, instruments=[task_steps])


def _run_of(trainer):
    """What the trainer's parts share (its ``TrainingRun``); a ``--baseline`` checkout from
    before the trainer had one holds the same fields itself."""
    return getattr(trainer, "run", trainer)


def _paramsync_options(args: argparse.Namespace, *, clip: bool = True):
    """The paramsync workers' `TrainerOptions`: ``--option``'s fields, the comm hook's and
    (``clip``: the trainer clips, as `train_batch` does) ``--clip-grad-norm``."""
    from paramsync.actors.train.trainer import TrainerOptions

    overrides = _trainer_options(args.option)
    if clip and args.clip_grad_norm is not None:
        overrides.setdefault("clip_grad_norm", args.clip_grad_norm)
    if args.bucket_bytes is not None:
        overrides["bucket_bytes"] = args.bucket_bytes
    overrides.setdefault("comm_hook", args.comm_hook)
    overrides.setdefault("powersgd_rank", args.powersgd_rank)
    overrides.setdefault("powersgd_start_iter", args.powersgd_start_iter)
    return TrainerOptions(**overrides)


def _worker_own_loop(args: argparse.Namespace) -> dict:
    """One rank of paramsync's DDP-shaped entry: the loop `_worker_ddp` runs, with
    `paramsync.actors.DistributedDataParallel` in place of torch's and nothing else changed (the
    optimizer stepped unwrapped, ``--clip-grad-norm`` clipping between backward and step); it
    joins the run from the environment, as a torchrun or ``paramsync launch`` script does."""
    import torch

    from paramsync.actors import DistributedDataParallel

    model, optimizer, batch, info = _setup(args)
    os.environ.update(
        RANK=str(args.rank),
        WORLD_SIZE=str(args.world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(args.port),
        PARAMSYNC_ROLE="worker",
    )
    counter = _count_paramsync_all_reduce()
    options = _paramsync_options(args, clip=False)  # the loop clips, as DDP's does
    with DistributedDataParallel(model, options=options) as forward:
        ends: list[float] = []
        losses: list[float] = []
        for step in range(args.warmup + args.steps):
            inputs, targets = batch(step)
            optimizer.zero_grad()
            logits = forward(inputs)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
            )
            loss.backward()  # returns with every bucket averaged, as DDP's does
            if args.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            optimizer.step()  # its step hooks report the state digest
            losses.append(float(loss.detach()))
            ends.append(time.perf_counter())
            if step == args.warmup - 1:
                counter[0] = 0
                cpu_start = time.process_time()
        forward.verified()  # the last step's check, as the paramsync worker waits for it
        overall = time.perf_counter() - ends[args.warmup - 1]
        cpu = (cpu_start, time.process_time())
    result = _result(ends, losses, args.warmup, overall, info, cpu)
    result["allreduce_bytes_per_step"] = counter[0] / args.steps
    return result


def _count_paramsync_all_reduce() -> list[int]:
    """A counter of the bytes the gradient-comm actor all-reduces (its module's ``all_reduce``
    wrapped: every bucket's reducer calls it, compressed or not)."""
    from paramsync.actors.graph import gradcomm

    counter = [0]
    original = gradcomm.all_reduce

    async def counting_all_reduce(transport, tensor, *rest, **kwargs):
        counter[0] += tensor.numel() * tensor.element_size()
        return await original(transport, tensor, *rest, **kwargs)

    gradcomm.all_reduce = counting_all_reduce
    return counter


PHASES = ("forward", "backward", "grad-wait", "optimizer")
"""The trainer's spans on a step's path (`--check-split` runs record them): the optimizer's
includes the hash of a checked step."""


def _phase_seconds(events: list[dict], steps: list[int]) -> dict[str, list[float]]:
    """Each of ``PHASES``' time in each of ``steps``, from a trace's complete events."""
    spent = {phase: dict.fromkeys(steps, 0.0) for phase in PHASES}
    for event in events:
        step = event.get("args", {}).get("step")
        if event.get("ph") == "X" and event["name"] in spent and step in spent[event["name"]]:
            spent[event["name"]][step] += event["dur"] / 1e6
    return {phase: [spent[phase][step] for step in steps] for phase in PHASES}


def _trainer_options(items: list[str]) -> dict:
    """``NAME=VALUE`` strings -> TrainerOptions fields (ints, floats, true/false)."""
    import dataclasses

    from paramsync.actors.train.trainer import TrainerOptions

    fields = {f.name for f in dataclasses.fields(TrainerOptions)}
    out: dict = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in fields:
            raise SystemExit(
                f"--option {item!r}: expected NAME=VALUE, NAME one of {sorted(fields)}"
            )
        if text.lower() in ("true", "false"):
            value: object = text.lower() == "true"
        else:
            try:
                value = int(text)
            except ValueError:
                try:
                    value = float(text)
                except ValueError:
                    value = text
        out[name] = value
    return out


def _run_worker(args: argparse.Namespace) -> None:
    worker = {
        "ddp": _worker_ddp,
        LIMIT: functools.partial(_worker_ddp, communicate=False),
        PLAIN: functools.partial(_worker_ddp, communicate=False, group=False),
        OWN_LOOP: _worker_own_loop,
        TORCHFT: _worker_torchft,
    }.get(args.worker, _worker_paramsync)
    result = worker(args)
    if args.rank == 0:
        print(json.dumps(result), flush=True)
    if args.worker in ("ddp", LIMIT, PLAIN, TORCHFT):
        # Never let torch tear the DDP rank's gloo group down: its destructor joins gloo's
        # worker thread while holding the GIL, and that thread can need the GIL to free its
        # last work (seen: a rank hung in ~ProcessGroupGloo after its result was out).
        sys.stdout.flush()
        os._exit(0)


# ----------------------------------------------------------------------------- driver


def _model_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for name in (
        "model",
        "steps",
        "warmup",
        "batch_size",
        "context",
        "d_model",
        "layers",
        "heads",
        "lr",
        "seed",
        "corpus_bytes",
        "device",
        "ddp_backend",
        "bucket_bytes",
        "bucket_cap_mb",
        "comm_hook",
        "powersgd_rank",
        "powersgd_start_iter",
        "clip_grad_norm",
    ):
        if getattr(args, name) is not None:
            flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    for item in args.option:
        flags += ["--option", item]
    if args.trace:
        flags += ["--trace", str(Path(args.trace).resolve())]
    return flags


def _cpu_seconds(pid: int) -> float | None:
    """A live process's CPU time so far (user + system, all threads), from /proc (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_all(
    procs: dict[str, subprocess.Popen],
    logs: dict[str, Path],
    what: str,
    sampled: subprocess.Popen | None = None,
    samples: list[tuple[float, float]] | None = None,
) -> None:
    """Wait for every process; on a failure or the deadline stop the rest and raise. Samples
    ``sampled``'s CPU time into ``samples`` as (monotonic time, CPU seconds) meanwhile."""
    deadline = time.monotonic() + LAUNCH_SECONDS
    pending = dict(procs)
    failure = None
    while pending and failure is None:
        if sampled is not None and samples is not None and sampled.poll() is None:
            cpu = _cpu_seconds(sampled.pid)
            if cpu is not None:
                samples.append((time.perf_counter(), cpu))
        for name, proc in list(pending.items()):
            code = proc.poll()
            if code is None:
                continue
            del pending[name]
            if code != 0:
                failure = f"{what}: {name} exited with code {code}"
                break
        if failure is None and time.monotonic() > deadline:
            failure = f"{what}: still running after {LAUNCH_SECONDS:.0f} s"
        # The same slow poll for every system: a 10 ms poll of the coordinator's CPU once
        # took 1 % of the machine's CPU from the paramsync runs alone (perf, 2 cores).
        time.sleep(POLL_SECONDS)
    if failure is None:
        return
    for proc in pending.values():
        proc.kill()
        proc.wait()
    tails = "\n".join(f"--- {name} stderr ---\n{logs[name].read_text()[-3000:]}" for name in procs)
    raise RuntimeError(f"{failure}\n{tails}")


def _launch(system: str, world: int, args: argparse.Namespace) -> dict:
    port = _free_port()
    # A baseline system runs the same workers with another checkout's code (and coordinator).
    code = Path(args.baseline).resolve() if system.endswith(BASELINE) else ROOT
    system = system.removesuffix(BASELINE)
    env = dict(
        os.environ,
        # The code first; what PYTHONPATH already held (packages installed there) after it.
        PYTHONPATH=os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
        PARAMSYNC_SECRET=secrets.token_hex(16),
    )
    if code != ROOT:  # that checkout may predate the torch backend's entry point
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="paramsync-ddp-bench-") as tmp:

        def start(name: str, cmd: list[str], stdout=subprocess.DEVNULL) -> None:
            logs[name] = Path(tmp) / f"{name.replace(' ', '-')}.err"
            with open(logs[name], "w") as err:
                procs[name] = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=err, cwd=code)

        if system in ("paramsync", UNCHECKED, VARIANT, SPLIT, OWN_LOOP, TORCH):
            interval = {UNCHECKED: 1_000_000, SPLIT: args.check_split}.get(
                system, args.digest_interval
            )
            start(
                "coordinator",
                [
                    sys.executable,
                    "-m",
                    "paramsync.runtime.cli.main",
                    "--log-level",
                    "WARNING",
                    "coordinator",
                    "--world-size",
                    str(world),
                    "--bind",
                    f"127.0.0.1:{port}",
                    "--digest-interval",
                    str(interval),
                ],
            )
        lighthouse = None
        if system == TORCHFT:
            import torchft_peer

            lighthouse = torchft_peer.start_lighthouse(world, Path(tmp) / "lighthouse.log")
        out_path = Path(tmp) / "rank0.out"
        variant = [f"--option={item}" for item in args.variant] if system == VARIANT else []
        if system == SPLIT:
            variant.append("--record-phases")
        if system == TORCH:
            variant.append("--option=data_plane=torch")
        if lighthouse is not None:
            variant.append(f"--lighthouse={lighthouse.address}")
        with open(out_path, "w") as out:
            for rank in range(world):
                cmd = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--worker",
                    "paramsync" if system in (UNCHECKED, VARIANT, SPLIT, TORCH) else system,
                    "--rank",
                    str(rank),
                    "--world",
                    str(world),
                    "--port",
                    str(port),
                    *_model_flags(args),
                    *variant,
                ]
                start(f"rank {rank}", cmd, stdout=out if rank == 0 else subprocess.DEVNULL)
        samples: list[tuple[float, float]] = []
        try:
            _wait_all(
                procs, logs, f"{system} with {world} workers", procs.get("coordinator"), samples
            )
        finally:
            if lighthouse is not None:
                lighthouse.stop()
        result = json.loads(out_path.read_text().strip().splitlines()[-1])
        result["coordinator_cpu_seconds_per_step"] = _window_cpu(samples, result, args.steps)
        return result


PORT_RACES = 3
"""Launches tried when a process finds its port taken (`_free_port` frees the port it found
before the process binds it: another program on the machine may take it meanwhile)."""


def _launch_retrying(system: str, world: int, args: argparse.Namespace) -> dict:
    """`_launch`, again on a fresh port when a process found its port taken."""
    for attempt in range(1, PORT_RACES + 1):
        try:
            return _launch(system, world, args)
        except RuntimeError as error:
            if "EADDRINUSE" not in str(error) or attempt == PORT_RACES:
                raise
            print(f"{system} with {world} workers: port taken, launching again", flush=True)
    raise AssertionError("unreachable")


def _window_cpu(samples: list[tuple[float, float]], result: dict, steps: int) -> float | None:
    """The coordinator's CPU time per step over rank 0's timed window (sampled every
    ``POLL_SECONDS`` at the kernel's clock-tick resolution and interpolated at the window's
    ends: a rough figure; None without samples around the window)."""
    start, end = result["window"]
    at_start, at_end = _cpu_at(samples, start), _cpu_at(samples, end)
    if at_start is None or at_end is None:
        return None
    return (at_end - at_start) / steps


def _cpu_at(samples: list[tuple[float, float]], moment: float) -> float | None:
    """The CPU time at ``moment``, linear between the samples on either side of it."""
    for (t0, cpu0), (t1, cpu1) in itertools.pairwise(samples):
        if t0 <= moment <= t1:
            return cpu0 if t1 == t0 else cpu0 + (cpu1 - cpu0) * (moment - t0) / (t1 - t0)
    return None


def _round_ratios(ours: list[dict], theirs: list[dict], key: str = "step_seconds") -> list[float]:
    """Round by round, ``ours`` over ``theirs`` (each round ran them back to back): the median
    step time, or another per-run figure. Steadier than a ratio of pooled medians when the
    machine's speed drifts during a run."""

    def figure(run: dict) -> float:
        value = run[key]
        return statistics.median(value) if isinstance(value, list) else value

    return [figure(a) / figure(b) for a, b in zip(ours, theirs)]


def _summarise(
    runs: dict,
    worlds: list[int],
    variant_options: tuple[str, ...] = (),
    check_split: int = 0,
    comm_hook: str = "none",
) -> list[dict]:
    table = []
    for world in worlds:
        row: dict = {"world_size": world}
        for system in (*SYSTEMS, PLAIN, UNCHECKED, VARIANT, SPLIT, TORCH, TORCHFT):
            if (system, world) not in runs:
                continue
            results = runs[(system, world)]
            pooled = [s for r in results for s in r["step_seconds"]]
            losses = results[-1]["losses"]
            row[system] = {
                "median_step_seconds": statistics.median(pooled),
                "steps_per_second": statistics.median(r["steps_per_second"] for r in results),
                "final_loss": losses[-1],
                "first_loss": losses[0],
                "mean_loss_last10": statistics.fmean(losses[-10:]),
                "cpu_seconds_per_step": statistics.median(
                    r["cpu_seconds_per_step"] for r in results
                ),
                **{
                    key: statistics.median(r[key] for r in results)
                    for key in ("event_loop_cpu_seconds_per_step", "task_steps_per_step")
                    if all(key in r for r in results)
                },
                "coordinator_cpu_seconds_per_step": (
                    statistics.median(
                        r["coordinator_cpu_seconds_per_step"]
                        for r in results
                        if r.get("coordinator_cpu_seconds_per_step") is not None
                    )
                    if any(r.get("coordinator_cpu_seconds_per_step") is not None for r in results)
                    else None
                ),
                "rounds": len(results),
                "step_samples": len(pooled),
                **(
                    {
                        "allreduce_bytes_per_step": statistics.median(
                            r["allreduce_bytes_per_step"] for r in results
                        )
                    }
                    if all("allreduce_bytes_per_step" in r for r in results)
                    else {}
                ),
            }
        row["comm_hook"] = comm_hook
        if PLAIN in row:
            # Each system's fixed cost a step over the plain loop, round by round.
            for system in ("ddp", "paramsync"):
                over = _round_ratios(runs[(system, world)], runs[(PLAIN, world)])
                row[f"{system}_over_plain"] = statistics.median(ratio - 1 for ratio in over)
        row["ddp_backend"] = runs[("ddp", world)][0].get("ddp_backend", "gloo")
        row["parameters"] = runs[("ddp", world)][0]["parameters"]
        row["vocab_size"] = runs[("ddp", world)][0]["vocab_size"]
        row["step_time_ratio"] = (
            row["paramsync"]["median_step_seconds"] / row["ddp"]["median_step_seconds"]
        )
        checked_runs = runs[("paramsync", world)]
        hashing = [r for r in checked_runs if "hash_cpu_seconds_per_step" in r]
        if hashing:
            # Rank 0's own accounting of its hashing, against its CPU time a step.
            row["hash_cpu_seconds_per_step"] = statistics.median(
                r["hash_cpu_seconds_per_step"] for r in hashing
            )
            row["hash_cpu_share"] = statistics.median(
                r["hash_cpu_seconds_per_step"] / r["cpu_seconds_per_step"] for r in hashing
            )
        if UNCHECKED in row:
            checked, unchecked = row["paramsync"], row[UNCHECKED]
            row["check_cost"] = (
                checked["median_step_seconds"] / unchecked["median_step_seconds"] - 1
            )
            row["check_cpu_cost"] = (
                checked["cpu_seconds_per_step"] / unchecked["cpu_seconds_per_step"] - 1
            )
            check_rounds = [
                ratio - 1 for ratio in _round_ratios(checked_runs, runs[(UNCHECKED, world)])
            ]
            row["check_cost_paired"] = statistics.median(check_rounds)
            row["check_cost_paired_interval"] = _median_interval(check_rounds)
        if (SPLIT, world) in runs:
            row["check_cost_split"] = _split_check_cost(runs[(SPLIT, world)], check_split)
        if VARIANT in row:
            row["variant"] = list(variant_options)
            variants = runs[(VARIANT, world)]
            row["variant_ratio_paired"] = statistics.median(_round_ratios(variants, checked_runs))
            row["variant_cpu_ratio_paired"] = statistics.median(
                _round_ratios(variants, checked_runs, "cpu_seconds_per_step")
            )
        if TORCH in row:
            torch_runs = runs[(TORCH, world)]
            row["torch_plane_ddp_ratio_rounds"] = _round_ratios(torch_runs, runs[("ddp", world)])
            row["torch_plane_ddp_ratio_paired"] = statistics.median(
                row["torch_plane_ddp_ratio_rounds"]
            )
            row["torch_plane_paramsync_ratio_paired"] = statistics.median(
                _round_ratios(torch_runs, checked_runs)
            )
            over = [ratio - 1 for ratio in _round_ratios(torch_runs, runs[(LIMIT, world)])]
            row["torch_plane_over_limit"] = statistics.median(over)
        if TORCHFT in row:
            torchft_runs = runs[(TORCHFT, world)]
            row["torchft_ratio_rounds"] = _round_ratios(checked_runs, torchft_runs)
            row["torchft_ratio_paired"] = statistics.median(row["torchft_ratio_rounds"])
            row["torchft_ratio_paired_interval"] = _median_interval(row["torchft_ratio_rounds"])
            row["torchft_ddp_ratio_paired"] = statistics.median(
                _round_ratios(torchft_runs, runs[("ddp", world)])
            )
            over = [ratio - 1 for ratio in _round_ratios(torchft_runs, runs[(LIMIT, world)])]
            row["torchft_over_limit"] = statistics.median(over)
            row["torchft_loss_curve_max_abs_diff"] = max(
                abs(a - b)
                for ours, theirs in zip(checked_runs, torchft_runs)
                for a, b in zip(ours["losses"], theirs["losses"])
            )
        # paramsync against DDP round by round: the spread shows the machine's drift.
        row["step_time_ratio_rounds"] = _round_ratios(checked_runs, runs[("ddp", world)])
        row["step_time_ratio_paired"] = statistics.median(row["step_time_ratio_rounds"])
        row["step_time_ratio_paired_interval"] = _median_interval(row["step_time_ratio_rounds"])
        row["throughput_ratio"] = (
            row["paramsync"]["steps_per_second"] / row["ddp"]["steps_per_second"]
        )
        # Each system's overhead over the physical limit, round by round (same rounds).
        limit_runs = runs[(LIMIT, world)]
        for system in ("paramsync", "ddp"):
            over = [ratio - 1 for ratio in _round_ratios(runs[(system, world)], limit_runs)]
            row[f"{system}_over_limit"] = statistics.median(over)
            row[f"{system}_over_limit_interval"] = _median_interval(over)
            row[f"{system}_over_limit_rounds"] = over
        pairs = list(zip(runs[("paramsync", world)], runs[("ddp", world)]))
        row["loss_curve_max_abs_diff"] = max(
            abs(a - b) for ours, theirs in pairs for a, b in zip(ours["losses"], theirs["losses"])
        )
        row["loss_curve_max_abs_diff_first10"] = max(
            abs(a - b)
            for ours, theirs in pairs
            for a, b in zip(ours["losses"][:10], theirs["losses"][:10])
        )
        table.append(row)
    return table


def _compared(args: argparse.Namespace) -> tuple[str, ...]:
    """The paramsync systems ``--baseline`` runs again with the baseline's code."""
    return ("paramsync", OWN_LOOP) if args.own_loop else ("paramsync",)


def _summarise_extras(table: list[dict], runs: dict) -> None:
    """Add the own-loop and baseline systems to ``table``'s rows: each one's median step,
    its overhead over the limit, and its paired ratio (round by round) to what it is compared
    with: the own loop to ``train_batch`` (plain paramsync), a baseline system's new code to
    its baseline's (new / old)."""
    for row in table:
        world = row["world_size"]
        limit_runs = runs[(LIMIT, world)]
        pairs = {OWN_LOOP: ("paramsync", OWN_LOOP)}
        pairs.update({name + BASELINE: (name + BASELINE, name) for name in ("paramsync", OWN_LOOP)})
        for system, (under, over) in pairs.items():
            if (system, world) not in runs or (under, world) not in runs:
                continue
            results = runs[(system, world)]
            ratios = _round_ratios(runs[(over, world)], runs[(under, world)])
            over_limit = [ratio - 1 for ratio in _round_ratios(results, limit_runs)]
            row[system] = {
                "median_step_seconds": statistics.median(
                    s for r in results for s in r["step_seconds"]
                ),
                "steps_per_second": statistics.median(r["steps_per_second"] for r in results),
                "cpu_seconds_per_step": statistics.median(
                    r["cpu_seconds_per_step"] for r in results
                ),
                "final_loss": results[-1]["losses"][-1],
                "over_limit": statistics.median(over_limit),
                "over_limit_rounds": over_limit,
                "paired_ratio": statistics.median(ratios),
                "paired_ratio_rounds": ratios,
                "paired_ratio_interval": _median_interval(ratios),
                "cpu_ratio": statistics.median(
                    _round_ratios(runs[(over, world)], runs[(under, world)], "cpu_seconds_per_step")
                ),
            }
            if system == OWN_LOOP and ("ddp", world) in runs:  # the one-line change's figure
                against_ddp = _round_ratios(results, runs[("ddp", world)])
                row[system]["ddp_ratio"] = statistics.median(against_ddp)
                row[system]["ddp_ratio_rounds"] = against_ddp


def _print_extras(table: list[dict], baseline: str | None) -> None:
    for row in table:
        n = row["world_size"]
        own = row.get(OWN_LOOP)
        if own is not None:
            rounds = " ".join(f"{ratio:.3f}" for ratio in own["paired_ratio_rounds"])
            print(
                f"n={n}: own loop (DDP-shaped) {own['median_step_seconds'] * 1e3:.2f} ms a "
                f"step, over the limit {own['over_limit'] * 100:+.1f} %; against train_batch "
                f"round by round: step time x{own['paired_ratio']:.3f}"
                f"{_interval_text(own['paired_ratio_interval'])}, rank 0's CPU time "
                f"x{own['cpu_ratio']:.3f} (rounds: {rounds})"
            )
            if "ddp_ratio" in own:
                rounds = " ".join(f"{ratio:.3f}" for ratio in own["ddp_ratio_rounds"])
                print(
                    f"n={n}: own loop / torch DDP round by round: step time "
                    f"x{own['ddp_ratio']:.3f} (rounds: {rounds})"
                )
        for name in ("paramsync", OWN_LOOP):
            old = row.get(name + BASELINE)
            if old is None:
                continue
            rounds = " ".join(f"{ratio:.3f}" for ratio in old["paired_ratio_rounds"])
            print(
                f"n={n}: {LABELS[name]}: this code / baseline ({baseline}) round by round: "
                f"step time x{old['paired_ratio']:.3f}"
                f"{_interval_text(old['paired_ratio_interval'])}, rank 0's CPU time "
                f"x{old['cpu_ratio']:.3f} (baseline {old['median_step_seconds'] * 1e3:.2f} ms "
                f"a step, over the limit {old['over_limit'] * 100:+.1f} %; rounds: {rounds})"
            )


def _median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of ``values`` (the sign test's: order
    statistics chosen from the binomial distribution), so a target is judged against what
    the machine's noise allows; None when there are too few values for that confidence."""
    n = len(values)
    ordered = sorted(values)
    below = 0.0  # P(Binomial(n, 1/2) <= k - 1), for the k tried next
    k = 0
    while True:
        tail = below + math.comb(n, k) / 2**n
        if tail > (1 - confidence) / 2:
            break
        below, k = tail, k + 1
    if k == 0:
        return None
    return ordered[k - 1], ordered[n - k]


def _split_check_cost(results: list[dict], interval: int) -> dict | None:
    """The check's cost from runs that check every ``interval`` steps (at least 3).

    A checked step pays the hash, the step after it the digest's report; the cycle's other
    steps pay neither. Each cycle gives (checked + next - 2 x the others' mean): adjacent steps,
    so the machine's slow spells, which last seconds, hit both sides alike. The median over
    all cycles, with its interval, as a fraction of the unchecked steps' median. With the
    runs' trace spans (``phase_seconds``), also where the cost lands: each phase's median in
    checked and next steps against its median in the others.
    """
    costs: list[float] = []
    plain: list[float] = []
    for run in results:
        by_step = dict(zip(run["step_numbers"], run["step_seconds"]))
        for checked in sorted(step for step in by_step if step % interval == 0):
            cycle = [by_step.get(checked + offset) for offset in range(interval)]
            if any(seconds is None for seconds in cycle):
                continue
            rest = statistics.fmean(cycle[2:])
            costs.append(cycle[0] + cycle[1] - 2 * rest)
            plain.extend(cycle[2:])
    if not costs:
        return None
    base = statistics.median(plain)
    bounds = _median_interval(costs)
    split = {
        "interval": interval,
        "cycles": len(costs),
        "seconds": statistics.median(costs),
        "fraction": statistics.median(costs) / base,
        "fraction_interval": None if bounds is None else [x / base for x in bounds],
        "unchecked_step_seconds": base,
    }
    if all("phase_seconds" in run for run in results):
        phases = {}
        for phase in PHASES:
            kinds: dict[str, list[float]] = {"checked": [], "next": [], "unchecked": []}
            for run in results:
                for step, seconds in zip(run["step_numbers"], run["phase_seconds"][phase]):
                    offset = step % interval
                    kind = "checked" if offset == 0 else "next" if offset == 1 else "unchecked"
                    kinds[kind].append(seconds)
            unchecked = statistics.median(kinds["unchecked"])
            phases[phase] = {
                kind: statistics.median(kinds[kind]) - unchecked for kind in ("checked", "next")
            }
        split["phases"] = phases
        split["phases_seconds"] = sum(d["checked"] + d["next"] for d in phases.values())
    return split


def _print_table(table: list[dict]) -> None:
    header = (
        f"{'n':>2} | {'DDP step':>9} {'steps/s':>7} {'loss':>6} | "
        f"{'paramsync':>9} {'steps/s':>7} {'loss':>6} | {'step ratio':>10} | "
        f"{'max |dloss| 10':>14} {'all':>8}"
    )
    print(header)
    print("-" * len(header))
    for row in table:
        ddp, ours = row["ddp"], row["paramsync"]
        print(
            f"{row['world_size']:>2} | "
            f"{ddp['median_step_seconds'] * 1e3:>6.1f} ms {ddp['steps_per_second']:>7.2f} "
            f"{ddp['final_loss']:>6.3f} | "
            f"{ours['median_step_seconds'] * 1e3:>6.1f} ms {ours['steps_per_second']:>7.2f} "
            f"{ours['final_loss']:>6.3f} | "
            f"{row['step_time_ratio']:>9.2f}x | "
            f"{row['loss_curve_max_abs_diff_first10']:>14.1e} "
            f"{row['loss_curve_max_abs_diff']:>8.1e}"
        )
    for row in table:
        rounds = " ".join(f"{ratio:.3f}" for ratio in row["step_time_ratio_rounds"])
        print(
            f"n={row['world_size']}: paramsync / DDP round by round: median "
            f"{row['step_time_ratio_paired']:.3f}x"
            f"{_interval_text(row['step_time_ratio_paired_interval'])} "
            f"(rounds: {rounds})"
        )
        limit = row[LIMIT]["median_step_seconds"]
        print(
            f"n={row['world_size']}: over the limit (the same processes with no communication, "
            f"{limit * 1e3:.1f} ms a step), round by round: paramsync "
            f"{row['paramsync_over_limit'] * 100:+.1f} %"
            f"{_interval_text(row['paramsync_over_limit_interval'], percent=True)}; DDP "
            f"{row['ddp_over_limit'] * 100:+.1f} %"
            f"{_interval_text(row['ddp_over_limit_interval'], percent=True)}"
        )
        if PLAIN in row:
            plain = row[PLAIN]
            cpu = ", ".join(
                f"{LABELS[system]} {row[system]['cpu_seconds_per_step'] * 1e3:.1f} ms"
                for system in (PLAIN, "ddp", "paramsync")
            )
            print(
                f"n={row['world_size']}: plain torch loop (no process group, no DDP) "
                f"{plain['median_step_seconds'] * 1e3:.2f} ms a step; over it, round by round: "
                f"DDP {row['ddp_over_plain'] * 100:+.1f} %, paramsync "
                f"{row['paramsync_over_plain'] * 100:+.1f} %; rank 0's CPU a step: {cpu}"
            )
        if UNCHECKED in row:
            off = row[UNCHECKED]["median_step_seconds"]
            print(
                f"n={row['world_size']}: paramsync with the check off {off * 1e3:.1f} ms a step "
                f"({off / row['ddp']['median_step_seconds']:.2f}x DDP): the check costs "
                f"{row['check_cost'] * 100:+.1f} % of the step time "
                f"({row['check_cost_paired'] * 100:+.1f} % paired round by round"
                f"{_interval_text(row['check_cost_paired_interval'], percent=True)}), "
                f"{row['check_cpu_cost'] * 100:+.1f} % of rank 0's CPU time"
            )
        split = row.get("check_cost_split")
        if split is not None:
            within = _interval_text(split["fraction_interval"], percent=True)
            print(
                f"n={row['world_size']}: the check's cost within runs checking every "
                f"{split['interval']} steps: {split['seconds'] * 1e3:+.2f} ms a check, "
                f"{split['fraction'] * 100:+.1f} % of the step{within} "
                f"(median over {split['cycles']} cycles)"
            )
            if "phases" in split:
                landed = ", ".join(
                    f"{phase} {d['checked'] * 1e3:+.2f} / {d['next'] * 1e3:+.2f}"
                    for phase, d in split["phases"].items()
                )
                print(
                    f"n={row['world_size']}:   where it lands (rank 0's spans, median in the "
                    f"checked / next step against the others, ms): {landed}; in all "
                    f"{split['phases_seconds'] * 1e3:+.2f} ms, "
                    f"{split['phases_seconds'] / split['unchecked_step_seconds'] * 100:+.1f} % "
                    "of the step"
                )
        if TORCH in row:
            over_torch = row[TORCH]
            rounds = " ".join(f"{ratio:.3f}" for ratio in row["torch_plane_ddp_ratio_rounds"])
            print(
                f"n={row['world_size']}: paramsync over torch.distributed (data_plane torch, "
                f"gloo): {over_torch['median_step_seconds'] * 1e3:.1f} ms a step, "
                f"{over_torch['steps_per_second']:.2f} steps/s; round by round "
                f"{row['torch_plane_ddp_ratio_paired']:.3f}x DDP (rounds: {rounds}), "
                f"{row['torch_plane_paramsync_ratio_paired']:.3f}x paramsync's own data "
                f"plane, {row['torch_plane_over_limit'] * 100:+.1f} % over the limit"
            )
        if TORCHFT in row:
            peer = row[TORCHFT]
            rounds = " ".join(f"{ratio:.3f}" for ratio in row["torchft_ratio_rounds"])
            print(
                f"n={row['world_size']}: torchft (Manager + DistributedDataParallel + Optimizer, "
                f"ProcessGroupGloo, one replica group a worker): "
                f"{peer['median_step_seconds'] * 1e3:.1f} ms a step, "
                f"{peer['steps_per_second']:.2f} steps/s, loss {peer['final_loss']:.3f}, "
                f"{row['torchft_ddp_ratio_paired']:.3f}x DDP, "
                f"{row['torchft_over_limit'] * 100:+.1f} % over the limit; paramsync / torchft "
                f"round by round: median {row['torchft_ratio_paired']:.3f}x"
                f"{_interval_text(row['torchft_ratio_paired_interval'])} (rounds: {rounds}); "
                f"max |dloss| against paramsync {row['torchft_loss_curve_max_abs_diff']:.1e}"
            )
        if VARIANT in row:
            variant = row[VARIANT]
            print(
                f"n={row['world_size']}: paramsync with {' '.join(row['variant'])}: "
                f"{variant['median_step_seconds'] * 1e3:.1f} ms a step "
                f"({variant['median_step_seconds'] / row['ddp']['median_step_seconds']:.2f}x "
                f"DDP, {variant['steps_per_second']:.2f} steps/s); against plain paramsync "
                f"round by round: step time x{row['variant_ratio_paired']:.3f}, rank 0's CPU "
                f"time x{row['variant_cpu_ratio_paired']:.3f}"
            )
        loops = [
            f"{LABELS[system]} {row[system]['event_loop_cpu_seconds_per_step'] * 1e3:.2f} ms "
            f"({row[system]['task_steps_per_step']:.1f} task steps)"
            for system in ("paramsync", UNCHECKED, VARIANT)
            if system in row and "event_loop_cpu_seconds_per_step" in row[system]
        ]
        if loops:
            print(f"n={row['world_size']}: rank 0's event loop, CPU a step: {'; '.join(loops)}")
        sent = [
            f"{LABELS[system]} {row[system]['allreduce_bytes_per_step'] / 1e6:.3f} MB"
            for system in ("ddp", "paramsync")
            if "allreduce_bytes_per_step" in row[system]
        ]
        if sent:
            print(
                f"n={row['world_size']}: bytes all-reduced a step by rank 0 "
                f"(hook {row['comm_hook']}): {'; '.join(sent)}"
            )
        if "hash_cpu_share" in row:
            print(
                f"n={row['world_size']}: rank 0 hashing its state for the check (its own "
                f"accounting): {row['hash_cpu_seconds_per_step'] * 1e3:.2f} ms of CPU a step, "
                f"{row['hash_cpu_share'] * 100:.1f} % of its CPU time"
            )
    print(
        "(step: median time between consecutive steps on rank 0, pooled over rounds; steps/s: "
        "timed steps over their\n wall time, median over rounds; loss: rank 0's loss at the "
        "last step; step ratio: paramsync / DDP, below 1 means\n paramsync is faster; "
        "max |dloss|: largest difference between the two systems' rank-0 loss curves, over\n"
        " the first 10 steps and over all steps: float summation order differs between the "
        "two all-reduces, and\n training amplifies those last-bit differences over the steps)"
    )


def _interval_text(bounds: list[float] | tuple[float, float] | None, percent: bool = False) -> str:
    """A 95 % interval (`_median_interval`'s) as text; '' if there is none."""
    if bounds is None:
        return ""
    if percent:
        return f", 95 % interval {bounds[0] * 100:+.1f} to {bounds[1] * 100:+.1f} %"
    return f" (95 % interval {bounds[0]:.3f}-{bounds[1]:.3f})"


def _bytes_text(result: dict) -> str:
    nbytes = result.get("allreduce_bytes_per_step")
    return f"; all-reduced {nbytes / 1e6:.3f} MB a step" if nbytes is not None else ""


def _coordinator_cpu_text(result: dict) -> str:
    cpu = result.get("coordinator_cpu_seconds_per_step")
    return f", coordinator {cpu * 1e3:.1f} ms" if cpu is not None else ""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per system")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per worker")
    parser.add_argument(
        "--model",
        choices=("transformer", "batchnorm", "mlp"),
        default="transformer",
        help="the demo's CharTransformer, a convolutional character model with BatchNorm "
        "(buffers synchronized as DDP's broadcast_buffers=True in both systems), or a tiny "
        "per-position MLP (a step of a few ms: the fixed costs show)",
    )
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus-bytes", type=int, default=1 << 20)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where every worker's model and batches live: the CPU (default), or GPU "
        "rank %% device_count (2 workers on one GPU share it); DDP's gradients go through gloo "
        "either way, paramsync's through its own plane (host-staged) or, with data_plane "
        "torch, NCCL",
    )
    parser.add_argument(
        "--bucket-bytes",
        type=int,
        default=None,
        help="paramsync gradient bucket size (default: TrainerOptions' default)",
    )
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size")
    parser.add_argument(
        "--ddp-backend",
        choices=DDP_BACKENDS,
        default="gloo",
        help="torch DDP's process group backend (default gloo; nccl needs --device cuda and one "
        "GPU per rank: NCCL refuses two ranks on one device)",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="also run a plain torch loop (the same model and loop, no process group, no DDP) "
        "in the same rounds, and report each system's cost over it",
    )
    parser.add_argument(
        "--comm-hook",
        choices=COMM_HOOKS,
        default="none",
        help="gradient compression in both systems: DDP registers torch's hook, paramsync "
        "workers get the comm_hook option (default none)",
    )
    parser.add_argument(
        "--powersgd-rank", type=int, default=1, help="PowerSGD matrix_approximation_rank"
    )
    parser.add_argument(
        "--powersgd-start-iter",
        type=int,
        default=2,
        help="PowerSGD start_powerSGD_iter (torch needs at least 2)",
    )
    parser.add_argument(
        "--digest-interval",
        type=int,
        default=1,
        help="paramsync checks identical weights every this many steps (default every step)",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a paramsync TrainerOptions field, e.g. response_cache=false (repeatable)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also run paramsync with this TrainerOptions field changed (on top of --option), "
        "in the same alternating rounds, and report it against plain paramsync (repeatable: "
        "one variant with every field given)",
    )
    parser.add_argument(
        "--check-cost",
        action="store_true",
        help="also run paramsync with the weight check off in the same alternating rounds, "
        "and report what the check costs",
    )
    parser.add_argument(
        "--check-split",
        type=int,
        default=0,
        metavar="K",
        help="also run paramsync checking every K steps (K >= 3) in the same rounds, and "
        "measure the check's cost within those runs: each checked step and the one after it "
        "against the unchecked steps beside them (steadier than --check-cost's A/B of runs)",
    )
    parser.add_argument(
        "--clip-grad-norm",
        type=float,
        metavar="NORM",
        help="clip the averaged gradients to this total norm before each optimizer step in "
        "every system (DDP, the limit and the own loop call clip_grad_norm_ between backward "
        "and step; train_batch gets the clip_grad_norm option)",
    )
    parser.add_argument(
        "--own-loop",
        action="store_true",
        help="also run paramsync's DDP-shaped entry (paramsync.actors.DistributedDataParallel, the "
        "user's own loss.backward(); optimizer.step() loop) in the same rounds, and report it "
        "against train_batch",
    )
    parser.add_argument(
        "--baseline",
        metavar="PATH",
        help="also run the paramsync systems with the code of the checkout at PATH (its "
        "runtime and actors packages) in the same rounds, and report this code against it",
    )
    parser.add_argument(
        "--torchft",
        action="store_true",
        help="also run torchft (the bench extra: Manager, DistributedDataParallel and Optimizer "
        "on ProcessGroupGloo, a lighthouse started for the run) in the same rounds, and report "
        "paramsync / torchft",
    )
    parser.add_argument("--json", type=Path, help="write the table as JSON here")
    parser.add_argument(
        "--no-torch-plane",
        action="store_true",
        help="leave out paramsync over torch.distributed (data_plane torch)",
    )
    parser.add_argument(
        "--trace",
        help="directory for the paramsync ranks' Chrome traces (actors' spans; the last round "
        "of each world size is kept)",
    )
    parser.add_argument(
        "--worker", choices=(*SYSTEMS, PLAIN, OWN_LOOP, TORCHFT), help=argparse.SUPPRESS
    )
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--record-phases", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.warmup < 1 or args.steps < 1:
        raise SystemExit("--warmup and --steps must be at least 1")
    if args.check_split and not 3 <= args.check_split <= args.steps // 2:
        raise SystemExit("--check-split must be at least 3 and at most half of --steps")
    if args.worker:
        _run_worker(args)
        return
    if min(args.worlds) < 1:
        raise SystemExit("--worlds: every world size must be at least 1")
    if args.ddp_backend == "nccl" and args.device != "cuda":
        raise SystemExit("--ddp-backend nccl needs --device cuda")
    LABELS["ddp"] = f"DDP ({args.ddp_backend})"
    _trainer_options(args.option + args.variant)  # refuse a misspelt field before any run
    if args.torchft:
        import torchft_peer

        if not torchft_peer.available():
            raise SystemExit(f"--torchft: {torchft_peer.missing_reason()}")
        if args.comm_hook != "none":
            raise SystemExit("--torchft: torchft runs with --comm-hook none only")
    if args.baseline and not (Path(args.baseline) / "paramsync" / "actors" / "train").is_dir():
        raise SystemExit(
            f"--baseline {args.baseline}: not a paramsync checkout (no paramsync/actors/train); "
            "make one with benchmarks/baseline_checkout.py"
        )
    model_text = {
        "batchnorm": f"CharConvBatchNorm d_model {args.d_model}, {args.layers} layers, ",
        "mlp": f"CharMLP d_model {args.d_model}, ",
    }.get(
        args.model,
        f"CharTransformer d_model {args.d_model}, {args.layers} layers, {args.heads} heads, ",
    )
    print(
        model_text
        + f"context {args.context}; batch {args.batch_size} per worker; AdamW lr {args.lr}; "
        f"{args.warmup} warm-up + {args.steps} timed steps; {args.rounds} rounds; "
        f"{os.cpu_count()} CPUs"
        + ("; models and batches on CUDA" if args.device == "cuda" else ""),
        flush=True,
    )
    runs: dict = {}
    started = time.perf_counter()
    for world in args.worlds:
        for round_index in range(args.rounds):
            systems = (*SYSTEMS, UNCHECKED) if args.check_cost else SYSTEMS
            if args.plain:
                systems = (*systems, PLAIN)
            if args.variant:
                systems = (*systems, VARIANT)
            if args.check_split:
                systems = (*systems, SPLIT)
            if args.own_loop:
                systems = (*systems, OWN_LOOP)
            if args.baseline:
                systems = (*systems, *(system + BASELINE for system in _compared(args)))
            if not args.no_torch_plane:
                systems = (*systems, TORCH)
            if args.torchft:
                systems = (*systems, TORCHFT)
            order = systems if round_index % 2 == 0 else systems[::-1]
            for system in order:
                result = _launch_retrying(system, world, args)
                runs.setdefault((system, world), []).append(result)
                print(
                    f"world size {world}, round {round_index + 1}/{args.rounds}, "
                    f"{LABELS[system]}: median step "
                    f"{statistics.median(result['step_seconds']) * 1e3:.1f} ms, "
                    f"{result['steps_per_second']:.2f} steps/s, "
                    f"loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}; "
                    f"CPU per step: rank 0 {result['cpu_seconds_per_step'] * 1e3:.1f} ms"
                    + _coordinator_cpu_text(result)
                    + _bytes_text(result),
                    flush=True,
                )
    table = _summarise(runs, args.worlds, tuple(args.variant), args.check_split, args.comm_hook)
    _summarise_extras(table, runs)
    print(f"model: {table[0]['parameters']} parameters, vocabulary {table[0]['vocab_size']}")
    _print_table(table)
    _print_extras(table, args.baseline)
    print(f"total benchmark time {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {
            k: v
            for k, v in vars(args).items()
            if k not in ("json", "trace", "worker", "rank", "world", "port", "lighthouse")
        }
        args.json.write_text(
            json.dumps({"cpu_count": os.cpu_count(), "settings": settings, "rows": table}, indent=2)
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
