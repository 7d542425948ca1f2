"""ParallelismConfig (seed 004): validation naming the field, the schedules' micro-batch and chunk
rules, the world and layer checks, the tp_size alias, and TOML/env/flag layering."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramsync import runtime
from paramsync.runtime.errors import ConfigError
from paramsync.runtime.parallel.config import (
    DEFAULT_INTERLEAVED_CHUNKS,
    ENV_VARS,
    DataPlane,
    MemoryOptimization,
    ParallelismConfig,
    PipelineSchedule,
    add_arguments,
    overrides_from_args,
)

SCHEDULES = [s.value for s in PipelineSchedule]


def schedule_allows(schedule: str, pp: int, m: int, v: int) -> str | None:
    """The field a (schedule, pp, m, v) breaks, written from the rules, not from the code."""
    if schedule == "interleaved_1f1b":
        if v < 2:
            return "virtual_chunks"
        return None if m % pp == 0 else "num_micro_batches"
    if v != 1:
        return "virtual_chunks"
    if schedule in ("1f1b", "zero_bubble") and m < pp:
        return "num_micro_batches"
    return None


@settings(max_examples=300, deadline=None)
@given(
    schedule=st.sampled_from(SCHEDULES),
    pp=st.integers(1, 8),
    m=st.integers(1, 24),
    v=st.integers(1, 4),
)
def test_schedule_rules_accept_exactly_the_valid_combinations(
    schedule: str, pp: int, m: int, v: int
) -> None:
    broken = schedule_allows(schedule, pp, m, v)
    kwargs = dict(pp_size=pp, num_micro_batches=m, virtual_chunks=v, pipeline_schedule=schedule)
    if broken is None:
        config = ParallelismConfig(**kwargs)  # type: ignore[arg-type]
        assert config.pipeline_schedule is PipelineSchedule(schedule)
        assert config.num_stages == pp * v
    else:
        with pytest.raises(ConfigError) as info:
            ParallelismConfig(**kwargs)  # type: ignore[arg-type]
        assert broken in str(info.value)
        assert schedule in str(info.value)


@settings(max_examples=200, deadline=None)
@given(
    dp=st.integers(1, 4),
    tp=st.integers(1, 4),
    pp=st.integers(1, 4),
    world=st.integers(1, 64),
)
def test_check_world_accepts_exactly_the_product(dp: int, tp: int, pp: int, world: int) -> None:
    config = ParallelismConfig(dp_size=dp, tp_size=tp, pp_size=pp)
    assert config.world_size == dp * tp * pp
    if world == dp * tp * pp:
        config.check_world(world)
    else:
        with pytest.raises(ConfigError, match="world_size") as info:
            config.check_world(world)
        assert f"dp_size={dp}" in str(info.value) and f"pp_size={pp}" in str(info.value)


@settings(max_examples=200, deadline=None)
@given(pp=st.integers(1, 8), v=st.integers(2, 4), layers=st.integers(1, 64))
def test_check_layers_needs_equal_stages(pp: int, v: int, layers: int) -> None:
    config = ParallelismConfig(
        pp_size=pp, virtual_chunks=v, num_micro_batches=pp, pipeline_schedule="interleaved_1f1b"
    )
    if layers % (pp * v) == 0:
        config.check_layers(layers)
    else:
        with pytest.raises(ConfigError, match="num_layers") as info:
            config.check_layers(layers)
        assert "virtual_chunks" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dp_size": 0}, "dp_size"),
        ({"mp_size": -1}, "mp_size"),
        ({"tp_size": 0}, "tp_size"),
        ({"pp_size": 1.5}, "pp_size"),
        ({"num_micro_batches": 0}, "num_micro_batches"),
        ({"accumulation_steps": 0, "gradient_accumulation": True}, "accumulation_steps"),
        ({"accumulation_steps": 4}, "accumulation_steps"),
        ({"gradient_accumulation": "yes"}, "gradient_accumulation"),
        ({"activation_checkpointing": 1}, "activation_checkpointing"),
        ({"data_plane": "nccl"}, "data_plane"),
        ({"pipeline_schedule": "pipedream"}, "pipeline_schedule"),
        ({"memory_optimization": "zero3"}, "memory_optimization"),
        ({"virtual_chunks": 0}, "virtual_chunks"),
        ({"mp_size": 2, "tp_size": 4}, "tp_size"),
        ({"dp_size": True}, "dp_size"),
    ],
)
def test_every_bad_field_is_a_config_error_naming_it(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        ParallelismConfig(**kwargs)  # type: ignore[arg-type]
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)


def test_defaults_alias_enums_and_mesh() -> None:
    config = ParallelismConfig()
    assert config.world_size == 1 and config.tp_size == 1 and not config.zero1
    assert config.data_plane is DataPlane.PARAMSYNC
    config = ParallelismConfig(
        dp_size=2, tp_size=4, pp_size=3, data_plane="torch", memory_optimization="ZERO1"
    )
    assert config.mp_size == 4 and config.tp_size == 4
    same = ParallelismConfig(
        dp_size=2, mp_size=4, pp_size=3, data_plane="torch", memory_optimization="zero1"
    )
    assert config == same and same.memory_optimization is MemoryOptimization.ZERO1
    assert config.zero1 and config.data_plane is DataPlane.TORCH
    assert config.mesh_names() == ("pp", "dp", "tp")
    assert config.mesh_shape() == (3, 2, 4)
    assert ParallelismConfig(mp_size=2, tp_size=2).mp_size == 2
    assert runtime.ParallelismConfig is ParallelismConfig
    with pytest.raises(AttributeError):
        config.dp_size = 3  # type: ignore[misc]


def test_mesh_shape_lays_tp_fastest() -> None:
    from paramsync.runtime.collectives.mesh import mesh_groups

    config = ParallelismConfig(dp_size=2, tp_size=2, pp_size=4)
    groups = mesh_groups(config.mesh_shape(), config.mesh_names(), "dp")
    assert groups[:3] == [[0, 2], [1, 3], [4, 6]]  # Megatron's golden case
    assert mesh_groups(config.mesh_shape(), config.mesh_names(), "tp")[0] == [0, 1]


def write_toml(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(body)
    return path


def test_toml_env_flags_layer_in_order(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        "[distributed]\nworld_size = 8\n\n[parallelism]\ndp_size = 2\ntp_size = 2\npp_size = 2\n"
        'num_micro_batches = 4\npipeline_schedule = "1f1b"\nactivation_checkpointing = true\n',
    )
    from_file = ParallelismConfig.from_toml(path)
    assert from_file.mesh_shape() == (2, 2, 2) and from_file.activation_checkpointing
    env = {"PARAMSYNC_PP_SIZE": "4", "PARAMSYNC_DP_SIZE": "1", "PARAMSYNC_MICRO_BATCHES": "8"}
    layered = ParallelismConfig.resolve(path, env, world_size=8)
    assert layered.mesh_shape() == (4, 1, 2)
    assert layered.num_micro_batches == 8 and layered.activation_checkpointing
    flagged = ParallelismConfig.resolve(
        path,
        env,
        {"pp_size": None, "dp_size": 2, "mp_size": 1, "activation_checkpointing": False},
        world_size=8,
    )
    assert flagged.mesh_shape() == (4, 2, 1) and not flagged.activation_checkpointing
    with pytest.raises(ConfigError, match="world_size is 4"):
        ParallelismConfig.resolve(path, env, world_size=4)


def test_flags_parse_both_spellings_and_layer_over_env() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--tp-size",
            "2",
            "--pp-size",
            "2",
            "--micro-batches",
            "4",
            "--pipeline-schedule",
            "zero_bubble",
            "--no-activation-checkpointing",
            "--memory-optimization",
            "zero1",
        ]
    )
    env = {"PARAMSYNC_TP_SIZE": "4", "PARAMSYNC_ACTIVATION_CHECKPOINTING": "on"}
    config = ParallelismConfig.resolve(None, env, overrides_from_args(args))
    assert config.mp_size == 2 and config.pp_size == 2 and config.zero1
    assert config.pipeline_schedule is PipelineSchedule.ZERO_BUBBLE
    assert not config.activation_checkpointing
    args = parser.parse_args(["--mp-size", "3"])
    assert ParallelismConfig.resolve(None, {}, overrides_from_args(args)).tp_size == 3
    assert ParallelismConfig.resolve(None, env).activation_checkpointing


def test_alias_across_and_within_sources(tmp_path: Path) -> None:
    env = {"PARAMSYNC_MP_SIZE": "2"}
    assert ParallelismConfig.resolve(None, env, {"tp_size": 4}).mp_size == 4
    assert ParallelismConfig.resolve(None, {"PARAMSYNC_TP_SIZE": "2"}).mp_size == 2
    with pytest.raises(ConfigError, match="PARAMSYNC_MP_SIZE=2 and PARAMSYNC_TP_SIZE=4"):
        ParallelismConfig.from_env({"PARAMSYNC_MP_SIZE": "2", "PARAMSYNC_TP_SIZE": "4"})
    path = write_toml(tmp_path, "[parallelism]\nmp_size = 2\ntp_size = 4\n")
    with pytest.raises(ConfigError, match="mp_size=2 and tp_size=4"):
        ParallelismConfig.from_toml(path)
    with pytest.raises(ConfigError, match="flag: mp_size=2 and tp_size=3"):
        ParallelismConfig.resolve(None, {}, {"mp_size": 2, "tp_size": 3})


@pytest.mark.parametrize(
    ("source", "text"),
    [
        ("env", "PARAMSYNC_DP_SIZE"),
        ("toml-key", "unknown key 'dp'"),
        ("toml-type", "[parallelism] pp_size must be an integer"),
        ("toml-bool", "[parallelism] gradient_accumulation must be a bool"),
        ("flag", "flag: unknown key 'world_size'"),
        ("bad-toml", "not valid TOML"),
    ],
)
def test_source_errors_name_the_source(tmp_path: Path, source: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        if source == "env":
            ParallelismConfig.from_env({"PARAMSYNC_DP_SIZE": "two"})
        elif source == "toml-key":
            ParallelismConfig.from_toml(write_toml(tmp_path, "[parallelism]\ndp = 2\n"))
        elif source == "toml-type":
            ParallelismConfig.from_toml(write_toml(tmp_path, '[parallelism]\npp_size = "x"\n'))
        elif source == "toml-bool":
            body = '[parallelism]\ngradient_accumulation = "maybe"\n'
            ParallelismConfig.from_toml(write_toml(tmp_path, body))
        elif source == "flag":
            ParallelismConfig.resolve(None, {}, {"world_size": 4})
        else:
            ParallelismConfig.from_toml(write_toml(tmp_path, "[parallelism\n"))
    assert text in str(info.value)


def test_every_field_has_an_environment_variable() -> None:
    config = ParallelismConfig.from_env(
        {
            ENV_VARS["dp_size"]: "2",
            ENV_VARS["pp_size"]: "2",
            ENV_VARS["num_micro_batches"]: "4",
            ENV_VARS["virtual_chunks"]: "2",
            ENV_VARS["pipeline_schedule"]: "interleaved-1f1b",
            ENV_VARS["gradient_accumulation"]: "true",
            ENV_VARS["accumulation_steps"]: "3",
            ENV_VARS["data_plane"]: "torch",
            ENV_VARS["memory_optimization"]: "zero1",
        }
    )
    assert config.virtual_chunks == 2 and config.accumulation_steps == 3
    assert config.pipeline_schedule is PipelineSchedule.INTERLEAVED_1F1B
    assert ENV_VARS["dp_size"] == "PARAMSYNC_DP_SIZE"
    assert ENV_VARS["tp_size"] == "PARAMSYNC_TP_SIZE"
    assert ENV_VARS["num_micro_batches"] == "PARAMSYNC_MICRO_BATCHES"
    config.check_layers(8)
    with pytest.raises(ConfigError):
        config.check_layers(6)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]),
    pp=st.integers(1, 8),
    m=st.integers(1, 24),
    v=st.integers(1, 4),
    layers=st.integers(1, 48),
)
def test_the_config_accepts_exactly_the_layouts_the_schedule_generator_builds(
    kind: str, pp: int, m: int, v: int, layers: int
) -> None:
    """One rule set: ParallelismConfig refuses a schedule layout exactly when
    check_schedule_parameters does, and check_layers agrees with the generator's."""
    from paramsync.runtime.parallel import schedules

    try:
        schedules.check_schedule_parameters(kind, pp, m, v)
        generator_ok = True
    except ValueError:
        generator_ok = False
    try:
        config = ParallelismConfig(
            pp_size=pp, num_micro_batches=m, virtual_chunks=v, pipeline_schedule=kind
        )
        config_ok = True
    except ValueError:
        config_ok = False
    assert config_ok == generator_ok
    if config_ok:
        try:
            schedules.check_layers(layers, pp, v)
            layers_ok = True
        except ValueError:
            layers_ok = False
        try:
            config.check_layers(layers)
            config_layers_ok = True
        except ValueError:
            config_layers_ok = False
        assert config_layers_ok == layers_ok


