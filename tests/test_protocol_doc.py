"""docs/protocol.md and docs/shared_memory.md checked against the bytes of a real connection.

Two ranks run the real handshake (`dial`, `accept`) through a proxy that records every byte of
each direction, then exchange frames (one with a bulk tensor each way). Section 8's reading code,
taken from the document and run as it is written, must read each direction from its first byte
to its last: the handshake's two frames without a trailer, then every frame with its tag checked
against section 5.4's keys and counter starting at 0 with the third frame. Section 5.4's test
vector is a current-version frame whose trailers the reference implementation reproduces, and
the shared-memory plane's ``shm_hello.host`` is what shared_memory.md says it is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import io
import logging
import os
import re
import socket
import stat
import struct
from pathlib import Path

import cbor2
import cpace_spec
import numpy as np
import pytest
import torch
import trio
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from paramsync.runtime.errors import PeerClosed
from paramsync.runtime.protocol.frame_auth import FrameSealer, direction_keys
from paramsync.runtime.protocol.handshake import Identity
from paramsync.runtime.protocol.messages import ShmHello
from paramsync.runtime.protocol.wire import PROTOCOL_VERSION, encode_frame_bytes
from paramsync.runtime.transport import keylog, shm
from paramsync.runtime.transport.tcp import DEFAULT_GROUP, Connection, accept, dial

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
SECRET = b"protocol-doc-test-secret-0123456789"


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end >= 0 else len(text)]


def reader() -> dict:
    """Section 8's Python code, executed as the document writes it."""
    (code,) = re.findall(r"```python\n(.*?)```", section(PROTOCOL, "## 8. Reading a frame"), re.S)
    namespace: dict = {}
    exec(compile(code, "docs/protocol.md section 8", "exec"), namespace)
    return namespace


async def capture(monkeypatch) -> tuple[bytes, bytes, bytes]:  # type: ignore[no-untyped-def]
    """(dialer -> listener bytes, listener -> dialer bytes, the session key) of a connection
    that ran the handshake and then one frame each way, each with a bulk tensor."""
    keys: list[bytes] = []
    original = Connection.authenticate_frames

    def spy(self: Connection, session_key: bytes, *, dialer: bool) -> None:
        keys.append(session_key)
        original(self, session_key, dialer=dialer)

    monkeypatch.setattr(Connection, "authenticate_frames", spy)
    to_listener, to_dialer = bytearray(), bytearray()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    proxies = await trio.open_tcp_listeners(0, host="127.0.0.1")
    upstream = listeners[0].socket.getsockname()[:2]
    proxy = proxies[0].socket.getsockname()[:2]

    async def pump(source: trio.SocketStream, sink: trio.SocketStream, into: bytearray) -> None:
        while data := await source.receive_some():
            into += data
            await sink.send_all(data)
        await sink.send_eof()

    async with trio.open_nursery() as nursery:

        async def relay() -> None:
            downstream = await proxies[0].accept()
            up = await trio.open_tcp_stream(*upstream)
            async with trio.open_nursery() as pumps:
                pumps.start_soon(pump, downstream, up, to_listener)
                pumps.start_soon(pump, up, downstream, to_dialer)

        async def listen(done: list, welcomed: trio.Event) -> None:
            stream = await listeners[0].accept()
            me = Identity(DEFAULT_GROUP, 2, 0)
            done.append((await accept(stream, SECRET, me, lambda _peer: None))[0])
            welcomed.set()

        nursery.start_soon(relay)
        accepted: list[Connection] = []
        welcomed = trio.Event()
        nursery.start_soon(listen, accepted, welcomed)
        dialer, _ = await dial(proxy, SECRET, Identity(DEFAULT_GROUP, 2, 1))
        await welcomed.wait()
        listener = accepted[0]
        await dialer.send("coll", {"op": 1, "hop": 0, "part": 0}, torch.tensor([1.0, 2.0, 3.0]))
        await listener.recv()
        await listener.send("coll", {"op": 1, "hop": 1, "part": 0}, torch.arange(4))
        await dialer.recv()
        await dialer.aclose()
        await listener.aclose()
    await listeners[0].aclose()
    await proxies[0].aclose()
    assert len(set(keys)) == 1 and len(keys) == 2, "both ends derive one session key"
    return bytes(to_listener), bytes(to_dialer), keys[0]


