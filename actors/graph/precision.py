"""Mixed precision for a worker's actors: autocast around the forward, and a loss scaler.

`MixedPrecision` is what the compute and optimizer actors share (``TrainerOptions``'
``autocast_dtype`` and ``grad_scaler``): the compute actor runs the user's loss function under
``torch.autocast(device_type, dtype)`` and, with a `torch.amp.GradScaler`, runs backward on the
scaled loss; the gradient-comm actor all-reduces the scaled gradients as they are; the optimizer
actor then steps through the scaler, which unscales the averaged gradients, skips the step if any
of them is inf or nan, and backs the scale off (or grows it).

The overflow decision is agreed, not local: it is taken on the *averaged* gradients, which the
all-reduce leaves bitwise identical on every rank, so every rank decides the same; and the
scaler's state (scale and growth tracker, which a skipped step backs off and a taken one grows)
is part of the state digest (`GradScalerDigests`), so a rank that decided otherwise is caught by
the identical-weights check (C-DDP-001) like any other divergence. It is also part of the
training state that checkpoints and a joiner's state transfer carry
(`paramsync.actors.state.training_state`).

A loss scaler is meant for float16 on CUDA (bfloat16 has float32's range and needs none); torch
also implements it for the CPU, where it runs the same code path (the tests use that).
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import cbor2
import torch
import xxhash

from paramsync.actors.state.digest import StateDigest

__all__ = [
    "AUTOCAST_DTYPES",
    "GRAD_SCALER_DIGEST_ENTRY",
    "GradScalerDigests",
    "MixedPrecision",
    "autocast_of",
    "check_precision_options",
]

AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16}
"""The ``autocast_dtype`` names `TrainerOptions` accepts."""

GRAD_SCALER_DIGEST_ENTRY = "amp/grad_scaler"
"""The name of the loss scaler's entry in a state digest."""


def check_precision_options(
    autocast_dtype: str | None,
    grad_scaler: bool,
    init_scale: float,
    growth_interval: int,
    growth_tracker: int = 0,
) -> None:
    """Refuse (ValueError naming the option) mixed-precision options that cannot work on any
    device; what depends on the model's device is checked by `MixedPrecision.for_model`."""
    if autocast_dtype is not None and autocast_dtype not in AUTOCAST_DTYPES:
        raise ValueError(
            f"autocast_dtype must be one of {sorted(AUTOCAST_DTYPES)} or None, got "
            f"{autocast_dtype!r}"
        )
    if grad_scaler and autocast_dtype != "float16":
        raise ValueError(
            "grad_scaler=True scales the loss of float16 autocast: it needs "
            f'autocast_dtype="float16", got {autocast_dtype!r}'
        )
    if not (init_scale > 0 and init_scale < float("inf")):
        raise ValueError(f"grad_scaler_init_scale must be positive and finite, got {init_scale}")
    if growth_interval < 1:
        raise ValueError(f"grad_scaler_growth_interval must be >= 1, got {growth_interval}")
    if growth_tracker < 0:
        raise ValueError(f"grad_scaler_growth_tracker must be >= 0, got {growth_tracker}")


