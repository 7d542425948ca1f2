"""The worker's fault wrappers: its actors, subclassed to SIGKILL the process at one point.

`faulty_actors(fault)` is an `ActorFactory` whose actor for the fault's phase is wrapped, the
others plain; ``with armed(fault):`` makes it the factory of the trainers built inside the block
(what `paramsync.runtime.testing.faulty_daemon` wraps a worker daemon's job in). The points,
each before the phase's work of the fault's step:

- ``data``: the trainer takes the step's batch from the data loader;
- ``forward``: the compute actor calls the loss function (the step's first micro-batch);
- ``backward``: the loss function has returned, backward has not begun;
- ``allreduce``: the step's first gradient all-reduce has sent its first frame (a
  `FaultyTransport`), so this rank's part has started and its peers' is not all in;
- ``optimizer``: the optimizer actor is about to step the optimizer;
- ``digest``: the optimizer actor is about to report the step's state digest.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from paramsync.actors.graph.compute import ComputeActor
from paramsync.actors.graph.factory import ActorFactory, actors_in_context
from paramsync.actors.graph.gradcomm import GradCommActor
from paramsync.actors.graph.loader import DataLoaderActor, LoaderPosition
from paramsync.actors.graph.messages import Backward
from paramsync.actors.graph.optimizer import OptimizerActor
from paramsync.runtime.testing.faults import PHASES, Fault, FaultyTransport
from paramsync.runtime.transport.base import Transport

__all__ = [
    "FaultyComputeActor",
    "FaultyDataLoaderActor",
    "FaultyGradCommActor",
    "FaultyOptimizerActor",
    "armed",
    "faulty_actors",
]


class FaultyDataLoaderActor(DataLoaderActor):
    """Dies (``data``) when the trainer takes the fault step's batch."""

    def __init__(self, *args: Any, fault: Fault, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fault = fault

    async def next_batch(self) -> tuple[LoaderPosition, Any]:
        if self.expects is not None:
            self.fault.strike("data", self.expects[0])
        return await super().next_batch()


class FaultyComputeActor(ComputeActor):
    """Dies (``forward``) as the fault step's forward begins, or (``backward``) between its
    forward and its backward: the loss function is wrapped."""

    def __init__(self, *args: Any, fault: Fault, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fault = fault
        self._step = -1
        inner = self.loss_fn

        def loss_fn(model: torch.nn.Module, micro_batch: Any) -> torch.Tensor:
            self.fault.strike("forward", self._step)
            loss = inner(model, micro_batch)
            self.fault.strike("backward", self._step)
            return loss

        self.loss_fn = loss_fn

    def run_backward(self, message: Backward) -> float:
        self._step = message.step
        return super().run_backward(message)


class FaultyGradCommActor(GradCommActor):
    """Dies (``allreduce``) in the fault step's first all-reduce, right after its first frame
    left (through a `FaultyTransport`); if the collective sent nothing the transport saw (one
    member; the shared-memory plane's threaded mode), right after the collective."""

    def __init__(
        self,
        model: torch.nn.Module,
        buckets: Any,
        transport: Transport,
        *args: Any,
        fault: Fault,
        **kwargs: Any,
    ) -> None:
        self.faulty = FaultyTransport(transport, fault)
        """The epoch's transport this actor was given, wrapped."""
        super().__init__(model, buckets, self.faulty, *args, **kwargs)
        self.fault = fault

    async def reduce_bucket(self, step: int, index: int) -> None:
        if not self.fault.at("allreduce", step):
            await super().reduce_bucket(step, index)
            return
        self.faulty.arm()
        await super().reduce_bucket(step, index)
        self.fault.kill()


class FaultyOptimizerActor(OptimizerActor):
    """Dies (``optimizer``) before the fault step's optimizer step, or (``digest``) before it
    reports the step's state digest.

    The digest is reported by `OptimizerActor.report`, whichever message asks for it: an
    `OptimizerStep` with ``verify`` (each step's overlapped check, where the digest was hashed
    in the step's own thread call) or a `Verify` (an epoch's opening check, a forced one). The
    kill wraps that report, not a message kind: wrapping `Verify` messages alone would miss
    every step whose check runs inside its optimizer step."""

    def __init__(self, *args: Any, fault: Fault, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fault = fault

    def apply(self, step: int) -> None:
        self.fault.strike("optimizer", step)
        super().apply(step)

    async def report(self, step: int, *, force: bool, wait: bool) -> None:
        if force or step % self.client.digest_interval == 0:
            self.fault.strike("digest", step)
        await super().report(step, force=force, wait=wait)


def _wrapped(actor: type, fault: Fault) -> Any:
    def build(*args: Any, **kwargs: Any) -> Any:
        return actor(*args, fault=fault, **kwargs)

    return build


_WRAPPER = {
    "data": ("loader", FaultyDataLoaderActor),
    "forward": ("compute", FaultyComputeActor),
    "backward": ("compute", FaultyComputeActor),
    "allreduce": ("comm", FaultyGradCommActor),
    "optimizer": ("optimizer", FaultyOptimizerActor),
    "digest": ("optimizer", FaultyOptimizerActor),
}


def faulty_actors(fault: Fault) -> ActorFactory:
    """The plain actors, but the one of ``fault.phase`` wrapped to die at ``fault``."""
    if fault.phase not in PHASES:
        raise ValueError(f"fault {fault.phase}:{fault.step}: a worker's phase is one of {PHASES}")
    field, actor = _WRAPPER[fault.phase]
    return ActorFactory(**{field: _wrapped(actor, fault)})


def armed(fault: Fault) -> AbstractContextManager[ActorFactory]:
    """Within the block, every trainer built without ``actors=`` dies at ``fault`` (its
    actors come from `faulty_actors`; `paramsync.actors.graph.factory.actors_in_context`)."""
    return actors_in_context(faulty_actors(fault))
