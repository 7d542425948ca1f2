"""TLS under the HMAC handshake (paramsync.runtime.transport.tls): collectives, the coordinator,
refusals, the wire.

Certificates come from `trustme`: one CA for the cluster and a certificate per node, written to
``tmp_path``; a second CA stands for a stranger. Every exchange runs under a deadline, so a
hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import functools
import logging
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing
import trustme
from conftest import bitwise_equal, free_port

from paramsync.runtime.cli.main import main as cli_main
from paramsync.runtime.collectives.ring import all_reduce
from paramsync.runtime.config import DistributedConfig
from paramsync.runtime.coordinator.service import Coordinator
from paramsync.runtime.errors import (
    AuthenticationError,
    CollectiveError,
    HandshakeError,
    PeerClosed,
    ProtocolError,
)
from paramsync.runtime.protocol.handshake import DialerHandshake, Identity, load_secret
from paramsync.runtime.train_config import DistributedTrainConfig, resolve_tls
from paramsync.runtime.transport.tcp import DEFAULT_GROUP, Connection, TcpTransport, accept, dial
from paramsync.runtime.transport.tls import TlsConfig

SECRET = load_secret("tls-tests-shared-secret", {})
SECONDS = 20.0
COLL = {"op": 0, "hop": 0, "part": 0}


def write_node(ca: trustme.CA, directory: Path, name: str, trust: trustme.CA | None = None) -> Path:
    """Issue ``name`` a certificate from ``ca``; write cert, key and the CA it trusts."""
    leaf = ca.issue_cert(name, "127.0.0.1")
    leaf.cert_chain_pems[0].write_to_path(directory / f"{name}.crt")
    leaf.private_key_pem.write_to_path(directory / f"{name}.key")
    (trust or ca).cert_pem.write_to_path(directory / f"{name}-ca.pem")
    return directory / name


def node_config(base: Path, **kw: Any) -> TlsConfig:
    return TlsConfig.from_paths(
        f"{base}.crt", f"{base}.key", base.with_name(f"{base.name}-ca.pem"), **kw
    )


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, TlsConfig]:
    """TLS configs: three cluster nodes, and a stranger whose certificate another CA signed
    (it trusts the cluster's CA, so only the cluster's side can refuse it)."""
    ca, other = trustme.CA(), trustme.CA()
    configs = {name: node_config(write_node(ca, tmp_path, name)) for name in ("a", "b", "c")}
    configs["stranger"] = node_config(write_node(other, tmp_path, "stranger", trust=ca))
    return configs


# --------------------------------------------------------------------------- a tiny listener


class Listener:
    """Accepts connections with `accept` (TLS or not) and records each outcome, like the
    coordinator's and the workers' listeners: a failure is recorded and serving goes on."""

    def __init__(self, tls: TlsConfig | None, handshake_seconds: float = 5.0) -> None:
        self.tls = tls
        self.handshake_seconds = handshake_seconds
        self.outcomes: list[Any] = []
        self.connections: list[Connection] = []
        self.changed = trio.Event()
        self.address: tuple[str, int] = ("", 0)

    async def serve(self, *, task_status: trio.TaskStatus[tuple[str, int]]) -> None:
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        self.address = listener.socket.getsockname()[:2]
        async with trio.open_nursery() as nursery:
            task_status.started(self.address)
            while True:
                stream = await listener.accept()
                nursery.start_soon(self._one, stream)

    async def _one(self, stream: trio.SocketStream) -> None:
        me = Identity(DEFAULT_GROUP, 3, 0)
        try:
            conn, peer = await accept(
                stream,
                SECRET,
                me,
                lambda peer: None,
                handshake_seconds=self.handshake_seconds,
                tls=self.tls,
            )
            self.connections.append(conn)
            self.outcomes.append(peer)
        except ProtocolError as exc:
            self.outcomes.append(exc)
        self.changed.set()
        self.changed = trio.Event()

    async def next_outcome(self, count: int) -> Any:
        """The ``count``-th outcome (1-based), waiting for it."""
        while len(self.outcomes) < count:
            await self.changed.wait()
        return self.outcomes[count - 1]


async def until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` (the caller's deadline bounds the wait)."""
    while not condition():  # noqa: ASYNC110 - a counter, not an event, is what we have
        await trio.sleep(0.01)


