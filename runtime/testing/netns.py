"""Hosts for multi-host tests on one machine: Linux network namespaces joined by a bridge.

`virtual_hosts` creates ``count`` network namespaces, each with its own loopback and one veth
pair whose other end sits on a fresh bridge, so the namespaces reach each other at private
addresses (``10.x.y.1`` .. ``10.x.y.count`` of one /24, drawn at random) and nothing else: the
bridge has no address in the caller's namespace, the namespaces have no route out. Each link
can be shaped with ``tc``'s token bucket filter (``tbf rate R burst B latency L``, in both
directions: each namespace then has a full-duplex link of rate R to the bridge, as a machine's
NIC would be). Every name carries a random token, so parallel runs never collide, and
everything (namespaces, veths, bridge, and any process still inside a namespace) is removed
when the context ends, on failure too.

Processes run in a namespace through ``ip netns exec`` (`VirtualHost.command`): a namespace has
its own network stack but shares the kernel, the file system and ``/dev/shm`` with the rest,
which is what makes it a "host" for paramsync only by its network namespace
(`paramsync.runtime.transport.shm.host_identity`).

`unavailable_reason` says why this machine cannot do it (not root, no ``ip``, namespaces
refused); tests skip with that reason.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass

__all__ = ["Shaping", "VirtualHost", "unavailable_reason", "virtual_hosts"]

_IP_SECONDS = 20.0


@dataclass(frozen=True)
class Shaping:
    """A ``tc qdisc ... tbf`` shaping of each link: ``rate`` in bits per second, ``burst`` in
    bytes (default: 4 ms at the rate, at least 64 KiB, so a TSO segment fits), ``latency`` in
    milliseconds (how long a packet may queue before tbf drops it)."""

    rate_bits: int
    burst_bytes: int | None = None
    latency_ms: float = 20.0

    def __post_init__(self) -> None:
        if self.rate_bits < 1_000_000:
            raise ValueError(f"shaping rate must be at least 1 Mbit/s, got {self.rate_bits}")
        if self.burst_bytes is not None and self.burst_bytes < 2048:
            raise ValueError(f"tbf burst must hold a packet (>= 2048 bytes): {self.burst_bytes}")
        if not self.latency_ms > 0:
            raise ValueError(f"tbf latency must be positive, got {self.latency_ms} ms")

    @property
    def burst(self) -> int:
        if self.burst_bytes is not None:
            return self.burst_bytes
        return max(64 << 10, self.rate_bits // 8 * 4 // 1000)

    def tc_args(self, device: str) -> list[str]:
        """``tc`` arguments that put this shaping on ``device``'s egress."""
        return [
            "qdisc", "replace", "dev", device, "root", "tbf",
            "rate", f"{self.rate_bits}bit", "burst", str(self.burst),
            "latency", f"{self.latency_ms:g}ms",
        ]  # fmt: skip


@dataclass(frozen=True)
class VirtualHost:
    """One namespace: its name, its address on the bridge, the veth's two ends."""

    index: int
    namespace: str
    address: str
    outer_veth: str
    """The veth end on the bridge, in the creator's namespace."""
    inner_veth: str = "eth0"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this namespace (``ip netns exec``)."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def popen(self, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside this namespace; ``kwargs`` go to `subprocess.Popen`."""
        return subprocess.Popen(self.command(argv), **kwargs)  # type: ignore[call-overload]

    def pids(self) -> list[int]:
        """The processes running inside this namespace now."""
        result = subprocess.run(
            ["ip", "netns", "pids", self.namespace],
            capture_output=True,
            text=True,
            timeout=_IP_SECONDS,
        )
        return [int(word) for word in result.stdout.split() if word.isdigit()]


def _run(argv: list[str]) -> None:
    """Run an ``ip``/``tc`` command; a failure is a RuntimeError with its message."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=_IP_SECONDS)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")


def _quiet(argv: list[str]) -> None:
    with suppress(OSError, subprocess.SubprocessError):
        subprocess.run(argv, capture_output=True, timeout=_IP_SECONDS)


_REASON: list[str | None] = []


def unavailable_reason() -> str | None:
    """Why `virtual_hosts` cannot run here (None: it can). Tried once per process: creates and
    deletes a probe namespace and veth pair."""
    if _REASON:
        return _REASON[0]
    reason: str | None = None
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        reason = "network namespaces need root (ip netns add)"
    elif shutil.which("ip") is None:
        reason = "no ip(8) command (iproute2) on this machine"
    elif shutil.which("tc") is None:
        reason = "no tc(8) command (iproute2) on this machine"
    else:
        token = secrets.token_hex(3)
        namespace, veth = f"paramsync-probe-{token}", f"psq{token}"
        try:
            _run(["ip", "netns", "add", namespace])
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p"])
            _run(["ip", "link", "set", f"{veth}p", "netns", namespace])
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            reason = f"cannot create a network namespace with a veth pair here: {exc}"
        finally:
            _quiet(["ip", "link", "del", veth])
            _quiet(["ip", "netns", "del", namespace])
    _REASON.append(reason)
    return reason


@contextmanager
def virtual_hosts(count: int, *, shaping: Shaping | None = None) -> Iterator[list[VirtualHost]]:
    """``count`` network namespaces on one bridge, each at its own 10.x.y.z address, links
    shaped by ``shaping`` (None: the veth's own speed); all removed on exit, on failure too.

    Raises RuntimeError naming the command that failed (call `unavailable_reason` first)."""
    if not 1 <= count <= 200:
        raise ValueError(f"count must be in 1..200, got {count}")
    token = secrets.token_hex(3)
    subnet = f"10.{secrets.randbelow(64) + 160}.{secrets.randbelow(256)}"
    bridge = f"psb{token}"
    hosts = [
        VirtualHost(i, f"paramsync-{token}-{i}", f"{subnet}.{i + 1}", f"psv{token}{i}")
        for i in range(count)
    ]
    try:
        _run(["ip", "link", "add", bridge, "type", "bridge"])
        _run(["ip", "link", "set", bridge, "up"])
        for host in hosts:
            peer = f"psp{token}{host.index}"
            _run(["ip", "netns", "add", host.namespace])
            _run(["ip", "link", "add", host.outer_veth, "type", "veth", "peer", "name", peer])
            _run(["ip", "link", "set", peer, "netns", host.namespace])
            inside = ["ip", "netns", "exec", host.namespace]
            _run([*inside, "ip", "link", "set", peer, "name", host.inner_veth])
            _run([*inside, "ip", "addr", "add", f"{host.address}/24", "dev", host.inner_veth])
            _run([*inside, "ip", "link", "set", host.inner_veth, "up"])
            _run([*inside, "ip", "link", "set", "lo", "up"])
            _run(["ip", "link", "set", host.outer_veth, "master", bridge])
            _run(["ip", "link", "set", host.outer_veth, "up"])
            if shaping is not None:
                _run(["tc", *shaping.tc_args(host.outer_veth)])  # into the namespace
                _run([*inside, "tc", *shaping.tc_args(host.inner_veth)])  # out of it
        yield hosts
    finally:
        for host in hosts:
            with suppress(OSError, subprocess.SubprocessError, ValueError):
                for pid in host.pids():  # only processes inside this run's own namespaces
                    with suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            _quiet(["ip", "link", "del", host.outer_veth])
            _quiet(["ip", "netns", "del", host.namespace])
        _quiet(["ip", "link", "del", bridge])
