"""How many guesses a secret holds out against a guesser who tries what people choose first
(sans-I/O, pure).

`strength_bits` cuts the secret into the pieces a guesser builds it from and counts the guesses
each costs, keeping the cut that costs the fewest (a minimum over every segmentation, by dynamic
programming), in bits. The pieces, and what each costs:

- a common word or password base (`paramsync.runtime.protocol.common_words`), found whatever
  its case, written backwards, or with common substitutions (``@`` or ``4`` for ``a``, ``3`` for
  ``e``, ``0`` for ``o``, ``$`` for ``s``, ...): its rank in the list, times the ways to case and
  substitute it;
- a run of the alphabet or the digits, up or down (``abcdef``, ``0123``, ``987``): its start
  and length;
- a walk on a QWERTY keyboard (``qwertyuiop``, ``asdfgh``, ``1qaz2wsx``): its start, length and
  turns;
- a year (1900-2099) or a date written with digits: how far it is from the present;
- a chunk repeated (``abcabc``, ``aaaa``): the chunk's own cost, times the repeats;
- any other character: drawn at random from the classes the secret uses (26 lowercase, 26
  uppercase, 10 digits, 33 ASCII symbols and space, 128 other bytes): log2 of their sizes' sum.

Every piece after the first adds a bit (which kind comes next). A random secret is rated at its
true entropy or above (`paramsync secret`'s 43 characters at some 265 bits); a human one at what
its structure gives away (``Summer2024!team1``: under 40). A word outside the list counts as
random letters, so the estimate errs high for rare words: it refuses what guessers try first,
and only random bytes are sure to be strong. The first `MAX_ANALYSED` bytes are read.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Iterator

from paramsync.runtime.protocol.common_words import COMMON_WORDS

__all__ = ["MAX_ANALYSED", "strength_bits"]

MAX_ANALYSED = 256
"""Bytes of a secret the estimate reads (a longer secret is rated by its first ones)."""

TOKEN_BITS = 1.0
"""What each piece after the first adds: the guesser's choice of what kind comes next."""

_RANK = {word: rank for rank, word in enumerate(COMMON_WORDS, start=1) if len(word) >= 3}
_REVERSED = {word[::-1]: rank for word, rank in _RANK.items()}
_PREFIXES = frozenset(word[:i] for word in _RANK for i in range(1, len(word) + 1))
_REVERSED_PREFIXES = frozenset(word[:i] for word in _REVERSED for i in range(1, len(word) + 1))
_LONGEST_WORD = max(len(word) for word in _RANK)
_SUBSTITUTIONS: dict[str, tuple[str, ...]] = {
    "4": ("a",), "@": ("a",), "8": ("b",), "(": ("c",), "{": ("c",), "[": ("c",),
    "<": ("c",), "3": ("e",), "6": ("g",), "9": ("g",), "1": ("i", "l"), "!": ("i",),
    "|": ("i", "l"), "0": ("o",), "5": ("s",), "$": ("s",), "7": ("t", "l"), "+": ("t",),
    "%": ("x",), "2": ("z",),
}  # fmt: skip