def test_section_8_reads_both_directions_of_a_real_connection(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    to_listener, to_dialer, session_key = trio.run(capture, monkeypatch)
    doc = reader()
    assert doc["VERSION"] == PROTOCOL_VERSION
    for data, from_dialer, handshake, bulk in (
        (to_listener, True, ["hello", "auth"], [1.0, 2.0, 3.0]),
        (to_dialer, False, ["challenge", "welcome"], [0, 1, 2, 3]),
    ):
        stream = io.BytesIO(data)
        kinds = [doc["read_frame"](stream)["kind"] for _ in handshake]  # no trailers
        assert kinds == handshake
        check = doc["TagCheck"](doc["direction_key"](session_key, from_dialer))
        frames = []
        while stream.tell() < len(data):
            frames.append(doc["read_frame"](stream, check))
        assert stream.tell() == len(data) and check.n == len(frames) == 1  # frame 0: the third
        assert frames[0]["kind"] == "coll"
        assert np.array_equal(doc["to_array"](frames[0]["data"]), np.array(bulk))
    assert doc["direction_key"](session_key, True) == direction_keys(session_key)[0]


def verify_with_key_log(keylog: str, to_listener: bytes, to_dialer: bytes) -> int:
    """The key log's reader (section 5.5), written from the document: find the connection's
    line by the nonces of its hello and challenge, then check every later frame's tag in both
    directions with section 8's code. Returns the number of tags checked; raises on any
    mismatch."""
    doc = reader()
    keys = {}
    for line in keylog.splitlines():
        label, nonce_d, nonce_l, k_dl, k_ld = line.split(" ")
        assert label == "PARAMSYNC_FRAME_KEYS"
        keys[nonce_d, nonce_l] = (bytes.fromhex(k_dl), bytes.fromhex(k_ld))
    from_dialer, from_listener = io.BytesIO(to_listener), io.BytesIO(to_dialer)
    hello, challenge = doc["read_frame"](from_dialer), doc["read_frame"](from_listener)
    k_dl, k_ld = keys[hello["nonce"].hex(), challenge["nonce"].hex()]
    checked = 0
    for stream, data, key in ((from_dialer, to_listener, k_dl), (from_listener, to_dialer, k_ld)):
        doc["read_frame"](stream)  # auth, welcome: the handshake's second frame, no trailer
        check = doc["TagCheck"](key)
        while stream.tell() < len(data):
            doc["read_frame"](stream, check)
        checked += check.n
    return checked


def test_the_key_log_lets_a_reader_check_every_tag_of_a_captured_connection(
    monkeypatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    """Third security review, row 10: a capture and the secret do not give the session keys,
    and nothing logged them. With PARAMSYNC_KEYLOG_FILE, both ends append the connection's
    line (mode 0600, one warning), and the verifier above checks every tag of the capture."""
    path = tmp_path / "keys.log"
    monkeypatch.setenv("PARAMSYNC_KEYLOG_FILE", str(path))
    with caplog.at_level(logging.WARNING, logger="paramsync.keylog"):
        to_listener, to_dialer, _ = trio.run(capture, monkeypatch)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    lines = path.read_text(encoding="ascii").splitlines()
    assert len(lines) == 2 and lines[0] == lines[1], lines  # both ends, one line each
    assert re.fullmatch(r"PARAMSYNC_FRAME_KEYS( [0-9a-f]{64}){4}", lines[0])
    assert verify_with_key_log(path.read_text(), to_listener, to_dialer) == 2
    warned = [r.getMessage() for r in caplog.records if r.name == "paramsync.keylog"]
    assert len(warned) == 1 and "PARAMSYNC_KEYLOG_FILE" in warned[0] and str(path) in warned[0]
    tampered = bytearray(to_dialer)
    tampered[-20] ^= 1  # a bit of the listener's last frame
    with pytest.raises(ValueError, match="frame 0: the tag does not match"):
        verify_with_key_log(path.read_text(), to_listener, bytes(tampered))


def test_no_key_log_unless_asked_and_a_readable_one_is_warned_about(
    monkeypatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("PARAMSYNC_KEYLOG_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="paramsync.keylog"):
        trio.run(capture, monkeypatch)
    assert not [r for r in caplog.records if r.name == "paramsync.keylog"]
    assert list(tmp_path.iterdir()) == []
    shared = tmp_path / "shared.log"
    shared.touch(mode=0o644)
    shared.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="paramsync.keylog"):
        keylog.log_connection((b"d" * 32, b"l" * 32), bytes(32), {keylog.KEYLOG_ENV: str(shared)})
    assert "has mode 0644" in caplog.text and shared.read_text().count("\n") == 1


def test_a_frame_read_without_its_trailer_loses_the_stream(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Why section 8 reads the trailer: read as a handshake frame, the next prefix is the
    trailer's bytes, and the reader stops there."""
    to_listener, _, _ = trio.run(capture, monkeypatch)
    doc = reader()
    stream = io.BytesIO(to_listener)
    for _ in range(3):  # hello, auth, then the first authenticated frame without its trailer
        doc["read_frame"](stream)
    with pytest.raises((ValueError, struct.error, cbor2.CBORDecodeError)):
        doc["read_frame"](stream)


def test_the_test_vector_is_a_current_frame_with_its_trailers() -> None:
    text = section(PROTOCOL, "### 5.4 Frame authentication")
    session_key = bytes.fromhex(re.search(r"session key\s*`([0-9a-f]{64})`", text)[1])
    k_dl = bytes.fromhex(re.search(r"`k_dl = ([0-9a-f]{64})`", text)[1])
    k_ld = bytes.fromhex(re.search(r"`k_ld = ([0-9a-f]{64})`", text)[1])
    assert direction_keys(session_key) == (k_dl, k_ld)
    frame = bytes.fromhex(re.search(r"```\n([0-9a-f]+)\n```", text)[1])
    assert frame == encode_frame_bytes("rdv_join", {"host": "10.0.0.2", "port": 29500})
    assert cbor2.loads(frame[8:])["v"] == PROTOCOL_VERSION
    dialer_0, dialer_1, listener_0 = re.findall(r"`(50[0-9a-f]{32})`", text)
    sealer = FrameSealer(k_dl)
    assert [sealer.seal([frame]).hex(), sealer.seal([frame]).hex()] == [dialer_0, dialer_1]
    assert FrameSealer(k_ld).seal([frame]).hex() == listener_0
    doc = reader()
    check = doc["TagCheck"](k_dl)
    check(frame, bytes.fromhex(dialer_0))
    check(frame, bytes.fromhex(dialer_1))
    assert check.n == 2


def test_shm_hello_host_is_what_the_shared_memory_document_says() -> None:
    doc = (ROOT / "docs" / "shared_memory.md").read_text(encoding="utf-8")
    assert "the network namespace (`readlink /proc/self/ns/net`" in doc
    host = cbor2.loads(encode_frame_bytes(*_hello(shm.host_identity({})))[8:])["host"]
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    netns = os.readlink("/proc/self/ns/net")
    assert re.fullmatch(r"net:\[[0-9]+\]", netns)
    assert host == f"{boot}/{netns}/{socket.gethostname()}"
    given = cbor2.loads(
        encode_frame_bytes(*_hello(shm.host_identity({"PARAMSYNC_HOST_ID": "a"})))[8:]
    )
    assert given["host"] == "id:a"
    long = "x" * 129
    hashed = shm.host_identity({"PARAMSYNC_HOST_ID": long})
    assert re.fullmatch(r"id-sha256:[0-9a-f]{64}", hashed)


def _hello(host: str) -> tuple[str, dict]:
    message = ShmHello(host=host, want=True)
    wire = message.to_wire()
    return wire[0], wire[1]


def test_section_1s_limits_are_the_code_s() -> None:
    """Every row of section 1's table of limits names a constant of the wire or the limits
    module and gives its value (the number before any parenthesis, spaces as thousands
    separators); the limits the readers enforce are all in the table."""
    from paramsync.runtime.coordinator import frame_caps
    from paramsync.runtime.protocol import limits, wire

    table = section(PROTOCOL, "### Limits").split("\n\n")[1]
    rows = re.findall(r"^\| `([A-Z_]+)` \| ([^|]+?) \|", table, re.M)
    documented = {}
    for name, value in rows:
        number = value.split("(")[0].replace(" ", "")
        documented[name] = int(number)
    modules = (wire, limits, frame_caps)
    code = {
        name: next(getattr(m, name) for m in modules if hasattr(m, name)) for name in documented
    }
    assert documented == code
    enforced = {"PREFIX_SIZE", "DEFAULT_MAX_FRAME", "HANDSHAKE_MAX_FRAME", "MAX_DEPTH"}
    enforced |= {"TAG_SIZE", "TRAILER_SIZE", "CONTROL_MAX_FRAME", "BULK_MAX_FRAME"}
    enforced |= {"INLINE_TENSOR_MAX", "PEEK_SIZE", "SCAN_THRESHOLD", "MAX_ITEMS"}
    enforced |= {"MAX_MODEL_TENSORS", "JOIN_ENTRY_BYTES", "FIRST_JOIN_MAX_FRAME"}
    assert set(documented) == enforced


def test_section_1s_bulk_kinds_and_unbounded_kinds_are_the_code_s() -> None:
    from paramsync.runtime.protocol import limits

    text = section(PROTOCOL, "### Limits")
    bulk = re.search(r"The kinds whose tensor is their bulk \(([^:]+):", text)
    assert bulk is not None
    assert set(re.findall(r"`(\w+)`", bulk.group(1))) == set(limits.BULK_KINDS)
    unbounded = re.search(r"for kinds with an unbounded map or list \(([^)]+)\)", text)
    assert unbounded is not None
    named = set(re.findall(r"`(\w+)`", unbounded.group(1)))
    big = {
        kind
        for kind in limits.KINDS
        if limits.kind_max_frame(kind) == limits.BULK_MAX_FRAME and kind not in limits.BULK_KINDS
    }
    assert named == big and len(big) >= 5


# --------------------------------------------------------------------------- section 5's text


def example_values(text: str) -> dict[str, bytes]:
    """Section 5.1's example vector: name -> 32 bytes."""
    return {
        name: bytes.fromhex(value)
        for name, value in re.findall(r"^(\w+) +([0-9a-f]{64})$", text, re.M)
    }


def repeated(text: str, name: str) -> bytes:
    """An example input written as ``<name> <count> bytes of `0x<byte>```."""
    found = re.search(rf"{name} (\d+)\s+bytes\s+of\s+`0x([0-9a-f]{{2}})`", text)
    assert found is not None, name
    return bytes.fromhex(found[2]) * int(found[1])


def identity(text: str, who: str) -> Identity:
    found = re.search(rf"{who}\s+`\(\"(\w+)\", (-?\d+), (-?\d+)\)`", text)
    assert found is not None, who
    return Identity(found[1], int(found[2]), int(found[3]))


def doc_transcript(text: str, label: bytes, first: bytes, second: bytes, *ids: Identity) -> bytes:
    """Section 5.1's transcript, its version the ``u16be(n)`` the document writes."""
    version = int(re.search(r"label\s+\|\|\s+u16be\((\d+)\)", text)[1])
    out = label + version.to_bytes(2, "big") + first + second
    for ident in ids:
        group = ident.group.encode()
        out += len(group).to_bytes(2, "big") + group
        out += ident.world_size.to_bytes(4, "big") + (ident.rank + 1).to_bytes(4, "big")
    return out


def lv(value: bytes) -> bytes:
    return len(value).to_bytes(2, "big") + value


def test_section_5_1s_vector_is_built_from_the_documents_own_text() -> None:
    """Third security review, row 11: every label, parameter and input of section 5.1's example
    is read from the document, and the vector is recomputed from them alone."""
    text = section(PROTOCOL, "### 5.1 ")
    values = example_values(text)
    secret = re.search(r"secret\s+`([^`]+)`", text)[1].encode()
    salt_l, nonce_d, nonce_l = (repeated(text, name) for name in ("salt_l", "nonce_d", "nonce_l"))
    y_d, y_l = repeated(text, "y_d"), repeated(text, "y_l")
    dialer, listener = identity(text, "dialer"), identity(text, "listener")
    scrypt = re.search(
        r'salt = "([^"]+)" \|\| salt_l,\s+N = (\d+), r = (\d+), p = (\d+), dkLen = (\d+)', text
    )
    assert scrypt is not None, "section 5.1 gives K's scrypt salt and parameters"
    label, n, r, p, dklen = scrypt[1].encode(), *map(int, scrypt.groups()[1:])
    k = hashlib.scrypt(secret, salt=label + salt_l, n=n, r=r, p=p, maxmem=64 << 20, dklen=dklen)
    assert k == values["K"]
    generator_label = re.search(r'SHA-512\( "([^"]+)"', text)[1].encode()
    name = dialer.group.encode()
    digest = hashlib.sha512(
        generator_label + lv(k) + lv(name) + dialer.world_size.to_bytes(4, "big") + lv(nonce_d)
    ).digest()
    g = cpace_spec.elligator2(int.from_bytes(digest, "little")).to_bytes(32, "little")
    assert g == values["G"]
    share_d, share_l = cpace_spec.x25519(y_d, g), cpace_spec.x25519(y_l, g)
    assert (share_d, share_l) == (values["share_d"], values["share_l"])
    isk_label = re.search(r'SHA-256\( "([^"]+)"', text)[1].encode()
    isk = hashlib.sha256(isk_label + cpace_spec.x25519(y_d, share_l) + share_d + share_l).digest()
    assert isk == values["ISK"]
    nonces = {"nonce_d": nonce_d, "nonce_l": nonce_l}
    who = {"dialer": dialer, "listener": listener}
    rows = re.findall(
        r"^\| `?([\w ]+?)`?(?:, in `\w+`| \(never sent\)) \| `([^`]+)` \| \((\w+), (\w+)\) \| "
        r"([\w, ]+) \|$",
        text,
        re.M,
    )
    names = {"proof_d": "proof_d", "proof_l": "proof_l", "session key": "session"}
    assert {row[0] for row in rows} == set(names), rows
    for value, mac_label, first, second, ids in rows:
        transcript = doc_transcript(
            text,
            mac_label.encode(),
            nonces[first],
            nonces[second],
            *(who[i.strip()] for i in ids.split(",")),
        )
        assert hmac.new(isk, transcript, hashlib.sha256).digest() == values[names[value]], value


def test_section_5_4s_session_key_and_vector_are_built_from_the_documents_own_text() -> None:
    """Row 11: section 5.4 gave the session key as HMAC(K, ...) while the code keys it by the
    ISK. Its formula, read here, must give section 5.1's session key from 5.1's values, and
    its direction keys and trailers follow from its own labels and nonce layout."""
    first = section(PROTOCOL, "### 5.1 ")
    values = example_values(first)
    text = section(PROTOCOL, "### 5.4 ")
    formula = re.search(
        r'session_key = HMAC-SHA256\((\w+), transcript\("([^"]+)", (\w+), (\w+), (\w+), (\w+)\)\)',
        text,
    )
    assert formula is not None
    key, label, n1, n2, i1, i2 = formula.groups()
    nonces = {"nonce_d": repeated(first, "nonce_d"), "nonce_l": repeated(first, "nonce_l")}
    who = {"dialer": identity(first, "dialer"), "listener": identity(first, "listener")}
    transcript = doc_transcript(first, label.encode(), nonces[n1], nonces[n2], who[i1], who[i2])
    session_key = hmac.new(values[key], transcript, hashlib.sha256).digest()
    assert session_key == values["session"], f"5.4's session key, keyed by {key}"
    assert re.search(r"session key\s*`([0-9a-f]{64})`", text)[1] == session_key.hex()
    direction = dict(re.findall(r'(k_\w\w) = HMAC-SHA256\(session_key, "([^"]+)"\)', text))
    keys = {
        name: hmac.new(session_key, label.encode(), hashlib.sha256).digest()
        for name, label in direction.items()
    }
    assert sorted(keys) == ["k_dl", "k_ld"]
    for name, digest in keys.items():
        assert re.search(rf"`{name} = ([0-9a-f]{{64}})`", text)[1] == digest.hex()
    assert "`00 00 00 00 || u64be(n)`" in text
    frame = bytes.fromhex(re.search(r"```\n([0-9a-f]+)\n```", text)[1])
    trailers = re.findall(r"`(50[0-9a-f]{32})`", text)

    def trailer(key: bytes, n: int) -> str:
        return "50" + AESGCM(key).encrypt(bytes(4) + n.to_bytes(8, "big"), b"", frame).hex()

    expected = [trailer(keys["k_dl"], 0), trailer(keys["k_dl"], 1), trailer(keys["k_ld"], 0)]
    assert trailers == expected


def test_the_handshake_messages_in_section_3_and_5_are_the_codes() -> None:
    """Row 11: the challenge's `share` was in no table or diagram. Section 3's table and
    section 5's diagram name exactly the fields of each handshake kind."""
    from paramsync.runtime.protocol.messages import Auth, Challenge, Hello, Welcome

    code = {m.KIND: [f.name for f in dataclasses.fields(m)] for m in (Hello, Challenge, Auth)}
    code["welcome"] = [f.name for f in dataclasses.fields(Welcome)]
    table = section(PROTOCOL, "## 3. Message kinds")
    diagram = re.search(r"```\n(dialer -> listener +hello.*?)```", PROTOCOL, re.S)[1]
    for kind, fields in code.items():
        row = re.search(rf"^\| `{kind}` \| [^|]+ \| (.+) \|$", table, re.M)[1]
        assert re.findall(r"`(\w+)`(?::|,| as in)", row) == fields, kind
        drawn = re.search(rf"\b{kind} +\{{([^}}]*)\}}", diagram)[1]
        assert [part.split(":")[0].strip() for part in drawn.split(",")] == fields, kind


def test_section_5_states_the_deviations_and_no_version_2_label() -> None:
    text = section(PROTOCOL, "## 5. The handshake")
    deviations = text[text.index("**Where this differs from the CPace draft**") :]
    deviations = deviations[: deviations.index("\n\n**Transcripts.**")]
    for point in (
        "`sid` is the dialer's nonce",
        "no zero padding",
        "64-byte SHA-512 digest, read little-endian, is reduced mod p",
        "ISK leaves out `sid`",
        "confirmation MACs are keyed by the ISK",
    ):
        assert point in " ".join(deviations.split()), point
    assert "paramsync/secret/v2" not in text
    assert "version 2" not in section(PROTOCOL, "### 5.3 ")
    low_order = text[text.index("**Low-order shares.**") :]
    assert "on_challenge" in low_order and "on_auth" in low_order


async def low_order_challenge() -> BaseException:
    """A listener that answers a hello with a low-order share: the dialer's error."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    address = listeners[0].socket.getsockname()[:2]

    async def answer() -> None:
        conn = Connection(await listeners[0].accept())
        await conn.recv(4096)
        fields = {"nonce": b"\x01" * 32, "salt": b"\x02" * 16, "share": bytes(32)}
        await conn.send("challenge", fields)
        with trio.fail_after(5), pytest.raises(PeerClosed):
            await conn.recv(4096)  # no auth: the dialer hangs up

    errors: list[Exception] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer)
        try:
            await dial(address, SECRET, Identity(DEFAULT_GROUP, 2, 1))
        except Exception as exc:  # returned to the test
            errors.append(exc)
    await listeners[0].aclose()
    assert errors, "the dialer accepted a low-order share"
    return errors[0]


def test_what_the_worker_prints_for_a_low_order_share_is_what_section_5_1_says() -> None:
    from paramsync.runtime.errors import AuthenticationError, configuration_error

    text = " ".join(section(PROTOCOL, "### 5.1 ").split())
    sentence = re.search(r"with the sentence `([^`]+)`", text)[1]
    error = trio.run(low_order_challenge)
    assert isinstance(error, AuthenticationError) and sentence in str(error)
    # No proof failed: the worker's line says what the peer did and never blames the secret.
    assert configuration_error(error) is None and "\n" not in str(error)
    assert "127.0.0.1:" in str(error) and "SECRET" not in str(error)
