"""How a gradient bucket on a device reaches its all-reduce and comes back: events, no sync.

`DeviceStaging` serves the gradient-comm actor (`paramsync.actors.graph.gradcomm`) for the
buckets whose gradients live on a device (`paramsync.runtime.transport.device_ops.DeviceOps`
says which). Each such bucket has a flat buffer on its device, the gradients views of it (so
backward fills it in place), and either:

- is reduced where it lies, when the transport runs the bucket's collective natively on the
  device (NCCL through `paramsync.runtime.transport.torch_plane`) and its reducer keeps no host
  state: the current stream waits on the bucket's ready event and the collective is ordered
  after it; no gradient byte goes through the host; or
- is staged through a pinned host buffer of its own (gloo, shared memory, TCP, in-process): a
  side stream waits on the ready event, copies the bucket to the host (``non_blocking``) and
  records the copy's event; the host reads the buffer only once that event has completed
  (`host_ready`), reduces it, and the averaged bytes go back on the side stream, the current
  stream waiting on that copy's event before anything (the optimizer) reads the gradients.

The ready event (C-STREAMSYNC-001: a bucket's gradients are complete before its collective or
copy reads them) is recorded on the stream backward ran on, by the autograd hook that saw the
bucket's last gradient (`DeviceStaging.gradients_done`), or else when the bucket is announced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from paramsync.runtime.transport.device_ops import DeviceOps, host_ready

__all__ = ["DeviceStaging", "GRADIENTS"]

GRADIENTS = "gradients"
"""The purpose the gradient buckets' copies are made for (`DeviceOps.copy_to_host`)."""


class DeviceStaging:
    """The device side of a gradient-comm actor's buckets (see the module's docstring).

    ``devices[i]``: the device bucket ``i``'s gradients live on, None for a host bucket (which
    this class leaves alone)."""

    def __init__(self, ops: DeviceOps, devices: Sequence[torch.device | None]) -> None:
        self.ops = ops
        self.devices = list(devices)
        self._hosts: list[torch.Tensor | None] = [None] * len(self.devices)
        """Per bucket: its pinned host buffer while it is staged (None: reduced where it lies)."""
        self._ready: list[Any] = [None] * len(self.devices)
        """Per bucket: the event recorded after its last gradient this step (None: not yet)."""
        self._copied: list[Any] = [None] * len(self.devices)
        """Per bucket: the event of its copy to the host not yet waited for."""
        self._sides: dict[torch.device, Any] = {}

    def on_device(self, index: int) -> bool:
        """Whether bucket ``index``'s gradients live on a device."""
        return self.devices[index] is not None

    def staged(self, index: int) -> bool:
        """Whether bucket ``index`` goes through a host buffer for its all-reduce."""
        return self._hosts[index] is not None

    def place(self, index: int, flat: torch.Tensor, native: bool) -> None:
        """Reduce bucket ``index`` (device buffer ``flat``) where it lies when ``native``, else
        through a pinned host buffer of its size (kept from an earlier placement if any)."""
        if native:
            self._hosts[index] = None
        elif self._hosts[index] is None:
            self._hosts[index] = self.ops.pinned_empty(flat.numel(), flat.dtype)

    def clear(self) -> None:
        """Forget the ready events of a step that is not going on (a new step begins)."""
        self._ready = [None] * len(self.devices)

    def gradients_done(self, index: int) -> None:
        """Backward has enqueued bucket ``index``'s last gradient (called in its thread, where
        the current stream is the one backward runs on): record the bucket's ready event."""
        device = self.devices[index]
        if device is not None:
            self._ready[index] = self.ops.record_event(self.ops.current_stream(device))

    def send_out(
        self, index: int, flat: torch.Tensor, fill: Callable[[], None] | None = None
    ) -> None:
        """Order bucket ``index``'s reads after its gradients: ``fill`` (packing gradients that
        are not views of ``flat`` into it) runs after the ready event, then a staged bucket's
        copy to its host buffer is enqueued. ``fill`` runs on the stream that will read
        ``flat``; anything it needs from the current stream must be enqueued before this."""
        device = self.devices[index]
        assert device is not None
        ops = self.ops
        current = ops.current_stream(device)
        ready, self._ready[index] = self._ready[index], None
        events = [ready] if ready is not None else []
        if ready is None or fill is not None:
            # announced without a hook's event, or the current stream wrote the gradients (a
            # zero fill for an unused one) after the hook recorded it
            events.append(ops.record_event(current))
        host = self._hosts[index]
        stream = current if host is None else self._side(device)
        for event in events:
            if stream is not current or event is ready:
                ops.wait_event(stream, event)
        if fill is not None:
            with ops.use_stream(stream):
                fill()
        if host is not None:
            self._copied[index] = ops.copy_to_host(flat, host, stream, GRADIENTS)

    async def host_buffer(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s host buffer, once its copy to the host has completed."""
        host = self._hosts[index]
        assert host is not None
        copied, self._copied[index] = self._copied[index], None
        if copied is not None:
            await host_ready(self.ops, copied)
        return host

    def bring_back(self, index: int, flat: torch.Tensor) -> None:
        """Copy staged bucket ``index``'s host buffer (now averaged) into its device buffer
        ``flat``, the current stream ordered after the copy (the gradients are read there)."""
        device = self.devices[index]
        host = self._hosts[index]
        assert device is not None and host is not None
        ops = self.ops
        back = ops.copy_to_device(host, flat, self._side(device), GRADIENTS)
        ops.wait_event(ops.current_stream(device), back)

    def _side(self, device: torch.device) -> Any:
        """The side stream the copies of ``device``'s buckets run on (one per device)."""
        stream = self._sides.get(device)
        if stream is None:
            stream = self._sides[device] = self.ops.new_stream(device)
        return stream
