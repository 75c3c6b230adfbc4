"""Benchmark the one-pass sweep: K=3 candidates from one read against three separate merges.

Run with ``make bench`` (``.venv/bin/python benchmarks/bench_sweep.py``). Two sweeps of the
synthetic Llama-like run of ``make_checkpoints.py`` (steps 1000-4000, merge step 4000):

  a. three windows (2000,3000,4000: 2, 3 and 4 checkpoints), uniform weights;
  b. one window (4 checkpoints), three weightings (uniform, ema with a half-life of 1000, wma);

each as ONE ``ckptavg merge --window ... --weighting ...`` and as the three ``ckptavg merge`` it
stands for, run one after the other. It prints, side by side, the bytes each reads (from the
commands' ``--json``: what they really read), the median wall of 3 runs with its min-max, and
the peak RSS (one accumulator block per candidate is the price of reading once), and the one
pass's own merge seconds (its ``--json``) over the floor measured in the same round
(``floor.py``: the 4 inputs read warm, or the 3 outputs' bytes written durably).

How it measures: every command is its own child process, reaped with ``os.wait4`` for its own
wall and peak RSS (this driver never imports torch, so it does not raise the children's RSS);
the inputs are read once untimed first (page cache warm: the numbers compare work, not disk); a
round runs the sweep then the three merges, repeated (interleaved, so a noisy neighbour hurts
both alike); outputs are deleted and ``os.sync()`` runs before every command. The load average
and the CPU the rest of the machine used meanwhile are printed with the figures.

``--small`` uses a ~5 MB model instead of the ~0.95 GB one (a quick check that the script works).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_merge  # noqa: E402
from floor import floor_command, parse_floor  # noqa: E402
from make_checkpoints import SPEC, checkpoint_bytes, missing_steps, weight_files  # noqa: E402

REPO = HERE.parent
DEFAULT_DATA = REPO / "bench-data"
STEPS = [1000, 2000, 3000, 4000]
SMALL_SPEC = {
    **SPEC,
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 704,
    "vocab_size": 4000,
    "noise_pool": 2**20,
}
CASES = {
    "windows": (["--window", "2000,3000,4000"], [["--window", str(w)] for w in (2000, 3000, 4000)]),
    "weightings": (
        ["--window", "4000", "--weighting", "uniform,ema,wma", "--ema-halflife", "1000"],
        [
            ["--window", "4000"],
            ["--window", "4000", "--weighting", "ema", "--ema-halflife", "1000"],
            ["--window", "4000", "--weighting", "wma"],
        ],
    ),
}


@dataclass
class Sample:
    wall_s: float
    rss_bytes: int
    bytes_read: int
    other_load: float  # CPUs the rest of the machine kept busy meanwhile
    seconds: float  # the merge itself, as its --json says: sources opened to outputs published


def run_child(command: list[str], timeout_s: float) -> Sample:
    """Run ``command`` with bench_merge's runner (its own wall time and peak RSS, the load of the
    rest of the machine), and read the bytes its ``--json`` says it read."""
    try:
        child = bench_merge.run_child(command, timeout_s)
    except bench_merge.ChildFailed as exc:
        raise SystemExit(f"bench_sweep: {exc}") from None
    record = json.loads(child.stdout)
    return Sample(child.wall_s, child.rss_bytes, int(record["bytes_read"]), child.other_cpus, record["seconds"])


def floor_seconds(run_dir: Path, outputs: int, folder: Path, timeout_s: float) -> float:
    """The floor of a pass over STEPS writing ``outputs`` outputs of one checkpoint's size."""
    inputs = [f for step in STEPS for f in weight_files(run_dir / f"step{step}")]
    output_bytes = sum(f.stat().st_size for f in weight_files(run_dir / f"step{STEPS[-1]}"))
    child = bench_merge.run_child(floor_command(inputs, outputs * output_bytes, folder), timeout_s)
    return parse_floor(child.stdout).seconds


