"""The TCP loopback floor: how fast can two processes move bytes at all on this machine?

Two OS processes, blocking sockets, no framing, no reduction: the best any TCP all-reduce can
do. It measures one direction (one process sends, the other receives) and both directions at
once (each process sends and receives ``--mib`` MiB, on two threads), which is what every hop of
a two-rank ring does. Medians over ``--reps``.

    python benchmarks/loopback.py
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time


def _send(sock: socket.socket, view: memoryview, chunk: int) -> None:
    for start in range(0, len(view), chunk):
        sock.sendall(view[start : start + chunk])


def _recv(sock: socket.socket, view: memoryview, chunk: int) -> None:
    got = 0
    while got < len(view):
        got += sock.recv_into(view[got:], min(chunk, len(view) - got), socket.MSG_WAITALL)


def _peer(port: int, nbytes: int, chunk: int, reps: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    out, into = memoryview(bytearray(nbytes)), memoryview(bytearray(nbytes))
    for _ in range(reps):  # one direction: receive only
        _recv(sock, into, chunk)
    for _ in range(reps):  # both directions
        sender = threading.Thread(target=_send, args=(sock, out, chunk))
        sender.start()
        _recv(sock, into, chunk)
        sender.join()
    sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16, help="MiB per transfer (default 16)")
    parser.add_argument("--chunk-kib", type=int, default=4096, help="bytes per system call")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    nbytes, chunk = args.mib << 20, args.chunk_kib << 10
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        try:
            _peer(port, nbytes, chunk, args.reps)
        finally:
            os._exit(0)
    sock, _ = listener.accept()
    out, into = memoryview(bytearray(nbytes)), memoryview(bytearray(nbytes))
    one_way = []
    for _ in range(args.reps):
        start = time.perf_counter()
        _send(sock, out, chunk)
        one_way.append(time.perf_counter() - start)
    both_ways = []
    for _ in range(args.reps):
        start = time.perf_counter()
        sender = threading.Thread(target=_send, args=(sock, out, chunk))
        sender.start()
        _recv(sock, into, chunk)
        sender.join()
        both_ways.append(time.perf_counter() - start)
    os.waitpid(pid, 0)
    # The one-way send returns when the kernel holds the bytes; the next send waits for the
    # reader, so the median over back-to-back sends is the stream's rate.
    one = statistics.median(one_way)
    both = statistics.median(both_ways)
    result = {
        "mib": args.mib,
        "one_way_GBps": nbytes / one / 1e9,
        "both_ways_ms": both * 1e3,
        "both_ways_GBps_each_direction": nbytes / both / 1e9,
    }
    print(f"one direction:  {result['one_way_GBps']:.2f} GB/s")
    print(
        f"both directions at once: {args.mib} MiB each way in {both * 1e3:.1f} ms "
        f"({result['both_ways_GBps_each_direction']:.2f} GB/s each way)"
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
