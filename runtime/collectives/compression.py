"""Gradient compression for the bucketed all-reduce: torch DDP's communication hooks.

A `GradientReducer` averages one gradient bucket's flat buffer across the group, in place, with
whatever all-reduce it is handed (the caller's, over its transport), and says how many bytes it
all-reduced. One reducer lives per bucket for an epoch and keeps that bucket's state.

- ``none`` (`AverageReducer`): the plain average, as without a hook.
- ``fp16`` / ``bf16`` (`CastReducer`): torch's ``fp16_compress_hook`` / ``bf16_compress_hook``.
  The float32 (or float64) bucket is cast to the low precision, divided by the world size there
  (before the sum, so fp16 does not overflow), all-reduced (sum) in that dtype and cast back:
  half the bytes of float32 on the wire. The ring and the shared-memory plane each reduce an
  element on one rank and copy that result to every rank, so every rank casts back the same
  bits.
- ``powersgd`` (`PowerSGDReducer`): torch's ``powerSGD_hook`` (Vogels et al. 2019), with its
  `PowerSGDState` parameters. Before ``start_powerSGD_iter`` steps it is the plain average.
  Then each gradient M of two or more dimensions, viewed as ``shape[0] x rest``, that is worth
  compressing at ``matrix_approximation_rank`` r (``(n + m) r min_compression_rate < n m``) is
  sent as two thin matrices: P = M Q, all-reduced (sum) and orthogonalized (Gram-Schmidt for
  r <= 2, QR above, as torch does), then Q = M^T P, all-reduced and averaged; every rank then
  writes M ~= P Q^T from the same reduced P and Q, so the applied gradients are bitwise
  identical. The other tensors (vectors, scalars, small matrices) go uncompressed in one
  averaged all-reduce first. Error feedback keeps, per rank, what the applied gradient missed of
  this rank's own (gradient + previous error), and adds it to the next step's gradient; warm
  start reuses the last averaged Q as the next step's start. The first Q is drawn from a normal
  distribution by a generator seeded from the bucket's index, identically on every rank (with
  torch's seeds: `_bucket_seed`).

Every reducer works on CPU float buffers; a bucket of another dtype (integers, or already half
precision) is reduced plainly whatever the hook. Ranks must agree on the hook: `tag_spec` marks
it in the bucket spec that the coordinator checks, so a rank with another hook is named, not
silently mixed in.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from paramsync.runtime.collectives.ring import ReduceOp

__all__ = [
    "COMM_HOOKS",
    "AllReduce",
    "GradientReducer",
    "AverageReducer",
    "CastReducer",
    "PowerSGDReducer",
    "COMPRESSIBLE_DTYPES",
    "check_comm_options",
    "compress_cast",
    "make_reducer",
    "orthogonalize",
    "tag_spec",
]

COMM_HOOKS: tuple[str, ...] = ("none", "fp16", "bf16", "powersgd")
"""The gradient communication hooks a trainer can use (``TrainerOptions.comm_hook``)."""

COMPRESSIBLE_DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.float64})
"""Bucket dtypes a hook compresses; other buckets are averaged plainly."""

AllReduce = Callable[[torch.Tensor, ReduceOp], Awaitable[object]]
"""Reduce a contiguous CPU tensor across the group in place (``"sum"`` or ``"avg"``)."""


class GradientReducer(Protocol):
    """Averages one bucket's gradients across the group with some compression."""

    @property
    def label(self) -> str:
        """What the bucket spec carries for this hook ('' for a plain average)."""
        ...

    def payload_bytes(self) -> int:
        """Bytes the next `reduce` will all-reduce (each rank's share of the traffic)."""
        ...

    async def reduce(self, flat: torch.Tensor, world_size: int, all_reduce: AllReduce) -> int:
        """Replace ``flat`` with the group's (approximate) average; return the bytes it
        all-reduced."""
        ...


