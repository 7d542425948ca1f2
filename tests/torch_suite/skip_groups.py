"""Which of torch's distributed tests the paramsync run skips or adds, read from torch's source.

* `accelerator_skips`: tests torch gates on accelerators (``@skip_if_no_gpu``,
  ``@skip_if_lt_x_gpu(n)``) when this machine has fewer CUDA devices than they need. torch
  skips them inside every rank; deciding it here, from the decorators in torch's source,
  gives the same verdict without starting the ranks. Their skip message starts with
  ``[accelerator]``, the group the report files them under (`group_of`).
* `GLOO_APPLICABLE_RUN`: tests torch skips for gloo that gloo runs (CPU ``all_to_all_single``,
  gated on MPI): the run runs them.
* `large_world_tests`: the tests torch runs only from 8 ranks up.

torch's gates decide as for gloo (`paramsync_case`): its other skips (NCCL-only, MPI-only,
world size, known torch issues) stay torch's, each its own group, with torch's reason. Nothing
is skipped for the backend's sake: an operation it does not run is refused by the test, at the
call, with one line (the runner counts it apart, as refused).
"""

from __future__ import annotations

import ast
import inspect

import torch

__all__ = [
    "GLOO_APPLICABLE_RUN",
    "accelerator_skips",
    "large_world_tests",
    "group_of",
]


CPU_ALL_TO_ALL_SINGLE = "Only MPI supports CPU all_to_all_single"
"""torch's reason for skipping its CPU ``all_to_all_single`` tests on any backend but MPI."""

GLOO_APPLICABLE_RUN: dict[str, str] = {
    f"test_all_to_all_single_{split}_split{scope}": CPU_ALL_TO_ALL_SINGLE
    for split in ("equal", "unequal")
    for scope in ("", "_complex", "_full_group", "_group")
}
"""Tests torch gates on MPI that gloo runs all the same (test -> torch's reason): gloo runs
``all_to_all_single`` on CPU tensors, equal and unequal splits (``ProcessGroupGloo``'s
``alltoall_base``), and their bodies are the same calls; the paramsync run runs them."""


ACCELERATOR_GROUP = "accelerator"


def group_of(reason: str) -> str:
    """The group a skip message belongs to: ``[name] ...`` gives ``name``; torch's own
    reasons are their own group."""
    if reason.startswith("[") and "]" in reason:
        return reason[1 : reason.index("]")]
    return reason


def _needed_devices(decorators: list[ast.expr], world_size: int) -> int:
    """The CUDA devices a test's decorators ask for (0: none); ``@skip_if_no_gpu`` asks for
    one per rank."""
    needed = 0
    for node in decorators:
        if isinstance(node, ast.Name) and node.id == "skip_if_no_gpu":
            needed = max(needed, world_size)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "skip_if_lt_x_gpu"
            and not any(k.arg == "allow_cpu" for k in node.keywords)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, int)
        ):
            needed = max(needed, node.args[0].value)
    return needed


def _decorated(names: list[str]) -> dict[str, list[ast.expr]]:
    """test -> its decorators in torch's source, for the tests among ``names``."""
    from torch.testing._internal.distributed import distributed_test

    tree = ast.parse(inspect.getsource(distributed_test))
    present = set(names)
    return {
        node.name: node.decorator_list
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name in present
    }


def large_world_tests(names: list[str]) -> list[str]:
    """The tests among ``names`` that torch runs only at world size 8 or more
    (``@skip_if_small_worldsize``: its ``*_group`` tests, on ``new_group([1, 2])``)."""
    return sorted(
        name
        for name, decorators in _decorated(names).items()
        if any(isinstance(d, ast.Name) and d.id == "skip_if_small_worldsize" for d in decorators)
    )


def accelerator_skips(names: list[str], world_size: int) -> dict[str, str]:
    """test -> skip message for the tests among ``names`` whose decorators in torch's source
    need more CUDA devices than this machine has."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    reasons: dict[str, str] = {}
    for name, decorators in _decorated(names).items():
        needed = _needed_devices(decorators, world_size)
        if needed > have:
            reasons[name] = (
                f"[{ACCELERATOR_GROUP}] needs {needed} CUDA device(s) (torch's "
                f"@skip_if_no_gpu / @skip_if_lt_x_gpu); this machine has {have}"
            )
    return reasons
