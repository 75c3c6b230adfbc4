"""CPU time per DCP chunk, in one thread (issue 31): what a save by many ranks costs beyond its bytes.

Run with ``.venv/bin/python benchmarks/bench_dcp_chunks.py`` (``--repeat``, ``--baseline``) after
``benchmarks/bench_layouts_dcp.py`` has built its data (``bench-data/layouts-dcp``). For the
1-rank, 8 x ``Shard(0)`` and 64 x ``Shard(0)`` saves of the same 4 checkpoints, a child process
opens the 4 (the collector paused, as a merge opens them) and then reads every tensor whole in
4 MiB ranges in its own thread, no arithmetic: it prints the CPU time of each phase. Runs are
interleaved (layouts and versions in turn, repetition by repetition); the table gives medians and
the CPU per chunk beyond the 1-rank save's (the reader's cost of many chunks, which a merge pays
across its reader threads).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parent / "bench-data" / "layouts-dcp"
LAYOUTS = {"1 rank": "1rank", "8 x Shard(0)": "8x0", "64 x Shard(0)": "64x0"}
RANGE = 4 * 2**20


def _chunks(metadata) -> int:  # noqa: ANN001 (DCP's Metadata, imported in the child only)
    entries = metadata.state_dict_metadata.values()
    return sum(1 for entry in entries for chunk in getattr(entry, "chunks", ()) if 0 not in chunk.sizes)


def measure(run: Path) -> dict[str, float]:
    """CPU seconds to open the checkpoints of ``run`` and to read all their tensors once."""
    from ckptavg.formats import open_checkpoint
    from ckptavg.formats.dcp import read_metadata
    from ckptavg.io.fs import resolve

    steps = sorted(run.glob("step-*"))
    gc.disable()
    started = time.process_time()
    readers = [open_checkpoint(*resolve(str(step))) for step in steps]
    opened = time.process_time()
    gc.freeze()
    gc.enable()
    buffer = memoryview(bytearray(RANGE))
    for reader in readers:
        for info in reader.tensors():
            for offset in range(0, info.nbytes, RANGE):
                reader.read_into(info.name, offset, buffer[: min(RANGE, info.nbytes - offset)])
    read = time.process_time()
    for reader in readers:
        reader.close()
    # Counted after the timed phases: reading the metadata again is no part of either.
    chunks = sum(_chunks(read_metadata(*resolve(str(step)))) for step in steps)
    return {"open": opened - started, "read": read - opened, "chunks": chunks}


def _medians(samples: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(sample[key] for sample in samples) for key in ("open", "read", "chunks")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="a folder with another version's ckptavg package")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(measure(args.child)))
        return 0
    runs = {name: args.data / folder for name, folder in LAYOUTS.items()}
    missing = [str(run) for run in runs.values() if not run.is_dir()]
    if missing:
        print(f"bench_dcp_chunks: no data in {', '.join(missing)}: run benchmarks/bench_layouts_dcp.py first")
        return 1
    versions = {"this": dict(os.environ)}
    if args.baseline is not None:
        versions["baseline"] = {**os.environ, "PYTHONPATH": str(args.baseline.resolve())}
    cases = [(version, name) for name in runs for version in versions]
    samples: dict[tuple[str, str], list[dict[str, float]]] = {case: [] for case in cases}
    for repetition in range(args.repeat):
        turn = repetition % len(cases)
        for version, name in cases[turn:] + cases[:turn]:  # a rotating order
            child = [sys.executable, __file__, "--child", str(runs[name])]
            done = subprocess.run(child, env=versions[version], check=True, capture_output=True, text=True)
            samples[version, name].append(json.loads(done.stdout))
    print(f"CPU of one thread opening 4 checkpoints and reading each tensor once, medians of {args.repeat}")
    print(f"{'version':<9}{'layout':<15}{'chunks':>8}{'open s':>8}{'read s':>8}{'open us':>9}{'read us':>9}  a chunk")
    for version, name in sorted(cases):
        row, base = _medians(samples[version, name]), _medians(samples[version, "1 rank"])
        extra = row["chunks"] - base["chunks"]  # the chunks beyond the 1-rank save's (one per tensor)
        per_open = f"{(row['open'] - base['open']) / extra * 1e6:.1f}" if extra else "-"
        per_read = f"{(row['read'] - base['read']) / extra * 1e6:.1f}" if extra else "-"
        print(
            f"{version:<9}{name:<15}{row['chunks']:>8.0f}{row['open']:>8.3f}{row['read']:>8.3f}{per_open:>9}{per_read:>9}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
