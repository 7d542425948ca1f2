"""Checkpoints of a `TrainingState` on disk: safetensors files, never pickle.

One checkpoint is one safetensors file named ``step-000000123.safetensors`` (the state's step,
the next step to run). Its tensors are the state's tensors under their state names; its
safetensors metadata holds, under the key ``"paramsync"``, one JSON document with the checkpoint
format version, the state's manifest (step, meta, and each tensor's name, shape and dtype, in
order), an XXH3-128 digest of every tensor's name, shape, dtype and bytes, the run id of the run
that wrote it (``run_id``, or null) and whether its state was committed (``committed``: every
rank's digest of it agreed). safetensors checks
the file's structure (a truncated file is refused); the digest catches flipped bits in tensor
data, which safetensors would load silently.

`CheckpointStore` writes atomically (temporary file in the same directory, fsync, rename, fsync
of the directory), so a crash leaves either the previous checkpoints or the new one, never a
torn file under a checkpoint name; leftover temporary files are ignored when reading and removed
by the next save. One process writes to a store's directory at a time.

Provenance (security review rows 7 and 8): a store bound to a run id (``run_id=``) writes it into
every checkpoint, counts only its own run's checkpoints when pruning, never deletes another
run's, and refuses to load another run's (`load`: `CheckpointError` naming both ids;
`load_latest_valid`: skipped with a warning naming both, and an error if nothing of its own run
is left). ``load_latest_valid(committed_only=True)`` skips checkpoints whose state was not
committed. The run id of the run writing to a directory is recorded in its ``run-id`` file.
Format 1 files (before run ids) read as ``run_id`` None, not committed. The content digest is
unkeyed: it detects corruption, not tampering by someone who can write the directory.

``meta`` values JSON cannot carry are encoded reversibly: bytes as ``{"$b64": ...}``,
non-finite floats as ``{"$float": "nan" | "inf" | "-inf"}``, and a dict with a key starting
with ``$`` is wrapped as ``{"$map": {...}}``, so the metadata is strict JSON.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import os
import re
import secrets
from pathlib import Path
from typing import Any, NamedTuple

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from paramsync.actors.state.training_state import TrainingState, manifest
from paramsync.runtime.errors import ParamsyncError
from paramsync.runtime.protocol.wire import tensor_buffer

__all__ = [
    "CHECKPOINT_FORMAT",
    "METADATA_KEY",
    "CheckpointError",
    "CheckpointStore",
    "CheckpointRecord",
    "RUN_ID_FILE",
    "checkpoint_name",
    "checkpoint_record",
    "load_checkpoint",
    "new_run_id",
]

log = logging.getLogger("paramsync.checkpoint")

CHECKPOINT_FORMAT = 2
"""Version of the checkpoint's metadata document (2: run id and committed flag)."""
_READABLE_FORMATS = (1, 2)
RUN_ID_FILE = "run-id"
"""The file in a checkpoint directory naming the run that writes its checkpoints."""
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
METADATA_KEY = "paramsync"
"""The safetensors metadata key holding paramsync's JSON document."""

_NAME = re.compile(r"step-(\d{9,})\.safetensors")
_TEMP = re.compile(r"\.step-\d{9,}\.safetensors\.tmp-[0-9a-f-]+")


class CheckpointError(ParamsyncError):
    """A checkpoint could not be written or read; the message names the file and the problem."""


class CheckpointRecord(NamedTuple):
    """What a checkpoint says of itself, read from its metadata alone (no tensor data)."""

    step: int
    run_id: str | None
    committed: bool


def new_run_id() -> str:
    """A fresh random run id."""
    return secrets.token_hex(8)


def _check_run_id(run_id: str | None) -> str | None:
    if run_id is not None and not (isinstance(run_id, str) and _RUN_ID.fullmatch(run_id)):
        raise ValueError(f"a run id must be 1-128 letters, digits, '.', '_' or '-', got {run_id!r}")
    return run_id


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint of ``step``: ``step-000000123.safetensors``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"step-{step:09d}.safetensors"


# --------------------------------------------------------------------------- the store


