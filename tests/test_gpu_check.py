"""benchmarks/gpu_check.py (``make gpu-check``): its no-GPU path end to end, its reading of
pytest's report and of the benchmarks' JSON, its deadlines, and that every CUDA-gated test
carries the ``cuda`` marker it selects by."""

from __future__ import annotations

import importlib.util
import re
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_without_cuda_every_line_is_a_skip_naming_the_reason() -> None:
    check = _module()
    paths = ["tests/test_cuda_training.py", "tests/test_digest.py"]
    args = check.build_parser().parse_args(["--tests", *paths])
    reason = check.skip_reason({"available": False, "torch": "2.x"})
    assert reason == "torch.cuda.is_available() is False"
    lines = check.check(args, {"available": False, "torch": "2.x"})
    assert [line.name for line in lines] == [
        "tests/test_cuda_training.py::test_workers_sharing_a_gpu_train_like_one_cpu_process[inproc]",
        "tests/test_cuda_training.py::test_workers_sharing_a_gpu_train_like_one_cpu_process[tcp]",
        "tests/test_digest.py::test_cuda_state_digests_like_its_host_copy",
        *[bench.name for bench in check.BENCHMARKS],
    ]
    assert check.MULTIDEVICE_NAME in [line.name for line in lines]
    assert check.DDP_NAME in [line.name for line in lines]
    assert all(line.result == "skip" and line.detail == reason for line in lines)
    assert check.exit_status(lines) == 0
    assert check.table(lines).splitlines()[-1] == "0 pass, 0 fail, 9 skip"
    # Every line is printed with its command: each test's, each benchmark's.
    assert all(f"  $ {line.command}" in check.table(lines) for line in lines)
    assert [line.command for line in lines[3:]] == [b.command for b in check.BENCHMARKS]
    assert check.skip_reason({"error": "torch is not importable: boom"}) == (
        "torch is not importable: boom"
    )
    assert check.skip_reason({"available": True, "count": 1, "name": "GPU"}) is None


def test_the_junit_report_gives_one_line_per_test_by_its_node_id() -> None:
    check = _module()
    report = """<testsuites><testsuite>
      <testcase classname="tests.test_digest" name="test_a" time="0.5"/>
      <testcase classname="tests.test_digest" name="test_b[x]" time="1.25">
        <failure message="assert 1 == 2&#10;more">trace</failure></testcase>
      <testcase classname="tests.test_digest.Suite" name="test_c" time="0.0">
        <skipped message="needs a CUDA device"/></testcase>
      <testcase classname="tests.test_digest" name="test_d" time="0.1">
        <error message="fixture broke"/></testcase>
      <testcase classname="" name="tests.test_digest" time="0.0">
        <error message="collection failure">E   ModuleNotFoundError: No module named 'x'
        </error></testcase>
    </testsuite></testsuites>"""
    lines = check.junit_lines(report)
    assert [(line.name, line.result, line.seconds, line.detail) for line in lines] == [
        ("tests/test_digest.py::test_a", "pass", 0.5, ""),
        ("tests/test_digest.py::test_b[x]", "fail", 1.25, "assert 1 == 2"),
        ("tests/test_digest.py::Suite::test_c", "skip", 0.0, "needs a CUDA device"),
        ("tests/test_digest.py::test_d", "fail", 0.1, "fixture broke"),
        (
            "tests/test_digest.py",
            "fail",
            0.0,
            "collection failure: E   ModuleNotFoundError: No module named 'x'",
        ),
    ]
    assert check.exit_status(lines) == 1
    assert check.table(lines).splitlines()[-1] == "1 pass, 3 fail, 1 skip"
    assert check.node_id("no.such.module", "t") == "no.such.module::t"


def test_the_benchmarks_figures_come_from_their_json() -> None:
    check = _module()
    table = {
        "threads": {"step_seconds": 0.012},
        "one": {"step_seconds": 0.010},
        "ddp": {"step_seconds": 0.015},
        "speedup_over_one": 0.8333,
        "step_ratio_to_ddp": 0.8,
    }
    assert check.multidevice_detail(table) == (
        "2 replicas in threads 12.00 ms/step, 1 replica 10.00, DDP 2 procs 15.00; "
        "speed-up over one 0.83x, threads / DDP 0.80"
    )
    row = {
        "world_size": 2,
        "ddp": {"median_step_seconds": 0.02, "final_loss": 2.5},
        "paramsync": {"median_step_seconds": 0.025, "final_loss": 2.50001},
        "step_time_ratio": 1.25,
    }
    assert check.ddp_detail([row]) == (
        "2 workers: DDP 20.00 ms/step, paramsync 25.00, ratio 1.25; final loss 2.5000 / 2.5000"
    )


def test_a_part_is_killed_with_its_children_at_its_deadline_and_a_failure_names_its_exit() -> None:
    check = _module()
    sleeper = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
    sleeper += "'import time; time.sleep(60)']); time.sleep(60)"
    started = time.monotonic()
    finished = check.run_part([sys.executable, "-c", sleeper], 1.0)
    assert finished.returncode is None and time.monotonic() - started < 30
    line = check._failed("part", finished, 1.0)
    assert (line.result, line.detail) == ("fail", "killed at its deadline (1 s)")
    failing = check.run_part([sys.executable, "-c", "print('ran'); raise SystemExit('broke')"], 30)
    assert check._failed("part", failing, 30).detail == "exit 1: broke"


