"""The coordinator core's vocabulary: the events it is fed that never travel (a tick, a lost
connection, a malformed frame), the actions it returns, and the helpers that describe models and
bucket specs. The wire messages themselves are declared in `paramsync.runtime.protocol.messages`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from paramsync.runtime.errors import plain_or_quoted, quoted
from paramsync.runtime.protocol.messages import (
    CALL_PREFIX,
    AbortRun,
    BucketSpec,
    Digest,
    Finished,
    Heartbeat,
    Joined,
    JoinRefused,
    Ready,
    Reduced,
    ResyncOrder,
    RootMessage,
    Signature,
    StepDone,
)

__all__ = [
    "Message",
    "Tick",
    "Disconnected",
    "Malformed",
    "Event",
    "Send",
    "Broadcast",
    "Refuse",
    "Abort",
    "Resync",
    "Evict",
    "Report",
    "Action",
    "dtype_name",
    "model_signature",
    "bucket_spec",
    "spec_hash",
    "agreement_hash",
    "MAX_WORLD",
    "is_int",
    "format_seconds",
    "spec_text",
    "signature_mismatch",
    "first_tensor_difference",
]

Message = RootMessage
"""What a coordinator's shell sends a peer: a worker the coordinator's kinds
(`CoordinatorMessage`); the tree's root a host those and `DigestQuery` (`RootMessage`)."""

MAX_WORLD = 1 << 16


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Tick:
    """The shell's clock reads ``now`` seconds: time to check heartbeat deadlines."""

    now: float


@dataclass(frozen=True)
class Disconnected:
    """Rank ``rank``'s accepted connection closed or failed."""

    rank: int
    reason: str


@dataclass(frozen=True)
class Malformed:
    """Rank ``rank`` sent something the shell could not parse (``error``: the ProtocolError)."""

    rank: int
    error: str


Event = (
    Joined
    | Ready
    | Reduced
    | Digest
    | StepDone
    | Heartbeat
    | Finished
    | Tick
    | Disconnected
    | Malformed
)
"""What the shell feeds :meth:`CoordinatorCore.handle`."""

# --------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Send:
    """Send ``message`` to rank ``rank``."""

    rank: int
    message: Message


@dataclass(frozen=True)
class Broadcast:
    """Send ``message`` to every member."""

    message: Message


@dataclass(frozen=True)
class Refuse:
    """Refuse the connection whose event was just handled: send ``message``, then close it.

    The run goes on; this rank's accepted connection, if any, is untouched.
    """

    rank: int
    reason: str

    @property
    def message(self) -> JoinRefused:
        return JoinRefused(self.reason)


@dataclass(frozen=True)
class Abort:
    """Stop the run: send ``message`` to every member, close everything."""

    reason: str

    @property
    def message(self) -> AbortRun:
        return AbortRun(self.reason)


@dataclass(frozen=True)
class Resync:
    """Before the commit that follows: ``source_rank`` sends its state to ``targets``.

    Send ``message`` to every rank of ``recipients`` (the source and the targets).
    """

    step: int
    source_rank: int
    targets: tuple[int, ...]

    @property
    def message(self) -> ResyncOrder:
        return ResyncOrder(self.step, self.source_rank, self.targets)

    @property
    def recipients(self) -> tuple[int, ...]:
        return (self.source_rank, *self.targets)


@dataclass(frozen=True)
class Evict:
    """Drop member ``rank`` from the run (elastic runs): tell it ``message``, close its link."""

    rank: int
    reason: str

    @property
    def message(self) -> AbortRun:
        return AbortRun(f"rank {self.rank} was removed from the run: {self.reason}")


@dataclass(frozen=True)
class Report:
    """Log ``text`` (a stall, a membership change): nothing to send."""

    text: str
    level: str = "warning"


Action = Send | Broadcast | Refuse | Abort | Resync | Evict | Report
"""What :meth:`CoordinatorCore.handle` asks the shell to do, in order."""


# --------------------------------------------------------------------------- helpers


def dtype_name(dtype: object) -> str:
    """The dtype string signatures and specs use: ``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def model_signature(named_parameters: Iterable[tuple[str, Any]]) -> Signature:
    """A model's signature from ``model.named_parameters()`` (anything with shape and dtype)."""
    return tuple(
        (name, tuple(int(d) for d in p.shape), dtype_name(p.dtype), bool(p.requires_grad))
        for name, p in named_parameters
    )


def bucket_spec(tensors: Iterable[Any]) -> BucketSpec:
    """A bucket's spec from its gradient tensors, in bucket order."""
    return tuple((tuple(int(d) for d in t.shape), dtype_name(t.dtype)) for t in tensors)


