"""`UpdateRelay`: the replica threads' hand-offs inside one fused step job.

`DataParallelCoordinator.train_batch_parallel` hands each replica thread one job per step:
forward and backward of its shard, then the update (the weighted gradient average, every
replica's optimizer step, the digests). One pool round-trip a step instead of three (each costs
the main thread's and the replica threads' wake-ups: measured on a 2-core host, 0.3 ms a step
less for the two saved).

How the update is shared depends on where its work runs:

- **CPU replicas, one after another** (`arrive`). Their optimizer steps and digests are mostly
  Python (torch's for-loop AdamW over small tensors, the hasher's walk), so two threads running
  them at the same moment only fight over the GIL: measured on a 2-core host, both replicas'
  AdamW steps took 3.53 ms on two threads at once against 2.26 ms one after the other. The
  replica thread that finishes its backward last therefore sums the whole average and takes
  every replica's update and then every digest, in device order, on its own: no thread waits
  at a barrier or for a turn (each such hand-off costs a wake-up), and the second replica's
  optimizer step runs with the first one's code warm in the core's caches (paired A/B on a
  2-core host: 0.2-0.5 ms a step less than replicas taking turns on their own threads). The
  others' jobs end as soon as their gradients are in place.
- **Replicas that update at once** (`wait_all`: CUDA replicas only launch kernels on their own
  streams; so do CPU replicas on an interpreter without a GIL): a barrier after the backward,
  each thread sums its slice of the average, a barrier, each thread steps and hashes its own
  replica.

A replica whose job fails calls `abort`: every barrier wait then returns False at once (instead
of waiting for a replica that never comes), and no `arrive` is the last, so the pool's `run`
ends and reports the failure with no replica updated.
"""

from __future__ import annotations

import threading

__all__ = ["UpdateRelay"]


class UpdateRelay:
    """The hand-offs of one step of ``count`` replicas: who arrives last (`arrive`), and the
    barrier of replicas that update at once (`wait_all`)."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"a relay needs at least one replica, not {count}")
        self.count = count
        self._barrier = threading.Barrier(count)
        self._lock = threading.Lock()
        self._arrived = 0
        self._aborted = False

    @property
    def aborted(self) -> bool:
        return self._aborted

    def arrive(self) -> bool:
        """Count this replica in (its gradient is computed): True for the last of the
        ``count`` replicas to arrive, when none failed; that one takes the update."""
        with self._lock:
            self._arrived += 1
            return self._arrived == self.count and not self._aborted

    def wait_all(self) -> bool:
        """Wait until every replica has reached this point (its gradient computed, its slice of
        the average summed); False if one failed."""
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            return False
        return not self._aborted

    def abort(self) -> None:
        """A replica failed: release every wait, now and later, with False, and let no
        arrival be the last."""
        with self._lock:
            self._aborted = True
        self._barrier.abort()
