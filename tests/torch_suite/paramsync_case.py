"""torch's own distributed test suite (``DistributedTest._DistTestBase``) on the paramsync backend.

Imported by ``run_torch_suite.py`` (with ``WORLD_SIZE`` and ``TEMP_DIR`` set, as torch's
``test/distributed/test_distributed_spawn.py`` expects them) and, by reference, in every rank
process the tests spawn. The selection is gloo's: every test torch runs with ``BACKEND=gloo``
on a CPU-only machine runs, and every group those tests make runs on paramsync. Importing it:

* registers the backend (the ``torch.backends`` entry point does it too; this makes a
  checkout that is not installed work the same);
* sets ``BACKEND=gloo`` before ``distributed_test`` is imported, so torch's gates (its
  decorators, read at import time, and the branches of the test bodies, read when they run)
  decide as they do for gloo: what gloo runs, with gloo's expectations;
* makes the groups paramsync groups: ``init_process_group`` and ``new_group`` called with
  ``backend="gloo"`` (the suite's ``BACKEND``), or with none (the default group's), create
  ``paramsync`` groups (`_as_paramsync`), so every collective of the selection runs on the
  backend and ``dist.get_backend()`` answers ``paramsync``;
* defines `TestDistBackendWithSpawn`, torch's ``_DistTestBase`` on ``MultiProcessTestCase``
  spawning, runs the tests torch skips for gloo though gloo runs them
  (`skip_groups.GLOO_APPLICABLE_RUN`: CPU ``all_to_all_single``, which torch gates on MPI), and
  marks as skipped, with the reason, the tests that need accelerators this machine does not
  have.
"""

from __future__ import annotations

import contextlib
import functools
import os
import unittest
from collections.abc import Callable, Iterator
from typing import Any

import torch
from skip_groups import GLOO_APPLICABLE_RUN, accelerator_skips

import paramsync.torch_entry as entry

entry.register()
GATES_AS = "gloo"
"""The backend torch's gates decide for: the selection is what torch runs for it."""
BACKEND_NAME = entry.BACKEND_NAME
"""The backend every group of the selection runs on."""
os.environ["BACKEND"] = GATES_AS

import torch.distributed as dist  # noqa: E402
import torch.distributed.distributed_c10d as c10d  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
    _build_tensor,
)


def _paramsync_backend(backend: Any) -> Any:
    """``backend`` for a group the suite makes: gloo's becomes paramsync's."""
    if backend is not None and str(backend).lower() == GATES_AS:
        return BACKEND_NAME
    return backend


_BACKEND_POSITION = {"init_process_group": 0, "new_group": 2}
"""Where each wrapped function takes ``backend`` positionally."""


def _as_paramsync(make: Callable[..., Any]) -> Callable[..., Any]:
    """``make`` (torch's ``init_process_group`` or ``new_group``) creating a paramsync group
    where the suite asks for a gloo one."""

    @functools.wraps(make)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs:
            kwargs["backend"] = _paramsync_backend(kwargs["backend"])
        position = _BACKEND_POSITION[make.__name__]
        if len(args) > position:
            args = (*args[:position], _paramsync_backend(args[position]), *args[position + 1 :])
        return make(*args, **kwargs)

    wrapper.__paramsync_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


for _module in (dist, c10d):
    for _name in ("init_process_group", "new_group"):
        _make = getattr(_module, _name)
        if not getattr(_make, "__paramsync_wrapped__", False):
            setattr(_module, _name, _as_paramsync(_make))


@contextlib.contextmanager
def _suite_backend(name: str) -> Iterator[None]:
    """The suite's ``BACKEND`` is ``name`` inside (for a test that compares names only)."""
    before = distributed_test.BACKEND
    distributed_test.BACKEND = name
    try:
        yield
    finally:
        distributed_test.BACKEND = before


