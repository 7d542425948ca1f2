"""Who a process is in a group, and the addresses it dials (seed 002): shared by transports,
collectives and aggregators."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ADVERTISE_ENV",
    "DistributedConfig",
    "advertised_host",
    "parse_address",
]

ADVERTISE_ENV = "PARAMSYNC_ADVERTISE_ADDR"
"""The address a worker listens on for its peers and tells them to dial (``paramsync launch
--advertise-addr``). Unset: the address of the interface its connection to the coordinator
leaves through, which other hosts reach when the coordinator is given by a routable address."""


def advertised_host(environ: Mapping[str, str] | None = None) -> str | None:
    """The host ``$PARAMSYNC_ADVERTISE_ADDR`` names (None: unset or blank). A value with a
    port, or one that is no host name or address, is a ``ValueError`` naming the variable."""
    env = os.environ if environ is None else environ
    text = env.get(ADVERTISE_ENV, "").strip()
    if not text:
        return None
    host = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if len(host) > 253 or not all(c.isalnum() or c in "-." for c in host):
        raise ValueError(
            f"{ADVERTISE_ENV}={text!r} is not a host name or IP address (no port: the worker "
            "picks its own)"
        )
    return host


def parse_address(text: str, *, default_port: int | None = None) -> tuple[str, int]:
    """Parse ``host:port`` (``[v6]:port`` for IPv6) into a (host, port) pair.

    Raises ``ValueError`` naming the text when it is not an address.
    """
    if not isinstance(text, str) or not text:
        raise ValueError(f"address {text!r} is empty; expected host:port")
    host, sep, port_text = text.rpartition(":")
    if text.startswith("[") and "]" in text:
        close = text.index("]")
        host = text[1:close]
        rest = text[close + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"address {text!r} is not host:port")
        port_text = rest[1:] if rest else ""
        sep = ":" if rest else ""
        try:
            ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise ValueError(f"address {text!r}: {host!r} is not an IPv6 address") from exc
    elif not sep:
        host, port_text = text, ""
    elif ":" in host:
        raise ValueError(f"address {text!r}: write IPv6 addresses as [host]:port")
    if not host:
        raise ValueError(f"address {text!r} has no host")
    if not port_text:
        if default_port is None:
            raise ValueError(f"address {text!r} has no port; expected host:port")
        return host, default_port
    if not port_text.isdigit():
        raise ValueError(f"address {text!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"address {text!r}: port {port} is outside 0-65535")
    return host, port


@dataclass(frozen=True)
class DistributedConfig:
    """Who this process is in a group: ``world_size`` ranks, this one ``rank``.

    ``coordinator_addr`` (``host:port``) is where rank 0 listens for the rendezvous in the
    multi-process TCP form; in-process groups leave it empty.
    """

    world_size: int
    rank: int
    coordinator_addr: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise ValueError(f"world_size must be an int, got {self.world_size!r}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise ValueError(f"rank must be an int, got {self.rank!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is out of range for world_size {self.world_size}")
        if self.coordinator_addr:
            parse_address(self.coordinator_addr)

    @property
    def address(self) -> tuple[str, int]:
        """The coordinator address as a (host, port) pair."""
        return parse_address(self.coordinator_addr)
