"""paramsync.actors.state.checkpoint: safetensors checkpoints, written atomically, read whole or
refused.

* A saved state loads back bitwise equal (names, order, dtypes, values, meta) and restores a
  replica to the source's state digest; plain `safetensors.safe_open` reads the file and its
  metadata is strict JSON.
* Crashes: a leftover temporary file is ignored and removed by the next save; a torn or
  corrupt newest checkpoint is refused by `load` (naming the file) and skipped, with a warning,
  by `load_latest_valid`. Saves fsync the file before the rename and the directory after.
* Pruning keeps the newest ``keep`` checkpoints and never the one just written.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_state import make_replica, same_bits, train

import paramsync.actors.state.checkpoint as checkpoint_module
from paramsync.actors.state.checkpoint import (
    CHECKPOINT_FORMAT,
    METADATA_KEY,
    CheckpointError,
    CheckpointStore,
    checkpoint_name,
    load_checkpoint,
)
from paramsync.actors.state.digest import state_digest
from paramsync.actors.state.training_state import TrainingState, capture_state, restore_state
from paramsync.runtime.errors import ParamsyncError


def trained_state(step: int, dtype: torch.dtype = torch.float32, **extra: Any) -> TrainingState:
    model, optimizer = make_replica(30 + step, "adamw", dtype)
    train(model, optimizer, range(step), dtype)
    return capture_state(model, optimizer, step, extra=extra)


def assert_same_state(a: TrainingState, b: TrainingState) -> None:
    assert a.step == b.step
    assert [n for n, _ in a.tensors] == [n for n, _ in b.tensors]
    for (name, x), (_, y) in zip(a.tensors, b.tensors):
        assert same_bits(x, y), name
    assert a.meta == b.meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    model, optimizer = make_replica(1, "adam", dtype, tied=True)
    train(model, optimizer, range(3), dtype)
    extra = {
        "blob": b"\x00\x01\xff",
        # user dicts that look like the JSON escapes
        "$odd": {"$b64": "not base64!", "$map": [1]},
        "like_bytes": {"$b64": "aGk="},
        "like_map": {"$map": {"a": 1}},
        "like_float": {"$float": "nan"},
        "big": 2**64 - 1,
        "inf": -math.inf,
        "nested": [{"a": None, "b": True}, 1.5],
    }
    state = capture_state(model, optimizer, 3, extra=extra)
    store = CheckpointStore(tmp_path / "ckpt")
    path = store.save(state)
    assert path == tmp_path / "ckpt" / "step-000000003.safetensors"
    assert store.latest() == path

    loaded = store.load()
    assert_same_state(state, loaded)
    assert loaded.meta["extra"] == extra
    other_model, other_optimizer = make_replica(2, "adam", dtype, tied=True)
    restore_state(other_model, other_optimizer, loaded)
    assert state_digest(other_model, other_optimizer) == state_digest(model, optimizer)


def test_nan_in_meta_survives(tmp_path: Path) -> None:
    state = trained_state(1, value=math.nan)
    loaded = CheckpointStore(tmp_path).load(CheckpointStore(tmp_path).save(state))
    assert math.isnan(loaded.meta["extra"]["value"])


def test_readable_by_plain_safetensors(tmp_path: Path) -> None:
    state = trained_state(2, value=math.inf, blob=b"x")
    path = CheckpointStore(tmp_path).save(state)
    with safe_open(path, framework="pt") as file:
        text = file.metadata()[METADATA_KEY]
        assert set(file.keys()) == {name for name, _ in state.tensors}
        for name, tensor in state.tensors:
            assert same_bits(file.get_tensor(name), tensor), name

    def refuse(token: str) -> None:
        raise AssertionError(f"non-standard JSON token {token}")

    document = json.loads(text, parse_constant=refuse)
    assert document["format"] == CHECKPOINT_FORMAT
    assert document["manifest"]["step"] == 2
    assert document["manifest"]["meta"]["extra"] == {
        "value": {"$float": "inf"},
        "blob": {"$b64": "eA=="},
    }
    assert [entry[0] for entry in document["manifest"]["tensors"]] == [n for n, _ in state.tensors]


def test_shared_and_non_contiguous_tensors(tmp_path: Path) -> None:
    """safetensors refuses tensors sharing memory and non-contiguous ones; save clones them."""
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = [
        ("param.base", base),
        ("param.row", base[1]),
        ("param.transposed", base.t()),
        ("param.same", base),
        ("param.empty", torch.empty(0, 3)),
        ("param.empty2", torch.empty(0)),
        ("buffer.flag", torch.tensor([True, False])),
    ]
    state = TrainingState(7, tensors, {"optimizer": None})
    loaded = CheckpointStore(tmp_path).load(CheckpointStore(tmp_path).save(state))
    assert_same_state(state, loaded)
    assert all(t.is_contiguous() for _, t in loaded.tensors)


def test_pruning(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for step in range(1, 6):
        store.save(TrainingState(step, [("x", torch.tensor([step]))], {}))
    assert [s for s, _ in store.checkpoints()] == [4, 5]
    assert store.latest() == tmp_path / checkpoint_name(5)
    # An older step written after newer ones (e.g. resumed past a corrupt newest) is kept ...
    store.save(TrainingState(3, [("x", torch.tensor([3]))], {}))
    assert [s for s, _ in store.checkpoints()] == [3, 4, 5]
    # ... until newer checkpoints push it out.
    store.save(TrainingState(6, [("x", torch.tensor([6]))], {}))
    assert [s for s, _ in store.checkpoints()] == [5, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_name(5), checkpoint_name(6)]
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(tmp_path, keep=0)


def test_big_step_names(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(TrainingState(999_999_999, [("x", torch.zeros(1))], {}))
    store.save(TrainingState(1_000_000_000, [("x", torch.ones(1))], {}))
    assert store.latest() == tmp_path / "step-1000000000.safetensors"
    assert store.load().step == 1_000_000_000


def test_crash_leftovers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(tmp_path, keep=5)
    first, second = trained_state(1), trained_state(2)
    store.save(first)
    good = store.save(second)
    data = good.read_bytes()

    # A crash while writing step 3's temporary file: ignored by readers.
    temporary = tmp_path / ".step-000000003.safetensors.tmp-4242-0badcafe"
    temporary.write_bytes(data[: len(data) // 2])
    assert store.latest() == good
    assert_same_state(store.load(), second)

    # A torn file under a checkpoint name (e.g. copied by hand, or a filesystem without
    # rename atomicity): latest() names it, load() refuses it, load_latest_valid() skips it.
    torn = tmp_path / checkpoint_name(4)
    torn.write_bytes(data[:-10])
    assert store.latest() == torn
    with pytest.raises(CheckpointError, match=re.escape(f"{torn}: cannot read the checkpoint")):
        store.load()
    with caplog.at_level(logging.WARNING, logger="paramsync.checkpoint"):
        recovered = store.load_latest_valid()
    assert recovered is not None
    assert_same_state(recovered, second)
    assert str(torn) in caplog.text

    # The next save removes the leftover temporary file.
    store.save(trained_state(5))
    assert not temporary.exists()
    assert [s for s, _ in store.checkpoints()] == [1, 2, 4, 5]


def test_nothing_readable(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "missing")
    assert store.latest() is None
    assert store.load_latest_valid() is None
    with pytest.raises(CheckpointError, match="missing: no checkpoint"):
        store.load()
    (tmp_path / "missing").mkdir()
    (tmp_path / "missing" / checkpoint_name(1)).write_bytes(b"")
    assert store.load_latest_valid() is None


def _rewrite_metadata(path: Path, change: Any) -> None:
    with safe_open(path, framework="pt") as file:
        tensors = {name: file.get_tensor(name) for name in file.keys()}
        document = json.loads(file.metadata()[METADATA_KEY])
    change(document, tensors)
    save_file(tensors, path, metadata={METADATA_KEY: json.dumps(document)})


def test_corrupt_and_foreign_files(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=10)
    path = store.save(trained_state(2))
    data = bytearray(path.read_bytes())
    cases: list[tuple[str, bytes | None, Any, str]] = []

    flipped = bytearray(data)
    flipped[-3] ^= 0x40  # inside the last tensor's bytes: safetensors would load it silently
    cases.append(("flipped", bytes(flipped), None, "content digest mismatch"))
    cases.append(("text", b"hello, I am not a checkpoint", None, "cannot read the checkpoint"))
    cases.append(("empty", b"", None, "cannot read the checkpoint"))

    def wrong_format(document: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        document["format"] = 99

    def drop_tensor(document: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        tensors.pop("rng.torch")

    def reshape(document: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        tensors["param.inp.bias"] = torch.zeros(5)

    def bad_meta(document: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        document["manifest"]["meta"] = {"x": {"$b64": "!!"}}

    cases.append(("format", None, wrong_format, "checkpoint format 99 is not supported"))
    cases.append(("dropped", None, drop_tensor, r"missing \['rng.torch'\]"))
    cases.append(("reshaped", None, reshape, r"tensor 'param.inp.bias': manifest says \[4\]"))
    cases.append(("meta", None, bad_meta, "corrupt 'paramsync' metadata"))

    for label, content, change, message in cases:
        target = tmp_path / f"{label}.safetensors"
        if content is not None:
            target.write_bytes(content)
        else:
            target.write_bytes(data)
            _rewrite_metadata(target, change)
        with pytest.raises(CheckpointError, match=message) as raised:
            load_checkpoint(target)
        assert str(target) in str(raised.value), label
        assert isinstance(raised.value, ParamsyncError)

    foreign = tmp_path / checkpoint_name(3)
    save_file({"weight": torch.zeros(2)}, foreign)
    with pytest.raises(CheckpointError, match=re.escape(f"{foreign}: not a paramsync checkpoint")):
        store.load()
    renamed = tmp_path / checkpoint_name(9)
    renamed.write_bytes(data)
    with pytest.raises(CheckpointError, match="holds step 2, its name says 000000009"):
        store.load(renamed)
    assert store.load_latest_valid().step == 2  # type: ignore[union-attr]


def test_save_order_and_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fsync(temporary) happens before the rename and fsync(directory) after it; a failed
    rename leaves no temporary file and the previous checkpoint intact."""
    store = CheckpointStore(tmp_path)
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append(("replace", str(src)))
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint_module.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint_module.os, "replace", replace)
    path = store.save(trained_state(1))
    kinds = [kind for kind, _ in events]
    assert kinds == ["fsync", "replace", "fsync"]
    assert events[0][1] == events[1][1] and ".tmp-" in events[0][1]
    assert events[2][1] == str(tmp_path)

    def broken_replace(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module.os, "replace", broken_replace)
    with pytest.raises(CheckpointError, match=r"step-000000002\.safetensors: could not write"):
        store.save(trained_state(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert store.load().step == 1


def test_loaded_tensors_do_not_map_the_file(tmp_path: Path) -> None:
    """A loaded state owns its memory: truncating the file afterwards (another process, a full
    disk) must not kill the reader with SIGBUS, as safetensors' default mmap loading would."""
    path = CheckpointStore(tmp_path).save(
        TrainingState(1, [("x", torch.arange(1 << 20, dtype=torch.float32))], {})
    )
    script = (
        "import os, sys\n"
        "from paramsync.actors.state.checkpoint import load_checkpoint\n"
        "state = load_checkpoint(sys.argv[1])\n"
        "os.truncate(sys.argv[1], 64)\n"
        "print(int(state.tensors[0][1].sum().item()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert int(done.stdout) == sum(range(1 << 20))
