"""Fuzz it yourself: the public strategies, the hostile-peer machine and ``paramsync fuzz``.

``paramsync fuzz`` runs as a user runs it (``python -m paramsync.runtime.cli.main fuzz``) against a
live coordinator daemon and a live worker's rendezvous listener (``paramsync allreduce`` rank 0
waiting for rank 1), with and without the secret, for a bounded number of examples: no failure,
memory within the bound. A coordinator whose core is wrapped to act on a report from a peer that
never joined (`paramsync.runtime.testing.faults.forged_report_core`) is caught, and the minimal
example printed.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paramsync.runtime.errors import FrameAuthenticationError, ProtocolError
from paramsync.runtime.protocol.frame_auth import frame_session
from paramsync.runtime.protocol.messages import KINDS
from paramsync.runtime.protocol.wire import (
    DEFAULT_MAX_FRAME,
    PREFIX_SIZE,
    decode_frame,
    decode_head,
    encode_frame_bytes,
    parse_prefix,
)
from paramsync.runtime.testing import hostile
from paramsync.runtime.testing.hostile import Deployment, check_deployment, check_target
from paramsync.runtime.testing.strategies import (
    DTYPE_NAMES,
    Frame,
    hostile_frames,
    seal_modes,
    spoil,
    tensors,
    valid_frames,
)

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "paramsync.runtime.cli.main"]
SECRET = "fuzz-test-secret-" + "a1B2c3D4e5F6g7H8"
BROKEN_COORDINATOR = (
    "import sys\n"
    "from paramsync.runtime.testing.faults import forged_report_core\n"
    "from paramsync.runtime.cli.main import main\n"
    "sys.exit(main(sys.argv[1:], coordinator_core=forged_report_core('heartbeat')))\n"
)


# --------------------------------------------------------------------------- strategies


def _decode_as_a_coordinator(data: bytes) -> dict:
    """What a coordinator's control link does with a whole frame (no tensors)."""
    item_len, bulk_len = parse_prefix(data[:PREFIX_SIZE], DEFAULT_MAX_FRAME)
    if len(data) - PREFIX_SIZE != item_len:
        raise ProtocolError("the frame is not whole")
    head = data[PREFIX_SIZE : PREFIX_SIZE + item_len - bulk_len]
    return decode_head(head, bulk_len, tensors=False)[0]


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(valid_frames(tensors=False))
def test_valid_frames_decode_as_their_kind(frame: Frame) -> None:
    assert frame.valid and frame.complete
    assert _decode_as_a_coordinator(frame.data)["kind"] == frame.kind


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_frames())
def test_hostile_frames_are_refused(frame: Frame) -> None:
    assert not frame.valid
    with pytest.raises(ProtocolError):
        _decode_as_a_coordinator(frame.data)


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(
    valid_frames(tensors=False),
    seal_modes(forged_only=True),
    st.binary(min_size=16, max_size=16),
    st.integers(0, 2**16),
)
def test_spoiled_frames_fail_authentication_and_sealed_ones_pass(
    frame: Frame, mode: str, tag: bytes, bit: int
) -> None:
    key = bytes(range(32))
    sender = frame_session(key, dialer=True).sealer
    trailer = sender.seal([frame.data])
    receiver = frame_session(key, dialer=False).opener
    genuine = spoil(frame.data, trailer, "sealed")
    receiver.open([genuine[: len(frame.data)]], genuine[len(frame.data) :])
    trailer = sender.seal([frame.data])
    wire = spoil(frame.data, trailer, mode, tag=tag, bit=bit)
    if mode == "unsealed":
        assert wire == frame.data
        return
    with pytest.raises(FrameAuthenticationError):
        receiver.open([wire[: len(frame.data)]], wire[len(frame.data) :])


@settings(max_examples=60)
@given(tensors())
def test_tensors_of_every_dtype_travel_bit_exact(tensor) -> None:
    frame = encode_frame_bytes("coll", {"op": 0, "hop": 0, "part": 0}, tensor)
    got = decode_frame(frame)["data"]
    assert got.dtype == tensor.dtype and tuple(got.shape) == tuple(tensor.shape)
    assert got.contiguous().view(-1).view(dtype=_same_width(tensor)).tolist() == (
        tensor.contiguous().view(-1).view(dtype=_same_width(tensor)).tolist()
    )


def _same_width(tensor):
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]


def test_tensors_cover_every_dtype_the_wire_carries() -> None:
    from paramsync.runtime.protocol.wire import DTYPE_TAGS

    assert sorted(str(d).removeprefix("torch.") for d in DTYPE_TAGS) == sorted(DTYPE_NAMES)
    assert "coll" in KINDS


# --------------------------------------------------------------------------- targets


def test_only_loopback_or_a_named_host_is_fuzzed() -> None:
    check_target("127.0.0.1")
    check_target("localhost")
    with pytest.raises(ValueError, match=r"not loopback.*--allow-host"):
        check_target("10.9.9.9")
    check_target("10.9.9.9", allowed_hosts=["10.9.9.9"])
    result = _fuzz_cli("--target", "10.9.9.9:29500")
    assert result.returncode == 2
    assert "is not loopback" in result.stdout


def test_ipv4_mapped_loopback_is_loopback() -> None:
    """``::ffff:127.0.0.1`` is 127.0.0.1 (checked and dialled as its IPv4 form); a mapped
    address outside loopback is not."""
    assert check_target("::ffff:127.0.0.1") == "127.0.0.1"
    assert check_target("::ffff:127.8.9.10") == "127.8.9.10"
    assert check_target("::1") == "::1"
    with pytest.raises(ValueError, match="not loopback"):
        check_target("::ffff:10.9.9.9")


