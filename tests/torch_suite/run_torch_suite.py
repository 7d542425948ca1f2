"""Run torch's own distributed test suite against the paramsync backend and report.

torch ships its distributed tests in the wheel
(``torch/testing/_internal/distributed/distributed_test.py``, class
``DistributedTest._DistTestBase``). Out-of-tree backends run them the way torch's
``test/distributed/test_distributed_spawn.py`` does: a TestCase combining ``_DistTestBase``
with ``MultiProcessTestCase`` spawning (one process per rank), driven by the environment
variables ``BACKEND``, ``WORLD_SIZE``, ``TEMP_DIR`` and ``INIT_METHOD``. This script does that
with the selection torch runs for ``BACKEND=gloo`` on a CPU-only machine, every group made a
paramsync group (`paramsync_case`: the ranks are forked unless
``PARAMSYNC_TORCH_SUITE_START=spawn``), at each world size asked for, one child process per
world size (torch reads the variables at import time), and writes a report: the tests that
pass, the tests the backend refuses at the call (its one ``UnsupportedCall`` line), the tests
that fail with their error line, and the skipped tests by group with the group's reason
(`skip_groups`). ``--large-world-size 8`` also runs, at 8 ranks, the tests torch runs only
from 8 ranks up (its ``*_group`` tests).

    python tests/torch_suite/run_torch_suite.py                       # world sizes 2, 3 and 4
    python tests/torch_suite/run_torch_suite.py --world-sizes 2 -k all_reduce -k broadcast
    python tests/torch_suite/run_torch_suite.py --json out/torch_suite.json \\
        --markdown out/torch_suite.md

``-k`` keeps the tests whose name contains any of the given substrings; ``--tests`` names them
exactly. The exit status is 1 when a test fails (or a world size's run breaks), else 0.
``PARAMSYNC_SECRET`` is made fresh for the run when the environment has none.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import unittest
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BACKEND = "paramsync"
DEFAULT_TIMEOUT = 120


# --------------------------------------------------------------------------- one world size


class _Recorder(unittest.TestResult):
    """Each test's outcome, seconds, and (failed) error line and text, or (skipped) reason."""

    def __init__(self, log: Any) -> None:
        super().__init__()
        self.rows: list[dict[str, Any]] = []
        self._log = log
        self._started = 0.0

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self._started = time.monotonic()

    def _row(self, test: unittest.TestCase, outcome: str, **extra: Any) -> None:
        name = test.id().rsplit(".", 1)[-1]
        row = {"test": name, "outcome": outcome, "seconds": 0.0, **extra}
        if outcome != "skipped":
            row["seconds"] = round(time.monotonic() - self._started, 2)
        self.rows.append(row)
        line = extra.get("reason") or extra.get("error") or ""
        print(f"{outcome:7} {row['seconds']:6.1f}s {name} {line}"[:300], file=self._log, flush=True)

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._row(test, "passed")

    def _failed(self, test: unittest.TestCase, err: Any) -> None:
        text = "".join(traceback.format_exception(*err))
        refusal = _refusal(text)
        if refusal is not None:
            self._row(test, "refused", error=refusal, text=text[-6000:])
            return
        self._row(test, "failed", error=_error_line(text), text=text[-6000:])

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._failed(test, err)

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._failed(test, err)

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._row(test, "skipped", reason=reason)

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self._row(test, "failed", error="unexpected success", text="")

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self._row(test, "passed", note="expected failure")


REFUSAL = "UnsupportedCall"
"""The exception with which the backend refuses an operation it does not run, at the call."""


def _refusal(text: str) -> str | None:
    """The backend's refusal in a failed test's text (a rank's traceback), or None: the line
    ``UnsupportedCall: <operation>: <why>``."""
    for line in text.splitlines():
        head, _, message = line.strip().partition(": ")
        if message and head.rsplit(".", 1)[-1] == REFUSAL:
            return f"{REFUSAL}: {message}"[:400]
    return None


