"""What one torch.distributed call is, as the coordinator compares it (pure: no I/O).

Every collective a torch process group runs on paramsync is first described as a `Call`: the
operation, its reduce op or root, and the shape and dtype of every tensor it takes. The
coordinator receives each rank's description as the bucket spec of a ``ready`` report (its
first entry names the call, the others are the tensors) and sends the go only when every
member described the same call; otherwise it stops the run naming the ranks and both calls
(`paramsync.runtime.coordinator.events.spec_text` prints a call entry as the call). Two ranks that
call ``all_reduce`` and ``broadcast`` at the same point, or all-reduce different shapes, are
therefore stopped before any byte of data moves. A call whose bytes go through the group's
inner torch group names it (``allreduce(sum) on nccl``): ranks that would run the same call on
different planes (a CUDA tensor on one, a CPU tensor on another) are stopped the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paramsync.runtime.coordinator.events import dtype_name
from paramsync.runtime.protocol.messages import CALL_PREFIX, BucketSpec

if TYPE_CHECKING:
    import torch

__all__ = ["Call", "REDUCE_OPS", "reduce_op_name", "UnsupportedCall"]

REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")
"""The reduce ops the backend runs (torch's ``ReduceOp`` names, lower case)."""


class UnsupportedCall(RuntimeError):
    """A torch.distributed operation or argument this backend does not run (the message
    names it and says what to use instead)."""


def reduce_op_name(op: object) -> str:
    """The lower-case name of a torch ``ReduceOp`` (or its ``RedOpType``)."""
    kind = getattr(op, "op", op)
    name = getattr(kind, "name", None)
    if not isinstance(name, str):
        raise UnsupportedCall(f"reduce op {op!r} is not one of torch's ReduceOp values")
    name = name.lower()
    if name not in REDUCE_OPS:
        raise UnsupportedCall(
            f"reduce op {name.upper()} is not supported by the paramsync backend "
            f"(supported: {', '.join(op.upper() for op in REDUCE_OPS)})"
        )
    return name


@dataclass(frozen=True)
class Call:
    """One collective as its callers see it: ``op`` ("allreduce", "broadcast", ...),
    ``detail`` (its reduce op, root or other arguments that must agree, as text), the
    (shape, dtype) of each tensor in the order the call takes them, and ``plane``: the inner
    torch group that carries its bytes ("nccl", "gloo"; empty: paramsync's own mesh)."""

    op: str
    detail: str
    tensors: tuple[tuple[tuple[int, ...], str], ...]
    plane: str = ""

    @classmethod
    def of(cls, op: str, tensors: Sequence[torch.Tensor], detail: str = "") -> Call:
        """The call ``op`` over ``tensors``."""
        return cls(
            op,
            detail,
            tuple((tuple(int(d) for d in t.shape), dtype_name(t.dtype)) for t in tensors),
        )

    @property
    def name(self) -> str:
        """The call as text: ``allreduce(sum)``, or ``allreduce(sum) on gloo`` on an inner
        group."""
        text = f"{self.op}({self.detail})"
        return f"{text} on {self.plane}" if self.plane else text

    def spec(self) -> BucketSpec:
        """The call as a bucket spec: a first entry naming it, then one per tensor."""
        return (((), f"{CALL_PREFIX}{self.name}"), *self.tensors)

    def __str__(self) -> str:
        shapes = ", ".join(f"{list(shape)} {dtype}" for shape, dtype in self.tensors)
        return f"{self.name} of [{shapes}]"
