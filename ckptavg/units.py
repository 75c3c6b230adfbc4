"""Parsing and printing of token counts and byte sizes (``100B``, ``2.5T``, ``5GB``)."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from .errors import CkptavgError

_COUNT_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTE_SUFFIXES = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def _parse(text: str, suffixes: dict[str, int], what: str) -> int:
    match = _NUMBER.match(str(text))
    if not match:
        raise CkptavgError(f"cannot parse {what} {text!r} (examples: 100B, 2.5T, 4M, 1e9)")
    number, suffix = match.group(1), match.group(2).upper()
    if suffix not in suffixes:
        known = ", ".join(s for s in suffixes if s)
        raise CkptavgError(f"unknown suffix {suffix!r} in {what} {text!r} (known: {known})")
    try:
        # Decimal, not float: "2.5T" must be exactly 2_500_000_000_000 tokens.
        value = Decimal(number) * suffixes[suffix]
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only valid numbers
        raise CkptavgError(f"cannot parse {what} {text!r}") from exc
    if value != value.to_integral_value():
        raise CkptavgError(f"{what} {text!r} is not a whole number ({value})")
    return int(value)


def parse_count(text: str | int) -> int:
    """Parse a token count such as ``100B`` (10^11), ``2.5T``, ``4M``, ``1e9`` or ``12345``."""
    if isinstance(text, int):
        return text
    return _parse(text, _COUNT_SUFFIXES, "token count")


def parse_size(text: str | int) -> int:
    """Parse a byte size such as ``5GB`` (decimal), ``512MiB`` (binary) or ``1000000``."""
    if isinstance(text, int):
        return text
    return _parse(text, _BYTE_SUFFIXES, "size")


def format_count(value: int) -> str:
    """Short human form of a token count: 100000000000 -> ``100B``, 2500000000000 -> ``2.5T``."""
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if abs(value) >= scale:
            text = f"{value / scale:.3f}".rstrip("0").rstrip(".")
            return f"{text}{suffix}"
    return str(value)


def format_bytes(value: float) -> str:
    """Decimal byte size for people: 1234567890 -> ``1.23 GB``."""
    for suffix, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {suffix}"
    return f"{int(value)} B"