class CheckpointStore:
    """A directory of checkpoints, the newest ``keep`` of them (of this store's run) kept.

    ``run_id``: the run this store writes for and reads from (None: any, as before run ids).
    """

    def __init__(
        self, directory: str | os.PathLike[str], keep: int = 3, *, run_id: str | None = None
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        self.directory = Path(directory)
        self.keep = keep
        self.run_id = _check_run_id(run_id)

    def __repr__(self) -> str:
        return f"CheckpointStore({str(self.directory)!r}, keep={self.keep}, run_id={self.run_id!r})"

    def recorded_run_id(self) -> str | None:
        """The run id in the directory's ``run-id`` file, or None if there is none."""
        try:
            text = (self.directory / RUN_ID_FILE).read_text().strip()
        except FileNotFoundError:
            return None
        except OSError as err:
            raise CheckpointError(f"{self.directory / RUN_ID_FILE}: cannot read: {err}") from err
        try:
            return _check_run_id(text)
        except ValueError as err:
            raise CheckpointError(f"{self.directory / RUN_ID_FILE}: {err}") from None

    def record_run_id(self) -> None:
        """Write this store's run id into the directory's ``run-id`` file (atomically)."""
        if self.run_id is None:
            raise ValueError("this store has no run id to record")
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / RUN_ID_FILE
        temporary = self.directory / f".{RUN_ID_FILE}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            temporary.write_text(self.run_id + "\n")
            _fsync_path(temporary)
            os.replace(temporary, target)
        except OSError as err:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise CheckpointError(f"{target}: could not record the run id: {err}") from err
        _fsync_path(self.directory)

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Every file with a checkpoint name, as ``(step, path)``, oldest first. Names only:
        a listed file may still be corrupt."""
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            match = _NAME.fullmatch(entry.name)
            if match and entry.is_file():
                found.append((int(match.group(1)), Path(entry.path)))
        return sorted(found)

    def latest(self) -> Path | None:
        """The checkpoint file with the highest step, or None if there is none."""
        found = self.checkpoints()
        return found[-1][1] if found else None

    def save(self, state: TrainingState, *, committed: bool = False) -> Path:
        """Write ``state`` atomically as ``step-<step>.safetensors`` (replacing a checkpoint of
        the same step), recording this store's run id and ``committed`` (whether every rank's
        digest of this state agreed), then delete all but the newest ``keep`` checkpoints of
        this run (never the one just written). Returns the checkpoint's path.

        Raises `CheckpointError` if the file cannot be written (nothing is left behind), and
        TypeError if the state holds what a checkpoint cannot (see
        `paramsync.actors.state.training_state`).
        """
        name = checkpoint_name(state.step)
        final = self.directory / name
        tensors, metadata = _encode(state, self.run_id, committed)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._remove_temporaries()
        except OSError as err:
            raise CheckpointError(f"{final}: could not write the checkpoint: {err}") from err
        temporary = self.directory / f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            save_file(tensors, temporary, metadata={METADATA_KEY: metadata})
            _fsync_path(temporary)
            os.replace(temporary, final)
        except BaseException as err:
            with contextlib.suppress(OSError):
                temporary.unlink()
            if isinstance(err, OSError | ValueError | RuntimeError):
                raise CheckpointError(f"{final}: could not write the checkpoint: {err}") from err
            raise
        _fsync_path(self.directory)
        self._prune(keep_also=final)
        return final

    def load(self, path: str | os.PathLike[str] | None = None) -> TrainingState:
        """Read the checkpoint at ``path`` (default: `latest`); `CheckpointError` if there is
        none, it cannot be read whole and intact, or it belongs to another run than this
        store's (naming both run ids)."""
        if path is None:
            path = self.latest()
            if path is None:
                raise CheckpointError(f"{self.directory}: no checkpoint")
        self._check_run(Path(path), checkpoint_record(path))
        return load_checkpoint(path)

    def load_latest_valid(self, *, committed_only: bool = False) -> TrainingState | None:
        """The newest checkpoint of this store's run that reads whole and intact (and, with
        ``committed_only``, whose state was committed), skipping newer ones that do not, each
        with a warning; None if there is none. Raises `CheckpointError`, naming the run ids, if
        the directory holds only other runs' checkpoints: resuming must not silently start
        afresh next to them."""
        others: set[str | None] = set()
        for _, path in reversed(self.checkpoints()):
            try:
                record = checkpoint_record(path)
                self._check_run(path, record)
            except CheckpointError as err:
                if isinstance(err, _ForeignRun):
                    others.add(err.other)
                log.warning("skipping checkpoint: %s", err)
                continue
            if committed_only and not record.committed:
                log.warning(
                    "skipping checkpoint %s: its state was not committed (no digest agreement)",
                    path,
                )
                continue
            try:
                return load_checkpoint(path)
            except CheckpointError as err:
                log.warning("skipping unreadable checkpoint: %s", err)
        if others:
            named = ", ".join(sorted(repr(other) for other in others))
            raise CheckpointError(
                f"{self.directory}: no checkpoint of run {self.run_id!r}, only of run(s) "
                f"{named}: refusing to resume from another run or to start afresh beside it"
            )
        return None

    def _check_run(self, path: Path, record: CheckpointRecord) -> None:
        if self.run_id is not None and record.run_id != self.run_id:
            raise _ForeignRun(path, record.run_id, self.run_id)

    def _remove_temporaries(self) -> None:
        """Delete temporary files a crashed save left behind."""
        for entry in os.scandir(self.directory):
            if _TEMP.fullmatch(entry.name) and entry.is_file():
                log.info("removing leftover temporary checkpoint %s", entry.path)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)

    def _prune(self, keep_also: Path) -> None:
        found = self.checkpoints()
        if self.run_id is not None:
            found = [(step, path) for step, path in found if self._is_ours(path)]
        newest = {path for _, path in found[-self.keep :]}
        for _, path in found:
            if path not in newest and path != keep_also:
                log.debug("pruning checkpoint %s", path)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def _is_ours(self, path: Path) -> bool:
        try:
            return checkpoint_record(path).run_id == self.run_id
        except CheckpointError:
            return False  # unreadable: not provably ours, so never deleted by us