def _error_line(text: str) -> str:
    """The line that says what went wrong: the last exception line of the innermost
    traceback (a rank's, when the ranks reported one)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Exit", "Timeout")) or "Error: " in line:
            return line[:400]
    return lines[-1][:400] if lines else ""


def run_one(
    world_size: int, select: list[str], exact: list[str], out: Path, log: Path, large: bool
) -> int:
    """Run the suite at ``world_size`` in this process; write the rows to ``out`` as JSON.
    Everything the ranks and torch's harness print goes to ``log``; one line per test to
    this process's standard error."""
    progress = os.fdopen(os.dup(2), "w", buffering=1)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    temp = tempfile.mkdtemp(prefix="paramsync-torch-suite-")
    (Path(temp) / "barrier").mkdir()
    os.environ.update(
        WORLD_SIZE=str(world_size),
        TEMP_DIR=temp,
        INIT_METHOD=os.environ.get("INIT_METHOD", "env://"),
    )
    sys.path.insert(0, str(HERE))
    import paramsync_case

    case = paramsync_case.TestDistBackendWithSpawn
    names = sorted(n for n in dir(case) if n.startswith("test_"))
    if exact:
        unknown = sorted(set(exact) - set(names))
        if unknown:
            raise SystemExit(f"torch's suite has no test {', '.join(unknown)}")
        names = [n for n in names if n in exact]
    if select:
        names = [n for n in names if any(s in n for s in select)]
    if large:
        from skip_groups import large_world_tests

        names = large_world_tests(names)
    suite = unittest.TestSuite(case(n) for n in names)
    recorder = _Recorder(progress)
    started = time.monotonic()
    try:
        suite.run(recorder)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    result = {
        "world_size": world_size,
        "seconds": round(time.monotonic() - started, 1),
        "rows": recorder.rows,
    }
    out.write_text(json.dumps(result, indent=1))
    return 0


# --------------------------------------------------------------------------- the report


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Counts, failed tests, and skipped tests by group with the group's reason."""
    from skip_groups import group_of

    rows = result["rows"]
    groups: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["outcome"] == "skipped":
            name = group_of(row["reason"])
            entry = groups.setdefault(name, {"reason": row["reason"], "tests": []})
            entry["tests"].append(row["test"])
    return {
        "world_size": result["world_size"],
        "large_only": result.get("large_only", False),
        "seconds": result["seconds"],
        "passed": sorted(r["test"] for r in rows if r["outcome"] == "passed"),
        "failed": {r["test"]: r["error"] for r in rows if r["outcome"] == "failed"},
        "refused": {r["test"]: r["error"] for r in rows if r["outcome"] == "refused"},
        "skipped": sum(1 for r in rows if r["outcome"] == "skipped"),
        "skip_groups": dict(sorted(groups.items(), key=lambda kv: -len(kv[1]["tests"]))),
    }


def markdown(summaries: list[dict[str, Any]], command: str) -> str:
    """The report as Markdown."""
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    import torch

    out = [
        "# torch's distributed test suite on the paramsync backend",
        "",
        f"`{command}` on {today}, torch {torch.__version__}.",
        "",
        "| world size | selected | passed | refused | failed | skipped | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        out.append(
            f"| {_label(s)} | {_selected(s)} | {len(s['passed'])} | {len(s['refused'])} | "
            f"{len(s['failed'])} | {s['skipped']} | {s['seconds']:.0f} |"
        )
    for s in summaries:
        out += ["", f"## World size {_label(s)}", ""]
        if s["failed"]:
            out += ["Failed:", ""]
            out += [f"* `{t}`: `{line}`" for t, line in sorted(s["failed"].items())]
            out.append("")
        if s["refused"]:
            out += ["Refused by the backend at the call, with its one line:", ""]
            out += [f"* `{t}`: `{line}`" for t, line in sorted(s["refused"].items())]
            out.append("")
        out += [f"Passed ({len(s['passed'])}): " + ", ".join(f"`{t}`" for t in s["passed"]), ""]
        out += ["Skipped, by group (torch: torch's own skip, with torch's reason):", ""]
        out += ["| group | reason | tests |", "|---|---|---|"]
        for name, entry in s["skip_groups"].items():
            reason = entry["reason"].replace("|", "/").replace("\n", " ")
            label = name if name != entry["reason"] else "torch"
            tests = ", ".join(f"`{t}`" for t in sorted(entry["tests"]))
            out.append(f"| {label} | {reason} | {tests} |")
        out.append("")
    return "\n".join(out)


