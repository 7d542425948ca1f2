"""Digests of a replica's training state, for the C-DDP-001 check.

A digest is a 128-bit XXH3 hash over the exact bytes of every parameter, every buffer
(BatchNorm running statistics, any registered buffer, persistent or not) and every
optimizer-state tensor, in a fixed order, with names, shapes and dtypes mixed in, plus the
optimizer's param-group hyperparameters and an LR scheduler's ``state_dict()`` (CBOR, keys sorted),
so two replicas have equal digests only if their whole training states are identical (an
accidental collision has probability about 2**-128). Per-entry digests let the coordinator name
the first one that differs.

Buffers are left out (``buffers=False``) only when the trainer keeps them local
(``TrainerOptions(buffer_sync="local")``, torch DDP's ``broadcast_buffers=False``): each rank's
running statistics then legitimately differ, and the check covers the rest of the state.

Why XXH3 and not SHA-256: the check runs after every optimizer step and must cost at most a few
percent of it. SHA-256 hashes about 1.5 GB/s here (3.5 ms for a 5 MiB model state, more than the
whole budget of a 43 ms step); XXH3 about 20 GB/s. The check guards against divergence
(non-determinism, bit flips, bugs), not against a forging adversary: peers are already
authenticated, and a malicious member could corrupt the gradients it sends anyway.

Why a `StateHasher`: the hashing itself (about 0.2 ms for 5 MiB) is cheaper than the Python
around it, and all of it sits on the step's critical path. The hasher keeps each tensor's
zero-copy byte view and its header seed from step to step, so a digest is one C call per
tensor. While the state's layout holds (the same parameter and state tensors, names, storage,
shapes, strides and dtypes, which it checks in a few C-level passes before every digest) it
skips the per-tensor Python altogether; any change sends it through the full walk, so a
swapped or resized tensor is never hashed stale. The param groups' encoding is kept while they
hold the very same immutable values.

Two algorithms compute the per-tensor digests, and every digest names its own
(`StateDigest.algorithm`): XXH3-128 over the host bytes (``"xxh3-128"``), and the fold
(``"fold31x4"``, `paramsync.actors.state.fold_digest`, docs/digest.md), exact integer arithmetic
run on the tensors' own device, so a CUDA state is digested without a synchronize or a copy of
its bytes to the host. ``StateHasher(algorithm="auto")`` (the default, or the
``PARAMSYNC_STATE_DIGEST`` environment variable's value) folds a state that has a tensor off the
CPU and hashes a state entirely on the CPU with XXH3, the faster there (benchmarks/digest.py); a
run mixing CPU and CUDA ranks forces one algorithm everywhere (``"xxh3"`` or ``"fold"``).
"""

from __future__ import annotations

import os
from itertools import chain
from operator import attrgetter, is_
from typing import Any, Literal

import cbor2
import torch
import xxhash

from paramsync.actors.state.fold_digest import (
    DIGEST_PURPOSE,
    FOLD_NAME,
    DeviceReadback,
    FoldLayout,
    entry_header,
)
from paramsync.runtime.protocol.wire import tensor_buffer
from paramsync.runtime.transport.device_ops import DeviceOps, context_device_ops

__all__ = [
    "ALGORITHMS",
    "DIGEST_ENV",
    "FOLD_NAME",
    "XXH3_NAME",
    "DigestChoice",
    "PendingDigest",
    "StateDigest",
    "StateHasher",
    "check_digest_choice",
    "state_digest",
    "named_state",
    "Scheduler",
]

Scheduler = torch.optim.lr_scheduler.LRScheduler
"""The LR schedulers a training state holds (torch's base class)."""

_digest128 = xxhash.xxh3_128_digest
_seed64 = xxhash.xxh3_64_intdigest
_data_ptr = torch.Tensor.data_ptr
_stride = torch.Tensor.stride
_shape = attrgetter("shape")
_dtype = attrgetter("dtype")
_flatten = chain.from_iterable
_REGISTRIES = attrgetter("_modules", "_parameters", "_buffers")
_REGISTRIES_NO_BUFFERS = attrgetter("_modules", "_parameters")