class _ForeignRun(CheckpointError):
    """A checkpoint of another run than the store's."""

    def __init__(self, path: Path, other: str | None, ours: str) -> None:
        self.other = other
        super().__init__(f"{path}: checkpoint of run {other!r}, not of this run {ours!r}: refused")


def _fsync_path(path: Path) -> None:
    """fsync a file (its data) or a directory (its entries, e.g. a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- encoding


def _encode(
    state: TrainingState, run_id: str | None, committed: bool
) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors safetensors accepts (contiguous CPU tensors, no two sharing memory: others
    are cloned) and the metadata document."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in state.tensors:
        if name in tensors:
            raise CheckpointError(f"tensor {name!r} appears twice in the state")
        tensor = tensor.detach()
        storage = tensor.untyped_storage()
        shared = storage.nbytes() > 0 and storage.data_ptr() in storages
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or shared:
            tensor = tensor.to("cpu").clone(memory_format=torch.contiguous_format)
            storage = tensor.untyped_storage()
        if storage.nbytes() > 0:
            storages.add(storage.data_ptr())
        tensors[name] = tensor
    document = {
        "format": CHECKPOINT_FORMAT,
        "manifest": {**manifest(state), "meta": _to_json(state.meta)},
        "digest": _content_digest(list(tensors.items())),
        "run_id": run_id,
        "committed": bool(committed),
    }
    try:
        text = json.dumps(document, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as err:
        raise TypeError(f"the state's meta cannot be stored: {err}") from err
    return tensors, text


def _content_digest(tensors: list[tuple[str, torch.Tensor]]) -> str:
    whole = xxhash.xxh3_128()
    for name, tensor in tensors:
        whole.update(f"{name}|{list(tensor.shape)}|{tensor.dtype}|".encode())
        whole.update(tensor_buffer(tensor.contiguous()))
    return whole.hexdigest()


def _to_json(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"$b64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, float) and not math.isfinite(value):
        return {"$float": repr(value)}
    if isinstance(value, list | tuple):
        return [_to_json(item) for item in value]
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise TypeError(f"meta dict keys must be str, got {list(value)!r}")
        encoded = {key: _to_json(item) for key, item in value.items()}
        return {"$map": encoded} if any(key.startswith("$") for key in value) else encoded
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(item) for item in value]
    if isinstance(value, dict):
        if value.keys() == {"$b64"}:
            return base64.b64decode(value["$b64"], validate=True)
        if value.keys() == {"$float"}:
            if value["$float"] not in ("nan", "inf", "-inf"):
                raise ValueError(f"bad $float {value['$float']!r}")
            return float(value["$float"])
        if value.keys() == {"$map"}:
            value = value["$map"]
            if not isinstance(value, dict):
                raise ValueError("$map must hold an object")
        return {key: _from_json(item) for key, item in value.items()}
    return value


# --------------------------------------------------------------------------- reading


def checkpoint_record(path: str | os.PathLike[str]) -> CheckpointRecord:
    """The step, run id and committed flag a checkpoint records, from its metadata alone
    (its tensor data is not read or checked: `load_checkpoint` does that)."""
    path = Path(path)
    try:
        with safe_open(path, framework="pt", device="cpu", backend="pread") as file:
            metadata = file.metadata() or {}
    except Exception as err:  # safetensors raises its own SafetensorError, OSError, ...
        raise CheckpointError(f"{path}: cannot read the checkpoint: {err}") from err
    if METADATA_KEY not in metadata:
        raise CheckpointError(f"{path}: not a paramsync checkpoint (no {METADATA_KEY!r} metadata)")
    document = _parse_document(path, metadata[METADATA_KEY])
    step = document["manifest"].get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise CheckpointError(f"{path}: corrupt {METADATA_KEY!r} metadata: bad step {step!r}")
    return CheckpointRecord(step, document["run_id"], document["committed"])


def load_checkpoint(path: str | os.PathLike[str]) -> TrainingState:
    """Read one checkpoint file whole into CPU memory and check it: safetensors structure,
    paramsync metadata, tensor names, shapes and dtypes against the manifest, content digest,
    and the step against the file name. Raises `CheckpointError` naming the file and the
    problem; never returns a partly read state."""
    path = Path(path)
    try:
        # pread, not the default mmap: mmapped tensors die of SIGBUS if the file is truncated
        # later, and could see later writes to it.
        with safe_open(path, framework="pt", device="cpu", backend="pread") as file:
            metadata = file.metadata() or {}
            if METADATA_KEY not in metadata:
                raise CheckpointError(
                    f"{path}: not a paramsync checkpoint (no {METADATA_KEY!r} metadata)"
                )
            document = _parse_document(path, metadata[METADATA_KEY])
            described = document["manifest"]
            names = [entry[0] for entry in described["tensors"]]
            if sorted(file.keys()) != sorted(names):
                missing = sorted(set(names) - set(file.keys()))
                extra = sorted(set(file.keys()) - set(names))
                raise CheckpointError(
                    f"{path}: tensors differ from the manifest (missing {missing}, extra {extra})"
                )
            tensors = [(name, file.get_tensor(name)) for name in names]
    except CheckpointError:
        raise
    except Exception as err:  # safetensors raises its own SafetensorError, OSError, ...
        raise CheckpointError(f"{path}: cannot read the checkpoint: {err}") from err
    try:
        state = TrainingState.from_manifest(described, tensors)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from err
    if _content_digest(state.tensors) != document["digest"]:
        raise CheckpointError(f"{path}: content digest mismatch: the tensor data is corrupt")
    match = _NAME.fullmatch(path.name)
    if match and int(match.group(1)) != state.step:
        raise CheckpointError(f"{path}: holds step {state.step}, its name says {match.group(1)}")
    return state


def _parse_document(path: Path, text: str) -> dict[str, Any]:
    try:
        document = json.loads(text)
        if not isinstance(document, dict):
            raise ValueError("not a JSON object")
        if document.get("format") not in _READABLE_FORMATS:
            raise CheckpointError(
                f"{path}: checkpoint format {document.get('format')!r} is not supported "
                f"(expected one of {list(_READABLE_FORMATS)})"
            )
        run_id = document.setdefault("run_id", None)
        if run_id is not None and not (isinstance(run_id, str) and _RUN_ID.fullmatch(run_id)):
            raise ValueError(f"bad run id {run_id!r}")
        if not isinstance(document.setdefault("committed", False), bool):
            raise ValueError("the committed flag is not a boolean")
        described = document.get("manifest")
        if not isinstance(described, dict) or not isinstance(described.get("tensors"), list):
            raise ValueError("no manifest with a tensor list")
        if not all(
            isinstance(e, list) and e and isinstance(e[0], str) for e in described["tensors"]
        ):
            raise ValueError("malformed tensor list")
        if not isinstance(document.get("digest"), str):
            raise ValueError("no content digest")
        described["meta"] = _from_json(described.get("meta"))
    except CheckpointError:
        raise
    except (ValueError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{path}: corrupt {METADATA_KEY!r} metadata: {err}") from err
    return document
