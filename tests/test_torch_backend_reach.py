"""Where a torch backend group's listeners bind and what they tell the others
(`paramsync.actors.torch_backend.reach`). The run across two hosts whose own names resolve to
loopback is `tests/test_multihost.py::test_hosts_whose_own_name_is_loopback_train_on_the_backend`
(soak)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from paramsync.actors.torch_backend import reach
from paramsync.actors.torch_backend.reach import coordinator_reach, mesh_reach, spans_hosts


def test_the_launchers_variables_say_whether_the_job_spans_hosts() -> None:
    assert spans_hosts({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    assert not spans_hosts({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert not spans_hosts({"WORLD_SIZE": "4"})  # no launcher said: as before
    assert not spans_hosts({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "x"})


def test_a_rank_on_the_coordinators_host_listens_everywhere_and_gives_its_name() -> None:
    """Reached over loopback through the name ``nodea`` in a job across hosts: the others
    resolve nodea to this host, never to their own loopback."""
    assert mesh_reach("nodea", "127.0.1.1", spanning=True) == ("0.0.0.0", "nodea")
    assert mesh_reach("nodea", "::1", spanning=True) == ("::", "nodea")
    # As before: a routable address, one host, or a loopback name or address dialed.
    assert mesh_reach("nodea", "10.0.0.2", spanning=True) == ("10.0.0.2", "10.0.0.2")
    assert mesh_reach("nodea", "127.0.1.1", spanning=False) == ("127.0.1.1", "127.0.1.1")
    assert mesh_reach("localhost", "127.0.0.1", spanning=True) == ("127.0.0.1", "127.0.0.1")
    assert mesh_reach("127.0.0.1", "127.0.0.1", spanning=True) == ("127.0.0.1", "127.0.0.1")


async def test_a_coordinator_named_by_a_loopback_name_listens_everywhere_across_hosts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    names = {"nodea": "127.0.1.1", "nodeb": "10.0.0.2", "node6": "::1"}

    async def resolve(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        if host not in names:
            raise socket.gaierror(socket.EAI_NONAME, "no such host")
        family = socket.AF_INET6 if ":" in names[host] else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (names[host], port))]

    monkeypatch.setattr(reach.trio.socket, "getaddrinfo", resolve)
    assert await coordinator_reach("nodea", spanning=True) == ("0.0.0.0", "nodea")
    assert await coordinator_reach("node6", spanning=True) == ("::", "node6")
    assert await coordinator_reach("nodeb", spanning=True) == ("nodeb", "nodeb")
    assert await coordinator_reach("nodea", spanning=False) == ("nodea", "nodea")
    assert await coordinator_reach("10.0.0.1", spanning=True) == ("10.0.0.1", "10.0.0.1")
    assert await coordinator_reach("localhost", spanning=True) == ("localhost", "localhost")
    # A name that does not resolve is bound as it is: binding names the problem.
    assert await coordinator_reach("nosuch", spanning=True) == ("nosuch", "nosuch")
