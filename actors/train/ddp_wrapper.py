"""`DistributedDataParallel`: torch DDP's shape for paramsync: wrap the model and the optimizer,
keep your own ``loss.backward(); optimizer.step()`` loop.

    model = DistributedDataParallel(model)        # reads RANK, WORLD_SIZE, ... when wrapping:
    optimizer = model.wrap_optimizer(optimizer)   # joins the run, rank 0's weights everywhere
    for inputs, targets in my_shard:
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)    # your forward: arms the gradient hooks
        loss.backward()                           # each finished bucket's all-reduce starts now
        optimizer.step()                          # waits for the buckets, steps, reports digest
    model.close()                                 # or `with DistributedDataParallel(...)`

Design (issue 14, "your own loop"), decided here:

* **The same machinery as `DistributedTrainer.train_batch`, minus the loss function.** The
  wrapper drives a `DistributedTrainer` whose epoch actors are the usual ones: the gradient-comm
  actor owns the flat bucket buffers (the gradients are views of them, DDP's
  ``gradient_as_bucket_view``), negotiates and all-reduces each bucket; the optimizer actor
  applies the step and reports the state digest for the coordinator's identical-weights check
  (C-DDP-001). Only who runs forward and backward changes: the user's own thread instead of
  the compute actor's worker thread. The compute actor still owns the gradient hooks; the
  wrapped forward arms them (`ComputeActor.expect_backward`, as DDP's ``prepare_for_backward``
  does in its forward) and the user's ``backward`` fires them: each bucket is handed to the
  trio loop the moment its last gradient is accumulated (``run_sync_soon``, thread-safe), so its
  all-reduce runs while backward goes on in the user's thread. ``optimizer.step()`` then calls
  `DistributedTrainer.finish_own_step`, the tail of ``train_batch``: wait for the buckets,
  synchronize the buffers, apply, digest. A ``loss_fn`` adapter replaying the user's forward
  inside ``train_batch`` was rejected: it would run the forward twice or take ``backward`` out
  of the user's hands.
* **A synchronous facade, like torch DDP.** The trainer's trio loop runs in a background thread
  (`SyncTrainer`, started by `wrap_optimizer` from the torchrun/``paramsync launch``
  environment); forward and ``step()`` cross into it with ``trio.from_thread``. A trio
  application, or a test running several workers in one trio run, attaches a wrapper to a
  trainer it already runs (`DistributedDataParallel.around`) and runs the loop with
  ``trio.to_thread.run_sync``: the loop is synchronous code either way, as DDP's is.
* **Where it differs from torch DDP, on purpose.** The optimizer is wrapped (as torchft's
  ``OptimizerWrapper`` does) because the step must wait for the all-reduce and report the
  digest; ``zero_grad`` zeroes in place whatever ``set_to_none`` says, keeping the gradients the
  bucket views (the optimizer actor already zeroes them after each step). A step the membership
  changes under is dropped, not rerun (the user's forward cannot be replayed): ``step()``
  returns False, the weights are the new epoch's, as torchft's ``should_commit`` skips a step.
  Options a user's loop owns itself are refused: ``accumulation_steps`` (use `no_sync`, which
  is DDP's way), ``grad_scaler`` (the scaler must scale the user's loss) and ``join``.
  ``autocast_dtype`` is honoured: the wrapped forward runs under autocast.
* **Gradient accumulation is `no_sync`**, as in DDP: forwards under ``with model.no_sync():``
  leave the hooks disarmed, the gradients accumulate in the bucket buffers, and the first
  forward outside it arms them for the backward that synchronizes the sum (divide the loss
  yourself, as with DDP).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch
import trio

from actors.graph.precision import autocast_of
from actors.state.digest import Scheduler
from actors.train.sync import SyncTrainer
from actors.train.trainer import DistributedTrainer, OwnStep, TrainerOptions
from runtime.coordinator.service import CoordinatorOptions

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
            "DistributedDataParallel: grad_scaler is not supported: the loss scaler would have "
            "to scale your loss; train in bfloat16 (autocast_dtype='bfloat16') or with "
            "train_batch"
        )
    if options.join:
        raise ValueError(
            "DistributedDataParallel: join (uneven inputs) is not supported; give every rank "
            "the same number of steps, or use train_batch and join"
        )


class DistributedDataParallel(torch.nn.Module):
    """A model whose gradients are averaged over every worker by the user's own backward.

    ``module``: the user's model, on its device already (its parameters and buffers are
    replaced by rank 0's when the optimizer is wrapped). The keyword arguments are
    `SyncTrainer`'s: the trainer options (see `check_own_loop_options` for the few refused),
    the coordinator's options when this rank hosts it, configuration overrides and the shared
    secret; and three of torch DDP's, which set the matching options: ``find_unused_parameters``,
    ``broadcast_buffers`` (False: ``buffer_sync="local"``) and ``bucket_cap_mb``
    (``bucket_bytes``). Call `wrap_optimizer` next. Like torch DDP's, ``state_dict`` keys carry
    the ``module.`` prefix; `trainer`'s ``state_dict`` is the plain module's.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        options: TrainerOptions | None = None,
        coordinator_options: CoordinatorOptions | None = None,
        overrides: Mapping[str, object] | None = None,
        secret: bytes | str | None = None,
        find_unused_parameters: bool | None = None,
        broadcast_buffers: bool | None = None,
        bucket_cap_mb: float | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self._options = _ddp_options(
            options or TrainerOptions(), find_unused_parameters, broadcast_buffers, bucket_cap_mb
        )
        check_own_loop_options(self._options)
        self._settings: dict[str, Any] = {
            "coordinator_options": coordinator_options,
            "overrides": overrides,
            "secret": secret,
        }
        self._sync: SyncTrainer | None = None
        self._trainer: DistributedTrainer | None = None
        self._cross: Callable[..., Any] | None = None
        """Runs an async function of the trainer in its trio loop, from the user's thread."""
        self._own: OwnStep | None = None
        """The step the user's loop is in (its first forward began it), None between steps."""
        self._armed = False
        """Whether a forward of the step armed the hooks (outside `no_sync`)."""
        self._no_sync = False
        self._thread: int | None = None

    # -- attaching a trainer --------------------------------------------------------------

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, scheduler: Scheduler | None = None
    ) -> DistributedOptimizer:
        """Join the run this environment describes (torchrun's or ``paramsync launch``'s
        variables, as `trainer_from_env` reads them) with this model and ``optimizer``; rank
        0's weights are broadcast before this returns. ``scheduler``: an LR scheduler of
        ``optimizer`` that the trainer steps right after each optimizer step (do not step it
        yourself); its state then travels with the training state. Returns the optimizer to
        use in the loop."""
        if self._trainer is not None:
            raise RuntimeError("DistributedDataParallel: the optimizer is already wrapped")
        _check_optimizer(self.module, optimizer)
        sync = SyncTrainer(
            self.module,
            optimizer,
            _no_loss_fn,
            options=self._options,
            scheduler=scheduler,
            **self._settings,
        )
        sync.__enter__()
        self._sync = sync
        self._attach(sync.trainer, sync.call)
        return DistributedOptimizer(self, optimizer)

    @classmethod
    def around(
        cls, trainer: DistributedTrainer
    ) -> tuple[DistributedDataParallel, DistributedOptimizer]:
        """Wrap a trainer this trio run already runs (`DistributedTrainer.open`,
        `trainer_from_env`, `train_in_process`): call it in the trio thread, then use the
        model and optimizer it returns from another thread (``trio.to_thread.run_sync``), never
        from the trio thread itself, which they block on."""
        check_own_loop_options(trainer.options)
        wrapper = cls(trainer.model, options=trainer.options)
        token = trio.lowlevel.current_trio_token()

        def cross(fn: Callable[..., Any], *args: Any) -> Any:
            return trio.from_thread.run(fn, *args, trio_token=token)

        wrapper._attach(trainer, cross)
        return wrapper, DistributedOptimizer(wrapper, trainer.optimizer)

    def _attach(self, trainer: DistributedTrainer, cross: Callable[..., Any]) -> None:
        self._trainer = trainer
        self._cross = cross

    @property
    def trainer(self) -> DistributedTrainer:
        """The underlying trainer (its summary, state_dict, step; touch it only between steps)."""
        if self._trainer is None:
            raise RuntimeError(
                "DistributedDataParallel: wrap the optimizer first "
                "(optimizer = model.wrap_optimizer(optimizer))"
            )
        return self._trainer

    # -- the user's loop ------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward; with gradients enabled it first begins the step (once per
        step) and, outside `no_sync`, arms the hooks so the next backward reduces the buckets."""
        trainer = self.trainer
        if torch.is_grad_enabled():
            self._check_thread()
            if self._own is None:
                # The step the last optimizer.step() began in the event loop, if it still
                # stands; else cross into it to begin one.
                prepared = trainer.prepared_own_step()
                self._own = prepared if prepared is not None else self._run(trainer.begin_own_step)
            own = self._own
            if self._armed and (self._no_sync or own.compute.sync_backward_started):
                raise RuntimeError(
                    f"step {own.step}: a forward after the step's synchronizing one: call "
                    "optimizer.step() first (or run the earlier forwards and backwards under "
                    "`with model.no_sync():`)"
                )
            self._armed = not self._no_sync
            own.compute.expect_backward(own.step, not self._no_sync, hand_over_last=True)
        with autocast_of(trainer.precision):
            return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards (and their backwards) inside accumulate gradients without synchronizing
        them (torch DDP's ``no_sync``): the first forward-backward outside synchronizes the sum."""
        before, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = before

    def _step(self) -> bool:
        own = self._own
        if own is None:
            raise RuntimeError(
                "optimizer.step() before any forward of the wrapped model in this step: run "
                "loss = loss_fn(model(inputs), targets); loss.backward() first"
            )
        if not self._armed:
            raise RuntimeError(
                f"step {own.step}: optimizer.step() after forwards all under no_sync(): the "
                "last forward and backward of a step must be outside it, to synchronize"
            )
        self._own, self._armed = None, False
        taken: bool = self._run(self.trainer.finish_own_step, own)
        return taken

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        assert self._cross is not None
        return self._cross(fn, *args)

    def _check_thread(self) -> None:
        """One thread runs the loop: the hooks' bookkeeping is that thread's."""
        me = threading.get_ident()
        if self._thread is None:
            self._thread = me
        elif self._thread != me:
            raise RuntimeError(
                "DistributedDataParallel: the training loop moved to another thread; run "
                "forward, backward and step from one thread"
            )

    # -- around the loop ------------------------------------------------------------------

    def verified(self) -> None:
        """Block until every step so far passed the identical-weights check (C-DDP-001)."""
        self._run(self.trainer.verified)

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
        return self.trainer.rank

    def close(self) -> None:
        """Leave the run (when `wrap_optimizer` joined it): tell the coordinator this worker
        is done and stop the trainer's thread. A wrapper from `around` leaves the trainer to
        its owner."""
        sync, self._sync = self._sync, None
        if sync is not None:
            sync.__exit__(None, None, None)

    def __enter__(self) -> DistributedDataParallel:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        sync, self._sync = self._sync, None
        if sync is not None:
            sync.__exit__(exc_type, exc, tb)


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
        return self.model._step()

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


def _ddp_options(
    options: TrainerOptions,
    find_unused_parameters: bool | None,
    broadcast_buffers: bool | None,
    bucket_cap_mb: float | None,
) -> TrainerOptions:
    """``options`` with torch DDP's keyword arguments of the same meaning applied."""
    changes: dict[str, Any] = {}
    if find_unused_parameters is not None:
        changes["find_unused_parameters"] = find_unused_parameters
    if broadcast_buffers is not None:
        changes["buffer_sync"] = "broadcast" if broadcast_buffers else "local"
    if bucket_cap_mb is not None:
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        changes["bucket_bytes"] = max(1, int(bucket_cap_mb * 1024 * 1024))
    return dataclasses.replace(options, **changes) if changes else options


def _check_optimizer(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must step this module's parameters (and nothing else)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"wrap_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    mine = {id(param) for param in module.parameters()}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in mine:
                raise ValueError(
                    f"wrap_optimizer: parameter group {index} holds a tensor of shape "
                    f"{tuple(param.shape)} that is not a parameter of the wrapped module"
                )
