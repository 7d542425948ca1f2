"""The whole training state of one worker: named tensors plus CBOR-able metadata.

A `TrainingState` is what a rejoining worker receives from a healthy peer (live state transfer)
and what a checkpoint holds: every parameter, buffer and optimizer-state tensor, the RNG states,
and the step to run next. Because the data loader is a pure function of the step, restoring a
state and continuing reproduces the source replica bit for bit.

Tensors are named and ordered deterministically:

* ``param.<name>`` for ``model.named_parameters()`` (tied weights appear once, as torch dedups
  them), then ``buffer.<name>`` for ``model.named_buffers()`` (non-persistent buffers included:
  the initial weight broadcast syncs them too);
* ``optim.<index>.<key>`` for the optimizer's per-parameter state tensors, where ``index`` is the
  parameter's position in the optimizer's param groups (the packing of
  ``optimizer.state_dict()``), keys sorted;
* ``rng.torch`` (``torch.get_rng_state()``) and ``rng.cuda.<i>`` per CUDA device, if any.

Everything else lives in ``meta``, which holds only CBOR-able values (str, int, float, bool,
None, list, dict with str keys, bytes), so the manifest can travel as one CBOR message and be
stored as JSON: the optimizer's class, its param groups (hyperparameters, tuples as lists, and
the ``params`` index lists), its non-tensor per-parameter state, an LR scheduler's class and
``state_dict()`` (``meta["scheduler"]``, None without one), Python's ``random`` state, and the
caller's free ``extra`` dict. Nothing is pickled.

A mixed-precision run's loss scaler (`torch.amp.GradScaler`) is part of the state too:
``meta["grad_scaler"]`` holds its ``state_dict()`` (scale, growth tracker, growth and backoff
factors, growth interval), None without one (see the scaler block below).
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from paramsync.runtime.transport.device_ops import DeviceOps, context_device_ops

__all__ = [
    "STATE_FORMAT",
    "TrainingState",
    "StateMismatch",
    "capture_state",
    "restore_state",
    "manifest",
    "allocate",
    "parse_manifest",
    "dtype_name",
    "saved_grad_scaler",
]

STATE_FORMAT = 1
"""Version of the manifest layout (and of the meta layout inside it)."""

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class StateMismatch(ValueError):
    """A training state does not fit the model, optimizer or process it is restored into."""


@dataclass
class TrainingState:
    """One worker's whole training state.

    ``step`` is the next optimizer step to run, which is also the data position. ``tensors``
    are CPU tensors in the module's fixed order (see the module docstring); ``meta`` holds only
    CBOR-able values.
    """

    step: int
    tensors: list[tuple[str, torch.Tensor]]
    meta: dict[str, Any]

    @property
    def nbytes(self) -> int:
        """Total size of the tensors' data in bytes."""
        return sum(tensor.numel() * tensor.element_size() for _, tensor in self.tensors)

    @classmethod
    def from_manifest(
        cls, manifest: Mapping[str, Any], tensors: list[tuple[str, torch.Tensor]]
    ) -> TrainingState:
        """Assemble a state from a manifest and the tensors received for it (e.g. into
        `allocate`'s buffers); raises ValueError unless names, order, shapes and dtypes match
        the manifest exactly."""
        step, meta, specs = parse_manifest(manifest)
        if len(tensors) != len(specs):
            raise ValueError(f"manifest lists {len(specs)} tensors, got {len(tensors)}")
        for (name, shape, dtype), (got_name, tensor) in zip(specs, tensors):
            if got_name != name:
                raise ValueError(f"expected tensor {name!r} next, got {got_name!r}")
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"tensor {name!r}: not a tensor ({type(tensor).__name__})")
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(
                    f"tensor {name!r}: manifest says {list(shape)} {_DTYPE_NAMES[dtype]}, got "
                    f"{list(tensor.shape)} {tensor.dtype}"
                )
            if tensor.device.type != "cpu":
                raise ValueError(f"tensor {name!r}: expected a CPU tensor, got {tensor.device}")
        return cls(step, list(tensors), meta)


# --------------------------------------------------------------------------- capture


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of a dtype ("float32", "bfloat16", ...); TypeError if unsupported."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"tensors of dtype {dtype} are not supported in a training state") from None


