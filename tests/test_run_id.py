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
import re
import secrets
from pathlib import Path

import pytest

from paramsync.actors.state.checkpoint import RUN_ID_FILE, CheckpointStore
from paramsync.runtime.cli import launch
from paramsync.runtime.coordinator.core import CoordinatorCore
from paramsync.runtime.coordinator.events import Broadcast
from paramsync.runtime.coordinator.service import Coordinator, CoordinatorOptions
from paramsync.runtime.protocol.handshake import stretch_secret
from paramsync.runtime.protocol.messages import SALT_SIZE, Joined, StartRun
from paramsync.runtime.testing import artefact_scan
from paramsync.runtime.transport import keylog

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


def test_no_artefact_of_a_multi_node_run_holds_a_function_of_the_secret(tmp_path: Path) -> None:
    """Two launchers (node 0 with the coordinator, node 1), one rank each, on this host's
    network address (`paramsync.runtime.testing.artefact_scan.run_two_nodes`): checkpoints, the
    run-id file, logs, traces, summaries and metrics hold no value computed from the secret
    (the key under every salt the run's listeners used, found by probing them), and both ranks
    record the coordinator's random run id."""
    host = artefact_scan.this_hosts_address()
    if host is None:
        pytest.skip("this host has no address but loopback")
    secret = secrets.token_urlsafe(32).encode()
    run = artefact_scan.run_two_nodes(tmp_path, secret, host)
    assert run.exit_codes == [0, 0], run.log_text[-4000:]
    assert run.salts, "no listener of the run answered a hello with its salt"
    artefacts = run.files()
    values = artefact_scan.secret_functions(secret, run.coordinator, run.salts)
    report = artefact_scan.scan(artefacts, values, tmp_path)
    assert report.clean, report.found
    assert len(artefacts) >= 8 and report.values >= 7, artefacts

    ckpt, out = run.checkpoint_dir, tmp_path / "out"
    recorded = CheckpointStore(ckpt).recorded_run_id()
    assert recorded is not None and re.fullmatch(r"[0-9a-f]{16}", recorded), recorded
    told = set(
        re.findall(r"rank \d: checkpoints of run '([^']+)' \(the coordinator's\)", run.log_text)
    )
    assert told == {recorded}, run.log_text[-4000:]  # both ranks, on both nodes, the same id
    assert (ckpt / RUN_ID_FILE).read_text().strip() == recorded
    assert any(out.glob("metrics-rank*.txt")), "no metrics scraped"
    assert any(out.glob("trace*.json")) and any(ckpt.glob("*.safetensors"))


def test_the_scan_finds_each_function_of_the_secret_in_each_form(tmp_path: Path) -> None:
    """The scan is not blind: each value, planted raw, as hex or as base64 (or its first 64
    bits) in a file among clean ones, is found and named; so is a key log line."""
    secret, salt = secrets.token_urlsafe(32).encode(), secrets.token_bytes(SALT_SIZE)
    values = artefact_scan.secret_functions(secret, "10.0.0.1:29500", [salt])
    assert stretch_secret(secret, salt) in values.values()
    clean = tmp_path / "clean.log"
    clean.write_bytes(secrets.token_bytes(4096))
    for index, (name, value) in enumerate(values.items()):
        planted = tmp_path / f"planted{index}.txt"
        form = [value, value.hex().encode(), base64.b64encode(value[:8])][index % 3]
        planted.write_bytes(b"run " + form + b" done")
        report = artefact_scan.scan([clean, planted], values, tmp_path)
        assert report.hits[name] >= 1 and f"in planted{index}.txt" in report.found[0], name
        planted.unlink()
    keylog_file = tmp_path / "keys"
    keylog_file.write_text(keylog.keylog_line(bytes(32), bytes(32), bytes(32)))
    assert not artefact_scan.scan([keylog_file], values).clean
