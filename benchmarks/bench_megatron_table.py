"""ckptavg in the format of Megatron-LM's weighted-merge table (PR 5114), scaled to this machine.

Run with ``make bench`` (``.venv/bin/python benchmarks/bench_megatron_table.py``).

Megatron-LM's ``tools/checkpoint/weighted_merge.py`` (NVIDIA/Megatron-LM pull request 5114,
"Weighted Checkpoint Merging & WSM Support") published one table: merge wall-clock of 8 bf16
``torch_dist`` checkpoints at 1 rank and at 8 ranks, for dense GPT and Mamba-MoE
(Nemotron-H-style) models of ~30B and ~120B parameters, "on a single CPU node" (the PR names no
CPU, core count or storage). ``PUBLISHED`` below holds its rows exactly as published; this script
prints them, and the GiB/s they imply (8 x GiB/ckpt / seconds, in total and per rank). The PR's
table gives no peak memory.

The same sweep here, scaled to this machine: 8 checkpoints, 1 process and one per CPU (2 on the
development machine), dense and MoE layouts of the same bytes (``make_checkpoints.py``: the
0.95 GB bf16 Llama-like checkpoint of 74 tensors, and its Mixtral-style twin with 16 experts per
layer, 442 tensors: 6.0 x the tensors, where Megatron's MoE models have 4.5 x (30B) and 7.6 x
(120B) the tensors of its dense ones). Each merge writes its output durably (fsync, the
default), with ``--shard-size 50MB`` so that the processes have files to share (ckptavg shares
whole output files). Repetitions are interleaved with the floor of the same merge
(``floor.py``: the inputs read from the page cache, the output's size written with
``O_DIRECT`` + fsync), and each process count is a fresh launch of ``launch_local.py`` (what
torchrun does). Reported per layout and process count: ckptavg's merge seconds (its ``--json``
``seconds``, rank 0: sources opened to output published), GiB/s of input in total and per
process, peak RSS per process (the largest process's ``ru_maxrss``), the floor and merge / floor,
and, across layouts, the cost per byte of MoE against dense for ckptavg and for Megatron.
The outputs of 1 and N processes are checked byte-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from bench_merge import DEFAULT_DATA, Bench, Measurement, ckptavg_command, fresh, median_seconds
from bench_scale import digests
from floor import parse_floor
from make_checkpoints import SPEC, checkpoint_bytes, spec_with_experts, step_numbers, tensor_shapes, weight_files

HERE = Path(__file__).resolve().parent
GIB = 2**30
CHECKPOINTS = 8  # Megatron's table merges 8 checkpoints
EXPERTS = 16
SOURCE = "https://github.com/NVIDIA/Megatron-LM/pull/5114"
# (model, params, GiB/ckpt, tensors, seconds at 1 rank, seconds at 8 ranks, speedup), as published.
PUBLISHED = [
    ("GPT, ~30B", "29.6B", 55, 291, 658, 118, "5.6x"),
    ("GPT, ~120B", "121.8B", 227, 435, 2574, 572, "4.5x"),
    ("Mamba-MoE, ~30B", "29.2B", 54, 1317, 799, 143, "5.6x"),
    ("Mamba-MoE, ~120B", "114.2B", 213, 3291, 3175, 589, "5.4x"),
]
PUBLISHED_RANKS = 8


def megatron_rows() -> list[dict[str, Any]]:
    """The published rows, with the GiB/s of input they imply."""
    rows = []
    for model, params, gib, tensors, one, many, speedup in PUBLISHED:
        read = CHECKPOINTS * gib
        rows.append(
            {
                "model": model,
                "params": params,
                "gib_per_checkpoint": gib,
                "tensors": tensors,
                "seconds_1": one,
                f"seconds_{PUBLISHED_RANKS}": many,
                "speedup": speedup,
                "gib_per_s_1": read / one,
                f"gib_per_s_{PUBLISHED_RANKS}": read / many,
                "gib_per_s_per_rank": read / many / PUBLISHED_RANKS,
                "seconds_per_gib_1": one / read,
                f"seconds_per_gib_{PUBLISHED_RANKS}": many / read,
            }
        )
    return rows


def moe_over_dense(rows: list[dict[str, Any]], dense: str, moe: str, key: str) -> float:
    """Seconds per GiB of the MoE row over the dense row's: what a MoE layout costs per byte."""
    by_name = {row["model"]: row for row in rows}
    return by_name[moe][key] / by_name[dense][key]


