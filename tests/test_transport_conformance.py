"""Every transport passes the conformance suite (paramsync.runtime.testing.transport_conformance),
and the suite fails transports that break the contract.

The transports: in-process, TCP on 127.0.0.1, TCP under TLS (a `trustme` CA), TCP with the
shared-memory plane attached (every all-reduce from 0 bytes on it, so the plane sees every
size) and torch.distributed (a gloo group in this process: frames as gloo point-to-point sends,
collectives natively), each in groups of 2 and 3 ranks; and a process group on torch's data
plane (``torch-group``: ranks 1..n of a torch world of n + 1, each group rank a
`NativeProcessGroup` over a gloo communicator of the members' own).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
import trio
import trustme

from paramsync.runtime.collectives.groups import NativeProcessGroup, new_group
from paramsync.runtime.errors import ProtocolError
from paramsync.runtime.testing import transport_conformance as conformance
from paramsync.runtime.testing.transport_conformance import (
    CHECKS,
    ConformanceError,
    MakeGroup,
    check_transport,
)
from paramsync.runtime.transport.base import InProcessTransport, Transport
from paramsync.runtime.transport.capabilities import (
    BlockingLinkProvider,
    NativeCollectives,
    PolledLinkProvider,
    PrecodedFrames,
    SharedMemoryHolder,
)
from paramsync.runtime.transport.shm import SharedMemoryPlane
from paramsync.runtime.transport.tcp import TcpTransport
from paramsync.runtime.transport.tls import TlsConfig
from paramsync.runtime.transport.torch_plane import open_local_group

KINDS = ("inproc", "tcp", "tls", "tcp+shm", "torch", "torch-group")


@pytest.fixture(scope="module")
def tls_config(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    """One node's certificate, key and CA (every rank of a loopback group uses it)."""
    directory = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    leaf = ca.issue_cert("node", "127.0.0.1")
    leaf.cert_chain_pems[0].write_to_path(directory / "node.crt")
    leaf.private_key_pem.write_to_path(directory / "node.key")
    ca.cert_pem.write_to_path(directory / "ca.pem")
    return TlsConfig.from_paths(
        directory / "node.crt", directory / "node.key", directory / "ca.pem"
    )


def in_process(cls: type[InProcessTransport] = InProcessTransport) -> MakeGroup:
    @asynccontextmanager
    async def make(n: int) -> AsyncIterator[list[Transport]]:
        group: list[Transport] = list(cls.create_group(n))
        try:
            yield group
        finally:
            with trio.CancelScope(shield=True):
                for transport in group:
                    await transport.aclose()

    return make


@asynccontextmanager
async def torch_group(n: int) -> AsyncIterator[list[Transport]]:
    """Ranks 1..n of a torch world of n + 1 as a process group (rank 0 is no member); closing
    the world closes the group."""
    async with open_local_group(n + 1) as world:
        groups: list[Transport | None] = [None] * (n + 1)

        async def make(rank: int) -> None:
            groups[rank] = await new_group(world[rank], range(1, n + 1))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for rank in range(n + 1):
                    nursery.start_soon(make, rank)
        assert groups[0] is None
        members = [group for group in groups[1:] if group is not None]
        assert len(members) == n and all(isinstance(g, NativeProcessGroup) for g in members)
        yield members


def maker(kind: str, tls: TlsConfig) -> MakeGroup:
    if kind == "inproc":
        return in_process()
    if kind == "torch":
        return open_local_group
    if kind == "torch-group":
        return torch_group
    options: dict[str, Any] = {
        "tcp": {},
        "tls": {"tls": tls},
        "tcp+shm": {"shared_memory": True, "min_bytes": 0},
    }[kind]

    @asynccontextmanager
    async def make(n: int) -> AsyncIterator[list[Transport]]:
        async with TcpTransport.open_group(n, **options) as group:
            if kind == "tcp+shm":
                assert all(isinstance(t.shared_memory, SharedMemoryPlane) for t in group)
            yield list(group)

    return make


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("kind", KINDS)
async def test_transport_conforms(kind: str, check: str, n: int, tls_config: TlsConfig) -> None:
    await CHECKS[check](maker(kind, tls_config), n)