def test_the_fuzzer_dials_the_address_it_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name is resolved once, when the target is checked: a resolver that answers with
    another host later (DNS rebinding) never gets the hostile traffic, every connection goes to
    the address that was checked."""
    answers = iter(["127.0.0.1"])
    resolved: list[str] = []

    def rebinding(host: str, *args: object, **kwargs: object) -> list[tuple[object, ...]]:
        resolved.append(host)
        address = next(answers, "203.0.113.7")  # loopback once, then somewhere else
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, 0))]

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        monkeypatch.setattr(hostile.socket, "getaddrinfo", rebinding)
        deployment = Deployment("target.invalid", port, deadline=5.0)
        assert deployment.address == ("127.0.0.1", port)
        sock = hostile._dial(deployment)
        with sock:
            assert sock.getpeername() == ("127.0.0.1", port)
    assert resolved == ["target.invalid"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMSYNC_")}
    env["PARAMSYNC_SECRET"] = SECRET
    env["PYTHONPATH"] = str(ROOT)
    return env


def _wait_for_port(port_of, proc: subprocess.Popen) -> int:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, "the target exited before listening"
        assert time.monotonic() < deadline, "the target never listened"
        port = port_of()
        if port:
            return port
        time.sleep(0.05)


def _coordinator(tmp_path: Path, *prefix: str) -> Iterator[int]:
    port_file = tmp_path / "port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [
            *prefix,
            "--log-level",
            "ERROR",
            "coordinator",
            "--world-size",
            "2",
            "--bind",
            "127.0.0.1:0",
            "--port-file",
            str(port_file),
        ],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "log").open("w"),
    )
    try:
        yield _wait_for_port(
            lambda: port_file.exists() and int(port_file.read_text().strip() or 0), proc
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """One coordinator daemon of a two-rank run nobody joins, for the module's fuzz runs."""
    yield from _coordinator(tmp_path_factory.mktemp("coordinator"), *CLI)


@pytest.fixture
def broken_coordinator(tmp_path: Path) -> Iterator[int]:
    yield from _coordinator(tmp_path, sys.executable, "-c", BROKEN_COORDINATOR)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def worker() -> Iterator[int]:
    """Rank 0 of a two-rank ``paramsync allreduce``: its rendezvous listener waits for rank 1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [
            *CLI,
            "allreduce",
            "--rank",
            "0",
            "--world-size",
            "2",
            "--coordinator",
            f"127.0.0.1:{port}",
        ],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield _wait_for_port(lambda: port if _listening(port) else 0, proc)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _fuzz_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "fuzz", *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120
    )


def _secret_file(tmp_path: Path) -> str:
    path = tmp_path / "secret"
    path.write_text(SECRET)
    path.chmod(0o600)
    return str(path)


def _check_clean(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    assert "result            no failure" in result.stdout
    examples = int(re.search(r"examples\s+(\d+)", result.stdout).group(1))
    assert examples >= 10
    memory = re.search(r"\(\+([\d.]+) MiB; bound \+64 MiB\)", result.stdout)
    assert memory is not None, result.stdout  # the target's memory was read
    assert float(memory.group(1)) <= 64


@pytest.mark.parametrize("with_secret", [False, True], ids=["stranger", "member"])
def test_paramsync_fuzz_finds_nothing_wrong_with_a_coordinator(
    coordinator: int, tmp_path: Path, with_secret: bool
) -> None:
    secret = ["--secret-file", _secret_file(tmp_path)] if with_secret else []
    result = _fuzz_cli(
        "--target", f"127.0.0.1:{coordinator}", *secret, "--examples", "15", "--seconds", "10"
    )
    _check_clean(result)
    if with_secret:
        assert "rank N is already taken" in result.stdout or "members admitted" in result.stdout


@pytest.mark.parametrize(
    "with_secret",
    [False, True],
    ids=["stranger", "member"],
)
def test_paramsync_fuzz_finds_nothing_wrong_with_a_worker(
    worker: int, tmp_path: Path, with_secret: bool
) -> None:
    secret = ["--secret-file", _secret_file(tmp_path)] if with_secret else []
    result = _fuzz_cli(
        "--target", f"127.0.0.1:{worker}", *secret, "--examples", "15", "--seconds", "10"
    )
    _check_clean(result)


def test_a_coordinator_acting_on_a_report_from_a_stranger_is_caught(
    broken_coordinator: int, tmp_path: Path
) -> None:
    result = _fuzz_cli(
        "--target",
        f"127.0.0.1:{broken_coordinator}",
        "--secret-file",
        _secret_file(tmp_path),
        "--examples",
        "1000",
        "--seconds",
        "60",
        "--steps",
        "3",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert "result            FAILURE" in out
    assert "acted on a heartbeat from a peer that never joined" in out
    example = out[out.index("minimal reproducing example:") :]
    assert "state.start_as_member()" in example
    assert "Frame(label='valid heartbeat'" in example
    assert "state.report_without_joining(" in example or "state.send_as_member(" in example


def test_check_deployment_from_a_users_suite(coordinator: int) -> None:
    summary = check_deployment("127.0.0.1", coordinator, secret=SECRET, examples=10, seconds=10)
    assert summary.ok and summary.examples >= 10
    assert summary.admitted >= 1
    assert summary.memory_growth <= summary.memory_bound


def test_fuzz_without_hypothesis_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from paramsync.runtime.cli.main import main

    for name in list(sys.modules):
        if name.split(".")[0] == "hypothesis" or name in (
            "paramsync.runtime.testing.hostile",
            "paramsync.runtime.testing.strategies",
        ):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    assert main(["fuzz", "--target", "127.0.0.1:1"]) == 2
    assert "pip install 'hypothesis>=6.100'" in capsys.readouterr().out
