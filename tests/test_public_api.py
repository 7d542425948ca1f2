"""The public API: a few names a user reaches for, each defined in the layer it belongs to.

``paramsync`` exports the front doors, the configurations, the errors and ``testing``;
``paramsync.runtime`` and ``paramsync.actors`` re-export what a user's code imports of the
engine and the worker (the seeds' names among them); internals stay importable from their
modules but are not exported from the packages. docs/api.md, generated from the docstrings,
documents the root's names.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import paramsync
import paramsync.testing
from paramsync import actors, runtime

ROOT = Path(__file__).resolve().parent.parent

SEED_NAMES = {
    runtime: {
        "DistributedTrainConfig",
        "ParallelismConfig",
        "DistributedConfig",
        "GradientAggregator",
        "AllReduceAggregator",
        "ParameterServerAggregator",
        "InProcessTransport",
        "TcpTransport",
        "all_reduce",
        "reduce_scatter",
        "all_gather",
        "broadcast",
        "barrier",
    },
    actors: {"DistributedTrainer", "SyncTrainer", "TrainerOptions", "DataParallelCoordinator"},
}


@pytest.mark.parametrize("package", [runtime, actors], ids=lambda p: p.__name__)
def test_the_seeds_names_are_exported(package: object) -> None:
    assert SEED_NAMES[package] <= set(package.__all__)  # type: ignore[attr-defined]


@pytest.mark.parametrize("package", [runtime, actors], ids=lambda p: p.__name__)
def test_every_export_is_defined_in_a_layer_module(package: object) -> None:
    name = package.__name__  # type: ignore[attr-defined]
    for export in package.__all__:  # type: ignore[attr-defined]
        value = getattr(package, export)
        home = getattr(value, "__module__", None)
        if home is None:  # a constant: it must still be importable from a submodule
            continue
        assert home.startswith(name + "."), f"{name}.{export} is defined in {home}"
        assert getattr(importlib.import_module(home), export) is value


def test_internals_are_not_exported() -> None:
    internals = {"CoordinatorCore", "AdmissionGate", "Link", "MemoryLink", "CoordinatorClient"}
    internals |= {"ComputeActor", "GradCommActor", "OptimizerActor", "CharTransformer"}
    assert not internals & (set(runtime.__all__) | set(actors.__all__))
    assert len(runtime.__all__) <= 40 and len(actors.__all__) <= 12


@pytest.mark.parametrize("package", [runtime, actors], ids=lambda p: p.__name__)
def test_all_lists_exactly_the_public_names(package: object) -> None:
    # dir() and getattr(), not vars(): runtime loads its re-exports on first use (PEP 562).
    public = {
        key
        for key in dir(package)
        if not key.startswith("_") and not isinstance(getattr(package, key), type(runtime))
    }
    assert public == set(package.__all__)  # type: ignore[attr-defined]


def test_import_paramsync_loads_nothing_but_its_root() -> None:
    # torch imports paramsync.torch_entry at ``import torch``: the root it runs first must not
    # pull in the engine, the worker, torch or trio.
    code = (
        "import sys, paramsync\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('paramsync', 'torch', 'trio', 'cbor2')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['paramsync']"


def test_the_root_exports_the_front_doors_the_configurations_the_errors_and_testing() -> None:
    page = _api_page()
    groups = dict(page.groups(paramsync))
    assert list(groups) == ["the front doors", "the configurations", "the errors", "namespaces"]
    assert groups["the front doors"] == [
        "BACKEND_NAME",
        "DistributedDataParallel",
        "SyncTrainer",
        "trainer_from_env",
    ]
    assert paramsync.BACKEND_NAME == "paramsync"
    assert paramsync.DistributedDataParallel is actors.DistributedDataParallel
    assert paramsync.SyncTrainer is actors.SyncTrainer
    assert paramsync.trainer_from_env is actors.trainer_from_env
    for name in groups["the configurations"]:
        assert dataclasses.is_dataclass(getattr(paramsync, name)), name
    for name in groups["the errors"]:
        assert issubclass(getattr(paramsync, name), paramsync.ParamsyncError), name
    assert groups["namespaces"] == ["testing", "runtime", "actors"]
    assert paramsync.runtime is runtime and paramsync.actors is actors
    assert len(paramsync.__all__) <= 30
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        paramsync.nothing  # noqa: B018


@pytest.mark.parametrize("package", [paramsync, paramsync.testing], ids=lambda p: p.__name__)
def test_every_root_export_resolves_to_its_module_s_object(package: Any) -> None:
    for name in package.__all__:
        value = getattr(package, name)
        if isinstance(value, types.ModuleType):
            assert value.__name__.startswith("paramsync."), name
            continue
        home = getattr(value, "__module__", None) or package._WHERE[name]
        assert getattr(importlib.import_module(home), name) is value, name
    assert set(dir(package)) >= set(package.__all__)


def test_the_api_page_is_what_the_docstrings_say() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "api_page.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def _api_page() -> Any:
    spec = importlib.util.spec_from_file_location("api_page", ROOT / "docs" / "api_page.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
