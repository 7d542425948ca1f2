"""The public API: a few names a user reaches for, each defined in the layer it belongs to.

``runtime`` and ``actors`` re-export what a user's code imports (the seeds' names among them);
internals stay importable from their modules but are not exported from the packages.
"""

from __future__ import annotations

import importlib

import pytest

from paramsync import actors, runtime

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
