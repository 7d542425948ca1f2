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
    return grimp.build_graph("paramsync")


def test_no_module_imports_one_that_imports_it_back(graph: grimp.ImportGraph) -> None:
    cycles = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                cycles.append(" -> ".join((module, *back)))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_engine_never_imports_the_worker(graph: grimp.ImportGraph) -> None:
    engine, worker = "paramsync.runtime", "paramsync.actors"
    arrows = graph.find_matching_direct_imports(import_expression=f"{engine}.** -> {worker}.**")
    arrows += graph.find_matching_direct_imports(import_expression=f"{engine} -> {worker}.**")
    assert not arrows, f"runtime imports actors: {arrows}"


def test_the_layer_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


SANS_IO = (
    "paramsync.runtime.protocol",
    "paramsync.runtime.parallel",
    "paramsync.runtime.coordinator.core",
    "paramsync.actors.client.protocol",
)
"""The sans-I/O cores every test drives without a network: each must reach no trio, socket or
threading, through any chain of imports (function-level ones included)."""


def test_the_sans_io_contract_covers_the_cores_and_bites() -> None:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert config["include_external_packages"] is True
    (contract,) = [c for c in config["contracts"] if c["name"].startswith("sans-I/O cores")]
    assert contract["type"] == "forbidden"
    assert set(contract["forbidden_modules"]) == {"trio", "socket", "threading"}
    assert set(SANS_IO) <= set(contract["source_modules"])
    core_parts = {
        f"paramsync.runtime.coordinator.{path.stem}"
        for path in (ROOT / "runtime" / "coordinator").glob("*.py")
        if path.stem not in ("__init__", "service", "tree_service")  # the trio shells
    }
    assert core_parts <= set(contract["source_modules"]), core_parts - set(
        contract["source_modules"]
    )
    graph = grimp.build_graph("paramsync", include_external_packages=True)
    for source in contract["source_modules"]:
        for banned in contract["forbidden_modules"]:
            chain = graph.find_shortest_chains(importer=source, imported=banned)
            assert not chain, f"{source} reaches {banned}: {chain}"
    # The same query finds the shells' I/O, so the check above is not vacuous.
    assert graph.find_shortest_chains(
        importer="paramsync.runtime.coordinator.service", imported="trio"
    )
    assert graph.find_shortest_chains(importer="paramsync.runtime.transport.tcp", imported="socket")
