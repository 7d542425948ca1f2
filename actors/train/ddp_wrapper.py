"""`DistributedDataParallel`: torch DDP's class for paramsync, with torch's contract, in the
user's own loop. A torch DDP script runs with its import changed:

    model = DistributedDataParallel(model, device_ids=None)  # joins the run: rank 0's weights
    optimizer = torch.optim.AdamW(model.parameters())       # built before or after; unwrapped
    for inputs, targets in my_shard:
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)    # your forward: arms the gradient hooks
        loss.backward()                           # returns with every .grad averaged
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # sees the averaged gradients
        optimizer.step()                          # digest reported from a step hook (C-DDP-001)
    model.close()                                 # or `with DistributedDataParallel(...)`

Design, decided here:

* **The same machinery as `DistributedTrainer.train_batch`, minus the loss function.** The
  wrapper drives a `DistributedTrainer` whose epoch actors are the usual ones: the gradient-comm
  actor owns the flat bucket buffers (the gradients are views of them, DDP's
  ``gradient_as_bucket_view``), negotiates and all-reduces each bucket; the coordinator
  sequences every bucket and checks the state digest after every optimizer step. Only who runs
  forward, backward and the optimizer step changes: the user's own thread. The compute actor
  owns the gradient hooks; the wrapped forward arms them (`ComputeActor.expect_backward`, as
  DDP's ``prepare_for_backward`` does in its forward) and the user's ``backward`` fires them:
  each bucket is handed to the trio loop the moment its last gradient is accumulated
  (``run_sync_soon``, thread-safe), so its all-reduce runs while backward goes on.
* **Backward returns with the averaged gradients** (torch DDP's reducer finalizes in backward):
  the first hook of a synchronizing backward queues an autograd engine callback that runs when
  the whole backward is done and waits, in the event loop, until every bucket's average is in
  the gradients and the buffers are synchronized (`OwnLoop.reduce_own_step`). Only
  the wait for the buckets still running moves to the end of backward: the overlap stays.
  Clipping, ``GradScaler.unscale_``, gradient-norm logging and gradient surgery between
  ``backward()`` and ``step()`` see identical averaged gradients on every rank.
* **The user's optimizer stays the user's.** Global optimizer step hooks (torch's
  ``register_optimizer_step_pre_hook``/``post_hook``) recognise the optimizer stepping this
  module's parameters (named by its first step, or by `wrap_optimizer` or ``optimizer=``):
  before its step, the previous step's commit and the epoch's apply barrier; after it, the
  state digest, hashed in the user's thread, is reported. A step the user does not take (a
  ``GradScaler`` that found inf or nan skips ``optimizer.step()``, every rank alike since the
  gradients are identical) is finished as skipped by the next forward. `wrap_optimizer` is still
  there for ``step()`` returning False on a step a membership change dropped (an unwrapped
  optimizer cannot refuse its step: the dropped step's gradients are zeroed instead, on every
  rank alike).
* **A synchronous facade, like torch DDP.** The trainer's trio loop runs in a background thread
  (`SyncTrainer`, started by the constructor from the torchrun/``paramsync launch``
  environment); forward and the step hooks cross into it with ``trio.from_thread``. A trio
  application, or a test running several workers in one trio run, attaches a wrapper to a
  trainer it already runs (`DistributedDataParallel.around`) and runs the loop with
  ``trio.to_thread.run_sync``.
* **Gradient accumulation is `no_sync` / ``require_backward_grad_sync = False``**, as in DDP:
  forwards with it off leave the hooks disarmed, the gradients accumulate in the bucket
  buffers, and the first forward with it on arms them for the backward that synchronizes the
  sum (divide the loss yourself, as with DDP).

The wrapper is the face of parts it owns, one job each: `TrainerLink` (its trainer and the
crossing into the trainer's event loop), `StepTracker` (the step the user's loop is in, from
its first forward to its optimizer step), `OptimizerBinding` (which optimizer steps the module,
and torch's step hooks around the user's own step), `LoopChecks` (one thread, the wrapped
parameters unchanged) and `uneven_inputs` (``join()``).
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch
import trio

from paramsync.actors.graph.precision import autocast_of
from paramsync.actors.state.digest import Scheduler
from paramsync.actors.train.ddp_arguments import (
    DeviceArgs,
    device_args,
    torch_comm_hook,
    torch_ddp_options,
)
from paramsync.actors.train.loop_checks import LoopChecks
from paramsync.actors.train.optimizer_binding import OptimizerBinding, check_optimizer
from paramsync.actors.train.step_tracker import StepTracker
from paramsync.actors.train.sync import SyncTrainer
from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions
from paramsync.actors.train.trainer_link import TrainerLink
from paramsync.actors.train.unbound_optimizer import UnboundOptimizer
from paramsync.actors.train.uneven_inputs import uneven_inputs
from paramsync.runtime.coordinator.service import CoordinatorOptions

__all__ = ["DistributedDataParallel", "DistributedOptimizer"]


def _no_loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    raise RuntimeError(
        "a DistributedDataParallel trainer runs no loss function: the user's loop runs forward "
        "and backward (train_batch is not available through the wrapper)"
    )


def check_own_loop_options(options: TrainerOptions) -> None:
    """Refuse the trainer options that only `DistributedTrainer.train_batch`'s own forward
    and backward can honour (each error says what to do instead)."""
    if options.accumulation_steps != 1:
        raise ValueError(
            "DistributedDataParallel: accumulation_steps must be 1 (got "
            f"{options.accumulation_steps}): accumulate with `with model.no_sync():` around the "
            "forwards and backwards before the last, as with torch DDP"
        )
    if options.grad_scaler:
        raise ValueError(
            "DistributedDataParallel: TrainerOptions(grad_scaler=True) is train_batch's: in "
            "your own loop use your own torch.amp.GradScaler as with torch DDP (backward "
            "returns with the averaged gradients, so every rank skips the same steps)"
        )
    if options.join:
        raise ValueError(
            "DistributedDataParallel: join (uneven inputs) is not supported; give every rank "
            "the same number of steps, or use train_batch and join"
        )


_WRAPPED_MODULES: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Every module a live wrapper joined a run with (wrapping one twice is refused)."""