async def dial_as(address: tuple[str, int], tls: TlsConfig | None, **kw: Any) -> Connection:
    conn, _ = await dial(address, kw.pop("secret", SECRET), Identity(DEFAULT_GROUP, 3, 1), tls=tls)
    return conn


# --------------------------------------------------------------------------- (a) collectives


def rank_tensor(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank))


async def reduce_in(transports: list[TcpTransport], numel: int, op: str) -> list[torch.Tensor]:
    tensors = [rank_tensor(t.rank, numel) for t in transports]
    with trio.fail_after(SECONDS):
        async with trio.open_nursery() as nursery:
            for transport, tensor in zip(transports, tensors):
                nursery.start_soon(all_reduce, transport, tensor, op)
    return tensors


@pytest.mark.parametrize("op", ["sum", "avg"])
async def test_all_reduce_over_tls_is_bitwise_equal_to_plaintext(
    pki: dict[str, TlsConfig], op: str
) -> None:
    numel = 1 << 20  # 4 MiB: the threaded ring in plaintext, the trio ring under TLS
    async with TcpTransport.open_group(3, tls=pki["a"]) as secure:
        assert not any(t.supports_blocking for t in secure)
        for transport in secure:
            for conn in transport.connections.values():
                assert isinstance(conn.stream, trio.SSLStream)
                assert conn.stream.version() in ("TLSv1.3", "TLSv1.2")
        encrypted = await reduce_in(secure, numel, op)
    async with TcpTransport.open_group(3) as plain:
        assert all(t.supports_blocking for t in plain)
        clear = await reduce_in(plain, numel, op)
    for rank in range(3):
        assert bitwise_equal(encrypted[rank], clear[rank])
        assert bitwise_equal(encrypted[rank], encrypted[0])


async def test_blocking_links_refuse_tls_connections(pki: dict[str, TlsConfig]) -> None:
    async with TcpTransport.open_group(2, tls=pki["a"]) as (t0, _):
        with pytest.raises(CollectiveError, match="plaintext TCP"):
            async with t0.blocking_links({1}):
                pass  # pragma: no cover - never entered


async def test_polled_links_refuse_tls_connections(pki: dict[str, TlsConfig]) -> None:
    async with TcpTransport.open_group(2, tls=pki["a"]) as (t0, _):
        with pytest.raises(CollectiveError, match="plaintext TCP"):
            async with t0.polled_links({1}):
                pass  # pragma: no cover - never entered


async def test_every_payload_travels_over_tls(pki: dict[str, TlsConfig]) -> None:
    messages: list[tuple[str, dict[str, Any], torch.Tensor | None]] = [
        ("refuse", {"reason": "just text"}, None),
        ("coll", COLL, torch.arange(5000, dtype=torch.float32)),
        ("coll", COLL, torch.empty(0, dtype=torch.int64)),
        ("coll", COLL, torch.tensor(2.5, dtype=torch.float64)),
        ("coll", COLL, torch.arange(3 << 20, dtype=torch.int32)),  # 12 MiB: sent in parts
    ]
    with trio.fail_after(SECONDS):
        async with TcpTransport.open_group(2, tls=pki["b"]) as (t0, t1):
            async with trio.open_nursery() as nursery:

                async def sender() -> None:
                    for kind, fields, bulk in messages:
                        await t0.send(1, kind, fields, bulk)

                nursery.start_soon(sender)
                for kind, fields, bulk in messages[:-1]:
                    got = await t1.recv(0)
                    assert got["kind"] == kind and {k: got[k] for k in fields} == fields
                    if bulk is not None:
                        assert bitwise_equal(got["data"], bulk)
                out = torch.zeros(3 << 20, dtype=torch.int32)
                await t1.recv_into(0, out)
                assert bitwise_equal(out, messages[-1][2])


