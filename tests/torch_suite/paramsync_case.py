"""torch's own distributed test suite (``DistributedTest._DistTestBase``) on the paramsync backend.

Imported by ``run_torch_suite.py`` (with ``BACKEND=paramsync``, ``WORLD_SIZE`` and ``TEMP_DIR``
set, as torch's ``test/distributed/test_distributed_spawn.py`` expects them) and, by reference,
in every rank process the tests spawn. Importing it:

* registers the backend (the ``torch.backends`` entry point does it too; this makes a
  checkout that is not installed work the same);
* declares what the backend implements the way out-of-tree backends do, in
  `DistTestCases.backend_feature` (DDP, subgroups, CUDA tensors staged through host memory,
  a plugin backend) and `DistTestCases.skip_collective` (the collectives it refuses), before
  ``distributed_test`` is imported, since its decorators read them at import time;
* defines `TestDistBackendWithSpawn`, torch's ``_DistTestBase`` on ``MultiProcessTestCase``
  spawning, and marks as skipped, with the reason, the tests that need accelerators this
  machine does not have;
* runs the tests of `skip_groups.GLOO_GATED_RUN`, which torch gates on the backend's name
  alone (``@require_backend_is_available({"gloo"})``) and whose bodies use nothing of gloo's.
"""

from __future__ import annotations

import os
import unittest

import torch
from skip_groups import GLOO_GATED_RUN, accelerator_skips
from torch.testing._internal.common_distributed import DistTestCases

import paramsync.torch_entry as entry

entry.register()
BACKEND = os.environ["BACKEND"]

for _feature in ("ddp", "subgroup", "gpu", "cuda", "plugin"):
    DistTestCases.backend_feature[_feature].add(BACKEND)
# recv without a named source is refused (UnsupportedCall names the source to give).
DistTestCases.skip_collective["sendrecv anysource"].add(BACKEND)

import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
    _build_tensor,
)

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


def _unskip_gloo_gated() -> None:
    """Run the tests torch gates on gloo by name only (`skip_groups.GLOO_GATED_RUN`)."""
    for name in GLOO_GATED_RUN:
        method = getattr(TestDistBackendWithSpawn, name)
        why = getattr(method, "__unittest_skip_why__", "")
        if "to be one of {'gloo'}" not in why:
            raise ValueError(f"{name} is not gated on gloo by name in this torch ({why!r})")
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


_unskip_gloo_gated()
SKIPPED_HERE = _mark_skips()
