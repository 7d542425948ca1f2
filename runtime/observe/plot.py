"""Loss-curve PNGs for the end of a training run, drawn with matplotlib's Agg backend.

Only the object-oriented API is used (``Figure`` + ``FigureCanvasAgg``, never ``pyplot``), so
plotting needs no display, touches no global backend state and is safe off the main thread.
matplotlib is imported on first use: importing this module stays cheap.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["write_loss_plot"]


def _check_series(
    series: Mapping[str, Sequence[tuple[int, float]]], log_y: bool
) -> dict[str, tuple[list[int], list[float]]]:
    if not isinstance(series, Mapping) or not series:
        raise ValueError("series must be a non-empty mapping of name -> [(step, value), ...]")
    out: dict[str, tuple[list[int], list[float]]] = {}
    for name, points in series.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"series names must be non-empty strings, got {name!r}")
        if isinstance(points, str | bytes) or not isinstance(points, Sequence) or not points:
            raise ValueError(f"series {name!r} must be a non-empty list of (step, value) pairs")
        steps: list[int] = []
        values: list[float] = []
        for i, point in enumerate(points):
            if not isinstance(point, Sequence) or isinstance(point, str | bytes) or len(point) != 2:
                raise ValueError(
                    f"series {name!r} point {i}: expected (step, value), got {point!r}"
                )
            step, value = point
            if isinstance(step, bool) or not isinstance(step, numbers.Integral):
                raise ValueError(f"series {name!r} point {i}: step {step!r} is not an int")
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"series {name!r} point {i}: value {value!r} is not a number")
            if not math.isfinite(value):
                raise ValueError(f"series {name!r} point {i}: value {value!r} is not finite")
            if log_y and value <= 0:
                raise ValueError(f"series {name!r} point {i}: value {value!r} is not > 0 (log_y)")
            if steps and step <= steps[-1]:
                raise ValueError(
                    f"series {name!r} point {i}: step {step} does not increase "
                    f"(previous {steps[-1]})"
                )
            steps.append(int(step))
            values.append(float(value))
        out[name] = (steps, values)
    return out


def _ema(values: list[float], smoothing: float) -> list[float]:
    """Bias-corrected exponential moving average (TensorBoard-style smoothing)."""
    out, avg = [], 0.0
    for n, value in enumerate(values, start=1):
        avg = smoothing * avg + (1 - smoothing) * value
        out.append(avg / (1 - smoothing**n))
    return out


def write_loss_plot(
    path: str | os.PathLike[str],
    series: Mapping[str, Sequence[tuple[int, float]]],
    title: str,
    *,
    xlabel: str = "step",
    ylabel: str = "loss",
    size: tuple[int, int] = (800, 500),
    dpi: int = 100,
    log_y: bool = False,
    smoothing: float = 0.0,
    highlight: str | None = None,
) -> Path:
    """Draw each series (name -> [(step, value), ...], steps increasing) as a line and save
    a ``size`` (width, height) pixel PNG at ``path`` (written atomically); returns the path.

    ``smoothing`` in [0, 1) overlays an exponential moving average on the faded raw curve.
    ``highlight`` names the series to read at a glance (the mean over ranks, say): it is drawn
    last, bold and black (smoothed when ``smoothing`` is set, over its own faint raw curve),
    and every other series thin and faint, raw. Bad input (empty series, non-finite values,
    steps that do not increase, a ``highlight`` that names no series, ...) raises
    ``ValueError`` before anything is written.
    """
    data = _check_series(series, log_y)
    if highlight is not None and highlight not in data:
        raise ValueError(f"highlight {highlight!r} names no series (series: {', '.join(data)})")
    if not isinstance(title, str):
        raise ValueError(f"title must be a string, got {title!r}")
    if (
        not isinstance(size, Sequence)
        or len(size) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in size)
        or not all(64 <= v <= 10_000 for v in size)
    ):
        raise ValueError(f"size must be (width, height) in pixels, each 64-10000, got {size!r}")
    if isinstance(dpi, bool) or not isinstance(dpi, int) or not 10 <= dpi <= 1000:
        raise ValueError(f"dpi must be an int in 10-1000, got {dpi!r}")
    if isinstance(smoothing, bool) or not isinstance(smoothing, int | float):
        raise ValueError(f"smoothing must be a number in [0, 1), got {smoothing!r}")
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    width, height = size
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for index, (name, (steps, values)) in enumerate(data.items()):
        color = f"C{index % 10}"
        marker = "o" if len(steps) == 1 else None
        if highlight is not None:
            if name != highlight:
                ax.plot(steps, values, color=color, alpha=0.3, linewidth=0.8, label=name)
            continue
        if smoothing > 0:
            ax.plot(steps, values, color=color, alpha=0.3, linewidth=1.0, marker=marker)
            ax.plot(steps, _ema(values, smoothing), color=color, linewidth=1.8, label=name)
        else:
            ax.plot(steps, values, color=color, linewidth=1.5, label=name, marker=marker)
    if highlight is not None:
        steps, values = data[highlight]
        marker = "o" if len(steps) == 1 else None
        label = highlight
        if smoothing > 0:
            ax.plot(steps, values, color="black", alpha=0.25, linewidth=0.8, marker=marker)
            values, label = _ema(values, smoothing), f"{highlight} (smoothed)"
        ax.plot(steps, values, color="black", linewidth=2.6, label=label, marker=marker, zorder=3)
    if log_y:
        ax.set_yscale("log")

        # Plain numbers ("0.1", "3") rather than 10^-1 / 3x10^0; minor ticks are labelled only
        # when the axis spans less than a decade, where there would be no major label.
        def minor_label(value: float, _pos: int) -> str:
            low, high = ax.get_ylim()
            return f"{value:g}" if high < 10 * low else ""

        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(minor_label))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=dpi)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
