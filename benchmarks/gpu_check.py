"""GPU check (``make gpu-check``): everything in this project that needs an NVIDIA GPU, in one
run of at most 8 minutes, as a table of pass, fail or skip lines.

1. every CUDA-gated test (``pytest -m cuda``: each test that needs a GPU carries the ``cuda``
   marker, so a new one is picked up), one line per test: the CUDA compute actor and the
   host-staged data plane (C-STREAMSYNC-001, tests/test_cuda_training.py), multi-device replicas
   on the GPU, NCCL's device data plane, the digest of device state, autocast on CUDA;
2. ``benchmarks/multidevice.py --device cuda``: two replicas in threads on the GPU against one
   replica and torch DDP (gloo) with its 2 ranks on the GPU; the figures in the line;
3. ``benchmarks/ddp.py --device cuda --worlds 2``: torch DDP (gloo) against paramsync, 2
   processes sharing the GPU (paramsync's gradients staged through the host); the figures in
   the line.

Each part runs in its own process under its own deadline, all within ``--budget`` seconds (480
by default). Exit status 1 if any line failed, else 0. On a machine where CUDA is not usable
every line is a skip naming the reason (``torch.cuda.is_available() is False``), and the exit
status is 0. It runs with the interpreter that runs it (``python3 benchmarks/gpu_check.py``
from a checkout whose dependencies that interpreter has; ``make gpu-check`` uses the .venv).

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BUDGET_SECONDS = 480.0
"""The whole run's bound (8 minutes); each part gets its own share of what is left."""
PART_SECONDS = {"tests": 120.0, "multidevice": 200.0, "ddp": 150.0}
"""Each part's own deadline (cut to what is left of the budget when it starts). The multidevice
benchmark starts 12 processes that import peft and transformers: most of its time (123 s on an
H200 machine, 16 cores)."""
MULTIDEVICE = ["--device", "cuda", "--rounds", "3", "--warmup", "3", "--steps", "20"]
DDP = ["--device", "cuda", "--worlds", "2", "--rounds", "2", "--warmup", "5", "--steps", "30"]
DDP_ONLY = ["--no-torch-plane"]
"""NCCL takes one rank per GPU: two ranks on one GPU cannot form paramsync's torch plane, so
the ddp part compares DDP with paramsync's own (host-staged) plane; the device plane has its
test (tests/test_torch_groups.py, one rank)."""
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
    return [Line(node, "skip", 0.0, reason) for node in ids]


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
            lines.append(Line(node, "fail", seconds, text[:200]))
        elif skipped is not None:
            message = (skipped.get("message") or "").removeprefix("Skipped: ")
            lines.append(Line(node, "skip", seconds, message[:200]))
        else:
            lines.append(Line(node, "pass", seconds))
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


def run_benchmark(
    name: str, script: str, options: list[str], seconds: float, logs: Path | None, detail: Any
) -> Line:
    """Run ``benchmarks/<script>`` with ``options`` and ``--json``; its line's detail is
    ``detail(the JSON)``."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, str(ROOT / "benchmarks" / script), *options, "--json", str(out)]
        log = logs / f"{Path(script).stem}.log" if logs else None
        finished = run_part(command, seconds, log)
        if finished.returncode != 0 or not out.exists():
            return _failed(name, finished, seconds)
        return Line(name, "pass", finished.seconds, detail(json.loads(out.read_text())))


MULTIDEVICE_NAME = "benchmarks/multidevice.py " + " ".join(MULTIDEVICE)
DDP_NAME = "benchmarks/ddp.py " + " ".join(DDP + DDP_ONLY)


# ----------------------------------------------------------------------------- the run


def check(args: argparse.Namespace, info: dict[str, Any]) -> list[Line]:
    """Every line: the tests, then the two benchmarks (each skipped with the reason when CUDA
    is not usable here)."""
    deadline = time.monotonic() + args.budget

    def left(part: str) -> float:
        return min(PART_SECONDS[part], deadline - time.monotonic())

    reason = skip_reason(info)
    if reason is not None:
        ids, failure = collect(args.tests, left("tests"))
        lines = [failure] if failure else skipped_tests(ids, reason)
        lines.append(Line(MULTIDEVICE_NAME, "skip", 0.0, reason))
        lines.append(Line(DDP_NAME, "skip", 0.0, reason))
        return lines
    lines = run_tests(args.tests, left("tests"), args.logs)
    if info.get("peft"):
        lines.append(
            run_benchmark(
                MULTIDEVICE_NAME,
                "multidevice.py",
                MULTIDEVICE,
                left("multidevice"),
                args.logs,
                lambda result: multidevice_detail(result["table"]),
            )
        )
    else:
        lines.append(Line(MULTIDEVICE_NAME, "skip", 0.0, "peft is not installed (its LoRA model)"))
    lines.append(
        run_benchmark(
            DDP_NAME,
            "ddp.py",
            DDP + DDP_ONLY,
            left("ddp"),
            args.logs,
            lambda result: ddp_detail(result["rows"]),
        )
    )
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