@dataclass
class Case:
    name: str
    sweep: list[Sample] = field(default_factory=list)
    separate: list[list[Sample]] = field(default_factory=list)  # per round, the three merges
    floor: list[float] = field(default_factory=list)  # per round, the one pass's floor

    def summary(self) -> dict[str, Any]:
        sweep_walls = [s.wall_s for s in self.sweep]
        separate_walls = [sum(s.wall_s for s in round_) for round_ in self.separate]
        return {
            "sweep_bytes_read": self.sweep[0].bytes_read,
            "separate_bytes_read": sum(s.bytes_read for s in self.separate[0]),
            "sweep_wall_s": [statistics.median(sweep_walls), min(sweep_walls), max(sweep_walls)],
            "separate_wall_s": [statistics.median(separate_walls), min(separate_walls), max(separate_walls)],
            "sweep_peak_rss_bytes": max(s.rss_bytes for s in self.sweep),
            "separate_peak_rss_bytes": max(s.rss_bytes for r in self.separate for s in r),
            "other_load": round(statistics.median(s.other_load for r in self.separate for s in r), 2),
            "sweep_merge_s": statistics.median(s.seconds for s in self.sweep),
            "floor_s": statistics.median(self.floor),
        }


def ensure_data(run_dir: Path, spec: dict[str, Any]) -> None:
    """Generate the missing steps (cached between runs) in a child: this driver stays torch-free."""
    todo = missing_steps(run_dir, STEPS, spec)
    if not todo:
        return
    print(f"bench_sweep: generating {len(todo)} checkpoint(s) of {checkpoint_bytes(spec) / 1e9:.2f} GB in {run_dir}")
    code = (
        "import json, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import make_checkpoints as m; "
        "m.generate(Path(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4]))"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(HERE), str(run_dir), json.dumps(todo), json.dumps(spec)], check=True
    )


def warm(run_dir: Path) -> None:
    for path in sorted(run_dir.glob("step*/*.safetensors")):
        with open(path, "rb") as handle:
            while handle.read(1 << 24):
                pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help="cache folder for inputs (default: bench-data/)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="rounds; medians reported (default 3)")
    parser.add_argument("--small", action="store_true", help="a ~5 MB model: check that the script works")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a command may take (default 1800)")
    args = parser.parse_args(argv)
    spec = SMALL_SPEC if args.small else SPEC
    run_dir = args.data / ("run-small" if args.small else "run")
    ensure_data(run_dir, spec)
    warm(run_dir)
    scratch = Path(tempfile.mkdtemp(prefix=".bench-sweep-", dir=args.data))
    ckptavg = [sys.executable, "-m", "ckptavg", "merge", str(run_dir), "--merge-step", "4000", "--quiet", "--json"]
    print(
        f"bench_sweep: K=3 candidates in one pass vs 3 merges; {len(STEPS)} checkpoints of "
        f"{checkpoint_bytes(spec) / 1e9:.3f} GB; median of {args.repeat} rounds (min-max); "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; page cache warm"
    )
    cases = {name: Case(name) for name in CASES}
    try:
        for _ in range(args.repeat):
            for name, (sweep_args, separate_args) in CASES.items():
                shutil.rmtree(scratch / "sweep", ignore_errors=True)
                os.sync()
                cases[name].floor.append(floor_seconds(run_dir, len(separate_args), scratch, args.timeout))
                cases[name].sweep.append(
                    run_child([*ckptavg, *sweep_args, "--out", str(scratch / "sweep")], args.timeout)
                )
                round_ = []
                for i, extra in enumerate(separate_args):
                    shutil.rmtree(scratch / f"merge{i}", ignore_errors=True)
                    os.sync()
                    round_.append(run_child([*ckptavg, *extra, "--out", str(scratch / f"merge{i}")], args.timeout))
                cases[name].separate.append(round_)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = {name: case.summary() for name, case in cases.items()}
    print(f"{'case':<11} {'':<14} {'bytes read':>11} {'wall s: median (min-max)':>26} {'peak RSS':>9}")
    for name, row in report.items():
        for label, key in (("one pass", "sweep"), ("3 merges", "separate")):
            median, low, high = row[f"{key}_wall_s"]
            print(
                f"{name:<11} {label:<14} {row[f'{key}_bytes_read'] / 1e9:>8.3f} GB "
                f"{median:>12.2f} ({low:.2f}-{high:.2f}) {row[f'{key}_peak_rss_bytes'] / 1e6:>6.0f} MB"
            )
        read_ratio = row["separate_bytes_read"] / row["sweep_bytes_read"]
        wall_ratio = row["separate_wall_s"][0] / row["sweep_wall_s"][0]
        print(
            f"{name:<11} ratio          {read_ratio:>8.2f}x read less, {wall_ratio:.2f}x faster "
            f"(other load {row['other_load']:.2f} CPUs)"
        )
        print(
            f"{name:<11} floor          one pass {row['sweep_merge_s']:.2f} s of merge against a floor of "
            f"{row['floor_s']:.2f} s: {row['sweep_merge_s'] / row['floor_s']:.2f}x"
        )
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"spec": spec, "cases": report}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
