"""The arithmetic of an average, one block of elements at a time: shared by the merge engine and
the training hook's running sums, so that both round exactly alike.

Callers hand in blocks small enough to stay in cache (the engine: a few hundred thousand
elements per worker thread; the hook: at most ATen's grain size, so that no OpenMP team starts
in its background thread). Per element the sequence is fixed: the first source is copied into
the sum (and scaled by its weight), every later one is converted once into ``scratch`` and added
(``add_(x, alpha=weight)``, after ``mul_(decay)`` for the hook's decaying weightings). Elementwise
ops give the same bits whatever the block boundaries, so block size and thread count never
change an output.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

import torch

# ATen's grain size: an op on at most this many elements runs in the calling thread without
# starting an OpenMP team (see ckptavg.hook.workers for why a background thread must not).
INLINE_ELEMENTS = 32768


def start_sum(total: torch.Tensor, values: torch.Tensor, weight: float = 1.0) -> None:
    """``total = values * weight`` (``total`` contiguous, of the sum's dtype)."""
    total.copy_(values)
    if weight != 1.0:
        total.mul_(weight)


def fold_in(
    totals: Sequence[torch.Tensor],
    values: torch.Tensor,
    scratch: torch.Tensor,
    factors: Sequence[tuple[float, float]] | None = None,
) -> None:
    """``t.mul_(decay).add_(values, alpha=weight)`` for each ``t`` of ``totals`` and its
    ``(decay, weight)`` (plain ``t.add_(values)`` without ``factors``). ``values`` of another
    dtype than the sums is converted once into ``scratch`` (as many elements, the sums' dtype):
    a mixed-dtype ``add_`` would allocate a temporary per call and run ~2x slower."""
    if values.dtype != totals[0].dtype:
        scratch.copy_(values)
        values = scratch
    for total, (decay, weight) in zip(totals, factors or [(1.0, 1.0)] * len(totals), strict=True):
        if decay != 1.0:
            total.mul_(decay)
        if weight == 1.0:
            total.add_(values)
        else:
            total.add_(values, alpha=weight)


def finish_mean(
    total: torch.Tensor,
    out: torch.Tensor,
    scratch: torch.Tensor,
    divisor: float | None,
    near: torch.Tensor | None = None,
) -> None:
    """Write the mean into ``out`` (the output dtype): ``total / divisor`` rounded once to the
    sum's dtype and then written as ``out``'s, or ``total`` as it is when the weights already sum
    to one (``divisor`` None). ``scratch`` has the sum's dtype and size; ``near`` is an fp32 block
    of that size, needed where an fp64 sum is written as a dtype of fewer than 32 bits (then
    ``total`` is overwritten)."""
    if divisor is not None and out.dtype == total.dtype:
        torch.div(total, divisor, out=out)
        return
    mean, free = (total, scratch) if divisor is None else (scratch, total)
    if divisor is not None:
        torch.div(total, divisor, out=scratch)
    if mean.dtype == torch.float64 and out.dtype.itemsize < 4:
        assert near is not None, "an fp64 mean written in fewer bits needs an fp32 block"
        round_to_odd(mean, near, free)
        out.copy_(near)
    else:
        out.copy_(mean)


def round_to_odd(values: torch.Tensor, near: torch.Tensor, work: torch.Tensor) -> None:
    """``near`` := the fp64 ``values`` rounded to fp32 to odd: exact values as they are, the others
    to whichever fp32 neighbour has an odd last bit. ``values`` and ``work`` (fp64, as many
    elements) are overwritten.

    Why: torch casts fp64 to bf16, fp16 or float8 through fp32, rounding twice, and a value just
    past a midpoint of the narrow grid can round to the midpoint in fp32, then to even, the wrong
    way (fp64 18432 + 2**-18 becomes float8_e5m2 16384, not 20480). Rounded to odd in a format with
    at least two more bits, a value can land on no midpoint it was not on, so the one rounding
    that follows, to nearest even, is that of the fp64 value itself (Boldo and Melquiond, "When
    double rounding is odd", 2005); fp32 has 24 bits, bf16 8, fp16 11, float8 at most 4."""
    near.copy_(values)  # to nearest
    torch.sub(values, near, out=work)  # what the rounding left out: exact in fp64
    # Its sign times the value's: 1 where ``near`` lies toward zero of the value, -1 where it lies
    # away from zero, 0 where it is exact, and for NaN and Inf (whose difference is NaN). (The
    # product underflows only below 2**-480, which every narrow format writes as zero either way.)
    work.mul_(values).sign_().nan_to_num_(nan=0.0)
    steps = values.view(torch.int64)
    steps.copy_(work)
    # An even ``near`` moves one step (its bits, sign and magnitude, count up away from zero):
    # away from zero where it lies toward it, toward zero where it lies away; an odd one stays.
    even = work.view(torch.int64)
    torch.bitwise_and(near.view(torch.int32), 1, out=even)
    even.neg_().add_(1)
    steps.mul_(even)
    near.view(torch.int32).add_(steps)


def finite(values: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite`` of floats of every width: 1-byte floats through fp32 (torch's isfinite
    takes no float8_e4m3fn, and calls float8_e8m0fnu's NaN finite)."""
    return torch.isfinite(values.float() if values.dtype.itemsize == 1 else values)


def is_finite(total: torch.Tensor) -> bool:
    """Whether every element is finite: the cheap reduction first, the elementwise check only
    when the sum is not finite (a finite sum can still overflow); torch sums no float8."""
    if total.dtype.itemsize == 1:
        return bool(finite(total).all())
    return bool(torch.isfinite(total.sum())) or bool(torch.isfinite(total).all())


# -- weighted sums ------------------------------------------------------------------------------
#
# A weighted sum in an accumulator of unit roundoff u errs by up to about m u S (m terms whose
# magnitudes sum to S), and where the terms cancel that is any multiple of the result: fp32 sums
# of bf16 inputs came out up to 146 ulps off with minus-sqrt weights, and weights of both signs
# lose every bit. So a weighted sum written in at most 24 bits is taken in fp64 (u = 2^-53), and
# each element is checked: with M the largest |input| of the element and W = sum |w_i|, each of
# the 2m roundings (product, sum) errs by at most u of its result, and each result is at most
# W M (1 + 2m u), so the fp64 sum s is within E = (2m + 2) u W M (+ 2^-1074 per operation below
# the normal range) of the exact sum r. The output, s rounded once (through fp32 rounded to odd),
# is r correctly rounded wherever [s - E, s + E] holds no midpoint of the output's grid, that is
# everywhere but within about 2^(p - 53 + log2(4 m W M / |r|)) of a midpoint (p the output's bits):
# for 16-bit outputs and realistic cancellation a few elements in 10^9. Where the weights have so
# few bits that every product is exact in fp64 (0.25, 0.75: an exact tie is then common) each
# addition is checked for exactness as well, and an element whose additions were all exact has
# E = 0. The elements the bound cannot vouch for are recomputed exactly with rationals, so every
# output is the exact weighted sum correctly rounded (round to nearest, ties to even).
#
# An fp64 output cannot be checked so cheaply (E exceeds its half-ulp). With negative weights its
# sum is compensated instead (Ogita, Rump and Oishi's Sum2, "Accurate sum and dot product", 2005):
# each weight is split so that every product with an input is exact in fp64, each addition's
# rounding error is recovered exactly (TwoSum) and summed beside, and the result is within
# u|r| + (m u)^2 S of r; where that bound cannot place the output within one ulp of r (cancellation
# past about 2^90 / m^2), the element is recomputed exactly with rationals.

_UNIT = 2.0**-53
_SMALLEST = 2.0**-1074
# (significant bits, smallest exponent of a normal value) of each float dtype, for its grid.
_PRECISION = {
    torch.float64: (53, -1022),
    torch.float32: (24, -126),
    torch.bfloat16: (8, -126),
    torch.float16: (11, -14),
    torch.float8_e4m3fn: (4, -6),
    torch.float8_e4m3fnuz: (4, -7),
    torch.float8_e5m2: (3, -14),
    torch.float8_e5m2fnuz: (3, -15),
}


def split_weight(weight: float, bits: int) -> tuple[float, float]:
    """``weight = hi + lo`` exactly, ``hi`` of at most ``bits`` significant bits and ``lo`` of at
    most ``53 - bits``: an input of ``53 - bits`` bits or fewer times either is exact in fp64."""
    if weight == 0.0:
        return 0.0, 0.0
    mantissa, exponent = math.frexp(weight)
    hi = math.ldexp(round(math.ldexp(mantissa, bits)), exponent - bits)
    return hi, weight - hi


@dataclass(frozen=True)
class ErrorBound:
    """What :meth:`WeightedSum.mean` needs of its weights: E = ``scale`` * max|x| + ``tail`` bounds
    an element's fp64 sum's error; ``exact_products`` where every product with an input is exact
    in fp64 (then sums whose additions were all exact have E = 0)."""

    scale: float
    tail: float
    exact_products: bool


@functools.lru_cache(maxsize=256)
def error_bound(weights: tuple[float, ...], dtype: torch.dtype) -> ErrorBound:
    """The :class:`ErrorBound` of a sum of ``len(weights)`` inputs of ``dtype`` (the module's
    comment above derives it; the factor 1 + 2^-30 covers the rounding of sum |w| and of E)."""
    operations = 2 * len(weights) + 2
    scale = operations * _UNIT * math.fsum(abs(w) for w in weights) * (1 + 2.0**-30)
    bits, lowest = _PRECISION[dtype]
    finest = lowest - bits + 1  # the exponent of the input's smallest spacing

    def exact(weight: float) -> bool:  # its products have <= 53 bits, none below 2^-1074
        numerator, denominator = abs(weight).as_integer_ratio()
        return numerator.bit_length() <= 53 - bits and finest - (denominator.bit_length() - 1) >= -1074

    return ErrorBound(scale, operations * _SMALLEST, all(map(exact, weights)))


class WeightedLoop(Protocol):
    """The compiled weighted sums (:meth:`.native.NativeMean.weighted`)."""

    def weighted(
        self,
        sources: Sequence[torch.Tensor],
        weights: Sequence[float],
        out: torch.Tensor,
        bound: ErrorBound,
        doubtful: torch.Tensor,
    ) -> int: ...


class WeightedSum:
    """Reused blocks for :meth:`mean` (one set per worker thread): fp64 blocks of ``elements``
    for torch's ops, and a flag per element for the compiled loop."""

    def __init__(self, elements: int) -> None:
        self.elements = elements
        self._blocks: list[torch.Tensor] = []
        self._near = torch.empty(0, dtype=torch.float32)
        self._rounded = torch.empty(0, dtype=torch.bool)
        self._doubtful = torch.empty(0, dtype=torch.uint8)

    def mean(
        self,
        sources: Sequence[torch.Tensor],
        weights: Sequence[float],
        out: torch.Tensor,
        native: WeightedLoop | None = None,
    ) -> None:
        """``out`` := the weighted sum of ``sources`` (1-D, any float dtype; weights normalised,
        of either sign): the exact sum correctly rounded to ``out``'s dtype, or for an fp64
        ``out`` within one ulp of it. ``native``: the compiled loops, where they take ``out``'s
        dtype (the sources' too), else torch's ops; the same bits either way. Non-finite inputs
        give non-finite outputs, for the caller's check. Elementwise: the same bits whatever the
        blocks."""
        if out.dtype == torch.float64:
            for lo in range(0, out.numel(), self.elements):
                hi = min(out.numel(), lo + self.elements)
                self._compensated([s[lo:hi] for s in sources], weights, out[lo:hi])
            return
        bound = error_bound(tuple(weights), sources[0].dtype)
        if native is not None:
            doubtful = self._flags(out.numel())
            if native.weighted(sources, weights, out, bound, doubtful):
                self._settle(doubtful.nonzero().flatten(), sources, weights, out)
            return
        for lo in range(0, out.numel(), self.elements):
            hi = min(out.numel(), lo + self.elements)
            parts = [s[lo:hi] for s in sources]
            doubtful = self._checked_sum(parts, weights, out[lo:hi], bound)
            if bool(doubtful.any()):
                self._settle(doubtful.nonzero().flatten(), parts, weights, out[lo:hi])

    def _take(self, count: int) -> list[torch.Tensor]:
        """The fp64 blocks, of ``count`` elements each."""
        if not self._blocks:
            self._blocks = [torch.empty(self.elements, dtype=torch.float64) for _ in range(8)]
            self._near = torch.empty(self.elements, dtype=torch.float32)
            self._rounded = torch.empty(self.elements, dtype=torch.bool)
        return [b[:count] for b in self._blocks]

    def _checked_sum(
        self, sources: Sequence[torch.Tensor], weights: Sequence[float], out: torch.Tensor, bound: ErrorBound
    ) -> torch.Tensor:
        """``out`` := the fp64 sum rounded once; returns where the bound does not vouch for it
        (what the compiled loops compute, with torch's ops: a product and a sum per input)."""
        count = out.numel()
        total, x, term, top, work, spare, _, _ = self._take(count)
        rounded, flags = self._rounded[:count], self._flags(count).view(torch.bool)
        rounded.zero_()
        x.copy_(sources[0])
        torch.abs(x, out=top)
        torch.mul(x, weights[0], out=total)
        for source, weight in zip(sources[1:], weights[1:], strict=True):
            x.copy_(source)
            torch.abs(x, out=work)
            torch.maximum(top, work, out=top)
            torch.mul(x, weight, out=term)
            if not bound.exact_products:
                total.add_(term)
                continue
            torch.add(total, term, out=work)
            # exact iff (s + t) - s == t and (s + t) - t == s: see native.c's additions_exact
            torch.sub(work, total, out=x)
            torch.ne(x, term, out=flags)
            rounded.logical_or_(flags)
            torch.sub(work, term, out=x)
            torch.ne(x, total, out=flags)
            rounded.logical_or_(flags)
            total.copy_(work)
        self._round(total, out, work, spare)
        return self._doubt(total, top, rounded if bound.exact_products else None, out, bound, flags)

    def _flags(self, count: int) -> torch.Tensor:
        """A byte per element (grown to the largest range asked for)."""
        if self._doubtful.numel() < count:
            self._doubtful = torch.empty(count, dtype=torch.uint8)
        return self._doubtful[:count]

    def _doubt(
        self,
        total: torch.Tensor,
        top: torch.Tensor,
        rounded: torch.Tensor | None,
        out: torch.Tensor,
        bound: ErrorBound,
        into: torch.Tensor,
    ) -> torch.Tensor:
        """Where the bound does not vouch for ``out``, ``total`` rounded (native.c's ``vouched``:
        E = 0, or ``|total| -+ E`` strictly between the midpoints around ``out``; a total that is
        not finite is vouched for, its output being not finite too). ``top`` is overwritten."""
        bits, lowest = _PRECISION[out.dtype]
        zeros = top == 0  # every input zero: the sum is exact, its zero's sign IEEE's
        error = top.mul_(bound.scale).add_(bound.tail).masked_fill_(zeros, 0.0)
        if rounded is not None:
            error.masked_fill_(~rounded, 0.0)
        written = out.double().abs_()
        away, toward = _grid(written, bits, lowest)
        size = total.abs()
        inside = (size + error < written + away * 0.5) & (size - error > written - toward * 0.5)
        inside &= (written != 0) | (size > error)  # a zero only where the sign is sure too
        return torch.logical_not(inside | (error == 0) | ~torch.isfinite(total), out=into)

    def _settle(
        self, indices: torch.Tensor, sources: Sequence[torch.Tensor], weights: Sequence[float], out: torch.Tensor
    ) -> None:
        """Recompute ``out`` at ``indices`` exactly: the exact sum, correctly rounded. Where the
        fp64 sum's bound leaves one midpoint of the output's grid in doubt (the common case: a
        weighted sum within 2^-50 or so of a midpoint, as rational weights such as 1/13 give
        often), the exact sign of the sum minus that midpoint decides (:func:`_sign_past`); the
        elements left (cancellation past half an output ulp, or a sign undecided) take rationals."""
        bits, lowest = _PRECISION[out.dtype]
        xs = [source[indices].double() for source in sources]
        total = torch.zeros_like(xs[0])
        for x, weight in zip(xs, weights, strict=True):
            total.add_(x * weight)
        top = torch.stack(xs).abs().amax(0)
        bound = error_bound(tuple(weights), sources[0].dtype)
        error = top.mul_(bound.scale).add_(bound.tail)
        value = self._round_gathered(total, out.dtype)
        up, down = _grid(value, bits, lowest)
        rising = total >= value
        above = torch.where(value >= 0, value + up, value + down)
        below = torch.where(value > 0, value - down, value - up)
        neighbour = torch.where(rising, above, below)
        midpoint = (value + neighbour) * 0.5  # exact: one bit below the grid
        sign = _sign_past(xs, weights, midpoint, sources[0].dtype)
        odd = (value.abs() / up).fmod_(2) == 1  # the last bit of its significand
        beyond = torch.where(rising, sign > 0, sign < 0) | ((sign == 0) & odd)
        settled = torch.where(beyond, neighbour, value)
        # A zero takes the sign of the exact sum (+0 where that is 0).
        zero = settled == 0
        if bool(zero.any()):
            sure = total.abs() > error
            exact = _sign_past(xs, weights, torch.zeros_like(total), sources[0].dtype)
            signs = torch.where(sure, torch.sign(total), exact)
            settled = torch.where(zero, torch.where(signs < 0, -0.0, 0.0), settled)
            sign = torch.where(zero & torch.isnan(signs), math.nan, sign)
        # One midpoint decides where S lies within half the finer gap around ``value`` of ``total``.
        decided = (error < torch.minimum(up, down) * 0.5) & ~torch.isnan(sign) & torch.isfinite(total)
        out[indices[decided]] = settled[decided].to(out.dtype)
        for index in indices[~decided].tolist():
            values = [float(source[index]) for source in sources]
            if all(map(math.isfinite, values)):
                out[index] = _rounded(_exact(values, weights), bits, lowest)

    def _round_gathered(self, total: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``total`` rounded once to ``dtype``'s grid, as fp64 (``total`` kept)."""
        rounded = torch.empty(total.numel(), dtype=dtype)
        finish_mean(total.clone(), rounded, torch.empty_like(total), None, torch.empty(total.numel()))
        return rounded.double()

    def _compensated(self, sources: Sequence[torch.Tensor], weights: Sequence[float], out: torch.Tensor) -> None:
        """``out`` (fp64) := within one ulp of the exact weighted sum: Sum2, checked (above)."""
        count = out.numel()
        s, c, bound, term, t1, t2, x, x_lo = self._take(count)
        wide = sources[0].dtype == torch.float64  # 53-bit inputs are split too (Veltkamp)
        parts = [split_weight(w, 27 if wide else 29) for w in weights]
        s.zero_()
        c.zero_()
        bound.zero_()
        terms = 0
        for source, weight, (w_hi, w_lo) in zip(sources, weights, parts, strict=True):
            x.copy_(source)
            torch.abs(x, out=t1)
            bound.add_(t1, alpha=abs(weight))
            pieces = [x]
            if wide:
                torch.mul(x, 134217729.0, out=t1)  # 2**27 + 1
                torch.sub(t1, x, out=t2)
                t1.sub_(t2)  # the high 26 bits
                torch.sub(x, t1, out=x_lo)  # the rest, 26 bits with its sign
                x.copy_(t1)
                pieces = [x, x_lo]
            for piece in pieces:
                for part in (w_hi, w_lo):
                    if part != 0.0:
                        torch.mul(piece, part, out=term)  # exact
                        s, t1 = _two_sum(s, term, c, t1, t2), s
                        terms += 1
        torch.add(s, c, out=t1)  # the compensated sum
        out.copy_(t1)
        self._fix(t1, out, terms, bound, sources, weights, t2, s, c)

    def _round(self, total: torch.Tensor, out: torch.Tensor, work: torch.Tensor, scratch: torch.Tensor) -> None:
        """``out`` := ``total`` rounded once to ``out``'s dtype (``total`` kept)."""
        work.copy_(total)
        finish_mean(work, out, scratch, None, self._near[: out.numel()])

    def _fix(
        self,
        total: torch.Tensor,
        out: torch.Tensor,
        terms: int,
        bound: torch.Tensor,
        sources: Sequence[torch.Tensor],
        weights: Sequence[float],
        work: torch.Tensor,
        spare: torch.Tensor,
        slack: torch.Tensor,
    ) -> None:
        """Recompute exactly the elements of the fp64 ``out`` that the error bound does not place
        within one ulp of the exact sum: ``|out - total| + err <= ulp(max(|total| - err, 0))``,
        with err Sum2's bound on ``|total - exact|`` (scaled up by a margin for its own rounding,
        plus an underflow term per operation), implies ``|out - exact| <= ulp(|exact|)``."""
        # Sum2's bound with a margin for its own rounding: gamma of two more terms, S up by 2^-26
        # (the split weights' parts together exceed the weight by at most 2^-28 of it).
        gamma = (terms + 2) * _UNIT / (1 - (terms + 2) * _UNIT)
        bits, lowest = _PRECISION[out.dtype]
        err = slack
        torch.abs(total, out=err)
        err.mul_(_UNIT).add_(bound, alpha=gamma * gamma * (1 + 2.0**-26)).mul_(1 + 16 * _UNIT)
        err.add_(4 * terms * _SMALLEST)  # products and compensations below the normal range
        work.copy_(out)
        work.sub_(total).abs_().add_(err).mul_(1 + 4 * _UNIT)  # |out - total| + err, rounded up
        low = spare
        torch.abs(total, out=low)
        low.sub_(err).clamp_(min=0).mul_(1 - 4 * _UNIT)
        exponent = torch.frexp(low).exponent.sub_(1)  # floor(log2(low))
        exponent = torch.where(low == 0, lowest, exponent.clamp_(min=lowest))
        doubtful = ~(work <= torch.ldexp(torch.ones_like(low), exponent - (bits - 1)))  # NaN included
        if not bool(doubtful.any()):
            return
        for source in sources:  # a non-finite input makes a non-finite output, for the caller
            doubtful &= finite(source)
        for index in doubtful.nonzero().flatten().tolist():
            out[index] = _exact_sum([float(source[index]) for source in sources], weights)


def _grid(values: torch.Tensor, bits: int, lowest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of each value of the grid of ``bits`` significant bits whose normal values start at
    ``2**lowest`` (fp64, finite): the gap to the next value away from zero, and the gap to the
    next toward zero (half as wide above a power of two past the smallest normal value)."""
    size = values.abs()
    mantissa, exponent = torch.frexp(size)
    exponent = exponent.sub_(1).clamp_(min=lowest).masked_fill_(size == 0, lowest)
    # 2**(exponent - bits + 1) from its bits (torch.ldexp is a pow and a multiply, several times slower)
    away = exponent.to(torch.int64).add_(1023 - (bits - 1)).bitwise_left_shift_(52).view(torch.float64)
    toward = torch.where((mantissa == 0.5) & (exponent > lowest), away * 0.5, away)
    return away, toward


@functools.lru_cache(maxsize=256)
def exact_parts(weights: tuple[float, ...]) -> tuple[float, ...] | None:
    """Each weight split in two (:func:`split_weight`, 29 bits and the rest), so that its parts'
    products with inputs of at most 24 bits are exact in fp64; None where a part is so small
    that a product could fall below fp64's normal range (and lose bits)."""
    parts = tuple(part for w in weights for part in split_weight(w, 29))
    return None if any(0 < abs(part) < 2.0**-800 for part in parts) else parts


def _sign_past(
    xs: Sequence[torch.Tensor], weights: Sequence[float], point: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The sign (-1, 0, 1) of the exact ``sum(w * x) - point`` per element, NaN where undecided.

    Every product is exact in fp64 with each weight split in two (29 + 24 bits against inputs of
    at most 24); their sum with ``-point`` is taken by TwoSum with the errors summed beside (Sum2).
    Where each of those error sums was exact the compensated result is the exact sum rounded once,
    whose sign is the sum's; otherwise its sign is the sum's where it exceeds Sum2's error bound
    (u |r| + gamma^2 S, Ogita, Rump and Oishi 2005, Prop. 4.5). Undecided: inputs of more than 24
    bits, weights so small that a product would fall below fp64's normal range, and the rest."""
    undecided = torch.full_like(point, math.nan)
    parts = exact_parts(tuple(weights))
    if _PRECISION[dtype][0] > 24 or parts is None:
        return undecided
    total, compensation, size = -point, torch.zeros_like(point), point.abs()
    exact = torch.ones_like(point, dtype=torch.bool)
    for j, part in enumerate(parts):
        term = xs[j // 2] * part  # exact
        size += term.abs()
        added = total + term
        back = added - total
        lost = (total - (added - back)) + (term - back)  # TwoSum: exactly total + term - added
        summed = compensation + lost
        exact &= (summed - compensation == lost) & (summed - lost == compensation)
        total, compensation = added, summed
    result = total + compensation
    terms = 2 * len(weights) + 1
    gamma = terms * _UNIT / (1 - terms * _UNIT)
    bound = size * (gamma * gamma * (1 + 2.0**-20)) + terms * 2.0**-1070
    sure = exact | (result.abs() * (1 - 2.0**-50) > bound)
    return torch.where(sure, torch.sign(result), undecided)


def _two_sum(s: torch.Tensor, t: torch.Tensor, c: torch.Tensor, new: torch.Tensor, bp: torch.Tensor) -> torch.Tensor:
    """``new := s + t`` and ``c += (s + t) - new``, the rounding error, exactly (Knuth's TwoSum:
    six operations, no branch, exact in binary floating point rounding to nearest). ``s``, ``t``
    and ``bp`` are overwritten; returns ``new``."""
    torch.add(s, t, out=new)
    torch.sub(new, s, out=bp)
    t.sub_(bp)  # t - bp
    bp.sub_(new).neg_()  # new - bp
    s.sub_(bp).add_(t)  # (s - (new - bp)) + (t - bp)
    c.add_(s)
    return new


def _exact(values: Sequence[float], weights: Sequence[float]) -> Fraction:
    """The exact weighted sum."""
    return sum((Fraction(w) * Fraction(v) for v, w in zip(values, weights, strict=True)), Fraction(0))


def _exact_sum(values: Sequence[float], weights: Sequence[float]) -> float:
    """The exact weighted sum, rounded once to fp64 (infinite past its range)."""
    return _rounded(_exact(values, weights), 53, -1022)


def _rounded(value: Fraction, bits: int, lowest: int) -> float:
    """``value`` rounded to nearest (ties to even) on the grid of ``bits`` significant bits whose
    normal values start at ``2**lowest`` (subnormals below), as a float; infinite past fp64's
    range (a float past the output's range becomes infinite as it is written)."""
    size = abs(value)
    if size == 0:
        return 0.0
    exponent = size.numerator.bit_length() - size.denominator.bit_length()  # floor(log2), or one more
    if size < Fraction(2) ** exponent:
        exponent -= 1
    quantum = max(exponent, lowest) - bits + 1
    steps = round(size / Fraction(2) ** quantum)  # half to even
    try:
        return math.copysign(math.ldexp(steps, quantum), value)
    except OverflowError:
        return math.copysign(math.inf, value)
