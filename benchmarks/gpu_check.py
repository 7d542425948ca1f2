"""GPU check (``make gpu-check``): everything in this project that needs an NVIDIA GPU, in one
run of at most 8 minutes, as a table of pass, fail or skip lines, each with the command that
produced it.

1. every CUDA-gated test (``pytest -m cuda``: each test that needs a GPU carries the ``cuda``
   marker, so a new one is picked up), one line per test: the CUDA compute actor and the
   host-staged data plane (C-STREAMSYNC-001, tests/test_cuda_training.py), multi-device replicas
   on the GPU (their device averaging and stream ordering), NCCL's device data plane, the digest
   of device state, autocast on CUDA;
2. the benchmarks, one line each with its figures and each figure's target (met or missed):

   (a) ``benchmarks/ddp.py --worlds 1 --ddp-backend nccl --plain``: one worker on the GPU, a
       plain torch loop, torch DDP on NCCL and paramsync checking its weights every step: each
       one's step time and rank 0's CPU time a step; paramsync / torch DDP, target <= 1.05x;
   (b) ``benchmarks/ddp.py --worlds 2``: 2 ranks sharing the GPU, torch DDP on gloo against
       paramsync (its gradients staged through the host); target <= 1.05x;
   (c) ``benchmarks/digest.py --device cuda``: the state digest computed on the device, for the
       417 k-parameter demo model and a ~100 M-parameter one: its time a step and the bytes it
       moves to the host; target for the large model: <= 2 % of its step;
   (d) ``benchmarks/multidevice.py --device cuda``: seed 003's two replicas in threads on the
       GPU against one replica and torch DDP; target: speed-up over one replica >= 1.3x;
   (b') ``benchmarks/ddp.py --worlds 2 --ddp-backend nccl``: 2 ranks on 2 GPUs, torch DDP and
       paramsync over NCCL. NCCL refuses two ranks on one device, so with one GPU this line is
       a skip saying so.

Each part runs in its own process under its own deadline, all within ``--budget`` seconds (480
by default). Exit status 1 if any line failed, else 0. On a machine where CUDA is not usable
every line is a skip naming the reason (``torch.cuda.is_available() is False``), and the exit
status is 0. A benchmark whose script lacks an option the line needs (another part of the
project still adding it) is a skip naming the option. It runs with the interpreter that runs
it (``python3 benchmarks/gpu_check.py`` from a checkout whose dependencies that interpreter has;
``make gpu-check`` uses the .venv).

    python benchmarks/gpu_check.py --logs out/gpu-check --json out/gpu_check.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BUDGET_SECONDS = 480.0
"""The whole run's bound (8 minutes); each part gets its own share of what is left."""
PART_SECONDS = {
    "tests": 80.0,
    "world one": 100.0,
    "shared": 80.0,
    "digest": 40.0,
    "digest large": 60.0,
    "multidevice": 110.0,
    "two gpus": 120.0,
}
"""Each part's own deadline (cut to what is left of the budget when it starts). A benchmark's
time is mostly its processes starting (each imports torch and initializes CUDA; 2026-11-27 on an
H200 machine with 16 cores: 60 s for 6 launches of ddp.py; 92 s for multidevice.py, whose 12
processes import peft and transformers). The line that needs two GPUs comes last: on one GPU it
is skipped, on two it takes what is left."""
MIN_PART_SECONDS = 10.0
"""A benchmark with less than this left of the budget is skipped (it could not even start)."""
TARGET_RATIO = 1.05
"""paramsync / torch DDP, step time: at most this."""
TARGET_DIGEST_SHARE = 0.02
"""The digest of the ~100 M-parameter model on the device: at most this share of its step."""
TARGET_SPEEDUP = 1.3
"""Seed 003's two replicas in threads on the GPU over one replica: at least this."""
TIMING = ("--rounds", "2", "--warmup", "5", "--steps", "30")
MULTIDEVICE = ["--device", "cuda", "--rounds", "3", "--warmup", "3", "--steps", "20"]
DDP = ["--device", "cuda", "--worlds", "2", *TIMING]
DDP_ONLY = ["--no-torch-plane"]
"""NCCL takes one rank per GPU: two ranks on one GPU cannot form paramsync's torch plane, so
the shared-GPU line compares DDP with paramsync's own (host-staged) plane; the device plane has
its test (tests/test_torch_groups.py, one rank) and its line on two GPUs."""
WORLD_ONE = ["--device", "cuda", "--worlds", "1", "--ddp-backend", "nccl", "--plain", *TIMING]
TWO_GPUS = ["--device", "cuda", "--worlds", "2", "--ddp-backend", "nccl", *TIMING]
DIGEST = ["--device", "cuda", "--steps", "60"]
DIGEST_LARGE = ["--device", "cuda", "--params", "100M", "--steps", "30"]
PROBE = """
import importlib.util, json, platform
info = {"python": platform.python_version(), "peft": importlib.util.find_spec("peft") is not None}
try:
    import torch
except Exception as exc:
    info["error"] = f"torch is not importable: {exc}"
else:
    info["torch"] = torch.__version__
    info["available"] = torch.cuda.is_available()
    if info["available"]:
        info["count"] = torch.cuda.device_count()
        info["name"] = torch.cuda.get_device_name(0)
print(json.dumps(info))
"""