_SYMBOLS = frozenset(" !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
_CLASS_SIZE = {"lower": 26, "upper": 26, "digit": 10, "symbol": 33, "other": 128}

_KEYBOARD_ROWS = (
    ("`1234567890-=", "~!@#$%^&*()_+", 0.0),
    ("qwertyuiop[]\\", "QWERTYUIOP{}|", 1.5),
    ("asdfghjkl;'", 'ASDFGHJKL:"', 1.75),
    ("zxcvbnm,./", "ZXCVBNM<>?", 2.25),
)
_KEYS = {
    char: (row, start + column)
    for row, (plain, shifted, start) in enumerate(_KEYBOARD_ROWS)
    for keys in (plain, shifted)
    for column, char in enumerate(keys)
}
_SHIFTED = frozenset(char for _plain, shifted, _start in _KEYBOARD_ROWS for char in shifted)
_KEYBOARD_STARTS = len(_KEYS) // 2
_KEYBOARD_DEGREE = 4.6
"""The mean number of neighbours of a key (zxcvbn's figure for QWERTY)."""

_PRESENT_YEAR = 2025
_MIN_YEAR_SPACE = 20
_YEAR = re.compile(r"(19|20)\d\d")
_DATE = re.compile(
    r"(?:(\d{1,2})[-/._ ]?(\d{1,2})[-/._ ]?((?:19|20)\d\d))"
    r"|(?:((?:19|20)\d\d)[-/._ ]?(\d{1,2})[-/._ ]?(\d{1,2}))"
)


def strength_bits(secret: bytes) -> float:
    """The estimated entropy of ``secret`` in bits: log2 of the guesses its cheapest cut into
    pieces costs (module docstring). 0 for an empty secret."""
    text = bytes(secret[:MAX_ANALYSED]).decode("latin-1")
    return _bits(text)


@functools.lru_cache(maxsize=1024)
def _bits(text: str) -> float:
    n = len(text)
    if n == 0:
        return 0.0
    pieces: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    for start, end, bits in _patterns(text):
        pieces[start].append((end, bits))
    # best[i][b]: the fewest bits for text[:i], b: whether it ends inside a run of characters
    # rated one by one (a run is one piece, so extending it adds no piece).
    char_bits = math.log2(sum(_CLASS_SIZE[kind] for kind in {_class(c) for c in text}))
    inf = math.inf
    best = [[inf, inf] for _ in range(n + 1)]
    best[0][0] = 0.0
    for i in range(n):
        here = min(best[i][0] + TOKEN_BITS, best[i][1])
        if here < inf:
            best[i + 1][1] = min(best[i + 1][1], here + char_bits)
        start_cost = min(best[i])
        for end, bits in pieces[i]:
            best[end][0] = min(best[end][0], start_cost + TOKEN_BITS + bits)
    return max(0.0, min(best[n]) - TOKEN_BITS)


def _class(char: str) -> str:
    if "a" <= char <= "z":
        return "lower"
    if "A" <= char <= "Z":
        return "upper"
    if "0" <= char <= "9":
        return "digit"
    return "symbol" if char in _SYMBOLS else "other"


def _patterns(text: str) -> Iterator[tuple[int, int, float]]:
    """Every piece found in ``text``: (start, end, bits)."""
    yield from _words(text)
    yield from _sequences(text)
    yield from _keyboard_walks(text)
    yield from _years_and_dates(text)
    yield from _repeats(text)


# --------------------------------------------------------------------------- words


def _case_variations(piece: str) -> int:
    """The ways to case a word as ``piece`` is cased (zxcvbn's count): lowercase 1; all
    uppercase, or only its first or last letter, 2; else every placement of its capitals."""
    upper = sum(c.isupper() for c in piece)
    lower = sum(c.islower() for c in piece)
    if upper == 0:
        return 1
    if lower == 0 or (upper == 1 and (piece[0].isupper() or piece[-1].isupper())):
        return 2
    return sum(math.comb(upper + lower, i) for i in range(1, min(upper, lower) + 1))


def _words(text: str) -> Iterator[tuple[int, int, float]]:
    """Common words from each start, forwards and backwards, with every combination of
    substitutions undone (only spellings that still begin a word are followed)."""
    for start in range(len(text)):
        for backwards, ranks, prefixes in (
            (1, _RANK, _PREFIXES),
            (2, _REVERSED, _REVERSED_PREFIXES),
        ):
            spellings = {"": 0}  # spelling so far -> substitutions undone in it
            for end in range(start + 1, min(len(text), start + _LONGEST_WORD) + 1):
                char = text[end - 1].lower()
                spellings = {
                    done + choice: undone + (choice != char)
                    for done, undone in spellings.items()
                    for choice in (char, *_SUBSTITUTIONS.get(char, ()))
                    if done + choice in prefixes
                }
                if not spellings:
                    break
                found = [
                    ranks[spelling] * 2**undone
                    for spelling, undone in spellings.items()
                    if spelling in ranks
                ]
                if found:
                    piece = text[start:end]
                    guesses = min(found) * backwards * _case_variations(piece)
                    yield start, end, math.log2(guesses)


# --------------------------------------------------------------------------- runs and walks


def _sequences(text: str) -> Iterator[tuple[int, int, float]]:
    """Runs of the alphabet or the digits, one step up or down each character."""
    for start in range(len(text) - 2):
        kind = _class(text[start])
        if kind not in ("lower", "upper", "digit"):
            continue
        step = ord(text[start + 1]) - ord(text[start])
        if step not in (1, -1):
            continue
        end = start + 1
        while (
            end < len(text)
            and _class(text[end]) == kind
            and ord(text[end]) - ord(text[end - 1]) == step
        ):
            end += 1
            if end - start >= 3:
                first = text[start]
                base = 4 if first in "aAzZ019" else 10 if kind == "digit" else 26
                guesses = base * (end - start) * (2 if step < 0 else 1)
                yield start, end, math.log2(guesses)


def _adjacent(a: str, b: str) -> bool:
    if a not in _KEYS or b not in _KEYS:
        return False
    (row_a, x_a), (row_b, x_b) = _KEYS[a], _KEYS[b]
    if row_a == row_b:
        return abs(x_a - x_b) == 1
    return abs(row_a - row_b) == 1 and abs(x_a - x_b) < 1


def _walk_bits(piece: str) -> float:
    turns = 0
    direction = None
    for a, b in itertools.pairwise(piece):
        (row_a, x_a), (row_b, x_b) = _KEYS[a], _KEYS[b]
        now = (row_b - row_a, x_b > x_a)
        if now != direction:
            turns += 1
            direction = now
    length = len(piece)
    guesses = sum(
        math.comb(i - 1, j - 1) * _KEYBOARD_STARTS * _KEYBOARD_DEGREE**j
        for i in range(2, length + 1)
        for j in range(1, min(turns, i - 1) + 1)
    )
    shifted = sum(c in _SHIFTED for c in piece)
    if 0 < shifted < length:
        guesses *= sum(math.comb(length, i) for i in range(1, min(shifted, length - shifted) + 1))
    return math.log2(guesses)


def _keyboard_walks(text: str) -> Iterator[tuple[int, int, float]]:
    """Runs of neighbouring keys of a QWERTY keyboard (each key next to the one before)."""
    for start in range(len(text) - 2):
        end = start + 1
        while end < len(text) and _adjacent(text[end - 1], text[end]):
            end += 1
            if end - start >= 3:
                yield start, end, _walk_bits(text[start:end])


# --------------------------------------------------------------------------- years, repeats


def _year_space(year: int) -> int:
    return max(abs(year - _PRESENT_YEAR), _MIN_YEAR_SPACE)


def _years_and_dates(text: str) -> Iterator[tuple[int, int, float]]:
    for start in range(len(text)):
        year = _YEAR.match(text, start)
        if year is not None:
            yield start, year.end(), math.log2(_year_space(int(year.group())))
        for end in range(start + 6, min(len(text), start + 10) + 1):
            date = _DATE.fullmatch(text, start, end)
            if date is None:
                continue
            first, second, when = date.group(1, 2, 3) if date.group(3) else date.group(6, 5, 4)
            day, month = sorted((int(first), int(second)), reverse=True)
            if 1 <= month <= 12 and 1 <= day <= 31:  # either order: d/m or m/d
                yield start, end, math.log2(366 * _year_space(int(when)))


def _repeats(text: str) -> Iterator[tuple[int, int, float]]:
    """A chunk written two or more times in a row: the chunk's cost, times the repeats."""
    n = len(text)
    for start in range(n - 1):
        for size in range(1, min(64, (n - start) // 2) + 1):
            chunk = text[start : start + size]
            count = 1
            while text.startswith(chunk, start + count * size):
                count += 1
            if count >= 2:
                yield start, start + count * size, _bits(chunk) + math.log2(count)