def capture_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    *,
    extra: Mapping[str, Any] | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    device_ops: DeviceOps | None = None,
) -> TrainingState:
    """Snapshot the model, the optimizer, the LR scheduler, the RNGs and ``step`` (the next
    step to run).

    Every tensor is a fresh contiguous CPU *copy* (never a view), so the snapshot stays valid
    while training goes on, can be written to a checkpoint or sent over the network as is, and
    shares no storage between entries. A tensor on a device (``device_ops`` says which; default:
    the context's, `paramsync.runtime.transport.device_ops.context_device_ops`) is copied to the
    host on its current stream (purpose ``"state"``) and read once that copy's event has
    completed. ``extra`` must be CBOR-able (tuples become lists); it comes back unchanged in
    ``meta["extra"]``. ``grad_scaler``: the run's loss scaler, if it has one.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    ops = device_ops or context_device_ops()
    tensors = [
        (f"param.{name}", _host_copy(f"param.{name}", p, ops))
        for name, p in model.named_parameters()
    ]
    tensors += [
        (f"buffer.{name}", _host_copy(f"buffer.{name}", b, ops))
        for name, b in model.named_buffers()
    ]
    optimizer_meta = None
    if optimizer is not None:
        optimizer_meta, optimizer_tensors = _capture_optimizer(optimizer, ops)
        tensors += optimizer_tensors
    tensors.append(("rng.torch", torch.get_rng_state()))
    if torch.cuda.is_available():
        tensors += [
            (f"rng.cuda.{i}", torch.cuda.get_rng_state(i)) for i in range(torch.cuda.device_count())
        ]
    version, internal, gauss_next = random.getstate()
    meta = {
        "optimizer": optimizer_meta,
        "scheduler": _capture_scheduler(scheduler),
        "rng": {"python": [version, list(internal), gauss_next]},
        "extra": _cborable(dict(extra or {}), "extra"),
    }
    meta["grad_scaler"] = _capture_grad_scaler(grad_scaler)
    return TrainingState(step, tensors, meta)


def _host_copy(name: str, tensor: torch.Tensor, ops: DeviceOps) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.layout != torch.strided:
        raise TypeError(f"tensor {name!r}: layout {tensor.layout} is not supported")
    dtype_name(tensor.dtype)
    host = torch.empty(tensor.shape, dtype=tensor.dtype)
    if ops.on_device(tensor):
        copied = ops.copy_to_host(tensor, host, ops.current_stream(tensor.device), "state")
        ops.wait_host(copied)  # this copy's event, not the whole device
    else:
        host.copy_(tensor)
    return host


def _capture_optimizer(
    optimizer: torch.optim.Optimizer, ops: DeviceOps
) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    packed = optimizer.state_dict()
    groups = [
        _cborable(dict(group), f"optimizer param group {g}")
        for g, group in enumerate(packed["param_groups"])
    ]
    state_meta: dict[str, dict[str, Any]] = {}
    tensors = []
    for index in sorted(packed["state"]):
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"optimizer state is keyed by {index!r}, not a parameter index")
        values: dict[str, Any] = {}
        for key in sorted(packed["state"][index]):
            value = packed["state"][index][key]
            name = f"optim.{index}.{key}"
            if isinstance(value, torch.Tensor):
                tensors.append((name, _host_copy(name, value, ops)))
            else:
                values[key] = _cborable(value, f"optimizer state {name}")
        state_meta[str(index)] = values
    cls = type(optimizer)
    meta = {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "param_groups": groups,
        "state": state_meta,
    }
    return meta, tensors


def _class_name(value: object) -> str:
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def _capture_scheduler(
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
) -> dict[str, Any] | None:
    """The scheduler's class and ``state_dict()``; TypeError naming the entry CBOR cannot carry
    (e.g. a `LambdaLR` whose lambda is a callable object with such attributes)."""
    if scheduler is None:
        return None
    return {
        "class": _class_name(scheduler),
        "state": _cborable(scheduler.state_dict(), "LR scheduler state"),
    }


def _cborable(value: Any, where: str) -> Any:
    """A deep copy of ``value`` with tuples turned into lists; TypeError naming ``where`` for
    anything CBOR (and the checkpoint's JSON) would not carry faithfully. Integers must fit
    CBOR's plain integer types: bignums are semantic tags, which `paramsync.runtime.protocol.wire`
    refuses."""
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**64) <= value < 2**64:
        raise TypeError(f"{where}: integer {value} does not fit 64 bits (CBOR bignum)")
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    if isinstance(value, list | tuple):
        return [_cborable(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: dict key {key!r} is not a str")
            out[key] = _cborable(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: tensor values are not supported here")
    raise TypeError(f"{where}: {type(value).__name__} is not CBOR-able")


# --------------------------------------------------------------------------- manifests


def manifest(state: TrainingState) -> dict[str, Any]:
    """A CBOR-able description of ``state``: format version, step, meta, and each tensor's
    ``[name, shape, dtype name]`` in order. The receiver `allocate`s from it."""
    return {
        "format": STATE_FORMAT,
        "step": state.step,
        "meta": copy.deepcopy(state.meta),
        "tensors": [
            [name, list(tensor.shape), dtype_name(tensor.dtype)] for name, tensor in state.tensors
        ],
    }


def allocate(
    manifest: Mapping[str, Any], *, max_bytes: int | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Empty contiguous CPU tensors, named and ordered as ``manifest`` lists them, to receive
    a state into. The manifest is validated first (it may come from the network); with
    ``max_bytes``, one announcing more data than that is refused before allocating."""
    _, _, specs = parse_manifest(manifest)
    if max_bytes is not None:
        total = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in specs)
        if total > max_bytes:
            raise ValueError(f"manifest announces {total} bytes of tensors, more than {max_bytes}")
    return [(name, torch.empty(shape, dtype=dtype)) for name, shape, dtype in specs]


