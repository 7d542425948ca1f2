"""A dependency-free progress bar for the rank that reports (rank 0).

On a terminal the bar redraws one line in place with ``\\r`` (at most every ``min_interval``
seconds, so a fast loop does not flood the terminal); into a file or a pipe (CI logs) it prints
a whole line every ``every`` steps instead. Each line shows step/total, percent, rate, ETA and
the latest metrics, e.g.::

    train  120/500 [#####...............]  24.0% | 3.41 step/s | ETA 1:51 | loss=2.314
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

__all__ = ["ProgressBar", "format_duration", "format_metric"]


def format_duration(seconds: float) -> str:
    """``M:SS`` or ``H:MM:SS``; ``?`` when unknown (not finite or negative)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_metric(value: Any) -> str:
    """Floats to 4 significant digits (whole numbers from 1000 up), others as ``str``."""
    if isinstance(value, float):
        return f"{value:.0f}" if 1e3 <= abs(value) < 1e15 else f"{value:.4g}"
    if hasattr(value, "item") and callable(value.item):  # a 0-d tensor or numpy scalar
        try:
            return format_metric(value.item())
        except (ValueError, RuntimeError):
            pass
    return str(value)


class ProgressBar:
    """Step progress with rate, ETA and metrics on ``stream`` (default ``sys.stderr``).

    ``tty`` forces in-place redrawing on or off (default: ``stream.isatty()``). ``every``
    is the line interval when not a TTY (default: ten lines per run). ``clock`` is
    injectable for tests.
    """

    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        *,
        description: str = "",
        width: int = 20,
        every: int | None = None,
        min_interval: float = 0.1,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"total must be a positive int, got {total!r}")
        if isinstance(width, bool) or not isinstance(width, int) or width < 0:
            raise ValueError(f"width must be a non-negative int, got {width!r}")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int)):
            raise ValueError(f"every must be a positive int, got {every!r}")
        if every is not None and every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        if not isinstance(min_interval, int | float) or not min_interval >= 0:
            raise ValueError(f"min_interval must be >= 0, got {min_interval!r}")
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        self.description = description
        self.width = width
        self.every = every if every is not None else max(1, math.ceil(total / 10))
        self.min_interval = min_interval
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty()) if callable(isatty) else False
        self.tty = tty
        self._clock = clock
        self._start = clock()
        self._step = 0
        self._metrics: dict[str, Any] = {}
        self._last_draw = -math.inf
        self._drawn_width = 0
        self._printed_step: int | None = None
        self._closed = False

    @property
    def step(self) -> int:
        """The last step passed to `update`."""
        return self._step

    @property
    def rate(self) -> float:
        """Steps per second since the bar was created (``nan`` before any time passed)."""
        elapsed = self._clock() - self._start
        return self._step / elapsed if elapsed > 0 else math.nan

    def update(self, step: int, **metrics: Any) -> None:
        """Record that ``step`` of ``total`` steps are done, with the latest metrics (merged
        with earlier ones), and redraw or print if it is time to."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step must be an int, got {step!r}")
        if not 0 <= step <= self.total:
            raise ValueError(f"step {step} is outside 0..{self.total}")
        if self._closed:
            return
        self._step = step
        self._metrics.update(metrics)
        if self.tty:
            now = self._clock()
            if step == self.total or now - self._last_draw >= self.min_interval:
                self._last_draw = now
                self._redraw()
        elif (step % self.every == 0 or step == self.total) and step != self._printed_step:
            self._printed_step = step
            self._emit(self.render() + "\n")

    def write(self, message: str) -> None:
        """Print ``message`` on its own line without garbling the bar."""
        if self.tty and self._drawn_width:
            self._emit("\r" + " " * self._drawn_width + "\r" + message + "\n")
            self._drawn_width = 0
            if not self._closed:
                self._redraw()
        else:
            self._emit(message + "\n")

    def close(self) -> None:
        """Finish the bar: draw the final state and end the line (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.tty:
            self._redraw()
            self._emit("\n")
        elif self._printed_step != self._step:
            self._printed_step = self._step
            self._emit(self.render() + "\n")

    def render(self) -> str:
        """The progress line for the current state (no ``\\r`` or newline)."""
        step, total = self._step, self.total
        parts = []
        head = f"{self.description} " if self.description else ""
        head += f"{step:>{len(str(total))}}/{total}"
        if self.width:
            filled = self.width * step // total
            head += " [" + "#" * filled + "." * (self.width - filled) + "]"
        head += f" {100 * step / total:5.1f}%"
        parts.append(head)
        rate = self.rate
        if math.isfinite(rate) and rate > 0:
            parts.append(f"{rate:.3g} step/s" if rate >= 1 else f"{1 / rate:.3g} s/step")
            parts.append(f"ETA {format_duration((total - step) / rate)}")
        else:
            parts.append("? step/s")
            parts.append("ETA ?")
        if self._metrics:
            parts.append(" ".join(f"{k}={format_metric(v)}" for k, v in self._metrics.items()))
        return " | ".join(parts)

    def _redraw(self) -> None:
        line = self.render()
        pad = " " * max(0, self._drawn_width - len(line))
        self._drawn_width = len(line)
        self._emit("\r" + line + pad)

    def _emit(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
