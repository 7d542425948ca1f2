"""Where the replicas' trainable gradients are averaged: on the host or on the devices.

The average is ``sum(weights[i] * gradient[i])`` over the replicas in device order
(`weighted_sum`), whichever side computes it. The side is decided once per coordinator
(`averaging_kind`):

- ``"device"`` (every replica on a CUDA device): `DeviceAverage`. The root replica (replica 0)
  averages on its own stream: its stream waits on every replica's ``ready`` marker (recorded
  after that replica's backward), the flat gradient buffers of replicas on other devices are
  copied onto the root's device (peer copies; a replica sharing the root's device is read in
  place), the weighted sum is written into one buffer on the root's device, and the ``reduced``
  marker is recorded after it. Each replica's stream waits on ``reduced`` before it copies that
  buffer into its own gradient buffer. Nothing crosses the host and the host waits for nothing:
  the ordering is all CUDA events.
- ``"host"`` (CPU replicas, or a mix of CPU and CUDA ones): `HostAverage`. Each replica's
  gradient is in a host buffer (on the CPU the gradient buffer itself; on CUDA a pinned copy);
  the host waits on each replica's ``ready`` marker (a no-op on the CPU) before it reads the
  copies, and on its ``loaded`` marker before it overwrites the average that replica's previous
  copy read. Each replica thread may sum one slice (`HostAverage.part`).

Either class can be asked for the kind it is not the default of (the coordinator's
``averaging`` argument): on CPU replicas ``"device"`` runs the same steps with markers that do
nothing, which is how the CPU tests exercise the device path's logic, and gives the same bits as
``"host"`` (the same element-wise arithmetic in the same order).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch

from paramsync.actors.multidevice.marker import StreamMarker

if TYPE_CHECKING:
    from paramsync.actors.multidevice.replica import Replica

__all__ = [
    "KINDS",
    "Average",
    "AveragingKind",
    "DeviceAverage",
    "HostAverage",
    "averaging_kind",
    "make_average",
    "slices",
    "weighted_sum",
]

AveragingKind = Literal["host", "device"]
KINDS: tuple[AveragingKind, ...] = ("host", "device")


def averaging_kind(devices: Sequence[torch.device]) -> AveragingKind:
    """``"device"`` when every replica is on a CUDA device, ``"host"`` otherwise."""
    return "device" if all(device.type == "cuda" for device in devices) else "host"


def weighted_sum(
    sources: Sequence[torch.Tensor],
    weights: Sequence[float],
    target: torch.Tensor,
    lo: int,
    hi: int,
) -> None:
    """``target[lo:hi] = sum(weights[i] * sources[i][lo:hi])``, summed in the sources' order."""
    out = target[lo:hi]
    torch.mul(sources[0][lo:hi], weights[0], out=out)
    for source, weight in zip(sources[1:], weights[1:]):
        out.add_(source[lo:hi], alpha=weight)


