"""3D-parallel layouts: what each join says about its place in the run, whether the ranks agree,
and the shards whose data-parallel replicas the digest check compares.

A worker of a 3D-parallel run declares a `ParallelLayout` at its join: the mesh (dimension
names and sizes, e.g. pp x dp x tp), its own coordinates, and the digest of the whole pipeline
schedule. The coordinator holds the run to one layout:

- `join_layout_problem`, at each join: the mesh holds the world, and it is the mesh of the
  process groups the join declares, if it declares them as a mesh (a refusal of that join);
- `layout_disagreement`, once the first epoch's ranks are in: every rank declares a layout or
  none does, all declare the same mesh and the same schedule digest, no two claim the same
  coordinates, and each rank's coordinates are its rank's under the mesh's one ordering rule
  (row-major, the last named dimension fastest:
  `paramsync.runtime.collectives.mesh.mesh_coordinates`). Any of these stops the run, naming the
  ranks on each side and the field that differs. (No join comes after the start: a run with layouts
  is static, `CoordinatorCore` refuses an elastic one, and a restarted coordinator checks its joins
  as a first epoch again.)

A restarted coordinator resumes a 3D-parallel run (`sharded_resume_step`) only where every
shard's replicas hold one state at one step: states differ between shards by design, so the
donor rule of flat runs (`paramsync.runtime.coordinator.membership.resume_plan`), which hands one
rank's state to the others, does not apply, and no state moves between replicas yet.

`Shards` then maps each rank to its shard, the ranks whose coordinates agree on every dimension
but "dp" (`DATA_PARALLEL_DIM`): the digest check (`paramsync.runtime.coordinator.commits`) compares
a rank's state only with the other replicas of its shard. A run without layouts is one shard.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from paramsync.runtime.collectives.mesh_layout import mesh_coordinates
from paramsync.runtime.errors import plain_or_quoted
from paramsync.runtime.protocol.messages import DATA_PARALLEL_DIM, Joined, ParallelLayout

__all__ = [
    "AgreedLayout",
    "Shards",
    "join_layout_problem",
    "layout_disagreement",
    "sharded_resume_step",
    "describe_mesh",
    "describe_schedule",
    "ORDERING_RULE",
]

ORDERING_RULE = "row-major, the last named dimension fastest"
"""How ranks fill a mesh (`paramsync.runtime.collectives.mesh`), as errors name it."""

_MAX_LISTED = 4
"""The most ranks with wrong coordinates an error lists one by one."""

K = TypeVar("K", bound=Hashable)


def describe_mesh(names: Sequence[str], sizes: Sequence[int]) -> str:
    """``{dp: 2, tp: 2}``: a mesh as errors show it."""
    pairs = zip(names, sizes, strict=True)
    return "{" + ", ".join(f"{plain_or_quoted(name)}: {size}" for name, size in pairs) + "}"


def describe_schedule(digest: bytes) -> str:
    """A schedule digest as errors show it: its first 12 hex digits ("none" when empty)."""
    if not digest:
        return "none"
    text = digest.hex()
    return text if len(text) <= 12 else text[:12] + "..."


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 2`` or ``ranks 0, 1, 3``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(rank) for rank in ranks)


def _sides(
    values: Mapping[int, K], show: Callable[[K], str], verb: tuple[str, str] = ("declare", "s")
) -> str:
    """Who declares what: ``ranks 0, 1 declare X; rank 2 declares Y`` (the largest side first,
    then by lowest rank). ``verb``: the plural and the singular's ending."""
    sides: dict[K, list[int]] = {}
    for rank in sorted(values):
        sides.setdefault(values[rank], []).append(rank)
    ordered = sorted(sides.items(), key=lambda side: (-len(side[1]), side[1][0]))
    plural, ending = verb
    return "; ".join(
        f"{_ranks(ranks)} {plural}{ending if len(ranks) == 1 else ''} {show(value)}"
        for value, ranks in ordered
    )


def join_layout_problem(event: Joined, world_size: int) -> str | None:
    """Why ``event``'s layout cannot be taken on its own (None: it can, or it has none)."""
    layout = event.layout
    if layout is None:
        return None
    rank = event.rank
    mesh = describe_mesh(layout.names, layout.sizes)
    total = math.prod(layout.sizes)
    if total != world_size:
        return (
            f"rank {rank} declares a parallel layout on the mesh {mesh} holding {total} ranks, "
            f"but the world has {world_size}"
        )
    if event.mesh is not None and tuple(event.mesh) != (layout.names, layout.sizes):
        names, sizes = event.mesh
        return (
            f"rank {rank} declares its process groups on the mesh {describe_mesh(names, sizes)} "
            f"but its parallel layout on the mesh {mesh}"
        )
    return None


def _coordinates_text(names: Sequence[str], coordinates: Sequence[int]) -> str:
    pairs = zip(names, coordinates, strict=True)
    return "(" + ", ".join(f"{name}={value}" for name, value in pairs) + ")"


def layout_disagreement(joins: Mapping[int, Joined]) -> str | None:
    """Why the joined ranks cannot run together under their layouts (None: they can, or none
    declares one). Names the ranks on each side and the field that differs."""
    layouts = {rank: join.layout for rank, join in joins.items()}
    declared = {rank: layout for rank, layout in layouts.items() if layout is not None}
    if not declared:
        return None
    if len(declared) < len(layouts):
        sides = _sides(
            {rank: layout is not None for rank, layout in layouts.items()},
            lambda has: "a parallel layout" if has else "none",
        )
        return f"the ranks disagree on the parallel layout: {sides}"
    problems: list[str] = []
    meshes = {rank: (layout.names, layout.sizes) for rank, layout in declared.items()}
    if len(set(meshes.values())) > 1:
        sides = _sides(meshes, lambda mesh: f"the mesh {describe_mesh(*mesh)}")
        problems.append(f"the ranks disagree on the parallel layout's mesh: {sides}")
    schedules = {rank: layout.schedule_digest for rank, layout in declared.items()}
    if len(set(schedules.values())) > 1:
        sides = _sides(schedules, lambda digest: f"schedule digest {describe_schedule(digest)}")
        problems.append(f"the ranks disagree on the pipeline schedule: {sides}")
    if not problems:
        problems += _placement_problems(declared)
    return "; ".join(problems) if problems else None


