"""Parsing and printing of token counts, byte sizes (``100B``, ``2.5T``, ``5GB``) and dtype
names (``bf16``), and the element count of a shape.

torch is imported only when a dtype name is parsed: ``ckptavg plan`` imports this module and
starts without torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from fractions import Fraction
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    import torch

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
# Counts and sizes fit a signed 64-bit integer, as trainers and file offsets store them; anything
# larger (1e400 tokens) is a typo, refused before it reaches arithmetic that would choke on it.
MAX_QUANTITY = 2**63 - 1
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def _digits_and_exponent(number: str) -> tuple[str, int]:
    """``"2.50e3"`` -> ``("25", 2)``: the number is exactly ``int(digits) * 10**exponent``, with no
    zeros at either end of the digits ("" for zero). Parsed by hand, not by float (inexact) nor
    Decimal (which refuses exponents past 10**18); an exponent of more than 9 digits is kept at
    +-10**9, far past any limit."""
    mantissa, _, exponent_text = number.lower().partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = (whole + fraction).lstrip("0")
    significant = digits.rstrip("0")
    magnitude = exponent_text.lstrip("+-").lstrip("0") or "0"
    exponent = 10**9 if len(magnitude) > 9 else int(magnitude)
    if exponent_text.startswith("-"):
        exponent = -exponent
    return significant, exponent - len(fraction) + len(digits) - len(significant)


def _parse(text: str, suffixes: dict[str, int], what: str) -> int:
    match = _NUMBER.match(text)
    text = text if len(text) <= 40 else f"{text[:37]}..."  # as the messages show it
    if not match:
        raise ConfigError(f"cannot parse {what} {text!r} (examples: 100B, 2.5T, 4M, 1e9)")
    suffix = match.group(2).upper()
    if suffix not in suffixes:
        known = ", ".join(s for s in suffixes if s)
        raise ConfigError(f"unknown suffix {suffix!r} in {what} {text!r} (known: {known})")
    significant, exponent = _digits_and_exponent(match.group(1))
    if not significant:
        return 0
    # Magnitudes first, before any arithmetic: 1e5000 must not become a 5000-digit integer, nor
    # 1e-999999999 a division by 10**999999999. Without its trailing zeros, a number with more
    # than 40 decimals is no whole number after a suffix of at most 10**12 or 2**40.
    if exponent + len(significant) > len(str(MAX_QUANTITY)):
        raise ConfigError(f"{what} {text!r} is too large (at most {MAX_QUANTITY})")
    if exponent < -40 or (value := int(significant) * suffixes[suffix] * Fraction(10) ** exponent).denominator != 1:
        raise ConfigError(f"{what} {text!r} is not a whole number")
    if value > MAX_QUANTITY:
        raise ConfigError(f"{what} {text!r} is too large (at most {MAX_QUANTITY})")
    return int(value)


def parse_count(text: str | int, what: str = "token count") -> int:
    """Parse a token count such as ``100B`` (10^11), ``2.5T``, ``4M``, ``1e9`` or ``12345``, exactly;
    ``what`` (an option's name) is named in the message that refuses it."""
    if isinstance(text, int):
        return text
    return _parse(text, _COUNT_SUFFIXES, what)


def parse_size(text: str | int, what: str = "size") -> int:
    """Parse a byte size such as ``5GB`` (decimal), ``512MiB`` (binary) or ``1000000``."""
    if isinstance(text, int):
        return text
    return _parse(text, _BYTE_SUFFIXES, what)


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


def numel(shape: Iterable[int]) -> int:
    """Elements of a tensor of ``shape`` (1 for a scalar's ``()``)."""
    return math.prod(shape)


# The output dtypes of floating tensors, as ``ckptavg merge --dtype`` and ``MergeHookConfig.dtype``
# name them: each name to the torch attribute it means.
DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "fp64": "float64",
    "float64": "float64",
}


def parse_dtype(name: str, what: str = "dtype") -> torch.dtype:
    """The torch dtype a name of :data:`DTYPE_ALIASES` means (any case); ``what`` (an option's
    name) is named in the message that refuses it."""
    key = name.lower()
    if key not in DTYPE_ALIASES:
        raise ConfigError(f"unknown {what} {name!r} (choose from bf16, fp16, fp32, fp64)")
    import torch  # here, not at the top: parsing counts and sizes must not import torch

    dtype: torch.dtype = getattr(torch, DTYPE_ALIASES[key])
    return dtype


def every(stride: int, unit: str = "step") -> str:
    """``every step`` or ``every 10 steps``: a stride as a message says it."""
    return f"every {unit}" if stride == 1 else f"every {stride} {unit}s"
