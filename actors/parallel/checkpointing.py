"""Activation checkpointing: blocks whose activations are recomputed in backward, not stored.

`CheckpointedBlock` wraps one block (or a run of consecutive blocks) of a model: its forward runs
under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, which keeps only the
block's inputs and runs the block's forward again when backward reaches it. The recomputation
must draw the same random numbers as the first forward, or dropout masks differ and the
gradients are wrong (the original "checkpointing" stored clones instead, saving nothing):
``preserve_rng_state=True`` restores torch's global CPU and CUDA generators, and an
``rng_tracker`` (any object with ``get_states()`` and ``set_states(states)``, such as the
tensor-parallel RNG tracker that seeds each tp rank's dropout as Megatron does) is set back to
the states it had at the first forward for the recomputation, then restored. Gradients are then
bitwise those of the unwrapped model.

`checkpoint_blocks` wraps a list of blocks. `SavedTensorMeter` measures what checkpointing is
for, deterministically: the bytes of distinct storages autograd holds for backward (every
tensor saved by an operation, through ``torch.autograd.graph.saved_tensors_hooks``, plus the
inputs a checkpointed block keeps), the model's own parameters left out.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "RngStateTracker",
    "CheckpointedBlock",
    "checkpoint_blocks",
    "SavedTensorMeter",
]


@runtime_checkable
class RngStateTracker(Protocol):
    """An extra source of random numbers whose state a recomputation must replay."""

    def get_states(self) -> Any: ...

    def set_states(self, states: Any) -> None: ...


_METER: contextvars.ContextVar[SavedTensorMeter | None] = contextvars.ContextVar(
    "paramsync_saved_tensor_meter", default=None
)


class CheckpointedBlock(nn.Module):
    """``blocks`` (one module or several, run in order) with their activations recomputed in
    backward. With ``enabled=False``, or where no gradient is being recorded, it runs the blocks
    plainly. The wrapped modules stay reachable as ``self.blocks`` (their parameters are this
    module's)."""

    def __init__(
        self,
        blocks: nn.Module | Sequence[nn.Module],
        *,
        rng_tracker: RngStateTracker | None = None,
        enabled: bool = True,
    ) -> None:
        super().__init__()
        modules = [blocks] if isinstance(blocks, nn.Module) else list(blocks)
        if not modules:
            raise ValueError("CheckpointedBlock needs at least one block")
        if rng_tracker is not None and not isinstance(rng_tracker, RngStateTracker):
            raise TypeError(
                f"rng_tracker must have get_states() and set_states(states), got "
                f"{type(rng_tracker).__name__}"
            )
        self.blocks = nn.ModuleList(modules)
        self.rng_tracker = rng_tracker
        self.enabled = enabled

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        out = self.blocks[0](*args, **kwargs)
        for block in self.blocks[1:]:
            out = block(out)
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled or not torch.is_grad_enabled():
            return self._run(*args, **kwargs)
        meter = _METER.get()
        if meter is not None:
            meter.hold(arg for arg in (*args, *kwargs.values()) if isinstance(arg, torch.Tensor))
        return checkpoint(
            self._replaying(), *args, use_reentrant=False, preserve_rng_state=True, **kwargs
        )

    def _replaying(self) -> Callable[..., Any]:
        """The function checkpoint runs: plainly the first time; on the recomputation with the
        tracker's states as they were at the first run (and put back afterwards)."""
        tracker = self.rng_tracker
        if tracker is None:
            return self._run
        first_states = tracker.get_states()
        calls = 0

        def run(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                return self._run(*args, **kwargs)
            now = tracker.get_states()
            tracker.set_states(first_states)
            try:
                return self._run(*args, **kwargs)
            finally:
                tracker.set_states(now)

        return run


def checkpoint_blocks(
    blocks: Iterable[nn.Module],
    *,
    every: int = 1,
    rng_tracker: RngStateTracker | None = None,
    enabled: bool = True,
) -> nn.ModuleList:
    """Wrap ``blocks`` in `CheckpointedBlock`s of ``every`` consecutive blocks each (the last
    may hold fewer): a model that ran ``for block in blocks: x = block(x)`` runs the returned
    list the same way."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a positive int, got {every!r}")
    modules = list(blocks)
    return nn.ModuleList(
        CheckpointedBlock(modules[start : start + every], rng_tracker=rng_tracker, enabled=enabled)
        for start in range(0, len(modules), every)
    )


class SavedTensorMeter:
    """Bytes of the distinct storages held for backward while the meter is active.

    ``with SavedTensorMeter(model.parameters()) as meter: loss = model(x)...`` then
    ``meter.bytes``. Counts each storage once (a tensor and its views share one), leaves the
    ``exclude`` tensors' storages out (the parameters: held by the model anyway), and counts
    what a `CheckpointedBlock` keeps for its recomputation (its inputs). Tensors saved inside a
    checkpointed region are checkpoint's business, not stored, and not counted.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_storage_key(t)[0] for t in exclude}
        self._storages: dict[int, int] = {}
        self.tensors = 0
        """How many tensors were saved (before deduplication by storage)."""

    @property
    def bytes(self) -> int:
        """Bytes of the distinct storages seen."""
        return sum(self._storages.values())

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors`` as held for backward."""
        for tensor in tensors:
            self.tensors += 1
            pointer, nbytes = _storage_key(tensor)
            if pointer not in self._excluded:
                self._storages[pointer] = max(nbytes, self._storages.get(pointer, 0))

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.hold((tensor,))
        return tensor

    @contextmanager
    def _active(self) -> Iterator[SavedTensorMeter]:
        token = _METER.set(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield self
        finally:
            _METER.reset(token)

    def __enter__(self) -> SavedTensorMeter:
        self._context = self._active()
        return self._context.__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        self._context.__exit__(*exc_info)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()
