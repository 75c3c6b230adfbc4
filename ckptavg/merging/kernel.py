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

import math
from collections.abc import Sequence
from fractions import Fraction

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


# -- weighted sums with negative weights ------------------------------------------------------
#
# With weights of both signs the terms cancel, and an accumulator's rounding errors, bounded by
# its unit roundoff times the sum of the terms' magnitudes, can be any multiple of the result:
# fp32 sums of bf16 inputs weighted 3, -2 lose every bit of x where 3x and 2y nearly cancel. So
# such sums are taken exactly term by term and compensated (Ogita, Rump and Oishi's Sum2, "Accurate
# sum and dot product", 2005): each weight is split so that every product with an input is exact
# in fp64, each addition's rounding error is recovered exactly (TwoSum) and summed beside, and the
# result is within u|r| + (m u)^2 S of the exact sum r (u = 2^-53, m terms, S the sum of their
# magnitudes). Each element is then checked: where that bound cannot guarantee an output within
# one ulp of r (cancellation past about 2^90 / m^2, which no training run gives but an adversary
# can), the element is recomputed exactly with rationals.

_UNIT = 2.0**-53
_SMALLEST = 2.0**-1074
# (significant bits, smallest exponent of a normal value) of each output dtype, for its ulp.
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


class SignedSum:
    """Reused fp64 blocks for :meth:`mean` (one set per worker thread), of ``elements`` each."""

    def __init__(self, elements: int) -> None:
        self.elements = elements
        self._blocks = [torch.empty(elements, dtype=torch.float64) for _ in range(8)]
        self._near = torch.empty(elements, dtype=torch.float32)

    def mean(self, sources: Sequence[torch.Tensor], weights: Sequence[float], out: torch.Tensor) -> None:
        """``out`` := the weighted sum of ``sources`` (1-D, at most :attr:`elements` each, any
        float dtype; weights normalised, some negative) within one ulp of ``out``'s dtype of the
        exact sum of the products. Non-finite inputs give non-finite outputs, for the caller's
        check. Elementwise: the same bits whatever the blocks."""
        count = out.numel()
        s, c, bound, term, t1, t2, x, x_lo = (b[:count] for b in self._blocks)
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
        self._round(t1, out, t2, s)
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
        """Recompute exactly the elements of ``out`` that the error bound does not place within
        one ulp of the exact sum: ``|out - total| + err <= ulp(max(|total| - err, 0))``, with err
        Sum2's bound on ``|total - exact|`` (scaled up by a margin for its own rounding, plus an
        underflow term per operation), implies ``|out - exact| <= ulp(|exact|)``."""
        # Sum2's bound with a margin for its own rounding: gamma of two more terms, S up by 2^-26
        # (the split weights' parts together exceed the weight by at most 2^-28 of it).
        gamma = (terms + 2) * _UNIT / (1 - (terms + 2) * _UNIT)
        bits, lowest = _PRECISION[out.dtype]
        err = slack
        torch.abs(total, out=err)
        err.mul_(_UNIT).add_(bound, alpha=gamma * gamma * (1 + 2.0**-26)).mul_(1 + 16 * _UNIT)
        err.add_(4 * terms * _SMALLEST)  # products and compensations below the normal range
        work.copy_(out)  # exact: a narrower float in fp64
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
        indices = doubtful.nonzero().flatten().tolist()
        if indices:
            work.copy_(total)
            for index in indices:
                work[index] = _exact_sum([float(source[index]) for source in sources], weights)
            self._round(work, out, spare, slack)


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


def _exact_sum(values: Sequence[float], weights: Sequence[float]) -> float:
    """The exact weighted sum, rounded once to fp64 (infinite past its range)."""
    exact = sum((Fraction(w) * Fraction(v) for v, w in zip(values, weights, strict=True)), Fraction(0))
    try:
        return float(exact)
    except OverflowError:
        return math.copysign(math.inf, exact)
