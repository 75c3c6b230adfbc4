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


def finish_mean(total: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor, divisor: float | None) -> None:
    """Write the mean into ``out`` (the output dtype): ``total / divisor`` rounded once to the
    sum's dtype and then cast, or ``total`` cast as it is when the weights already sum to one
    (``divisor`` None). ``scratch`` has the sum's dtype and size."""
    if divisor is None:
        out.copy_(total)
    elif out.dtype == total.dtype:
        torch.div(total, divisor, out=out)
    else:
        torch.div(total, divisor, out=scratch)
        out.copy_(scratch)


def is_finite(total: torch.Tensor) -> bool:
    """Whether every element is finite: the cheap reduction first, the elementwise check only
    when the sum is not finite (a finite sum can still overflow)."""
    return bool(torch.isfinite(total.sum())) or bool(torch.isfinite(total).all())
