"""The torch.distributed data plane (paramsync.runtime.transport.torch_plane, ``data_plane =
"torch"``).

The conformance suite runs it in tests/test_transport_conformance.py and the parity with one
process in tests/test_trainer.py; here: choosing it (options, TOML, environment, flag), its
deadlines and abort (a collective a peer never joins fails, never hangs), the frames it sends
(CBOR frames as gloo uint8 tensors, nothing pickled), and a worker SIGKILLed mid-run while its
peers use it: the survivors form a new torch group in a new epoch and finish.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing
from test_state import make_replica, same_bits, train

from paramsync.actors.state.training_state import capture_state
from paramsync.actors.train.state_transfer import receive_state, send_state
from paramsync.actors.train.trainer import TrainerOptions
from paramsync.runtime.cli.main import build_parser
from paramsync.runtime.collectives.ring import all_reduce, barrier, broadcast
from paramsync.runtime.config import DATA_PLANE_ENV, DataPlane
from paramsync.runtime.errors import PeerClosed, StallError
from paramsync.runtime.protocol.wire import decode_frame
from paramsync.runtime.testing.fault_trials import JOB_FLAGS, run_trial
from paramsync.runtime.train_config import DistributedTrainConfig
from paramsync.runtime.transport import torch_plane
from paramsync.runtime.transport.torch_plane import (
    DATA_PLANES,
    TorchPlaneTransport,
    create_local_group,
    open_local_group,
)

# --------------------------------------------------------------------------- choosing it


def test_trainer_options_take_the_data_plane_and_refuse_others() -> None:
    assert TrainerOptions().data_plane is DataPlane.PARAMSYNC
    assert TrainerOptions(data_plane="torch").data_plane is DataPlane.TORCH
    with pytest.raises(ValueError, match="data_plane must be one of 'paramsync', 'torch'"):
        TrainerOptions(data_plane="nccl")
    with pytest.raises(ValueError, match="collective_seconds"):
        TrainerOptions(data_plane="torch", collective_seconds=0)


def test_the_config_reads_the_data_plane_from_toml_environment_and_flags(tmp_path: Path) -> None:
    toml = tmp_path / "train.toml"
    toml.write_text('[distributed]\ndata_plane = "torch"\n')
    assert DistributedTrainConfig().data_plane is DataPlane.PARAMSYNC
    assert DistributedTrainConfig.resolve(toml, environ={}).data_plane is DataPlane.TORCH
    env = {DATA_PLANE_ENV: "Paramsync"}
    assert DistributedTrainConfig.resolve(toml, environ=env).data_plane is DataPlane.PARAMSYNC
    overrides = {"data_plane": "torch"}
    assert DistributedTrainConfig.resolve(None, env, overrides).data_plane is DataPlane.TORCH
    with pytest.raises(ValueError, match=f"environment variable {DATA_PLANE_ENV}"):
        DistributedTrainConfig.from_env({DATA_PLANE_ENV: "mpi"})
    toml.write_text("[distributed]\ndata_plane = 3\n")
    with pytest.raises(ValueError, match="data_plane must be one of"):
        DistributedTrainConfig.from_toml(toml)
    args = build_parser().parse_args(["worker", "--data-plane", "torch"])
    assert args.data_plane == "torch"
    assert build_parser().parse_args(["worker"]).data_plane is None
    assert DATA_PLANES == ("paramsync", "torch")


# --------------------------------------------------------------------------- frames


async def test_frames_travel_as_cbor_bytes_in_uint8_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What gloo carries is the frame paramsync's codec made: a uint8 tensor that decodes
    (as any frame) to the message sent; its length goes first as one int64."""
    sent: list[torch.Tensor] = []
    original = torch_plane._frame_tensor

    def spy(*args: Any) -> torch.Tensor:
        frame = original(*args)
        sent.append(frame.clone())
        return frame

    monkeypatch.setattr(torch_plane, "_frame_tensor", spy)
    payload = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    async with open_local_group(2) as (a, b):
        await a.send(1, "probe_data", {"src": 0, "seq": 4}, payload)
        message = await b.recv(0)
    assert len(sent) == 1 and sent[0].dtype == torch.uint8
    decoded = decode_frame(sent[0].numpy().tobytes())
    assert decoded["kind"] == "probe_data" and (decoded["src"], decoded["seq"]) == (0, 4)
    assert torch.equal(decoded["data"], payload) and torch.equal(message["data"], payload)


