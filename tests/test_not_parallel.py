"""The refusal of a run that is silently not data-parallel
(`paramsync.actors.torch_backend.not_parallel`), in one process: a group's watch stands in for
a paramsync group of two ranks (each group makes one as it forms, and reports every call to
it); the optimizer steps are real ones, through torch's global step hooks. The refusal on a
real run (Accelerate's ``DistributedType.NO`` on a paramsync group of two processes) is in
tests/test_frameworks.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from paramsync.actors.torch_backend.not_parallel import (
    LOCAL_STEPS_ENV,
    NotDataParallel,
    ParallelWatch,
    watch_parallel,
)
from paramsync.runtime.errors import ConfigError


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> Iterator[ParallelWatch]:
    """The watch of group "7", rank 1 of 2, forgotten afterwards (as destroy_process_group
    does), so no other test's optimizer steps are counted; two local steps allowed."""
    monkeypatch.setenv(LOCAL_STEPS_ENV, "2")
    watch = watch_parallel("7", 1, 2)
    try:
        yield watch
    finally:
        watch.forget()


def _model() -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: torch.nn.Linear, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()


def test_the_step_past_the_allowance_is_refused_naming_the_rank_the_size_and_the_cause(
    group: ParallelWatch,
) -> None:
    model, optimizer = _model()
    _step(model, optimizer)
    _step(model, optimizer)  # two local steps are allowed here (a warm-up)
    before = model.weight.detach().clone()
    with pytest.raises(NotDataParallel) as caught:
        _step(model, optimizer)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "paramsync group 7, rank 1 of 2: optimizer step 3 applies this rank's own gradients"
    ), message
    assert "DistributedDataParallel" in message and "DistributedType.NO" in message, message
    assert torch.equal(model.weight, before)  # refused before the step changed anything


def test_a_reduction_on_the_group_disarms_the_check_for_good(group: ParallelWatch) -> None:
    model, optimizer = _model()
    group.saw("broadcast")  # DDP's broadcast of rank 0's state is no reduction
    group.saw("allgather")
    _step(model, optimizer)
    _step(model, optimizer)
    group.saw("reduce_scatter_tensor")  # FSDP's gradients
    for _ in range(5):
        _step(model, optimizer)


def test_steps_without_a_gradient_are_not_counted(group: ParallelWatch) -> None:
    model, optimizer = _model()
    for _ in range(4):  # as torch's distributed checkpoint makes an optimizer's state
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    optimizer.step()
    _step(model, optimizer)
    _step(model, optimizer)
    with pytest.raises(NotDataParallel, match="optimizer step 3 "):
        _step(model, optimizer)


def test_local_steps_are_configurable_and_the_check_can_be_off(
    group: ParallelWatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = _model()
    monkeypatch.setenv(LOCAL_STEPS_ENV, "off")
    for _ in range(4):
        _step(model, optimizer)
    monkeypatch.setenv(LOCAL_STEPS_ENV, "5")  # the steps taken with the check off not counted
    for _ in range(5):
        _step(model, optimizer)
    with pytest.raises(NotDataParallel, match="optimizer step 6 "):
        _step(model, optimizer)
    monkeypatch.setenv(LOCAL_STEPS_ENV, "some")
    with pytest.raises(ConfigError, match="PARAMSYNC_LOCAL_STEPS='some' is not a number"):
        _step(model, optimizer)


def test_twenty_local_steps_are_allowed_by_default(
    group: ParallelWatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(LOCAL_STEPS_ENV)
    model, optimizer = _model()
    for _ in range(20):  # a local reference model trained first, as torch's DDP tests do
        _step(model, optimizer)
    with pytest.raises(NotDataParallel, match="optimizer step 21 "):
        _step(model, optimizer)


def test_a_group_of_one_rank_or_an_ended_group_is_never_armed() -> None:
    model, optimizer = _model()
    alone = watch_parallel("8", 0, 1)
    ended = watch_parallel("9", 0, 2)
    ended.forget()
    for _ in range(25):
        _step(model, optimizer)
    alone.forget()


def test_one_live_group_that_reduced_lets_another_group_step(group: ParallelWatch) -> None:
    """Data parallelism over a subgroup: the world group never reduces, the subgroup does."""
    model, optimizer = _model()
    subgroup = watch_parallel("8", 0, 2)
    try:
        subgroup.saw("allreduce")
        for _ in range(5):
            _step(model, optimizer)
    finally:
        subgroup.forget()