START_METHOD_ENV = "PARAMSYNC_TORCH_SUITE_START"
"""How the rank processes start: ``fork`` (the default) or ``spawn``."""


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc]
    """torch's distributed tests, one process per rank, on ``BACKEND``.

    torch's ``test_distributed_spawn.py`` spawns the ranks; each then imports torch and its
    test modules again before the test starts (15 s a rank on a busy 2-core machine). Forked
    ranks start from the runner's imports instead (torch ran this suite forked as
    ``test_distributed_fork.py``); ``PARAMSYNC_TORCH_SUITE_START=spawn`` spawns them.
    """

    def setUp(self) -> None:
        super().setUp()
        method = os.environ.get(START_METHOD_ENV, "fork")
        if method == "spawn":
            self._spawn_processes()
        elif method == "fork":
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            raise ValueError(f"{START_METHOD_ENV}={method!r}: use fork or spawn")
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    def test_get_backend(self) -> None:
        """torch's test_get_backend, comparing each group's backend with the backend the
        groups run on (paramsync), not with the backend the gates decide for (gloo)."""
        with _suite_backend(BACKEND_NAME):
            super().test_get_backend()

    # torch's suite tests reduce-scatter on CUDA tensors only (test_reduce_scatter_v_cuda,
    # test_reduce_scatter_tensor_cuda). These two are their bodies on CPU tensors, with the
    # suite's own helpers and expected values.

    def test_reduce_scatter_v_cpu(self) -> None:
        """test_reduce_scatter_v_cuda on CPU: uneven parts (rank r keeps r + 1 rows)."""
        self._barrier()
        group, group_id, rank = self._init_global_test()
        splits = [src + 1 for src in group]
        start = sum(splits[:rank])
        total = sum(splits)
        for async_op in (True, False):
            tensor = _build_tensor(total, 10)
            tensor[start : start + splits[rank]].fill_(2)
            out = torch.empty(splits[rank], total, total).fill_(-1)
            req = dist.reduce_scatter(
                out, list(torch.split(tensor, splits)), dist.ReduceOp.SUM, group_id, async_op
            )
            if async_op:
                req.wait()
            expected = torch.empty(splits[rank], total, total).fill_(2 + 10 * (len(group) - 1))
            self.assertEqual(out, expected)
        self._barrier()

    def test_reduce_scatter_tensor_cpu(self) -> None:
        """test_reduce_scatter_tensor_cuda on CPU: concatenated, then stacked input."""
        group, group_id, rank = self._init_global_test()
        size = 2
        tensor_in = torch.arange(len(group) * size)
        expected = torch.arange(rank * size, (rank + 1) * size) * len(group)
        for shaped in (tensor_in, tensor_in.reshape(len(group), size)):
            out = self._reduce_scatter_tensor_helper(
                torch.zeros(size, dtype=torch.int64), shaped, group_id, rank, cuda=False
            )
            self.assertEqual(out, expected)
            self._barrier()


def _run_gloo_applicable() -> None:
    """Run the tests torch skips for gloo that gloo runs (`skip_groups.GLOO_APPLICABLE_RUN`)."""
    for name, reason in GLOO_APPLICABLE_RUN.items():
        method = getattr(TestDistBackendWithSpawn, name)
        why = getattr(method, "__unittest_skip_why__", "")
        if why != reason:
            raise ValueError(f"{name}: torch no longer skips it as {reason!r} ({why!r})")
        del method.__unittest_skip__
        del method.__unittest_skip_why__


def _mark_skips() -> dict[str, str]:
    """Mark the tests that need accelerators this machine lacks; returns test -> reason."""
    reasons: dict[str, str] = {}
    names = [n for n in dir(TestDistBackendWithSpawn) if n.startswith("test_")]
    reasons.update(accelerator_skips(names, int(os.environ["WORLD_SIZE"])))
    for name, reason in reasons.items():
        method = getattr(TestDistBackendWithSpawn, name)
        if getattr(method, "__unittest_skip__", False):
            continue  # torch skips it already, with its own reason
        setattr(TestDistBackendWithSpawn, name, unittest.skip(reason)(method))
    return reasons


_run_gloo_applicable()
SKIPPED_HERE = _mark_skips()