@dataclass
class Line:
    """One line of the table."""

    name: str
    result: str  # "pass", "fail" or "skip"
    seconds: float
    detail: str = ""
    command: str = ""
    """What ran (or would have run) for this line, from the checkout's root."""


@dataclass
class Finished:
    """A part's process: its exit status (None: killed at its deadline), output and time."""

    returncode: int | None
    output: str
    seconds: float


def run_part(command: list[str], seconds: float, log: Path | None = None) -> Finished:
    """Run ``command`` in the checkout, in a process group of its own (its workers too), with
    stdout and stderr together; at ``seconds`` the whole group is killed."""
    started = time.monotonic()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), _pythonpath()])))
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=max(seconds, 1.0))
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code = None
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"$ {' '.join(command)}\n{output}")
    return Finished(code, output, time.monotonic() - started)


def _pythonpath() -> str:
    return os.environ.get("PYTHONPATH", "")


def probe() -> dict[str, Any]:
    """What this interpreter's torch sees (in a child, so that this script imports no torch)."""
    finished = run_part([sys.executable, "-c", PROBE], 120.0)
    if finished.returncode != 0:
        return {"error": f"the CUDA probe failed: {_last_line(finished.output)}"}
    info: dict[str, Any] = json.loads(finished.output.strip().splitlines()[-1])
    return info


def skip_reason(info: dict[str, Any]) -> str | None:
    """Why nothing can run on the GPU here, or None when CUDA is usable."""
    if "error" in info:
        return str(info["error"])
    if not info.get("available"):
        return "torch.cuda.is_available() is False"
    return None


def _last_line(output: str) -> str:
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def _failed(name: str, finished: Finished, seconds: float) -> Line:
    if finished.returncode is None:
        return Line(name, "fail", finished.seconds, f"killed at its deadline ({seconds:.0f} s)")
    detail = f"exit {finished.returncode}: {_last_line(finished.output)}"
    return Line(name, "fail", finished.seconds, detail)


# ----------------------------------------------------------------------------- the tests


def _pytest(paths: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", *paths]


def collect(paths: list[str], seconds: float) -> tuple[list[str], Line | None]:
    """The CUDA-gated tests' node ids (``-m cuda``), or a fail line if collection failed."""
    finished = run_part([*_pytest(paths), "--collect-only", "-q"], seconds)
    if finished.returncode not in (0, 5):  # 5: no test selected
        return [], _failed("tests: collection", finished, seconds)
    return [line for line in finished.output.splitlines() if "::" in line], None


def skipped_tests(ids: list[str], reason: str) -> list[Line]:
    return [Line(node, "skip", 0.0, reason, pytest_command(node)) for node in ids]


def pytest_command(node: str) -> str:
    """The command that runs one CUDA-gated test on its own."""
    return f"python -m pytest -m cuda '{node}'"


def junit_lines(xml_text: str) -> list[Line]:
    """One line per test case of a pytest JUnit report (its node id as pytest names it)."""
    lines = []
    for case in ElementTree.fromstring(xml_text).iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "?")
        # A module that failed to import: no class name, the module's dotted name as the name.
        node = node_id(classname, name) if classname else node_id(name, "").removesuffix("::")
        seconds = float(case.get("time", "0"))
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            message = (problem.get("message") or "").strip().splitlines()
            text = message[0] if message else ""
            if not classname and problem.text:  # "collection failure": the error's own line
                text = f"{text}: {_last_line(problem.text)}"
            lines.append(Line(node, "fail", seconds, text[:200], pytest_command(node)))
        elif skipped is not None:
            message = (skipped.get("message") or "").removeprefix("Skipped: ")
            lines.append(Line(node, "skip", seconds, message[:200], pytest_command(node)))
        else:
            lines.append(Line(node, "pass", seconds, "", pytest_command(node)))
    return lines