async def test_rendezvous_over_tls_with_a_certificate_per_node(pki: dict[str, TlsConfig]) -> None:
    """`TcpTransport.connect`, as separate processes use it: rank 0 serves the rendezvous."""
    address = f"127.0.0.1:{free_port()}"
    results: dict[int, torch.Tensor] = {}

    async def rank(r: int, tls: TlsConfig) -> None:
        config = DistributedConfig(3, r, address)
        async with TcpTransport.connect(config, secret=SECRET, tls=tls) as transport:
            assert not transport.supports_blocking
            tensor = rank_tensor(r, 300_000)
            await all_reduce(transport, tensor, "sum")
            results[r] = tensor

    with trio.fail_after(SECONDS):
        async with trio.open_nursery() as nursery:
            for r, name in enumerate("abc"):
                nursery.start_soon(rank, r, pki[name])
    expected = rank_tensor(0, 300_000) + rank_tensor(1, 300_000) + rank_tensor(2, 300_000)
    assert torch.allclose(results[0], expected, atol=1e-5)
    assert bitwise_equal(results[1], results[0]) and bitwise_equal(results[2], results[0])


async def test_abort_and_aclose_wake_a_tls_receiver(pki: dict[str, TlsConfig]) -> None:
    with trio.fail_after(SECONDS):
        async with TcpTransport.open_group(3, tls=pki["a"]) as (t0, t1, t2):

            async def blocked(transport: TcpTransport, peer: int) -> None:
                with pytest.raises(PeerClosed):
                    await transport.recv(peer)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(blocked, t1, 0)
                nursery.start_soon(blocked, t2, 0)
                await trio.testing.wait_all_tasks_blocked()
                t1.connections[0].abort()  # this side's socket: its own receiver wakes
                await t0.connections[2].aclose()  # the peer's side: the receiver sees EOF


# --------------------------------------------------------------------------- (b) coordinator


def serve_coordinator(coordinator: Coordinator, tls: TlsConfig) -> Callable[..., Any]:
    return functools.partial(coordinator.serve_tcp, "127.0.0.1", 0, tls=tls)


async def join_as_rank(address: tuple[str, int], tls: TlsConfig | None, rank: int) -> Connection:
    conn, peer = await dial(address, SECRET, Identity(DEFAULT_GROUP, 2, rank), tls=tls)
    assert peer.rank == -1  # the coordinator is not a rank
    return conn


async def test_coordinator_serves_tls_workers_and_refuses_a_stranger(
    pki: dict[str, TlsConfig], caplog: pytest.LogCaptureFixture
) -> None:
    coordinator = Coordinator(2, secret=SECRET)
    caplog.set_level(logging.WARNING)
    with trio.fail_after(SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve_coordinator(coordinator, pki["a"]))
            # (c) a certificate from another CA: refused, naming the reason on both sides
            with pytest.raises(HandshakeError, match="unknown ca") as refused:
                await join_as_rank(address, pki["stranger"], 0)
            assert f"{address[0]}:{address[1]}" in str(refused.value)
            await until(lambda: coordinator.hostile_refused >= 1)
            assert "certificate verify failed" in caplog.text
            # ... and the listener keeps serving: two workers with the cluster's certificates
            ranks = [await join_as_rank(address, pki[name], r) for r, name in enumerate("bc")]
            for r, conn in enumerate(ranks):
                assert isinstance(conn.stream, trio.SSLStream)
                await conn.send("join", {"host": "127.0.0.1", "port": 9000 + r, "params": []})
            for conn in ranks:
                start = await conn.recv()
                assert start["kind"] == "start_run", start
                assert start["addresses"] == [["127.0.0.1", 9000], ["127.0.0.1", 9001]]
            assert coordinator.hostile_refused == 1
            nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------- (c)-(e) refusals


