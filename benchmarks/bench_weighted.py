"""What weighted means cost against the uniform mean: a dense bf16 merge, interleaved.

Run with ``.venv/bin/python benchmarks/bench_weighted.py`` (``--elements``, ``--sources``,
``--repeat`` to resize it). It writes ``--sources`` bf16 checkpoints of one dense tensor each
(neighbouring training steps: one base plus small noise) and times the merge engine over them
into a sink that drops the bytes, the inputs already in memory (``engine_only.make_resident``:
the arithmetic alone, the case where a weighted sum's fp64 accumulation shows most) and read
from the files (page cache), for each weighting in turn, repetition by repetition (so that a
noisy neighbour slows them all alike):

  uniform        the exact uniform mean (fp32 sums of bf16: unchanged by weighted sums' path);
  minus-sqrt     weights 1/sqrt(i) (irrational: no output lies near a tie of its grid);
  wma            weights 1..n (rational: ties of the grid lie within 2^-50 of many sums, whose
                 exact side each is decided by an exact sign: ckptavg.merging.kernel._sign_past);
  dyadic         weights 1, 1, 2, 4, ... (few bits: every product exact, ties common and exact);
  negative       --weights=-1,2,2,...: extrapolation, with cancellation.

and prints each one's median GB/s of input and its median time relative to uniform's, in wall
time and in the process's CPU time (all its threads: steadier than wall time on a shared machine).

``--against FILE`` times a second build of the compiled loops as well, from another version of
``native.c`` (``git show main:ckptavg/merging/native.c > /tmp/main-native.c``), interleaved with
this one's repetition by repetition, and prints its table too and its times over this one's.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from engine_only import _Drop, make_resident  # type: ignore[import-not-found]
from results import record

import ckptavg.merging.native as native_module
from ckptavg.formats import open_checkpoint
from ckptavg.formats.layout import layout_shards
from ckptavg.io.fs import resolve
from ckptavg.merging.engine import EngineOptions, StreamingAverage, output_specs
from ckptavg.weighting import normalised


def write_sources(folder: Path, sources: int, elements: int) -> list[str]:
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    base = torch.randn(elements, generator=generator) * 0.02
    paths = []
    for step in range(sources):
        path = folder / f"step{step + 1}"
        path.mkdir()
        noise = torch.randn(elements, generator=generator) * 0.002
        save_file({"w": (base + noise).bfloat16()}, str(path / "model.safetensors"))
        paths.append(str(path))
    return paths


def weightings(sources: int) -> dict[str, list[float] | None]:
    return {
        "uniform": None,
        "minus-sqrt": normalised([1 / math.sqrt(i) for i in range(1, sources + 1)]),
        "wma": normalised([float(i) for i in range(1, sources + 1)]),
        "dyadic": normalised([1.0] + [2.0 ** (i - 1) for i in range(1, sources)]),
        "negative": normalised([-1.0] + [2.0] * (sources - 1), allow_negative=True),
    }


def timed(paths: list[str], weights: list[float] | None, resident: bool) -> tuple[float, float]:
    """Wall and CPU seconds of one merge."""
    readers = [open_checkpoint(*resolve(p)) for p in paths]
    engine = StreamingAverage(readers, weights, EngineOptions(mmap=resident))
    kept = [make_resident(reader) for reader in readers] if resident else []
    shards = layout_shards(output_specs(list(engine.tensors.values()), None), 5 * 10**9)
    started, cpu = time.perf_counter(), time.process_time()
    engine.run(shards, lambda _shard: _Drop())
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    del kept
    return seconds, cpu


def report(title: str, seconds: dict[str, list[float]], cpu: dict[str, list[float]], read: int) -> None:
    print(title)
    uniform, uniform_cpu = statistics.median(seconds["uniform"]), statistics.median(cpu["uniform"])
    for name, times in seconds.items():
        median, used = statistics.median(times), statistics.median(cpu[name])
        print(
            f"  {name:11s} {read / median / 1e9:6.2f} GB/s  {median / uniform:5.2f}x uniform's wall time"
            f"  {used / uniform_cpu:5.2f}x its CPU time"
        )


def use_source(source: Path) -> None:
    """The compiled loops from ``source`` for the merges that follow (built into the cache)."""
    native_module.SOURCE = source
    native_module.native_mean.cache_clear()
    if native_module.native_mean() is None:
        raise SystemExit(f"the compiled loops of {source} did not build or do not agree with torch's ops")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=2**25, help="elements per checkpoint (bf16)")
    parser.add_argument("--sources", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--against", type=Path, help="another native.c, timed interleaved with this one's")
    args = parser.parse_args(argv)
    print(f"compiled loops: {'yes' if native_module.native_mean() is not None else 'no (torch ops)'}")
    builds = {"this native.c": native_module.SOURCE}
    if args.against is not None:
        builds[str(args.against)] = args.against.resolve()
    schemes = weightings(args.sources)
    read = 2 * args.elements * args.sources
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_sources(Path(tmp), args.sources, args.elements)
        for resident in (True, False):
            seconds = {build: {name: [] for name in schemes} for build in builds}
            cpu = {build: {name: [] for name in schemes} for build in builds}
            for _ in range(args.repeat):
                for build, source in builds.items():
                    if len(builds) > 1:
                        use_source(source)
                    for name, weights in schemes.items():
                        wall, used = timed(paths, weights, resident)
                        seconds[build][name].append(wall)
                        cpu[build][name].append(used)
            where = "inputs in memory" if resident else "inputs read from the page cache"
            for build in builds:
                title = f"{args.sources} x {args.elements} bf16 elements, {where}, medians of {args.repeat}"
                report(f"{title}{f' ({build})' if len(builds) > 1 else ''}:", seconds[build], cpu[build], read)
            if len(builds) > 1:
                mine, other = builds
                print(f"  {other}'s medians over this one's (wall, CPU):")
                for name in schemes:
                    wall = statistics.median(seconds[other][name]) / statistics.median(seconds[mine][name])
                    used = statistics.median(cpu[other][name]) / statistics.median(cpu[mine][name])
                    print(f"    {name:11s} {wall:5.2f}x  {used:5.2f}x")
            mine = next(iter(builds))
            figures["in memory" if resident else "page cache"] = {"wall_s": seconds[mine], "cpu_s": cpu[mine]}
    record("bench_weighted", {"elements": args.elements, "sources": args.sources, **figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())