# --------------------------------------------------------------------------- deadlines, abort


async def test_abort_fails_a_collective_a_peer_never_joins_at_once() -> None:
    # The abandoned all-reduce (its peer never joins) ends at its deadline, and closing rank 0
    # waits for it: a short deadline, far past the abort's moment (the test's first milliseconds;
    # an abort missed would be a StallError here, not PeerClosed), ends the test in seconds.
    async with open_local_group(2, collective_seconds=3.0) as (a, b):
        failed: list[BaseException] = []

        async def alone() -> None:
            try:
                await all_reduce(a, torch.ones(1000), "sum")
            except PeerClosed as exc:
                failed.append(exc)

        async def receive() -> None:
            try:
                await a.recv(1)
            except PeerClosed as exc:
                failed.append(exc)

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(alone)
                nursery.start_soon(receive)
                await trio.testing.wait_all_tasks_blocked()
                a.abort()
        assert len(failed) == 2
        assert any("aborted" in str(exc) for exc in failed)
        with pytest.raises(PeerClosed, match="closed"):
            await a.send(1, "welcome", {})
        # The peer hears of it: its receive ends, its sends are refused.
        with trio.fail_after(20):
            with pytest.raises(PeerClosed) as caught:
                await b.recv(0)
        assert caught.value.peer == 0


async def test_a_collective_past_its_deadline_is_a_stall_not_a_hang() -> None:
    group = await create_local_group(2, collective_seconds=0.5)
    try:
        started = time.monotonic()
        with trio.fail_after(30), pytest.raises(StallError, match="all_reduce"):
            await all_reduce(group[0], torch.ones(8), "sum")
        assert time.monotonic() - started < 15
    finally:
        for transport in group:
            await transport.aclose()


async def test_collectives_run_natively_and_int16_falls_back_to_frames() -> None:
    """Every dtype gloo reduces goes to the group; int16, which it does not, takes the ring
    over the transport's frames; both exact, and a barrier holds every rank."""
    async with open_local_group(3) as group:
        assert all(isinstance(t, TorchPlaneTransport) for t in group)
        for dtype in (torch.int16, torch.int32, torch.bfloat16):
            inputs = [torch.full((5000,), rank + 1, dtype=dtype) for rank in range(3)]

            async def reduce(t: TorchPlaneTransport, ins: list[torch.Tensor] = inputs) -> None:
                await all_reduce(t, ins[t.rank], "avg")

            async with trio.open_nursery() as nursery:
                for transport in group:
                    nursery.start_soon(reduce, transport)
            assert all(torch.equal(t, torch.full((5000,), 2, dtype=dtype)) for t in inputs)
        assert [t.native_accepts(torch.zeros(1, dtype=torch.int16)) for t in group] == [False] * 3
        values = [torch.full((3,), float(rank)) for rank in range(3)]

        async def cast_then_wait(t: TorchPlaneTransport) -> None:
            await broadcast(t, values[t.rank], 2)
            await barrier(t)  # collectives run one at a time, in one order on every rank

        async with trio.open_nursery() as nursery:
            for transport in group:
                nursery.start_soon(cast_then_wait, transport)
        assert all(torch.equal(v, torch.full((3,), 2.0)) for v in values)


