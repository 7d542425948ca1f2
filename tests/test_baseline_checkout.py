"""benchmarks/baseline_checkout.py: a revision from before the one import root, moved under
``paramsync`` so that the benchmarks' ``--baseline`` imports that revision's code."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "baseline_checkout.py"


def _module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("baseline_checkout", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rename_moves_every_reference_and_nothing_else() -> None:
    bench = _module()
    text = (
        "import runtime\n"
        "from actors import SyncTrainer\n"
        "from runtime.transport.tcp import TcpTransport\n"
        "import actors.train.worker as worker\n"
        'MODULE = "actors.torchdist.process_group"\n'
        "self.runtime.cli = 1  # an attribute, not the package\n"
        "at runtime. A sentence about actors.\n"
        "path = 'runtime/transport/tcp.py'\n"
    )
    assert bench.under_the_root(text) == (
        "from paramsync import runtime\n"
        "from paramsync.actors import SyncTrainer\n"
        "from paramsync.runtime.transport.tcp import TcpTransport\n"
        "import paramsync.actors.train.worker as worker\n"
        'MODULE = "paramsync.actors.torchdist.process_group"\n'
        "self.runtime.cli = 1  # an attribute, not the package\n"
        "at runtime. A sentence about actors.\n"
        "path = 'runtime/transport/tcp.py'\n"
    )


def test_an_old_layout_tree_imports_under_paramsync(tmp_path: Path) -> None:
    bench = _module()
    tree = tmp_path / "old"
    (tree / "runtime" / "errors").mkdir(parents=True)
    (tree / "actors").mkdir()
    (tree / "runtime" / "__init__.py").write_text("")
    (tree / "runtime" / "errors" / "__init__.py").write_text("WHERE = 'the old checkout'\n")
    (tree / "actors" / "__init__.py").write_text("from runtime.errors import WHERE\n")
    assert bench.move_under_the_root(tree) == 1
    code = "import paramsync.actors as a; print(a.WHERE); print(a.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    where, path = done.stdout.splitlines()
    assert where == "the old checkout"
    assert Path(path).resolve() == (tree / "actors" / "__init__.py").resolve()


def test_the_command_refuses_a_folder_that_is_not_empty(tmp_path: Path) -> None:
    (tmp_path / "something").write_text("")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "HEAD", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "not empty" in done.stderr
