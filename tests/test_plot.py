"""Tests for paramsync.runtime.observe.plot: a real PNG of the requested size, drawn curves, input
validation."""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

import pytest

from paramsync.runtime.observe.plot import write_loss_plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
C0_BLUE = (0x1F, 0x77, 0xB4)  # matplotlib's first cycle colour
C1_ORANGE = (0xFF, 0x7F, 0x0E)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    ihdr = data[16 : 16 + length]
    (crc,) = struct.unpack(">I", data[16 + length : 20 + length])
    assert zlib.crc32(kind + ihdr) == crc
    width, height = struct.unpack(">II", ihdr[:8])
    return width, height


def count_colour(path: Path, rgb: tuple[int, int, int], tol: int = 8) -> int:
    from matplotlib.image import imread

    pixels = imread(path)  # floats in [0, 1], shape (h, w, 3 or 4)
    target = [c / 255 for c in rgb]
    close = (abs(pixels[..., :3] - target) <= tol / 255).all(axis=-1)
    return int(close.sum())


def falling(n: int = 200, scale: float = 1.0) -> list[tuple[int, float]]:
    return [(i, scale * (4.0 * math.exp(-i / 50) + 1.0)) for i in range(n)]


def test_writes_png_of_requested_size_with_the_curves(tmp_path: Path) -> None:
    out = write_loss_plot(
        tmp_path / "plots" / "loss.png",
        {"train": falling(), "eval": falling(20, 1.1)[::2]},
        "char LM",
    )
    assert out == tmp_path / "plots" / "loss.png"
    assert png_size(out) == (800, 500)
    assert count_colour(out, C0_BLUE) > 300
    assert count_colour(out, C1_ORANGE) > 30
    assert not list(out.parent.glob(".*.tmp"))


def test_size_dpi_smoothing_log_scale_and_single_point(tmp_path: Path) -> None:
    out = write_loss_plot(
        tmp_path / "small.png",
        {"rank0": falling(), "single": [(5, 2.0)]},
        "options",
        size=(320, 240),
        dpi=80,
        log_y=True,
        smoothing=0.9,
        xlabel="iteration",
        ylabel="nats",
    )
    assert png_size(out) == (320, 240)
    assert count_colour(out, C0_BLUE) > 50


def test_accepts_tuples_and_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "loss.png"
    path.write_bytes(b"old")
    write_loss_plot(path, {"a": ((0, 1), (1, 0.5))}, "")
    assert path.read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.parametrize(
    ("series", "needle"),
    [
        ({}, "non-empty mapping"),
        ([("a", [(0, 1.0)])], "non-empty mapping"),
        ({"a": []}, "non-empty list"),
        ({"a": "01"}, "non-empty list"),
        ({"": [(0, 1.0)]}, "names"),
        ({3: [(0, 1.0)]}, "names"),
        ({"a": [(0, 1.0, 2.0)]}, "expected"),
        ({"a": [5]}, "expected"),
        ({"a": [(0.5, 1.0)]}, "not an int"),
        ({"a": [(True, 1.0)]}, "not an int"),
        ({"a": [(0, "1")]}, "not a number"),
        ({"a": [(0, float("nan"))]}, "not finite"),
        ({"a": [(0, math.inf)]}, "not finite"),
        ({"a": [(0, 1.0), (0, 0.9)]}, "does not increase"),
        ({"a": [(3, 1.0), (2, 0.9)]}, "does not increase"),
    ],
)
def test_bad_series_raise_value_error_and_write_nothing(
    tmp_path: Path, series: object, needle: str
) -> None:
    path = tmp_path / "loss.png"
    with pytest.raises(ValueError, match=needle):
        write_loss_plot(path, series, "t")  # type: ignore[arg-type]
    assert not path.exists()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"title": None}, "title"),
        ({"size": (10, 10)}, "size"),
        ({"size": (800,)}, "size"),
        ({"size": (800.0, 500)}, "size"),
        ({"dpi": 0}, "dpi"),
        ({"smoothing": 1.0}, "smoothing"),
        ({"smoothing": -0.1}, "smoothing"),
        ({"smoothing": "0.5"}, "smoothing"),
        ({"log_y": True, "series": {"a": [(0, 0.0)]}}, "log_y"),
        ({"highlight": "mean"}, "highlight 'mean' names no series"),
    ],
)
def test_bad_options_raise_value_error(tmp_path: Path, kwargs: dict, needle: str) -> None:
    args = {"series": {"a": falling(5)}, "title": "t", **kwargs}
    with pytest.raises(ValueError, match=needle):
        write_loss_plot(tmp_path / "x.png", **args)
    assert not (tmp_path / "x.png").exists()


def test_the_highlighted_mean_is_bold_and_the_ranks_faint(tmp_path: Path) -> None:
    """`make demo`'s loss.png: four noisy per-rank curves drawn faint, their smoothed mean bold
    and black on top, so the mean reads at a glance."""
    import random

    rng = random.Random(0)
    ranks = {
        f"rank {r}": [(s, v * (1 + 0.2 * rng.uniform(-1, 1))) for s, v in falling()]
        for r in range(4)
    }
    mean = [(s, sum(ranks[f"rank {r}"][s][1] for r in range(4)) / 4) for s in range(200)]
    plain = write_loss_plot(tmp_path / "plain.png", {**ranks, "mean": mean}, "demo")
    bold = write_loss_plot(
        tmp_path / "bold.png",
        {**ranks, "mean": mean},
        "demo",
        smoothing=0.9,
        highlight="mean",
    )
    black = (0, 0, 0)
    # Every rank's colour at full strength is gone (drawn at alpha 0.3 over white) ...
    assert count_colour(plain, C0_BLUE) > 300
    assert count_colour(bold, C0_BLUE) < 20
    # ... and the mean is a thick black line (text is black too: compare with no highlight).
    assert count_colour(bold, black, tol=40) > count_colour(plain, black, tol=40) + 1000
