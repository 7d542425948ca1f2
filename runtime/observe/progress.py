"""The progress bar of the rank that reports (rank 0), drawn by tqdm.

On a terminal the bar redraws one line in place (tqdm's in-place display, at most every
``min_interval`` seconds, so a fast loop does not flood the terminal); into a file or a pipe
(CI logs) it prints a whole line every ``every`` steps instead, never a carriage return. Each
line is tqdm's meter laid out as step/total, bar, percent, rate, ETA and the latest metrics,
e.g.::

    train 120/500 [####................]  24.0% |  3.41step/s | ETA 01:51 | loss=2.314
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["ProgressBar", "format_metric"]


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


class _Display(tqdm):
    """tqdm's terminal display (in-place redraws, `tqdm.write` around it, the final line on
    close) showing the `ProgressBar`'s line: the bar keeps the state and the clock."""

    def __init__(self, render: Callable[[], str], stream: TextIO) -> None:
        self._render = render
        # position=0: always the line the cursor is on (tqdm would stack concurrent bars);
        # a delay: no frame before the first update (tqdm draws one at construction).
        super().__init__(file=stream, position=0, leave=True, delay=math.inf)
        self.delay = 0  # drawn from now on, and the last frame drawn again on close

    def __str__(self) -> str:
        return self._render()


class ProgressBar:
    """Step progress with rate, ETA and metrics on ``stream`` (default ``sys.stderr``).

    ``tty`` forces in-place redrawing on or off (default: ``stream.isatty()``). ``every``
    is the line interval when not a TTY (default: ten lines per run). ``width`` is the bar's
    width in characters (0: no bar). ``clock`` is injectable for tests.
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
        self._format = (
            f"{{desc}}{{n_fmt:>{len(str(total))}}}/{{total_fmt}}"
            + (f" [{{bar:{width}}}]" if width else "")
            + " {percentage:5.1f}% | {rate_fmt} | ETA {remaining}{metrics}"
        )
        self._last_draw = -math.inf
        self._drawn = False
        self._printed_step: int | None = None
        self._closed = False
        self._display = _Display(self.render, self.stream) if tty else None

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
        if self._display is not None:
            now = self._clock()
            if step == self.total or now - self._last_draw >= self.min_interval:
                self._last_draw = now
                self._drawn = True
                self._display.n = step
                self._display.refresh()
        elif (step % self.every == 0 or step == self.total) and step != self._printed_step:
            self._printed_step = step
            self._emit(self.render() + "\n")

    def write(self, message: str) -> None:
        """Print ``message`` on its own line without garbling the bar."""
        if self._display is not None and self._drawn and not self._closed:
            tqdm.write(message, file=self.stream)
            self.stream.flush()
        else:
            self._emit(message + "\n")

    def close(self) -> None:
        """Finish the bar: draw the final state and end the line (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._display is not None:
            self._display.n = self._step
            self._display.close()
            self.stream.flush()
        elif self._printed_step != self._step:
            self._printed_step = self._step
            self._emit(self.render() + "\n")

    def render(self) -> str:
        """The progress line for the current state (no ``\\r`` or newline): tqdm's meter."""
        metrics = " ".join(f"{k}={format_metric(v)}" for k, v in self._metrics.items())
        return tqdm.format_meter(
            self._step,
            self.total,
            max(0.0, self._clock() - self._start),
            prefix=f"{self.description} " if self.description else "",
            ascii=".#",
            unit="step",
            bar_format=self._format,
            metrics=f" | {metrics}" if metrics else "",
        )

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
