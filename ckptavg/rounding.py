"""Correct rounding of a mean computed in a wider type and stored in a 16-bit float.

``sum / n`` in fp32 followed by a cast to bf16 rounds twice. The result differs from the
correctly rounded mean only where the fp32 quotient lands exactly halfway between two bf16
values while the true quotient does not: about one element in 2^16 for a window of 3. Those
elements are found with two cheap integer passes and decided exactly in fp64, where
``quotient * n`` and the fp32 sum are both exact.
"""

from __future__ import annotations

import torch

# Bits of an fp32 significand dropped when rounding to each 16-bit type (normal range).
_DROPPED_BITS = {torch.bfloat16: 16, torch.float16: 13}


def accumulator_dtype(input_dtype: torch.dtype, output_dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16- and 8-bit floats (their sums are exact in fp32), fp64 for fp32 and fp64
    inputs, and fp64 whenever the output itself is fp64."""
    if input_dtype.itemsize >= 4 or output_dtype.itemsize >= 8:
        return torch.float64
    return torch.float32


def needs_midpoint_fix(acc_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    return acc_dtype == torch.float32 and out_dtype in _DROPPED_BITS


def fix_double_rounding(
    total: torch.Tensor,
    quotient: torch.Tensor,
    out: torch.Tensor,
    count: int,
    scratch_int: torch.Tensor,
    scratch_bool: torch.Tensor,
) -> int:
    """Make ``out`` the correctly rounded ``total / count`` where ``out = cast(quotient)``
    rounded twice. ``total`` and ``quotient`` are fp32; the scratch tensors are reused
    buffers of at least ``total.numel()`` elements. Returns how many elements changed.
    """
    dropped = _DROPPED_BITS[out.dtype]
    n = total.numel()
    low = torch.bitwise_and(quotient.view(torch.int32), (1 << dropped) - 1, out=scratch_int[:n])
    halfway = torch.eq(low, 1 << (dropped - 1), out=scratch_bool[:n])
    if not bool(halfway.any()):
        return 0
    index = halfway.nonzero().squeeze(1)
    q = quotient[index]
    chosen = out[index].to(torch.float32)
    # When q is a midpoint, its other neighbour in the output type is exactly 2q - chosen.
    other = 2 * q - chosen
    is_midpoint = (other.to(out.dtype).to(torch.float32) == other) & (other != chosen)
    # Sign of (true mean - q), exact: q * count fits in fp64's 53 bits and so does the sum.
    residual = total[index].to(torch.float64) - q.to(torch.float64) * count
    toward_other = torch.where(other > chosen, residual > 0, residual < 0)
    change = is_midpoint & toward_other
    out[index[change]] = other[change].to(out.dtype)
    return int(change.sum())