def check_comm_options(comm_hook: str, powersgd_rank: int, powersgd_start_iter: int) -> None:
    """Refuse a hook name or PowerSGD setting that cannot work, naming it."""
    if comm_hook not in COMM_HOOKS:
        raise ValueError(f"comm_hook must be one of {', '.join(COMM_HOOKS)}; got {comm_hook!r}")
    if isinstance(powersgd_rank, bool) or not isinstance(powersgd_rank, int):
        raise ValueError(f"powersgd_rank must be an integer, got {powersgd_rank!r}")
    if powersgd_rank < 1:
        raise ValueError(f"powersgd_rank must be >= 1, got {powersgd_rank}")
    if isinstance(powersgd_start_iter, bool) or not isinstance(powersgd_start_iter, int):
        raise ValueError(f"powersgd_start_iter must be an integer, got {powersgd_start_iter!r}")
    if powersgd_start_iter < 0:
        raise ValueError(f"powersgd_start_iter must be >= 0, got {powersgd_start_iter}")


def make_reducer(
    comm_hook: str,
    index: int,
    shapes: Sequence[Sequence[int]],
    dtype: torch.dtype,
    *,
    powersgd_rank: int = 1,
    powersgd_start_iter: int = 2,
    random_seed: int = 0,
) -> GradientReducer:
    """The reducer of bucket ``index`` (its tensors' ``shapes``, its ``dtype``) for a hook."""
    check_comm_options(comm_hook, powersgd_rank, powersgd_start_iter)
    numel = sum(math.prod(shape) for shape in shapes)
    if comm_hook == "none" or dtype not in COMPRESSIBLE_DTYPES:
        return AverageReducer(numel, dtype)
    if comm_hook == "fp16":
        return CastReducer(numel, torch.float16)
    if comm_hook == "bf16":
        return CastReducer(numel, torch.bfloat16)
    return PowerSGDReducer(
        shapes,
        dtype,
        matrix_approximation_rank=powersgd_rank,
        start_powerSGD_iter=powersgd_start_iter,
        seed=_bucket_seed(random_seed, index),
    )


def tag_spec(spec: list[list[object]], label: str) -> list[list[object]]:
    """A bucket spec ([[shape, dtype], ...]) with the hook marked on each dtype
    (``float32+fp16``), so that ranks using different hooks disagree on the spec."""
    if not label:
        return spec
    return [[shape, f"{dtype}+{label}"] for shape, dtype in spec]


def _bucket_seed(random_seed: int, index: int) -> int:
    """The seed of bucket ``index``'s first Q, the same on every rank: torch's, which draws
    one ``randint(1_000_000_000)`` per bucket from ``numpy.random.RandomState(random_seed)``
    as buckets first compress (in index order, where its buckets first compress so)."""
    rng = np.random.RandomState(random_seed)
    return int(rng.randint(1_000_000_000, size=index + 1)[index])


class AverageReducer:
    """The plain average (no hook)."""

    label = ""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self._bytes = numel * torch.empty((), dtype=dtype).element_size()

    def payload_bytes(self) -> int:
        return self._bytes

    async def reduce(self, flat: torch.Tensor, world_size: int, all_reduce: AllReduce) -> int:
        await all_reduce(flat, "avg")
        return flat.numel() * flat.element_size()


class CastReducer:
    """torch's ``fp16_compress_hook`` / ``bf16_compress_hook``: cast, divide, sum, cast back."""

    def __init__(self, numel: int, wire_dtype: torch.dtype) -> None:
        if wire_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"a cast hook sends float16 or bfloat16, not {wire_dtype}")
        self.wire_dtype = wire_dtype
        self.label = "fp16" if wire_dtype == torch.float16 else "bf16"
        self._bytes = numel * torch.empty((), dtype=wire_dtype).element_size()

    def payload_bytes(self) -> int:
        return self._bytes

    async def reduce(self, flat: torch.Tensor, world_size: int, all_reduce: AllReduce) -> int:
        low = compress_cast(flat, self.wire_dtype, world_size)
        if low.numel():
            await all_reduce(low, "sum")
        flat.copy_(low)
        return low.numel() * low.element_size()


