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

from collections.abc import Sequence

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