async def test_a_live_rejoins_state_transfer_goes_through_the_torch_group() -> None:
    """A donor's whole training state (parameters, AdamW's moments and steps) reaches a joiner
    as frames over gloo and restores bitwise (`paramsync.actors.train.state_transfer`)."""
    donor_model, donor_optimizer = make_replica(7, "adamw")
    train(donor_model, donor_optimizer, range(3), torch.float32)
    joiner_model, joiner_optimizer = make_replica(99, "adamw")
    async with open_local_group(2) as (donor, joining):
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_state, donor, 1, donor_model, donor_optimizer, 3)
                state = await receive_state(joining, 0, joiner_model, joiner_optimizer)
    assert state.step == 3
    sent = capture_state(donor_model, donor_optimizer, 3)
    got = capture_state(joiner_model, joiner_optimizer, 3)
    assert [name for name, _ in sent.tensors] == [name for name, _ in got.tensors]
    for (name, a), (_, b) in zip(sent.tensors, got.tensors):
        assert same_bits(a, b), name


# --------------------------------------------------------------------------- a killed worker


def test_a_worker_killed_mid_run_is_survived_over_the_torch_data_plane() -> None:
    """Three worker processes train the LM demo with ``--data-plane torch``; rank 2 is
    SIGKILLed in step 2's backward (its peers are in, or about to enter, that step's gloo
    all-reduce). The survivors must not hang: the coordinator starts epoch 2 with ranks 0 and
    1, each forms a new torch group, reruns step 2 and finishes, bitwise identical. ~40 s."""
    result = run_trial("backward", 2, job_flags=[*JOB_FLAGS, "--data-plane", "torch"], timeout=180)
    assert result.ok, result.problems
    assert {rank: s["data_plane"] for rank, s in result.summaries.items()} == {
        0: "torch",
        1: "torch",
    }
    assert [e["members"] for e in result.epochs] == [[0, 1, 2], [0, 1]]
    assert result.resumed_at == 2
    assert result.detection_seconds is not None and result.detection_seconds < 5.0


# --------------------------------------------------------------------------- exiting


_EXIT_ATTEMPTS = 8
"""Exits to try (the old code aborted about one exit in five)."""

_OPEN_REDUCE_CLOSE_EXIT = """
import os, sys
import torch, trio
from paramsync.runtime.transport.torch_plane import open_local_group

async def main() -> None:
    async with open_local_group(2) as group:
        values = [torch.ones(64) for _ in group]
        async with trio.open_nursery() as nursery:
            for transport, value in zip(group, values):
                nursery.start_soon(transport.native_all_reduce, value, "sum")
        assert all(torch.equal(value, torch.full((64,), 2.0)) for value in values)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(group[0].send, 1, "coll", {"op": 1, "hop": 0, "part": 0}, values[0])
            nursery.start_soon(group[1].recv, 0)

attempts, folder = int(sys.argv[1]), sys.argv[2]
for attempt in range(attempts):
    pid = os.fork()
    if pid == 0:  # the attempt: this copy of the interpreter (torch imported, nothing started)
        os.dup2(os.open(os.path.join(folder, f"{attempt}.err"), os.O_WRONLY | os.O_CREAT), 2)
        trio.run(main)
        break  # and it ends as a script does: the interpreter finalizes
    _, status = os.waitpid(pid, 0)
    print(attempt, os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.soak
def test_a_process_that_closed_its_torch_group_exits_cleanly(tmp_path: Path) -> None:
    """A process opens a 2-rank torch group, reduces, sends a frame, closes and exits: exit
    status 0 every time. The threads the transport starts (receivers, the group's release) are
    joined before the interpreter finalizes; a daemon thread still inside gloo then was torn
    down mid-C++ and aborted the process ("terminate called without an active exception",
    status -6), about one exit in five here. Each attempt is a process forked from one that
    imported torch (the import, a second a process, paid once), which runs and exits as a
    script does."""
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run(
        [sys.executable, "-c", _OPEN_REDUCE_CLOSE_EXIT, str(_EXIT_ATTEMPTS), str(tmp_path)],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    statuses = [tuple(map(int, line.split())) for line in done.stdout.splitlines()]
    assert [attempt for attempt, _ in statuses] == list(range(_EXIT_ATTEMPTS)), done.stdout
    for attempt, status in statuses:
        stderr = (tmp_path / f"{attempt}.err").read_text()
        assert status == 0, (attempt, status, stderr[-2000:])
        assert "terminate called" not in stderr, (attempt, stderr[-2000:])
