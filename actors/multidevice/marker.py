"""`StreamMarker`: a point in one replica's queue of device work, for ordering another queue
after it (or, where the host really must read bytes, the host).

On a CUDA device a marker is a CUDA event: `record` puts it at the end of the work queued on a
stream so far, `wait` makes another stream's later work start after it without blocking the
host (``cudaStreamWaitEvent``), and `synchronize` blocks the host until that one event has
completed. On the CPU every operation has finished when its call returns, so each method does
nothing: the replicas' step code is the same on both, and the CPU tests run it.

A marker never recorded is complete: waiting on it returns at once (a CUDA event never recorded
has nothing to wait for), so the first step needs no special case.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StreamMarker"]


class StreamMarker:
    """A CUDA event on a CUDA device, nothing on the CPU."""

    __slots__ = ("_event",)

    def __init__(self, device: torch.device) -> None:
        self._event: Any = torch.cuda.Event() if device.type == "cuda" else None

    @property
    def on_device(self) -> bool:
        """Whether this marker orders CUDA work (False on the CPU: it does nothing)."""
        return self._event is not None

    def record(self, stream: Any) -> None:
        """Mark the end of the work queued on ``stream`` so far."""
        if self._event is not None:
            self._event.record(stream)

    def wait(self, stream: Any) -> None:
        """Make the work queued on ``stream`` from now on start after the marked work (a device
        side wait: the host goes on)."""
        if self._event is not None:
            stream.wait_event(self._event)

    def synchronize(self) -> None:
        """Block the host until the marked work has completed (only where the host reads or
        overwrites bytes that work touches)."""
        if self._event is not None:
            self._event.synchronize()
