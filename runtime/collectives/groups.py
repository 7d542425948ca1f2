"""Process groups: a subset of a world's ranks, with its own rank numbering and connections.

A `ProcessGroup` IS a `Transport` over its member ranks, so every collective of
`paramsync.runtime.collectives.ring` (and point-to-point, `paramsync.runtime.collectives.p2p`) runs
on it unchanged: ``await all_reduce(group, tensor)``. Group rank g is the g-th smallest member's
world rank, as in torch's ``new_group``.

Creation is collective, like torch's ``new_group``: every rank of the world calls `new_group`
with the same ranks, in the same order as every other rank, and not while a collective runs on
the world (the TCP form exchanges addresses over the world's connections). Each call draws the
next number of a per-world counter, so every member derives the same group name from the
counter and the sorted ranks; non-members draw the number too and get None back (torch's
``GroupMember.NON_GROUP_MEMBER``).

Each group has connections of its own, as gloo and NCCL communicators do, so collectives in
different groups run at the same time without their frames ever meeting (a rank in a dp and a
tp group may all-reduce in both at once):

- in one process (`InProcessTransport` worlds), a fresh set of memory channels among the members,
  found through the world's shared ``registry``;
- over TCP (`TcpTransport` worlds), a separate mesh of authenticated connections among the
  members. Each member opens a listener, the members exchange their addresses over the world's
  connections (``group_addr``, which also checks that all members create the same group), and
  the mesh forms with the usual dial/accept handshake whose `Identity` carries the group's name:
  a connection of one group is refused by every other. When the members share a host, the
  group attaches its own shared-memory plane (`paramsync.runtime.transport.shm`) on that mesh;
- on torch's data plane (`TorchPlaneTransport` worlds, ``data_plane = "torch"``), a gloo
  communicator of the members' own (and an NCCL one when the world has a CUDA device), formed
  through the epoch's store under a prefix named by the group
  (`TorchPlaneTransport.open_subgroup`): the group is a `NativeProcessGroup`, whose collectives
  run natively on that communicator.

Groups may be built over groups (ranks are then the parent group's ranks). A group is closed
with ``await group.aclose()`` (or ``async with``); closing the world does not close its groups,
except on torch's data plane, where a group belongs to its world's epoch: aborting or closing
the world aborts or closes its groups.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import Any

import torch
import trio

from paramsync.runtime.collectives.group_names import derive_group_name
from paramsync.runtime.errors import CollectiveError, ProtocolError, StallError
from paramsync.runtime.protocol.handshake import Identity
from paramsync.runtime.protocol.messages import GroupAddr
from paramsync.runtime.transport.base import BulkRoute, InProcessTransport, Transport
from paramsync.runtime.transport.capabilities import (
    AllReducePlane,
    BlockingLinkProvider,
    BlockingLinkSet,
    NativeCollectives,
    PolledLinkProvider,
    PolledLinkSet,
    PrecodedFrames,
    SharedMemoryHolder,
)
from paramsync.runtime.transport.shm import attach_shared_memory
from paramsync.runtime.transport.tcp import TcpTransport, form_mesh
from paramsync.runtime.transport.torch_plane import TorchPlaneTransport

__all__ = [
    "ProcessGroup",
    "ParamsyncProcessGroup",
    "NativeProcessGroup",
    "new_group",
    "group_name",
    "derive_group_name",
    "DEFAULT_GROUP_SECONDS",
]

_STALL_SECONDS = 10.0
"""How long a peer may stay silent in a signalled exchange when the members do not say."""

DEFAULT_GROUP_SECONDS = 60.0
"""How long forming one group may take (address exchange, mesh, shared-memory plane)."""


_COUNTERS: weakref.WeakKeyDictionary[Transport, int] = weakref.WeakKeyDictionary()
"""How many groups each world transport has created (every rank counts every call)."""


class ProcessGroup(Transport):
    """One rank's view of a process group: a `Transport` over the members, numbered 0..k-1.

    ``ranks`` are the members' ranks in the parent (sorted); ``rank`` is this rank's group rank.
    Sends and receives go over ``members``, the group's own transport (its own channels, TCP
    connections or torch communicator); the parent's connections are never used after
    creation. `new_group` makes one of the two kinds below, which add the capabilities
    (`paramsync.runtime.transport.capabilities`) of their members' data plane.
    """

    def __init__(
        self, parent: Transport, ranks: tuple[int, ...], name: str, members: Transport
    ) -> None:
        super().__init__(members.rank, members.world_size)
        if len(ranks) != members.world_size or ranks[members.rank] != parent.rank:
            raise CollectiveError(
                f"group {name!r}: member transport rank {members.rank} of {members.world_size} "
                f"does not fit ranks {list(ranks)} seen from parent rank {parent.rank}"
            )
        self.parent = parent
        self.ranks = ranks
        self.name = name
        self.members = members

    # ------------------------------------------------------------------ rank maps

    def parent_rank(self, group_rank: int) -> int:
        """The parent's rank of group rank ``group_rank``."""
        if isinstance(group_rank, bool) or not isinstance(group_rank, int):
            raise CollectiveError(f"group rank must be an int, got {group_rank!r}")
        if not 0 <= group_rank < self.world_size:
            raise CollectiveError(
                f"group {self.name!r} has ranks 0..{self.world_size - 1}, not {group_rank}"
            )
        return self.ranks[group_rank]

    def world_rank(self, group_rank: int) -> int:
        """The world's rank of group rank ``group_rank`` (through every parent group)."""
        rank = self.parent_rank(group_rank)
        parent = self.parent
        return parent.world_rank(rank) if isinstance(parent, ProcessGroup) else rank

    def group_rank(self, parent_rank: int) -> int | None:
        """This group's rank of the parent's rank ``parent_rank`` (None: not a member)."""
        try:
            return self.ranks.index(parent_rank)
        except ValueError:
            return None

    @property
    def world_ranks(self) -> tuple[int, ...]:
        """The members' world ranks, in group rank order."""
        return tuple(self.world_rank(g) for g in range(self.world_size))

    def describe_peer(self, group_rank: int) -> str:
        """A peer as errors name it: its group rank and its world rank."""
        return f"group rank {group_rank} (world rank {self.world_rank(group_rank)})"

    # ------------------------------------------------------------------ Transport

    async def send(
        self, peer: int, kind: str, fields: Mapping[str, Any], bulk: torch.Tensor | None = None
    ) -> None:
        await self.members.send(peer, kind, fields, bulk)

    async def recv(self, peer: int) -> dict[str, Any]:
        return await self.members.recv(peer)

    async def recv_into(self, peer: int, out: torch.Tensor) -> dict[str, Any]:
        return await self.members.recv_into(peer, out)

    async def recv_routed(
        self, peer: int, route: BulkRoute, *, max_bulk: int = 0
    ) -> dict[str, Any]:
        return await self.members.recv_routed(peer, route, max_bulk=max_bulk)

    def abort(self) -> None:
        self.members.abort()

    async def aclose(self) -> None:
        await self.members.aclose()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name!r}, rank {self.rank} of {self.world_size}, "
            f"ranks {list(self.ranks)})"
        )


