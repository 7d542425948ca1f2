"""Which coordinator a paramsync process group runs: one flat coordinator, or the coordinator
tree (a sub-coordinator on each host's first rank under a root on rank 0).

Every rank publishes, in the group's torch store, the coordinator kind it was asked for
(``PARAMSYNC_COORDINATOR_KIND``: ``auto``, ``flat`` or ``tree``) and its host key, and reads
every rank's: the layout comes from what all ranks published, so ranks never disagree on it
(nodes configured differently would), and ranks asked for different kinds are refused, named,
before any coordinator starts. ``auto`` (the default) runs the tree when the group's ranks
span more than one host, the flat coordinator on one host; ``tree`` forces it.

A rank's host key is ``PARAMSYNC_HOST_KEY`` when set (tests fake several hosts on one machine
with it), else torchrun's node (``GROUP_RANK``: one agent a node), else the machine's host
name. The hosts are ordered by their lowest rank; a host's ranks need not be contiguous.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from paramsync.runtime.errors import ConfigError

__all__ = [
    "KIND_ENV",
    "HOST_KEY_ENV",
    "KINDS",
    "TreeLayout",
    "coordinator_kind",
    "host_key",
    "plan",
    "decide",
]

KIND_ENV = "PARAMSYNC_COORDINATOR_KIND"
"""``auto`` (default: the tree when the group spans hosts), ``flat`` or ``tree``."""
HOST_KEY_ENV = "PARAMSYNC_HOST_KEY"
"""A rank's host, as the coordinator tree groups ranks (default: torchrun's node, else the
machine's host name)."""
KINDS = ("auto", "flat", "tree")


@dataclass(frozen=True)
class TreeLayout:
    """The group's hosts (each its key and its group ranks, ascending), ordered by their
    lowest rank, and this rank's host index."""

    hosts: tuple[tuple[str, tuple[int, ...]], ...]
    index: int
    rank: int

    @property
    def name(self) -> str:
        return self.hosts[self.index][0]

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.hosts[self.index][1]

    @property
    def first(self) -> bool:
        """Whether this rank is its host's first (it runs the host's sub-coordinator)."""
        return self.ranks[0] == self.rank


def coordinator_kind(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    kind = env.get(KIND_ENV, "").strip().lower() or "auto"
    if kind not in KINDS:
        raise ConfigError(f"{KIND_ENV}={kind!r}: expected one of {', '.join(KINDS)}")
    return kind


def host_key(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    key = env.get(HOST_KEY_ENV, "").strip()
    if key:
        return key
    node = env.get("GROUP_RANK", "").strip()
    if node.isdigit():
        return f"node{node}"
    return socket.gethostname() or "localhost"


def plan(group: str, published: Sequence[tuple[str, str]], rank: int) -> TreeLayout | None:
    """The layout from every rank's (kind, host key), by group rank; None: the flat
    coordinator. ConfigError when ranks asked for different kinds, naming them."""
    kinds: dict[str, list[int]] = {}
    for r, (kind, _) in enumerate(published):
        kinds.setdefault(kind, []).append(r)
    if len(kinds) > 1:
        said = "; ".join(f"ranks {ranks} say {kind!r}" for kind, ranks in kinds.items())
        raise ConfigError(
            f"paramsync group {group}: the ranks ask for different coordinators "
            f"({KIND_ENV}): {said}"
        )
    (kind,) = kinds
    by_host: dict[str, list[int]] = {}
    for r, (_, key) in enumerate(published):
        by_host.setdefault(key, []).append(r)
    if kind == "flat" or (kind == "auto" and len(by_host) < 2):
        return None
    hosts = tuple(sorted(((key, tuple(ranks)) for key, ranks in by_host.items()), key=_first))
    index = next(i for i, (_, ranks) in enumerate(hosts) if rank in ranks)
    return TreeLayout(hosts, index, rank)


def _first(host: tuple[str, tuple[int, ...]]) -> int:
    return host[1][0]


def decide(
    store: Any, key: str, group: str, rank: int, size: int, seconds: float
) -> TreeLayout | None:
    """Publish this rank's kind and host key under ``key`` in the group's ``store``, read
    every rank's, and `plan` (a group of one rank: flat, nothing published)."""
    kind = coordinator_kind()
    if size == 1:
        return None
    store.set(f"{key}/layout/{rank}", f"{kind} {host_key()}")
    keys = [f"{key}/layout/{r}" for r in range(size)]
    store.wait(keys, timedelta(seconds=seconds))
    try:
        values = store.multi_get(keys)  # one round trip
    except (AttributeError, NotImplementedError, RuntimeError):  # a store without it
        values = [store.get(k) for k in keys]
    published = []
    for value in values:
        text = value.decode() if isinstance(value, bytes | bytearray) else str(value)
        their_kind, _, their_host = text.partition(" ")
        published.append((their_kind, their_host))
    return plan(group, published, rank)
