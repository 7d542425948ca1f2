"""benchmarks/ddp.py: its figures' helpers (CPU sampling, paired ratios, the median's
interval, the check's cost within runs), and a tiny run of the systems end to end."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "ddp.py"


def _module():
    spec = importlib.util.spec_from_file_location("ddp_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_at_interpolates_between_the_samples_around_a_moment() -> None:
    bench = _module()
    samples = [(10.0, 1.0), (10.5, 2.0), (11.0, 2.5)]
    assert bench._cpu_at(samples, 10.25) == pytest.approx(1.5)
    assert bench._cpu_at(samples, 10.5) == pytest.approx(2.0)
    assert bench._cpu_at(samples, 11.0) == pytest.approx(2.5)
    assert bench._cpu_at(samples, 9.9) is None  # before the first sample: unknown
    assert bench._cpu_at(samples, 11.1) is None


def test_window_cpu_is_the_coordinators_cpu_per_step_over_rank_0s_window() -> None:
    bench = _module()
    samples = [(0.0, 0.0), (1.0, 0.1), (2.0, 0.3), (3.0, 0.4)]
    per_step = bench._window_cpu(samples, {"window": [0.5, 2.5]}, steps=10)
    assert per_step == pytest.approx((0.35 - 0.05) / 10)
    assert bench._window_cpu(samples, {"window": [0.5, 3.5]}, steps=10) is None


def test_round_ratios_pair_each_round_of_one_system_with_the_others() -> None:
    bench = _module()
    ours = [{"step_seconds": [1.0, 3.0, 2.0]}, {"step_seconds": [4.0]}]
    theirs = [{"step_seconds": [1.0, 1.0, 1.0]}, {"step_seconds": [2.0]}]
    assert bench._round_ratios(ours, theirs) == [2.0, 2.0]


def test_median_interval_is_the_sign_tests_order_statistics() -> None:
    bench = _module()
    values = [float(v) for v in (7, 1, 9, 3, 10, 5, 2, 8, 4, 6)]
    assert bench._median_interval(values) == (2.0, 9.0)  # n=10: the 2nd and 9th of 10
    assert bench._median_interval(values[:5]) is None  # 5 values cannot give 95 %
    for n in range(6, 41):
        low, high = bench._median_interval([float(v) for v in range(n)])
        k = int(low) + 1  # the interval is the k-th smallest to the k-th largest
        assert high == n - k

        def miss(k: int, n: int = n) -> float:  # P(the median lies outside x(k)..x(n-k+1))
            return 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

        assert miss(k) <= 0.05 < miss(k + 1)  # covers 95 %, and is the narrowest that does


def test_split_check_cost_pairs_each_checked_step_with_its_neighbours() -> None:
    bench = _module()
    base, hashing, report = 0.040, 0.0006, 0.0002

    def run(first: int, slow: set[int]) -> dict:
        numbers = list(range(first, first + 12))
        seconds = []
        for step in numbers:
            cost = base + (hashing if step % 3 == 0 else report if step % 3 == 1 else 0.0)
            seconds.append(cost * (1.5 if step // 3 in slow else 1.0))  # a slow spell
        return {"step_numbers": numbers, "step_seconds": seconds}

    split = bench._split_check_cost([run(5, set()), run(5, {2})], 3)
    # Whole cycles start at 6, 9 and 12 in each run (5 and 15-16 belong to cut ones); the
    # slow spell stretches one cycle of the second run, but not the median.
    assert split["cycles"] == 6
    assert split["seconds"] == pytest.approx(hashing + report)
    assert split["fraction"] == pytest.approx((hashing + report) / base)
    assert "phases" not in split  # runs without their trace spans
    assert bench._split_check_cost([run(1, set())], 20) is None  # no whole cycle


def test_split_check_cost_says_in_which_phase_the_cost_lands() -> None:
    bench = _module()
    numbers = list(range(3, 30))
    phases = {phase: [0.010] * len(numbers) for phase in bench.PHASES}
    phases["optimizer"] = [0.003 + (0.0006 if step % 3 == 0 else 0.0) for step in numbers]
    phases["forward"] = [0.016 + (0.0001 if step % 3 == 1 else 0.0) for step in numbers]
    seconds = [sum(phases[phase][i] for phase in bench.PHASES) for i in range(len(numbers))]
    run = {"step_numbers": numbers, "step_seconds": seconds, "phase_seconds": phases}
    split = bench._split_check_cost([run], 3)
    assert split["phases"]["optimizer"] == {
        "checked": pytest.approx(0.0006),
        "next": pytest.approx(0.0),
    }
    assert split["phases"]["forward"]["next"] == pytest.approx(0.0001)
    assert split["phases"]["backward"] == {"checked": 0.0, "next": 0.0}
    assert split["phases_seconds"] == pytest.approx(0.0007)
    assert split["seconds"] == pytest.approx(0.0007)


def test_phase_seconds_sums_each_steps_spans() -> None:
    bench = _module()
    events = [
        {"ph": "X", "name": "forward", "dur": 1000.0, "args": {"step": 7}},
        {"ph": "X", "name": "optimizer", "dur": 250.0, "args": {"step": 7}},
        {"ph": "X", "name": "optimizer", "dur": 50.0, "args": {"step": 7}},
        {"ph": "X", "name": "digest", "dur": 99.0, "args": {"step": 7}},  # not a phase
        {"ph": "X", "name": "forward", "dur": 5.0, "args": {"step": 3}},  # not a timed step
        {"ph": "i", "name": "forward", "args": {"step": 8}},
    ]
    spent = bench._phase_seconds(events, [7, 8])
    assert spent["forward"] == [0.001, 0.0]
    assert spent["optimizer"] == [pytest.approx(0.0003), 0.0]
    assert spent["backward"] == [0.0, 0.0]


def _tiny_command(out: Path) -> list[str]:
    command = [sys.executable, str(SCRIPT), "--worlds", "2", "--rounds", "1", "--steps", "6"]
    command += ["--warmup", "2", "--layers", "1", "--d-model", "32", "--context", "16"]
    command += ["--corpus-bytes", "200000", "--json", str(out)]
    return command


@pytest.mark.soak  # six systems of processes, about 90 s: make soak
def test_a_tiny_run_of_the_own_loop_and_a_baseline_checkout(tmp_path: Path) -> None:
    """The DDP-shaped entry, and the paramsync systems again with a baseline's code (this
    checkout), in the same rounds as the others."""
    out = tmp_path / "ddp.json"
    command = [*_tiny_command(out), "--no-torch-plane", "--own-loop", "--baseline", str(ROOT)]
    command += ["--clip-grad-norm", "0.5"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(out.read_text())["rows"][0]
    # The own loop (paramsync.actors.DistributedDataParallel, the user's loop) trains the same
    # curve.
    own = row["own-loop"]
    assert own["median_step_seconds"] > 0 and len(own["paired_ratio_rounds"]) == 1
    assert own["final_loss"] == pytest.approx(row["paramsync"]["final_loss"], abs=1e-4)
    assert "own loop (DDP-shaped)" in done.stdout and "against train_batch" in done.stdout
    # With clipping between backward and step in the user's loop, torch DDP's curve too.
    assert own["final_loss"] == pytest.approx(row["ddp"]["final_loss"], abs=1e-4)
    assert len(own["ddp_ratio_rounds"]) == 1 and "own loop / torch DDP" in done.stdout
    for system in ("paramsync@baseline", "own-loop@baseline"):
        assert row[system]["median_step_seconds"] > 0
        assert row[system]["final_loss"] == pytest.approx(row["paramsync"]["final_loss"], abs=1e-4)
    assert "this code / baseline" in done.stdout


@pytest.mark.soak  # four systems of processes, about 17 s: make soak
def test_a_tiny_run_trains_both_systems_and_reports_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    command = [*_tiny_command(out), "--check-split", "3"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "paramsync / DDP round by round" in done.stdout
    table = json.loads(out.read_text())
    row = table["rows"][0]
    assert row["world_size"] == 2
    for system in ("ddp", "paramsync", "limit", "paramsync-torch"):
        assert row[system]["median_step_seconds"] > 0
    # The torch.distributed data plane's column, paired with DDP and plain paramsync.
    assert "paramsync over torch.distributed (data_plane torch, gloo)" in done.stdout
    assert len(row["torch_plane_ddp_ratio_rounds"]) == 1
    assert row["torch_plane_paramsync_ratio_paired"] > 0
    # The limit column: the same processes with no communication; each system's overhead over it.
    assert "over the limit (the same processes with no communication" in done.stdout
    for system in ("paramsync", "ddp"):
        assert len(row[f"{system}_over_limit_rounds"]) == 1
        assert row[f"{system}_over_limit"] == row[f"{system}_over_limit_rounds"][0]
    assert row["paramsync"]["coordinator_cpu_seconds_per_step"] is not None
    # The run checking every 3rd step: its 6 timed steps hold at least one whole cycle.
    assert row["check_cost_split"]["interval"] == 3
    assert row["check_cost_split"]["cycles"] >= 1
    assert "the check's cost within runs checking every 3 steps" in done.stdout
    assert set(row["check_cost_split"]["phases"]) == {
        "forward",
        "backward",
        "grad-wait",
        "optimizer",
    }
    assert "where it lands" in done.stdout


def test_the_mlp_model_is_tiny_seeded_and_trains() -> None:
    import torch

    model = _module()._mlp_model(vocab_size=11, d_model=8, seed=3)
    again = _module()._mlp_model(vocab_size=11, d_model=8, seed=3)
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)
    assert model.num_parameters() == 11 * 8 + (8 * 16 + 16) + (16 * 11 + 11)
    idx = torch.randint(0, 11, (4, 5))
    assert model(idx).shape == (4, 5, 11)
    model.loss(idx, torch.randint(0, 11, (4, 5))).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_batchnorm_model_has_running_statistics_that_training_moves() -> None:
    import torch

    model = _module()._conv_batchnorm_model(vocab_size=11, d_model=8, layers=2, seed=3)
    buffers = dict(model.named_buffers())
    assert {name.rsplit(".", 1)[-1] for name in buffers} == {
        "running_mean",
        "running_var",
        "num_batches_tracked",
    }
    again = _module()._conv_batchnorm_model(vocab_size=11, d_model=8, layers=2, seed=3)
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)  # the seed decides the weights: every rank builds the same
    idx = torch.randint(0, 11, (4, 5))
    assert model(idx).shape == (4, 5, 11)
    before = buffers["blocks.0.1.running_mean"].clone()
    loss = model.loss(idx, torch.randint(0, 11, (4, 5)))
    assert math.isfinite(float(loss.detach()))
    assert not torch.equal(before, buffers["blocks.0.1.running_mean"])


def test_the_device_option_reaches_every_worker_and_places_the_model_and_its_batches() -> None:
    import torch

    bench = _module()
    parser = bench.build_parser()
    assert parser.parse_args([]).device == "cpu"
    flags = bench._model_flags(parser.parse_args(["--device", "cuda"]))
    assert flags[flags.index("--device") + 1] == "cuda"
    common = ["--model", "mlp", "--d-model", "8", "--corpus-bytes", "4096", "--batch-size", "4"]
    args = parser.parse_args([*common, "--rank", "1", "--world", "2"])
    model, optimizer, batch, _ = bench._setup(args)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert optimizer.param_groups[0]["params"] == list(model.parameters())
    assert all(t.device.type == "cpu" for t in batch(0))
    on_gpu = parser.parse_args([*common, "--device", "cuda", "--rank", "1", "--world", "2"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match=r"torch.cuda.is_available\(\) is False"):
            bench._setup(on_gpu)
        return
    model, optimizer, batch, _ = bench._setup(on_gpu)  # pragma: no cover (on a GPU)
    device = torch.device("cuda", 1 % torch.cuda.device_count())
    assert {p.device for p in model.parameters()} == {device}
    assert {p.device for p in optimizer.param_groups[0]["params"]} == {device}
    assert all(t.device == device for t in batch(0))


def test_clip_grad_norm_goes_to_train_batch_as_an_option_and_stays_in_the_own_loop() -> None:
    ddp = _module()
    args = ddp.build_parser().parse_args(
        ["--clip-grad-norm", "0.5", "--option", "chunk_bytes=4096"]
    )
    assert ddp._paramsync_options(args).clip_grad_norm == 0.5
    assert ddp._paramsync_options(args, clip=False).clip_grad_norm is None
    flags = ddp._model_flags(args)
    assert flags[flags.index("--clip-grad-norm") + 1] == "0.5"


@pytest.mark.soak  # three systems of processes, about 11 s: make soak
def test_world_size_one_runs_a_plain_loop_beside_ddp_and_paramsync(tmp_path: Path) -> None:
    """``--worlds 1 --plain``: one worker of each system and the plain torch loop (no process
    group, no DDP) in the same rounds; each system's cost over it and rank 0's CPU a step."""
    out = tmp_path / "ddp.json"
    command = [sys.executable, str(SCRIPT), "--worlds", "1", "--plain", "--no-torch-plane"]
    command += ["--rounds", "1", "--steps", "4", "--warmup", "1", "--model", "mlp"]
    command += ["--d-model", "16", "--context", "16", "--corpus-bytes", "50000"]
    command += ["--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(out.read_text())["rows"][0]
    assert row["world_size"] == 1 and row["ddp_backend"] == "gloo"
    for system in ("plain", "ddp", "paramsync"):
        assert row[system]["median_step_seconds"] > 0
        assert row[system]["cpu_seconds_per_step"] > 0
    # The same model, data and loop: the same first loss in every system.
    assert row["plain"]["first_loss"] == pytest.approx(row["ddp"]["first_loss"], abs=1e-5)
    assert row["plain"]["first_loss"] == pytest.approx(row["paramsync"]["first_loss"], abs=1e-5)
    assert {"ddp_over_plain", "paramsync_over_plain", "step_time_ratio"} <= set(row)
    assert "plain torch loop (no process group, no DDP)" in done.stdout
    assert "paramsync / DDP round by round" in done.stdout


def test_the_ddp_backend_reaches_the_workers_and_nccl_needs_the_gpu() -> None:
    bench = _module()
    parser = bench.build_parser()
    assert parser.parse_args([]).ddp_backend == "gloo"
    flags = bench._model_flags(parser.parse_args(["--device", "cuda", "--ddp-backend", "nccl"]))
    assert flags[flags.index("--ddp-backend") + 1] == "nccl"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--ddp-backend", "nccl", "--worlds", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "--ddp-backend nccl needs --device cuda" in done.stderr