async def test_a_foreign_certificate_is_refused_and_the_listener_keeps_serving(
    pki: dict[str, TlsConfig],
) -> None:
    server = Listener(pki["a"])
    with trio.fail_after(SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(server.serve)
            with pytest.raises(HandshakeError, match="tlsv1 alert unknown ca"):
                await dial_as(address, pki["stranger"])
            refused = await server.next_outcome(1)
            assert isinstance(refused, HandshakeError), refused
            assert "certificate verify failed" in str(refused)
            assert refused.peer is not None and refused.peer.startswith("127.0.0.1:")
            conn = await dial_as(address, pki["b"])
            assert (await server.next_outcome(2)).rank == 1
            await conn.aclose()
            nursery.cancel_scope.cancel()


async def test_a_dialer_without_a_certificate_is_refused(pki: dict[str, TlsConfig]) -> None:
    """Mutual TLS: trusting the CA is not enough, the dialer must present a certificate."""
    server = Listener(pki["a"])
    anonymous = ssl.create_default_context(cafile=str(pki["a"].ca))
    anonymous.check_hostname = False
    with trio.fail_after(SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(server.serve)
            stream = trio.SSLStream(await trio.open_tcp_stream(*address), anonymous)
            conn = Connection(stream, peer="listener")  # a TLS connection, by its stream
            assert not conn.supports_blocking
            with pytest.raises(PeerClosed, match="certificate required"):
                await conn.send(*DialerHandshake(SECRET, Identity(DEFAULT_GROUP, 3, 1)).hello())
                await conn.recv()
            refused = await server.next_outcome(1)
            assert isinstance(refused, HandshakeError)
            assert "peer did not return a certificate" in str(refused)
            await conn.aclose()
            nursery.cancel_scope.cancel()


async def test_a_listener_refuses_a_server_of_another_ca(pki: dict[str, TlsConfig]) -> None:
    """The dialer checks the listener too: the stranger's listener is refused by a node."""
    server = Listener(pki["stranger"])
    with trio.fail_after(SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(server.serve)
            with pytest.raises(HandshakeError, match="certificate verify failed"):
                await dial_as(address, pki["a"])
            refused = await server.next_outcome(1)
            assert isinstance(refused, HandshakeError) and "unknown ca" in str(refused)
            nursery.cancel_scope.cancel()


async def test_plaintext_peers_of_a_tls_listener_are_refused_quickly(
    pki: dict[str, TlsConfig],
) -> None:
    server = Listener(pki["a"], handshake_seconds=0.5)
    with trio.fail_after(SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(server.serve)
            # A plaintext paramsync dialer: told in the clear, at once, that TLS is required
            # (by the listener's TLS layer, not its deadline).
            with pytest.raises(HandshakeError, match="requires TLS"):
                await dial_as(address, None)
            refused = await server.next_outcome(1)
            assert isinstance(refused, HandshakeError) and "wrong version number" in str(refused)
            # A silent plaintext peer: dropped at the handshake deadline, not later.
            silent = await trio.open_tcp_stream(*address)
            started = trio.current_time()
            late = await server.next_outcome(2)
            assert isinstance(late, HandshakeError) and "within 0.5 s" in str(late)
            assert trio.current_time() - started < 2.0
            await silent.aclose()
            # The listener still serves a proper node.
            conn = await dial_as(address, pki["c"])
            assert (await server.next_outcome(3)).rank == 1
            await conn.aclose()
            nursery.cancel_scope.cancel()


async def test_a_tls_dialer_of_a_plaintext_listener_is_told_why(pki: dict[str, TlsConfig]) -> None:
    server = Listener(None)
    with trio.fail_after(SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(server.serve)
            with pytest.raises(HandshakeError, match="does not speak TLS"):
                await dial_as(address, pki["a"])
            refused = await server.next_outcome(1)
            assert isinstance(refused, HandshakeError)
            assert "speaks TLS but this side has no TLS" in str(refused)
            nursery.cancel_scope.cancel()


async def test_a_tls_dialer_with_the_wrong_secret_is_refused_by_the_hmac(
    pki: dict[str, TlsConfig],
) -> None:
    server = Listener(pki["a"])
    with trio.fail_after(SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(server.serve)
            with pytest.raises(AuthenticationError, match="wrong shared secret"):
                await dial_as(address, pki["b"], secret=b"not-the-shared-secret")
            # TLS let it in; the HMAC layer threw it out before any admission.
            assert isinstance(await server.next_outcome(1), AuthenticationError)
            conn = await dial_as(address, pki["b"])
            assert (await server.next_outcome(2)).rank == 1
            await conn.aclose()
            nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------- (f) the wire

PATTERN = b"paramsync-tensor-bytes:0123456789" * 64


class Tap:
    """A TCP proxy that records every byte each way."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.seen = bytearray()

    async def serve(self, *, task_status: trio.TaskStatus[tuple[str, int]]) -> None:
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        task_status.started(listener.socket.getsockname()[:2])
        client = await listener.accept()
        server = await trio.open_tcp_stream(*self.target)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pump, client, server)
            nursery.start_soon(self._pump, server, client)

    async def _pump(self, source: trio.SocketStream, sink: trio.SocketStream) -> None:
        try:
            while data := await source.receive_some(65536):
                self.seen += data
                await sink.send_all(data)
            await sink.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


@pytest.mark.parametrize("secure", [True, False], ids=["tls", "plaintext"])
async def test_the_wire_carries_no_plaintext_under_tls(
    pki: dict[str, TlsConfig], secure: bool
) -> None:
    server = Listener(pki["a"] if secure else None)
    bulk = torch.frombuffer(bytearray(PATTERN), dtype=torch.uint8)
    with trio.fail_after(SECONDS):
        async with trio.open_nursery() as nursery:
            target = await nursery.start(server.serve)
            tap = Tap(target)
            via = await nursery.start(tap.serve)
            conn = await dial_as(via, pki["b"] if secure else None)
            await server.next_outcome(1)
            await conn.send("coll", COLL, bulk)
            out = torch.zeros_like(bulk)
            await server.connections[0].recv_into(out)
            assert bitwise_equal(out, bulk)
            await conn.aclose()
            nursery.cancel_scope.cancel()
    assert len(tap.seen) > len(PATTERN)
    plaintext = [PATTERN[:64], b"world_size", b"nonce", b"hello", b"challenge", b"paramsync"]
    leaked = [needle for needle in plaintext if needle in tap.seen]
    # The plaintext run proves the tap sees those bytes when nothing hides them.
    assert leaked == ([] if secure else plaintext)


# --------------------------------------------------------------------------- (g) configuration


def test_tls_config_names_a_missing_or_bad_file(tmp_path: Path) -> None:
    base = write_node(trustme.CA(), tmp_path, "n")
    cert, key, ca = f"{base}.crt", f"{base}.key", tmp_path / "n-ca.pem"
    missing = tmp_path / "nope.pem"
    for args in ((missing, key, ca), (cert, missing, ca), (cert, key, missing)):
        with pytest.raises(ValueError, match=r"nope\.pem"):
            TlsConfig.from_paths(*args)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=r"CA file .*junk\.pem"):
        TlsConfig.from_paths(cert, key, junk)
    with pytest.raises(ValueError, match=r"junk\.pem"):
        TlsConfig.from_paths(junk, key, ca)
    other_key = write_node(trustme.CA(), tmp_path, "other").with_suffix(".key")
    with pytest.raises(ValueError, match=r"key file .*other\.key.* is not the key of"):
        TlsConfig.from_paths(cert, other_key, ca)


def test_an_encrypted_key_is_refused_instead_of_prompting(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    base = write_node(trustme.CA(), tmp_path, "n")
    key = serialization.load_pem_private_key(Path(f"{base}.key").read_bytes(), None)
    locked = tmp_path / "locked.key"
    locked.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    with pytest.raises(ValueError, match=r"locked\.key.* is encrypted"):
        TlsConfig.from_paths(f"{base}.crt", locked, tmp_path / "n-ca.pem")


def test_contexts_are_mutual_tls_1_2_or_later_and_cached(pki: dict[str, TlsConfig]) -> None:
    config = pki["a"]
    for context in (config.server_context(), config.client_context()):
        assert context.verify_mode is ssl.CERT_REQUIRED
        assert context.minimum_version is ssl.TLSVersion.TLSv1_2
    assert not config.client_context().check_hostname
    assert config.server_context() is config.server_context()
    assert config.client_context() is config.client_context()
    named = TlsConfig(config.cert, config.key, config.ca, server_hostname="paramsync")
    assert named.client_context().check_hostname
    assert named == TlsConfig(config.cert, config.key, config.ca, "paramsync")


async def test_server_hostname_is_enforced_when_set(pki: dict[str, TlsConfig]) -> None:
    """With ``server_hostname`` the dialer requires it in the listener's certificate."""
    server = Listener(pki["a"])  # its certificate names "a" and 127.0.0.1
    good = TlsConfig(pki["b"].cert, pki["b"].key, pki["b"].ca, server_hostname="a")
    wrong = TlsConfig(pki["b"].cert, pki["b"].key, pki["b"].ca, server_hostname="elsewhere")
    with trio.fail_after(SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(server.serve)
            await (await dial_as(address, good)).aclose()
            with pytest.raises(
                HandshakeError, match=r"certificate verify failed: Hostname mismatch"
            ):
                await dial_as(address, wrong)
            nursery.cancel_scope.cancel()


def test_train_config_takes_all_three_tls_paths_or_none(
    pki: dict[str, TlsConfig], tmp_path: Path
) -> None:
    a = pki["a"]
    assert DistributedTrainConfig().tls_config() is None
    config = DistributedTrainConfig(tls_cert=str(a.cert), tls_key=a.key, tls_ca=a.ca)
    assert config.tls_config() == TlsConfig(a.cert, a.key, a.ca)
    with pytest.raises(ValueError, match=r"tls_key and tls_ca missing.*--tls-key, --tls-ca"):
        DistributedTrainConfig(tls_cert=a.cert)
    with pytest.raises(ValueError, match="tls_ca must be a file path"):
        DistributedTrainConfig(tls_cert=a.cert, tls_key=a.key, tls_ca=3)
    gone = DistributedTrainConfig(tls_cert=a.cert, tls_key=a.key, tls_ca=tmp_path / "gone.pem")
    with pytest.raises(ValueError, match=r"gone\.pem"):
        gone.tls_config()


def test_train_config_reads_tls_from_env_toml_and_flags(
    pki: dict[str, TlsConfig], tmp_path: Path
) -> None:
    a, b = pki["a"], pki["b"]
    env = {"PARAMSYNC_TLS_CERT": str(a.cert), "PARAMSYNC_TLS_KEY": str(a.key)}
    env["PARAMSYNC_TLS_CA"] = str(a.ca)
    assert DistributedTrainConfig.from_env(env).tls_config() == TlsConfig(a.cert, a.key, a.ca)
    with pytest.raises(ValueError, match="PARAMSYNC_TLS_CA"):
        DistributedTrainConfig.from_env(dict(env, PARAMSYNC_TLS_CA=""))
    with pytest.raises(ValueError, match="PARAMSYNC_TLS_KEY"):
        DistributedTrainConfig.from_env({"PARAMSYNC_TLS_CERT": str(a.cert)})
    # Flags > environment > TOML (whose paths are relative to the file), field by field.
    toml = tmp_path / "train.toml"
    toml.write_text(f"[distributed]\ntls_cert = '{b.cert.name}'\ntls_key = '{b.key.name}'\n")
    only_key = {"PARAMSYNC_TLS_KEY": str(a.key)}
    config = DistributedTrainConfig.resolve(toml, only_key, {"tls_ca": str(b.ca), "tls_key": None})
    assert (config.tls_cert, config.tls_key, config.tls_ca) == (b.cert, a.key, b.ca)
    key_and_ca = {"PARAMSYNC_TLS_KEY": str(a.key), "PARAMSYNC_TLS_CA": str(a.ca)}
    flags = {"tls_cert": str(a.cert), "tls_key": None, "tls_ca": None}
    assert resolve_tls(flags, key_and_ca) == TlsConfig(a.cert, a.key, a.ca)
    assert resolve_tls({}, {}) is None


def test_cli_refuses_incomplete_tls_flags_naming_them(
    pki: dict[str, TlsConfig], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("PARAMSYNC_TLS_CERT", "PARAMSYNC_TLS_KEY", "PARAMSYNC_TLS_CA"):
        monkeypatch.delenv(var, raising=False)
    a = pki["a"]
    code = cli_main(["coordinator", "--world-size", "1", "--tls-cert", str(a.cert)])
    assert code == 2
    assert "--tls-key, --tls-ca" in caplog.text
    caplog.clear()
    missing = str(a.ca) + ".missing"
    allreduce = ["allreduce", "--rank", "0", "--world-size", "1", "--coordinator", "127.0.0.1:1"]
    code = cli_main(
        [*allreduce, "--tls-cert", str(a.cert), "--tls-key", str(a.key), "--tls-ca", missing]
    )
    assert code == 2
    assert missing in caplog.text
