"""The ``paramsync`` command line."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from collections.abc import Sequence

__all__ = ["main", "build_parser"]

log = logging.getLogger("paramsync.cli")

_UNITS = {
    "": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
}


def parse_size(text: str) -> int:
    """Parse a byte count such as ``4096``, ``64KiB`` or ``16MiB``."""
    raw = text.strip().lower().replace(" ", "")
    digits = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(digits) :]
    if not digits.isdigit() or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4096, 64KiB or 16MiB")
    return int(digits) * _UNITS[unit]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every ``paramsync`` subcommand."""
    parser = argparse.ArgumentParser(
        prog="paramsync",
        description="Async actor-model parameter synchronization for data-parallel PyTorch.",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default INFO)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    allreduce = sub.add_parser(
        "allreduce",
        help="run one rank of an all-reduce check over TCP",
        description="Average a deterministic per-rank tensor over TCP, check the result "
        "against a float64 reference and that every rank holds identical bytes, and report "
        "the bandwidth. Needs PARAMSYNC_SECRET (or PARAMSYNC_SECRET_FILE) on every rank.",
    )
    allreduce.add_argument("--rank", type=int, required=True)
    allreduce.add_argument("--world-size", type=int, required=True)
    allreduce.add_argument(
        "--coordinator", required=True, help="host:port where rank 0 listens for the rendezvous"
    )
    allreduce.add_argument("--size", type=parse_size, default=16 << 20, help="bytes (float32)")
    allreduce.add_argument("--repeats", type=int, default=5)
    allreduce.add_argument("--summary-json", help="write this rank's result here")
    return parser


def _run_allreduce(args: argparse.Namespace) -> int:
    import torch
    import trio

    from .collectives import all_gather, all_reduce, barrier
    from .config import DistributedConfig
    from .tcp import TcpTransport
    from .wire import tensor_buffer

    config = DistributedConfig(args.world_size, args.rank, args.coordinator)
    numel = args.size // 4

    def rank_tensor(rank: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 + rank)
        return torch.randn(numel, generator=gen, dtype=torch.float32)

    async def main() -> dict:
        async with TcpTransport.connect(config) as transport:
            tensor = rank_tensor(config.rank)
            await all_reduce(transport, tensor, "avg")
            reference = sum(rank_tensor(r).double() for r in range(config.world_size))
            reference = reference / config.world_size
            max_error = float((tensor.double() - reference).abs().max()) if numel else 0.0
            digest = hashlib.sha256(tensor_buffer(tensor)).digest()
            token = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
            digests = await all_gather(transport, token)
            identical = bool((digests == digests[0]).all())
            times = []
            for _ in range(args.repeats):
                await barrier(transport)
                start = time.perf_counter()
                await all_reduce(transport, tensor, "avg")
                times.append(time.perf_counter() - start)
            await barrier(transport)
        seconds = sorted(times)[len(times) // 2] if times else float("nan")
        n = config.world_size
        algbw = args.size / seconds / 1e9
        return {
            "rank": config.rank,
            "world_size": n,
            "bytes": args.size,
            "max_abs_error": max_error,
            "identical_on_all_ranks": identical,
            "median_seconds": seconds,
            "algbw_GBps": algbw,
            "busbw_GBps": algbw * 2 * (n - 1) / n,
            "digest": digest.hex(),
        }

    result = trio.run(main)
    ok = result["identical_on_all_ranks"] and result["max_abs_error"] < 1e-5
    if args.summary_json:
        with open(args.summary_json, "w") as handle:
            json.dump(result, handle, indent=2)
    if config.rank == 0 or not ok:
        print(json.dumps(result), flush=True)
    return 0 if ok else 3


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``paramsync`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "allreduce":
        return _run_allreduce(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
