"""Benchmark ``ckptavg merge`` with 1 and 2 processes on the bench_merge data (4 x 0.95 GB bf16).

Run with ``make bench`` (``.venv/bin/python benchmarks/bench_scale.py``). Each measurement is a
fresh launch of ``launch_local.py`` (what torchrun/srun do: N processes, RANK/WORLD_SIZE set),
timed as one child by bench_merge's ``run_child`` (wall, CPU of all processes, peak RSS), with
repetitions interleaved and medians reported:

  1 process / 2 processes            unpinned: what a user on this 2-core box gets;
  1 process on 1 core / 2 on 2 cores  each process pinned to its own core: the per-process
                                      scaling where one process is compute-bound, as on a node
                                      where every process has its own cores.

Besides the wall time (start-up included) it reports the merge time rank 0 measured (after
imports and rendezvous), that time over the floor measured in the same rounds (``floor.py``:
the inputs read warm, the output's size written durably), and checks once that both outputs
are byte-identical. Target: 2 processes at least 1.6x the throughput of 1 where the single
process is compute-bound.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

from bench_merge import DEFAULT_DATA, Bench, ckptavg_command, fresh, gb, median_seconds
from make_checkpoints import step_numbers, weight_files

HERE = Path(__file__).resolve().parent
TARGET_SPEEDUP = 1.6


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--inputs", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    bench = Bench(argparse.Namespace(data=args.data, timeout=args.timeout, repeat=args.repeat, keep_outputs=False))
    try:
        steps = step_numbers(args.inputs)
        bench.say(f"ckptavg scale-out benchmark: {os.cpu_count()} CPUs, {args.inputs} inputs, median of {args.repeat}")
        bench.ensure_steps(steps)
        files = bench.input_files(steps)
        read_bytes = sum(f.stat().st_size for f in files)
        output_bytes = sum(f.stat().st_size for f in weight_files(bench.run_dir / f"step{steps[-1]}"))
        bench.warm(steps)
        floor = bench.add_floor("floor", "floor", files, output_bytes, bench.scratch)
        # 50 MB output files, about 20 to share, as in the runs docs/benchmarks.md compares with
        # (processes share a single file by byte ranges too: bench_processes.py measures that).
        merge = [*ckptavg_command(), "merge", str(bench.run_dir), "--steps", ",".join(map(str, steps))]
        merge += ["--shard-size", "50MB"]
        entries = [(floor, os.sync)]
        for processes, pin in ((1, False), (2, False), (1, True), (2, True)):
            out = bench.scratch / f"out-{processes}-{pin}"
            launcher = [
                sys.executable,
                str(HERE / "launch_local.py"),
                str(processes),
                *(["--pin"] if pin else []),
                "--",
            ]
            label = f"{processes} process{'es' if processes > 1 else ''}" + (
                f" on {processes} core{'s' if processes > 1 else ''}" if pin else ""
            )
            command = [*launcher, *merge, "--out", str(out), "--force", "--quiet", "--json"]
            entries.append((bench.add(f"{processes}-{pin}", label, command, read_bytes), lambda out=out: fresh(out)))
        bench.say(f"measuring ({gb(read_bytes)} read per merge):")
        bench.measure_round(entries, args.repeat)
        identical = digests(bench.scratch / "out-1-False") == digests(bench.scratch / "out-2-False")

        def merge_seconds(key: str) -> float:
            return median_seconds(bench.measurements[key])

        floor_s = median_seconds(floor)
        bench.say(f"\nfloor (inputs read warm, or the output written durably): {floor_s:.2f} s")
        bench.say("configuration            wall (s)  merge (s)  merge/floor  merge GB/s  CPU (s)  peak RSS")
        for key, m in bench.measurements.items():
            if m is floor:
                continue
            seconds = merge_seconds(key)
            bench.say(
                f"{m.label:<24} {m.median('wall_s'):8.2f}  {seconds:9.2f}  {seconds / floor_s:11.2f}  "
                f"{read_bytes / seconds / 1e9:10.2f}  {m.median('cpu_s'):7.2f}  {m.median('rss_bytes') / 1e6:6.0f} MB"
            )

        def ratio(attr: str, one: str, two: str) -> float:
            if attr == "merge":
                return merge_seconds(one) / merge_seconds(two)
            return bench.measurements[one].median("wall_s") / bench.measurements[two].median("wall_s")

        speed = {
            name: (ratio("merge", f"1-{pin}", f"2-{pin}"), ratio("wall", f"1-{pin}", f"2-{pin}"))
            for name, pin in (("unpinned", False), ("pinned", True))
        }
        for name, (by_merge, by_wall) in speed.items():
            verdict = "PASS" if by_merge >= TARGET_SPEEDUP else "below target"
            bench.say(
                f"speed-up of 2 processes, {name}: {by_merge:.2f}x merge time, {by_wall:.2f}x wall "
                f"(target >= {TARGET_SPEEDUP}x where one process is compute-bound: {verdict})"
            )
        bench.say(f"outputs of 1 and 2 processes byte-identical: {identical}")
        return 0 if identical else 1
    finally:
        bench.close()


if __name__ == "__main__":
    sys.exit(main())
