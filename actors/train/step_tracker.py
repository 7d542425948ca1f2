"""`StepTracker`: where the user's own loop is in its current step, as
`DistributedDataParallel` (`paramsync.actors.train.ddp_wrapper`) sees it, and the crossings into the
trainer's event loop (`OwnLoop`) that move the step on.

A step is begun by its first forward with gradients (`begin`), armed by its synchronizing
forward (the others run under ``no_sync``), reduced when that forward's backward ends (an
autograd engine callback waits for every bucket's average), and ended by its optimizer step:
the trainer's (`apply_through_trainer`, a wrapped optimizer), the user's own between torch's
step hooks (`begin_caller_apply`, `end_caller_apply`), or none: a loss scaler skipped it
(`finish_skipped`).
"""

from __future__ import annotations

import functools

import torch

from paramsync.actors.train.own_step import OwnStep
from paramsync.actors.train.trainer_link import TrainerLink

__all__ = ["StepTracker"]


class StepTracker:
    """The step the user's loop is in, and how far its backward got."""

    def __init__(self, link: TrainerLink, *, find_unused_parameters: bool) -> None:
        self.link = link
        self.find_unused_parameters = find_unused_parameters
        """Whether a synchronizing backward may leave every parameter without a gradient."""
        self.own: OwnStep | None = None
        """The step the user's loop is in (its first forward began it), None between steps."""
        self.armed = False
        """Whether a forward of the step armed the hooks (its backward synchronizes)."""
        self.reduced = False
        """Whether the step's synchronizing backward has finished its all-reduce."""
        self.applying: OwnStep | None = None
        """The step whose optimizer step the user's thread is taking (between the hooks)."""

    def ended(self) -> None:
        """The step is over (or dropped): the next forward begins the next one."""
        self.own, self.armed, self.reduced = None, False, False

    # -- forward and backward --------------------------------------------------------------

    def begin(self, sync: bool) -> None:
        """A forward with gradients: begin the step if none is open and, with ``sync``, arm
        the compute hooks so that the next backward averages the buckets before it returns."""
        trainer = self.link.trainer
        if self.own is None:
            # The step the last optimizer step began in the event loop, if it still
            # stands; else cross into it to begin one.
            prepared = trainer.own_loop.prepared_own_step()
            self.own = (
                prepared if prepared is not None else self.link.run(trainer.own_loop.begin_own_step)
            )
            self.armed = self.reduced = False
        own = self.own
        if self.armed and (not sync or self.reduced or own.compute.sync_backward_started):
            raise RuntimeError(
                f"step {own.step}, rank {trainer.run.rank}: a forward after the step's "
                "synchronizing one and before its backward ended: call optimizer.step() "
                "first (or run the earlier forwards and backwards under "
                "`with model.no_sync():`)"
            )
        self.armed = sync
        own.compute.expect_backward(
            own.step,
            sync,
            hand_over_last=True,
            on_started=functools.partial(self._queue_reduce, own) if sync else None,
        )

    def _queue_reduce(self, own: OwnStep) -> None:
        """In the autograd engine, at the synchronizing backward's first gradient: have the
        engine wait for the step's all-reduce once the whole backward is done."""
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(self._reduce, own)
        )

    def _reduce(self, own: OwnStep) -> None:
        """The end of the synchronizing backward: every bucket's average into the gradients."""
        if self.own is own and not self.reduced:
            self._await_reduction(own)

    def _await_reduction(self, own: OwnStep) -> None:
        self.reduced = True
        self.link.run(self.link.trainer.own_loop.reduce_own_step, own)

    def ensure_reduced(self, own: OwnStep, what: str) -> None:
        """Before ``what`` (an optimizer step): the step's synchronizing backward has reduced
        its gradients (waiting for it here when no hook fired)."""
        if not self.armed:
            raise RuntimeError(
                f"step {own.step}, rank {self.link.trainer.run.rank}: {what} after forwards all "
                "under no_sync() (or require_backward_grad_sync=False): the last forward and "
                "backward of a step must synchronize"
            )
        if not self.reduced:  # no hook fired in the backward (or it has not run yet)
            if not self.find_unused_parameters and not own.compute.sync_backward_started:
                raise RuntimeError(
                    f"step {own.step}, rank {self.link.trainer.run.rank}: {what} after a forward "
                    "with no backward (no parameter received a gradient since the step's "
                    "synchronizing forward): call loss.backward() first"
                )
            self._await_reduction(own)

    # -- its optimizer step ----------------------------------------------------------------

    def apply_through_trainer(self) -> bool:
        """`DistributedOptimizer.step`: the trainer applies the step. Returns whether it was
        taken (False: a membership change dropped it)."""
        own = self.own
        if own is None:
            raise RuntimeError(
                "optimizer.step() before any forward of the wrapped model in this step: run "
                "loss = loss_fn(model(inputs), targets); loss.backward() first"
            )
        self.ensure_reduced(own, "optimizer.step()")
        self.ended()
        taken: bool = self.link.run(self.link.trainer.own_loop.finish_own_step, own)
        return taken

    def begin_caller_apply(self) -> bool:
        """The user's thread is about to step its own optimizer: wait until the step may be
        applied (the previous step's commit, the apply barrier). False: a membership change
        dropped the step, and this optimizer step must change nothing."""
        trainer = self.link.trainer
        own = self.own
        if own is None:
            raise RuntimeError(
                f"rank {trainer.run.rank}, step {trainer.step}: optimizer.step() with no "
                "forward and backward of the wrapped model since the last step: every step "
                "must synchronize its gradients first"
            )
        self.ensure_reduced(own, "optimizer.step()")
        if self.link.run(trainer.own_loop.begin_caller_apply, own):
            self.applying = own
            return True
        self.ended()
        return False

    def end_caller_apply(self) -> None:
        """The user's own optimizer step is done: report the step's digest (C-DDP-001)."""
        own = self.applying
        if own is None:
            return
        self.applying = None
        self.ended()
        trainer = self.link.trainer
        trainer.own_loop.caller_applied(own)
        self.link.run(trainer.own_loop.end_caller_apply, own)

    def finish_skipped(self) -> None:
        """A synchronized step no optimizer step followed (a loss scaler skipped it) is
        finished now, unchanged, as skipped: every rank alike."""
        own = self.own
        if own is None or not self.reduced:
            return
        self.ended()
        trainer = self.link.trainer
        if self.link.run(trainer.own_loop.begin_caller_apply, own):
            trainer.own_loop.caller_applied(own, skipped=True)
            self.link.run(trainer.own_loop.end_caller_apply, own)
