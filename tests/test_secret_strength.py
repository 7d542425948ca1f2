"""The entropy estimate of a shared secret (third security review, issue 39, row 3): what a
guesser tries first is refused, random secrets (``paramsync secret``'s above all) are not."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paramsync.runtime.protocol.handshake import (
    SECRET_MIN_BITS,
    SECRET_MIN_BYTES,
    load_secret,
    new_secret,
    secret_strength_bits,
)

ROOT = Path(__file__).resolve().parent.parent

REVIEWED = [b"abcdefghijklmnop", b"0123456789abcdef", b"password12345678", b"qwertyuiopasdfgh"]
REVIEWED += [b"Summer2024!team1"]
"""The five secrets the review found accepted (rated 55-64 bits before)."""

BASES = (
    "password", "qwerty", "dragon", "monkey", "letmein", "football", "baseball", "shadow",
    "master", "sunshine", "princess", "welcome", "summer", "winter", "michael", "jessica",
    "charlie", "freedom", "secret", "admin", "paramsync", "iloveyou", "superman", "hello",
)  # fmt: skip
"""Bases of the passwords people pick most (the top of every leaked-password list)."""

SUBSTITUTED = str.maketrans({"a": "@", "o": "0", "e": "3", "s": "$", "i": "1"})
WALKS = (
    "qwertyuiopasdfgh", "1qaz2wsx3edc4rfv", "zxcvbnm,./asdfgh", "!QAZ@WSX#EDC$RFV",
    "qazwsxedcrfvtgby", "asdfghjkl;qwerty", "poiuytrewqlkjhgf", "1234qwerasdfzxcv",
)  # fmt: skip
RUNS = (
    "abcdefghijklmnop", "zyxwvutsrqponmlk", "ABCDEFGHIJ123456", "98765432109876543210",
    "0123456789abcdef", "abcdefgh12345678",
)  # fmt: skip


def _at_least_min_length(text: str, filler: str) -> str:
    """``text``, followed by ``filler`` as many times as it takes to be `SECRET_MIN_BYTES` long
    (people lengthen a password with whole words and numbers)."""
    while len(text) < SECRET_MIN_BYTES:
        text += filler
    return text


def common_passwords() -> list[str]:
    """What people choose when asked for a 16-character password: common bases with digits,
    capitals, years, symbols, substitutions, reversed, doubled; keyboard walks; runs."""
    made: list[str] = []
    for number, base in enumerate(BASES):
        other = BASES[(number * 7 + 3) % len(BASES)]
        year = (1970, 1985, 1999, 2001, 2019, 2024, 2025)[number % 7]
        symbol = "!@#$*?."[number % 7]
        made += [
            _at_least_min_length(base, "1234567890"),
            _at_least_min_length(base.capitalize() + str(year) + symbol, other),
            _at_least_min_length(base.capitalize() + str(year) + symbol + other + "1", "!"),
            _at_least_min_length(base.translate(SUBSTITUTED) + str(year), "!"),
            _at_least_min_length(base.upper() + "_" + other.upper(), "123"),
            _at_least_min_length(base[::-1] + other, "2024"),
            _at_least_min_length(base + base, "1"),
            _at_least_min_length(f"{base}{number % 28 + 1:02d}0{number % 9 + 1}{year}", "!"),
            _at_least_min_length(base + "qwerty", "123"),
        ]
    return [*made, *WALKS, *RUNS]


@pytest.mark.parametrize("weak", REVIEWED, ids=[w.decode() for w in REVIEWED])
def test_the_reviews_five_secrets_are_refused(weak: bytes) -> None:
    assert secret_strength_bits(weak) < SECRET_MIN_BITS - 10
    with pytest.raises(ValueError, match="too little entropy") as info:
        load_secret(weak)
    assert "paramsync secret" in str(info.value)


def test_common_passwords_are_rated_as_what_they_are() -> None:
    passwords = common_passwords()
    assert len(passwords) > 200
    assert all(len(p) >= SECRET_MIN_BYTES for p in passwords)
    accepted = {p: round(secret_strength_bits(p.encode()), 1) for p in passwords}
    accepted = {p: bits for p, bits in accepted.items() if bits >= SECRET_MIN_BITS}
    assert not accepted, accepted


def test_random_secrets_stay_strong() -> None:
    """`paramsync secret` (43 URL-safe characters) and the hex of 16 random bytes, however
    they fall, and even the hex of 8."""
    assert min(secret_strength_bits(new_secret().encode()) for _ in range(200)) > 150
    # The hex strings from a seeded generator: the same 300 draws every run (a hex string of
    # 8 random bytes can spell words and years, and a few of all possible ones rate lower).
    draws = random.Random(20261129)
    assert min(secret_strength_bits(draws.randbytes(16).hex().encode()) for _ in range(300)) > 90
    assert min(secret_strength_bits(draws.randbytes(8).hex().encode()) for _ in range(300)) >= 48
    assert secret_strength_bits(os.urandom(32)) > 150


def test_paramsync_secret_makes_one_that_loads() -> None:
    made = subprocess.run(
        [sys.executable, "-m", "paramsync.runtime.cli.main", "secret"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ).stdout.strip()
    assert load_secret(made) == made.encode()
    assert secret_strength_bits(made.encode()) > 150


def test_a_long_secret_is_rated_quickly_by_its_first_bytes() -> None:
    started = time.monotonic()
    assert secret_strength_bits(b"ab" * 5000) < SECRET_MIN_BITS
    assert secret_strength_bits(os.urandom(4096)) > 150
    assert time.monotonic() - started < 5