async def test_check_transport_runs_every_check_for_every_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checks themselves run one by one above; here, that the whole suite runs them all."""
    ran: list[tuple[str, int, MakeGroup]] = []
    for name in CHECKS:

        async def spy(make: MakeGroup, n: int, name: str = name) -> None:
            ran.append((name, n, make))

        monkeypatch.setitem(CHECKS, name, spy)
    make = in_process()
    await check_transport(make, world_sizes=(2, 3))
    assert ran == [(name, n, make) for n in (2, 3) for name in CHECKS]
    with pytest.raises(ValueError, match="at least 2"):
        await check_transport(in_process(), world_sizes=(1,))


async def test_transports_declare_their_capabilities(tls_config: TlsConfig) -> None:
    capabilities = (BlockingLinkProvider, PolledLinkProvider, PrecodedFrames, SharedMemoryHolder)
    (inproc, _) = InProcessTransport.create_group(2)
    assert not any(isinstance(inproc, capability) for capability in capabilities)
    async with TcpTransport.open_group(2) as (plain, _):
        assert all(isinstance(plain, capability) for capability in capabilities)
        assert plain.supports_blocking and plain.supports_polled
        assert plain.shared_memory is None
    async with TcpTransport.open_group(2, tls=tls_config) as (secure, _):
        assert all(isinstance(secure, capability) for capability in capabilities)
        assert not secure.supports_blocking and not secure.supports_polled
        assert not isinstance(secure, NativeCollectives)
    async with open_local_group(2) as (torch_plane, _):
        assert isinstance(torch_plane, NativeCollectives)
        assert not any(isinstance(torch_plane, capability) for capability in capabilities)


# --------------------------------------------------------------------------- the suite can fail


class UnnamedErrors(InProcessTransport):
    """Refuses a wrong destination without saying which peer sent it."""

    async def recv_into(self, peer: int, out: torch.Tensor) -> dict[str, Any]:
        try:
            return await super().recv_into(peer, out)
        except ProtocolError as exc:
            raise ProtocolError(exc.reason) from None


class FlatReceiver(InProcessTransport):
    """Delivers every tensor flattened: the shape is lost."""

    async def recv(self, peer: int) -> dict[str, Any]:
        message = await super().recv(peer)
        if isinstance(message.get("data"), torch.Tensor):
            message["data"] = message["data"].reshape(-1)
        return message


class DeafClose(InProcessTransport):
    """Closing leaves the channels open: a peer waiting on it hangs."""

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


class ReorderingSender(InProcessTransport):
    """Holds every other message back and sends it after the next one."""

    held: tuple[int, str, Mapping[str, Any], torch.Tensor | None] | None = None

    async def send(
        self, peer: int, kind: str, fields: Mapping[str, Any], bulk: torch.Tensor | None = None
    ) -> None:
        if kind != "probe":
            await super().send(peer, kind, fields, bulk)
        elif self.held is None:
            self.held = (peer, kind, fields, bulk)
        else:
            held, self.held = self.held, None
            await super().send(peer, kind, fields, bulk)
            await super().send(*held)


class NeverMatches(InProcessTransport, PrecodedFrames):
    """Declares pre-encoded frames but never recognises one."""

    stall_seconds = 5.0

    async def send_frame(self, peer: int, frame: bytes) -> None:
        self.check_peer(peer)
        await self._senders[peer].send(frame)

    async def recv_matching(self, peer: int, expected: bytes) -> dict[str, Any] | None:
        return await self.recv(peer)


@pytest.mark.parametrize(
    ("broken", "check", "complaint"),
    [
        (UnnamedErrors, "errors", "does not name peer"),
        (FlatReceiver, "tensors", "arrived through recv as"),
        (ReorderingSender, "pairs", "message #1 from rank"),
        (NeverMatches, "precoded_frames", "did not recognise the frame"),
    ],
)
async def test_the_suite_fails_a_broken_transport(
    broken: type[InProcessTransport], check: str, complaint: str
) -> None:
    with pytest.raises(ConformanceError, match=complaint):
        await CHECKS[check](in_process(broken), 2)


async def test_a_hang_fails_the_check_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conformance, "CHECK_SECONDS", 0.5)
    with trio.fail_after(20), pytest.raises(ConformanceError, match="close: no result within"):
        await CHECKS["close"](in_process(DeafClose), 2)