def parse_manifest(
    manifest: Mapping[str, Any],
) -> tuple[int, dict[str, Any], list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """Validate a manifest's structure: ``(step, meta, [(name, shape, dtype), ...])``, or
    ValueError naming the problem. Allocates nothing (see `paramsync.actors.state.manifest_guard`
    for the check against a local model)."""
    if not isinstance(manifest, Mapping):
        raise ValueError(f"manifest must be a map, got {type(manifest).__name__}")
    if manifest.get("format") != STATE_FORMAT:
        raise ValueError(
            f"manifest format {manifest.get('format')!r} is not supported (expected {STATE_FORMAT})"
        )
    step = manifest.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"manifest step must be a non-negative int, got {step!r}")
    meta = manifest.get("meta")
    if not isinstance(meta, dict):
        raise ValueError("manifest meta must be a map")
    entries = manifest.get("tensors")
    if not isinstance(entries, list):
        raise ValueError("manifest tensors must be a list")
    specs = []
    seen = set()
    for i, entry in enumerate(entries):
        if not (isinstance(entry, list | tuple) and len(entry) == 3):
            raise ValueError(f"manifest tensor {i} must be [name, shape, dtype]")
        name, shape, dtype = entry
        if not isinstance(name, str) or name in seen:
            raise ValueError(f"manifest tensor {i}: bad or repeated name {name!r}")
        seen.add(name)
        if not isinstance(shape, list | tuple) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(f"manifest tensor {name!r}: bad shape {shape!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"manifest tensor {name!r}: unsupported dtype {dtype!r}")
        specs.append((name, tuple(shape), _DTYPES[dtype]))
    return step, meta, specs


# --------------------------------------------------------------------------- restore


def restore_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: TrainingState,
    *,
    restore_rng: bool = True,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    restore_grad_scaler: bool = True,
) -> None:
    """Make ``model``, ``optimizer``, ``scheduler`` (and the RNGs) hold exactly ``state``.

    Everything is validated first; the first problem found raises `StateMismatch` and nothing
    is changed (a state with scheduler state needs a scheduler of its class, one without needs
    none). Then the optimizer's state is replaced through ``load_state_dict`` (from copies:
    torch would otherwise adopt ``state``'s tensors and mutate them while training), the
    scheduler's through its ``load_state_dict``, parameters
    and buffers are copied in place onto their own devices, and the RNG states are set. The
    caller resumes at ``state.step``. With ``restore_rng=False`` the ``rng.*`` tensors are
    ignored (e.g. restoring a CUDA machine's state on a CPU-only one). A state with a loss
    scaler's state needs ``grad_scaler`` to restore it into, one without needs none; with
    ``restore_grad_scaler=False`` that part of the state is ignored (a trainer that resumes
    makes its own scaler from `saved_grad_scaler`, through its options).
    """
    by_name: dict[str, torch.Tensor] = {}
    for name, tensor in state.tensors:
        if name in by_name:
            raise StateMismatch(f"tensor {name!r} appears twice in the state")
        by_name[name] = tensor
    used: set[str] = set()

    def take(name: str, like: torch.Tensor, where: str) -> torch.Tensor:
        source = by_name.get(name)
        if source is None:
            raise StateMismatch(f"tensor {name!r} ({where}) is missing from the state")
        if source.shape != like.shape:
            raise StateMismatch(
                f"tensor {name!r}: shape {list(source.shape)} in the state, "
                f"{list(like.shape)} in the {where}"
            )
        if source.dtype != like.dtype:
            raise StateMismatch(
                f"tensor {name!r}: dtype {source.dtype} in the state, {like.dtype} in the {where}"
            )
        used.add(name)
        return source

    copies: list[tuple[torch.Tensor, torch.Tensor]] = [
        (live, take(f"param.{name}", live, "model")) for name, live in model.named_parameters()
    ]
    copies += [
        (live, take(f"buffer.{name}", live, "model")) for name, live in model.named_buffers()
    ]
    for name, _ in state.tensors:
        if name.startswith(("param.", "buffer.")) and name not in used:
            raise StateMismatch(f"unexpected tensor {name!r} in the state (not in the model)")
    optimizer_state = _plan_optimizer(optimizer, state, by_name, used)
    scheduler_state = _plan_scheduler(scheduler, state)
    scaler_state = _plan_grad_scaler(grad_scaler, state.meta) if restore_grad_scaler else None
    rng_states: list[tuple[int | None, torch.Tensor]] = []
    if restore_rng:
        rng_states.append((None, take("rng.torch", torch.get_rng_state(), "process")))
        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for i in range(devices):
            rng_states.append((i, take(f"rng.cuda.{i}", torch.cuda.get_rng_state(i), "process")))
        python_rng = _python_rng(state.meta)
    else:
        used.update(name for name in by_name if name.startswith("rng."))
    for name, _ in state.tensors:
        if name not in used:
            raise StateMismatch(
                f"unexpected tensor {name!r} in the state (nothing to restore it to)"
            )

    if optimizer is not None:
        assert optimizer_state is not None
        optimizer.load_state_dict(optimizer_state)
    if scheduler is not None:
        assert scheduler_state is not None
        scheduler.load_state_dict(scheduler_state)
    if scaler_state is not None and grad_scaler is not None:
        grad_scaler.load_state_dict(scaler_state)
    with torch.no_grad():
        for live, source in copies:
            live.copy_(source)
    if restore_rng:
        for device, rng in rng_states:
            if device is None:
                torch.set_rng_state(rng.clone())
            else:
                torch.cuda.set_rng_state(rng.clone(), device)
        random.setstate(python_rng)


