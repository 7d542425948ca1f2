"""How a trainer builds the actors of its graph: one constructor per actor, replaceable.

`ActorFactory`'s defaults are the actor classes themselves. A harness that must observe or
perturb a trainer it does not build itself (the fault trials' SIGKILL wrappers in
`actors.testing.faults`) passes subclasses instead; the trainer calls the factory with the same
arguments either way and knows nothing of what it gets beyond the actors' interfaces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from actors.graph.compute import ComputeActor
from actors.graph.gradcomm import GradCommActor
from actors.graph.loader import DataLoaderActor
from actors.graph.optimizer import OptimizerActor

__all__ = ["ActorFactory"]


@dataclass(frozen=True)
class ActorFactory:
    """The constructors a trainer builds each epoch's actors (and `fit`'s loader) with; each
    takes the arguments of the class it defaults to."""

    compute: Callable[..., ComputeActor] = ComputeActor
    comm: Callable[..., GradCommActor] = GradCommActor
    optimizer: Callable[..., OptimizerActor] = OptimizerActor
    loader: Callable[..., DataLoaderActor] = DataLoaderActor
