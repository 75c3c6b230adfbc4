"""Merge seconds per layout of the same bytes: dense, MoE experts, tiny tensors (issue 31).

Three run folders of four bf16 safetensors checkpoints each, every checkpoint ``--mib`` MiB of
tensor data (384 by default: 4 x 0.4 GB) cut into tensors of one size per layout:

  dense  16 MiB tensors (24 of them at 384 MiB)
  moe    256 KiB tensors (1,536), the experts of a fine-grained MoE
  tiny   16 KiB tensors (24,576)

Each measurement is ``ckptavg merge <run> --last 4 --out <tmp> --force --quiet --json --no-fsync``
in a child process, its own ``seconds`` taken; the layouts are interleaved (dense, moe, tiny,
dense, ...), the inputs in the page cache (read once before timing), and the medians printed
with their ratio to dense (same bytes, so it is the ratio per byte) and the child's whole wall
(:func:`bench_merge.run_child`; what it holds besides ``seconds``, beyond dense's, is the cost of
opening that layout's headers), beside the naive load-all
average of ``naive_merge.py`` on the tiny layout, and the floor measured in the same rounds
(``floor.py``): reading the inputs from the page cache, which a ``--no-fsync`` merge of warm
inputs cannot beat (merge / read floor printed), and writing the output durably (what a merge
with fsync pays besides). Targets (issue 31): moe <= 1.1 x dense, tiny
<= 2 x dense and faster than the naive average. Generated data is cached in
``bench-data/layouts-<mib>/`` (delete it to rebuild).

Run with ``.venv/bin/python benchmarks/bench_layouts_small.py [--repeats 3] [--mib 384]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_merge import fresh, run_child
from floor import floor_command, parse_floor
from results import record

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parent / "bench-data"
LAYOUTS = {"dense": 16 * 2**20, "moe": 256 * 2**10, "tiny": 16 * 2**10}  # bytes per tensor
SOURCES = 4
STAMP = ".bench-complete"
SHARD = "model-00001-of-00001.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHILD_TIMEOUT_S = 600


def build_checkpoint(folder: Path, tensor_bytes: int, total_bytes: int, seed: int) -> None:
    """One checkpoint: a shard of bf16 tensors of ``tensor_bytes`` each, written by
    the safetensors library (as trainers write them), and a stamp once complete."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    count, per = total_bytes // tensor_bytes, tensor_bytes // 2
    values = (torch.randn(count * per, generator=generator) * 0.02).to(torch.bfloat16)
    names = [f"model.layers.{i // 64}.mlp.experts.{i % 64}.weight" for i in range(count)]
    tensors = {name: values[i * per : (i + 1) * per] for i, name in enumerate(names)}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / SHARD), metadata={"format": "pt"})
    # An index (of one shard), which naive_merge.py reads.
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict.fromkeys(tensors, SHARD)}
    (folder / INDEX_FILE).write_text(json.dumps(index))
    (folder / STAMP).write_text("")


def run_folder(data: Path, layout: str, mib: int) -> Path:
    """The run folder of ``layout`` (built on first use): steps 1000-4000."""
    run = data / f"layouts-{mib}" / layout
    for i in range(SOURCES):
        step = run / f"step{1000 * (i + 1)}"
        if not (step / STAMP).exists():
            shutil.rmtree(step, ignore_errors=True)
            build_checkpoint(step, LAYOUTS[layout], mib * 2**20, seed=1000 * i + len(layout))
    return run


def build_runs(data: Path, mib: int) -> None:
    """Every layout's run folder, built in a child process: a child's peak RSS (``ru_maxrss``)
    starts from the RSS of the process that spawns it, which importing torch here would raise."""
    command = [sys.executable, __file__, "--build", "--data", str(data), "--mib", str(mib)]
    subprocess.run(command, check=True)


def warm(run: Path) -> None:
    """Read every input once, so that each measurement starts from the page cache."""
    for file in sorted(run.rglob("*.safetensors")):
        with open(file, "rb") as stream:
            while stream.read(2**24):
                pass


def timed(command: list[str], peaks: list[int]) -> tuple[float, float]:
    """(the ``seconds`` the command prints in its JSON, the child's whole wall time:
    :func:`bench_merge.run_child`); its peak RSS appended to ``peaks``."""
    sample = run_child(command, CHILD_TIMEOUT_S)
    peaks.append(sample.rss_bytes)
    return float(json.loads(sample.stdout)["seconds"]), sample.wall_s


def ckptavg_seconds(run: Path, out: Path, peaks: list[int]) -> tuple[float, float]:
    """A ``ckptavg merge`` of the last four checkpoints of ``run``: its ``seconds`` (from the
    open checkpoints to the published output) and the command's wall time."""
    command = [str(Path(sys.executable).parent / "ckptavg"), "merge", str(run), "--last", str(SOURCES)]
    return timed([*command, "--out", str(out), "--force", "--quiet", "--json", "--no-fsync"], peaks)