def _plan_optimizer(
    optimizer: torch.optim.Optimizer | None,
    state: TrainingState,
    by_name: dict[str, torch.Tensor],
    used: set[str],
) -> dict[str, Any] | None:
    """Validate the optimizer part of ``state`` against ``optimizer`` and build the state dict
    to load (tensors cloned), without touching the optimizer."""
    saved = state.meta.get("optimizer")
    if optimizer is None:
        if saved is not None:
            held = saved.get("class") if isinstance(saved, dict) else saved
            raise StateMismatch(f"the state holds {held!r} optimizer state, no optimizer given")
        return None
    cls = type(optimizer)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if not isinstance(saved, dict):
        raise StateMismatch(f"the state holds no optimizer state, the optimizer is {name}")
    if saved.get("class") != name:
        raise StateMismatch(f"optimizer class: {saved.get('class')!r} in the state, {name!r} here")
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise StateMismatch("malformed optimizer param groups in the state")
    if len(groups) != len(optimizer.param_groups):
        raise StateMismatch(
            f"number of optimizer param groups: {len(groups)} in the state, "
            f"{len(optimizer.param_groups)} in the optimizer"
        )
    indices: set[int] = set()
    for g, (group, live) in enumerate(zip(groups, optimizer.param_groups)):
        params = group.get("params")
        if not isinstance(params, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in params
        ):
            raise StateMismatch(f"malformed params list of optimizer param group {g} in the state")
        if len(params) != len(live["params"]):
            raise StateMismatch(
                f"optimizer param group {g}: {len(params)} parameters in the state, "
                f"{len(live['params'])} in the optimizer"
            )
        indices.update(params)
    packed_groups = []
    for group, live in zip(groups, optimizer.param_groups):
        packed = copy.deepcopy(group)
        for key, value in packed.items():
            if isinstance(live.get(key), tuple) and isinstance(value, list):
                packed[key] = tuple(value)  # e.g. Adam's betas, a tuple in torch's own dicts
        packed_groups.append(packed)

    saved_state = saved.get("state")
    if not isinstance(saved_state, dict):
        raise StateMismatch("malformed optimizer state in the state")
    packed_state: dict[int, dict[str, Any]] = {}
    for key, values in saved_state.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) in indices):
            raise StateMismatch(f"optimizer state for unknown parameter index {key!r}")
        if not isinstance(values, dict):
            raise StateMismatch(f"malformed optimizer state of parameter {key}")
        packed_state[int(key)] = copy.deepcopy(values)
    for tensor_name, tensor in by_name.items():
        if not tensor_name.startswith("optim."):
            continue
        index, _, key = tensor_name.removeprefix("optim.").partition(".")
        if not (index.isdigit() and key and int(index) in packed_state):
            raise StateMismatch(f"tensor {tensor_name!r} names no parameter's optimizer state")
        if key in packed_state[int(index)]:
            raise StateMismatch(f"optimizer state {tensor_name!r} is both a tensor and a value")
        packed_state[int(index)][key] = tensor.clone()
        used.add(tensor_name)
    # torch keeps state entries in insertion order; sort keys as capture did.
    return {
        "state": {i: dict(sorted(packed_state[i].items())) for i in sorted(packed_state)},
        "param_groups": packed_groups,
    }