class MixedPrecision:
    """Autocast of one dtype on one device type, and an optional loss scaler.

    Build it with `for_model`, which checks that torch supports the dtype on the model's
    device. ``scaler`` is the `torch.amp.GradScaler` (None without one): its state belongs to the
    training state (pass it as ``grad_scaler`` to `capture_state` and `restore_state`).
    """

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self.scaler = scaler
        self._scaled = False
        """Whether the scaler has scaled a loss in this process (which creates its scale
        tensor, on the loss's device)."""

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        autocast_dtype: str | None,
        grad_scaler: bool = False,
        *,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        growth_tracker: int = 0,
    ) -> MixedPrecision | None:
        """The mixed precision ``model`` trains with (None: ``autocast_dtype`` is None).

        Raises ValueError when autocast of that dtype is not available on the device the
        model's parameters live on, or the model's parameters span several device types.
        ``init_scale`` and ``growth_tracker``: where the scaler starts (a resumed run's)."""
        check_precision_options(
            autocast_dtype, grad_scaler, init_scale, growth_interval, growth_tracker
        )
        if autocast_dtype is None:
            return None
        dtype = AUTOCAST_DTYPES[autocast_dtype]
        devices = {param.device.type for param in model.parameters()}
        if len(devices) > 1:
            raise ValueError(
                f"autocast_dtype={autocast_dtype!r}: the model's parameters are on several "
                f"device types ({sorted(devices)}); autocast takes one"
            )
        device_type = devices.pop() if devices else "cpu"
        if not _autocast_supports(device_type, dtype):
            raise ValueError(
                f"autocast_dtype={autocast_dtype!r}: this torch ({torch.__version__}) has no "
                f"{autocast_dtype} autocast on {device_type!r}"
                + (' (use "bfloat16")' if autocast_dtype == "float16" else "")
            )
        scaler = None
        if grad_scaler:
            scaler = torch.amp.GradScaler(
                device_type, init_scale=init_scale, growth_interval=growth_interval
            )
            if growth_tracker:
                scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": growth_tracker})
        return cls(device_type, dtype, scaler)

    def autocast(self) -> torch.autocast:
        """The context the forward pass (the loss function) runs in."""
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """What backward runs on: the loss times the current scale (the loss without a
        scaler)."""
        if self.scaler is None:
            return loss
        self._scaled = True
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale now, in place, noting any inf or nan
        (nothing without a scaler). What must see the true gradients before the step (clipping
        by norm) calls this first; `step` then does not unscale them again."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step ``optimizer`` with the averaged gradients, through the scaler if there is one
        (unscale, skip on inf/nan, update the scale); returns whether the step was skipped.

        Skipped means the scaler found an inf or nan among the (averaged) gradients: it backs
        the scale off by its backoff factor (< 1), which is how this tells, and never otherwise
        lowers it."""
        if self.scaler is None:
            optimizer.step()
            return False
        if not self._scaled:
            # A worker that computed nothing yet (it only reduces zeros, its data ended):
            # torch's scaler steps only once a loss has made its scale tensor; make it here.
            first = next(p for group in optimizer.param_groups for p in group["params"])
            self.scaled(torch.zeros((), device=first.device))
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() < before

    def scaler_tensors(self) -> list[torch.Tensor]:
        """The loss scaler's changing state as two host tensors, its scale (float64) and its
        growth tracker (int64), for a re-sync to copy ([] without a scaler); received into,
        they go back into a scaler with `load_scaler_tensors`."""
        if self.scaler is None:
            return []
        state = self.scaler.state_dict()
        return [
            torch.tensor([state["scale"]], dtype=torch.float64),
            torch.tensor([state["_growth_tracker"]], dtype=torch.int64),
        ]

    def load_scaler_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Set the loss scaler's scale and growth tracker from `scaler_tensors`' layout."""
        if self.scaler is None:
            return
        scale, tracker = tensors
        state = self.scaler.state_dict()
        state["scale"], state["_growth_tracker"] = float(scale[0]), int(tracker[0])
        self.scaler.load_state_dict(state)


def _autocast_supports(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.autocast(device_type, dtype)`` really computes in ``dtype`` here (torch
    warns and disables autocast for a dtype it lacks on a device, rather than raising)."""
    if not torch.amp.is_autocast_available(device_type):
        return False
    if device_type == "cuda" and not torch.cuda.is_available():
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autocast(device_type, dtype=dtype):
                probe = torch.ones(2, 2, device=device_type)
                return bool((probe @ probe).dtype == dtype)
    except (RuntimeError, AssertionError):
        return False


def _scaler_bytes(scaler: torch.amp.GradScaler) -> bytes:
    """The scaler's state dict (scale, growth tracker, factors, interval) as canonical CBOR."""
    return cbor2.dumps(dict(sorted(scaler.state_dict().items())), canonical=True)


class GradScalerDigests:
    """Appends the loss scaler's state to each state digest of one stream (one optimizer
    actor's), so ranks whose scalers differ (one skipped a step the others took) report
    different digests. The extended names stay one tuple object while the state digest's own
    names do (the optimizer actor sends the names only when they change)."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler
        self._base: tuple[str, ...] | None = None
        self._names: tuple[str, ...] = ()

    def entry(self) -> tuple[str, bytes]:
        """The scaler's entry now: `GRAD_SCALER_DIGEST_ENTRY` and the hash of its state dict
        (scale, growth tracker, factors, interval) as canonical CBOR."""
        return GRAD_SCALER_DIGEST_ENTRY, xxhash.xxh3_128_digest(_scaler_bytes(self.scaler))

    def extend(self, digest: StateDigest, entry: tuple[str, bytes] | None = None) -> StateDigest:
        """``digest`` with one more entry, the scaler's (``entry``, taken earlier; None: now)."""
        if digest.names is not self._base:
            self._base, self._names = digest.names, (*digest.names, GRAD_SCALER_DIGEST_ENTRY)
        if entry is None:
            entry = self.entry()
        return StateDigest(None, [*digest.tensors, entry], self._names, algorithm=digest.algorithm)


def autocast_of(precision: MixedPrecision | None) -> AbstractContextManager[Any]:
    """``precision``'s autocast context, or one that does nothing."""
    return precision.autocast() if precision is not None else nullcontext()