class ParamsyncProcessGroup(
    ProcessGroup, BlockingLinkProvider, PolledLinkProvider, SharedMemoryHolder
):
    """A group on paramsync's own data plane (in-process channels or TCP connections). It
    declares every capability such a transport may have and honours each exactly when
    ``members`` does: ``supports_blocking``/``supports_polled`` say so, and the shared-memory
    plane is the members' own."""

    # ------------------------------------------------------------------ capabilities

    @property
    def supports_blocking(self) -> bool:
        members = self.members
        return isinstance(members, BlockingLinkProvider) and members.supports_blocking

    def blocking_links(self, peers: set[int]) -> AbstractAsyncContextManager[BlockingLinkSet]:
        if not isinstance(self.members, BlockingLinkProvider):
            raise CollectiveError(f"group {self.name!r}: its transport lends no blocking links")
        return self.members.blocking_links(peers)

    @property
    def supports_polled(self) -> bool:
        members = self.members
        return isinstance(members, PolledLinkProvider) and members.supports_polled

    def polled_links(self, peers: set[int]) -> AbstractAsyncContextManager[PolledLinkSet]:
        if not isinstance(self.members, PolledLinkProvider):
            raise CollectiveError(f"group {self.name!r}: its transport lends no polled links")
        return self.members.polled_links(peers)

    @property
    def stall_seconds(self) -> float:  # type: ignore[override]  # the members' value, read-only
        members = self.__dict__.get("members")
        return members.stall_seconds if isinstance(members, PrecodedFrames) else _STALL_SECONDS

    async def send_frame(self, peer: int, frame: bytes) -> None:
        await self._precoded().send_frame(peer, frame)

    async def recv_matching(self, peer: int, expected: bytes) -> dict[str, Any] | None:
        return await self._precoded().recv_matching(peer, expected)

    def _precoded(self) -> PrecodedFrames:
        if not isinstance(self.members, PrecodedFrames):
            raise CollectiveError(f"group {self.name!r}: its transport sends no pre-encoded frames")
        return self.members

    @property
    def shared_memory(self) -> AllReducePlane | None:
        """The group's own shared-memory plane, if its members attached one."""
        members = self.__dict__.get("members")
        return members.shared_memory if isinstance(members, SharedMemoryHolder) else None

    @shared_memory.setter
    def shared_memory(self, plane: AllReducePlane | None) -> None:
        members = self.__dict__.get("members")
        if isinstance(members, SharedMemoryHolder):
            members.shared_memory = plane
        elif plane is not None:
            raise CollectiveError(f"group {self.name!r}: its transport holds no shared memory")


