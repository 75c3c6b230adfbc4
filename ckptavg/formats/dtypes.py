"""The tensor dtypes ckptavg reads, by the names checkpoints give them, and the scales that
float8 tensors keep beside them.

Read: every float torch averages (fp64, fp32, fp16, bf16, and the four float8 formats), the
integers (signed and unsigned, 8 to 64 bits), bool, and ``float8_e8m0fnu`` (a power of two per
element: the block scales of MX formats, copied like an integer, never averaged). Everything
else torch can store (complex, quantized, bit-packed and sub-byte dtypes, ``float4_e2m1fn_x2``)
is refused where a reader meets it, in one line naming the tensor and the dtype.

A float8 weight quantized with a scale stores the scale as a tensor of its own, named after it:
DeepSeek-V3 and transformers' ``FineGrainedFP8`` write ``X.weight_scale_inv`` beside ``X.weight``
(fp32 blocks, or e8m0), compressed-tensors and vLLM ``X.weight_scale``; the value is the raw
float8 times (or divided by) its scale. :func:`float8_scales` finds them by those names.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

FLOAT8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})
AVERAGED = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, *FLOAT8})
"""Dtypes whose tensors a merge averages."""
COPIED = frozenset(
    {
        torch.float8_e8m0fnu,
        *(torch.int8, torch.int16, torch.int32, torch.int64),
        *(torch.uint8, torch.uint16, torch.uint32, torch.uint64),
        torch.bool,
    }
)
"""Dtypes whose tensors a merge copies from the newest source when every source holds the same bytes."""
READ = AVERAGED | COPIED

# Every dtype torch names, by its attribute name (``torch.float8_e4m3fn``): a pickle names a dtype
# as a global of module ``torch``, and HyperParallel's metadata as a string. Looked up in this
# table, never with getattr on torch, whose module __getattr__ imports submodules by name.
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)
}

# What a float8 tensor's scale is called: its own name and one of these (``X.weight_scale_inv``).
SCALE_SUFFIXES = ("_scale_inv", "_scale")


def float8_scales(tensors: Iterable[tuple[str, torch.dtype]]) -> dict[str, str]:
    """{scale tensor: the float8 tensor it scales} among ``(name, dtype)`` pairs: each float8
    tensor's ``<name>_scale_inv`` and ``<name>_scale`` that are present."""
    dtypes = dict(tensors)
    return {
        name + suffix: name
        for name, dtype in dtypes.items()
        if dtype in FLOAT8
        for suffix in SCALE_SUFFIXES
        if name + suffix in dtypes
    }
