"""Point-to-point messages with tags: ``send``/``recv`` and their non-blocking forms.

Works over any `Transport`: a world, or a `ProcessGroup` (ranks are then group ranks). Every
message is one ``p2p`` frame carrying its tag and the tensor, whose dtype and shape travel with
it (RFC 8746); the receiver reads the head first to find the tensor it posted
(`Transport.recv_routed`). The posted tensor may be live state, so it changes only once the
frame passed its tag: the bytes land in a scratch tensor and are copied over (one copy).

Matching rule (refuse, never swap): receives are matched by tag among the receives this rank
has *posted* for that peer. ``recv`` posts one and waits; ``irecv`` posts at the moment it is
called, so several irecvs started together accept their messages in whatever order the peer
sends them (the Megatron case: two sends to one peer, received under their own tags whatever
their order). Receives posted for one tag match that tag's messages in posting order, as sends
to one peer leave in the order they were posted. A message is never held for a receive that
is not posted yet and never paired with another tag's receive: a message whose tag no posted
receive expects is a `ProtocolError` naming the peer (group rank and world rank), the tag it
sent and the tags expected; a message of the expected tag with another dtype or shape is a
`ProtocolError` naming both. After either error the message has been read whole, so the link
stays in step.

`send_on_links` / `recv_on_links` are the same messages from an OS thread, over connections a
`BlockingLinkProvider` lent it (`blocking_links`): the thread blocks in the system calls with the
GIL released, and no event loop is woken per message (a pipeline stage's compute thread sends
this way the moment a tensor is computed). There nothing is posted ahead: a receive takes the
peer's next message, which must carry the expected tag (else a `ProtocolError` naming the peer
and both tags) and a bulk of the receiving tensor's dtype and size (the transport refuses
another, naming the peer) and shape (the same size in another shape is refused here, naming the
peer and both shapes, as on the trio path).

A peer's link carries collectives too: point-to-point traffic on a group must not run at the
same time as a collective on that group (use another group). A receive cancelled in the middle
of a message breaks the link, as a cancelled collective does.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import trio

from paramsync.runtime.errors import CollectiveError, ProtocolError
from paramsync.runtime.protocol.messages import P2P, P2P_MAX_TAG
from paramsync.runtime.transport.base import Transport
from paramsync.runtime.transport.capabilities import BlockingLinkSet
from paramsync.runtime.transport.segments import SUPPORTED_DTYPES

__all__ = [
    "MAX_TAG",
    "P2PHandle",
    "send",
    "recv",
    "isend",
    "irecv",
    "post_send",
    "post_recv",
    "send_on_links",
    "recv_on_links",
]

MAX_TAG = P2P_MAX_TAG


class P2PHandle:
    """A send or receive running in a nursery; ``await handle.wait()`` for its tensor."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._done = trio.Event()
        self._result: torch.Tensor | None = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    async def wait(self) -> torch.Tensor:
        """The tensor sent or received, once the operation finished; its error if it failed."""
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _finish(self, result: torch.Tensor | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done.set()


# ------------------------------------------------------------------------------ per-peer state


class _Outbox:
    """Sends to one peer leave in posting order: each takes a ticket when posted."""

    def __init__(self) -> None:
        self.issued = 0
        self.serving = 0
        self.abandoned: set[int] = set()
        self.lot = trio.lowlevel.ParkingLot()

    def ticket(self) -> int:
        ticket = self.issued
        self.issued += 1
        return ticket

    async def in_turn(self, ticket: int, send: Callable[[], Any]) -> None:
        finished = False
        try:
            while self.serving != ticket:
                await self.lot.park()
            await send()
            finished = True
        finally:
            if self.serving == ticket:
                self._advance()
            elif not finished:
                self.abandoned.add(ticket)  # cancelled before its turn: skipped

    def _advance(self) -> None:
        self.serving += 1
        while self.serving in self.abandoned:
            self.abandoned.discard(self.serving)
            self.serving += 1
        self.lot.unpark_all()


class _Posted:
    """One posted receive: its tensor, and how it ended."""

    __slots__ = ("done", "error", "tag", "tensor")

    def __init__(self, tag: int, tensor: torch.Tensor) -> None:
        self.tag = tag
        self.tensor = tensor
        self.done = False
        self.error: BaseException | None = None


class _Inbox:
    """Receives posted for one peer. One posted receive at a time reads the link (whoever
    is waiting), and each message it reads goes to the first receive posted for its tag."""

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.posted: dict[int, deque[_Posted]] = {}
        self.reading = False
        self.lot = trio.lowlevel.ParkingLot()

    def post(self, tag: int, tensor: torch.Tensor) -> _Posted:
        entry = _Posted(tag, tensor)
        self.posted.setdefault(tag, deque()).append(entry)
        return entry

    def withdraw(self, entry: _Posted) -> None:
        queue = self.posted.get(entry.tag)
        if queue is not None and entry in queue:
            queue.remove(entry)
            if not queue:
                del self.posted[entry.tag]

    async def complete(self, transport: Transport, entry: _Posted) -> torch.Tensor:
        try:
            while not entry.done:
                if self.reading:
                    await self.lot.park()
                    continue
                self.reading = True
                try:
                    await self._read_one(transport)
                finally:
                    self.reading = False
                    self.lot.unpark_all()
        finally:
            self.withdraw(entry)
        if entry.error is not None:
            raise entry.error
        return entry.tensor

    async def _read_one(self, transport: Transport) -> None:
        chosen: list[_Posted] = []

        def route(head: dict[str, Any], dtype: torch.dtype, shape: tuple[int, ...]) -> Any:
            tag = head.get("tag") if head["kind"] == P2P.KIND else None
            queue = self.posted.get(tag) if isinstance(tag, int) else None
            if not queue:
                return None
            entry = queue[0]
            chosen.append(entry)
            if entry.tensor.dtype != dtype or tuple(entry.tensor.shape) != tuple(shape):
                return None  # read into a fresh tensor, to keep the link in step; refused below
            return entry.tensor

        largest = max(
            (e.tensor.numel() * e.tensor.element_size() for q in self.posted.values() for e in q),
            default=0,
        )
        message = await transport.recv_routed(self.peer, route, max_bulk=largest)
        who = _describe(transport, self.peer)
        if message["kind"] != P2P.KIND:
            raise ProtocolError(
                f"sent a {message['kind']} message where a point-to-point message with tag "
                f"{self._expected()} was expected",
                peer=who,
            )
        tag, data = message["tag"], message["data"]
        queue = self.posted.get(tag)
        if not queue:
            raise ProtocolError(
                f"sent tag {tag} ({_what(data)}), expected tag {self._expected()}: "
                "messages match receives posted for their tag and are never paired with "
                "another tag's",
                peer=who,
            )
        entry = chosen[0] if chosen and chosen[0] in queue else queue[0]
        self.withdraw(entry)
        if data is not entry.tensor:
            if data.dtype == entry.tensor.dtype and tuple(data.shape) == tuple(entry.tensor.shape):
                entry.tensor.copy_(data)  # a tensor small enough to travel inline
            else:
                entry.error = ProtocolError(
                    f"sent tag {tag} as {_what(data)}, expected {_what(entry.tensor)}", peer=who
                )
        entry.done = True

    def _expected(self) -> str:
        tags = sorted(self.posted)
        return " or ".join(map(str, tags)) if tags else "(none posted)"


class _Peers:
    """Point-to-point state of one transport: an outbox and an inbox per peer (it holds no
    reference to the transport, so the state goes when the transport does)."""

    def __init__(self) -> None:
        self.outboxes: dict[int, _Outbox] = {}
        self.inboxes: dict[int, _Inbox] = {}

    def outbox(self, peer: int) -> _Outbox:
        if peer not in self.outboxes:
            self.outboxes[peer] = _Outbox()
        return self.outboxes[peer]

    def inbox(self, peer: int) -> _Inbox:
        if peer not in self.inboxes:
            self.inboxes[peer] = _Inbox(peer)
        return self.inboxes[peer]


_STATE: weakref.WeakKeyDictionary[Transport, _Peers] = weakref.WeakKeyDictionary()


def _peers(transport: Transport) -> _Peers:
    state = _STATE.get(transport)
    if state is None:
        state = _STATE[transport] = _Peers()
    return state


def _describe(transport: Transport, peer: int) -> str:
    return transport.describe_peer(peer)


def _what(tensor: torch.Tensor) -> str:
    return f"{tensor.dtype} of shape {list(tensor.shape)}"


def _check(transport: Transport, tensor: torch.Tensor, peer: int, tag: int, what: str) -> None:
    if not isinstance(transport, Transport):
        raise CollectiveError(f"{what} needs a group (a Transport), got {type(transport).__name__}")
    if not isinstance(tensor, torch.Tensor):
        raise CollectiveError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise CollectiveError(f"{what} does not support dtype {tensor.dtype}")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise CollectiveError(f"{what} needs a contiguous CPU tensor")
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
        raise CollectiveError(f"{what} tag must be an int in 0..2**63-1, got {tag!r}")
    transport.check_peer(peer)


# ------------------------------------------------------------------------------ API


def post_send(
    group: Transport, tensor: torch.Tensor, dst: int, tag: int = 0
) -> Callable[[], Awaitable[torch.Tensor]]:
    """Post a send of ``tensor`` to ``dst`` now (sends to one peer leave in the order they
    were posted); awaiting the returned function sends it. For a caller that owns its tasks
    (`isend` is this in a nursery)."""
    _check(group, tensor, dst, tag, "send")
    outbox = _peers(group).outbox(dst)
    ticket = outbox.ticket()

    async def run() -> torch.Tensor:
        await outbox.in_turn(ticket, lambda: group.send(dst, P2P.KIND, {"tag": tag}, tensor))
        return tensor

    return run


def post_recv(
    group: Transport, tensor: torch.Tensor, src: int, tag: int = 0
) -> Callable[[], Awaitable[torch.Tensor]]:
    """Post a receive into ``tensor`` from ``src`` now (it can match a message from this
    moment); awaiting the returned function completes it. For a caller that owns its tasks
    (`irecv` is this in a nursery)."""
    _check(group, tensor, src, tag, "recv")
    inbox = _peers(group).inbox(src)
    entry = inbox.post(tag, tensor)

    async def run() -> torch.Tensor:
        return await inbox.complete(group, entry)

    return run


async def send(group: Transport, tensor: torch.Tensor, dst: int, tag: int = 0) -> torch.Tensor:
    """Send ``tensor`` to rank ``dst`` of ``group`` under ``tag``; returns once the transport
    took it (the tensor's memory leaves uncopied: do not modify it before this returns)."""
    return await post_send(group, tensor, dst, tag)()


async def recv(group: Transport, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
    """Receive the message ``src`` sent under ``tag`` into ``tensor`` (same dtype and shape,
    else a ProtocolError) and return ``tensor``."""
    return await post_recv(group, tensor, src, tag)()


def _start(nursery: trio.Nursery, what: str, run: Any) -> P2PHandle:
    handle = P2PHandle(what)

    async def task() -> None:
        try:
            result = await run()
        except BaseException as exc:
            handle._finish(None, exc)
            raise
        handle._finish(result, None)

    nursery.start_soon(task)
    return handle


def isend(
    nursery: trio.Nursery, group: Transport, tensor: torch.Tensor, dst: int, tag: int = 0
) -> P2PHandle:
    """Start `send` in ``nursery``; it is posted now (sends to one peer leave in the order they
    were posted). A failure also propagates into the nursery."""
    return _start(nursery, f"send to {dst} tag {tag}", post_send(group, tensor, dst, tag))


def irecv(
    nursery: trio.Nursery, group: Transport, tensor: torch.Tensor, src: int, tag: int = 0
) -> P2PHandle:
    """Start `recv` in ``nursery``; the receive is posted now, so irecvs started together
    take their messages in any arrival order. A failure also propagates into the nursery."""
    return _start(nursery, f"recv from {src} tag {tag}", post_recv(group, tensor, src, tag))


# ------------------------------------------------------------------------------ from a thread


def send_on_links(
    links: BlockingLinkSet, group: Transport, tensor: torch.Tensor, dst: int, tag: int = 0
) -> None:
    """Send ``tensor`` to rank ``dst`` under ``tag`` from an OS thread, over ``links`` that
    ``group`` lent (`BlockingLinkProvider.blocking_links`); returns once the kernel took every
    byte (the tensor may be modified then). The same frame as `send`."""
    _check(group, tensor, dst, tag, "send")
    links.send(dst, P2P.KIND, {"tag": tag}, tensor)


def recv_on_links(
    links: BlockingLinkSet, group: Transport, tensor: torch.Tensor, src: int, tag: int = 0
) -> torch.Tensor:
    """Receive ``src``'s next message into ``tensor`` from an OS thread, over ``links`` that
    ``group`` lent, and return ``tensor``. ``tensor`` is a landing buffer (uncopied, as
    `BlockingLinkSet.recv_into`): when this raises it holds unspecified bytes, so pass a
    buffer of the caller's own (a pipeline's fresh activation buffer), never live state. A
    message of another kind or tag is a `ProtocolError` naming the peer and both tags (it has
    been read whole: the link stays in step, and ``tensor`` holds its bytes); a bulk of
    another dtype or size one naming both, and one of the same size in another shape too
    (read whole as well)."""
    _check(group, tensor, src, tag, "recv")
    message = links.recv_into(src, tensor)
    if message["kind"] != P2P.KIND:
        raise ProtocolError(
            f"sent a {message['kind']} message where a point-to-point message with tag {tag} "
            "was expected",
            peer=_describe(group, src),
        )
    if message["tag"] != tag:
        raise ProtocolError(
            f"sent tag {message['tag']} ({_what(tensor)}), expected tag {tag}: messages are "
            "never paired with another tag's receive",
            peer=_describe(group, src),
        )
    landed = message["data"]
    if tuple(landed.shape) != tuple(tensor.shape):
        raise ProtocolError(
            f"sent tag {tag} as {_what(landed)}, expected {_what(tensor)}",
            peer=_describe(group, src),
        )
    return tensor
