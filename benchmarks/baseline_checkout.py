"""Make a baseline checkout for the benchmarks' ``--baseline PATH``: another revision's code,
importable under this one's names.

    python benchmarks/baseline_checkout.py REV PATH

writes revision ``REV`` of this repository into ``PATH`` (``git archive``, no history). The
benchmarks run their workers with ``PATH`` first on the path and import ``paramsync``; a
revision from before the one import root (its code imports the bare ``runtime`` and ``actors``)
is moved under ``paramsync`` here by the same mechanical rename that introduced the root: every
``runtime.<layer>`` / ``actors.<layer>`` reference and ``from runtime import`` /
``import actors`` becomes its ``paramsync.`` name, and ``paramsync/`` holds an ``__init__.py``
and links to the two folders. Nothing else of that code changes, so the baseline measures that
revision's code.
"""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE_LAYERS = (
    "actor|cli|collectives|config|coordinator|errors|observe|parallel|protocol|testing|"
    "train_config|transport"
)
WORKER_LAYERS = "client|demo_job|graph|multidevice|parallel|state|testing|torchdist|train"
_DOTTED = re.compile(
    rf"(?<![\w.\-/])(?:(runtime)\.({ENGINE_LAYERS})|(actors)\.({WORKER_LAYERS}))\b"
)
_FROM = re.compile(r"(?<![\w.])from (runtime|actors) import\b")
_IMPORT = re.compile(r"^(\s*)import (runtime|actors)\s*$", re.M)
_SUFFIXES = (".py", ".toml", ".md", ".txt", ".cfg", ".ini", "Makefile")


def under_the_root(text: str) -> str:
    """``text`` with every reference to the bare ``runtime`` / ``actors`` packages moved under
    ``paramsync``."""
    text = _DOTTED.sub(
        lambda m: f"paramsync.{m.group(1) or m.group(3)}.{m.group(2) or m.group(4)}", text
    )
    text = _FROM.sub(lambda m: f"from paramsync.{m.group(1)} import", text)
    return _IMPORT.sub(lambda m: f"{m.group(1)}from paramsync import {m.group(2)}", text)


def move_under_the_root(tree: Path) -> int:
    """Move a checkout from before the import root under ``paramsync``; the files changed."""
    changed = 0
    for path in sorted(tree.rglob("*")):
        if not path.is_file() or path.is_symlink() or not path.name.endswith(_SUFFIXES):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        new = under_the_root(text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed += 1
    root = tree / "paramsync"
    root.mkdir()
    (root / "__init__.py").write_text('"""A baseline checkout moved under paramsync."""\n')
    for name in ("runtime", "actors"):
        (root / name).symlink_to(Path("..") / name, target_is_directory=True)
    return changed


def export(rev: str, path: Path) -> str:
    """Write revision ``rev`` into the empty folder ``path``; what was done, in one line."""
    if path.exists() and any(path.iterdir()):
        raise SystemExit(f"{path}: not empty")
    archive = subprocess.run(
        ["git", "archive", "--format=tar", rev], cwd=ROOT, capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise SystemExit(f"git archive {rev}: {archive.stderr.decode().strip()}")
    path.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(path, filter="tar")
    if (path / "paramsync").is_dir():
        return f"{rev} written to {path}"
    if not ((path / "runtime").is_dir() and (path / "actors").is_dir()):
        raise SystemExit(f"{rev}: neither paramsync/ nor runtime/ and actors/: not paramsync")
    changed = move_under_the_root(path)
    return f"{rev} written to {path} and moved under paramsync ({changed} files renamed in)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="the revision (a commit, tag or branch of this repository)")
    parser.add_argument("path", type=Path, help="an empty or new folder")
    args = parser.parse_args(argv)
    print(export(args.rev, args.path.resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
