"""How large a frame a member of this run may send the coordinator, from the run's model.

Before the first join the coordinator knows no model, and a join is held to what a join of the
largest model a run may have needs (`FIRST_JOIN_MAX_FRAME`: `MAX_MODEL_TENSORS` entries of
`JOIN_ENTRY_BYTES` each, plus `MEMBER_FRAME_ALLOWANCE`; some 6 MiB, where the join's schema cap is
64 MiB). Once the reference model is
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
and the heartbeats that follow it), each frame at most what a join needs (`join_frame_cap`:
`FIRST_JOIN_MAX_FRAME` while no model is known, then twice the run's model's entries); a longer
frame is refused from its prefix (`join_cap_refusal` says why, in one line), any other kind (a
digest, a bucket report) from the prefix and the peek at its kind, unread and undecoded.
"""

from __future__ import annotations

from paramsync.runtime.protocol.messages import Signature

__all__ = [
    "FIRST_JOIN_MAX_FRAME",
    "JOINING_KINDS",
    "JOIN_ENTRIES_PER_PARAM",
    "JOIN_ENTRY_BYTES",
    "MAX_MODEL_TENSORS",
    "MEMBER_FRAME_ALLOWANCE",
    "STATE_ENTRIES_PER_PARAM",
    "join_cap_refusal",
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


MAX_MODEL_TENSORS = 32_768
"""The most parameter tensors a run's model may have. A join lists each as about seven CBOR
items (the entry, its name, shape and two dimensions, dtype, flag), so this many stay under the
frame's item cap (`paramsync.runtime.protocol.limits.MAX_ITEMS`, 2^18) that every join already
met; models with tens of thousands of tensors (a mixture of experts with one tensor per expert
and layer) fit."""

JOIN_ENTRY_BYTES = 192
"""Bytes a join's signature entry may take on average before the run's model is known: its name
(up to about 170 bytes; ``base_model.model.layers.31.self_attn.q_proj.lora_A.default.weight``
is 66), shape, dtype and flag. A real model's join averages well under 100."""

FIRST_JOIN_MAX_FRAME = MEMBER_FRAME_ALLOWANCE + MAX_MODEL_TENSORS * JOIN_ENTRY_BYTES
"""The largest head a peer may send before it has joined while the run's model is unknown
(6,356,992 bytes): a join of `MAX_MODEL_TENSORS` entries of `JOIN_ENTRY_BYTES`, plus
`MEMBER_FRAME_ALLOWANCE` for its other fields (groups, a layout)."""


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
    (``signature``), or while no model is known (None) `FIRST_JOIN_MAX_FRAME`; never above
    ``default``, the join's schema cap."""
    if signature is None:
        return min(default, FIRST_JOIN_MAX_FRAME)
    model = sum(_entry_bytes(name, tuple(shape), dtype) for name, shape, dtype, _ in signature)
    return min(default, MEMBER_FRAME_ALLOWANCE + JOIN_ENTRIES_PER_PARAM * model)


def join_cap_refusal(announced: str, cap: int, model_known: bool) -> str:
    """The one line refusing a frame that a peer which has not joined announced beyond ``cap``
    (``announced``: what the frame reader said of it, its size and the limit)."""
    if model_known:
        return f"{announced}: before its join a peer may send only a join, {cap} bytes at most"
    return (
        f"{announced}: before its join a peer may send only a join, {cap} bytes at most while "
        f"the run's model is unknown ({MAX_MODEL_TENSORS} tensors of {JOIN_ENTRY_BYTES} bytes and "
        f"{MEMBER_FRAME_ALLOWANCE} bytes more: FIRST_JOIN_MAX_FRAME)"
    )
