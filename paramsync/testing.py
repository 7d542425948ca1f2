"""paramsync.testing: check your own deployment, transport or fault handling against paramsync's.

The tools paramsync's own suite uses, for yours (as trio's `trio.testing` serves trio's users):

- **a deployment**: `check_deployment` plays hostile and valid peers against a live coordinator
  or worker listener and raises `DeploymentFault` (a pytest failure, with hypothesis's minimal
  example) if it admits, answers or acts on anything it must refuse; `hostile_machine` is the
  hypothesis state machine underneath, `Deployment` its target; ``paramsync fuzz`` is the
  command line. `strategies` holds hypothesis strategies for every frame of the wire protocol,
  valid and hostile, and for tensors.
- **a transport**: `check_transport` runs the transport conformance suite (every rule a
  transport under paramsync's collectives must keep) against a group your factory builds, and
  raises `ConformanceError` at the first broken rule.
- **faults, injected by wrapping**: `Fault` (a phase and a step: where a process dies),
  `FaultyTransport` (a transport that dies mid-collective), `faulty_actors` and `armed` (a
  worker's actors that die at a phase).

hypothesis is needed by the first group; it is in the ``test`` extra
(``pip install 'paramsync[test]'``). Nothing loads before it is used.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from paramsync.actors.testing.faults import armed, faulty_actors
    from paramsync.runtime.testing import strategies
    from paramsync.runtime.testing.faults import Fault, FaultyTransport
    from paramsync.runtime.testing.hostile import (
        Deployment,
        DeploymentFault,
        check_deployment,
        hostile_machine,
    )
    from paramsync.runtime.testing.transport_conformance import ConformanceError, check_transport

__all__ = [
    # a deployment
    "check_deployment",
    "DeploymentFault",
    "Deployment",
    "hostile_machine",
    "strategies",
    # a transport
    "check_transport",
    "ConformanceError",
    # faults, injected by wrapping
    "Fault",
    "FaultyTransport",
    "faulty_actors",
    "armed",
]

_WHERE = {
    "check_deployment": "paramsync.runtime.testing.hostile",
    "DeploymentFault": "paramsync.runtime.testing.hostile",
    "Deployment": "paramsync.runtime.testing.hostile",
    "hostile_machine": "paramsync.runtime.testing.hostile",
    "check_transport": "paramsync.runtime.testing.transport_conformance",
    "ConformanceError": "paramsync.runtime.testing.transport_conformance",
    "Fault": "paramsync.runtime.testing.faults",
    "FaultyTransport": "paramsync.runtime.testing.faults",
    "faulty_actors": "paramsync.actors.testing.faults",
    "armed": "paramsync.actors.testing.faults",
}
"""Each exported name's module (`strategies` is the module itself)."""


def __getattr__(name: str) -> _typing.Any:
    if name == "strategies":
        value = _importlib.import_module("paramsync.runtime.testing.strategies")
    elif name in _WHERE:
        value = getattr(_importlib.import_module(_WHERE[name]), name)
    else:
        raise AttributeError(f"module 'paramsync.testing' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