class MegatronTable(Bench):
    """The layouts' merges at 1 and N processes, each beside its floor."""

    def measure_layout(
        self, name: str, label: str, run_dir: Path, spec: dict[str, Any], processes: list[int]
    ) -> dict[str, Any]:
        """``name``'s 8 checkpoints merged by 1 and N processes, beside its floor (``name`` keys
        the measurements and output folders, ``label`` is what the table says)."""
        steps = step_numbers(CHECKPOINTS)
        if not self.ensure_run(run_dir, steps, spec):
            raise SystemExit(f"bench: no room on disk for the {label} checkpoints")
        self.warm(steps, run_dir)
        files = self.input_files(steps, run_dir)
        read_bytes = sum(f.stat().st_size for f in files)
        output_bytes = sum(f.stat().st_size for f in weight_files(run_dir / f"step{steps[-1]}"))
        floor = self.add_floor(f"floor_{name}", f"floor, {label}", files, output_bytes, self.scratch)
        merge = [*ckptavg_command(), "merge", str(run_dir), "--steps", ",".join(map(str, steps))]
        merge += ["--shard-size", "50MB", "--force", "--quiet", "--json"]
        entries: list[tuple[Measurement, Callable[[], None]]] = [(floor, os.sync)]
        merges: dict[int, Measurement] = {}
        for count in processes:
            out = self.scratch / f"{name}-{count}"
            launcher = [sys.executable, str(HERE / "launch_local.py"), str(count), "--"]
            what = f"ckptavg merge, {label}, {count} process{'es' if count > 1 else ''}"
            merges[count] = self.add(f"{name}_{count}", what, [*launcher, *merge, "--out", str(out)], read_bytes)
            entries.append((merges[count], partial(fresh, out)))
        size = checkpoint_bytes(spec) / GIB
        self.say(f"measuring {label}: {len(tensor_shapes(spec))} tensors, {CHECKPOINTS} x {size:.2f} GiB")
        self.measure_round(entries, self.args.repeat)
        identical = len({json.dumps(digests(self.scratch / f"{name}-{count}")) for count in processes}) == 1
        floor_s = median_seconds(floor)
        result: dict[str, Any] = {
            "layout": label,
            "tensors": len(tensor_shapes(spec)),
            "gib_per_checkpoint": checkpoint_bytes(spec) / GIB,
            "read_gib": read_bytes / GIB,
            "floor_seconds": floor_s,
            "floor_last": parse_floor(floor.samples[-1].stdout).record(),
            "outputs_identical": identical,
        }
        for count, m in merges.items():
            seconds = median_seconds(m)
            result[f"seconds_{count}"] = seconds
            result[f"gib_per_s_{count}"] = read_bytes / GIB / seconds
            result[f"gib_per_s_per_process_{count}"] = read_bytes / GIB / seconds / count
            result[f"peak_rss_gib_{count}"] = m.median("rss_bytes") / GIB
            result[f"merge_over_floor_{count}"] = seconds / floor_s
            result[f"seconds_per_gib_{count}"] = seconds / (read_bytes / GIB)
        for count in processes:
            fresh(self.scratch / f"{name}-{count}")
        return result


