"""Search everything a multi-node run wrote for any value computed from its secret (issue 39,
row 1: a run id derived from the secret was an offline oracle for it).

`run_two_nodes` runs a two-node-shaped launch on this host's network address (node 0 with the
coordinator and one rank, node 1 with one rank; ``paramsync launch --nnodes 2``, the LM demo
job with checkpoints, traces, summaries, logs at INFO and metrics endpoints scraped while it
trains; ``PARAMSYNC_KEYLOG_FILE`` unset). While it runs, every TCP listener of its processes
(found in ``/proc``: Linux only) is sent a ``hello`` and its challenge's scrypt salt kept, so
the scan knows every salt the run stretched the secret under. `secret_functions` lists every
value the project computes from the secret outside a handshake's fresh nonces and shares:

* the secret itself;
* the scrypt-stretched key under each salt the run's listeners use
  (`paramsync.runtime.protocol.handshake.stretch_secret`), and under version 3's constant salt;
* SHA-256 of the secret and of each stretched key;
* the version-3 run id (SHA-256 of a label, the secret and the coordinator's address).

The CPace generator, the ISK, the proofs, the session and direction keys also depend on both
sides' fresh nonces and shares, which no artefact holds; what would write the direction keys
(the key log) is off, and its line label `KEYLOG_LABEL` must appear nowhere. `scan` searches
every file for each value (and its first 8 bytes, 64 bits) raw, in hex of either case and in
base64 of either alphabet. ``tests/test_run_id.py`` and ``benchmarks/hostile.py --artefact-scan``
use it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from paramsync.runtime.protocol.handshake import DialerHandshake, Identity, stretch_secret
from paramsync.runtime.protocol.messages import SALT_SIZE
from paramsync.runtime.protocol.wire import HANDSHAKE_MAX_FRAME, decode_frame, encode_frame_bytes
from paramsync.runtime.testing.process_watch import listening_sockets
from paramsync.runtime.transport.keylog import KEYLOG_LABEL

__all__ = [
    "VERSION_3_SALT",
    "RunArtefacts",
    "ScanReport",
    "forms",
    "listening_ports",
    "probe_salt",
    "run_two_nodes",
    "scan",
    "secret_functions",
    "this_hosts_address",
]

VERSION_3_SALT = b"paramsync/secret/v2"
"""The one scrypt salt of protocol versions 2 and 3 (no listener salt)."""
_V3_RUN_ID_LABEL = b"paramsync-run-id\0"
_PREFIX = struct.Struct(">II")


def this_hosts_address() -> str | None:
    """An address of this host other than loopback (the interface of its default route)."""
    for probe in ("192.0.2.1", "10.255.255.255", "198.51.100.1"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.connect((probe, 9))
                address = sock.getsockname()[0]
        except OSError:
            continue
        if not address.startswith("127.") and address != "0.0.0.0":
            return str(address)
    return None


def secret_functions(
    secret: bytes, coordinator: str, salts: Iterable[bytes] = ()
) -> dict[str, bytes]:
    """Every value the project computes from ``secret`` outside a handshake's fresh values
    (module doc), by name; ``salts``: the listeners' scrypt salts the run used."""
    values = {"the secret": secret, "SHA-256 of the secret": hashlib.sha256(secret).digest()}
    keys = {
        f"the key stretched under salt {salt.hex()}": stretch_secret(secret, salt) for salt in salts
    }
    keys["the key stretched under version 3's constant salt"] = hashlib.scrypt(
        secret, salt=VERSION_3_SALT, n=2**14, r=8, p=1, maxmem=64 * 2**20, dklen=32
    )
    for name, key in keys.items():
        values[name] = key
        values[f"SHA-256 of {name}"] = hashlib.sha256(key).digest()
    former = hashlib.sha256(_V3_RUN_ID_LABEL + secret + coordinator.encode()).digest()
    values["the version-3 run id"] = former[:8]
    return values


