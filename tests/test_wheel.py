"""The installed wheel, as a new user gets it: ``import torch`` never breaks, whatever folder it
runs from, and ``init_process_group("paramsync")`` works beside the user's own ``actors`` and
``runtime`` packages.

torch imports every ``torch.backends`` entry point at ``import torch`` and fails the import when
one fails; an entry point under a bare top-level name (``actors``) is shadowed by a user's folder
of that name, which breaks every program in the environment. These tests install the wheel of
this tree (not the editable tree) into a venv of its own and run from a folder that holds a
user's ``actors/`` and ``runtime/``.

The venv is made once and reused (`make test` makes it before the suite, in
``.venv/wheel-env``; ``PARAMSYNC_WHEEL_ENV`` names another); each run reinstalls the wheel.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WHEEL_ENV = Path(os.environ.get("PARAMSYNC_WHEEL_ENV", ROOT / ".venv" / "wheel-env"))
SECRET = "wheel-test-secret-0123456789abcdef"
USERS_PACKAGE = (
    "import sys\nWHOSE = 'the user'\nprint('imported the user\\'s {name}', file=sys.stderr)\n"
)
"""A user's own package: says so on stderr when anything imports it."""


def _run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)  # type: ignore[call-overload, no-any-return]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this tree."""
    out = tmp_path_factory.mktemp("wheel")
    done = _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("paramsync-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_python(wheel: Path) -> Path:
    """The venv's python, with this tree's wheel (and torch) installed and nothing else of it."""
    python = WHEEL_ENV / "bin" / "python"
    install = [str(python), "-m", "pip", "install", "-q"]
    if not python.exists():
        made = _run([sys.executable, "-m", "venv", str(WHEEL_ENV)])
        assert made.returncode == 0, made.stderr
        done = _run([*install, "-c", str(ROOT / "constraints.txt"), str(wheel)])
    else:
        done = _run([*install, "--no-deps", "--force-reinstall", str(wheel)])
    assert done.returncode == 0, done.stderr[-3000:]
    return python


@pytest.fixture()
def users_folder(tmp_path: Path) -> Path:
    """A working folder holding the user's own ``actors`` and ``runtime`` packages."""
    for name in ("actors", "runtime"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(USERS_PACKAGE.format(name=name))
    return tmp_path


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    return dict(env, OMP_NUM_THREADS="1", **extra)


def test_the_wheel_installs_one_import_root(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        text = archive.read(entry_points).decode()
    tops = {name.split("/", 1)[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"paramsync"}
    assert "paramsync/runtime/coordinator/core.py" in names
    assert "paramsync/actors/train/trainer.py" in names
    assert "paramsync/py.typed" in names
    assert "paramsync = paramsync.torch_entry:register" in text
    assert "paramsync = paramsync.runtime.cli.main:main" in text


def test_import_torch_works_beside_the_users_own_packages(
    wheel_python: Path, users_folder: Path
) -> None:
    code = (
        "import sys\n"
        "import torch, torch.distributed as dist\n"
        "print('paramsync' in dist.Backend.backend_list)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('paramsync', 'actors', 'runtime')))\n"
        "import actors, runtime\n"
        "print(actors.WHOSE, runtime.WHOSE)\n"
    )
    done = _run([str(wheel_python), "-c", code], cwd=users_folder, env=_clean_env())
    assert done.returncode == 0, done.stderr[-3000:]
    registered, modules, whose = done.stdout.splitlines()
    assert registered == "True"
    # torch loaded the entry point and nothing else of paramsync, and none of the user's code.
    assert modules == "['paramsync', 'paramsync.torch_entry']"
    assert whose == "the user the user"
    assert done.stderr.count("imported the user's") == 2  # only the script's own imports


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_init_process_group_beside_the_users_own_packages(
    wheel_python: Path, users_folder: Path
) -> None:
    script = users_folder / "train.py"
    script.write_text(
        "import os, sys\n"
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('paramsync')\n"
        "rank = dist.get_rank()\n"
        "t = torch.full((4,), float(rank + 1))\n"
        "dist.all_reduce(t)\n"
        "import paramsync.actors as ours, actors as theirs\n"
        "print(rank, t.tolist(), ours.__name__, theirs.WHOSE, flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    port = str(_free_port())
    ranks = [
        subprocess.Popen(
            [str(wheel_python), str(script)],
            cwd=users_folder,
            env=_clean_env(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                RANK=str(rank),
                WORLD_SIZE="2",
                PARAMSYNC_SECRET=SECRET,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=180) for proc in ranks]
    for proc, (_, err) in zip(ranks, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    lines = sorted(out.strip() for out, _ in outputs)
    assert lines == [
        "0 [3.0, 3.0, 3.0, 3.0] paramsync.actors the user",
        "1 [3.0, 3.0, 3.0, 3.0] paramsync.actors the user",
    ]


def test_the_command_runs_from_the_users_folder(wheel_python: Path, users_folder: Path) -> None:
    command = wheel_python.with_name("paramsync")
    done = _run([str(command), "--help"], cwd=users_folder, env=_clean_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert "launch" in done.stdout
    assert "imported the user's" not in done.stderr


def test_the_editable_tree_grafts_nothing_onto_the_users_packages(users_folder: Path) -> None:
    """The development install maps ``paramsync`` alone: a user's ``actors`` stays the user's,
    and paramsync's is only ever ``paramsync.actors``."""
    code = (
        "import actors, paramsync.actors as ours\n"
        "print(actors.WHOSE, hasattr(actors, 'train'), ours.__name__)\n"
        "import importlib.util as u\n"
        "print(u.find_spec('actors.train'))\n"
    )
    done = _run([sys.executable, "-c", code], cwd=users_folder, env=_clean_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["the user False paramsync.actors", "None"]
