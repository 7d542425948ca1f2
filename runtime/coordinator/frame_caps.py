"""How large a frame a member of this run may send the coordinator, from the run's model.

Before the first join the coordinator knows no model, and each kind's schema cap bounds a
frame (`paramsync.runtime.protocol.limits`: up to 64 MiB for a join). Once the reference model is
known (the first join's signature, or the one the coordinator was given), every frame a member sends
(a later join, a bucket report, a digest with its tensor names) is bounded by what that model
legitimately needs (`member_frame_cap`), checked from the frame's prefix before it is read:

* a join lists each parameter once: its name, shape and dtype;
* a bucket report lists at most every parameter's shape and dtype;
* a digest names every state tensor (parameters, buffers, and up to a few optimizer-state
  tensors each, named after their parameter) with a 16-byte hash each.

So the cap is a fixed allowance for the small fields plus a multiple of the signature's own
wire size that covers the digest's names; a model of 150 parameter tensors gets about 200 KiB,
one of 10,000 about 11 MiB.

Before a peer has joined, it may send only what a joining peer sends (`JOINING_KINDS`: its join,
and the heartbeats that follow it), each frame at most what a join needs (`join_frame_cap`); any
other kind (a digest, a bucket report) is refused from the frame's prefix and the peek at its
kind, unread and undecoded.
"""

from __future__ import annotations

from paramsync.runtime.protocol.messages import Signature

__all__ = [
    "JOINING_KINDS",
    "JOIN_ENTRIES_PER_PARAM",
    "MEMBER_FRAME_ALLOWANCE",
    "STATE_ENTRIES_PER_PARAM",
    "join_frame_cap",
    "member_frame_cap",
]

MEMBER_FRAME_ALLOWANCE = 64 * 1024
"""Bytes every member frame may hold beside its model-sized part (groups, a layout, a step
report's fields, the scheduler's and the loss scaler's digest entries)."""

STATE_ENTRIES_PER_PARAM = 8
"""Digest entries (and their names) a parameter may account for: itself and its optimizer's
state tensors (Adam's step, exp_avg, exp_avg_sq; more for others), with room."""

JOINING_KINDS = frozenset({"join", "heartbeat"})
"""What a peer that has not joined may send: its join (and the heartbeats a worker starts once
its join is sent, should one arrive before the join is taken)."""

JOIN_ENTRIES_PER_PARAM = 2
"""Signature entries a join may hold per parameter of the run's model: its own model lists each
once; twice leaves room for a joiner whose model differs, so it hears which parameter does."""


def _entry_bytes(name: str, shape: tuple[int, ...], dtype: str) -> int:
    """An upper estimate of one signature entry's wire size, with a digest entry's hash."""
    return len(name.encode()) + 9 * len(shape) + len(dtype) + 16 + 64


def member_frame_cap(signature: Signature, default: int) -> int:
    """The largest frame a member of a run with ``signature`` needs to send the coordinator
    (never above ``default``, the schema's cap)."""
    model = sum(_entry_bytes(name, tuple(shape), dtype) for name, shape, dtype, _ in signature)
    return min(default, MEMBER_FRAME_ALLOWANCE + STATE_ENTRIES_PER_PARAM * model)


def join_frame_cap(signature: Signature | None, default: int) -> int:
    """The largest frame a peer that has not joined may send: a join of the run's model
    (``signature``; None while no model is known, then the join's schema cap ``default``)."""
    if signature is None:
        return default
    model = sum(_entry_bytes(name, tuple(shape), dtype) for name, shape, dtype, _ in signature)
    return min(default, MEMBER_FRAME_ALLOWANCE + JOIN_ENTRIES_PER_PARAM * model)
