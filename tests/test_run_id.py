"""The run id is random, never a function of the secret (third security review, issue 39, row 1).

Before, a multi-node run's id was the first 64 bits of SHA-256 over a label, the secret and the
coordinator's address, written to the checkpoint directory, into checkpoint metadata and into a
log line: an offline oracle for the secret, bypassing scrypt and CPace. Now one node's launcher
draws it at random, and a multi-node run's coordinator draws it and tells every worker in its
``start_run``. The last test runs a two-node-shaped launch on this host and searches everything it
wrote for every value the project computes from the secret.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from paramsync.actors.state.checkpoint import RUN_ID_FILE, CheckpointStore
from paramsync.runtime.cli import launch
from paramsync.runtime.coordinator.core import CoordinatorCore
from paramsync.runtime.coordinator.events import Broadcast
from paramsync.runtime.coordinator.service import Coordinator, CoordinatorOptions
from paramsync.runtime.protocol.handshake import stretch_secret
from paramsync.runtime.protocol.messages import SALT_SIZE, Joined, StartRun

ROOT = Path(__file__).resolve().parent.parent
SIG = (("w", (2,), "float32", True),)


def _plan(*flags: str) -> launch.LaunchPlan:
    from paramsync.runtime.cli.main import build_parser

    args = build_parser().parse_args(["launch", *flags, "--", "x.py"])
    return launch.LaunchPlan.from_args(args)


def test_a_multi_node_launcher_derives_no_run_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node of a multi-node launch gives its processes no run id of its own making (the
    coordinator's is the run's); one node draws a random one; a given one is kept."""
    monkeypatch.delenv("PARAMSYNC_RUN_ID", raising=False)
    monkeypatch.setenv("PARAMSYNC_SECRET", secrets.token_urlsafe(32))
    multi = _plan("--nnodes", "2", "--node-rank", "1", "--nproc", "1", "--coordinator", "10.0.0.1")
    assert launch._run_id(multi) is None
    single = _plan("--nproc", "2")
    drawn = {launch._run_id(single) for _ in range(3)}
    assert len(drawn) == 3 and all(re.fullmatch(r"[0-9a-f]{16}", d or "") for d in drawn)
    monkeypatch.setenv("PARAMSYNC_RUN_ID", "given-run")
    assert launch._run_id(multi) == launch._run_id(single) == "given-run"


def test_the_coordinator_tells_every_worker_a_random_run_id() -> None:
    """Every ``start_run`` carries the coordinator's run id: random unless given, and two
    coordinators with one secret draw two."""
    key = secrets.token_urlsafe(32)
    ids = {Coordinator(2, secret=key).run_id for _ in range(4)}
    assert len(ids) == 4 and all(re.fullmatch(r"[0-9a-f]{16}", i) for i in ids)
    assert Coordinator(2, CoordinatorOptions(run_id="named"), secret=key).run_id == "named"
    with pytest.raises(ValueError, match="at most 128"):
        Coordinator(2, CoordinatorOptions(run_id="x" * 129), secret=key)
    core = CoordinatorCore(2, run_id="abc123")
    actions = [a for rank in range(2) for a in core.handle(Joined(rank, SIG, ("h", 1 + rank), 0.0))]
    starts = [a.message for a in actions if isinstance(a, Broadcast)]
    assert [type(s) for s in starts] == [StartRun] and starts[0].run == "abc123"
    assert starts[0].to_wire()[1]["run"] == "abc123"
    assert "run" not in StartRun(addresses=(("h", 1),), ring=(0,)).to_wire()[1]


# --------------------------------------------------------------------------- the artefacts