def forms(value: bytes) -> list[bytes]:
    """How an artefact could hold ``value`` (or its first 8 bytes, 64 bits): raw, hex of either
    case, base64 of either alphabet; forms shorter than 8 bytes are left out."""
    out: list[bytes] = []
    for part in dict.fromkeys((value, value[:8])):
        out += [part, part.hex().encode(), part.hex().upper().encode()]
        out += [base64.b64encode(part).rstrip(b"="), base64.urlsafe_b64encode(part).rstrip(b"=")]
    return list(dict.fromkeys(f for f in out if len(f) >= 8))


@dataclass
class ScanReport:
    """What `scan` found: files and bytes searched, hits per value (all zero when clean)."""

    files: int = 0
    bytes: int = 0
    values: int = 0
    forms: int = 0
    hits: dict[str, int] = field(default_factory=dict)
    found: list[str] = field(default_factory=list)
    """One line per hit: the value's name, its form and the file."""

    @property
    def clean(self) -> bool:
        return not self.found


def scan(paths: Sequence[Path], values: dict[str, bytes], root: Path | None = None) -> ScanReport:
    """Search every file of ``paths`` for every form of every value, and for the key log's
    line label; ``root`` shortens the paths named in the report."""
    report = ScanReport(files=len(paths), values=len(values))
    searched = {name: forms(value) for name, value in values.items()}
    searched[f"a key log line ({KEYLOG_LABEL})"] = [KEYLOG_LABEL.encode()]
    report.forms = sum(len(f) for f in searched.values())
    for path in paths:
        data = path.read_bytes()
        report.bytes += len(data)
        where = path.relative_to(root) if root is not None else path
        for name, candidates in searched.items():
            count = 0
            for form in candidates:
                if form in data:
                    count += 1
                    report.found.append(f"{name} ({form[:12]!r}...) in {where}")
            report.hits[name] = report.hits.get(name, 0) + count
    return report


# ----------------------------------------------------------------------------- the salts