def node_id(classname: str, name: str, root: Path = ROOT) -> str:
    """pytest's node id of a JUnit test case: ``tests.test_x.TestY`` and ``name`` ->
    ``tests/test_x.py::TestY::name`` (the longest dotted prefix that is a file of ``root``)."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (root / path).is_file():
            return "::".join([path, *parts[cut:], name])
    return "::".join([classname, name])


def run_tests(paths: list[str], seconds: float, logs: Path | None) -> list[Line]:
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        report = Path(tmp) / "junit.xml"
        finished = run_part(
            # A module that fails to import (a package missing here) is a line of its own
            # rather than the end of every GPU test.
            [
                *_pytest(paths),
                "-q",
                "-rA",
                "--continue-on-collection-errors",
                f"--junitxml={report}",
            ],
            seconds,
            logs / "tests.log" if logs else None,
        )
        if finished.returncode is None or not report.exists():
            return [_failed("tests (pytest -m cuda)", finished, seconds)]
        lines = junit_lines(report.read_text())
    if finished.returncode not in (0, 1) or not lines:  # 1: a test failed (its line says so)
        lines.append(_failed("tests (pytest -m cuda)", finished, seconds))
    return lines


# ----------------------------------------------------------------------------- benchmarks


def multidevice_detail(table: dict[str, Any]) -> str:
    """benchmarks/multidevice.py's figures (``--json``'s table) in one line."""
    ms = {name: table[name]["step_seconds"] * 1e3 for name in ("threads", "one", "ddp")}
    return (
        f"2 replicas in threads {ms['threads']:.2f} ms/step, 1 replica {ms['one']:.2f}, "
        f"DDP 2 procs {ms['ddp']:.2f}; speed-up over one {table['speedup_over_one']:.2f}x, "
        f"threads / DDP {table['step_ratio_to_ddp']:.2f}"
    )


def ddp_detail(rows: list[dict[str, Any]]) -> str:
    """benchmarks/ddp.py's figures (``--json``'s rows) in one line."""
    row = rows[0]
    ddp, ours = row["ddp"], row["paramsync"]
    return (
        f"{row['world_size']} workers: DDP {ddp['median_step_seconds'] * 1e3:.2f} ms/step, "
        f"paramsync {ours['median_step_seconds'] * 1e3:.2f}, ratio {row['step_time_ratio']:.2f}; "
        f"final loss {ddp['final_loss']:.4f} / {ours['final_loss']:.4f}"
    )


def target(value: float, bound: float, *, at_most: bool, unit: str = "x") -> str:
    """``value`` against its target, said beside the figure: met or missed."""
    met = value <= bound if at_most else value >= bound
    sign = "<=" if at_most else ">="
    shown = f"{bound * 100:g} %" if unit == "%" else f"{bound:g}x"
    return f"target {sign} {shown}: {'met' if met else 'missed'}"


def ratio_detail(rows: list[dict[str, Any]]) -> str:
    """`ddp_detail` with the paramsync / torch DDP target."""
    return f"{ddp_detail(rows)}; {target(rows[0]['step_time_ratio'], TARGET_RATIO, at_most=True)}"


def world_one_detail(rows: list[dict[str, Any]]) -> str:
    """benchmarks/ddp.py ``--worlds 1 --plain``: each system's step time and rank 0's CPU time
    a step, and paramsync / torch DDP against its target."""
    row = rows[0]
    backend = row.get("ddp_backend", "gloo")
    parts = []
    for system, label in (("plain", "plain torch"), ("ddp", f"DDP {backend}"), ("paramsync", "")):
        figures = row[system]
        parts.append(
            f"{label or 'paramsync'} {figures['median_step_seconds'] * 1e3:.2f} ms/step "
            f"(CPU {figures['cpu_seconds_per_step'] * 1e3:.1f} ms)"
        )
    ratio = row["step_time_ratio"]
    return (
        f"1 worker: {', '.join(parts)}; paramsync / DDP {ratio:.2f}x, "
        f"{target(ratio, TARGET_RATIO, at_most=True)}"
    )


DIGEST_FIGURES = ("step_seconds", "digest_seconds", "host_bytes")
"""The figures a line reads from benchmarks/digest.py ``--device cuda``'s JSON: a training
step's median time, the digest's median time a step, and the bytes the digest copies to the
host a step."""


def digest_detail(result: dict[str, Any], *, share_target: float | None = None) -> str:
    """benchmarks/digest.py ``--device cuda``'s figures in one line: the digest's time a step,
    its share of the step (against ``share_target`` if given) and its bytes to the host. A JSON
    without those figures: its numbers as they are."""
    if not all(key in result for key in DIGEST_FIGURES):
        numbers = [
            f"{key} {value:.4g}" for key, value in _numbers(result) if not isinstance(value, bool)
        ]
        missing = ", ".join(key for key in DIGEST_FIGURES if key not in result)
        return f"no {missing} in its JSON; its figures: {'; '.join(numbers)}"[:400]
    step, digest = result["step_seconds"], result["digest_seconds"]
    share = digest / step
    text = (
        f"digest {digest * 1e3:.3f} ms a step, {share * 100:.2f} % of a {step * 1e3:.2f} ms "
        f"step; {int(result['host_bytes'])} bytes to the host"
    )
    if share_target is not None:
        text += f"; {target(share, share_target, at_most=True, unit='%')}"
    return text


def _numbers(value: Any, prefix: str = "") -> list[tuple[str, float]]:
    """Every number in a JSON object, by its dotted key."""
    if isinstance(value, dict):
        found = []
        for key, inner in value.items():
            found += _numbers(inner, f"{prefix}{key}.")
        return found
    if isinstance(value, int | float):
        return [(prefix.rstrip("."), float(value))]
    return []


def speedup_detail(table: dict[str, Any]) -> str:
    """`multidevice_detail` with the speed-up's target."""
    speedup = table["speedup_over_one"]
    return f"{multidevice_detail(table)}; {target(speedup, TARGET_SPEEDUP, at_most=False)}"


