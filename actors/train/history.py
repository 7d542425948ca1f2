"""`StepHistory`: what a trainer keeps of the steps it ran (bounded lists for the newest steps,
totals for the whole run), and the metrics it feeds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paramsync.runtime.observe.metrics import Metrics

__all__ = ["StepHistory"]


def _keep(history: list[Any], keep: int) -> None:
    if len(history) > keep:
        del history[: len(history) - keep]


@dataclass
class StepHistory:
    """The newest ``keep`` steps' losses, times, gradient norms and skips, and the whole run's
    totals (its first loss, how many steps in how many seconds)."""

    keep: int
    metrics: Metrics | None = None
    losses: list[tuple[int, float]] = field(default_factory=list)
    """(step, loss) of the newest steps this worker ran."""
    step_seconds: list[float] = field(default_factory=list)
    """Wall time of the newest steps this worker ran."""
    grad_norms: list[tuple[int, float]] = field(default_factory=list)
    """(step, total gradient norm before clipping) of the newest clipped steps."""
    skipped_steps: list[int] = field(default_factory=list)
    """The newest steps the loss scaler skipped."""
    joined_steps: int = 0
    """Steps this worker took part in with zero gradients, its data ended (``join``)."""
    first_loss: float | None = None
    steps_run: int = 0
    seconds_run: float = 0.0
    skipped_total: int = 0

    def record(self, step: int, loss: float | None, seconds: float) -> None:
        """A step ran in ``seconds``; ``loss`` None: its loss is the caller's own."""
        if loss is not None:
            if self.first_loss is None:
                self.first_loss = loss
            self.losses.append((step, loss))
        self.steps_run += 1
        self.seconds_run += seconds
        if self.metrics is not None:
            self.metrics.observe_step(step, seconds)
        self.step_seconds.append(seconds)
        _keep(self.losses, self.keep)
        _keep(self.step_seconds, self.keep)

    def record_norm(self, step: int, norm: float) -> None:
        self.grad_norms.append((step, norm))
        _keep(self.grad_norms, self.keep)

    def skipped(self, step: int) -> None:
        """The loss scaler skipped ``step`` (called in the optimizer step's thread)."""
        self.skipped_total += 1
        self.skipped_steps.append(step)
        _keep(self.skipped_steps, self.keep)

    @property
    def steps_per_second(self) -> float | None:
        return self.steps_run / self.seconds_run if self.seconds_run else None

    @property
    def median_step_seconds(self) -> float | None:
        seconds = sorted(self.step_seconds)
        return seconds[len(seconds) // 2] if seconds else None