XXH3_NAME = "xxh3-128"
"""The XXH3 algorithm's name in a digest report."""
ALGORITHMS = (XXH3_NAME, FOLD_NAME)
"""The per-tensor digest algorithms, by the names digest reports carry."""
DigestChoice = Literal["auto", "xxh3", "fold"]
"""Which algorithm a `StateHasher` uses: ``"auto"`` (the fold for a state with a tensor off the
CPU, XXH3 for a state entirely on the CPU), or one forced."""
DIGEST_ENV = "PARAMSYNC_STATE_DIGEST"
"""The environment variable a `StateHasher` built without ``algorithm`` reads its choice from
(unset: ``"auto"``); the torch backend's proof takes its choice from there."""
_CHOICES = ("auto", "xxh3", "fold")


def check_digest_choice(choice: str, where: str = "state_digest") -> DigestChoice:
    """``choice`` if it is a `DigestChoice`; ValueError naming ``where`` otherwise."""
    if choice not in _CHOICES:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, _CHOICES))}, got {choice!r}")
    return choice  # type: ignore[return-value]


class _Dicts:
    """A snapshot of a list of dicts: each one's size, its keys and its values, in order.
    `holds` tells in a few C-level passes that dicts (the same ones or others) hold exactly
    those keys, dict by dict, and the very same value objects."""

    __slots__ = ("keys", "sizes", "values")

    def __init__(self, dicts: list[dict[Any, Any]]) -> None:
        self.sizes = list(map(len, dicts))
        self.keys = list(_flatten(dicts))
        self.values: list[Any] = list(_flatten(map(dict.values, dicts)))

    def holds(self, dicts: list[dict[Any, Any]]) -> bool:
        # Equal sizes and keys: as many values as before, dict by dict.
        return (
            list(map(len, dicts)) == self.sizes
            and list(_flatten(dicts)) == self.keys
            and all(map(is_, _flatten(map(dict.values, dicts)), self.values))
        )


