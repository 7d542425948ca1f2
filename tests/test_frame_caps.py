"""Frames a member sends the coordinator are bounded by the run's model (second security
review, row 2: "each kind's cap the size it legitimately needs, derived from the run's manifest
where it depends on the model, checked from the prefix").

Before the first join a kind's schema cap applies (a join up to 64 MiB); once the reference
model is known, every member frame is held to `member_frame_cap` of its signature, refused from
the frame's prefix, before a byte of it is read: a 2 MiB digest from a member of a run whose
model has two tensors is dropped naming the cap, the run and the other members go on.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
from test_coordinator_slots import SECRET, dial_as, join

from paramsync.runtime.coordinator.frame_caps import (
    MEMBER_FRAME_ALLOWANCE,
    STATE_ENTRIES_PER_PARAM,
    member_frame_cap,
)
from paramsync.runtime.coordinator.service import Coordinator, CoordinatorOptions
from paramsync.runtime.errors import PeerClosed
from paramsync.runtime.protocol.wire import DEFAULT_MAX_FRAME


def test_the_cap_grows_with_the_model_and_never_passes_the_schemas() -> None:
    small = (("w", (2,), "float32", True),)
    assert member_frame_cap(small, DEFAULT_MAX_FRAME) < MEMBER_FRAME_ALLOWANCE + 1024
    gpt2ish = tuple(
        (f"h.{i // 12}.attn.c_attn.weight", (768, 2304), "float32", True) for i in range(150)
    )
    cap = member_frame_cap(gpt2ish, DEFAULT_MAX_FRAME)
    names = sum(len(name) for name, *_ in gpt2ish)
    assert cap > STATE_ENTRIES_PER_PARAM * names  # every state tensor's name fits
    assert cap < 512 * 1024
    huge = tuple((f"p{i}" * 20, (8, 8), "float32", True) for i in range(200_000))
    assert member_frame_cap(huge, DEFAULT_MAX_FRAME) == DEFAULT_MAX_FRAME


async def test_a_member_frame_beyond_the_models_cap_is_refused_from_its_prefix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="paramsync.coordinator")
    coordinator = Coordinator(2, CoordinatorOptions(heartbeat_deadline=5.0), secret=SECRET)
    cap = member_frame_cap((("w", (2,), "float32", True),), DEFAULT_MAX_FRAME)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(coordinator.serve_tcp, "127.0.0.1", 0)
            members = [await dial_as(address, rank, 2) for rank in range(2)]
            for rank, member in enumerate(members):
                await member.send("join", join(rank))
            start = await members[1].recv()
            assert start["kind"] == "start_run", start
            names: list[Any] = [f"param/{'w' * 64}{i}" for i in range(2 * 1024 * 1024 // 80)]
            digest = {"step": 0, "digest": b"\x00" * 16, "tensors": b"", "names": names}
            await members[1].send("digest", digest)  # about 2 MiB
            with pytest.raises(PeerClosed):
                with trio.fail_after(10):
                    while True:
                        await members[1].recv()
            nursery.cancel_scope.cancel()
    assert f"exceeds this receiver's limit of {cap}" in caplog.text, caplog.text