def _descendants(pids: Iterable[int]) -> set[int]:
    """``pids`` and every process below them (from /proc/*/stat's parent ids)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found = set(pids)
    grew = True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in found and pid not in found:
                found.add(pid)
                grew = True
    return found


def listening_ports(pids: Iterable[int]) -> set[int]:
    """The TCP ports processes ``pids`` and their descendants listen on (Linux /proc)."""
    inodes: set[str] = set()
    for pid in _descendants(pids):
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return {port for port, inode in listening_sockets() if inode in inodes}


def probe_salt(host: str, port: int, seconds: float = 2.0) -> bytes | None:
    """Send a ``hello`` to ``host:port`` and hang up after the reply: the scrypt salt of its
    challenge, or None (not a paramsync listener, or a refusal)."""
    hello = DialerHandshake(secrets.token_bytes(32), Identity("probe", 1, 0)).hello()
    try:
        with socket.create_connection((host, port), timeout=seconds) as sock:
            sock.sendall(encode_frame_bytes(*hello))
            prefix = _recv_exactly(sock, _PREFIX.size)
            item_len, _ = _PREFIX.unpack(prefix)
            if item_len > HANDSHAKE_MAX_FRAME:
                return None
            message = decode_frame(prefix + _recv_exactly(sock, item_len), HANDSHAKE_MAX_FRAME)
    except Exception:  # a refusal, a hang-up, not a paramsync listener: no salt here
        return None
    salt = message.get("salt") if message.get("kind") == "challenge" else None
    return bytes(salt) if isinstance(salt, bytes) and len(salt) == SALT_SIZE else None


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise OSError("closed")
        data += chunk
    return data


# ----------------------------------------------------------------------------- the run


@dataclass
class RunArtefacts:
    """A finished `run_two_nodes`: where it wrote, what it said, the salts its listeners used."""

    workdir: Path
    checkpoint_dir: Path
    coordinator: str
    exit_codes: list[int]
    log_text: str
    salts: set[bytes]
    ports_probed: int
    seconds: float

    def files(self) -> list[Path]:
        return sorted(p for p in self.workdir.rglob("*") if p.is_file())


def _probe(
    procs: list[subprocess.Popen[bytes]], host: str, salts: set[bytes], probed: set[int],
    done: threading.Event,
) -> None:  # fmt: skip
    """While the run lasts: each listener of its processes probed once for its salt (a
    listener that is not paramsync's, such as a metrics endpoint, holds a probe up to its
    timeout)."""
    while not done.is_set():
        for port in listening_ports(p.pid for p in procs) - probed:
            salt = probe_salt(host, port) or probe_salt("127.0.0.1", port)
            probed.add(port)
            if salt is not None:
                salts.add(salt)
        time.sleep(0.05)


def _scrape(logs: list[Path], out: Path, done: threading.Event) -> None:
    """While the run lasts: every worker's metrics endpoint (its address from its log line)
    scraped into ``out``, on a thread of its own, so no slow probe keeps it from an endpoint
    that lives only while the ranks train."""
    while not done.is_set():
        text = "\n".join(p.read_text(errors="replace") for p in logs if p.exists())
        for rank, mhost, port in re.findall(r"rank (\d+): metrics at http://([^:]+):(\d+)/", text):
            try:
                with urllib.request.urlopen(f"http://{mhost}:{port}/metrics", timeout=1) as page:
                    (out / f"metrics-rank{rank}.txt").write_bytes(page.read())
            except OSError:
                pass
        time.sleep(0.05)


def run_two_nodes(
    workdir: Path, secret: bytes, host: str, *, steps: int = 20, timeout: float = 180.0
) -> RunArtefacts:
    """A two-node-shaped launch on ``host`` (module doc), its artefacts under ``workdir``."""
    port = _free_port(host)
    coordinator = f"{host}:{port}"
    ckpt, out = workdir / "ckpt", workdir / "out"
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARAMSYNC_", "TORCHELASTIC_"))}
    env |= {
        "PARAMSYNC_SECRET": secret.decode(),
        "PARAMSYNC_METRICS_PORT": "0",
        "PARAMSYNC_METRICS_HOST": "127.0.0.1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "OMP_NUM_THREADS": "1",
    }
    job = [
        "-m", "paramsync.actors.demo_job.job", "--steps", str(steps), "--batch-size", "2",
        "--context", "16", "--d-model", "16", "--layers", "1", "--heads", "2",
        "--corpus-bytes", "100000", "--no-progress", "--checkpoint-dir", str(ckpt),
        "--checkpoint-every", "5", "--trace", str(out / "trace{rank}.json"),
        "--summary-json", str(out / "summary{rank}.json"),
    ]  # fmt: skip
    logs = [out / "node0.log", out / "node1.log"]
    procs: list[subprocess.Popen[bytes]] = []
    started = time.perf_counter()
    for node, log in enumerate(logs):
        argv = [
            sys.executable, "-m", "paramsync.runtime.cli.main", "--log-level", "INFO", "launch",
            "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
            "--coordinator", coordinator, "--", *job,
        ]  # fmt: skip
        with open(log, "wb") as handle:
            procs.append(subprocess.Popen(argv, env=env, stdout=handle, stderr=subprocess.STDOUT))
    done = threading.Event()
    salts: set[bytes] = set()
    probed: set[int] = set()
    watchers = [
        threading.Thread(target=_probe, args=(procs, host, salts, probed, done), daemon=True),
        threading.Thread(target=_scrape, args=(logs, out, done), daemon=True),
    ]
    for watcher in watchers:
        watcher.start()
    try:
        codes = [proc.wait(timeout=timeout) for proc in procs]
    finally:
        done.set()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for watcher in watchers:
            watcher.join(5)
    text = "\n".join(log.read_text(errors="replace") for log in logs)
    return RunArtefacts(
        workdir, ckpt, coordinator, codes, text, salts, len(probed),
        time.perf_counter() - started,
    )  # fmt: skip


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
