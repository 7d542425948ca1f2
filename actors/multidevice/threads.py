"""A persistent pool of OS threads, one per model replica.

Each replica's forward and backward run on its own thread, which lives as long as the pool: no
thread is started per step. torch releases the GIL inside its kernels, so replicas on several
CPU devices (or several GPUs) run at once. (Who takes the update after them, each thread its own
replica's or one thread every replica's, is the coordinator's choice:
`paramsync.actors.multidevice.relay`.)

One wake-up per round: `run` waits on one event, set by whichever job ends last, not on each
job's result in turn (a caller woken by an early finisher would only take the GIL from the
replica still working, and wait again).

Intra-op threads: ``torch.set_num_threads`` is called once on each pool thread when it starts,
so each replica runs its kernels with ``intra_op_threads`` threads (default 1: on an n-core
host, n replicas use one core each). torch's count is process-wide, not per thread (measured:
after a pool thread sets 1, the main thread and threads started later report 1 too), so the
pool records the count it found and puts it back when it closes: a pool leaves the process's
threading as it was (a leaked count once changed the arithmetic of unrelated code run later in
the same process: tests/test_multidevice.py checks it is restored).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

__all__ = ["ReplicaError", "ReplicaThreads"]

T = TypeVar("T")

_STOP = object()


class ReplicaError(RuntimeError):
    """A replica's work failed; names the replica, its device and the phase."""

    def __init__(self, replica: int, device: str, phase: str, error: BaseException) -> None:
        super().__init__(f"replica {replica} on {device} failed in {phase}: {error!r}")
        self.replica = replica
        self.device = device
        self.phase = phase


class _Round:
    """One `ReplicaThreads.run`: every job's result or error, and an event set when the last
    job ends."""

    __slots__ = ("done", "errors", "left", "lock", "results")

    def __init__(self, count: int) -> None:
        self.results: list[Any] = [None] * count
        self.errors: list[BaseException | None] = [None] * count
        self.left = count
        self.lock = threading.Lock()
        self.done = threading.Event()

    def finish(self) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self.done.set()


class ReplicaThreads:
    """``count`` persistent threads; `run` hands job ``i`` to thread ``i`` and waits for all."""

    def __init__(self, count: int, *, intra_op_threads: int = 1, name: str = "replica") -> None:
        if count < 1:
            raise ValueError(f"a replica pool needs at least one thread, not {count}")
        if intra_op_threads < 1:
            raise ValueError(f"intra_op_threads must be at least 1, not {intra_op_threads}")
        self.count = count
        self.intra_op_threads = intra_op_threads
        self._threads_before = torch.get_num_threads()
        self._queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(count)]
        self._threads = [
            threading.Thread(
                target=self._serve, args=(self._queues[index],), name=f"{name}-{index}", daemon=True
            )
            for index in range(count)
        ]
        self._closed = False
        for thread in self._threads:
            thread.start()

    def _serve(self, jobs: queue.SimpleQueue[Any]) -> None:
        torch.set_num_threads(self.intra_op_threads)
        while True:
            job = jobs.get()
            if job is _STOP:
                return
            function, round_, index = job
            try:
                round_.results[index] = function()
            except BaseException as error:
                round_.errors[index] = error
            finally:
                round_.finish()

    def run(
        self, jobs: Sequence[Callable[[], T]], *, phase: str, devices: Sequence[str]
    ) -> list[T]:
        """Run ``jobs[i]`` on thread ``i`` (at most ``count`` jobs), wait for every one, and
        return their results in order; the first failure in replica order is raised as a
        `ReplicaError` naming that replica, after all jobs have ended."""
        if self._closed:
            raise RuntimeError("the replica threads are closed")
        if len(jobs) > self.count:
            raise ValueError(f"{len(jobs)} jobs for {self.count} replica threads")
        if not jobs:
            return []
        round_ = _Round(len(jobs))
        for index, job in enumerate(jobs):
            self._queues[index].put((job, round_, index))
        round_.done.wait()
        for index, error in enumerate(round_.errors):
            if error is not None:
                raise ReplicaError(index, devices[index], phase, error) from error
        return list(round_.results)

    def close(self) -> None:
        """Stop and join every thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for jobs in self._queues:
            jobs.put(_STOP)
        for thread in self._threads:
            thread.join()
        torch.set_num_threads(self._threads_before)