def compress_cast(flat: torch.Tensor, wire_dtype: torch.dtype, world_size: int) -> torch.Tensor:
    """``flat`` in ``wire_dtype``, divided by ``world_size`` there (torch's order: the sum of
    the pre-divided values cannot overflow where the gradients do not)."""
    return flat.to(wire_dtype).div_(world_size)


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Orthonormalize the columns of each matrix of a batch (``[batch, rows, cols]``, cols <=
    rows) in place, as torch's PowerSGD does: Gram-Schmidt for at most 2 columns (or half
    precision), QR above. A column that is all zeros stays zeros (torch's would be NaN with
    ``epsilon`` 0; everything else is bitwise torch's)."""
    if matrices.dim() != 3 or matrices.shape[2] > matrices.shape[1]:
        raise ValueError(f"orthogonalize needs [batch, rows, cols<=rows], got {matrices.shape}")
    cols = matrices.shape[2]
    if cols <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(cols):
            col = matrices[:, :, i : i + 1]
            norm = torch.norm(col, dim=1, keepdim=True)
            if epsilon:
                norm = norm + epsilon
            else:
                norm = torch.where(norm == 0, torch.ones_like(norm), norm)
            col /= norm
            if i + 1 < cols:
                rest = matrices[:, :, i + 1 :]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
        return
    q, _ = torch.linalg.qr(matrices)
    matrices.copy_(q)


class PowerSGDReducer:
    """torch's ``powerSGD_hook`` for one bucket: low-rank P and Q instead of the gradients.

    The parameters mirror torch's `PowerSGDState`; ``seed`` draws the first Q (torch seeds
    its global generator with it; `make_reducer` gives bucket i torch's i-th seed).
    """

    label: str

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        dtype: torch.dtype = torch.float32,
        *,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 2,
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        seed: int = 0,
    ) -> None:
        if matrix_approximation_rank < 1:
            raise ValueError(
                f"matrix_approximation_rank must be >= 1, got {matrix_approximation_rank}"
            )
        if start_powerSGD_iter < 0:
            raise ValueError(f"start_powerSGD_iter must be >= 0, got {start_powerSGD_iter}")
        self.rank = matrix_approximation_rank
        self.start_iter = start_powerSGD_iter
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.epsilon = orthogonalization_epsilon
        self.seed = seed
        self.dtype = dtype
        self.label = f"powersgd{matrix_approximation_rank}@{start_powerSGD_iter}"
        self.iter = 0
        """Reductions done: the plain average runs while this is below ``start_iter``."""
        self.shapes = [tuple(int(d) for d in shape) for shape in shapes]
        self.numel = sum(math.prod(shape) for shape in self.shapes)
        # Each tensor's slice of the flat buffer, and which are compressed (as torch decides).
        self._slices: list[tuple[int, int]] = []
        self._matrices: list[tuple[int, int, int, int]] = []
        """Compressed tensors: (index, rows, cols, rank), grouped by shape as torch does."""
        uncompressed: list[int] = []
        groups: dict[tuple[int, int], list[int]] = {}
        offset = 0
        for index, shape in enumerate(self.shapes):
            count = math.prod(shape)
            self._slices.append((offset, offset + count))
            offset += count
            if len(shape) >= 2 and count:
                rows, cols = shape[0], count // shape[0]
                rank = min(rows, cols, self.rank)
                if (rows + cols) * rank * min_compression_rate < rows * cols:
                    groups.setdefault((rows, cols), []).append(index)
                    continue
            uncompressed.append(index)
        self._uncompressed = uncompressed
        for (rows, cols), members in groups.items():
            rank = min(rows, cols, self.rank)
            self._matrices.extend((index, rows, cols, rank) for index in members)
        self.p_numel = sum(rows * rank for _, rows, _, rank in self._matrices)
        self.q_numel = sum(cols * rank for _, _, cols, rank in self._matrices)
        self.uncompressed_numel = sum(
            self._slices[i][1] - self._slices[i][0] for i in self._uncompressed
        )
        self._p: torch.Tensor | None = None
        self._q: torch.Tensor | None = None
        self._error: torch.Tensor | None = None

    @property
    def compressing(self) -> bool:
        """Whether the next reduction is compressed (past ``start_powerSGD_iter``)."""
        return self.iter >= self.start_iter

    def payload_bytes(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        if not self.compressing:
            return self.numel * size
        return (self.uncompressed_numel + self.p_numel + self.q_numel) * size

    def error(self) -> torch.Tensor | None:
        """This rank's error-feedback residual (None before the first compressed step)."""
        return self._error

    async def reduce(self, flat: torch.Tensor, world_size: int, all_reduce: AllReduce) -> int:
        if flat.numel() != self.numel:
            raise ValueError(
                f"PowerSGD bucket holds {self.numel} elements, the buffer {flat.numel()}"
            )
        if not self.compressing:
            self.iter += 1
            await all_reduce(flat, "avg")
            return flat.numel() * flat.element_size()
        size = flat.element_size()
        local: torch.Tensor | None = None
        if self.use_error_feedback:
            if self._error is None:
                self._error = torch.zeros_like(flat)
            else:
                flat.add_(self._error)
            local = flat.clone()
        fresh = not self.warm_start or self._p is None
        if fresh:
            self._p = torch.empty(self.p_numel, dtype=flat.dtype)
            self._q = torch.empty(self.q_numel, dtype=flat.dtype)
        assert self._p is not None and self._q is not None
        matrices, ps, qs = self._views(flat, self._p, self._q)
        if fresh:
            generator = torch.Generator().manual_seed(self.seed)
            for q in qs:
                q.copy_(torch.randn(*q.shape, generator=generator, dtype=flat.dtype))
                orthogonalize(q, self.epsilon)
        else:
            for q in qs:
                orthogonalize(q, self.epsilon)
        # Uncompressed tensors: one averaged all-reduce of their concatenation.
        sent = 0
        if self._uncompressed:
            rest = torch.cat([flat[lo:hi] for lo, hi in self._uncompressed_slices()])
            if rest.numel():
                await all_reduce(rest, "avg")
            sent += rest.numel() * size
            at = 0
            for lo, hi in self._uncompressed_slices():
                flat[lo:hi].copy_(rest[at : at + hi - lo])
                at += hi - lo
        if self._matrices:
            for matrix, q, p in zip(matrices, qs, ps):
                torch.bmm(matrix, q, out=p)
            await all_reduce(self._p, "sum")
            for p in ps:
                orthogonalize(p, self.epsilon)
            for matrix, p, q in zip(matrices, ps, qs):
                torch.bmm(matrix.transpose(1, 2), p, out=q)
            await all_reduce(self._q, "avg")
            for p, q, matrix in zip(ps, qs, matrices):
                torch.bmm(p, q.transpose(1, 2), out=matrix)
            sent += (self.p_numel + self.q_numel) * size
        if local is not None:
            torch.sub(local, flat, out=self._error)
        if not self.warm_start:
            self._p = self._q = None
        self.iter += 1
        return sent

    def _uncompressed_slices(self) -> list[tuple[int, int]]:
        return [self._slices[index] for index in self._uncompressed]

    def _views(
        self, flat: torch.Tensor, p_memory: torch.Tensor, q_memory: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Per compressed tensor: its [1, rows, cols] view of ``flat`` and its [1, rows, rank]
        P and [1, cols, rank] Q views of the P and Q memories (torch's layout)."""
        matrices, ps, qs = [], [], []
        p_at = q_at = 0
        for index, rows, cols, rank in self._matrices:
            lo, hi = self._slices[index]
            matrices.append(flat[lo:hi].view(1, rows, cols))
            ps.append(p_memory[p_at : p_at + rows * rank].view(1, rows, rank))
            qs.append(q_memory[q_at : q_at + cols * rank].view(1, cols, rank))
            p_at += rows * rank
            q_at += cols * rank
        return matrices, ps, qs
