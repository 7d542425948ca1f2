"""One configuration: one layering engine for every configuration's sources, one `DataPlane`
with one variable and one flag, one boolean parser, and `DistributedTrainConfig` in a
configuration module that the command line and the library both use."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import grimp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramsync import runtime
from paramsync.runtime import config as config_module
from paramsync.runtime.cli.jobs import WorkerJob
from paramsync.runtime.cli.main import build_parser
from paramsync.runtime.config import (
    DATA_PLANE_ENV,
    DATA_PLANES,
    DataPlane,
    Layering,
    add_data_plane_flag,
    check_data_plane,
    parse_bool,
    parse_int,
)
from paramsync.runtime.errors import ConfigError
from paramsync.runtime.parallel import config as parallel_config
from paramsync.runtime.parallel.config import ParallelismConfig, add_arguments, overrides_from_args
from paramsync.runtime.train_config import Device, DistributedTrainConfig
from paramsync.runtime.transport import shm, torch_plane

# --------------------------------------------------------------------------- the engine


def toy_layering() -> Layering:
    return Layering(
        table="toy",
        fields=("a", "b", "c"),
        coerce=lambda key, value, label: parse_int(value, label),
        env_vars={"a": "TOY_A", "b": "TOY_B", "c": "TOY_C", "alias_c": "TOY_ALIAS_C"},
        aliases={"alias_c": "c"},
    )


LAYER = st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(-5, 5), max_size=3)


@settings(max_examples=100, deadline=None)
@given(toml=LAYER, env=LAYER, flags=LAYER, unset=st.sets(st.sampled_from(["a", "b", "c"])))
def test_flags_win_over_the_environment_over_the_file(
    tmp_path_factory: pytest.TempPathFactory,
    toml: dict[str, int],
    env: dict[str, int],
    flags: dict[str, int],
    unset: set[str],
) -> None:
    path = tmp_path_factory.mktemp("toy") / "toy.toml"
    path.write_text("[toy]\n" + "".join(f"{k} = {v}\n" for k, v in toml.items()))
    environ = {f"TOY_{k.upper()}": f" {v} " for k, v in env.items()}
    overrides: dict[str, object] = {**flags, **dict.fromkeys(unset - flags.keys())}
    merged = toy_layering().resolve(path, environ, overrides)
    assert merged == {**toml, **env, **flags}


def test_the_engine_names_every_source_in_its_errors(tmp_path: Path) -> None:
    layering = toy_layering()
    with pytest.raises(ConfigError, match="environment variable TOY_A a must be an integer"):
        layering.from_env({"TOY_A": "x"})
    with pytest.raises(ConfigError, match="TOY_C=1 and TOY_ALIAS_C=2"):
        layering.from_env({"TOY_C": "1", "TOY_ALIAS_C": "2"})
    assert layering.from_env({"TOY_ALIAS_C": "3"}) == {"c": 3}
    with pytest.raises(ConfigError, match="flag: unknown key 'd'"):
        layering.from_flags({"d": 1})
    with pytest.raises(ConfigError, match="cannot read"):
        layering.from_toml(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("[toy\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        layering.from_toml(tmp_path / "bad.toml")
    (tmp_path / "ok.toml").write_text("[other]\nz = 1\n")
    assert layering.from_toml(tmp_path / "ok.toml") == {}


def test_both_configurations_resolve_through_the_engine() -> None:
    for module in (importlib.import_module("paramsync.runtime.train_config"), parallel_config):
        layerings = [v for v in vars(module).values() if isinstance(v, Layering)]
        assert len(layerings) == 1, module.__name__
    source = Path(parallel_config.__file__).read_text()
    assert "tomllib" not in source and "_TRUE" not in source


# --------------------------------------------------------------------------- one DataPlane


def test_one_data_plane_one_variable() -> None:
    assert parallel_config.DataPlane is DataPlane
    assert torch_plane.DATA_PLANES is DATA_PLANES == ("paramsync", "torch")
    assert torch_plane.check_data_plane is check_data_plane
    assert parallel_config.ENV_VARS["data_plane"] == DATA_PLANE_ENV
    assert DataPlane.parse(" Torch ") is DataPlane.TORCH
    assert check_data_plane("torch") is DataPlane.TORCH
    assert check_data_plane(DataPlane.TORCH) is DataPlane.TORCH
    for bad in ("Torch", "nccl", 3, None):  # values in code are taken as written
        with pytest.raises(ConfigError, match="data_plane must be one of 'paramsync', 'torch'"):
            check_data_plane(bad)
    env = {DATA_PLANE_ENV: "torch"}
    assert DistributedTrainConfig.from_env(env).data_plane is DataPlane.TORCH
    assert ParallelismConfig.from_env(env).data_plane is DataPlane.TORCH


@pytest.mark.parametrize(
    ("old", "new", "value"),
    [
        ("PARAMSYNC_BACKEND", "PARAMSYNC_DEVICE", "cpu"),
        ("PARAMSYNC_COMM_BACKEND", DATA_PLANE_ENV, "torch"),
    ],
)
def test_a_renamed_variable_still_set_is_refused_naming_its_new_name(
    old: str, new: str, value: str
) -> None:
    refusal = f"environment variable {old} was renamed {new}: set {new} instead"
    for env in ({old: value}, {old: value, new: value}):
        with pytest.raises(ConfigError, match=refusal):
            DistributedTrainConfig.from_env(env)
        with pytest.raises(ConfigError, match=refusal):  # a flag given does not hide it
            DistributedTrainConfig.resolve(None, env, {"rank": 0})
    read = DistributedTrainConfig.from_env({new: value})
    assert (read.device, read.data_plane) != (Device.AUTO, DataPlane.PARAMSYNC)  # the new one
    if new == DATA_PLANE_ENV:  # the parallelism configuration reads the data plane's too
        with pytest.raises(ConfigError, match=refusal):
            ParallelismConfig.from_env({old: value})
        assert ParallelismConfig.from_env({new: value}).data_plane is DataPlane.TORCH
    else:
        assert ParallelismConfig.from_env({old: value}) == ParallelismConfig()


def test_one_data_plane_flag_for_the_worker_and_the_parallelism_flags() -> None:
    def job_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        add_arguments(parser)  # a 3D job's flags, on the worker's command line
        return parser

    async def run(args: argparse.Namespace) -> int:
        return 0

    parser = build_parser(WorkerJob("tests.a_3d_job", job_flags, run))
    args = parser.parse_args(["worker", "--data-plane", "torch", "--pp-size", "2"])
    assert args.data_plane == "torch"
    config = ParallelismConfig.resolve(None, {}, overrides_from_args(args))
    assert config.data_plane is DataPlane.TORCH and config.pp_size == 2
    flags = [
        action
        for action in parser._subparsers._group_actions[0].choices["worker"]._actions  # type: ignore[union-attr]
        if "--data-plane" in action.option_strings
    ]
    assert len(flags) == 1
    alone = argparse.ArgumentParser()
    add_arguments(alone)
    add_data_plane_flag(alone)  # a second call adds nothing
    assert alone.parse_args([]).data_plane is None
    assert (
        overrides_from_args(alone.parse_args(["--data-plane", "paramsync"]))["data_plane"]
        == "paramsync"
    )


# --------------------------------------------------------------------------- one bool parser


@pytest.mark.parametrize(
    ("text", "value"),
    [("1", True), (" On ", True), ("yes", True), ("TRUE", True), ("0", False), ("off", False)],
)
def test_one_boolean_parser(text: str, value: bool) -> None:
    assert parse_bool(text, "x") is value
    assert parse_bool(value, "x") is value


def test_every_boolean_setting_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        ConfigError, match="PARAMSYNC_GRADIENT_ACCUMULATION gradient_accumulation must be a bool"
    ):
        ParallelismConfig.from_env({"PARAMSYNC_GRADIENT_ACCUMULATION": "maybe"})
    holder = object()
    for text, wanted in (("off", False), ("no", False), ("1", True), ("", True)):
        monkeypatch.setenv("PARAMSYNC_SHM", text)
        assert shm.shared_memory_wanted(holder) is wanted  # type: ignore[arg-type]
    monkeypatch.setenv("PARAMSYNC_SHM", "maybe")
    with pytest.raises(ConfigError, match="PARAMSYNC_SHM must be a bool"):
        shm.shared_memory_wanted(holder)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- where it lives


def test_the_train_config_lives_below_the_command_line() -> None:
    assert runtime.DistributedTrainConfig is DistributedTrainConfig
    assert DistributedTrainConfig.__module__ == "paramsync.runtime.train_config"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("paramsync.runtime.cli.train_config")
    graph = grimp.build_graph("paramsync")
    for library in ("paramsync.actors.train.run", "paramsync.actors.train.worker"):
        imported = graph.find_modules_directly_imported_by(library)
        assert "paramsync.runtime.train_config" in imported
        # Of the command line, the library uses only the torchrun rendezvous (its store).
        assert {m for m in imported if m.startswith("paramsync.runtime.cli")} <= {
            "paramsync.runtime.cli.torchrun"
        }
    assert "paramsync.runtime.train_config" in graph.find_modules_directly_imported_by(
        "paramsync.runtime.cli.main"
    )
    assert config_module.DataPlane is DataPlane