def _this_hosts_address() -> str | None:
    """An address of this host other than loopback (the interface of its default route)."""
    for probe in ("192.0.2.1", "10.255.255.255", "198.51.100.1"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.connect((probe, 9))
                address = sock.getsockname()[0]
        except OSError:
            continue
        if not address.startswith("127.") and address != "0.0.0.0":
            return address
    return None


def secret_functions(secret: bytes, coordinator: str) -> dict[str, bytes]:
    """Every value the project computes from the secret outside a handshake's fresh nonces
    (`load_secret`, `stretch_secret`; the CPace generator, ISK and session keys also take both
    sides' fresh nonces), the former run id, and plain hashes of either."""
    # Each listener stretches under its own random salt, unknown here; the key under a fixed
    # salt still catches a value stretched by the secret alone.
    key = stretch_secret(secret, bytes(SALT_SIZE))
    former = hashlib.sha256(b"paramsync-run-id\0" + secret + coordinator.encode()).hexdigest()
    return {
        "the secret": secret,
        "the scrypt-stretched key": key,
        "SHA-256 of the secret": hashlib.sha256(secret).digest(),
        "SHA-256 of the key": hashlib.sha256(key).digest(),
        "the former run id": bytes.fromhex(former[:16]),
    }


def _forms(value: bytes) -> list[bytes]:
    """How an artefact could hold ``value`` (or its first 8 bytes, 64 bits): raw, hex either
    case, base64 either alphabet."""
    forms = []
    for part in {value, value[:8]}:
        forms += [part, part.hex().encode(), part.hex().upper().encode()]
        forms += [base64.b64encode(part).rstrip(b"="), base64.urlsafe_b64encode(part).rstrip(b"=")]
    return [f for f in forms if len(f) >= 8]


def _scrape_metrics(logs: list[Path], out: Path, done: threading.Event) -> None:
    """Scrape every worker's metrics endpoint (its address from its log line) while the run
    lasts, keeping each last exposition in ``out``."""
    while not done.is_set():
        text = "\n".join(p.read_text(errors="replace") for p in logs if p.exists())
        for rank, host, port in re.findall(r"rank (\d+): metrics at http://([^:]+):(\d+)/", text):
            try:
                with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=1) as page:
                    (out / f"metrics-rank{rank}.txt").write_bytes(page.read())
            except OSError:
                pass
        time.sleep(0.05)


def test_no_artefact_of_a_multi_node_run_holds_a_function_of_the_secret(tmp_path: Path) -> None:
    """Two launchers (node 0 with the coordinator, node 1), one rank each, on this host's
    network address: checkpoints, the run-id file, logs, traces, summaries and metrics hold no
    value computed from the secret, and both ranks record the coordinator's random run id."""
    host = _this_hosts_address()
    if host is None:
        pytest.skip("this host has no address but loopback")
    secret = secrets.token_urlsafe(32).encode()
    port = launch.free_port()
    coordinator = f"{host}:{port}"
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARAMSYNC_", "TORCHELASTIC_"))}
    env |= {
        "PARAMSYNC_SECRET": secret.decode(),
        "PARAMSYNC_METRICS_PORT": "0",
        "PARAMSYNC_METRICS_HOST": "127.0.0.1",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }
    job = [
        "-m", "paramsync.actors.demo_job.job", "--steps", "20", "--batch-size", "2",
        "--context", "16", "--d-model", "16", "--layers", "1", "--heads", "2",
        "--corpus-bytes", "100000", "--no-progress", "--checkpoint-dir", str(ckpt),
        "--checkpoint-every", "5", "--trace", str(out / "trace{rank}.json"),
        "--summary-json", str(out / "summary{rank}.json"),
    ]  # fmt: skip
    logs = [out / "node0.log", out / "node1.log"]
    procs = []
    for node, log in enumerate(logs):
        argv = [
            sys.executable, "-m", "paramsync.runtime.cli.main", "--log-level", "INFO", "launch",
            "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
            "--coordinator", coordinator, "--", *job,
        ]  # fmt: skip
        with open(log, "wb") as handle:
            procs.append(
                subprocess.Popen(argv, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT)
            )
    done = threading.Event()
    scraper = threading.Thread(target=_scrape_metrics, args=(logs, out, done), daemon=True)
    scraper.start()
    try:
        codes = [proc.wait(timeout=120) for proc in procs]
    finally:
        done.set()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        scraper.join(5)
    text = "\n".join(log.read_text(errors="replace") for log in logs)
    assert codes == [0, 0], text[-4000:]

    artefacts = [p for p in tmp_path.rglob("*") if p.is_file()]
    found = []
    for name, value in secret_functions(secret, coordinator).items():
        forms = _forms(value)
        for path in artefacts:
            data = path.read_bytes()
            if any(form in data for form in forms):
                found.append(f"{name} in {path.relative_to(tmp_path)}")
    assert not found, found
    assert len(artefacts) >= 8, artefacts

    recorded = CheckpointStore(ckpt).recorded_run_id()
    assert recorded is not None and re.fullmatch(r"[0-9a-f]{16}", recorded), recorded
    told = set(re.findall(r"rank \d: checkpoints of run '([^']+)' \(the coordinator's\)", text))
    assert told == {recorded}, text[-4000:]  # both ranks, on both nodes, the same id
    assert (ckpt / RUN_ID_FILE).read_text().strip() == recorded
    assert any(out.glob("metrics-rank*.txt")), "no metrics scraped"
    assert any(out.glob("trace*.json")) and any(ckpt.glob("*.safetensors"))
