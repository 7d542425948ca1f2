"""How a trainer builds the actors of its graph: one constructor per actor, replaceable.

`ActorFactory`'s defaults are the actor classes themselves. A trainer builds its actors with
the factory it is given (``actors=``), else with the one `actors_in_context` set around the code
that builds it, else with the plain classes. A harness that must observe or perturb a trainer it
does not build itself (the fault trials' SIGKILL wrappers in `paramsync.actors.testing.faults`,
around a worker daemon's job) runs that code inside ``with actors_in_context(factory):``: the
factory holds for the tasks and threads started inside the block (a context variable) and nowhere
else. The trainer calls the factory with the same arguments either way and knows nothing of what it
gets beyond the actors' interfaces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from paramsync.actors.graph.compute import ComputeActor
from paramsync.actors.graph.gradcomm import GradCommActor
from paramsync.actors.graph.loader import DataLoaderActor
from paramsync.actors.graph.optimizer import OptimizerActor

__all__ = ["ActorFactory", "actors_in_context", "context_actors"]


@dataclass(frozen=True)
class ActorFactory:
    """The constructors a trainer builds each epoch's actors (and `fit`'s loader) with; each
    takes the arguments of the class it defaults to."""

    compute: Callable[..., ComputeActor] = ComputeActor
    comm: Callable[..., GradCommActor] = GradCommActor
    optimizer: Callable[..., OptimizerActor] = OptimizerActor
    loader: Callable[..., DataLoaderActor] = DataLoaderActor


_PLAIN = ActorFactory()
_CONTEXT_ACTORS: ContextVar[ActorFactory | None] = ContextVar(
    "paramsync_actor_factory", default=None
)


def context_actors() -> ActorFactory:
    """The factory a trainer given no ``actors=`` builds with here: the innermost
    `actors_in_context`'s, else the plain actor classes."""
    return _CONTEXT_ACTORS.get() or _PLAIN


@contextmanager
def actors_in_context(factory: ActorFactory) -> Iterator[ActorFactory]:
    """Within the block (and the tasks and threads started inside it), trainers given no
    ``actors=`` build their actors with ``factory``; the previous factory holds again after."""
    if not isinstance(factory, ActorFactory):
        raise TypeError(f"actors_in_context takes an ActorFactory, not {type(factory).__name__}")
    token = _CONTEXT_ACTORS.set(factory)
    try:
        yield factory
    finally:
        _CONTEXT_ACTORS.reset(token)