def _plan_scheduler(
    scheduler: torch.optim.lr_scheduler.LRScheduler | None, state: TrainingState
) -> dict[str, Any] | None:
    """Validate the scheduler part of ``state`` against ``scheduler``; its state dict to load
    (a copy), without touching the scheduler."""
    saved = state.meta.get("scheduler")
    if scheduler is None:
        if saved is not None:
            held = saved.get("class") if isinstance(saved, dict) else saved
            raise StateMismatch(f"the state holds {held!r} LR scheduler state, no scheduler given")
        return None
    name = _class_name(scheduler)
    if not isinstance(saved, dict):
        raise StateMismatch(f"the state holds no LR scheduler state, the scheduler is {name}")
    if saved.get("class") != name:
        raise StateMismatch(
            f"LR scheduler class: {saved.get('class')!r} in the state, {name!r} here"
        )
    values = saved.get("state")
    if not isinstance(values, dict):
        raise StateMismatch("malformed LR scheduler state in the state")
    # torch's load_state_dict sets every key as an attribute: only this scheduler's own keys,
    # holding values of their own kinds, may come in (a peer's state is untrusted input).
    _check_like(values, scheduler.state_dict(), "LR scheduler state")
    return copy.deepcopy(values)


def _check_like(saved: Any, local: Any, where: str) -> None:
    """`StateMismatch` naming the first place where ``saved`` is not shaped like ``local``: maps
    with other keys, lists of another length, a leaf of another kind (numbers are one kind;
    None fits anything)."""
    if isinstance(local, dict):
        if not isinstance(saved, dict):
            raise StateMismatch(f"{where}: expected a map, got {type(saved).__name__}")
        if set(saved) != {str(key) for key in local}:
            extra = sorted(set(saved) - {str(key) for key in local})
            missing = sorted({str(key) for key in local} - set(saved))
            raise StateMismatch(f"{where}: keys differ (unexpected {extra}, missing {missing})")
        for key, value in local.items():
            _check_like(saved[str(key)], value, f"{where}[{key!r}]")
    elif isinstance(local, list | tuple):
        if not isinstance(saved, list | tuple) or len(saved) != len(local):
            raise StateMismatch(f"{where}: expected a list of {len(local)}, got {saved!r:.80}")
        for index, (item, mine) in enumerate(zip(saved, local)):
            _check_like(item, mine, f"{where}[{index}]")
    elif saved is not None and local is not None:
        number = (int, float)
        if isinstance(local, number) and isinstance(saved, number):
            return
        if type(saved) is not type(local):
            raise StateMismatch(
                f"{where}: expected a {type(local).__name__}, got {type(saved).__name__}"
            )


