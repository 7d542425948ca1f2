"""Optional TLS under the HMAC handshake: mutual certificate authentication and encryption.

With a `TlsConfig`, every TCP connection (worker to coordinator, worker to worker) runs a TLS
handshake right after connect/accept, inside the handshake deadline, and the HMAC handshake of
`paramsync.runtime.protocol.handshake` then runs unchanged inside the encrypted stream. Both layers
must agree: TLS proves each end holds a certificate signed by the cluster's CA (and hides the
bytes); the HMAC proves each end holds the group's shared secret and binds group, world size and
rank.

Policy:

* **Mutual.** Both sides present their certificate and verify the other's against ``ca``
  (``CERT_REQUIRED`` both ways). The CA file is the only trust anchor: the system's CAs are
  never loaded.
* **TLS 1.2 at least**; 1.3 is negotiated whenever both ends have it (OpenSSL's default
  ceiling), with Python's default cipher list (forward-secret AEAD suites only).
* **No hostname check by default.** Workers dial each other at the IP addresses of the
  rendezvous table, often private, ephemeral ones that no certificate names; the trust decision
  is "signed by this cluster's CA", so use a CA that signs nothing else. To also pin a name, set
  ``server_hostname``: the dialer then requires it in the listener's certificate (subject
  alternative name), so every node's certificate, the coordinator's included, must carry it
  (e.g. one shared SAN such as ``paramsync.internal``).
* **Keys are unencrypted PEM files**: a daemon has nobody to type a passphrase, so an
  encrypted key is refused at configuration time instead of prompting.

No ``close_notify`` is exchanged (trio's ``https_compatible`` mode): paramsync frames carry
their own lengths, so a truncated stream is already detected, and closing never waits on the
peer.
"""

from __future__ import annotations

import math
import os
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import trio

from paramsync.runtime.errors import HandshakeError

__all__ = ["TlsConfig", "describe_tls_error"]

_ALERT_SECONDS = 0.5
"""How long a failed handshake may spend handing its TLS alert to the peer."""

_NOT_TLS = frozenset({"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNKNOWN_PROTOCOL"})
"""OpenSSL's reasons for a first record that is not TLS at all."""
_NOT_OUR_CA = "the peer's certificate is not signed by the CA given as --tls-ca"
_HANG_UP = (
    "the peer hung up during the TLS handshake: did it refuse this side's certificate, or does "
    "it not speak TLS?"
)
_HINTS = {
    "wrong version number": "the peer does not speak TLS: is it running without --tls-*?",
    "tlsv1 alert unknown ca": "the peer does not trust this side's certificate: sign every "
    "node's certificate with the CA given as --tls-ca",
    "unable to get local issuer certificate": _NOT_OUR_CA,
    "self-signed certificate in certificate chain": _NOT_OUR_CA,
    "self-signed certificate": _NOT_OUR_CA,
}


class _EncryptedKey(Exception):
    """Raised by the password callback: the key file wants a passphrase."""


def _no_passphrase() -> bytes:
    raise _EncryptedKey


def _path(name: str, value: object) -> Path:
    if isinstance(value, bool) or not isinstance(value, str | os.PathLike):
        raise ValueError(f"TLS {name} must be a file path, got {value!r}")
    path = Path(value)
    if not str(path).strip():
        raise ValueError(f"TLS {name} must be a file path, got an empty string")
    return path


