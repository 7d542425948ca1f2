"""A `PipelineStage` that records every action of its schedule as a trace span.

For the Perfetto view of a pipeline: each compute action (F, B, I, W) becomes a complete event
named like ``F s1 mb3`` on the rank's ``pipeline`` track, and each receive the time spent
waiting for it as an ``idle`` event (the pipeline bubble: the stage has nothing to compute until
its peer's activation or gradient arrives). Sends start in the background and take no time on
the list, so they are instants. The spans come from `runtime.observe.trace.TraceRecorder`;
with a disabled recorder the stage behaves (and costs) as a plain `PipelineStage`.

The execution itself is `actors.parallel.pipeline`'s, unchanged: this subclass only wraps the
step run's per-action dispatch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import trio

from actors.parallel.pipeline import PipelineStage, PipelineStepResult, _StepRun
from runtime.observe.trace import TraceRecorder
from runtime.parallel.actions import Action, ActionKind

__all__ = ["TracedPipelineStage", "PIPELINE_TRACK"]

PIPELINE_TRACK = "pipeline"
"""The track (trace thread name) of a stage's actions."""


class TracedPipelineStage(PipelineStage):
    """`PipelineStage` with a ``tracer``: every action of every step as a span."""

    def __init__(self, *args: Any, tracer: TraceRecorder | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tracer = tracer if tracer is not None else TraceRecorder.disabled()

    async def run_schedule(
        self,
        actions: Sequence[Action],
        inputs: Sequence[torch.Tensor] | None = None,
        targets: Sequence[torch.Tensor] | None = None,
        *,
        microbatches: int | None = None,
        step: int | None = None,
    ) -> PipelineStepResult:
        if not self.tracer.enabled:
            return await super().run_schedule(
                actions, inputs, targets, microbatches=microbatches, step=step
            )
        if self.broken is not None:
            raise RuntimeError(
                f"pipeline rank {self.rank}: a previous step failed ({self.broken!r}); the "
                "stage's groups are closed"
            )
        step = self.step_count if step is None else step
        try:
            run = _TracedStepRun(self, list(actions), inputs, targets, microbatches, step)
            result = await run.run()
        except BaseException as exc:
            await self._fail(exc)
            raise
        self.step_count = step + 1
        return result


_NAMES = {
    ActionKind.FORWARD: "F",
    ActionKind.BACKWARD: "B",
    ActionKind.BACKWARD_INPUT: "I",
    ActionKind.BACKWARD_WEIGHT: "W",
}


class _TracedStepRun(_StepRun):
    """One step's run whose every action is timed into the stage's tracer."""

    async def _execute(self, nursery: trio.Nursery, action: Action) -> None:
        stage = self.stage
        assert isinstance(stage, TracedPipelineStage)
        tracer = stage.tracer
        kind = action.kind
        if kind.is_send:
            tracer.instant(
                f"send {'act' if kind is ActionKind.SEND_ACTIVATION else 'grad'} "
                f"s{action.stage} mb{action.microbatch}",
                PIPELINE_TRACK,
                peer=action.peer,
                step=self.step,
            )
            await super()._execute(nursery, action)
            return
        start = time.perf_counter_ns()
        await super()._execute(nursery, action)
        end = time.perf_counter_ns()
        if kind.is_recv:
            what = "activation" if kind is ActionKind.RECV_ACTIVATION else "gradient"
            tracer.complete(
                "idle",
                start,
                end,
                PIPELINE_TRACK,
                waiting_for=f"{what} of stage {action.stage}, micro-batch {action.microbatch}",
                peer=action.peer,
                step=self.step,
            )
        else:
            tracer.complete(
                f"{_NAMES[kind]} s{action.stage} mb{action.microbatch}",
                start,
                end,
                PIPELINE_TRACK,
                step=self.step,
                stage=action.stage,
                microbatch=action.microbatch,
            )