class NativeProcessGroup(ProcessGroup, NativeCollectives):
    """A group on torch's data plane: its members' transport (a `TorchPlaneTransport` over a
    communicator of the group's own) runs collectives natively, and
    `paramsync.runtime.collectives.ring` hands them over, as it does to the members' transport
    itself. It lends no links and carries no shared-memory plane (torch's transport has neither)."""

    def __init__(
        self, parent: Transport, ranks: tuple[int, ...], name: str, members: Transport
    ) -> None:
        if not isinstance(members, NativeCollectives):
            raise CollectiveError(
                f"group {name!r}: a {type(members).__name__} runs no native collectives"
            )
        super().__init__(parent, ranks, name, members)
        self.native: NativeCollectives = members

    def native_accepts(self, tensor: torch.Tensor) -> bool:
        return self.native.native_accepts(tensor)

    async def native_all_reduce(self, flat: torch.Tensor, op: str) -> None:
        with self._naming_peers():
            await self.native.native_all_reduce(flat, op)

    async def native_broadcast(self, flat: torch.Tensor, root: int) -> None:
        with self._naming_peers():
            await self.native.native_broadcast(flat, root)

    async def native_all_gather(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        with self._naming_peers():
            await self.native.native_all_gather(out, flat)

    async def native_reduce_scatter(
        self, flat: torch.Tensor, op: str, bounds: list[tuple[int, int]]
    ) -> torch.Tensor:
        with self._naming_peers():
            return await self.native.native_reduce_scatter(flat, op, bounds)

    async def native_barrier(self) -> None:
        with self._naming_peers():
            await self.native.native_barrier()

    @contextmanager
    def _naming_peers(self) -> Iterator[None]:
        """A collective's failure naming its peer by group and world rank (the members'
        transport knows only the group rank)."""
        try:
            yield
        except ProtocolError as exc:
            peer = exc.peer
            if isinstance(peer, bool) or not isinstance(peer, int):
                raise
            if not 0 <= peer < self.world_size:
                raise
            named = type(exc).__new__(type(exc))
            ProtocolError.__init__(
                named, f"group {self.name}: {exc.reason}", peer=self.describe_peer(peer)
            )
            raise named from None


def group_name(parent: Transport, index: int, ranks: Iterable[int]) -> str:
    """The name every member derives for the ``index``-th group of ``parent`` over ``ranks``."""
    base = parent.name if isinstance(parent, ProcessGroup) else "world"
    return derive_group_name(base, index, ranks)


def _check_ranks(world: Transport, ranks: Iterable[int]) -> tuple[int, ...]:
    try:
        listed = list(ranks)
    except TypeError:
        raise CollectiveError(f"group ranks must be a list of ints, got {ranks!r}") from None
    for rank in listed:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise CollectiveError(f"group ranks must be ints, got {rank!r} in {listed}")
        if not 0 <= rank < world.world_size:
            raise CollectiveError(
                f"rank {rank} is not in a world of {world.world_size} (ranks {listed})"
            )
    if not listed:
        raise CollectiveError("a group needs at least one rank")
    if len(set(listed)) != len(listed):
        raise CollectiveError(f"group ranks {listed} list a rank twice")
    return tuple(sorted(listed))


async def new_group(
    world: Transport,
    ranks: Iterable[int],
    *,
    shared_memory: bool | None = None,
    seconds: float = DEFAULT_GROUP_SECONDS,
    **shm_options: Any,
) -> ProcessGroup | None:
    """Create the group of ``ranks`` (ranks of ``world``); every rank of ``world`` must call
    this with the same ranks, in the same order of calls. Returns this rank's `ProcessGroup`,
    or None when this rank is not a member.

    Over TCP the group gets its own connections, and (when the members share a host) its own
    shared-memory plane: ``shared_memory`` None means on unless ``PARAMSYNC_SHM=0`` or TLS, as
    for `TcpTransport.connect`; ``shm_options`` go to `attach_shared_memory`. On torch's data
    plane it gets its own torch communicator (a `NativeProcessGroup`; ``shared_memory`` and
    ``shm_options`` do not apply). Forming the group must finish within ``seconds`` (a
    `StallError` otherwise).
    """
    members = _check_ranks(world, ranks)
    index = _COUNTERS.get(world, 0)
    _COUNTERS[world] = index + 1
    if world.rank not in members:
        return None
    name = group_name(world, index, members)
    try:
        with trio.fail_after(seconds):
            if _is_tcp(world):
                transport: Transport = await _tcp_members(
                    world, members, name, shared_memory, seconds, shm_options
                )
            elif _is_in_process(world):
                transport = _in_process_members(world, members, name, index)
            elif isinstance(base := _base(world), TorchPlaneTransport):
                transport = await base.open_subgroup(
                    members, name, parent=_parent_name(world), seconds=seconds
                )
            else:
                raise CollectiveError(
                    f"cannot build process groups over a {type(world).__name__}: only over "
                    "InProcessTransport, TcpTransport, TorchPlaneTransport and groups of them"
                )
    except trio.TooSlowError:
        raise StallError(
            f"group {name} (ranks {list(members)}) did not form within {seconds} s"
        ) from None
    if isinstance(transport, NativeCollectives):
        return NativeProcessGroup(world, members, name, transport)
    return ParamsyncProcessGroup(world, members, name, transport)


def _parent_name(world: Transport) -> str:
    """``world`` as every rank of it names it: "world", or the group's name."""
    return world.name if isinstance(world, ProcessGroup) else "world"


def _base(world: Transport) -> Transport:
    while isinstance(world, ProcessGroup):
        world = world.members
    return world


def _is_tcp(world: Transport) -> bool:
    return isinstance(_base(world), TcpTransport)


def _is_in_process(world: Transport) -> bool:
    return isinstance(_base(world), InProcessTransport)


# ---------------------------------------------------------------------------- in one process


def _in_process_members(
    world: Transport, members: tuple[int, ...], name: str, index: int
) -> InProcessTransport:
    """This rank's transport among fresh channels: the first member to arrive makes them all
    and leaves them in the world's registry; the last to take its own removes the entry."""
    base = _base(world)
    assert isinstance(base, InProcessTransport)
    registry = base.registry
    parent = world.name if isinstance(world, ProcessGroup) else "world"
    key = f"group:{parent}:{index}"
    entry = registry.get(key)
    if entry is None:
        transports = InProcessTransport.create_group(
            len(members), max_frame=base.max_frame, registry=registry
        )
        entry = {"ranks": members, "transports": transports, "taken": set()}
        registry[key] = entry
    if entry["ranks"] != members:
        raise CollectiveError(
            f"group #{index}: rank {world.rank} creates it with ranks {list(members)}, another "
            f"member with ranks {list(entry['ranks'])}: every rank must call new_group alike"
        )
    position = members.index(world.rank)
    entry["taken"].add(position)
    if len(entry["taken"]) == len(members):
        del registry[key]
    transport: InProcessTransport = entry["transports"][position]
    return transport


# ---------------------------------------------------------------------------- over TCP


async def _tcp_members(
    world: Transport,
    members: tuple[int, ...],
    name: str,
    shared_memory: bool | None,
    seconds: float,
    shm_options: dict[str, Any],
) -> TcpTransport:
    """This rank's transport in a fresh TCP mesh among ``members``."""
    position = members.index(world.rank)
    base = _base(world)
    assert isinstance(base, TcpTransport)
    secret, tls, max_frame = base.secret, base.tls, base.max_frame
    if secret is None:
        raise CollectiveError(
            "the world transport holds no secret to authenticate a group's connections "
            "(make it with TcpTransport.connect or open_group, or pass secret= to TcpTransport)"
        )
    peers = [rank for rank in members if rank != world.rank]
    mesh = {}
    if peers:
        host = base.connections[peers[0]].socket.getsockname()[0]
        listeners = await trio.open_tcp_listeners(0, host=host)
        try:
            port = listeners[0].socket.getsockname()[1]
            addresses = await _exchange_addresses(world, members, name, host, port)
            me = Identity(name, len(members), position)
            mesh = await form_mesh(me, listeners[0], addresses, secret, tls=tls)
        finally:
            for listener in listeners:
                await listener.aclose()
    transport = TcpTransport(position, len(members), mesh, max_frame, secret=secret, tls=tls)
    if isinstance(world, PrecodedFrames):
        transport.stall_seconds = world.stall_seconds
    try:
        if len(members) > 1:
            await attach_shared_memory(
                transport, want=shared_memory, seconds=seconds, **shm_options
            )
    except BaseException:
        with trio.CancelScope(shield=True):
            await transport.aclose()
        raise
    return transport


async def _exchange_addresses(
    world: Transport, members: tuple[int, ...], name: str, host: str, port: int
) -> list[tuple[str, int]]:
    """Tell every other member where this rank listens for the group, and learn where they do.

    Sending first cannot block (a frame of a few dozen bytes); a member that announces another
    group (other ranks, or another call) is a ProtocolError naming it."""
    mine = GroupAddr(name, members, host, port).to_wire()
    for peer in members:
        if peer != world.rank:
            await world.send(peer, *mine)
    addresses: list[tuple[str, int]] = []
    for peer in members:
        if peer == world.rank:
            addresses.append((host, port))
            continue
        item = await world.recv(peer)
        if item["kind"] != GroupAddr.KIND:
            raise ProtocolError(
                f"sent a {item['kind']} message while group {name} formed", peer=peer
            )
        theirs = GroupAddr.from_wire(item, peer=peer)
        if theirs.name != name or theirs.ranks != members:
            raise ProtocolError(
                f"creates group {theirs.name!r} with ranks {list(theirs.ranks)} where this rank "
                f"creates {name} with ranks {list(members)}: every rank must call new_group "
                "alike, in the same order",
                peer=peer,
            )
        addresses.append((theirs.host, theirs.port))
    return addresses
