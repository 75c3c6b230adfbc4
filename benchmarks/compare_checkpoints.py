"""Check that two merged checkpoints hold the same tensors, bit for bit.

The benchmark compares ckptavg's output with the naive baseline's after timing, so that the
speed ratio compares two programs that computed the same thing. For a power-of-two number of
bf16 inputs the fp32 sum and the division are exact, so both must round identically; for
other counts ckptavg's double-rounding fix may legitimately differ from the naive cast by one
ulp on a few elements, which is reported rather than hidden.
Prints one JSON line: tensors compared, tensors and elements that differ, largest difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

INDEX_FILE = "model.safetensors.index.json"


def compare(a: Path, b: Path) -> dict[str, Any]:
    """Compare every tensor of checkpoint folders ``a`` and ``b`` (shard layout may differ)."""
    import torch
    from safetensors import safe_open

    def locations(folder: Path) -> dict[str, Path]:
        index = json.loads((folder / INDEX_FILE).read_text())
        return {k: folder / f for k, f in index["weight_map"].items()}

    where_a, where_b = locations(a), locations(b)
    result: dict[str, Any] = {
        "tensors": len(where_a),
        "same_names": set(where_a) == set(where_b),
        "tensors_differing": 0,
        "elements_differing": 0,
        "max_abs_diff": 0.0,
        "dtype_mismatches": 0,
    }
    handles: dict[Path, Any] = {}

    def get(path: Path, name: str) -> torch.Tensor:
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt")
        return handles[path].get_tensor(name)

    for name in sorted(set(where_a) & set(where_b)):
        x, y = get(where_a[name], name), get(where_b[name], name)
        if x.dtype != y.dtype or x.shape != y.shape:
            result["dtype_mismatches"] += 1
            continue
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        differ = int((x.view(bits) != y.view(bits)).sum())
        if differ:
            result["tensors_differing"] += 1
            result["elements_differing"] += differ
            diff = float((x.double() - y.double()).abs().max())
            result["max_abs_diff"] = max(result["max_abs_diff"], diff)
    result["identical"] = result["same_names"] and not result["tensors_differing"] and not result["dtype_mismatches"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    print(json.dumps(compare(args.a, args.b)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
