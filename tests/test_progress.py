"""Tests for paramsync.runtime.observe.progress: in-place redraws on a TTY, periodic lines
elsewhere.

The line is tqdm's meter: its rate reads ``2.00step/s`` or ``4.00s/step`` and its ETA
``MM:SS`` (the hand-made bar this replaced wrote ``2 step/s`` and ``0:40``)."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from paramsync.runtime.observe.progress import ProgressBar, format_metric


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_line_shows_step_percent_rate_eta_and_metrics() -> None:
    clock = FakeClock()
    bar = ProgressBar(100, io.StringIO(), description="train", width=10, clock=clock)
    clock.now += 10.0
    bar.update(20, loss=2.34567, lr=1e-3, epoch=1)
    line = bar.render()
    assert line.startswith("train  20/100 [##........]  20.0%")
    assert "2.00step/s" in line
    assert "ETA 00:40" in line
    assert "loss=2.346 lr=0.001 epoch=1" in line


def test_slow_rates_show_seconds_per_step_and_unknown_eta() -> None:
    clock = FakeClock()
    bar = ProgressBar(10, io.StringIO(), clock=clock)
    assert "?step/s | ETA ?" in bar.render()
    clock.now += 8.0
    bar.update(2)
    assert "4.00s/step" in bar.render()
    assert "ETA 00:32" in bar.render()


def test_non_tty_prints_a_line_every_n_steps_and_the_last() -> None:
    out = io.StringIO()
    clock = FakeClock()
    bar = ProgressBar(25, out, every=10, clock=clock)
    for step in range(1, 26):
        clock.now += 0.5
        bar.update(step, loss=1.0 / step)
    bar.close()
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split("/")[0].strip() for line in lines] == ["10", "20", "25"]
    assert "\r" not in out.getvalue()
    assert "loss=0.04" in lines[-1]


def test_non_tty_default_interval_is_a_tenth_and_close_prints_unfinished_step() -> None:
    out = io.StringIO()
    bar = ProgressBar(200, out, clock=FakeClock())
    assert bar.every == 20
    for step in range(1, 31):
        bar.update(step)
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split("/")[0].strip() for line in lines] == ["20", "30"]


def test_tty_redraws_in_place_throttled_and_ends_with_newline() -> None:
    out = TtyStream()
    clock = FakeClock()
    with ProgressBar(50, out, min_interval=1.0, clock=clock) as bar:
        assert bar.tty
        for step in range(1, 51):
            clock.now += 0.25  # four updates per redraw interval
            bar.update(step, loss=3.0)
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1
    frames = text.rstrip("\n").split("\r")[1:]
    assert 12 <= len(frames) <= 16  # ~50 / 4, plus the final step and close
    assert frames[-1].startswith("50/50")
    assert frames[0].startswith(" 1/50")


def test_tty_pads_over_a_longer_previous_line() -> None:
    out = TtyStream()
    bar = ProgressBar(10, out, min_interval=0, clock=FakeClock())
    bar.update(1, note="a very long metric value")
    first = out.getvalue().split("\r")[-1]
    bar._metrics.clear()
    bar.update(2)
    second = out.getvalue().split("\r")[-1]
    assert len(second) == len(first)
    assert second.rstrip().endswith("ETA ?")


def test_write_keeps_the_bar_intact_on_a_tty() -> None:
    out = TtyStream()
    bar = ProgressBar(10, out, min_interval=0, clock=FakeClock())
    bar.update(3)
    line = bar.render()
    bar.write("checkpoint saved")
    text = out.getvalue()
    blank = " " * len(line)
    assert text == f"\r{line}\r{blank}\rcheckpoint saved\n\r{line}"
    plain = io.StringIO()
    ProgressBar(10, plain).write("hello")
    assert plain.getvalue() == "hello\n"


def test_updates_after_close_are_ignored() -> None:
    out = io.StringIO()
    bar = ProgressBar(10, out, every=1, clock=FakeClock())
    bar.update(1)
    bar.close()
    before = out.getvalue()
    bar.update(2)
    assert out.getvalue() == before
    assert bar.step == 1


def test_default_stream_is_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    bar = ProgressBar(1, tty=False)
    assert bar.stream is sys.stderr
    bar.update(1)
    assert "1/1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs",
    [
        {"total": 0},
        {"total": 2.0},
        {"total": True},
        {"total": 5, "every": 0},
        {"total": 5, "width": -1},
        {"total": 5, "min_interval": -1},
        {"total": 5, "min_interval": "x"},
    ],
)
def test_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ProgressBar(stream=io.StringIO(), **kwargs)


@pytest.mark.parametrize("step", [-1, 11, 2.5, True])
def test_bad_steps(step: object) -> None:
    bar = ProgressBar(10, io.StringIO())
    with pytest.raises(ValueError, match="step"):
        bar.update(step)  # type: ignore[arg-type]


def test_long_runs_show_hours_and_no_bar_at_width_zero() -> None:
    clock = FakeClock()
    bar = ProgressBar(10_000, io.StringIO(), width=0, clock=clock)
    clock.now += 3725.0
    bar.update(5000)
    line = bar.render()
    assert line.startswith(" 5000/10000  50.0% |")
    assert "[" not in line
    assert "ETA 1:02:05" in line


def test_formatting_helpers() -> None:
    assert format_metric(0.000123456) == "0.0001235"
    assert format_metric(torch.tensor(2.5)) == "2.5"
    assert format_metric(7) == "7"
    assert format_metric(12345.6) == "12346"
    assert format_metric(-2.5e20) == "-2.5e+20"
    assert format_metric("x") == "x"
