"""How a 3D-parallel run is laid out (seed 004's `ParallelismConfig`): data x tensor x pipeline
parallel degrees, micro-batches, the pipeline schedule, gradient accumulation, ZeRO-1 and
activation checkpointing.

`ParallelismConfig` is frozen and validated on construction: every bad value is a `ConfigError`
(a ``ValueError``) naming the field, and, when it came from a file, variable or flag, that source.
It comes from a ``[parallelism]`` table in a TOML file, from ``PARAMSYNC_*`` environment variables
(`ENV_VARS`) or from command-line flags (`add_arguments`), and `ParallelismConfig.resolve` layers
them through `paramsync.runtime.config.layering.Layering`, as
`paramsync.runtime.train_config.DistributedTrainConfig` does: flags > environment > TOML > defaults.
``data_plane`` is `paramsync.runtime.config.DataPlane`, with its one variable
(``PARAMSYNC_DATA_PLANE``) and its one flag (``--data-plane``), which the worker's command line
shares. ``tp_size`` is an alias of ``mp_size`` (the seed's name for tensor parallelism) in the
constructor, the TOML table, the flags (``--tp-size``/``--mp-size``) and the environment
(``PARAMSYNC_TP_SIZE``/``PARAMSYNC_MP_SIZE``).

The world size is not a field: it is checked where it is known, with `check_world` (or
``resolve(world_size=...)``), because it already has a source of truth (torchrun's WORLD_SIZE in
`DistributedTrainConfig`) and a second copy here could only disagree with it. The layer count is
checked the same way, by `check_layers`, once the model is known.

The ranks form a device mesh in Megatron's order, tensor parallel fastest: `mesh_names` is
``("pp", "dp", "tp")`` and `mesh_shape` the matching sizes, ready for
``paramsync.runtime.collectives.mesh.init_device_mesh(world, config.mesh_names(),
config.mesh_shape())``.
"""

from __future__ import annotations

import argparse
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from paramsync.runtime.config import (
    DATA_PLANE_ENV,
    RENAMED_DATA_PLANE_ENV,
    DataPlane,
    Layering,
    add_data_plane_flag,
    parse_bool,
    parse_enum,
    parse_int,
)
from paramsync.runtime.errors import ConfigError
from paramsync.runtime.parallel.schedules import check_schedule_parameters

__all__ = [
    "DataPlane",
    "PipelineSchedule",
    "MemoryOptimization",
    "ParallelismConfig",
    "DEFAULT_INTERLEAVED_CHUNKS",
    "ENV_VARS",
    "FIELD_ALIASES",
    "TOML_TABLE",
    "MESH_NAMES",
    "add_arguments",
    "overrides_from_args",
]

TOML_TABLE = "parallelism"
"""The TOML table `ParallelismConfig.from_toml` reads."""

MESH_NAMES = ("pp", "dp", "tp")
"""The mesh's dimensions, slowest first: tensor-parallel ranks are adjacent (Megatron's order)."""

FIELD_ALIASES = {"tp_size": "mp_size"}
"""Other names a field answers to, in every source."""

DEFAULT_INTERLEAVED_CHUNKS = 2
"""``virtual_chunks`` when ``pipeline_schedule`` is ``interleaved_1f1b`` and no source gives it
(Megatron's smallest interleaving)."""