@dataclass(frozen=True)
class TlsConfig:
    """Mutual TLS for every paramsync connection: this node's certificate and key, and the CA
    that signed every node's certificate.

    Paths may be given as strings; each must name a readable file (``ValueError`` naming the
    file otherwise). `from_paths` also parses them. ``server_hostname``: see the module doc.
    """

    cert: Path
    key: Path
    ca: Path
    server_hostname: str | None = None
    _contexts: dict[bool, ssl.SSLContext] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for name, label in (("cert", "certificate"), ("key", "key"), ("ca", "CA")):
            path = _path(label, getattr(self, name))
            try:
                with path.open("rb") as handle:
                    handle.read(1)
            except OSError as exc:
                raise ValueError(
                    f"cannot read the TLS {label} file {str(path)!r}: {exc.strerror or exc}"
                ) from None
            object.__setattr__(self, name, path)
        if self.server_hostname is not None and (
            not isinstance(self.server_hostname, str) or not self.server_hostname
        ):
            raise ValueError(
                f"TLS server_hostname must be a non-empty str, got {self.server_hostname!r}"
            )

    @classmethod
    def from_paths(
        cls,
        cert: str | os.PathLike[str],
        key: str | os.PathLike[str],
        ca: str | os.PathLike[str],
        server_hostname: str | None = None,
    ) -> TlsConfig:
        """Build and check a config: files readable, PEM that OpenSSL accepts, key matching
        the certificate. Every problem is a ``ValueError`` naming the file."""
        config = cls(Path(cert), Path(key), Path(ca), server_hostname)
        config.server_context()
        config.client_context()
        return config

    # ---------------------------------------------------------------- contexts

    def server_context(self) -> ssl.SSLContext:
        """The context of the accepting side (built once): requires a client certificate."""
        return self._context(server=True)

    def client_context(self) -> ssl.SSLContext:
        """The context of the dialing side (built once): presents this node's certificate."""
        return self._context(server=False)

    def _context(self, *, server: bool) -> ssl.SSLContext:
        context = self._contexts.get(server)
        if context is None:
            context = self._build(server)
            self._contexts[server] = context
        return context

    def _build(self, server: bool) -> ssl.SSLContext:
        context = _AlertKeepingContext(
            ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT
        )
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if not server:
            context.check_hostname = self.server_hostname is not None
        context.verify_mode = ssl.CERT_REQUIRED
        try:
            context.load_verify_locations(cafile=str(self.ca))
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(
                f"TLS CA file {str(self.ca)!r} holds no usable PEM certificate: "
                f"{describe_tls_error(exc)}"
            ) from None
        try:
            context.load_cert_chain(str(self.cert), str(self.key), password=_no_passphrase)
        except _EncryptedKey:
            raise ValueError(
                f"TLS key file {str(self.key)!r} is encrypted: paramsync needs an unencrypted "
                f"PEM key (keep it readable by this user only)"
            ) from None
        except (ssl.SSLError, OSError) as exc:
            reason = describe_tls_error(exc)
            if "mismatch" in reason:
                which = f"key file {str(self.key)!r} is not the key of {str(self.cert)!r}"
            else:
                which = (
                    f"certificate file {str(self.cert)!r} or key file {str(self.key)!r} is not PEM"
                )
            raise ValueError(f"TLS {which}: {reason}") from None
        return context

    # ---------------------------------------------------------------- handshakes

    async def wrap_server(
        self,
        stream: trio.SocketStream,
        peer: str,
        *,
        seconds: float | None = None,
        plaintext_reply: bytes = b"",
    ) -> trio.SSLStream[trio.SocketStream]:
        """Run the accepting side's TLS handshake on ``stream``; return the encrypted stream.

        A failure closes ``stream`` and raises `HandshakeError` naming ``peer`` and the TLS
        reason; ``seconds`` bounds the handshake (else the caller's deadline does). A peer
        whose first bytes are not TLS at all is sent ``plaintext_reply`` in the clear first
        (paramsync: a ``refuse`` frame saying that TLS is required).
        """
        with _outgoing_of_the_next_wrap() as outgoing:
            wrapped = trio.SSLStream(
                stream, self.server_context(), server_side=True, https_compatible=True
            )
        await _handshake(wrapped, outgoing, peer, seconds, plaintext_reply)
        return wrapped

    async def wrap_client(
        self, stream: trio.SocketStream, peer: str, *, seconds: float | None = None
    ) -> trio.SSLStream[trio.SocketStream]:
        """Run the dialing side's TLS handshake on ``stream``; see `wrap_server`.

        Under TLS 1.3 the listener checks this side's certificate after this returns: a
        refusal shows up on the first read (`paramsync.runtime.transport.tcp.dial` reports it as a
        HandshakeError).
        """
        with _outgoing_of_the_next_wrap() as outgoing:
            wrapped = trio.SSLStream(
                stream,
                self.client_context(),
                server_hostname=self.server_hostname,
                https_compatible=True,
            )
        await _handshake(wrapped, outgoing, peer, seconds)
        return wrapped


