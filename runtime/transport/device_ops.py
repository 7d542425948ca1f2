"""The device operations of the training hot path, behind one interface (`DeviceOps`).

Every stream, event, pinned host buffer and copy between a device and the host that the
gradient path makes (`paramsync.actors.graph.gradcomm`, the buffer synchronization, the state
capture, the torch data plane's NCCL wait) goes through a `DeviceOps`. Code asks it whether a
tensor lives on the device (`DeviceOps.on_device`) and branches on that answer, never on the
tensor's device type itself, so a CPU stand-in (`paramsync.runtime.testing.device_double`) runs
the device paths' logic in every test run and records each call with its bytes and purpose.

Ordering is by events, never by a host synchronize: the side that reads a tensor waits on an
event recorded on the stream that produced it (`DeviceOps.wait_event`, a stream wait, no host
block), and the host touches bytes copied to it only after the copy's event has completed
(`host_ready`: an event query, then a wait on that event alone in a thread).

`CudaDeviceOps` is the implementation on NVIDIA GPUs (tensors on a CUDA device). A trainer uses
the `DeviceOps` it is given, else the one `device_ops_in_context` set around the code that
builds it (a context variable: it holds for the tasks and threads started inside the block),
else `CudaDeviceOps`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

import torch
import trio

__all__ = [
    "CudaDeviceOps",
    "DeviceOps",
    "context_device_ops",
    "device_ops_in_context",
    "host_ready",
]


class DeviceOps(Protocol):
    """The device operations the hot path makes. Streams and events are the implementation's
    own objects: code passes them back to the same `DeviceOps` and never looks inside."""

    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on the device (its reads and writes are ordered by streams
        and events, and the host sees its bytes only through a copy)."""
        ...

    def current_stream(self, device: torch.device) -> Any:
        """The stream the calling thread's kernels on ``device`` are enqueued on."""
        ...

    def new_stream(self, device: torch.device) -> Any:
        """A stream of its own on ``device`` (copies that overlap the compute)."""
        ...

    def use_stream(self, stream: Any) -> AbstractContextManager[None]:
        """Within the block, the calling thread's kernels go to ``stream``."""
        ...

    def record_event(self, stream: Any) -> Any:
        """An event that completes once everything enqueued on ``stream`` so far has run."""
        ...

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` run what is enqueued on it later only after ``event`` (a stream
        wait: the host does not block)."""
        ...

    def query(self, event: Any) -> bool:
        """Whether ``event`` has completed (never blocks)."""
        ...

    def wait_host(self, event: Any) -> None:
        """Block the calling thread until ``event`` alone has completed (not the device)."""
        ...

    def synchronize(self, device: torch.device) -> None:
        """Block the calling thread until all of ``device``'s work has run: what the hot path
        never calls."""
        ...

    def pinned_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat host buffer that device copies can fill and read asynchronously."""
        ...

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor, stream: Any, purpose: str) -> Any:
        """Enqueue a copy of device tensor ``src`` into host tensor ``dst`` (same numel and
        dtype) on ``stream``; return the event that completes when ``dst`` holds the bytes.
        ``purpose`` names what the bytes are ("gradients", "buffers", "state")."""
        ...

    def copy_to_device(
        self, src: torch.Tensor, dst: torch.Tensor, stream: Any, purpose: str
    ) -> Any:
        """Enqueue a copy of host tensor ``src`` into device tensor ``dst`` on ``stream``;
        return the event that completes when ``dst`` holds the bytes (``src`` must not change
        before then)."""
        ...


async def host_ready(ops: DeviceOps, event: Any) -> None:
    """Return once ``event`` has completed: at once when a query says so, else after waiting
    for that event in a thread (the event loop keeps running meanwhile)."""
    if not ops.query(event):
        await trio.to_thread.run_sync(ops.wait_host, event)


class CudaDeviceOps:
    """`DeviceOps` on NVIDIA GPUs: a tensor on a CUDA device is on the device; copies to and
    from the host go through pinned buffers, ``non_blocking``, each followed by an event."""

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def use_stream(self, stream: Any) -> AbstractContextManager[None]:
        return torch.cuda.stream(stream)

    def record_event(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def wait_host(self, event: Any) -> None:
        event.synchronize()

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def pinned_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor, stream: Any, purpose: str) -> Any:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            return self.record_event(stream)

    def copy_to_device(
        self, src: torch.Tensor, dst: torch.Tensor, stream: Any, purpose: str
    ) -> Any:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            return self.record_event(stream)


_CUDA = CudaDeviceOps()
_CONTEXT_OPS: ContextVar[DeviceOps | None] = ContextVar("paramsync_device_ops", default=None)


def context_device_ops() -> DeviceOps:
    """The `DeviceOps` a trainer given none uses here: the innermost `device_ops_in_context`'s,
    else `CudaDeviceOps`."""
    return _CONTEXT_OPS.get() or _CUDA


@contextmanager
def device_ops_in_context(ops: DeviceOps) -> Iterator[DeviceOps]:
    """Within the block (and the tasks and threads started inside it), trainers given no
    device operations use ``ops``; the previous ones hold again after."""
    token = _CONTEXT_OPS.set(ops)
    try:
        yield ops
    finally:
        _CONTEXT_OPS.reset(token)
