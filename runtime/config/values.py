"""The one parser of each kind of configuration value: integers, booleans and enum members, from
their own type or from the strings of environment variables, TOML files and flags. Every bad
value is a `ConfigError` (a ``ValueError``) naming where it came from (``label``)."""

from __future__ import annotations

import enum
import re
from typing import TypeVar

from paramsync.runtime.errors import ConfigError

__all__ = ["TRUE_WORDS", "FALSE_WORDS", "parse_bool", "parse_enum", "parse_int"]

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
"""The strings (any case, blanks around ignored) that mean true."""
FALSE_WORDS = frozenset({"0", "false", "no", "off"})
"""The strings that mean false."""

_INT_RE = re.compile(r"[+-]?[0-9]+")

E = TypeVar("E", bound=enum.Enum)


def parse_int(value: object, label: str) -> int:
    """An int, or a decimal string of one (a bool is not an int here)."""
    if isinstance(value, str) and _INT_RE.fullmatch(value.strip()):
        return int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConfigError(f"{label} must be an integer, got {value!r}")


def parse_bool(value: object, label: str) -> bool:
    """A bool, or one of `TRUE_WORDS` / `FALSE_WORDS`."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
    raise ConfigError(f"{label} must be a bool (true/false, 1/0, yes/no, on/off), got {value!r}")


def parse_enum(cls: type[E], value: object, label: str) -> E:
    """A member of ``cls``, or its value as a string (any case, ``-`` for ``_``)."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        text = value.strip().lower().replace("-", "_")
        for member in cls:
            if member.value == text:
                return member
    choices = ", ".join(repr(member.value) for member in cls)
    raise ConfigError(f"{label} must be one of {choices}, got {value!r}")
