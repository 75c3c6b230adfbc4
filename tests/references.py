"""Independent references for exactness checks, without pytest: tests and benchmarks/gpu_check.py
use them alike."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from pathlib import Path

import torch
from safetensors.torch import load_file


def load_merged(folder: Path) -> dict[str, torch.Tensor]:
    """Load a merged output through its index, as a consumer would."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for file_name in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(folder / file_name)))
    assert set(out) == set(index["weight_map"])
    return out


def correctly_rounded(mean: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round-to-nearest-even of a float64 tensor straight to ``dtype`` (no intermediate fp32).

    Independent of the code under test: find each value's quantum (the spacing of ``dtype``
    around it, subnormals included), round ``value / quantum`` half to even in float64 (exact
    here), and scale back; the result is representable in ``dtype``, so the final cast is exact.
    """
    bits, smallest_quantum = {torch.bfloat16: (8, -133), torch.float16: (11, -24), torch.float32: (24, -149)}[dtype]
    _, exponent = torch.frexp(mean)
    quantum = torch.clamp(exponent - bits, min=smallest_quantum)
    rounded = torch.round(torch.ldexp(mean, -quantum))
    return torch.ldexp(rounded, quantum).to(dtype)


def weighted_correctly_rounded(
    values: Sequence[torch.Tensor], weights: Sequence[float], dtype: torch.dtype
) -> torch.Tensor:
    """The exact ``sum(weights[i] * values[i])`` (inputs of any float dtype, float64 weights as
    given) rounded to nearest even in ``dtype`` (bf16, fp16 or fp32), flattened.

    Independent of the code under test: the float64 sum of float64 products is within
    ``slack = 4 n 2^-53 sum|w x|`` of the exact sum, so where ``sum - slack`` and ``sum + slack``
    round to the same value the exact sum does too (rounding is monotonic) and is that value;
    every other element (near a midpoint of the grid, or cancelling) is summed with rationals and
    rounded by :func:`nearest_rational` (a zero with the exact sum's sign, +0 for an exact 0)."""
    xs = [v.double().reshape(-1) for v in values]
    total = xs[0] * weights[0]  # (not 0 + ...: a sum of -0.0 alone is -0.0)
    for x, w in zip(xs[1:], weights[1:], strict=True):
        total = total + x * w
    size = sum((x.abs() * abs(w) for x, w in zip(xs, weights, strict=True)), torch.zeros_like(xs[0]))
    # (inputs all zero: an exact sum, whose zero's sign is IEEE's)
    slack = (size * (4 * len(xs) * 2.0**-53) + 2.0**-1060) * sum(x != 0 for x in xs).clamp(max=1)
    exact = slack == 0  # (and -0.0 + 0.0 would be +0.0)
    low = correctly_rounded(torch.where(exact, total, total - slack), dtype)
    high = correctly_rounded(torch.where(exact, total, total + slack), dtype)
    out = correctly_rounded(total, dtype)
    # (the same zero with either sign is no agreement: a rounded zero has the exact sum's sign)
    doubtful = ((~same_bits(low, high)) & torch.isfinite(total)).nonzero().flatten().tolist()
    for index in doubtful:
        exact = sum((Fraction(w) * Fraction(float(x[index])) for x, w in zip(xs, weights, strict=True)), Fraction(0))
        out[index] = nearest_rational(exact, dtype)
    return out


def nearest_rational(value: Fraction, dtype: torch.dtype) -> float:
    """``value`` rounded to nearest, ties to even, on the grid of ``dtype`` (bf16, fp16, fp32,
    float8_e4m3fn, float8_e5m2; subnormals included, past the largest finite value to a float64
    that ``dtype`` holds as Inf or NaN)."""
    bits, smallest_quantum = {
        torch.bfloat16: (8, -133),
        torch.float16: (11, -24),
        torch.float32: (24, -149),
        torch.float8_e4m3fn: (4, -9),
        torch.float8_e5m2: (3, -16),
    }[dtype]
    if value == 0:
        return 0.0
    exponent = math.floor(math.log2(abs(float(value))))  # then corrected: the float may round up
    while Fraction(2) ** exponent > abs(value):
        exponent -= 1
    while Fraction(2) ** (exponent + 1) <= abs(value):
        exponent += 1
    quantum = Fraction(2) ** max(exponent - bits + 1, smallest_quantum)
    steps, rest = divmod(abs(value), quantum)
    if 2 * rest > quantum or (2 * rest == quantum and steps % 2):
        steps += 1
    return math.copysign(float(steps * quantum), value)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bit equality (so -0.0 != 0.0 and NaN payloads count)."""
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}[a.element_size()]
    return a.contiguous().view(view) == b.contiguous().view(view)


def reference(saved: Mapping[int, Mapping[str, torch.Tensor]], steps: Iterable[int]) -> dict[str, torch.Tensor]:
    """The correctly rounded float64 mean over ``steps`` of each floating-point tensor that
    ``saved`` (weights by step) holds, in its own dtype."""
    sources = [saved[step] for step in steps]
    return {
        key: correctly_rounded(torch.stack([source[key].double() for source in sources]).mean(0), value.dtype)
        for key, value in sources[0].items()
        if value.is_floating_point()
    }


def assert_equal(merged: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    """The same names, and each tensor of the same dtype and values."""
    assert set(merged) == set(expected)
    for key, value in expected.items():
        assert merged[key].dtype == value.dtype and torch.equal(merged[key], value), key


def grid_of(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite value of a 1- or 2-byte float ``dtype``, ascending, as float64 (zero once), and
    whether each one's bit pattern is even (its last significand bit 0): found by enumerating
    all of its bit patterns, without any of torch's conversions to ``dtype``."""
    bits = {1: torch.uint8, 2: torch.int16}[dtype.itemsize]
    codes = torch.arange(2 ** (8 * dtype.itemsize), dtype=torch.int64).to(bits)
    values = codes.view(dtype).double()
    keep = torch.isfinite(values) & ~((values == 0) & (torch.signbit(values)))  # -0 is +0
    values, codes = values[keep], codes[keep].to(torch.int64)
    order = torch.argsort(values)
    return values[order], (codes[order] % 2 == 0)


def nearest_by_search(sums: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
    """The value of ``dtype`` nearest to ``sums / count`` (ties to the even bit pattern), as
    float64, found by search in :func:`grid_of`: the reference the float8 means (and torch's own
    casts to float8) are held to. ``sums`` are exact float64 sums of values of ``dtype`` or of a
    narrower float, ``count`` a small integer, and the mean inside the range of ``dtype``: each
    distance ``sums - count * candidate`` is then exact in float64 (the candidates lie within a
    factor of two of the mean, and their products with ``count`` take a few more bits)."""
    grid, even = grid_of(dtype)
    flat = sums.reshape(-1).double()
    at = torch.searchsorted(grid, flat / count).clamp(2, len(grid) - 2)
    candidates = torch.stack([at - 2, at - 1, at, at + 1])  # around the (inexact) quotient's place
    distance = (flat - count * grid[candidates]).abs()
    best = distance.min(0).values
    # Among the nearest: an even pattern if there is one (a tie), else the one nearest.
    chosen = torch.where(distance == best, 2 - even[candidates].to(torch.int64), 3).argmin(0)
    return grid[candidates.gather(0, chosen[None])[0]].reshape(sums.shape)
