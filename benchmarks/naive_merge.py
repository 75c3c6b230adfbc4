"""The baseline ckptavg is measured against: the average most people write first.

Load every shard of every checkpoint with ``safetensors.torch.load_file``, accumulate each
tensor in fp32 (``acc[k] = acc.get(k, 0) + t.float()``), divide, cast back to the input dtype and
``save_file`` the result sharded exactly like the newest input, with an index and its
config.json. Whole checkpoints and the fp32 accumulator live in memory at once, which is
why its peak RSS grows with the model size, and every ``+`` allocates a fresh tensor.

Kept deliberately plain (no streaming, no thread tuning) so that "ckptavg / naive" says how
much the streaming engine buys over the obvious script. Run as a child process by the benchmark.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"


def naive_average(sources: list[Path], out: Path) -> int:
    """Average the sharded checkpoints ``sources`` into ``out``; return the tensor count."""
    import torch
    from safetensors.torch import load_file, save_file

    index = json.loads((sources[-1] / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    acc: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for source in sources:
        state: dict[str, torch.Tensor] = {}
        for file_name in files:
            state.update(load_file(str(source / file_name)))
        for k, t in state.items():
            dtypes[k] = t.dtype
            acc[k] = acc.get(k, 0) + t.float()
        del state
    out.mkdir(parents=True, exist_ok=True)
    for file_name in files:
        names = [k for k, f in index["weight_map"].items() if f == file_name]
        shard = {k: (acc.pop(k) / len(sources)).to(dtypes[k]) for k in names}
        save_file(shard, str(out / file_name), metadata={"format": "pt"})
        del shard
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    if (sources[-1] / "config.json").exists():
        shutil.copyfile(sources[-1] / "config.json", out / "config.json")
    return len(index["weight_map"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path, help="checkpoint folders, oldest first")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    count = naive_average(args.sources, args.out)
    print(json.dumps({"tensors": count, "seconds": time.perf_counter() - started}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
