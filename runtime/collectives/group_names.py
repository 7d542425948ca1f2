"""`derive_group_name`: a process group's name from its parent's, its number and its ranks.

Pure (no transport, no torch), so that the coordinator, which checks the groups workers declare,
names them exactly as `paramsync.runtime.collectives.groups.new_group` does without importing the
data planes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["derive_group_name"]


def derive_group_name(base: str, index: int, ranks: Iterable[int]) -> str:
    """`group_name` without a transport: ``base`` is the parent's name ("world" for the
    world), ``index`` the group's number among the parent's groups in creation order."""
    ranks = sorted(ranks)
    digest = hashlib.sha256(f"{base}|{index}|{ranks}".encode()).hexdigest()[:16]
    return f"pg{index}-{len(ranks)}-{digest}"