_OPEN_RUNS: set[SyncTrainer] = set()
"""The runs wrappers joined and have not closed, held here rather than through their wrappers:
a script that never closes its wrapper (a torch DDP script has nothing to close) leaves the
run when the interpreter exits, even once the wrapper itself is gone (its ``model`` was local
to a function that returned)."""


@atexit.register
def _leave_open_runs() -> None:
    while _OPEN_RUNS:
        _OPEN_RUNS.pop().__exit__(None, None, None)


class DistributedDataParallel(torch.nn.Module):
    """A model whose gradients are averaged over every worker by the user's own backward.

    The arguments are torch DDP's, in torch's order and with torch's meaning
    (`paramsync.actors.train.ddp_arguments` says what each does here and which are refused); then
    paramsync's own, by keyword: ``options`` (`TrainerOptions`; see `check_own_loop_options`
    for the few refused), ``coordinator_options`` when this rank hosts the coordinator,
    configuration ``overrides``, the shared ``secret``, ``optimizer``/``scheduler``: the
    optimizer (and LR scheduler) to check and transfer from the start, which a worker that may
    rejoin a run in progress must pass (otherwise the optimizer stepping this module's
    parameters is found at its first step), and ``grad_scaler``: a ``torch.amp.GradScaler``
    the loop drives, covered by the state digest (`register_grad_scaler`). Constructing it
    joins the run this environment describes (torchrun's, ``paramsync launch``'s, any
    launcher's that sets torch's variables, Slurm's or Open MPI's; after the script's own
    ``init_process_group``, the default group's rank and world size, and its store for the
    coordinator's address: `paramsync.actors.train.rendezvous`): rank 0's parameters and
    buffers are everywhere when it returns. Like torch
    DDP's, ``state_dict`` keys carry the ``module.`` prefix; `trainer`'s ``state_dict`` is the
    plain module's.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Any = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        options: TrainerOptions | None = None,
        coordinator_options: CoordinatorOptions | None = None,
        overrides: Mapping[str, object] | None = None,
        secret: bytes | str | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Scheduler | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        _trainer: DistributedTrainer | None = None,
    ) -> None:
        super().__init__()
        if isinstance(module, (DistributedDataParallel, torch.nn.parallel.DistributedDataParallel)):
            raise ValueError(
                f"DistributedDataParallel: the module is already wrapped by "
                f"{type(module).__module__}.{type(module).__name__}: wrap the plain module once"
            )
        if module in _WRAPPED_MODULES:
            raise ValueError(
                "DistributedDataParallel: this module is already wrapped by a live "
                "DistributedDataParallel (close that one first, or wrap it once)"
            )
        self.module = module
        self.dim = dim
        self.require_backward_grad_sync = True
        """torch DDP's flag: False makes the next forwards' backwards accumulate only."""
        self._devices: DeviceArgs = device_args(module, device_ids, output_device)
        device = self._devices.input_device
        self.device_ids = None if device is None else [device]
        self.output_device = self._devices.output_device
        base = _trainer.run.options if _trainer is not None else (options or TrainerOptions())
        self._options = torch_ddp_options(
            base,
            broadcast_buffers=broadcast_buffers,
            forward_sync_buffers=forward_sync_buffers,
            process_group=process_group,
            world_size=None,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce,
            mixed_precision=mixed_precision,
            device_mesh=device_mesh,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            bucket_cap_mb_list=bucket_cap_mb_list,
        )
        check_own_loop_options(self._options)
        self._sync: SyncTrainer | None = None
        self._link = TrainerLink()
        self._steps = StepTracker(
            self._link, find_unused_parameters=self._options.find_unused_parameters
        )
        self._checks = LoopChecks(module)
        self._binding = OptimizerBinding(module, self._link, self._steps, self._checks)
        self._hooked = False
        """Whether `register_comm_hook` was called."""
        self._registered = _trainer is None
        if self._registered:
            _WRAPPED_MODULES.add(module)
        try:
            if _trainer is None:
                self._join(coordinator_options, overrides, secret, optimizer, scheduler)
            elif optimizer is not None:
                self._binding.use(optimizer)
            if grad_scaler is not None:
                self.register_grad_scaler(grad_scaler)
            if process_group is not None:  # now the run's size is known
                torch_ddp_options(
                    self._options, process_group=process_group, world_size=self.world_size
                )
        except BaseException:
            self.close()
            raise
        self._binding.hook_steps()

    # -- attaching a trainer --------------------------------------------------------------

    def _join(
        self,
        coordinator_options: CoordinatorOptions | None,
        overrides: Mapping[str, object] | None,
        secret: bytes | str | None,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Scheduler | None,
    ) -> None:
        """Join the run this environment describes, with ``optimizer`` or an unbound one."""
        if optimizer is not None:
            check_optimizer(self.module, optimizer)
        sync = SyncTrainer(
            self.module,
            optimizer
            if optimizer is not None
            else UnboundOptimizer(list(self.module.parameters())),
            _no_loss_fn,
            options=self._options,
            scheduler=scheduler,
            coordinator_options=coordinator_options,
            overrides=overrides,
            secret=secret,
        )
        sync.__enter__()
        self._sync = sync
        _OPEN_RUNS.add(sync)
        self._link.attach(sync.trainer, sync.call)
        self._link.attach_caller(applies=True)
        if optimizer is not None:
            self._binding.user_optimizer = optimizer

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, scheduler: Scheduler | None = None
    ) -> DistributedOptimizer:
        """Step ``optimizer`` through the trainer (torchft's ``OptimizerWrapper``): the
        returned optimizer's ``step()`` returns False for a step a membership change dropped,
        and skips it. ``scheduler``: an LR scheduler of ``optimizer`` that the trainer steps
        right after each optimizer step (do not step it yourself); its state then travels with
        the training state. Call it before the first step."""
        self._binding.wrap(optimizer, scheduler)
        self._link.attach_caller(applies=False)  # the trainer steps it from now on
        return DistributedOptimizer(self, optimizer)

    @classmethod
    def around(
        cls, trainer: DistributedTrainer
    ) -> tuple[DistributedDataParallel, DistributedOptimizer]:
        """Wrap a trainer this trio run already runs (`DistributedTrainer.open`,
        `trainer_from_env`, `train_in_process`), its optimizer stepped through the trainer:
        call it in the trio thread, then use the model and optimizer it returns from another
        thread (``trio.to_thread.run_sync``), never from the trio thread itself, which they
        block on."""
        wrapper = cls.unwrapped_around(trainer)
        wrapper._binding.wrapped, wrapper._binding.user_optimizer = trainer.run.optimizer, None
        trainer.own_loop.attach_caller(applies=False)  # in the trio thread, as `around` is called
        return wrapper, DistributedOptimizer(wrapper, trainer.run.optimizer)

    @classmethod
    def unwrapped_around(
        cls, trainer: DistributedTrainer, *, optimizer_known: bool = True
    ) -> DistributedDataParallel:
        """As `around`, but the user's loop steps the trainer's optimizer itself (its step
        hooks report the digest); ``optimizer_known=False``: it is found at its first step,
        as a freshly constructed wrapper finds it."""
        check_own_loop_options(trainer.run.options)
        wrapper = cls(trainer.model, _trainer=trainer)
        token = trio.lowlevel.current_trio_token()

        def cross(fn: Callable[..., Any], *args: Any) -> Any:
            return trio.from_thread.run(fn, *args, trio_token=token)

        wrapper._link.attach(trainer, cross)
        trainer.own_loop.attach_caller(applies=True)  # in the trio thread, as this is called
        if optimizer_known:
            wrapper._binding.user_optimizer = trainer.run.optimizer
        return wrapper

    @property
    def trainer(self) -> DistributedTrainer:
        """The underlying trainer (its summary, state_dict, step; touch it only between steps)."""
        return self._link.trainer

    # -- the user's loop ------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward; with gradients enabled it first begins the step (once per
        step) and, with ``require_backward_grad_sync``, arms the hooks so the next backward
        averages the buckets before it returns."""
        trainer = self.trainer
        if torch.is_grad_enabled():
            self._checks.check_thread()
            self._binding.unmute()  # a muted step that raised before its post-hook
            self._checks.check_parameters(trainer)
            # The last step's backward was synchronized but no optimizer step followed (a
            # loss scaler skipped it): every rank finishes it unchanged, as skipped.
            self._binding.flush_skipped()
            self._steps.begin(self.require_backward_grad_sync)
        if self._devices.input_device is not None:
            args, kwargs = _to_device((args, kwargs), self._devices.input_device)
        with autocast_of(trainer.run.precision):
            return self.module(*args, **kwargs)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """torch DDP's ``register_comm_hook`` for torch's own hooks (``default_hooks``'
        ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``; ``powerSGD_hook``
        with its ``PowerSGDState``): each bucket is reduced with the hook's arithmetic, the
        same bits torch DDP gets; another hook is refused naming it (see
        `paramsync.actors.train.ddp_arguments.torch_comm_hook`). Once, before the first forward, on
        every rank (the hook is part of each bucket's spec: ranks that differ are stopped)."""
        if self._hooked:
            raise RuntimeError("register_comm_hook can only be called once (as with torch DDP)")
        trainer = self.trainer
        if self._steps.own is not None or trainer.step > 0:
            raise RuntimeError(
                f"rank {trainer.run.rank}, step {trainer.step}: register_comm_hook after "
                "training started: register it before the first forward"
            )
        comm_hook, rank, start = torch_comm_hook(state, hook)

        async def use() -> None:
            trainer.own_loop.use_comm_hook(comm_hook, rank, start)

        self._link.run(use)
        self._hooked = True

    def register_grad_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """Cover ``scaler`` (the loop's ``torch.amp.GradScaler``) in the per-step state digest
        (C-DDP-001): a rank whose scale or skip decision differs is caught at that step. The
        decisions agree without it (backward returns identical averaged gradients); this
        makes the check see the scaler itself. ``grad_scaler=`` in the constructor does the
        same."""
        trainer = self.trainer

        async def watch() -> None:
            trainer.own_loop.watch_grad_scaler(scaler)

        self._link.run(watch)

    @contextmanager
    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Iterator[None]:
        """Uneven inputs, torch DDP's ``join()``: every rank runs its loop inside; a rank whose
        loop ends before the others' keeps taking part in their steps with zero gradients
        (and steps its optimizer with them, so its replica stays identical every step, where
        torch only syncs it at the end) until every rank's loop has ended; the average still
        divides by the whole world, as with ``divide_by_initial_world_size=True``. With
        ``throw_on_early_termination`` every rank raises `EarlyTermination` at the step where
        the first one ran out instead."""
        with uneven_inputs(
            self._link,
            self._steps,
            self._binding,
            divide_by_initial_world_size=divide_by_initial_world_size,
            enable=enable,
            throw_on_early_termination=throw_on_early_termination,
        ):
            yield

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards (and their backwards) inside accumulate gradients without synchronizing
        them (torch DDP's ``no_sync``): the first forward-backward outside synchronizes the sum."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    # -- around the loop ------------------------------------------------------------------

    def verified(self) -> None:
        """Block until every step so far passed the identical-weights check (C-DDP-001)."""
        self._link.run(self.trainer.verified)

    def summary(self) -> dict[str, Any]:
        """The trainer's summary (`DistributedTrainer.summary`; the losses are your loop's, so
        its loss fields stay None)."""
        return self.trainer.summary()

    @property
    def world_size(self) -> int:
        """Number of workers training together."""
        return self.trainer.world_size

    @property
    def rank(self) -> int:
        """This worker's rank."""
        return self.trainer.run.rank

    def close(self) -> None:
        """Leave the run (when the constructor joined it): tell the coordinator this worker
        is done and stop the trainer's thread. A wrapper from `around` leaves the trainer to
        its owner."""
        self._release()
        sync, self._sync = self._sync, None
        if sync is not None:
            _OPEN_RUNS.discard(sync)
            sync.__exit__(None, None, None)

    def _release(self) -> None:
        self._binding.unhook()
        if self._registered:
            self._registered = False
            _WRAPPED_MODULES.discard(self.module)

    def __enter__(self) -> DistributedDataParallel:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._release()
        sync, self._sync = self._sync, None
        if sync is not None:
            sync.__exit__(exc_type, exc, tb)


def _to_device(value: Any, device: torch.device) -> Any:
    """Every tensor in ``value`` (nested tuples, lists, dicts) on ``device`` (torch DDP's
    ``_to_kwargs`` for a single-device module)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_to_device(v, device) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


class DistributedOptimizer:
    """The user's optimizer, stepped through the trainer (torchft's ``OptimizerWrapper``):
    ``step()`` waits for the step's all-reduce, applies it and reports the state digest."""

    def __init__(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def step(self, closure: Callable[[], float] | None = None) -> bool:
        """Apply this step's averaged gradients (every rank the same step). Returns whether the
        step was taken: False when a membership change dropped it (see the module docstring)."""
        if closure is not None:
            raise TypeError(
                "DistributedOptimizer.step: closures (LBFGS) are not supported: the step "
                "cannot rerun your forward and backward"
            )
        return self.model._steps.apply_through_trainer()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in place (whatever ``set_to_none`` says: they stay the views of
        the bucket buffers backward writes into, as DDP's ``gradient_as_bucket_view``)."""
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.zero_()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (set a learning rate here, as in torch)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state."""
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict``."""
        return self.optimizer.state_dict()
