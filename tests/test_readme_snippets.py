"""Every python snippet of README.md runs as written.

Each ```python block is preceded by an HTML comment the reader does not see, which says how the
block runs and which names it takes from its surroundings (``given``):

- ``<!-- snippet: script -->``: a whole program, run by python as it is.
- ``<!-- snippet: main N -->``: defines ``main(rank, world_size, address)``, run for N ranks at
  once in one process over TCP.
- ``<!-- snippet: ranks N; given: transport, ... -->``: the body of one rank, run on every rank
  of an N-rank in-process world (``transport``: that rank's).
- ``<!-- snippet: launch N [async]; given: ... -->``: a training script, run under ``paramsync
  launch --nproc N`` (``async``: as the body of an async function under trio); each takes half
  a minute on the 2-core machine, so these run in ``make soak``.
- ``<!-- snippet: launcher N NAME; given: ... -->``: a training script, run on N ranks as the
  launcher NAME starts them: ``env`` (a hand-written launcher: torch's RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR, MASTER_PORT), ``slurm`` (srun's SLURM_* variables only), ``mpirun``
  (Open MPI's OMPI_COMM_WORLD_* variables, with MASTER_ADDR and MASTER_PORT as ``mpirun -x``
  passes them) or ``torchrun`` (torchrun itself); in ``make soak`` too.

The given names are defined by this file (`GIVEN`), and only those: every name a snippet reads
and never binds must be given, and every given name must be read, so a snippet that leans on an
undefined name (a ``world`` never made) fails here, without running anything.
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

GIVEN = {
    "torch": "import torch",
    "F": "import torch.nn.functional as F",
    "dist": "import torch.distributed as dist",
    "model": "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), "
    "torch.nn.Linear(8, 3))",
    "optimizer": "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)",
    "loss_fn": "def loss_fn(model, batch):\n"
    "    inputs, targets = batch\n"
    "    return torch.nn.functional.cross_entropy(model(inputs), targets)",
    "my_batches": "def my_batches(rank):\n"
    "    generator = torch.Generator().manual_seed(rank)\n"
    "    for _ in range(3):\n"
    "        yield torch.randn(8, 4, generator=generator), "
    "torch.randint(0, 3, (8,), generator=generator)",
    "dataset": "class _Points:\n"
    "    def __init__(self):\n"
    "        generator = torch.Generator().manual_seed(0)\n"
    "        self.x = torch.randn(64, 4, generator=generator)\n"
    "        self.y = torch.randint(0, 3, (64,), generator=generator)\n"
    "    def __len__(self):\n"
    "        return len(self.x)\n"
    "    def batch(self, indices):\n"
    "        return self.x[indices], self.y[indices]\n"
    "dataset = _Points()",
    "loader": "loader = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(4)]",
    "accumulate": "accumulate = 2",
    "scaler": "scaler = torch.amp.GradScaler('cpu', enabled=False)",
    "activations": "activations = torch.ones(6)",
    "gradients": "gradients = torch.ones(5)",
    "tensor": "tensor = torch.arange(4.0)",
    "buffer": "buffer = torch.zeros(4)",
}
"""What each given name is, in an order that defines what a later one needs."""

PARAMETERS = {"transport"}
"""Given names that are the rank function's parameters, not definitions."""

_COMMENT = re.compile(r"<!-- snippet: (?P<spec>[^>]*?) -->\n```python\n(?P<code>.*?)```", re.S)


@dataclass(frozen=True)
class Snippet:
    line: int
    mode: str
    count: int
    is_async: bool
    given: tuple[str, ...]
    code: str
    launcher: str = ""

    @property
    def name(self) -> str:
        return f"README.md:{self.line}-{self.mode}"


def snippets() -> list[Snippet]:
    text = README.read_text()
    out = []
    for found in _COMMENT.finditer(text):
        head, _, given = found["spec"].partition("; given:")
        words = head.split()
        out.append(
            Snippet(
                line=text.count("\n", 0, found.start("code")) + 1,
                mode=words[0],
                count=int(words[1]) if len(words) > 1 else 1,
                is_async="async" in words[2:],
                given=tuple(name.strip() for name in given.split(",") if name.strip()),
                code=found["code"],
                launcher=words[2] if words[0] == "launcher" and len(words) > 2 else "",
            )
        )
    return out


SNIPPETS = snippets()


def split_imports(code: str) -> tuple[str, str]:
    """A rank's body may open with the imports it needs at column 0 (the body itself indented,
    as it sits in the caller's function): ``(imports, body)``, the body dedented."""
    lines = code.splitlines(keepends=True)
    head = 0
    while head < len(lines) and lines[head].startswith(("from ", "import ")):
        head += 1
    return "".join(lines[:head]), textwrap.dedent("".join(lines[head:]))


def names(code: str) -> tuple[set[str], set[str]]:
    """``(read, free)``: the names ``code`` reads, and those it reads but never binds (scopes
    aside), builtins excepted."""
    imports, body = split_imports(code)
    tree = ast.parse(imports + body)
    bound: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read, read - bound - set(dir(builtins))