# --------------------------------------------------------------------------- loss scaler

_GRAD_SCALER_FIELDS: dict[str, tuple[type, ...]] = {
    "scale": (float, int),
    "growth_factor": (float, int),
    "backoff_factor": (float, int),
    "growth_interval": (int,),
    "_growth_tracker": (int,),
}
"""The keys of `torch.amp.GradScaler.state_dict()` and the types each may hold."""


def _capture_grad_scaler(scaler: torch.amp.GradScaler | None) -> dict[str, Any] | None:
    """The loss scaler's state dict (None without one, or for a disabled one: it holds none)."""
    if scaler is None or not scaler.is_enabled():
        return None
    return _cborable(dict(scaler.state_dict()), "grad scaler state")


def saved_grad_scaler(state: TrainingState) -> dict[str, Any] | None:
    """The loss scaler's state dict a state holds, validated (None: the state has none); e.g.
    for the options of a trainer resuming from a checkpoint (``grad_scaler_init_scale`` its
    ``scale``, ``grad_scaler_growth_tracker`` its ``_growth_tracker``). StateMismatch if
    malformed."""
    if state.meta.get("grad_scaler") is None:
        return None
    return _check_grad_scaler(state.meta["grad_scaler"])


def _plan_grad_scaler(
    scaler: torch.amp.GradScaler | None, meta: Mapping[str, Any]
) -> dict[str, Any] | None:
    """Validate the loss scaler part of a state's ``meta`` against ``scaler``: the state dict to
    load (None: nothing to load), without touching the scaler."""
    saved = meta.get("grad_scaler")
    enabled = scaler is not None and scaler.is_enabled()
    if saved is None:
        if enabled:
            raise StateMismatch(
                "the state holds no grad scaler state, but a grad scaler was given (the state "
                "comes from a run without a loss scaler)"
            )
        return None
    if not enabled:
        raise StateMismatch(
            "the state holds grad scaler state (a run with a loss scaler), no enabled grad "
            "scaler was given to restore it into (restore_grad_scaler=False ignores it)"
        )
    return _check_grad_scaler(saved)


def _check_grad_scaler(saved: Any) -> dict[str, Any]:
    """``saved`` if it is a well-formed `torch.amp.GradScaler` state dict (a copy), else
    StateMismatch naming the problem."""
    if not isinstance(saved, dict) or set(saved) != set(_GRAD_SCALER_FIELDS):
        keys = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise StateMismatch(
            f"malformed grad scaler state: expected keys {sorted(_GRAD_SCALER_FIELDS)}, got {keys}"
        )
    for key, types in _GRAD_SCALER_FIELDS.items():
        value = saved[key]
        if isinstance(value, bool) or not isinstance(value, types):
            raise StateMismatch(f"grad scaler state {key!r}: {value!r} is not a number of {types}")
    if not (0 < saved["scale"] < math.inf):
        raise StateMismatch(
            f"grad scaler state 'scale': {saved['scale']!r} is not positive and finite"
        )
    if saved["growth_interval"] < 1 or saved["_growth_tracker"] < 0:
        raise StateMismatch(
            f"grad scaler state: growth_interval {saved['growth_interval']!r} must be >= 1 and "
            f"_growth_tracker {saved['_growth_tracker']!r} >= 0"
        )
    if not (saved["growth_factor"] > 1 and 0 < saved["backoff_factor"] < 1):
        raise StateMismatch(
            f"grad scaler state: growth_factor {saved['growth_factor']!r} must be > 1 and "
            f"backoff_factor {saved['backoff_factor']!r} in (0, 1)"
        )
    return dict(saved)


def _python_rng(meta: dict[str, Any]) -> tuple[Any, ...]:
    try:
        version, internal, gauss_next = meta["rng"]["python"]
        rng = (version, tuple(internal), gauss_next)
        random.Random().setstate(rng)  # validates without touching the global generator
    except (KeyError, TypeError, ValueError) as err:
        raise StateMismatch(f"malformed Python RNG state in the state: {err}") from None
    return rng
