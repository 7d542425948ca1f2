"""What a control message costs on the wire, end to end: the coordinator protocol's hot kinds.

For each message the training step exchanges (a worker's packed ``digest``, a cached and a
full ``ready``; the coordinator's ``go`` and ``commit``), times one round: the dataclass
encoded (``to_wire``), framed (``encode_frame_bytes``), the frame decoded and checked
(``decode_frame``) and turned back into the message (``event_from_wire`` or
``message_from_wire``). Prints the best of ``--repeat`` runs of ``--number`` rounds each, in
microseconds per round. Run it with ``python benchmarks/messages.py`` from a checkout.
"""

from __future__ import annotations

import argparse
import functools
import timeit
from collections.abc import Callable
from typing import Any

from paramsync.runtime.coordinator.events import spec_hash
from paramsync.runtime.protocol.messages import (
    Commit,
    Digest,
    Go,
    Ready,
    WireMessage,
    event_from_wire,
    message_from_wire,
)
from paramsync.runtime.protocol.wire import decode_frame, encode_frame_bytes


def report(message: WireMessage) -> Any:
    """A worker's report, as the coordinator receives it from rank 3."""
    kind, fields = message.to_wire()
    return event_from_wire(decode_frame(encode_frame_bytes(kind, fields)), rank=3, now=0.0)


def order(message: WireMessage) -> Any:
    """A coordinator's order, as a worker receives it."""
    kind, fields = message.to_wire()
    return message_from_wire(decode_frame(encode_frame_bytes(kind, fields)))


CASES: list[tuple[str, Callable[[WireMessage], Any], WireMessage]] = [
    ("digest (packed)", report, Digest(3, 120, b"d" * 16, packed=b"a" * 16 * 40, epoch=1)),
    (
        "ready (cached)",
        report,
        Ready(3, 120, 2, spec_hash((((64, 64), "float32"),)), epoch=1, cached=True),
    ),
    (
        "ready (full spec)",
        report,
        Ready(3, 0, 2, (((64, 64), "float32"), ((64,), "float32"), ((16, 8), "float32"))),
    ),
    ("go", order, Go(120, 2, 481, 1)),
    ("commit", order, Commit(120, 1)),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=5000, help="rounds per run")
    parser.add_argument("--repeat", type=int, default=25, help="runs; the best is printed")
    args = parser.parse_args()
    for name, round_trip, message in CASES:
        assert round_trip(message) == message
        runs = timeit.repeat(
            functools.partial(round_trip, message), number=args.number, repeat=args.repeat
        )
        print(f"{name:18s} {min(runs) / args.number * 1e6:6.2f} us per round")


if __name__ == "__main__":
    main()
