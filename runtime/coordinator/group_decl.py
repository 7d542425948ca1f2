"""Process-group declarations: what a worker's join says about the groups it will use.

A join may declare its groups as a device mesh (``mesh: [names, sizes]``) or as an explicit
list of named rank sets (``groups: [[name, ranks], ...]``). Either becomes a
:data:`Declaration`: every group of the world, in creation order, as ``(name, ranks)``.

The naming rule (shared with `paramsync.runtime.collectives.groups.group_name`): a mesh's groups are
created as `paramsync.runtime.collectives.mesh.init_device_mesh` creates them on a fresh world (for
every dimension in ``names`` order, every group in `mesh_groups` order), and the ``i``-th one is
named ``derive_group_name("world", i, ranks)``, exactly what `new_group` names it. Explicit groups
keep the names their declaration gives.

`declaration_of` checks a join's declaration against the world; `declaration_mismatch` names
the first group on which two declarations differ.
"""

from __future__ import annotations

import math

from paramsync.runtime.collectives.group_names import derive_group_name
from paramsync.runtime.collectives.mesh_layout import mesh_groups
from paramsync.runtime.errors import CollectiveError, plain_or_quoted, quoted
from paramsync.runtime.protocol.messages import GroupRanks, Joined

__all__ = ["Declaration", "declaration_of", "declaration_mismatch", "describe", "rank_groups"]

Declaration = tuple[GroupRanks, ...]
"""Every declared group of the world in creation order: (name, sorted ranks); () for none."""


def declaration_of(event: Joined, world_size: int) -> Declaration | str:
    """The groups ``event`` declares, or why its declaration is invalid."""
    rank = event.rank
    if event.mesh is not None and event.groups is not None:
        return f"rank {rank} declares its groups both as a mesh and as a list"
    if event.mesh is not None:
        names, sizes = event.mesh
        total = math.prod(sizes)
        if total != world_size:
            return (
                f"rank {rank} declares a mesh of {dict(zip(names, sizes, strict=False))} "
                f"holding {total} ranks, but the world has {world_size}"
            )
        groups: list[GroupRanks] = []
        try:
            for dim in names:
                for members in mesh_groups(sizes, names, dim):
                    name = derive_group_name("world", len(groups), members)
                    groups.append((name, tuple(members)))
        except CollectiveError as exc:
            return f"rank {rank} declares an invalid mesh: {exc}"
        return tuple(groups)
    seen: set[str] = set()
    out: list[GroupRanks] = []
    for name, ranks in event.groups or ():
        if name in seen:
            return f"rank {rank} declares group {quoted(name)} twice"
        seen.add(name)
        if not ranks:
            return f"rank {rank} declares group {quoted(name)} with no ranks"
        outside = sorted(r for r in ranks if not 0 <= r < world_size)
        if outside:
            return (
                f"rank {rank} declares group {quoted(name)} with ranks {outside} outside the world "
                f"of {world_size}"
            )
        if len(set(ranks)) != len(ranks):
            return f"rank {rank} declares group {quoted(name)} listing a rank twice: {list(ranks)}"
        out.append((name, tuple(sorted(ranks))))
    return tuple(out)


def describe(declaration: Declaration) -> str:
    """A declaration as errors show it: "{name: [ranks], ...}" or "no groups"."""
    if not declaration:
        return "no groups"
    return (
        "{"
        + ", ".join(f"{plain_or_quoted(name)}: {list(ranks)}" for name, ranks in declaration)
        + "}"
    )


def declaration_mismatch(mine: Declaration, reference: Declaration) -> str | None:
    """Where ``mine`` differs from ``reference``: the first group that differs (None: same)."""
    if mine == reference:
        return None
    theirs = dict(reference)
    for name, ranks in mine:
        if name not in theirs:
            return f"group {quoted(name)} (ranks {list(ranks)}) is not in the reference declaration"
        if theirs[name] != ranks:
            return f"group {quoted(name)} has ranks {list(ranks)}, not {list(theirs[name])}"
    ours = dict(mine)
    for name, ranks in reference:
        if name not in ours:
            return f"group {quoted(name)} (ranks {list(ranks)}) is missing"
    return "the groups are declared in another order"


def rank_groups(declaration: Declaration, rank: int) -> Declaration:
    """The groups of ``declaration`` that hold ``rank``, in declaration order."""
    return tuple((name, ranks) for name, ranks in declaration if rank in ranks)
