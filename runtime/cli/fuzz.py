"""``paramsync fuzz``: throw hostile peers at a live coordinator or worker listener.

Runs `paramsync.runtime.testing.hostile`'s state machine against ``--target HOST:PORT`` for at most
``--examples`` examples and about ``--seconds`` seconds, then prints a summary: examples run,
the target's refusals by reason, its worst answer time to a legitimate hello and its memory,
and any failure with the minimal reproducing example. Exit status 0: no failure; 1: a
failure; 2: bad arguments (or hypothesis missing).

The rule on targets: loopback addresses (127.0.0.0/8, ::1, their IPv4-mapped forms such as
``::ffff:127.0.0.1``, or a name resolving only to them) are fuzzed; any other host only when
named with ``--allow-host`` exactly as in ``--target``, saying it is yours. Hostile traffic must
never reach a host by a typo. The target's name is resolved once, when it is checked, and every
connection dials the address checked, never the name again (a resolver that answers otherwise
later cannot turn the traffic elsewhere).
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

__all__ = ["HARNESS", "add_fuzz_parser", "run_fuzz"]

HARNESS = "paramsync.runtime.testing.hostile"
"""The hostile-peer harness the command runs, loaded by name: `paramsync.runtime.testing` sits above
the command line in the engine's layers (docs/architecture.md), so the command names it the
way ``paramsync worker`` names its job, and a plain install without hypothesis still has a
working ``paramsync``."""

INSTALL_HINT = (
    "paramsync fuzz needs hypothesis, which a plain install leaves out: "
    "pip install 'hypothesis>=6.100' (or the test extra: pip install 'paramsync[test]')"
)


def add_fuzz_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``fuzz`` subcommand to ``sub`` (the ``paramsync`` parser's subparsers)."""
    fuzz = sub.add_parser(
        "fuzz",
        help="throw hostile peers at a live coordinator or worker (hypothesis)",
        description="Play hostile peers against the coordinator or worker listening at "
        "--target: strangers sending every valid and malformed frame, and with --secret-file "
        "authenticated members sending forged, malformed and out-of-turn frames. After every "
        "step a legitimate hello must be answered within --deadline, the target's memory "
        "must stay within --memory-bound of its start (read from /proc on this host), and "
        "nothing the target does may be wrong (a forged frame acted on, a refused peer "
        "admitted). Prints a summary; exit 1 on a failure, with its minimal example. Only "
        "loopback targets, unless --allow-host names the host as yours.",
    )
    fuzz.add_argument("--target", required=True, metavar="HOST:PORT", help="the listener")
    fuzz.add_argument(
        "--secret-file",
        metavar="FILE",
        help="the run's secret (as PARAMSYNC_SECRET_FILE): also play authenticated members",
    )
    fuzz.add_argument(
        "--examples", type=int, default=100, help="at most this many examples (default 100)"
    )
    fuzz.add_argument(
        "--seconds",
        type=float,
        default=60.0,
        help="stop starting examples after this long (default 60; a failure's shrinking may "
        "take longer)",
    )
    fuzz.add_argument(
        "--steps", type=int, default=20, help="at most this many steps an example (default 20)"
    )
    fuzz.add_argument(
        "--deadline",
        type=float,
        default=2.0,
        help="seconds the target has to answer a legitimate hello or hang up on a frame it "
        "must refuse (default 2)",
    )
    fuzz.add_argument(
        "--memory-bound",
        type=float,
        default=64.0,
        metavar="MIB",
        help="MiB the target's resident memory may grow by (default 64)",
    )
    fuzz.add_argument("--world-size", type=int, help="the run's (default: learned, or 2)")
    fuzz.add_argument("--group", default="paramsync", help="the run's group (default paramsync)")
    fuzz.add_argument("--pid", type=int, help="the target's process (default: found on loopback)")
    fuzz.add_argument(
        "--peers", type=int, default=3, help="hostile connections open at once (default 3)"
    )
    fuzz.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="HOST",
        help="a non-loopback host that is yours, to fuzz (repeat for several)",
    )
    return fuzz


def run_fuzz(args: argparse.Namespace) -> int:
    """Run ``paramsync fuzz``; returns the exit status."""
    from paramsync.runtime.config import parse_address
    from paramsync.runtime.protocol.handshake import SECRET_FILE_ENV, load_secret

    try:
        host, port = parse_address(args.target)
        secret = (
            load_secret(None, {SECRET_FILE_ENV: args.secret_file}) if args.secret_file else None
        )
        if args.examples < 1 or args.steps < 1 or args.peers < 1:
            raise ValueError("--examples, --steps and --peers must be at least 1")
        if args.seconds <= 0 or args.deadline <= 0 or args.memory_bound <= 0:
            raise ValueError("--seconds, --deadline and --memory-bound must be positive")
    except ValueError as exc:
        print(f"paramsync fuzz: {exc}")
        return 2
    try:
        harness = importlib.import_module(HARNESS)
    except ImportError as exc:
        if getattr(exc, "name", None) != "hypothesis":
            raise
        print(INSTALL_HINT)
        return 2
    try:
        deployment = harness.Deployment(  # checks the target and pins the address it resolved
            host,
            port,
            secret,
            group=args.group,
            world_size=args.world_size,
            deadline=args.deadline,
            memory_bound=int(args.memory_bound * 2**20),
            pid=args.pid,
            peers=args.peers,
            allowed_hosts=tuple(args.allow_host),
        )
        summary = harness.fuzz(
            deployment, examples=args.examples, seconds=args.seconds, steps=args.steps
        )
    except (ValueError, OSError) as exc:
        print(f"paramsync fuzz: {exc}")
        return 2
    print(summary.format(), flush=True)
    return 0 if summary.ok else 1
