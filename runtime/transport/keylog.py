"""The opt-in key log, as SSLKEYLOGFILE is for TLS: with ``PARAMSYNC_KEYLOG_FILE=path`` set,
each process appends one line per connection whose handshake completed, holding what a reader
needs to check that connection's frame tags (docs/protocol.md section 5.5)::

    PARAMSYNC_FRAME_KEYS <nonce_d> <nonce_l> <k_dl> <k_ld>

lowercase hex, one space apart: the dialer's and the listener's nonces (from the ``hello`` and
the ``challenge``, which name the connection in a capture) and its two direction keys
(`paramsync.runtime.protocol.frame_auth.direction_keys`). Both ends of a connection may write
the same line. The file is created with mode 0600; the first line a process writes logs a
warning. Unset (the default), nothing is written. Whoever reads the file can check and forge
every logged connection's frames: it is for debugging with captures, never for production.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from paramsync.runtime.protocol.frame_auth import direction_keys

__all__ = ["KEYLOG_ENV", "KEYLOG_LABEL", "keylog_line", "log_connection"]

KEYLOG_ENV = "PARAMSYNC_KEYLOG_FILE"
KEYLOG_LABEL = "PARAMSYNC_FRAME_KEYS"

log = logging.getLogger("paramsync.keylog")
_warned: set[str] = set()


def keylog_line(nonce_d: bytes, nonce_l: bytes, session_key: bytes) -> str:
    """The key log's line for one connection (newline included)."""
    k_dl, k_ld = direction_keys(session_key)
    fields = (nonce_d.hex(), nonce_l.hex(), k_dl.hex(), k_ld.hex())
    return f"{KEYLOG_LABEL} {' '.join(fields)}\n"


def log_connection(
    nonces: tuple[bytes, bytes], session_key: bytes, environ: Mapping[str, str] | None = None
) -> None:
    """Append the connection's line to the file named by ``PARAMSYNC_KEYLOG_FILE`` (in
    ``environ``, default the process's), creating it with mode 0600; nothing when unset.
    A file that cannot be written is logged, never raised: the connection goes on."""
    path = (os.environ if environ is None else environ).get(KEYLOG_ENV)
    if not path:
        return
    line = keylog_line(*nonces, session_key).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            mode = os.fstat(fd).st_mode & 0o777
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as exc:
        _warn_once(f"error:{path}", "cannot write the key log %s (%s): %s", KEYLOG_ENV, path, exc)
        return
    _warn_once(
        path,
        "%s is set: the frame keys of this process's connections are appended to %s; whoever "
        "reads it can check and forge their frames (unset it outside debugging)",
        KEYLOG_ENV,
        path,
    )
    if mode & 0o077:
        _warn_once(
            f"mode:{path}",
            "the key log %s has mode %04o: its group or other users may read it (chmod 600)",
            path,
            mode,
        )


def _warn_once(key: str, message: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)