def test_interleaving_with_nothing_else_said_holds_two_chunks_per_rank(tmp_path: Path) -> None:
    """Seed 004's config has no chunk field: ``interleaved_1f1b`` alone is valid, with 2 chunks
    per rank, from every source; a chunk count given explicitly is still checked as given, and
    layers that 2 chunks per rank cannot split are refused naming the fields and the way out."""
    seed = ParallelismConfig(pp_size=2, num_micro_batches=4, pipeline_schedule="interleaved_1f1b")
    assert seed.virtual_chunks == DEFAULT_INTERLEAVED_CHUNKS == 2
    assert seed.num_stages == 4
    assert ParallelismConfig(pp_size=2, num_micro_batches=4).virtual_chunks == 1
    assert ParallelismConfig(pipeline_schedule="1f1b").virtual_chunks == 1
    seed.check_layers(8)
    with pytest.raises(ConfigError) as info:
        seed.check_layers(6)
    text = str(info.value)
    assert "num_layers=6" in text and "virtual_chunks=2" in text and "--virtual-chunks" in text
    with pytest.raises(ConfigError, match="virtual_chunks=1"):  # said, so checked as said
        ParallelismConfig(
            pp_size=2, num_micro_batches=4, pipeline_schedule="interleaved_1f1b", virtual_chunks=1
        )
    assert (
        ParallelismConfig(
            pp_size=2, num_micro_batches=4, pipeline_schedule="interleaved_1f1b", virtual_chunks=3
        ).num_stages
        == 6
    )
    toml = tmp_path / "run.toml"
    toml.write_text(
        "[parallelism]\npp_size = 2\nnum_micro_batches = 4\n"
        'pipeline_schedule = "interleaved_1f1b"\n'
    )
    assert ParallelismConfig.resolve(toml, environ={}).virtual_chunks == 2
    env = {ENV_VARS["virtual_chunks"]: "4"}
    assert ParallelismConfig.resolve(toml, environ=env).virtual_chunks == 4
    flags = {"pipeline_schedule": "interleaved_1f1b", "pp_size": 2, "num_micro_batches": 2}
    assert ParallelismConfig.resolve(None, {}, flags).virtual_chunks == 2
    assert ParallelismConfig.resolve(None, {}, {"pp_size": 2}).virtual_chunks == 1