def _selected(summary: dict[str, Any]) -> int:
    """The tests that ran (passed, refused or failed): the selection less the skipped."""
    return len(summary["passed"]) + len(summary["refused"]) + len(summary["failed"])


def _label(summary: dict[str, Any]) -> str:
    if summary.get("large_only"):
        return f"{summary['world_size']} (only the tests torch runs from 8 ranks up)"
    return str(summary["world_size"])


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(HERE), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", str(DEFAULT_TIMEOUT))
    if not env.get("PARAMSYNC_SECRET") and not env.get("PARAMSYNC_SECRET_FILE"):
        sys.path.insert(0, str(ROOT))
        from paramsync.runtime.protocol.handshake import new_secret

        env["PARAMSYNC_SECRET"] = new_secret()
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--world-sizes",
        type=int,
        nargs="*",
        default=[2, 3, 4],
        help="the world sizes to run the suite at (default %(default)s; none: only the "
        "--large-world-size run)",
    )
    parser.add_argument("-k", dest="select", action="append", default=[], metavar="TEXT")
    parser.add_argument("--tests", nargs="+", default=[], metavar="NAME")
    parser.add_argument("--json", type=Path, help="write the full results here")
    parser.add_argument("--markdown", type=Path, help="write the report here")
    parser.add_argument(
        "--timeout",
        type=int,
        default=DEFAULT_TIMEOUT,
        help="seconds one test may take before torch's harness fails it (default %(default)s)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=ROOT / "out" / "torch_suite",
        help="where each world size's full output goes, as wsN.log (default %(default)s)",
    )
    parser.add_argument(
        "--large-world-size",
        type=int,
        metavar="N",
        help="also run, at world size N (8 or more), the tests torch runs only from 8 ranks "
        "up (its *_group tests)",
    )
    parser.add_argument("--one-world-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--large-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_world_size is not None:
        log = args.log_dir / f"ws{args.one_world_size}.log"
        return run_one(args.one_world_size, args.select, args.tests, args.out, log, args.large_only)

    sys.path.insert(0, str(HERE))
    env = _child_env()
    env["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(args.timeout)
    summaries, results, broken = [], [], False
    runs = [(world_size, False) for world_size in args.world_sizes]
    if args.large_world_size is not None:
        if args.large_world_size < 8:
            parser.error("--large-world-size: torch runs those tests from 8 ranks up")
        runs.append((args.large_world_size, True))
    for world_size, large in runs:
        if world_size < 2:
            parser.error(f"world size {world_size}: torch's suite needs at least 2 ranks")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            command = [sys.executable, __file__, "--one-world-size", str(world_size)]
            command += ["--out", str(out), "--log-dir", str(args.log_dir)]
            command += [f"-k{s}" for s in args.select]
            command += ["--tests", *args.tests] if args.tests else []
            command += ["--large-only"] if large else []
            log = args.log_dir / f"ws{world_size}.log"
            print(f"== world size {world_size} (output in {log})", file=sys.stderr, flush=True)
            code = subprocess.run(command, env=env, cwd=ROOT, check=False).returncode
            if code != 0 or not out.exists():
                print(
                    f"world size {world_size}: the run broke (exit {code}, see {log})",
                    file=sys.stderr,
                )
                broken = True
                continue
            result = json.loads(out.read_text())
        result["large_only"] = large
        results.append(result)
        summaries.append(summarize(result))
    invoked = " ".join(["python", os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])])
    report = markdown(summaries, invoked)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summaries": summaries, "results": results}, indent=1))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(report + "\n")
    for s in summaries:
        print(
            f"world size {_label(s)}: {_selected(s)} ran: {len(s['passed'])} passed, "
            f"{len(s['refused'])} refused, {len(s['failed'])} failed; {s['skipped']} "
            f"skipped in {s['seconds']:.0f} s"
        )
        for test, line in sorted(s["refused"].items()):
            print(f"  REFUSED {test}: {line}")
        for test, line in sorted(s["failed"].items()):
            print(f"  FAILED {test}: {line}")
    failed = any(s["failed"] for s in summaries)
    return 1 if failed or broken else 0


if __name__ == "__main__":
    sys.exit(main())
