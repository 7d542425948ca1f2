"""What a hostile-input harness reads of a target process on this host (Linux ``/proc``).

Its resident memory (`process_memory`, `reset_memory_peak`), its open descriptors
(`process_descriptors`), and which process listens at a loopback address (`listening_pid`), so a
harness given only ``HOST:PORT`` can watch the daemon behind it. Every reader returns None
where ``/proc`` cannot tell (another host, another user's process, not Linux).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from pathlib import Path

__all__ = [
    "PROBE_SOURCE",
    "listening_pid",
    "process_descriptors",
    "process_memory",
    "reset_memory_peak",
]

PROBE_SOURCE = "127.0.0.250"
"""The loopback address a legitimate probe dials a loopback target from: no attack uses it, so
the target's cap per source never refuses the probe for what the attackers hold."""


def process_memory(pid: int, field: str = "VmRSS") -> int | None:
    """The process's memory in bytes: ``VmRSS`` now, ``VmHWM`` its high-water mark."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(rf"{field}:\s+(\d+) kB", status)
    return int(match.group(1)) * 1024 if match else None


def reset_memory_peak(pid: int) -> None:
    """Restart the process's ``VmHWM`` from its current RSS (Linux ``clear_refs``; a no-op
    where that is not allowed)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass


def process_descriptors(pid: int) -> int | None:
    """How many file descriptors the process holds open."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def listening_sockets() -> list[tuple[int, str]]:
    """Every listening TCP socket of this network namespace, as (port, socket inode)."""
    found: list[tuple[int, str]] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) >= 10 and fields[3] == "0A":  # 0A: LISTEN
                found.append((int(fields[1].rsplit(":", 1)[1], 16), fields[9]))
    return found


def _listening_inodes(port: int) -> set[str]:
    return {inode for listening, inode in listening_sockets() if listening == port}


def listening_pid(host: str, port: int) -> int | None:
    """The process listening at ``host:port``, when ``host`` is this machine's loopback and
    ``/proc`` shows that process's sockets to this user; else None."""
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return None
    if not loopback:
        return None
    inodes = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not inodes:
        return None
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                if os.readlink(fd.path) in inodes:
                    return int(entry.name)
        except OSError:
            continue
    return None