class PipelineSchedule(enum.Enum):
    """The order in which pipeline stages run their micro-batches' forwards and backwards."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    ZERO_BUBBLE = "zero_bubble"


class MemoryOptimization(enum.Enum):
    """Memory optimisation of the optimizer state: none, or ZeRO stage 1 over the dp group."""

    NONE = "none"
    ZERO1 = "zero1"


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ConfigError(f"{name} must be at least 1, got {value}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be a bool, got {value!r}")
    return value


@dataclass(frozen=True)
class ParallelismConfig:
    """dp_size x mp_size x pp_size processes, and how they train; validated on construction.

    ``mp_size`` is the tensor-parallel degree; ``tp_size`` is its alias (pass either; both given
    and different is an error; after construction ``tp_size`` always equals ``mp_size``).
    ``num_micro_batches`` is m, the micro-batches of one step through the pipeline;
    ``virtual_chunks`` is v, the model chunks each pipeline rank holds (``interleaved_1f1b``
    only); left unsaid it is `DEFAULT_INTERLEAVED_CHUNKS` with ``interleaved_1f1b`` and 1 with
    every other schedule, so seed 004's config, which has no chunk field, is valid as written.
    ``accumulation_steps`` is how many steps' gradients accumulate before the optimizer steps,
    and must be 1 unless ``gradient_accumulation`` is on. Enum fields also take their values as
    strings (``"1f1b"``, ``"zero1"``).
    """

    dp_size: int = 1
    mp_size: int = 1
    pp_size: int = 1
    num_micro_batches: int = 1
    gradient_accumulation: bool = False
    accumulation_steps: int = 1
    activation_checkpointing: bool = False
    data_plane: DataPlane = DataPlane.PARAMSYNC
    pipeline_schedule: PipelineSchedule = PipelineSchedule.GPIPE
    virtual_chunks: int = None  # type: ignore[assignment]  # None: the schedule's default
    memory_optimization: MemoryOptimization = MemoryOptimization.NONE
    tp_size: int | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_positive("dp_size", self.dp_size)
        mp = _check_positive("mp_size", self.mp_size)
        if self.tp_size is not None:
            tp = _check_positive("tp_size", self.tp_size)
            if mp != 1 and mp != tp:
                raise ConfigError(
                    f"mp_size={mp} and its alias tp_size={tp} disagree: give the tensor-parallel "
                    "degree once"
                )
            mp = tp
            object.__setattr__(self, "mp_size", mp)
        object.__setattr__(self, "tp_size", mp)
        pp = _check_positive("pp_size", self.pp_size)
        m = _check_positive("num_micro_batches", self.num_micro_batches)
        accumulate = _check_bool("gradient_accumulation", self.gradient_accumulation)
        steps = _check_positive("accumulation_steps", self.accumulation_steps)
        if steps != 1 and not accumulate:
            raise ConfigError(
                f"accumulation_steps={steps} needs gradient_accumulation on (it is off): "
                "turn it on, or leave accumulation_steps at 1"
            )
        _check_bool("activation_checkpointing", self.activation_checkpointing)
        object.__setattr__(self, "data_plane", parse_enum(DataPlane, self.data_plane, "data_plane"))
        schedule = parse_enum(PipelineSchedule, self.pipeline_schedule, "pipeline_schedule")
        object.__setattr__(self, "pipeline_schedule", schedule)
        if self.virtual_chunks is None:
            interleaved = schedule is PipelineSchedule.INTERLEAVED_1F1B
            object.__setattr__(
                self, "virtual_chunks", DEFAULT_INTERLEAVED_CHUNKS if interleaved else 1
            )
        v = _check_positive("virtual_chunks", self.virtual_chunks)
        object.__setattr__(
            self,
            "memory_optimization",
            parse_enum(MemoryOptimization, self.memory_optimization, "memory_optimization"),
        )
        _check_schedule(schedule, pp, m, v)

    # ------------------------------------------------------------------ derived

    @property
    def world_size(self) -> int:
        """The processes this layout needs: dp_size * mp_size * pp_size."""
        return self.dp_size * self.mp_size * self.pp_size

    @property
    def num_stages(self) -> int:
        """Model stages (chunks) in the pipeline: pp_size * virtual_chunks."""
        return self.pp_size * self.virtual_chunks

    @property
    def zero1(self) -> bool:
        """Whether the optimizer state is partitioned over the dp group (ZeRO-1)."""
        return self.memory_optimization is MemoryOptimization.ZERO1

    def mesh_names(self) -> tuple[str, str, str]:
        """The mesh's dimension names, slowest first: ``("pp", "dp", "tp")``."""
        return MESH_NAMES

    def mesh_shape(self) -> tuple[int, int, int]:
        """The mesh's sizes in `mesh_names` order: ``(pp_size, dp_size, mp_size)``."""
        return (self.pp_size, self.dp_size, self.mp_size)

    def check_world(self, world_size: int) -> None:
        """Raise `ConfigError` unless dp_size * mp_size * pp_size equals ``world_size``."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
        if self.world_size != world_size:
            raise ConfigError(
                f"dp_size={self.dp_size} x mp_size={self.mp_size} x pp_size={self.pp_size} = "
                f"{self.world_size} processes, but world_size is {world_size}: the degrees must "
                "multiply to the world size"
            )

    def check_layers(self, num_layers: int) -> None:
        """Raise `ConfigError` unless the pipeline's pp_size * virtual_chunks stages split
        ``num_layers`` layers evenly (every stage the same number of layers, at least one)."""
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ConfigError(f"num_layers must be a positive int, got {num_layers!r}")
        if num_layers % self.num_stages:
            raise ConfigError(
                f"num_layers={num_layers} does not split into pp_size={self.pp_size} x "
                f"virtual_chunks={self.virtual_chunks} = {self.num_stages} equal stages"
                + (
                    f" (interleaved_1f1b holds {DEFAULT_INTERLEAVED_CHUNKS} chunks per rank "
                    "unless told: give virtual_chunks, --virtual-chunks or "
                    "PARAMSYNC_VIRTUAL_CHUNKS so that pp_size x virtual_chunks divides the "
                    "layers, or another schedule)"
                    if self.pipeline_schedule is PipelineSchedule.INTERLEAVED_1F1B
                    else ""
                )
            )

    # ------------------------------------------------------------------ sources

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ParallelismConfig:
        """Build from the ``PARAMSYNC_*`` variables of `ENV_VARS`; unset ones take defaults."""
        return cls(**_LAYERING.from_env(os.environ if environ is None else environ))

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> ParallelismConfig:
        """Build from the ``[parallelism]`` table of a TOML file (missing: all defaults).

        Other tables are left to other readers; unknown keys in ``[parallelism]`` are errors.
        """
        return cls(**_LAYERING.from_toml(path))

    @classmethod
    def resolve(
        cls,
        toml_path: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
        overrides: Mapping[str, object] | None = None,
        *,
        world_size: int | None = None,
    ) -> ParallelismConfig:
        """Layer the sources: ``overrides`` (flags) > environment > TOML file > defaults.

        ``environ`` defaults to ``os.environ``; pass ``{}`` to ignore it. ``None`` values in
        ``overrides`` mean "not given" (argparse's default) and do not mask lower layers.
        A field given by its alias in one layer and its name in another is one field: the
        higher layer wins. With ``world_size`` the result is checked against it (`check_world`).
        """
        config = cls(**_LAYERING.resolve(toml_path, environ, overrides))
        if world_size is not None:
            config.check_world(world_size)
        return config


def _check_schedule(schedule: PipelineSchedule, pp: int, m: int, v: int) -> None:
    """The micro-batch and chunk rules of each schedule (torch.distributed.pipelining's), in
    this config's field names; the schedule generator's own check
    (`paramsync.runtime.parallel.schedules.check_schedule_parameters`) runs last, so a layout the
    config accepts is one `build_schedule` builds (tests/test_parallelism_config.py checks they
    agree)."""
    _check_schedule_fields(schedule, pp, m, v)
    check_schedule_parameters(schedule.value, pp, m, v)


def _check_schedule_fields(schedule: PipelineSchedule, pp: int, m: int, v: int) -> None:
    if schedule is PipelineSchedule.INTERLEAVED_1F1B:
        if v < 2:
            raise ConfigError(
                f"virtual_chunks={v}: pipeline_schedule 'interleaved_1f1b' needs at least 2 "
                "model chunks per pipeline rank"
            )
        if m % pp:
            raise ConfigError(
                f"num_micro_batches={m}: pipeline_schedule 'interleaved_1f1b' needs a multiple "
                f"of pp_size={pp}"
            )
        return
    if v != 1:
        raise ConfigError(
            f"virtual_chunks={v}: only pipeline_schedule 'interleaved_1f1b' holds more than one "
            f"model chunk per rank, not {schedule.value!r}"
        )
    if schedule in (PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.ZERO_BUBBLE) and m < pp:
        raise ConfigError(
            f"num_micro_batches={m}: pipeline_schedule {schedule.value!r} needs at least "
            f"pp_size={pp} micro-batches"
        )


_FIELDS = tuple(f.name for f in fields(ParallelismConfig) if f.name not in FIELD_ALIASES)
_INT_FIELDS = frozenset(
    {"dp_size", "mp_size", "pp_size", "num_micro_batches", "accumulation_steps", "virtual_chunks"}
)
_BOOL_FIELDS = frozenset({"gradient_accumulation", "activation_checkpointing"})
_ENUM_FIELDS: dict[str, type[enum.Enum]] = {
    "data_plane": DataPlane,
    "pipeline_schedule": PipelineSchedule,
    "memory_optimization": MemoryOptimization,
}

ENV_VARS: dict[str, str] = {
    **{name: f"PARAMSYNC_{name.upper()}" for name in _FIELDS},
    "num_micro_batches": "PARAMSYNC_MICRO_BATCHES",
    "data_plane": DATA_PLANE_ENV,
    "tp_size": "PARAMSYNC_TP_SIZE",
}
"""Each field's (and alias's) environment variable: ``PARAMSYNC_DP_SIZE``, ``PARAMSYNC_TP_SIZE``
(or ``PARAMSYNC_MP_SIZE``), ``PARAMSYNC_PP_SIZE``, ``PARAMSYNC_MICRO_BATCHES``,
``PARAMSYNC_PIPELINE_SCHEDULE``, ``PARAMSYNC_MEMORY_OPTIMIZATION``, ..."""


def _coerce_value(key: str, value: object, label: str) -> object:
    """One source's value of ``key``, checked (`paramsync.runtime.config.layering.Coerce`)."""
    if key in _INT_FIELDS or key in FIELD_ALIASES:
        return parse_int(value, label)
    if key in _BOOL_FIELDS:
        return parse_bool(value, label)
    return parse_enum(_ENUM_FIELDS[key], value, label)


_LAYERING = Layering(
    table=TOML_TABLE,
    fields=_FIELDS,
    coerce=_coerce_value,
    env_vars=ENV_VARS,
    aliases=FIELD_ALIASES,
    renamed_env=RENAMED_DATA_PLANE_ENV,
)
"""`ParallelismConfig`'s sources: the ``[parallelism]`` TOML table, `ENV_VARS`, flags."""


# ---------------------------------------------------------------------- flags

_FLAGS: tuple[tuple[tuple[str, ...], str, dict[str, Any]], ...] = (
    (("--dp-size",), "dp_size", {"type": int, "help": "data-parallel degree"}),
    (
        ("--tp-size", "--mp-size"),
        "mp_size",
        {"type": int, "help": "tensor-parallel (model-parallel) degree"},
    ),
    (("--pp-size",), "pp_size", {"type": int, "help": "pipeline-parallel degree"}),
    (
        ("--micro-batches",),
        "num_micro_batches",
        {"type": int, "help": "micro-batches per step (m)"},
    ),
    (
        ("--pipeline-schedule",),
        "pipeline_schedule",
        {"choices": [s.value for s in PipelineSchedule], "help": "pipeline schedule"},
    ),
    (
        ("--virtual-chunks",),
        "virtual_chunks",
        {"type": int, "help": "model chunks per pipeline rank (interleaved_1f1b)"},
    ),
    (
        ("--gradient-accumulation",),
        "gradient_accumulation",
        {"action": argparse.BooleanOptionalAction, "help": "accumulate gradients over steps"},
    ),
    (
        ("--accumulation-steps",),
        "accumulation_steps",
        {"type": int, "help": "steps per optimizer step with --gradient-accumulation"},
    ),
    (
        ("--activation-checkpointing",),
        "activation_checkpointing",
        {"action": argparse.BooleanOptionalAction, "help": "recompute activations in backward"},
    ),
    (
        ("--memory-optimization",),
        "memory_optimization",
        {"choices": [o.value for o in MemoryOptimization], "help": "optimizer-state sharding"},
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the parallelism flags (``--dp-size``, ``--tp-size/--mp-size``, ``--pp-size``,
    ``--micro-batches``, ``--pipeline-schedule``, ...) to ``parser``. Each defaults to None
    ("not given"); `overrides_from_args` turns the parsed namespace into ``resolve``'s
    ``overrides``."""
    group = parser.add_argument_group("parallelism")
    for names, dest, options in _FLAGS:
        group.add_argument(*names, dest=f"parallel_{dest}", default=None, **options)
    add_data_plane_flag(group)  # the worker's one --data-plane, when the parser has it


def overrides_from_args(namespace: argparse.Namespace) -> dict[str, object]:
    """The flags `add_arguments` added, as ``resolve``'s overrides (None: not given)."""
    overrides = {dest: getattr(namespace, f"parallel_{dest}", None) for _, dest, _ in _FLAGS}
    overrides["data_plane"] = getattr(namespace, "data_plane", None)
    return overrides