def naive_seconds(run: Path, out: Path, peaks: list[int]) -> tuple[float, float]:
    """``naive_merge.py`` (the load-all average) of the last four checkpoints: its ``seconds``
    (from before it imports torch to its saved output) and the command's wall time."""
    sources = sorted(run.glob("step*"), key=lambda p: int(p.name[4:]))[-SOURCES:]
    return timed([sys.executable, str(HERE / "naive_merge.py"), *map(str, sources), "--out", str(out)], peaks)


def measure(data: Path, mib: int, repeats: int) -> tuple[dict[str, list[tuple[float, float]]], dict[str, list[int]]]:
    """Interleaved (seconds, wall) per layout, and of the naive average on the tiny layout; and
    the peak RSS of each of those runs."""
    runs = {layout: run_folder(data, layout, mib) for layout in LAYOUTS}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in [*LAYOUTS, "naive tiny", "floor"]}
    peaks: dict[str, list[int]] = {name: [] for name in [*LAYOUTS, "naive tiny"]}
    with tempfile.TemporaryDirectory(dir=data) as scratch:
        out = Path(scratch) / "out"
        for _ in range(repeats):
            warm(runs["dense"])
            steps = sorted(runs["dense"].glob("step*"), key=lambda p: int(p.name[4:]))[-SOURCES:]
            inputs = [step / SHARD for step in steps]
            command = floor_command(inputs, inputs[-1].stat().st_size, Path(scratch))
            floor = parse_floor(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
            times["floor"].append((floor.read_seconds, floor.write_seconds))
            for layout, run in runs.items():
                # Each merge into an empty folder, the last one's dirty pages flushed (as
                # bench_layouts_dcp.py does): one replacing the last layout's output pays for
                # deleting it (tens of ms for 0.4 GB of cached pages), and every layout but the
                # first of a round did, which made MoE look 1.15 x dense where it is 1.00 x.
                fresh(out)
                warm(run)
                times[layout].append(ckptavg_seconds(run, out, peaks[layout]))
            warm(runs["tiny"])
            times["naive tiny"].append(naive_seconds(runs["tiny"], out / "naive", peaks["naive tiny"]))
            shutil.rmtree(out, ignore_errors=True)
    return times, peaks


def report(times: dict[str, list[tuple[float, float]]], mib: int) -> None:
    """Medians (min-max) of each tool's own seconds, their ratio to dense, the commands' walls,
    and what the wall holds besides the seconds (start, imports, opening the checkpoints) beyond
    dense's: the cost of opening that layout's headers."""
    floors = times.pop("floor")
    read_floor = statistics.median(r for r, _ in floors)
    write_floor = [w for _, w in floors]
    dense = statistics.median(s for s, _ in times["dense"])
    dense_outside = statistics.median(w - s for s, w in times["dense"])
    print(f"{SOURCES} x {mib} MiB bf16 safetensors, warm cache, --no-fsync; medians (min-max) of {len(times['dense'])}")
    print(
        f"  floor: reading the inputs from the page cache {read_floor:.2f} s; writing the output durably "
        f"{statistics.median(write_floor):.2f} s ({min(write_floor):.2f}-{max(write_floor):.2f}), "
        "not paid with --no-fsync"
    )
    header = f"  {'':<11} {'':<14}  {'seconds':>18}  {'vs dense':>8}  {'/ read floor':>12}"
    print(f"{header}  {'whole command (start, imports, headers)':>40}  {'rest vs dense':>13}")
    for name, pairs in times.items():
        seconds, walls = [s for s, _ in pairs], [w for _, w in pairs]
        median = statistics.median(seconds)
        tensors = f"{mib * 2**20 // LAYOUTS[name]:>6} tensors" if name in LAYOUTS else " " * 14
        print(
            f"  {name:<11} {tensors}  {median:6.2f} s ({min(seconds):.2f}-{max(seconds):.2f})  "
            f"x{median / dense:7.2f}  x{median / read_floor:11.2f}  "
            f"{statistics.median(walls):27.2f} s ({min(walls):.2f}-{max(walls):.2f})  "
            # The naive average's seconds start before its imports: its rest is no opening cost.
            + (f"{statistics.median(w - s for s, w in pairs) - dense_outside:+12.2f} s" if name in LAYOUTS else "")
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=384, help="MiB of tensor data per checkpoint")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--build", action="store_true", help=argparse.SUPPRESS)  # internal: build_runs
    args = parser.parse_args(argv)
    args.data.mkdir(parents=True, exist_ok=True)
    if args.build:
        for layout in LAYOUTS:
            run_folder(args.data, layout, args.mib)
        return 0
    started = time.perf_counter()
    build_runs(args.data, args.mib)
    times, peaks = measure(args.data, args.mib, args.repeats)
    seconds = {name: [s for s, _ in pairs] for name, pairs in times.items() if name != "floor"}
    record("bench_layouts_small", {"mib": args.mib, "seconds": seconds, "rss_bytes": peaks})
    report(times, args.mib)
    print("  peak RSS (median): " + ", ".join(f"{n} {statistics.median(p) / 1e6:.0f} MB" for n, p in peaks.items()))
    print(f"  ({time.perf_counter() - started:.0f} s in all, data generation included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