def slices(length: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous slices covering ``range(length)`` (some empty when length < parts)."""
    base, extra = divmod(length, parts)
    bounds = [0]
    for index in range(parts):
        bounds.append(bounds[-1] + base + (1 if index < extra else 0))
    return list(itertools.pairwise(bounds))


class HostAverage:
    """The average on the host: a (pinned, with CUDA replicas) host buffer that every replica
    copies its gradient from."""

    kind: AveragingKind = "host"

    def __init__(self, replicas: Sequence[Replica]) -> None:
        first = replicas[0]
        pinned = any(replica.device.type == "cuda" for replica in replicas)
        self._replicas = list(replicas)
        self._sources = [replica.host_grad for replica in replicas]
        self.averaged = torch.zeros(first.numel, dtype=first.dtype, pin_memory=pinned)
        self._slices = slices(first.numel, len(replicas))

    def _settle(self) -> None:
        for replica in self._replicas:
            # The host reads each replica's host copy of its gradient: that copy must be done.
            replica.ready.synchronize()
            # The host overwrites the average the replica's last load read: that load must be
            # done.
            replica.loaded.synchronize()

    def part(self, index: int, weights: Sequence[float]) -> None:
        """Slice ``index`` of the average (one per replica thread), summed in device order."""
        self._settle()
        weighted_sum(self._sources, weights, self.averaged, *self._slices[index])

    def whole(self, weights: Sequence[float]) -> None:
        """The whole average at once: element by element the same arithmetic as every `part`."""
        self._settle()
        weighted_sum(self._sources, weights, self.averaged, 0, len(self.averaged))

    def source(self) -> tuple[torch.Tensor, StreamMarker | None]:
        """What each replica loads its gradient from, and the marker to wait on first."""
        return self.averaged, None

    @property
    def host(self) -> torch.Tensor:
        """The host buffer `on_host` returns."""
        return self.averaged

    def on_host(self) -> torch.Tensor:
        """The average in a host buffer (this one's own)."""
        return self.averaged


class DeviceAverage:
    """The average on the root replica's device, ordered by CUDA events (see the module)."""

    kind: AveragingKind = "device"

    def __init__(self, replicas: Sequence[Replica]) -> None:
        self._replicas = list(replicas)
        self._root = root = self._replicas[0]
        self.averaged = torch.zeros(root.numel, dtype=root.dtype, device=root.device)
        # Each replica's gradient as the root's device sees it: read in place on the root's
        # device, else a buffer there that the gradient is copied into.
        self._inputs = [
            replica.grad if replica.device == root.device else torch.empty_like(self.averaged)
            for replica in self._replicas
        ]
        self.reduced = StreamMarker(root.device)
        self._host_marker = StreamMarker(root.device)
        pinned = root.device.type == "cuda"
        self._host = torch.zeros(root.numel, dtype=root.dtype, pin_memory=pinned)

    def part(self, index: int, weights: Sequence[float]) -> None:
        """The root's thread (``index`` 0) computes the whole average; the others have no part
        (a few kernel launches: nothing worth sharing)."""
        if index == 0:
            self.whole(weights)

    def whole(self, weights: Sequence[float]) -> None:
        """Queue the average on the root's stream, after every replica's backward and after
        every replica's copy of the previous average; record ``reduced`` after it."""
        root = self._root
        with root.on_stream():
            stream = root.stream
            for replica in self._replicas:
                replica.ready.wait(stream)  # its backward's last gradient is in its buffer
                replica.loaded.wait(stream)  # it has copied the previous average out
            for replica, buffer in zip(self._replicas, self._inputs):
                if buffer is not replica.grad:
                    buffer.copy_(replica.grad, non_blocking=True)  # a peer copy
            weighted_sum(self._inputs, weights, self.averaged, 0, len(self.averaged))
            self.reduced.record(stream)

    def source(self) -> tuple[torch.Tensor, StreamMarker | None]:
        """The buffer on the root's device, and ``reduced`` to wait on before reading it."""
        return self.averaged, self.reduced

    @property
    def host(self) -> torch.Tensor:
        """The host buffer `on_host` copies the average into."""
        return self._host

    def on_host(self) -> torch.Tensor:
        """The average copied into a host buffer (this one's own), for a caller that must read
        it on the host (a multi-process trainer's all-reduce)."""
        root = self._root
        with root.on_stream():
            self._host.copy_(self.averaged, non_blocking=True)
            self._host_marker.record(root.stream)
        self._host_marker.synchronize()  # the caller reads these bytes on the host
        return self._host


Average = HostAverage | DeviceAverage


def make_average(kind: AveragingKind, replicas: Sequence[Replica]) -> Average:
    """The average of ``kind`` over ``replicas`` (whose gradient buffers it reads)."""
    if kind == "device":
        return DeviceAverage(replicas)
    if kind == "host":
        return HostAverage(replicas)
    raise ValueError(f"averaging must be one of {KINDS}, not {kind!r}")
