"""A CPU stand-in for a device (`RecordingDeviceOps`): runs the device paths' logic in tests.

`RecordingDeviceOps` is a `paramsync.runtime.transport.device_ops.DeviceOps` that treats every
tensor it is asked about as a device tensor, so code branching on ``on_device`` takes its device
path with CPU tensors: streams and events are named records, copies are done at once, and each
call is appended to `RecordingDeviceOps.calls` with its bytes and purpose (from every thread,
in the order made). A test passes it to a trainer (``device_ops_in_context``) and reads the
calls back: which bytes went to the host and why, which events ordered which copies, whether
anything synchronized the device.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["DeviceCall", "RecordedEvent", "RecordedStream", "RecordingDeviceOps"]


@dataclass(frozen=True)
class RecordedStream:
    """A stream of the stand-in device: ``"compute"`` (every thread's current stream) or a
    side stream ``"side-N"``."""

    name: str


@dataclass(frozen=True)
class RecordedEvent:
    """An event recorded on ``stream``; ``number`` counts the double's events from 1."""

    number: int
    stream: str


@dataclass(frozen=True)
class DeviceCall:
    """One call made to the double: ``op`` (the `DeviceOps` method's name), the stream it
    concerns, the event it records or uses, and for a copy its bytes, purpose and the address
    of its host tensor (``data_ptr``: which host buffer it fills or reads)."""

    op: str
    stream: str | None = None
    event: int | None = None
    nbytes: int = 0
    purpose: str = ""
    address: int = 0


class RecordingDeviceOps:
    """`DeviceOps` over CPU tensors that records every call (see the module's docstring)."""

    def __init__(self) -> None:
        self.calls: list[DeviceCall] = []
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self._sides = itertools.count(1)
        self._compute = RecordedStream("compute")

    def note(self, call: DeviceCall) -> None:
        """Append ``call`` to the record: the double's own calls, and a test's marks of what
        the host does between them (where it reads a buffer)."""
        with self._lock:
            self.calls.append(call)

    def ops(self, *names: str) -> list[DeviceCall]:
        """The calls made so far whose ``op`` is one of ``names``, in order."""
        with self._lock:
            return [call for call in self.calls if call.op in names]

    def clear(self) -> None:
        """Forget the calls made so far."""
        with self._lock:
            self.calls.clear()

    def on_device(self, tensor: torch.Tensor) -> bool:
        return True

    def current_stream(self, device: torch.device) -> RecordedStream:
        return self._compute

    def new_stream(self, device: torch.device) -> RecordedStream:
        stream = RecordedStream(f"side-{next(self._sides)}")
        self.note(DeviceCall("new_stream", stream.name))
        return stream

    @contextmanager
    def use_stream(self, stream: RecordedStream) -> Iterator[None]:
        self.note(DeviceCall("use_stream", stream.name))
        yield

    def record_event(self, stream: RecordedStream) -> RecordedEvent:
        event = RecordedEvent(next(self._numbers), stream.name)
        self.note(DeviceCall("record_event", stream.name, event.number))
        return event

    def wait_event(self, stream: RecordedStream, event: RecordedEvent) -> None:
        self.note(DeviceCall("wait_event", stream.name, event.number))

    def query(self, event: RecordedEvent) -> bool:
        self.note(DeviceCall("query", event.stream, event.number))
        return True  # the CPU did each copy when it was asked

    def wait_host(self, event: RecordedEvent) -> None:
        self.note(DeviceCall("wait_host", event.stream, event.number))

    def synchronize(self, device: torch.device) -> None:
        self.note(DeviceCall("synchronize"))

    def pinned_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(numel, dtype=dtype)
        self.note(DeviceCall("pinned_empty", nbytes=numel * buffer.element_size()))
        return buffer

    def copy_to_host(
        self, src: torch.Tensor, dst: torch.Tensor, stream: RecordedStream, purpose: str
    ) -> RecordedEvent:
        return self._copy("copy_to_host", src, dst, stream, purpose)

    def copy_to_device(
        self, src: torch.Tensor, dst: torch.Tensor, stream: RecordedStream, purpose: str
    ) -> RecordedEvent:
        return self._copy("copy_to_device", src, dst, stream, purpose)

    def _copy(
        self, op: str, src: torch.Tensor, dst: torch.Tensor, stream: RecordedStream, purpose: str
    ) -> RecordedEvent:
        if src.numel() != dst.numel() or src.dtype != dst.dtype:
            raise ValueError(
                f"{op}: {src.numel()} {src.dtype} into {dst.numel()} {dst.dtype} ({purpose})"
            )
        dst.copy_(src.reshape(dst.shape))
        event = RecordedEvent(next(self._numbers), stream.name)
        nbytes = src.numel() * src.element_size()
        host = dst if op == "copy_to_host" else src
        self.note(DeviceCall(op, stream.name, event.number, nbytes, purpose, host.data_ptr()))
        return event