def test_every_python_block_says_how_it_runs() -> None:
    blocks = README.read_text().count("```python\n")
    assert blocks == len(SNIPPETS) >= 6, "a ```python block without its <!-- snippet: --> line"
    for snippet in SNIPPETS:
        assert snippet.mode in ("script", "main", "ranks", "launch", "launcher"), snippet.name
        if snippet.mode == "launcher":
            assert snippet.launcher in LAUNCHERS, snippet.name
        assert set(snippet.given) <= set(GIVEN) | PARAMETERS, snippet.name


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.name)
def test_a_snippet_reads_only_what_it_defines_or_is_given(snippet: Snippet) -> None:
    read, free = names(snippet.code)
    assert free <= set(snippet.given), f"{snippet.name} reads undefined {free - set(snippet.given)}"
    assert set(snippet.given) <= read, f"{snippet.name} is given {set(snippet.given) - read}"


def prelude(given: tuple[str, ...]) -> str:
    needed = [name for name in GIVEN if name in given]
    return "\n".join(["import torch", *(GIVEN[name] for name in needed)]) + "\n"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def program(snippet: Snippet) -> str:
    imports, code = split_imports(snippet.code)
    if snippet.mode == "script":
        return imports + code
    if snippet.mode == "main":
        return (
            imports
            + code
            + "\n\nimport trio as _trio\n\n\nasync def _all():\n"
            + "    async with _trio.open_nursery() as nursery:\n"
            + f"        for rank in range({snippet.count}):\n"
            + f"            nursery.start_soon(main, rank, {snippet.count}, "
            + f"'127.0.0.1:{free_port()}')\n\n\n_trio.run(_all)\n"
        )
    if snippet.mode == "ranks":
        params = ", ".join(name for name in snippet.given if name in PARAMETERS)
        return (
            prelude(tuple(n for n in snippet.given if n not in PARAMETERS))
            + imports
            + "import trio as _trio\nfrom runtime import InProcessTransport as _World\n\n\n"
            + f"async def _rank({params}):\n"
            + textwrap.indent(code, "    ")
            + "\n\nasync def _all():\n"
            + f"    world = _World.create_group({snippet.count})\n"
            + "    async with _trio.open_nursery() as nursery:\n"
            + "        for transport in world:\n"
            + "            nursery.start_soon(_rank, transport)\n\n\n_trio.run(_all)\n"
        )
    assert snippet.mode in ("launch", "launcher")
    if snippet.is_async:
        return (
            prelude(snippet.given)
            + imports
            + "import trio as _trio\n\n\nasync def _main():\n"
            + textwrap.indent(code, "    ")
            + "\n\n_trio.run(_main)\n"
        )
    return prelude(snippet.given) + imports + code


LAUNCHERS = ("env", "slurm", "mpirun", "torchrun")
"""The launchers a ``launcher`` snippet names."""


def launcher_vars(launcher: str, rank: int, count: int, port: int) -> dict[str, str]:
    """What ``launcher`` sets for ``rank`` of ``count`` (one node; rank 0's address on
    loopback, ``port`` for it)."""
    if launcher == "env":
        return dict(
            RANK=str(rank),
            WORLD_SIZE=str(count),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    if launcher == "slurm":
        return dict(
            SLURM_PROCID=str(rank),
            SLURM_NTASKS=str(count),
            SLURM_LOCALID=str(rank),
            SLURM_NODELIST="127.0.0.1",
            SLURM_JOB_NAME="snippet",
            MASTER_PORT=str(port),  # the job id's port may be taken on a shared machine
        )
    assert launcher == "mpirun", launcher
    return dict(
        OMPI_COMM_WORLD_RANK=str(rank),
        OMPI_COMM_WORLD_SIZE=str(count),
        OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
        OMPI_COMM_WORLD_LOCAL_SIZE=str(count),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def run_launched(
    snippet: Snippet, path: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """Run ``path`` on the snippet's ranks as its launcher starts them."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    if snippet.launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node"]
        command += [str(snippet.count), "--master-port", str(free_port()), str(path)]
        return subprocess.run(
            command, cwd=path.parent, env=env, capture_output=True, text=True, timeout=timeout
        )
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(path)],
            cwd=path.parent,
            env={**env, **launcher_vars(snippet.launcher, rank, snippet.count, port)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(snippet.count)
    ]
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    failed = [proc.returncode for proc in procs if proc.returncode]
    return subprocess.CompletedProcess(
        [str(path)],
        failed[0] if failed else 0,
        "".join(out for out, _ in outputs),
        "".join(err for _, err in outputs),
    )


def run(snippet: Snippet, tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    path = tmp_path / "snippet.py"
    path.write_text(program(snippet))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    secret = "readme-snippets-test-secret-0123456789"
    env["PARAMSYNC_SECRET"] = secret
    if snippet.mode == "launcher":
        return run_launched(snippet, path, env, timeout)
    if snippet.mode == "launch":
        command = [sys.executable, "-m", "paramsync.runtime.cli.main", "launch"]
        command += ["--nproc", str(snippet.count), "--", str(path)]
    else:
        command = [sys.executable, str(path)]
    return subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "snippet",
    [
        pytest.param(
            s, id=s.name, marks=[pytest.mark.soak] if s.mode in ("launch", "launcher") else []
        )
        for s in SNIPPETS
    ],
)
def test_the_snippet_runs_as_written(snippet: Snippet, tmp_path: Path) -> None:
    done = run(snippet, tmp_path, timeout=240 if snippet.mode in ("launch", "launcher") else 120)
    assert done.returncode == 0, f"{snippet.name}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