def format_seconds(value: float) -> str:
    return f"{value:.1f}" if abs(value - round(value, 1)) < 1e-9 else f"{value:.3g}"


def spec_hash(spec: BucketSpec | Sequence[Any]) -> str:
    """A bucket spec's short text form, ``"xxh3:"`` and 32 hex digits: what a worker sends in
    a cached ``ready`` instead of the whole spec (one string instead of every shape, on every
    step). Takes a normalized spec or the worker's ``[[dims], dtype]`` list; a hash string is
    its own hash."""
    if isinstance(spec, str):
        return spec
    # Indexed, not unpacked: mypy keeps ``str`` among a ``Sequence``'s cases past the check.
    text = ";".join(f"{','.join(str(d) for d in entry[0])}:{entry[1]}" for entry in spec)
    return "xxh3:" + xxhash.xxh3_128_hexdigest(text.encode())


def agreement_hash(spec_hashes: Mapping[int, str]) -> str:
    """The hash of a whole response-cache agreement, bucket -> `spec_hash`: what a folding
    worker's step report carries for the buckets it reduced without reporting them."""
    text = ";".join(f"{bucket}={spec_hashes[bucket]}" for bucket in sorted(spec_hashes))
    return "xxh3:" + xxhash.xxh3_128_hexdigest(text.encode())


def spec_text(spec: BucketSpec) -> str:
    if isinstance(spec, str):
        return f"spec {quoted(spec)}"
    if spec and isinstance(spec[0][1], str) and spec[0][1].startswith(CALL_PREFIX):
        # A torch.distributed call: its name, then its tensors
        # (`paramsync.actors.torch_backend.calls`).
        call = plain_or_quoted(spec[0][1][len(CALL_PREFIX) :])
        tensors = "; ".join(f"{shape}, {_dtype_text(dtype)}" for shape, dtype in spec[1:])
        return f"{call} of [{tensors}]"
    return "[" + "; ".join(f"{shape}, {_dtype_text(dtype)}" for shape, dtype in spec) + "]"


def _dtype_text(dtype: object) -> str:
    """A peer's dtype name as text: bare when plain ("float32"), else quoted."""
    return plain_or_quoted(dtype)


def _shape_text(shape: object) -> str:
    """A peer's shape as text: a tuple of ints as Python writes it, anything else quoted."""
    if isinstance(shape, tuple) and all(type(d) is int for d in shape):
        return str(shape)
    return quoted(shape)


def signature_mismatch(mine: Signature, ref: Signature) -> str | None:
    """Where ``mine`` first differs from ``ref``: "at parameter 'x': ..." (None if equal)."""
    mine_names = {p[0] for p in mine}
    ref_names = {p[0] for p in ref}
    for index, (m, r) in enumerate(zip(mine, ref)):
        if m[0] != r[0]:
            if r[0] not in mine_names:
                return f"at parameter {quoted(r[0])}: missing"
            if m[0] not in ref_names:
                return f"at parameter {quoted(m[0])}: extra parameter"
            return (
                f"at position {index}: parameter {quoted(m[0])} vs {quoted(r[0])} (order differs)"
            )
        if m[1] != r[1]:
            shapes = f"{_shape_text(m[1])} vs {_shape_text(r[1])}"
            return f"at parameter {quoted(m[0])}: shape {shapes}"
        if m[2] != r[2]:
            return f"at parameter {quoted(m[0])}: dtype {_dtype_text(m[2])} vs {_dtype_text(r[2])}"
        if m[3] != r[3]:
            return f"at parameter {quoted(m[0])}: requires_grad {quoted(m[3])} vs {quoted(r[3])}"
    if len(mine) < len(ref):
        return f"at parameter {quoted(ref[len(mine)][0])}: missing"
    if len(mine) > len(ref):
        return f"at parameter {quoted(mine[len(ref)][0])}: extra parameter"
    return None


def first_tensor_difference(
    mine: tuple[tuple[str, bytes], ...], ref: tuple[tuple[str, bytes], ...]
) -> str:
    for (m_name, m_digest), (r_name, r_digest) in zip(mine, ref):
        if m_name != r_name:
            return f"tensor {quoted(m_name)} (where it has {quoted(r_name)})"
        if m_digest != r_digest:
            return f"tensor {quoted(m_name)}"
    if len(mine) < len(ref):
        return f"tensor {quoted(ref[len(mine)][0])} (missing)"
    if len(mine) > len(ref):
        return f"tensor {quoted(mine[len(ref)][0])} (extra)"
    return "no listed tensor (every per-tensor digest matches)"


# --------------------------------------------------------------------------- the core