def _placement_problems(layouts: Mapping[int, ParallelLayout]) -> list[str]:
    """Coordinates claimed twice, and coordinates that are not the rank's (one mesh)."""
    names, sizes = next(iter(layouts.values()))[:2]
    mesh = describe_mesh(names, sizes)
    claims: dict[tuple[int, ...], list[int]] = {}
    for rank in sorted(layouts):
        claims.setdefault(layouts[rank].coordinates, []).append(rank)
    problems = [
        f"{_ranks(ranks)} all claim the coordinates {_coordinates_text(names, coordinates)}"
        for coordinates, ranks in claims.items()
        if len(ranks) > 1
    ]
    misplaced = [
        (rank, layouts[rank].coordinates, mesh_coordinates(rank, sizes))
        for rank in sorted(layouts)
        if layouts[rank].coordinates != mesh_coordinates(rank, sizes)
    ]
    if misplaced:
        listed = [
            f"rank {rank} declares {_coordinates_text(names, claimed)} but its rank is at "
            f"{_coordinates_text(names, actual)}"
            for rank, claimed, actual in misplaced[:_MAX_LISTED]
        ]
        if len(misplaced) > _MAX_LISTED:
            listed.append(f"{len(misplaced) - _MAX_LISTED} more")
        problems.append(
            f"coordinates do not match the ranks on the mesh {mesh} ({ORDERING_RULE}): "
            + ", ".join(listed)
        )
    return problems


@dataclass(frozen=True)
class AgreedLayout:
    """The layout every rank of the run declared: its mesh and schedule digest."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    schedule_digest: bytes

    @classmethod
    def of(cls, joins: Mapping[int, Joined]) -> AgreedLayout | None:
        """The layout of ``joins``, which `layout_disagreement` accepted (None: no layouts)."""
        layouts = [join.layout for join in joins.values()]
        if not layouts or layouts[0] is None:
            return None
        first = layouts[0]
        return cls(first.names, first.sizes, first.schedule_digest)


class Shards:
    """Which shard each rank of a layout holds: ranks with the same coordinates on every
    dimension but "dp" hold the same shard (its data-parallel replicas). Built once per run
    (O(world)); `of` is O(1)."""

    def __init__(self, names: Sequence[str], sizes: Sequence[int]) -> None:
        self.names = tuple(names)
        self.sizes = tuple(sizes)
        axis = self.names.index(DATA_PARALLEL_DIM) if DATA_PARALLEL_DIM in self.names else None
        self._shard: list[int] = []
        self._labels: dict[int, str] = {}
        stride = math.prod(self.sizes[axis + 1 :]) if axis is not None else 0
        for rank in range(math.prod(self.sizes)):
            coordinates = mesh_coordinates(rank, self.sizes)
            # The shard's id: the rank of its replica at dp=0.
            shard = rank - coordinates[axis] * stride if axis is not None else rank
            self._shard.append(shard)
            if shard == rank:
                others = [i for i in range(len(self.names)) if i != axis]
                names = [self.names[i] for i in others]
                values = [coordinates[i] for i in others]
                self._labels[shard] = (
                    _coordinates_text(names, values) if others else "(the whole model)"
                )

    @classmethod
    def of_layout(cls, layout: AgreedLayout | None) -> Shards | None:
        return None if layout is None else cls(layout.names, layout.sizes)

    def of(self, rank: int) -> int:
        """Rank ``rank``'s shard (the rank of the shard's dp=0 replica)."""
        return self._shard[rank]

    def label(self, shard: int) -> str:
        """``(tp=1, pp=0)``: a shard as errors name it ("(the whole model)" for a mesh of "dp"
        alone)."""
        return self._labels[shard]


def _state_text(state: tuple[int, bytes]) -> str:
    step, digest = state
    return f"step {step} (digest {describe_schedule(digest)})"


def sharded_resume_step(joins: Mapping[int, Joined], shards: Shards) -> int | str | None:
    """Where the restarted workers of a 3D-parallel run resume: None for a fresh run (every
    join at step 0), the step when every shard's replicas report one state (step, digest) and
    every shard the same step; else why the run cannot resume, naming the shards and ranks."""
    states = {rank: (join.step, join.digest) for rank, join in joins.items()}
    if all(step == 0 for step, _ in states.values()):
        return None
    by_shard: dict[int, dict[int, tuple[int, bytes]]] = {}
    for rank, state in states.items():
        by_shard.setdefault(shards.of(rank), {})[rank] = state
    problems = [
        f"shard {shards.label(shard)}: {_sides(replicas, _state_text, ('hold', 's'))}"
        for shard, replicas in sorted(by_shard.items())
        if len(set(replicas.values())) > 1
    ]
    if not problems:
        steps = {rank: step for rank, (step, _) in states.items()}
        if len(set(steps.values())) == 1:
            return next(iter(steps.values()))
        problems.append(
            "the shards stand at different steps: "
            + _sides(steps, lambda step: f"step {step}", ("hold", "s"))
        )
    return (
        "a 3D-parallel run resumes only where every replica of a shard holds the same state at "
        "one step (no state moves between replicas): " + "; ".join(problems)
    )