class _ModuleTree:
    """A snapshot of what a module tree has registered: every module's ``_modules``,
    ``_parameters`` and (with ``buffers``) ``_buffers`` dict, each dict's size, keys and values.

    `holds` tells in a few C-level passes over all those dicts at once that nothing was
    registered, replaced, renamed, moved or removed anywhere in the tree since (torch registers
    every submodule, parameter and buffer in those dicts, so a tree whose dicts hold the same
    keys and the same objects yields the same ``named_parameters()`` and ``named_buffers()``).
    The sizes keep each dict's own contents apart: a parameter moved to the next module under
    its own name leaves the keys and values flattened over the tree as they were. Measured on a
    peft LoRA model of 104 modules: about 25 times cheaper than walking ``named_parameters()``
    and ``named_buffers()`` (170 µs), which was most of a planned digest's cost."""

    __slots__ = ("getter", "model", "modules", "registries")

    def __init__(self, model: torch.nn.Module, buffers: bool) -> None:
        self.model = model
        self.modules = list(model.modules())
        self.getter = _REGISTRIES if buffers else _REGISTRIES_NO_BUFFERS
        self.registries = _Dicts(self._dicts())

    def _dicts(self) -> list[dict[str, Any]]:
        return list(_flatten(map(self.getter, self.modules)))

    def holds(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` is the snapshot's model with exactly the snapshot's registrations."""
        return model is self.model and self.registries.holds(self._dicts())


class StateDigest:
    """The whole-state digest and each tensor's digest, in order.

    ``names`` and ``packed`` are the same per-tensor digests as the coordinator's packed form:
    the names in order, and the digests concatenated (16 bytes each). The whole digest is the
    XXH3-128 of ``packed``: without ``digest``, it is computed. ``algorithm``: the name of the
    algorithm that computed the tensors' digests (`ALGORITHMS`); digests of different
    algorithms are never equal.
    """

    def __init__(
        self,
        digest: bytes | None,
        tensors: list[tuple[str, bytes]],
        names: tuple[str, ...] | None = None,
        *,
        algorithm: str = XXH3_NAME,
    ) -> None:
        self.algorithm = algorithm
        self.tensors = tensors
        self.names = names if names is not None else tuple(name for name, _ in tensors)
        self.packed = b"".join(value for _, value in tensors)
        self.digest = _digest128(self.packed) if digest is None else digest

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, StateDigest)
            and self.digest == other.digest
            and self.algorithm == other.algorithm
        )

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return (
            f"StateDigest({self.digest.hex()[:16]}..., {len(self.tensors)} tensors, "
            f"{self.algorithm})"
        )


def _state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, buffers: bool = True
) -> list[tuple[str, Any]]:
    """Every parameter, buffer (unless ``buffers`` is False) and optimizer-state value with its
    stable name, in the fixed order; the values as they are held (parameters not detached,
    optimizer scalars not yet tensors)."""
    named = list(model.named_parameters())
    items: list[tuple[str, Any]] = [(f"param/{name}", param) for name, param in named]
    if buffers:
        items += [(f"buffer/{name}", buffer) for name, buffer in model.named_buffers()]
    if optimizer is not None:
        names = {id(param): name for name, param in named}
        states = optimizer.state
        for group_index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                state = states.get(param)
                if not state:
                    continue
                label = names.get(id(param), f"group{group_index}")
                for key in sorted(state):
                    items.append((f"optim/{label}/{key}", state[key]))
    return items


def named_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, buffers: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """Every parameter, buffer (unless ``buffers`` is False) and optimizer-state tensor with a
    stable name, in a fixed order: the tensors the digest covers and a re-sync copies."""
    return [
        (name, value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value))
        for name, value in _state_tensors(model, optimizer, buffers)
    ]


_SCALARS = (bool, int, float, str, bytes, type(None))


def _plain(item: Any) -> Any:
    """``item`` with dict keys as sorted strings, tuples as lists and tensors as their values."""
    if isinstance(item, _SCALARS):
        return item
    if isinstance(item, dict):
        return {str(key): _plain(item[key]) for key in sorted(item, key=str)}
    if isinstance(item, list | tuple):
        return [_plain(x) for x in item]
    if isinstance(item, torch.Tensor):
        return item.detach().cpu().tolist()
    return item  # CBOR refuses it below, by name


def _canonical(value: Any, where: str) -> bytes:
    """A deterministic CBOR encoding of a small non-tensor state (param groups, a scheduler's
    state_dict): keys sorted, tuples as lists, tensors as their values, floats always 64-bit
    (cbor2's ``canonical`` mode would also sort, at eight times the cost). TypeError naming
    ``where`` for anything CBOR cannot carry (a scheduler holding a callable object's
    attributes, say)."""
    try:
        return cbor2.dumps(_plain(value))
    except (TypeError, ValueError, cbor2.CBOREncodeError) as err:
        raise TypeError(f"{where} cannot be digested: {err}") from None


_GROUPS = "optim/param_groups"
_SCHEDULER = "sched/state"
_META_SEEDS = {name: _seed64(name.encode()) for name in (_GROUPS, _SCHEDULER)}


def _encode_groups(groups: list[dict[str, Any]]) -> bytes:
    """The param groups' hyperparameters (learning rates included, the parameters left out),
    canonically encoded."""
    plain = [{key: value for key, value in group.items() if key != "params"} for group in groups]
    return _canonical(plain, "the optimizer's param groups")


def _meta_digest(name: str, encoded: bytes) -> tuple[str, bytes]:
    return name, _digest128(encoded, _META_SEEDS[name])


_IMMUTABLE = frozenset((bool, int, float, str, bytes, type(None)))


def _immutable(value: Any) -> bool:
    """Whether ``value`` can never change while it is the same object (exact scalar types and
    tuples of them: not a tensor, a list or a subclass that might hold mutable state)."""
    kind = type(value)
    if kind is tuple:
        return all(map(_immutable, value))
    return kind in _IMMUTABLE


class _EncodedGroups:
    """The param groups' digest entry, kept while the groups hold the same keys and the very same
    values: an LR scheduler's step stores a new float object, and any other change replaces a
    value too, since only immutable values are ever kept (a tensor learning rate, changed in
    place, is encoded afresh every time). Values are compared by identity, so ``1`` and ``1.0``, or
    ``0.0`` and ``-0.0``, never pass for each other."""

    __slots__ = ("entry", "groups")

    def __init__(self, groups: list[dict[str, Any]], entry: tuple[str, bytes]) -> None:
        self.entry = entry
        self.groups = _Dicts(groups)

    @staticmethod
    def cacheable(groups: list[dict[str, Any]]) -> bool:
        return all(
            type(key) is str and (key == "params" or _immutable(value))
            for group in groups
            for key, value in group.items()
        )

    def holds(self, groups: list[dict[str, Any]]) -> bool:
        return self.groups.holds(groups)


class _View:
    """A tensor's cached byte view and header seed, valid while its storage stays put."""

    __slots__ = ("data", "dtype", "pointer", "seed", "shape", "stride", "tensor")

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.pointer = tensor.data_ptr()
        self.shape = tensor.shape
        self.stride = tensor.stride()
        self.dtype = tensor.dtype
        self.data = _bytes_of(tensor.detach())
        self.seed = _seed64(f"{name}|{list(tensor.shape)}|{tensor.dtype}|".encode())

    def fits(self, tensor: torch.Tensor) -> bool:
        return (
            tensor is self.tensor
            and tensor.data_ptr() == self.pointer
            and tensor.shape == self.shape
            and tensor.stride() == self.stride
            and tensor.dtype == self.dtype
        )


def _bytes_of(tensor: torch.Tensor) -> Any:
    """A zero-copy buffer over a contiguous CPU tensor's bytes (numpy's view is the cheapest;
    dtypes numpy lacks, bfloat16 among them, take `tensor_buffer`)."""
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError):
        return tensor_buffer(tensor)


def _cacheable(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and value.layout == torch.strided
        and value.is_contiguous()
    )


_NO_STATE: dict[str, Any] = {}


class _Plan:
    """What the last full walk hashed, and how to tell in a few C-level passes that the state
    still has exactly that layout: the same registrations in the module tree (so the same
    parameter and buffer names and objects), the same optimizer parameters in the same groups
    with the same state keys and state objects, and every tensor over the same storage, shape,
    strides and dtype. Built only when every tensor is a cacheable CPU tensor.

    The checks go through the tensors in the order the model and ``optimizer.state`` hold them
    (each state dict in insertion order, the cheapest to list), not the digest's name order;
    the plan is used only if both orders hold exactly the same tensors (`covers`)."""

    __slots__ = (
        "data",
        "dtypes",
        "group_sizes",
        "model",
        "names",
        "optimizer",
        "optimizer_params",
        "pointers",
        "scheduler",
        "seeds",
        "shapes",
        "state",
        "strides",
        "tensors",
        "tree",
    )

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Scheduler | None,
        buffers: bool,
        names: tuple[str, ...],
        views: list[_View],
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.names = names
        """Every entry's name: the tensors' (one per view), then the non-tensor parts'."""
        self.tree = _ModuleTree(model, buffers)
        tensors: list[Any] = [param for _, param in model.named_parameters()]
        if buffers:
            tensors += [buffer for _, buffer in model.named_buffers()]
        self.group_sizes: list[int] = []
        self.optimizer_params: list[Any] = []
        entries: list[dict[str, Any]] = []
        if optimizer is not None:
            self.group_sizes = _group_sizes(optimizer)
            self.optimizer_params = _optimizer_params(optimizer)
            state = optimizer.state
            entries = [state.get(param) or _NO_STATE for param in self.optimizer_params]
        self.state = _Dicts(entries)
        tensors += self.state.values
        self.tensors = tensors
        self.pointers = list(map(_data_ptr, tensors))
        self.shapes = list(map(_shape, tensors))
        self.strides = list(map(_stride, tensors))
        self.dtypes = list(map(_dtype, tensors))
        self.data = [view.data for view in views]
        self.seeds = [view.seed for view in views]

    def covers(self, views: list[_View]) -> bool:
        """Whether the plan checks exactly the tensors of ``views`` (the full walk's, in name
        order), each once per view."""
        return sorted(map(id, self.tensors)) == sorted(id(view.tensor) for view in views)

    def holds(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Scheduler | None = None,
    ) -> bool:
        """Whether the state of ``model``, ``optimizer`` and ``scheduler`` still has this plan's
        layout."""
        if model is not self.model or optimizer is not self.optimizer:
            return False
        if scheduler is not self.scheduler:
            return False
        # The same registrations give the same named parameters and buffers, in order: the
        # module part of ``tensors`` is those very objects, checked already.
        if not self.tree.holds(model):
            return False
        if optimizer is not None:
            params = _optimizer_params(optimizer)
            if (
                len(params) != len(self.optimizer_params)
                or not all(map(is_, params, self.optimizer_params))
                or _group_sizes(optimizer) != self.group_sizes
            ):
                return False
            state = optimizer.state
            entries = [state.get(param) or _NO_STATE for param in params]
            if not self.state.holds(entries):
                return False
        tensors = self.tensors
        return (
            list(map(_data_ptr, tensors)) == self.pointers
            and list(map(_shape, tensors)) == self.shapes
            and list(map(_stride, tensors)) == self.strides
            and list(map(_dtype, tensors)) == self.dtypes
        )

    def digest(self, meta: list[tuple[str, bytes]]) -> StateDigest:
        """The digest of the planned tensors now and ``meta`` (the non-tensor entries' names and
        digests, whose names the plan holds too)."""
        digests = list(map(_digest128, self.data, self.seeds))
        digests += [digest for _, digest in meta]
        return StateDigest(None, list(zip(self.names, digests)), self.names)


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[Any]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def _group_sizes(optimizer: torch.optim.Optimizer) -> list[int]:
    return [len(group["params"]) for group in optimizer.param_groups]


class PendingDigest:
    """A `StateDigest` on its way: `ready` tells whether its device work has landed on the host,
    `result` gives it (waiting for the device if it has not). A digest computed on the host is
    ready at once."""

    __slots__ = ("_done", "_entries", "_meta", "_names", "_parts")

    def __init__(
        self,
        done: StateDigest | None = None,
        *,
        names: tuple[str, ...] = (),
        parts: list[tuple[list[int], FoldLayout, DeviceReadback]] | None = None,
        meta: list[tuple[str, bytes]] | None = None,
    ) -> None:
        self._done = done
        self._names = names
        self._parts = parts or []
        self._meta = meta or []
        self._entries = len(names) - len(self._meta)

    def ready(self) -> bool:
        return self._done is not None or all(readback.ready() for *_, readback in self._parts)

    def result(self) -> StateDigest:
        if self._done is None:
            digests: list[bytes] = [b""] * self._entries
            for indexes, layout, readback in self._parts:
                for index, entry in zip(indexes, layout.entries(readback.result()), strict=True):
                    digests[index] = entry
            digests += [digest for _, digest in self._meta]
            per_tensor = list(zip(self._names, digests, strict=True))
            self._done = StateDigest(None, per_tensor, self._names, algorithm=FOLD_NAME)
            self._parts = []
        return self._done


class StateHasher:
    """Computes `StateDigest`s of one model, optimizer and scheduler, step after step, cheaply.

    Holds a byte view of each tensor between calls (so it keeps those tensors alive); views of
    tensors that left the state are dropped at the next digest. ``buffers=False`` leaves the
    model's buffers out (buffers kept local on each rank, see the module docstring). The param
    groups' encoding is kept while the groups hold the very same immutable values.
    ``algorithm``: a `DigestChoice` (None: the ``PARAMSYNC_STATE_DIGEST`` environment
    variable's, ``"auto"`` when it is unset).
    """

    def __init__(self, *, buffers: bool = True, algorithm: str | None = None) -> None:
        self.buffers = buffers
        if algorithm is None:
            choice = check_digest_choice(os.environ.get(DIGEST_ENV, "auto"), DIGEST_ENV)
        else:
            choice = check_digest_choice(algorithm)
        self.algorithm: DigestChoice = choice
        self._views: dict[str, _View] = {}
        self._names: tuple[str, ...] = ()
        self._plan: _Plan | None = None
        self._groups: _EncodedGroups | None = None
        self._layouts: dict[torch.device, tuple[tuple[str, ...], FoldLayout]] = {}

    def digest(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Scheduler | None = None,
    ) -> StateDigest:
        """The digest of the model's parameters and buffers, the optimizer's state and the
        scheduler's state now (waiting for a device fold's result, `start`)."""
        return self.start(model, optimizer, scheduler).result()

    def start(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Scheduler | None = None,
    ) -> PendingDigest:
        """Start the digest of the state now: the fold's work is enqueued on each device after
        the work already there (the optimizer step), and its result read when it has landed;
        XXH3 hashes the host bytes at once (a device tensor copied to the host through the
        device-operations seam and waited for by that copy's event, C-STREAMSYNC-001). The
        seam (`context_device_ops`) also says which tensors are on the device."""
        meta = self._meta(optimizer, scheduler)
        plan = self._plan
        if (
            self.algorithm != "fold"
            and plan is not None
            and plan.holds(model, optimizer, scheduler)
        ):
            return PendingDigest(plan.digest(meta))
        items = _state_tensors(model, optimizer, self.buffers)
        ops = context_device_ops()
        if self.algorithm == "fold" or (self.algorithm == "auto" and _on_device(items, ops)):
            self._plan = None
            return self._fold(items, meta, ops)
        return PendingDigest(self._walk(model, optimizer, scheduler, meta, items))

    def _fold(
        self, items: list[tuple[str, Any]], meta: list[tuple[str, bytes]], ops: DeviceOps
    ) -> PendingDigest:
        """Enqueue the fold of ``items``' tensors, one pass per device."""
        by_device: dict[torch.device, list[int]] = {}
        tensors: list[torch.Tensor] = []
        for index, (_, value) in enumerate(items):
            tensor = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors.append(tensor)
            by_device.setdefault(tensor.device, []).append(index)
        parts = []
        layouts: dict[torch.device, tuple[tuple[str, ...], FoldLayout]] = {}
        for device, indexes in by_device.items():
            names = tuple(items[i][0] for i in indexes)
            group = [tensors[i] for i in indexes]
            kept = self._layouts.get(device)
            if kept is not None and kept[0] == names and kept[1].fits(group):
                layout = kept[1]
            else:
                headers = [entry_header(n, t.shape, t.dtype) for n, t in zip(names, group)]
                layout = FoldLayout(headers, group)
            layouts[device] = (names, layout)
            parts.append((indexes, layout, DeviceReadback(layout.launch(group), ops)))
        self._layouts = layouts
        names = tuple(name for name, _ in items) + tuple(name for name, _ in meta)
        return PendingDigest(names=names, parts=parts, meta=meta)

    def _meta(
        self, optimizer: torch.optim.Optimizer | None, scheduler: Scheduler | None
    ) -> list[tuple[str, bytes]]:
        """The non-tensor entries' digests: the param groups' (kept while they hold,
        `_EncodedGroups`) and the scheduler's ``state_dict()``'s."""
        meta = []
        if optimizer is not None:
            groups = optimizer.param_groups
            kept = self._groups
            if kept is not None and kept.holds(groups):
                meta.append(kept.entry)
            else:
                entry = _meta_digest(_GROUPS, _encode_groups(groups))
                meta.append(entry)
                cacheable = _EncodedGroups.cacheable(groups)
                self._groups = _EncodedGroups(groups, entry) if cacheable else None
        if scheduler is not None:
            encoded = _canonical(scheduler.state_dict(), "the LR scheduler's state_dict")
            meta.append(_meta_digest(_SCHEDULER, encoded))
        return meta

    def _walk(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Scheduler | None,
        meta: list[tuple[str, bytes]],
        items: list[tuple[str, Any]],
    ) -> StateDigest:
        """The full walk (XXH3): every tensor of ``items`` hashed, its view reused if it still
        fits; a plan for later digests once the same layout was seen twice."""
        self._plan = None
        self._layouts = {}
        views = self._views
        fresh: dict[str, _View] = {}
        per_tensor = []
        for name, value in items:
            view = views.get(name)
            if view is None or not view.fits(value):
                if _cacheable(value):
                    view = _View(name, value)
                else:
                    view = _View(name, _host_copy(value, context_device_ops()))
                    view.tensor = None  # a one-off copy: never reused
            if view.tensor is not None:
                fresh[name] = view
            per_tensor.append((name, _digest128(view.data, view.seed)))
        self._views = fresh
        per_tensor += meta
        names = tuple(name for name, _ in items) + tuple(name for name, _ in meta)
        repeated = names == self._names
        if repeated:
            names = self._names  # the same object while the layout holds: cheap to compare
        self._names = names
        # A layout seen twice, every tensor cacheable: later digests may skip this walk (a
        # one-off digest, as `state_digest`'s, never pays for the plan).
        if repeated and len(fresh) == len(items):
            planned = [fresh[name] for name, _ in items]
            plan = _Plan(model, optimizer, scheduler, self.buffers, names, planned)
            # The plan's own checks must find exactly the tensors this walk hashed, or it is
            # unused.
            if plan.covers(planned) and plan.holds(model, optimizer, scheduler):
                self._plan = plan
        return StateDigest(None, per_tensor, names)


def _on_device(items: list[tuple[str, Any]], ops: DeviceOps) -> bool:
    """Whether a tensor of ``items`` lives on the device (an accelerator, as ``ops`` says)."""
    return any(isinstance(v, torch.Tensor) and ops.on_device(v) for _, v in items)


def _host_copy(value: Any, ops: DeviceOps) -> torch.Tensor:
    """A contiguous CPU tensor holding ``value`` (a scalar, a strided view, or a device tensor
    copied through ``ops`` and waited for by that copy's own event, never a synchronize)."""
    if not isinstance(value, torch.Tensor):
        return torch.tensor(value)
    value = value.detach()
    if value.device.type == "cpu" or not ops.on_device(value):
        return value.to("cpu").contiguous()
    host = torch.empty(value.shape, dtype=value.dtype)
    stream = ops.current_stream(value.device)
    ops.wait_host(ops.copy_to_host(value.contiguous(), host, stream, DIGEST_PURPOSE))
    return host


def state_digest(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Scheduler | None = None,
    *,
    buffers: bool = True,
    algorithm: str | None = None,
) -> StateDigest:
    """Hash the model's parameters and buffers (unless ``buffers`` is False), the optimizer's
    state and the scheduler's state once, with ``algorithm`` (a `DigestChoice`, None: as
    `StateHasher`); a training loop that digests every step keeps a `StateHasher` instead."""
    return StateHasher(buffers=buffers, algorithm=algorithm).digest(model, optimizer, scheduler)
