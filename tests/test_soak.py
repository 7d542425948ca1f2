"""Long trials kept out of `make test` (run them with `make soak`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Two threads take the first AdamW step of two identical replicas with tied embeddings at once.
# Without a lock torch itself sometimes updates the tied weight differently in one of them; the
# trainer serializes optimizer steps in a process for this reason
# (paramsync.actors.graph.optimizer).
_CONCURRENT_FIRST_STEP = textwrap.dedent(
    """
    import threading, torch
    torch.set_num_threads(1)
    from paramsync.actors.demo_job.model import CharTransformer
    from paramsync.actors.graph.optimizer import OPTIMIZER_STEP_LOCK
    LOCKED = {locked}

    def make():
        m = CharTransformer(97, 64, 4, 1, 32, seed=0)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        x = torch.randint(0, 97, (8, 32), generator=torch.Generator().manual_seed(1))
        m.loss(x, x).backward()
        return m, opt

    a, b = make(), make()
    barrier = threading.Barrier(2)

    def step(replica):
        barrier.wait()
        if LOCKED:
            with OPTIMIZER_STEP_LOCK:
                replica[1].step()
        else:
            replica[1].step()

    threads = [threading.Thread(target=step, args=(r,)) for r in (a, b)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    same = all(torch.equal(p, q) for p, q in zip(a[0].parameters(), b[0].parameters()))
    print("identical" if same else "differ")
    """
)


def _trials(locked: bool, runs: int) -> list[str]:
    code = _CONCURRENT_FIRST_STEP.format(locked=locked)
    return [
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(runs)
    ]


@pytest.mark.soak
def test_serialized_first_optimizer_steps_agree() -> None:
    """With the trainer's lock, concurrent first steps of identical replicas always agree."""
    assert set(_trials(locked=True, runs=30)) == {"identical"}
