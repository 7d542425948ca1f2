"""A `PipelineStage` that records every action of its schedule as a trace span.

For the Perfetto view of a pipeline: each compute action (F, B, I, W) becomes a complete event
named like ``F s1 mb3`` on the rank's ``pipeline`` track, and each receive the time spent
waiting for it as an ``idle`` event (the pipeline bubble: the stage has nothing to compute until
its peer's activation or gradient arrives). Sends are handed over (to the peer's sender thread
on lent links, else to the trio side) and take no time on the list, so they are instants. The
spans come from `paramsync.runtime.observe.trace.TraceRecorder`; with a disabled recorder the stage
behaves (and costs) as a plain `PipelineStage`.

The execution itself is `paramsync.actors.parallel.pipeline`'s, unchanged: this subclass only
implements the stage's public per-action hook, `PipelineStage.on_action` (called on the stage's
compute thread after each action with its start and end).
"""

from __future__ import annotations

from typing import Any

from paramsync.actors.parallel.pipeline import PipelineStage
from paramsync.runtime.observe.trace import TraceRecorder
from paramsync.runtime.parallel.actions import Action, ActionKind

__all__ = ["TracedPipelineStage", "PIPELINE_TRACK"]

PIPELINE_TRACK = "pipeline"
"""The track (trace thread name) of a stage's actions."""

_NAMES = {
    ActionKind.FORWARD: "F",
    ActionKind.BACKWARD: "B",
    ActionKind.BACKWARD_INPUT: "I",
    ActionKind.BACKWARD_WEIGHT: "W",
}


class TracedPipelineStage(PipelineStage):
    """`PipelineStage` with a ``tracer``: every action of every step as a span."""

    def __init__(self, *args: Any, tracer: TraceRecorder | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tracer = tracer if tracer is not None else TraceRecorder.disabled()

    def on_action(self, step: int, action: Action, started_ns: int, ended_ns: int) -> None:
        tracer = self.tracer
        if not tracer.enabled:
            return
        kind = action.kind
        if kind.is_send:
            tracer.instant(
                f"send {'act' if kind is ActionKind.SEND_ACTIVATION else 'grad'} "
                f"s{action.stage} mb{action.microbatch}",
                PIPELINE_TRACK,
                peer=action.peer,
                step=step,
            )
        elif kind.is_recv:
            what = "activation" if kind is ActionKind.RECV_ACTIVATION else "gradient"
            tracer.complete(
                "idle",
                started_ns,
                ended_ns,
                PIPELINE_TRACK,
                waiting_for=f"{what} of stage {action.stage}, micro-batch {action.microbatch}",
                peer=action.peer,
                step=step,
            )
        else:
            tracer.complete(
                f"{_NAMES[kind]} s{action.stage} mb{action.microbatch}",
                started_ns,
                ended_ns,
                PIPELINE_TRACK,
                step=step,
                stage=action.stage,
                microbatch=action.microbatch,
            )