class _AlertKeepingContext(ssl.SSLContext):
    """An ``SSLContext`` that hands the memory BIO OpenSSL writes the peer's bytes into to
    whoever asked with `_outgoing_of_the_next_wrap`: after a failed handshake that BIO holds
    the alert saying why, which trio's ``SSLStream`` raises without sending."""

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        sink = _WRAPPED_OUTGOING.get()
        if sink is not None:
            sink.append(outgoing)
        return super().wrap_bio(incoming, outgoing, server_side, server_hostname, session)


_WRAPPED_OUTGOING: ContextVar[list[ssl.MemoryBIO] | None] = ContextVar(
    "paramsync_tls_outgoing", default=None
)


@contextmanager
def _outgoing_of_the_next_wrap() -> Iterator[list[ssl.MemoryBIO]]:
    """Collects the outgoing BIO of the TLS objects an `_AlertKeepingContext` wraps within
    the block (the stream built there: trio builds its ``SSLObject`` in its constructor)."""
    sink: list[ssl.MemoryBIO] = []
    token = _WRAPPED_OUTGOING.set(sink)
    try:
        yield sink
    finally:
        _WRAPPED_OUTGOING.reset(token)


async def _handshake(
    stream: trio.SSLStream[trio.SocketStream],
    outgoing: list[ssl.MemoryBIO],
    peer: str,
    seconds: float | None,
    plaintext_reply: bytes = b"",
) -> None:
    try:
        with trio.fail_after(math.inf if seconds is None else seconds):
            await stream.do_handshake()
    except trio.TooSlowError:
        await trio.aclose_forcefully(stream)
        raise HandshakeError(f"TLS handshake not finished within {seconds} s", peer=peer) from None
    except trio.BrokenResourceError as exc:
        cause = exc.__cause__
        if isinstance(cause, ssl.SSLError) and cause.reason in _NOT_TLS and plaintext_reply:
            await _send_raw(stream, plaintext_reply)
        else:
            await _send_alert(stream, outgoing)
        await trio.aclose_forcefully(stream)
        reason = describe_tls_error(exc)
        raise HandshakeError(f"TLS handshake failed: {reason}", peer=peer) from None
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise


async def _send_alert(
    stream: trio.SSLStream[trio.SocketStream], outgoing: list[ssl.MemoryBIO]
) -> None:
    """Hand the peer the alert OpenSSL wrote when the handshake failed, so it learns why
    ("unknown ca") rather than seeing a bare hang-up. trio raises without sending it. Nothing
    to send when the stream's TLS object was not built by an `_AlertKeepingContext`."""
    for bio in outgoing:
        if bio.pending:
            await _send_raw(stream, bio.read())


async def _send_raw(stream: trio.SSLStream[trio.SocketStream], data: bytes) -> None:
    """Best effort: ``data`` on the TCP stream under ``stream``, briefly."""
    with trio.move_on_after(_ALERT_SECONDS):
        try:
            await stream.transport_stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass


def describe_tls_error(error: BaseException | None) -> str:
    """The OpenSSL reason behind a failed TLS operation, in words, with a hint when one is
    known, e.g. ``certificate verify failed: unable to get local issuer certificate``.

    Follows the exception chain (trio raises ``BrokenResourceError`` from the ``SSLError``).
    """
    seen: set[int] = set()
    exc = error
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ssl.SSLCertVerificationError):
            hint = _HINTS.get(exc.verify_message)
            reason = f"certificate verify failed: {exc.verify_message}"
            return f"{reason} ({hint})" if hint else reason
        if isinstance(exc, ssl.SSLEOFError | ssl.SSLSyscallError):
            return _HANG_UP
        if isinstance(exc, ssl.SSLError):
            if exc.reason:
                reason = exc.reason.lower().replace("_", " ")
            else:
                reason = str(exc.strerror or exc)
            hint = _HINTS.get(reason)
            return f"{reason} ({hint})" if hint else reason
        exc = exc.__cause__ or exc.__context__
    return str(error) or type(error).__name__
