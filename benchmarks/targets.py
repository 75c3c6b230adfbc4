"""The issues' performance targets against what this run of ``make bench`` measured: one table.

``make bench`` and ``make bench-targets`` run it three ways, with ``CKPTAVG_BENCH_RESULTS`` (see
``results.py``) naming the results folder:

  targets.py --start            empty the folder, record the machine (CPU model, cores, load average)
  targets.py --time -- CMD ...  run one bench script, record its wall time and exit status; exit 0
                                whatever it returned, so that one failing script stops no other
  targets.py                    print the table: per target its issue, what, bound, the figure
                                measured (median, range), met / not met; then each script's wall
                                time. Exit 1 where a script failed.

Every figure comes from the JSON the scripts wrote in this run (``results.record``): a script
that failed, or did not run, or recorded no such figure gives "not measured", never a number
from elsewhere. A ratio of two things measured interleaved (A, B, A, B, ...) is the ratio of
their medians, as the scripts print it, and its range the smallest and largest ratio of one
round's A and B; the verdict is on the median.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from results import ENV, results_folder

MACHINE = "machine.json"
WALLS = "walls.json"
BOUNDS = {"<=": operator.le, "<": operator.lt}


class NotMeasured(Exception):
    """A figure this run did not produce; the message says why."""


@dataclass(frozen=True)
class Measured:
    median: float
    low: float
    high: float
    flaw: str = ""  # what makes the figure fail its target whatever its value (outputs differ)


@dataclass(frozen=True)
class Target:
    issue: int
    what: str
    bound: tuple[str, float] | None  # ("<=", 1.1); None: reported, no bound
    script: str  # the bench whose JSON holds the figure
    measure: Callable[[dict[str, Any]], Measured]


def ratio(numerator: list[float], denominator: list[float]) -> Measured:
    """median(numerator) / median(denominator), and the range of the ratios round by round (the
    i-th sample of each was taken in the same round)."""
    if not numerator or len(numerator) != len(denominator):
        raise NotMeasured(f"{len(numerator)} against {len(denominator)} samples")
    rounds = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return Measured(statistics.median(numerator) / statistics.median(denominator), min(rounds), max(rounds))


def spread(values: list[float]) -> Measured:
    if not values:
        raise NotMeasured("no samples")
    return Measured(statistics.median(values), min(values), max(values))


def figure(record: dict[str, Any], *keys: str) -> Any:
    """``record[key][key]...``, or NotMeasured naming the first key missing."""
    for key in keys:
        if not isinstance(record, dict) or key not in record:
            raise NotMeasured(f"recorded no {' / '.join(keys)}")
        record = record[key]
    return record


def small_layouts(layout: str, baseline: str = "dense") -> Callable[[dict[str, Any]], Measured]:
    return lambda r: ratio(figure(r, "seconds", layout), figure(r, "seconds", baseline))


def small_layouts_rss(r: dict[str, Any]) -> Measured:
    """The larger peak RSS of the MoE and tiny layouts, over dense's (rounds paired)."""
    return max(
        (ratio(figure(r, "rss_bytes", n), figure(r, "rss_bytes", "dense")) for n in ("moe", "tiny")),
        key=lambda m: m.median,
    )


def dcp(layout: str, what: str = "seconds") -> Callable[[dict[str, Any]], Measured]:
    """``layout`` over the 1-rank save, flawed where its merge was not bit-identical to 1 rank's."""

    def measure(r: dict[str, Any]) -> Measured:
        measured = ratio(figure(r, what, layout), figure(r, what, "1 rank"))
        return measured if figure(r, "identical", layout) else replace(measured, flaw="output not bit-identical")

    return measure


def weighted(weighting: str) -> Callable[[dict[str, Any]], Measured]:
    return lambda r: ratio(figure(r, "page cache", "wall_s", weighting), figure(r, "page cache", "wall_s", "uniform"))


def balance(case: str) -> Callable[[dict[str, Any]], Measured]:
    """Largest / smallest bytes written per process, over the runs of ``case`` (the first case
    whose name contains it: ``--small`` names its shards otherwise)."""

    def measure(r: dict[str, Any]) -> Measured:
        written = figure(r, "bytes_written")
        name = next((n for n in written if case in n), None)
        if name is None:
            raise NotMeasured(f"recorded no {case!r} case")
        measured = spread([max(run) / max(1, min(run)) for run in written[name]])
        return measured if figure(r, "identical") else replace(measured, flaw="outputs of 1 and 2 processes differ")

    return measure


def merge_over_floor(merge: str) -> Callable[[dict[str, Any]], Measured]:
    """bench_merge's merge seconds / floor seconds (``floor.py``), both from the children's JSON."""

    def seconds(r: dict[str, Any], key: str) -> list[float]:
        return [json.loads(s["stdout"])["seconds"] for s in figure(r, "measurements", key, "samples")]

    return lambda r: ratio(seconds(r, merge), seconds(r, "floor"))


