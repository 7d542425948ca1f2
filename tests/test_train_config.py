"""Tests for paramsync.runtime.train_config: validation, env/TOML/override layering, device
resolution."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paramsync.runtime.config import DistributedConfig
from paramsync.runtime.train_config import (
    Device,
    DistributedRole,
    DistributedTrainConfig,
)

TORCHRUN_ENV = {
    "RANK": "2",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "10.0.0.5",
    "MASTER_PORT": "29999",
}


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "train.toml"
    path.write_text(text, encoding="utf-8")
    return path


# --- the dataclass -----------------------------------------------------------------------------


def test_defaults_are_a_single_coordinator_on_auto() -> None:
    cfg = DistributedTrainConfig()
    assert (cfg.world_size, cfg.rank, cfg.local_rank) == (1, 0, 0)
    assert cfg.role is DistributedRole.COORDINATOR
    assert cfg.is_coordinator
    assert cfg.device is Device.AUTO
    assert cfg.address == ("127.0.0.1", 29500)


def test_role_defaults_from_rank_and_accepts_names() -> None:
    assert DistributedTrainConfig(world_size=3, rank=1).role is DistributedRole.WORKER
    cfg = DistributedTrainConfig(world_size=3, rank=1, role="Coordinator", device="CPU")
    assert cfg.role is DistributedRole.COORDINATOR
    assert cfg.device is Device.CPU


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": "4"}, "world_size"),
        ({"world_size": True}, "world_size"),
        ({"world_size": 4, "rank": 4}, "rank 4 is out of range"),
        ({"world_size": 4, "rank": -1}, "rank -1 is out of range"),
        ({"rank": 1.0}, "rank"),
        ({"local_rank": -1}, "local_rank"),
        ({"world_size": 2, "local_rank": 2}, "local_rank"),
        ({"role": "boss"}, "role"),
        ({"device": "tpu"}, "device"),
        ({"coordinator_addr": "no-port"}, "coordinator_addr"),
        ({"coordinator_addr": "h:99999"}, "coordinator_addr"),
        ({"coordinator_addr": 5}, "coordinator_addr"),
    ],
)
def test_bad_fields_raise_value_error_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DistributedTrainConfig(**kwargs)


def test_config_is_frozen() -> None:
    cfg = DistributedTrainConfig()
    with pytest.raises(AttributeError):
        cfg.rank = 1  # type: ignore[misc]


def test_to_distributed_config() -> None:
    cfg = DistributedTrainConfig(world_size=5, rank=3, coordinator_addr="[::1]:7000")
    dc = cfg.to_distributed_config()
    assert dc == DistributedConfig(world_size=5, rank=3, coordinator_addr="[::1]:7000")
    assert dc.address == ("::1", 7000)


# --- environment ------------------------------------------------------------------------------


def test_from_env_reads_torchrun_variables() -> None:
    cfg = DistributedTrainConfig.from_env(TORCHRUN_ENV)
    assert (cfg.world_size, cfg.rank, cfg.local_rank) == (4, 2, 1)
    assert cfg.coordinator_addr == "10.0.0.5:29999"
    assert cfg.role is DistributedRole.WORKER


def test_from_env_extra_variables_and_ipv6() -> None:
    env = {"MASTER_ADDR": "::1", "PARAMSYNC_ROLE": "worker", "PARAMSYNC_DEVICE": "cpu"}
    cfg = DistributedTrainConfig.from_env(env)
    assert cfg.coordinator_addr == "[::1]:29500"
    assert cfg.role is DistributedRole.WORKER
    assert cfg.device is Device.CPU


def test_from_env_empty_gives_defaults() -> None:
    assert DistributedTrainConfig.from_env({}) == DistributedTrainConfig()


def test_from_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(var, value)
    assert DistributedTrainConfig.from_env().rank == 2


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("RANK", "two"),
        ("WORLD_SIZE", "4.0"),
        ("LOCAL_RANK", ""),
        ("MASTER_PORT", "http"),
        ("MASTER_PORT", "70000"),
        ("MASTER_ADDR", "a b"),
        ("MASTER_ADDR", ""),
        ("PARAMSYNC_ROLE", "chief"),
        ("PARAMSYNC_DEVICE", "metal"),
    ],
)
def test_from_env_errors_name_the_variable_and_value(var: str, value: str) -> None:
    env = dict(TORCHRUN_ENV, **{var: value})
    with pytest.raises(ValueError, match=var) as info:
        DistributedTrainConfig.from_env(env)
    assert repr(value) in str(info.value)


def test_from_env_rank_out_of_range() -> None:
    with pytest.raises(ValueError, match="rank 7 is out of range"):
        DistributedTrainConfig.from_env(dict(TORCHRUN_ENV, RANK="7"))


# --- TOML -------------------------------------------------------------------------------------


def test_from_toml(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        '[model]\nd_model = 128\n\n[distributed]\nworld_size = 5\nrank = 0\nrole = "coordinator"\n'
        'coordinator_addr = "localhost:4000"\ndevice = "cpu"\n',
    )
    cfg = DistributedTrainConfig.from_toml(path)
    assert cfg == DistributedTrainConfig(
        world_size=5, rank=0, coordinator_addr="localhost:4000", device="cpu"
    )


def test_from_toml_without_table_gives_defaults(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[model]\nd_model = 1\n")
    assert DistributedTrainConfig.from_toml(path) == DistributedTrainConfig()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[distributed]\nwordl_size = 4\n", "wordl_size"),
        ("[distributed]\nrank = 'x'\n", "rank"),
        ("[distributed]\nworld_size = 2\nrank = 2\n", "rank 2 is out of range"),
        ("[distributed]\ndevice = 3\n", "device"),
        ("[distributed]\ncoordinator_addr = 'x:y'\n", "coordinator_addr"),
        ("distributed = 3\n", "must be a table"),
        ("[distributed\n", "not valid TOML"),
    ],
)
def test_from_toml_errors(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        DistributedTrainConfig.from_toml(write_toml(tmp_path, text))


def test_from_toml_invalid_utf8_is_value_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(b"[distributed]\nrole = '\xff'\n")
    with pytest.raises(ValueError):
        DistributedTrainConfig.from_toml(path)


# --- layering ---------------------------------------------------------------------------------


def test_resolve_precedence_flags_over_env_over_toml_over_defaults(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        "[distributed]\nworld_size = 8\nrank = 1\nlocal_rank = 1\ndevice = 'cpu'\n"
        "coordinator_addr = 'toml-host:1'\n",
    )
    env = {"RANK": "3", "MASTER_ADDR": "env-host"}
    cfg = DistributedTrainConfig.resolve(path, env, {"rank": "5", "device": None})
    assert cfg.world_size == 8  # TOML
    assert cfg.local_rank == 1  # TOML
    assert cfg.device is Device.CPU  # TOML; a None flag does not mask it
    assert cfg.coordinator_addr == "env-host:29500"  # env over TOML
    assert cfg.rank == 5  # flag over env
    assert cfg.role is DistributedRole.WORKER  # derived from the final rank


def test_resolve_without_sources_is_defaults() -> None:
    assert DistributedTrainConfig.resolve(environ={}) == DistributedTrainConfig()


def test_resolve_rejects_unknown_override() -> None:
    with pytest.raises(ValueError, match="'ranks'"):
        DistributedTrainConfig.resolve(environ={}, overrides={"ranks": 1})


# --- devices ----------------------------------------------------------------------------------


def test_device_cpu_and_auto_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Device.CPU.resolve() == torch.device("cpu")
    assert Device.AUTO.resolve() == torch.device("cpu")
    with pytest.raises(RuntimeError, match="device 'cuda' was requested"):
        Device.CUDA.resolve()
    assert DistributedTrainConfig(device="cpu").torch_device() == torch.device("cpu")


def test_device_auto_and_cuda_with_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert Device.AUTO.resolve(1) == torch.device("cuda", 1)
    cfg = DistributedTrainConfig(world_size=4, rank=1, local_rank=1, device="cuda")
    assert cfg.torch_device() == torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match="only 2 GPU"):
        Device.CUDA.resolve(3)


# --- property tests: every bad value is a ValueError ------------------------------------------

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**6), max_value=10**6),
    st.floats(allow_nan=True),
    st.text(max_size=30),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.sampled_from(list(DistributedRole) + list(Device)),
)
field_names = st.sampled_from(
    ["world_size", "rank", "local_rank", "role", "coordinator_addr", "device"]
)


@settings(max_examples=150, deadline=None)
@given(values=st.dictionaries(field_names, anything, max_size=6))
def test_constructor_never_raises_anything_but_value_error(values: dict) -> None:
    try:
        DistributedTrainConfig(**values)
    except ValueError:
        pass


env_text = st.one_of(
    st.text(max_size=12),
    st.text(alphabet=string.digits + "-+ ", max_size=6),
    st.sampled_from(["::1", "[::1]", "host:1", "0", "65536", "cuda", "worker", "COORDINATOR"]),
)


@settings(max_examples=150, deadline=None)
@given(
    env=st.dictionaries(
        st.sampled_from(
            [
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "MASTER_ADDR",
                "MASTER_PORT",
                "PARAMSYNC_ROLE",
                "PARAMSYNC_DEVICE",
            ]
        ),
        env_text,
    )
)
def test_from_env_never_raises_anything_but_value_error(env: dict[str, str]) -> None:
    try:
        cfg = DistributedTrainConfig.from_env(env)
    except ValueError:
        return
    assert 0 <= cfg.rank < cfg.world_size
    cfg.to_distributed_config()


toml_scalar = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(str),
    st.booleans().map(lambda b: "true" if b else "false"),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.text(max_size=12).map(json.dumps),
    st.just("[1, 2]"),
    st.just("{ a = 1 }"),
)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    table=st.dictionaries(
        st.one_of(field_names, st.sampled_from(["extra", "Rank"])), toml_scalar, max_size=6
    ),
    junk=st.binary(max_size=20),
)
def test_from_toml_never_raises_anything_but_value_error(
    tmp_path: Path, table: dict[str, str], junk: bytes
) -> None:
    body = "".join(f"{key} = {value}\n" for key, value in table.items())
    for content in ("[distributed]\n" + body).encode(), junk:
        path = tmp_path / "cfg.toml"
        path.write_bytes(content)
        try:
            DistributedTrainConfig.from_toml(path)
        except ValueError:
            pass


@settings(max_examples=150, deadline=None)
@given(overrides=st.dictionaries(st.one_of(field_names, st.text(max_size=5)), anything))
def test_resolve_overrides_never_raise_anything_but_value_error(overrides: dict) -> None:
    try:
        DistributedTrainConfig.resolve(environ={}, overrides=overrides)
    except ValueError:
        pass
