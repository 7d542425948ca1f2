"""What one frame costs a TCP receiver before it is refused or accepted (issue 31, row 2).

Each case runs in a fresh process: a `Connection` with frame authentication on one end of a
socket pair, a sender thread writing one hand-built frame (no torch on the sending side) into
the other end, and the receiver's event loop running `Connection.recv` next to a 1 ms ticker.
Reported per case: the outcome, seconds to it, peak and kept RSS growth (from /proc, sampled
by the ticker), the longest event-loop stall, how many heads were decoded and whether the
receive imported torch.

* ``forged-bulk``: a 60 MiB ``p2p`` bulk frame whose tag is random (what an on-path relay
  without the secret can send);
* ``inline-coll``: a correctly tagged ``coll`` carrying 60 MiB inline (a peer holding the
  secret);
* ``manifest``: a correctly tagged 40 MiB ``state_manifest`` (a kind whose cap is 64 MiB).

    python benchmarks/frame_decode.py            # the table
    python benchmarks/frame_decode.py --json out/frame_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CASES = ("forged-bulk", "inline-coll", "manifest")
_SIZE = 60 << 20


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _frame(case: str, sealer: Any) -> bytes:
    import cbor2

    if case == "forged-bulk":
        array = cbor2.CBORTag(40, [[_SIZE // 4], cbor2.CBORTag(85, b"")])
        head = cbor2.dumps({"v": 2, "kind": "p2p", "tag": 0, "data": array})
        head = head[:-1] + b"\x5a" + _SIZE.to_bytes(4, "big")
        frame = struct.pack(">II", len(head) + _SIZE, _SIZE) + head + bytes(_SIZE)
        return frame + b"\x50" + os.urandom(16)
    if case == "inline-coll":
        array = cbor2.CBORTag(40, [[_SIZE // 4], cbor2.CBORTag(85, bytes(_SIZE))])
        fields = {"v": 2, "kind": "coll", "op": 0, "hop": 0, "part": 0, "data": array}
    else:
        names = [f"{'t' * 192}.{index:08d}" for index in range(200_000)]
        fields = {"v": 2, "kind": "state_manifest", "manifest": {"names": names}}
    body = cbor2.dumps(fields)
    frame = struct.pack(">II", len(body), 0) + body
    return frame + sealer.seal([frame])


def _case(case: str) -> dict[str, Any]:
    import trio

    from paramsync.runtime.protocol import wire
    from paramsync.runtime.protocol.frame_auth import frame_session
    from paramsync.runtime.transport import tcp

    decoded: list[int] = []
    real = wire.decode_head

    def watch(head: Any, bulk_len: int) -> Any:
        decoded.append(len(head))
        return real(head, bulk_len)

    tcp.decode_head = watch  # type: ignore[assignment]
    key = os.urandom(32)
    mine, theirs = socket.socketpair()
    frame = _frame(case, frame_session(key, dialer=True).sealer)
    torch_before = "torch" in sys.modules

    def send() -> None:
        try:
            mine.sendall(frame)
        except OSError:
            pass

    async def main() -> dict[str, Any]:
        conn = tcp.Connection(trio.SocketStream(trio.socket.from_stdlib_socket(theirs)), peer=1)
        conn.authenticate_frames(key, dialer=False)
        gaps, peak, stop = [0.0], [0.0], trio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not stop.is_set():
                await trio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last - 0.001)
                last = now
                peak[0] = max(peak[0], _rss_mib())

        result: dict[str, Any] = {"case": case}
        base = _rss_mib()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.sleep(0.05)
            threading.Thread(target=send, daemon=True).start()
            started = time.perf_counter()
            try:
                message = await conn.recv(wire.DEFAULT_MAX_FRAME)
                result["outcome"] = f"accepted ({message['kind']})"
                del message
            except Exception as exc:  # the outcome is what is measured
                result["outcome"] = f"{type(exc).__name__}: {str(exc)[:60]}"
            result["seconds"] = round(time.perf_counter() - started, 3)
            peak[0] = max(peak[0], _rss_mib())
            await trio.sleep(0.01)
            stop.set()
        result["peak_rss_mib"] = round(peak[0] - base, 1)
        result["kept_rss_mib"] = round(_rss_mib() - base, 1)
        result["loop_stall_ms"] = round(max(gaps) * 1e3, 1)
        result["heads_decoded"] = len(decoded)
        result["torch_imported"] = not torch_before and "torch" in sys.modules
        return result

    return trio.run(main)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_case(args.case)))
        return
    rows = []
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for case in CASES:
        out = subprocess.run(
            [sys.executable, __file__, "--case", case],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for row in rows:
        print(
            f"{row['case']:<12} {row['seconds']:>6.3f} s  peak +{row['peak_rss_mib']:>6.1f} MiB  "
            f"kept +{row['kept_rss_mib']:>6.1f} MiB  loop stall {row['loop_stall_ms']:>7.1f} ms  "
            f"decoded {row['heads_decoded']}  torch {row['torch_imported']}  {row['outcome']}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