def test_every_cuda_gated_test_carries_the_cuda_marker() -> None:
    """gpu_check selects the GPU's tests by ``-m cuda``: a test skipped without CUDA but not
    marked would never run there."""
    gated = re.compile(r"skipif\(\s*not torch\.cuda\.is_available\(\)")
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        lines = path.read_text().splitlines()
        for number, text in enumerate(lines):
            if gated.search(text):
                before = "\n".join(lines[max(0, number - 3) : number])
                assert "pytest.mark.cuda" in before, f"{path.name}:{number + 1} has no cuda mark"


def test_the_benchmark_lines_cover_world_one_shared_gpu_digest_and_seed_003() -> None:
    check = _module()
    commands = [bench.command for bench in check.BENCHMARKS]
    assert any(
        "ddp.py" in c and "--worlds 1" in c and "--ddp-backend nccl" in c and "--plain" in c
        for c in commands
    )
    assert any("ddp.py" in c and "--worlds 2" in c and "--ddp-backend" not in c for c in commands)
    assert any("digest.py --device cuda" in c and "--params" not in c for c in commands)
    assert any("digest.py --device cuda --params 100M" in c for c in commands)
    assert any("multidevice.py --device cuda" in c for c in commands)
    # What every script is asked for, its parser defines (digest.py's own options may still be
    # on their way: the line then says which is missing).
    for bench in check.BENCHMARKS:
        missing = check.missing_options(bench.script, bench.options)
        assert not missing or bench.script == "digest.py", (bench.command, missing)
    # The whole run fits the budget: the parts that run on one GPU, deadlines added up.
    one_gpu = [bench.part for bench in check.BENCHMARKS if bench.gpus == 1]
    spent = check.PART_SECONDS["tests"] + sum(check.PART_SECONDS[part] for part in one_gpu)
    assert spent <= check.BUDGET_SECONDS == 480


def test_lines_needing_two_gpus_or_a_missing_option_are_skipped_saying_why(
    tmp_path: Path,
) -> None:
    check = _module()
    one_gpu = {"available": True, "count": 1, "name": "GPU", "peft": True}
    (two_gpus,) = [bench for bench in check.BENCHMARKS if bench.gpus == 2]
    assert check.benchmark_skip(two_gpus, one_gpu) == (
        "needs 2 GPUs (NCCL refuses two ranks on one device); this machine has 1"
    )
    assert check.benchmark_skip(two_gpus, {**one_gpu, "count": 2}) is None
    (seed_003,) = [bench for bench in check.BENCHMARKS if bench.needs_peft]
    assert check.benchmark_skip(seed_003, {**one_gpu, "peft": False}) == (
        "peft is not installed (its LoRA model)"
    )
    assert check.benchmark_skip(seed_003, {"available": False}) == (
        "torch.cuda.is_available() is False"
    )
    absent = check.Benchmark("x", "ddp.py", ("--device", "cuda", "--no-such-flag"), "digest", str)
    assert check.benchmark_skip(absent, one_gpu) == (
        "benchmarks/ddp.py has no --no-such-flag option yet"
    )


def test_each_figure_is_printed_beside_its_target() -> None:
    check = _module()
    row = {
        "world_size": 1,
        "ddp_backend": "nccl",
        "plain": {"median_step_seconds": 0.004, "cpu_seconds_per_step": 0.0035},
        "ddp": {"median_step_seconds": 0.005, "cpu_seconds_per_step": 0.004, "final_loss": 2.5},
        "paramsync": {
            "median_step_seconds": 0.0051,
            "cpu_seconds_per_step": 0.0045,
            "final_loss": 2.5,
        },
        "step_time_ratio": 1.02,
    }
    assert check.world_one_detail([row]) == (
        "1 worker: plain torch 4.00 ms/step (CPU 3.5 ms), DDP nccl 5.00 ms/step (CPU 4.0 ms), "
        "paramsync 5.10 ms/step (CPU 4.5 ms); paramsync / DDP 1.02x, target <= 1.05x: met"
    )
    assert check.ratio_detail([{**row, "step_time_ratio": 2.83}]).endswith(
        "ratio 2.83; final loss 2.5000 / 2.5000; target <= 1.05x: missed"
    )
    digest = {"step_seconds": 0.1, "digest_seconds": 0.0015, "host_bytes": 16}
    assert check.digest_detail(digest, share_target=0.02) == (
        "digest 1.500 ms a step, 1.50 % of a 100.00 ms step; 16 bytes to the host; "
        "target <= 2 %: met"
    )
    assert check.digest_detail({"state_bytes": 2048, "median_cpu_seconds": {"hasher": 5e-4}}) == (
        "no step_seconds, digest_seconds, host_bytes in its JSON; its figures: "
        "state_bytes 2048; median_cpu_seconds.hasher 0.0005"
    )
    table = {
        "threads": {"step_seconds": 0.008},
        "one": {"step_seconds": 0.012},
        "ddp": {"step_seconds": 0.008},
        "speedup_over_one": 1.5,
        "step_ratio_to_ddp": 1.0,
    }
    assert check.speedup_detail(table).endswith("speed-up over one 1.50x, threads / DDP 1.00; "
                                                "target >= 1.3x: met")  # fmt: skip
