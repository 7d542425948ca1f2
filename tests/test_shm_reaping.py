"""A shared-memory segment whose creator died before unlinking it is reaped (review row 12).

Rank 0 creates ``/dev/shm/paramsync-...`` and unlinks it once every rank has mapped it; if rank
0 dies in between, the file stayed until reboot. Segment names now carry the creator's pid
(``paramsync-<pid>-<32 hex>``), and the next segment creation removes this user's segments whose
creator is gone, never one whose creator is alive (a live run's).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from paramsync.runtime.transport import shm

pytestmark = pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="no /dev/shm")


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def plant(pid: int) -> Path:
    path = Path(shm.SHM_DIR) / f"paramsync-{pid}-{secrets.token_hex(16)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    return path


def test_a_dead_creators_segment_is_reaped_and_a_live_ones_kept() -> None:
    dead = plant(dead_pid())
    live = plant(os.getpid())
    created = None
    try:
        created, fd = shm._create_segment(4096)
        os.close(fd)
        assert not dead.exists(), "the dead creator's segment leaked"
        assert live.exists(), "a live creator's segment was removed"
        assert os.path.basename(created).startswith(f"paramsync-{os.getpid()}-")
        assert shm._NAME.fullmatch(os.path.basename(created))
    finally:
        for path in (dead, live, Path(created) if created else None):
            if path is not None and path.exists():
                path.unlink()
