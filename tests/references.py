"""Independent references for exactness checks, without pytest: tests and benchmarks/gpu_check.py
use them alike."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
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