TARGETS = (
    Target(31, "MoE (256 KiB tensors) / dense, merge s", ("<=", 1.1), "bench_layouts_small", small_layouts("moe")),
    Target(31, "tiny (16 KiB tensors) / dense, merge s", ("<=", 2.0), "bench_layouts_small", small_layouts("tiny")),
    Target(
        31, "tiny / naive load-all average, s", ("<", 1.0), "bench_layouts_small", small_layouts("tiny", "naive tiny")
    ),
    Target(31, "peak RSS, MoE or tiny / dense", ("<=", 1.1), "bench_layouts_small", small_layouts_rss),
    Target(31, "DCP 8 x Shard(0) / 1 rank, merge s", ("<=", 1.15), "bench_layouts_dcp", dcp("8 x Shard(0)")),
    Target(31, "DCP 64 x Shard(0) / 1 rank, merge s", None, "bench_layouts_dcp", dcp("64 x Shard(0)")),
    *(
        Target(31, f"peak RSS, DCP {layout} / 1 rank", ("<=", 1.1), "bench_layouts_dcp", dcp(layout, "rss_bytes"))
        for layout in ("8 x Shard(0)", "2 x Shard(1)", "4 x Shard(1)", "64 x Shard(0)")
    ),
    Target(31, "merge / floor, bench_merge case a", None, "bench_merge", merge_over_floor("ckptavg")),
    Target(31, "  same, --no-fsync", None, "bench_merge", merge_over_floor("ckptavg_no_fsync")),
    Target(32, "DCP 2 x Shard(1) / 1 rank, merge s", ("<=", 1.15), "bench_layouts_dcp", dcp("2 x Shard(1)")),
    Target(32, "DCP 4 x Shard(1) / 1 rank, merge s", ("<=", 1.15), "bench_layouts_dcp", dcp("4 x Shard(1)")),
    *(
        Target(32, f"{name} / uniform, dense, page cache, wall", ("<=", 1.1), "bench_weighted", weighted(name))
        for name in ("minus-sqrt", "wma", "dyadic", "negative")
    ),
    Target(32, "2 processes, bytes largest / smallest, one file", ("<=", 1.1), "bench_processes", balance("one file")),
    Target(32, "  same, sharded output", ("<=", 1.1), "bench_processes", balance("shards")),
)


def load(folder: Path, name: str) -> Any:
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def unrecorded(script: str, ran: dict[str, Any] | None) -> str:
    """Why ``script`` left no figures: it did not run, failed before recording, or records none."""
    if ran is None:
        return f"{script} did not run"
    return f"{script} exited {ran['status']}" if ran["status"] != 0 else f"{script} recorded nothing"


def evaluate(target: Target, folder: Path, walls: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """(measured, verdict) of ``target`` from the results in ``folder``."""
    script = f"{target.script}.py"
    record = load(folder, f"{target.script}.json")
    try:
        if record is None:
            raise NotMeasured(unrecorded(script, walls.get(script)))
        measured = target.measure(record)
    except NotMeasured as reason:
        return "", f"not measured ({reason})"
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:  # a results file of another shape
        return "", f"not measured ({script}'s results unreadable: {error})"
    shown = f"{measured.median:.3f} ({measured.low:.3f}-{measured.high:.3f})"
    if measured.flaw:
        return shown, f"not met ({measured.flaw})"
    if target.bound is None:
        return shown, "reported"
    sign, bound = target.bound
    return shown, "met" if BOUNDS[sign](measured.median, bound) else "not met"


def machine() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
        ]
        model = names[0] if names else model
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def table(folder: Path) -> tuple[list[str], bool]:
    """The lines to print, and whether every script that ran exited 0."""
    walls = {entry["script"]: entry for entry in load(folder, WALLS) or []}
    host = load(folder, MACHINE) or {**machine(), "started": "not recorded; load now"}
    lines = [
        f"targets (issues 31, 32) as measured by this run in {folder}",
        f"machine: {host['cpu']}, {host['cores']} cores, load average {' '.join(map(str, host['load_average']))} "
        f"at start ({host['started']})",
        "ratios: of the medians, range of the rounds' ratios (A, B interleaved); verdict on the median",
        "",
    ]
    rows = [("issue", "target", "bound", "measured (range)", "verdict")]
    for target in TARGETS:
        bound = "" if target.bound is None else f"{target.bound[0]} {target.bound[1]:g}"
        rows.append((str(target.issue), target.what, bound, *evaluate(target, folder, walls)))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)) + "  " + row[4] for row in rows]
    lines += ["", "scripts (wall s, exit status):"]
    lines += [f"  {s}: {e['wall_s']:.0f} s, exit {e['status']}" for s, e in walls.items()] or ["  none recorded"]
    return lines, all(entry["status"] == 0 for entry in walls.values())


def start(folder: Path) -> None:
    """An empty results folder (this run's figures only) with the machine recorded."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.json"):
        stale.unlink()
    (folder / MACHINE).write_text(json.dumps(machine()) + "\n")


def timed(folder: Path, command: list[str]) -> None:
    """Run ``command`` (a bench script) and append its wall time and exit status to the record."""
    started = time.perf_counter()
    status = subprocess.run(command).returncode
    script = next((Path(arg).name for arg in command if arg.endswith(".py")), command[0])
    walls = load(folder, WALLS) or []
    walls.append({"script": script, "wall_s": time.perf_counter() - started, "status": status})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / WALLS).write_text(json.dumps(walls) + "\n")
    if status != 0:
        print(f"targets: {script} exited {status}; its targets will read 'not measured'", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], usage="%(prog)s [--start | --time -- CMD ...]"
    )
    parser.add_argument("--start", action="store_true", help="empty the results folder, record the machine")
    # ``--time -- CMD ...`` is read before argparse, which would take the command's options as its own.
    timing = argv[:2] == ["--time", "--"] and len(argv) > 2
    args = parser.parse_args([] if timing else argv)
    folder = results_folder()
    if folder is None:
        parser.error(f"set {ENV} to the results folder")
    if timing:
        timed(folder, argv[2:])
    elif args.start:
        start(folder)
    else:
        lines, all_ran = table(folder)
        print("\n".join(lines))
        return 0 if all_ran else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
