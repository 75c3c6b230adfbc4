"""The load-everything baseline for DCP inputs, as most people would first write it.

Read the newest checkpoint's ``.metadata`` for the shapes and dtypes, allocate one full tensor per
key (once, reused for every checkpoint), ``torch.distributed.checkpoint.load(state, checkpoint_id=...,
no_dist=True)`` each whole checkpoint into them (DCP copies every chunk into its place), accumulate
in fp32 (``acc[k] = acc.get(k, 0) + t.float()``, as ``naive_merge.py``), divide, cast back and
``save_file`` one ``model.safetensors`` (plus an index, so ``compare_checkpoints.py`` can read it).
A whole checkpoint and the fp32 accumulator are in memory at once. Run as a child process by the
benchmark; prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
OUT_FILE = "model.safetensors"


def naive_dcp_average(sources: list[Path], out: Path) -> int:
    """Average the DCP checkpoints ``sources`` into ``out``; return the tensor count."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    warnings.filterwarnings("ignore")  # DCP warns that no process group is initialized
    metadata = dcp.FileSystemReader(str(sources[-1])).read_metadata()
    state = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    acc: dict[str, torch.Tensor] = {}
    for source in sources:
        dcp.load(state, checkpoint_id=str(source), no_dist=True)
        for k, t in state.items():
            acc[k] = acc.get(k, 0) + t.float()
    mean = {k: (acc.pop(k) / len(sources)).to(state[k].dtype) for k in list(acc)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(mean, str(out / OUT_FILE), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in mean.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(mean, OUT_FILE)}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return len(mean)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path, help="DCP checkpoint folders, oldest first")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    count = naive_dcp_average(args.sources, args.out)
    print(json.dumps({"tensors": count, "seconds": time.perf_counter() - started}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
