"""Where a group's listeners bind, and the host they give the others, when ranks span hosts.

A group's coordinator listens on the host rank 0 is named by (``MASTER_ADDR``: torchrun's
``--local-addr``, else rank 0's FQDN), and each rank's mesh listener on the address its
connection to the coordinator leaves from; both are told to the others as they are. That fails
when a host's own name resolves, on that host, to a loopback address (``127.0.1.1 name`` in
Debian's ``/etc/hosts``, a container's) while the other hosts resolve it to the host's real
address, as torch's store and NCCL expect: the coordinator would listen on loopback only, and
the ranks on rank 0's host (which reach the coordinator over loopback) would give the others a
loopback address. torch's own store listens on every interface, so it works there.

The rule: when the job spans hosts (torchrun's ``LOCAL_WORLD_SIZE`` below ``WORLD_SIZE``) and a
listener's address is loopback although the host it was reached by is a name that is not
``localhost`` nor a loopback address, it listens on every interface of that family and gives
the others the name, which each host resolves as it resolves torch's store. Listeners take
only authenticated peers (the shared secret). Anything else binds and is told as before.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping

import trio

__all__ = ["Reach", "coordinator_reach", "mesh_reach", "spans_hosts", "local_address"]

Reach = tuple[str, str]
"""``(bind, advertised)``: the host a listener binds, and the host the other ranks dial."""


def spans_hosts(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the launcher says this job's ranks run on more than one host: torchrun (and
    ``paramsync launch``) set ``LOCAL_WORLD_SIZE`` below ``WORLD_SIZE`` then."""
    env = os.environ if environ is None else environ
    local, world = env.get("LOCAL_WORLD_SIZE", "").strip(), env.get("WORLD_SIZE", "").strip()
    return local.isdigit() and world.isdigit() and int(local) < int(world)


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _is_name(host: str) -> bool:
    """``host`` is a host name other than localhost (not an address)."""
    if host.lower().rstrip(".") in ("localhost", "localhost.localdomain"):
        return False
    try:
        ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return True
    return False


def _wildcard(address: str) -> str:
    return "::" if ":" in address else "0.0.0.0"


def mesh_reach(dialed: str, local: str, *, spanning: bool | None = None) -> Reach:
    """A rank's mesh listener: ``local`` is the address its connection to the coordinator
    left from, ``dialed`` the host it dialed the coordinator at. Loopback reached through a
    name, in a job across hosts: this rank is on the coordinator's host, which the others
    know by that name."""
    spanning = spans_hosts() if spanning is None else spanning
    if spanning and _loopback(local) and _is_name(dialed):
        return _wildcard(local), dialed
    return local, local


async def coordinator_reach(host: str, *, spanning: bool | None = None) -> Reach:
    """Rank 0's coordinator, named ``host``: bind ``host`` and give it as it is, unless it is
    a name that resolves here to loopback only in a job across hosts (then every interface
    of that family, and the name)."""
    spanning = spans_hosts() if spanning is None else spanning
    if not (spanning and _is_name(host)):
        return host, host
    try:
        found = await trio.socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError:
        return host, host  # binding says why, naming the host
    addresses = [str(info[4][0]) for info in found]
    if addresses and all(_loopback(address) for address in addresses):
        return _wildcard(addresses[0]), host
    return host, host


async def local_address(host: str, port: int) -> str:
    """The address of this machine that a connection to ``host:port`` leaves from (a
    sub-coordinator of the coordinator tree listens there: its host's ranks reach it, and so
    does a peer on another host that is given the address). No packet is sent."""
    found = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    family, _, _, _, address = found[0]
    with trio.socket.socket(family, socket.SOCK_DGRAM) as sock:
        await sock.connect(address)
        return str(sock.getsockname()[0])
