"""The layers: imports point down only and no module takes part in an import cycle.

The layer order itself is stated once, as import-linter contracts in pyproject.toml (`make test`
runs `lint-imports`); this test runs those contracts too, so `pytest` alone catches a broken
arrow, and it adds what import-linter's contracts do not say: no import cycle anywhere in
``runtime`` or ``actors``, function-level imports included.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("runtime", "actors")


def test_no_module_imports_one_that_imports_it_back(graph: grimp.ImportGraph) -> None:
    cycles = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                cycles.append(" -> ".join((module, *back)))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_engine_never_imports_the_worker(graph: grimp.ImportGraph) -> None:
    arrows = graph.find_matching_direct_imports(import_expression="runtime.** -> actors.**")
    arrows += graph.find_matching_direct_imports(import_expression="runtime -> actors.**")
    assert not arrows, f"runtime imports actors: {arrows}"


def test_the_layer_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