def print_tables(
    say: Callable[[str], None], ours: list[dict[str, Any]], processes: list[int], theirs: list[dict[str, Any]]
) -> None:
    many = processes[-1]
    say("")
    say(f"ckptavg, this machine ({os.cpu_count()} CPUs), {CHECKPOINTS} bf16 checkpoints, outputs fsynced:")
    say(
        f"| layout | tensors | GiB/ckpt | merge {CHECKPOINTS} ckpts @ 1 process | @ {many} processes | speedup "
        f"| GiB/s @ 1 | GiB/s per process @ {many} | peak RSS per process @ 1 / {many} | floor "
        f"| merge / floor @ 1 / {many} |"
    )
    say("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in ours:
        say(
            f"| {r['layout']} | {r['tensors']} | {r['gib_per_checkpoint']:.2f} | {r['seconds_1']:.2f} s "
            f"| {r[f'seconds_{many}']:.2f} s | {r['seconds_1'] / r[f'seconds_{many}']:.2f}x | {r['gib_per_s_1']:.2f} "
            f"| {r[f'gib_per_s_per_process_{many}']:.2f} "
            f"| {r['peak_rss_gib_1']:.2f} / {r[f'peak_rss_gib_{many}']:.2f} GiB "
            f"| {r['floor_seconds']:.2f} s | {r['merge_over_floor_1']:.2f} / {r[f'merge_over_floor_{many}']:.2f} |"
        )
    say("")
    say(f"Megatron-LM weighted_merge.py, as published ({SOURCE}; 'a single CPU node', bf16; GiB/s derived):")
    say(
        f"| model | params | GiB/ckpt | tensors | merge {CHECKPOINTS} ckpts @ 1 rank | @ {PUBLISHED_RANKS} ranks "
        f"| speedup | GiB/s @ 1 | GiB/s per rank @ {PUBLISHED_RANKS} | peak RSS |"
    )
    say("|---|---|---|---|---|---|---|---|---|---|")
    for r in theirs:
        say(
            f"| {r['model']} | {r['params']} | {r['gib_per_checkpoint']} | {r['tensors']:,} | {r['seconds_1']} s "
            f"| {r[f'seconds_{PUBLISHED_RANKS}']} s | {r['speedup']} | {r['gib_per_s_1']:.2f} "
            f"| {r['gib_per_s_per_rank']:.2f} | not published |"
        )
    say("")
    say("cost per byte, MoE / dense (seconds per GiB of input):")
    dense, moe = ours
    say(
        f"  ckptavg: {moe['seconds_per_gib_1'] / dense['seconds_per_gib_1']:.2f} at 1 process, "
        f"{moe[f'seconds_per_gib_{many}'] / dense[f'seconds_per_gib_{many}']:.2f} at {many}"
    )
    for size in ("~30B", "~120B"):
        pair = (f"GPT, {size}", f"Mamba-MoE, {size}")
        say(
            f"  Megatron {size}: {moe_over_dense(theirs, *pair, 'seconds_per_gib_1'):.2f} at 1 rank, "
            f"{moe_over_dense(theirs, *pair, f'seconds_per_gib_{PUBLISHED_RANKS}'):.2f} at {PUBLISHED_RANKS}"
        )
    for r in ours:
        say(f"  {r['layout']}: outputs of 1 and {many} processes byte-identical: {r['outputs_identical']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help="cache folder for inputs (default: bench-data/)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measurement; medians reported (default 3)")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 2, help="the several-process case")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    processes = [1, max(2, args.processes)]
    bench = MegatronTable(argparse.Namespace(**vars(args), keep_outputs=False))
    started = time.perf_counter()
    try:
        bench.say(
            f"ckptavg in Megatron-LM's weighted-merge table format: {os.cpu_count()} CPUs, median of {args.repeat}"
        )
        ours = [
            bench.measure_layout("dense", "dense", bench.run_dir, SPEC, processes),
            bench.measure_layout(
                "moe", f"MoE, {EXPERTS} experts", bench.data / "run-moe", spec_with_experts(SPEC, EXPERTS), processes
            ),
        ]
        theirs = megatron_rows()
        print_tables(bench.say, ours, processes, theirs)
        bench.say(f"total time {time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.2f}")
    finally:
        bench.close()
    if args.json:
        record = {"ckptavg": ours, "megatron_published": theirs, "source": SOURCE, "notes": bench.notes}
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0 if all(r["outputs_identical"] for r in ours) else 1


if __name__ == "__main__":
    sys.exit(main())