@dataclass(frozen=True)
class Benchmark:
    """One benchmark line: ``benchmarks/<script> <options> --json PATH``, and how its JSON
    becomes the line's figures."""

    name: str
    script: str
    options: tuple[str, ...]
    part: str
    """Its deadline's key in `PART_SECONDS`."""
    detail: Callable[[Any], str] = field(compare=False)
    gpus: int = 1
    """The GPUs it needs (NCCL takes one rank per GPU)."""
    needs_peft: bool = False

    @property
    def command(self) -> str:
        return " ".join(["python", f"benchmarks/{self.script}", *self.options])


BENCHMARKS = (
    Benchmark(
        "(a) world size 1: plain torch loop, torch DDP on NCCL, paramsync checking every step",
        "ddp.py",
        (*WORLD_ONE, *DDP_ONLY),
        "world one",
        lambda result: world_one_detail(result["rows"]),
    ),
    Benchmark(
        "(b) 2 ranks sharing one GPU: torch DDP (gloo) against paramsync",
        "ddp.py",
        (*DDP, *DDP_ONLY),
        "shared",
        lambda result: ratio_detail(result["rows"]),
    ),
    Benchmark(
        "(c) the digest on the device: the 417 k-parameter demo model",
        "digest.py",
        tuple(DIGEST),
        "digest",
        digest_detail,
    ),
    Benchmark(
        "(c) the digest on the device: a ~100 M-parameter model",
        "digest.py",
        tuple(DIGEST_LARGE),
        "digest large",
        lambda result: digest_detail(result, share_target=TARGET_DIGEST_SHARE),
    ),
    Benchmark(
        "(d) seed 003: 2 replicas in threads on the GPU against one",
        "multidevice.py",
        tuple(MULTIDEVICE),
        "multidevice",
        lambda result: speedup_detail(result["table"]),
        needs_peft=True,
    ),
    Benchmark(
        "(b') 2 ranks on 2 GPUs: torch DDP on NCCL against paramsync (and over NCCL)",
        "ddp.py",
        tuple(TWO_GPUS),
        "two gpus",
        lambda result: ratio_detail(result["rows"]),
        gpus=2,
    ),
)
MULTIDEVICE_NAME = BENCHMARKS[4].name
DDP_NAME = BENCHMARKS[1].name


def missing_options(script: str, options: tuple[str, ...]) -> list[str]:
    """The ``--options`` that ``benchmarks/<script>``'s argument parser does not define (read
    from its source: the script is not run)."""
    source = (ROOT / "benchmarks" / script).read_text()
    return [
        option
        for option in options
        if option.startswith("--") and f'"{option}"' not in source and f"'{option}'" not in source
    ]


