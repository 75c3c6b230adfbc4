"""Benchmark how 1 and 2 processes share ``ckptavg merge``: wall time and bytes per process.

Run with ``.venv/bin/python benchmarks/bench_processes.py`` (``--small``: a ~5 MB model, to check
the script). 4 checkpoints of bench_sweep's data (0.95 GB bf16 each), merged into one output file
(the default 5 GB shards) and into 64 MB shards (700 KB for ``--small``), each configuration a
fresh launch of ``launch_local.py`` (what torchrun/srun do), unpinned, rounds interleaved with
their order rotated, medians (min-max) reported. Per process: the tensor bytes it wrote and read,
from the merge's ``--json`` (``processes``), and the balance (largest share / smallest); beside
it, the split whole files would give (what ckptavg did before it shared files by byte ranges).
A file several processes wrote is hashed once all are written by the process that wrote its
first range, reading back the rest: the script times a hash of the whole one-file output read
back on its own (an upper bound: with 2 processes the merge reads back half of it). Outputs of 1
and 2 processes are checked byte-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_merge import Sample, run_child  # noqa: E402
from bench_sweep import DEFAULT_DATA, SMALL_SPEC, STEPS, ensure_data, warm  # noqa: E402
from make_checkpoints import SPEC, checkpoint_bytes  # noqa: E402
from results import record  # noqa: E402

SHARDS = {"one file": [], "64 MB shards": ["--shard-size", "64MB"]}
SMALL_SHARDS = {"one file": [], "700 KB shards": ["--shard-size", "700KB"]}
PROCESSES = (1, 2)


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def by_whole_files(folder: Path, world: int) -> list[int]:
    """Tensor files' bytes per process as whole files were dealt out (largest first to the
    least loaded), for the same output layout."""
    loads = [0] * world
    for size in sorted((f.stat().st_size for f in folder.glob("*.safetensors")), reverse=True):
        loads[loads.index(min(loads))] += size
    return loads


def read_back_seconds(path: Path, repeat: int) -> float:
    """Median seconds to hash ``path`` as the merge does (16 MiB reads into sha256)."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(1 << 24):
                digest.update(block)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="cache folder for inputs")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; medians reported (default 3)")
    parser.add_argument("--small", action="store_true", help="a ~5 MB model: check that the script works")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    spec = SMALL_SPEC if args.small else SPEC
    shards = SMALL_SHARDS if args.small else SHARDS
    run_dir = args.data / ("run-small" if args.small else "run")
    ensure_data(run_dir, spec)
    warm(run_dir)
    scratch = Path(tempfile.mkdtemp(prefix=".bench-processes-", dir=args.data))
    merge = [sys.executable, "-m", "ckptavg", "merge", str(run_dir), "--merge-step", str(STEPS[-1])]
    merge += ["--window", str(STEPS[-1]), "--quiet", "--json", "--force"]
    print(
        f"bench_processes: {len(STEPS)} checkpoints of {checkpoint_bytes(spec) / 1e9:.3f} GB, 1 and 2 processes "
        f"(unpinned), median of {args.repeat} rounds (min-max); {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f} at start; page cache warm"
    )
    samples: dict[tuple[str, int], list[Sample]] = {(case, n): [] for case in shards for n in PROCESSES}
    entries = list(samples)
    try:
        for round_index in range(args.repeat):
            shift = round_index % len(entries)
            for case, processes in entries[shift:] + entries[:shift]:
                out = scratch / f"{case.replace(' ', '-')}-{processes}"
                launcher = [sys.executable, str(HERE / "launch_local.py"), str(processes), "--"]
                command = [*launcher, *merge, *shards[case], "--out", str(out)]
                samples[case, processes].append(run_child(command, args.timeout))
        identical = all(
            digests(scratch / f"{case.replace(' ', '-')}-1") == digests(scratch / f"{case.replace(' ', '-')}-2")
            for case in shards
        )
        print(f"{'case':<14} {'processes':>9} {'wall s':>18} {'merge s':>18}  per process written / read (MB)")
        for (case, processes), runs in samples.items():
            result = json.loads(runs[-1].stdout)
            per = result["processes"]
            shares = " | ".join(f"{p['bytes_written'] / 1e6:.1f} / {p['bytes_read'] / 1e6:.1f}" for p in per)
            written = [p["bytes_written"] for p in result["processes"]]
            balance = f"  balance {max(written) / max(1, min(written)):.3f}" if processes > 1 else ""
            print(
                f"{case:<14} {processes:>9} {spread([r.wall_s for r in runs]):>18} "
                f"{spread([json.loads(r.stdout)['seconds'] for r in runs]):>18}  {shares}{balance}"
            )
        for case in shards:
            whole = by_whole_files(scratch / f"{case.replace(' ', '-')}-1", 2)
            balance = f"balance {max(whole) / min(whole):.3f}" if min(whole) else "one process idle"
            print(f"{case}: whole files would give {' | '.join(f'{w / 1e6:.1f}' for w in whole)} MB ({balance})")
        (one_file,) = (scratch / f"{next(iter(shards)).replace(' ', '-')}-2").glob("*.safetensors")
        seconds = read_back_seconds(one_file, args.repeat)
        size = one_file.stat().st_size
        rate = size / seconds / 1e9
        print(f"hash of the whole one-file output read back ({size / 1e9:.3f} GB): {seconds:.2f} s, {rate:.2f} GB/s")
        print(f"outputs of 1 and 2 processes byte-identical: {identical}")
        written = {
            case: [[p["bytes_written"] for p in json.loads(run.stdout)["processes"]] for run in runs]
            for (case, processes), runs in samples.items()
            if processes > 1
        }
        record("bench_processes", {"small": args.small, "bytes_written": written, "identical": identical})
        return 0 if identical else 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