def benchmark_skip(bench: Benchmark, info: dict[str, Any]) -> str | None:
    """Why ``bench`` cannot run here, or None."""
    reason = skip_reason(info)
    if reason is not None:
        return reason
    count = int(info.get("count", 0))
    if bench.gpus > count:
        return (
            f"needs {bench.gpus} GPUs (NCCL refuses two ranks on one device); this machine "
            f"has {count}"
        )
    if bench.needs_peft and not info.get("peft"):
        return "peft is not installed (its LoRA model)"
    missing = missing_options(bench.script, bench.options)
    if missing:
        return f"benchmarks/{bench.script} has no {' '.join(missing)} option yet"
    return None


def run_benchmark(
    name: str, script: str, options: list[str], seconds: float, logs: Path | None, detail: Any
) -> Line:
    """Run ``benchmarks/<script>`` with ``options`` and ``--json``; its line's detail is
    ``detail(the JSON)``."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, str(ROOT / "benchmarks" / script), *options, "--json", str(out)]
        log = logs / f"{_log_name(name, script)}.log" if logs else None
        finished = run_part(command, seconds, log)
        if finished.returncode != 0 or not out.exists():
            return _failed(name, finished, seconds)
        return Line(name, "pass", finished.seconds, detail(json.loads(out.read_text())))


def _log_name(name: str, script: str) -> str:
    """A line's log file's name: its script's and its letter's, ``ddp-a``."""
    letter = name[1 : name.index(")")] if name.startswith("(") else ""
    return f"{Path(script).stem}-{letter.replace(chr(39), 'p')}" if letter else Path(script).stem


# ----------------------------------------------------------------------------- the run


def check(args: argparse.Namespace, info: dict[str, Any]) -> list[Line]:
    """Every line: the tests, then the benchmarks (each skipped with the reason when it cannot
    run here)."""
    deadline = time.monotonic() + args.budget

    def left(part: str) -> float:
        return min(PART_SECONDS[part], deadline - time.monotonic())

    reason = skip_reason(info)
    if reason is not None:
        ids, failure = collect(args.tests, left("tests"))
        lines = [failure] if failure else skipped_tests(ids, reason)
    else:
        lines = run_tests(args.tests, left("tests"), args.logs)
    for bench in BENCHMARKS:
        why = benchmark_skip(bench, info)
        seconds = left(bench.part)
        if why is None and seconds < MIN_PART_SECONDS:
            why = f"the {args.budget:.0f} s budget was spent before it started"
        if why is not None:
            line = Line(bench.name, "skip", 0.0, why)
        else:
            options = list(bench.options)
            line = run_benchmark(
                bench.name, bench.script, options, seconds, args.logs, bench.detail
            )
        line.command = bench.command
        lines.append(line)
    return lines


def header(info: dict[str, Any]) -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    gpu = f"{info['name']} ({info['count']} GPU)" if info.get("available") else "no usable GPU"
    torch = info.get("torch", "not importable")
    return f"GPU check, {when}: {gpu}, torch {torch}, Python {platform.python_version()}"


def table(lines: list[Line]) -> str:
    width = max([len(line.name) for line in lines] + [4])
    rows = [f"{'part':<{width}}  result  seconds  detail"]
    for line in lines:
        rows.append(f"{line.name:<{width}}  {line.result:<6}  {line.seconds:7.1f}  {line.detail}")
        if line.command:
            rows.append(f"  $ {line.command}")
    counts = {result: sum(line.result == result for line in lines) for result in RESULTS}
    rows.append(", ".join(f"{count} {result}" for result, count in counts.items()))
    return "\n".join(rows)


RESULTS = ("pass", "fail", "skip")


def exit_status(lines: list[Line]) -> int:
    return 1 if any(line.result == "fail" for line in lines) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget", type=float, default=BUDGET_SECONDS, help="the whole run's bound, seconds"
    )
    parser.add_argument(
        "--tests",
        nargs="+",
        default=["tests"],
        help="where pytest looks for the CUDA-gated tests (default: tests)",
    )
    parser.add_argument("--logs", type=Path, help="write each part's output into this folder")
    parser.add_argument("--json", type=Path, help="write the lines as JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    info = probe()
    print(header(info), flush=True)
    lines = check(args, info)
    print(table(lines))
    print(f"total {time.monotonic() - started:.0f} s", flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"probe": info, "lines": [asdict(line) for line in lines]}
        args.json.write_text(json.dumps(payload, indent=2))
    return exit_status(lines)


if __name__ == "__main__":
    sys.exit(main())
