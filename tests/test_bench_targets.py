"""benchmarks/targets.py, the table that ends ``make bench``: from the JSON the bench scripts wrote
in one run, each issue target's figure (median of the medians, range of the rounds' ratios) and
met / not met, and "not measured" for every figure the run did not produce. Built from small
results files written here, not from a bench run."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers import REPO, load_script


@pytest.fixture(scope="module")
def targets() -> ModuleType:
    return load_script(REPO / "benchmarks" / "targets.py", "ckptavg_bench_targets")


def write(folder: Path, name: str, record: object) -> None:
    (folder / name).write_text(json.dumps(record))


def merge_samples(seconds: list[float]) -> dict:
    """bench_merge's record of one measurement: its children's JSON lines, ``seconds`` in each."""
    return {"samples": [{"stdout": json.dumps({"seconds": s}), "wall_s": s + 1} for s in seconds]}


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run in which bench_layouts_small, bench_layouts_dcp and bench_merge recorded figures,
    bench_weighted failed before recording and bench_processes did not run."""
    monkeypatch.setenv("CKPTAVG_BENCH_RESULTS", str(tmp_path))
    write(
        tmp_path, "machine.json", {"cpu": "Test CPU 9000", "cores": 2, "load_average": [0.5, 0.25, 0.1], "started": "x"}
    )
    seconds = {
        "dense": [1.0, 1.2, 1.1],
        "moe": [1.05, 1.3, 1.1],
        "tiny": [3.0, 2.0, 2.5],
        "naive tiny": [2.0, 2.4, 2.2],
    }
    write(tmp_path, "bench_layouts_small.json", {"mib": 384, "seconds": seconds})
    layouts = ["1 rank", "8 x Shard(0)", "2 x Shard(1)", "4 x Shard(1)", "64 x Shard(0)"]
    dcp = {
        "seconds": dict(zip(layouts, [[2.0, 2.0], [2.1, 2.3], [2.2, 2.2], [2.5, 2.3], [3.0, 3.0]], strict=True)),
        "rss_bytes": dict.fromkeys(layouts, [100, 100]) | {"64 x Shard(0)": [130, 120]},
        "identical": dict.fromkeys(layouts, True) | {"4 x Shard(1)": False},
    }
    write(tmp_path, "bench_layouts_dcp.json", dcp)
    merge = {"ckptavg": merge_samples([2.6, 2.8]), "ckptavg_no_fsync": merge_samples([1.0, 1.1])}
    write(tmp_path, "bench_merge.json", {"measurements": merge | {"floor": merge_samples([2.0, 2.0])}})
    walls = [
        {"script": f"{name}.py", "wall_s": 60.0, "status": 0}
        for name in ("bench_merge", "bench_layouts_small", "bench_layouts_dcp")
    ]
    write(tmp_path, "walls.json", [*walls, {"script": "bench_weighted.py", "wall_s": 3.0, "status": 1}])
    return tmp_path


def table(targets: ModuleType, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    status = targets.main([])
    return status, capsys.readouterr().out.splitlines()


def row(lines: list[str], what: str) -> str:
    """The one table row of target ``what``, its cells separated by single spaces."""
    (line,) = [line for line in lines if re.match(rf"\d+ +{re.escape(what)}  ", line)]
    return " ".join(line.split())


def test_each_target_is_met_not_met_or_not_measured_from_this_runs_figures(
    targets: ModuleType, results: Path, capsys: pytest.CaptureFixture[str]
):
    status, lines = table(targets, capsys)
    # Ratio of the medians (1.1 / 1.1), range of the rounds' ratios (1.05 / 1.0, 1.3 / 1.2, 1.1 / 1.1).
    assert row(lines, "MoE (256 KiB tensors) / dense, merge s") == (
        "31 MoE (256 KiB tensors) / dense, merge s <= 1.1 1.000 (1.000-1.083) met"
    )
    assert row(lines, "tiny (16 KiB tensors) / dense, merge s").endswith(f"<= 2 {2.5 / 1.1:.3f} (1.667-3.000) not met")
    assert row(lines, "tiny / naive load-all average, s").endswith(f"< 1 {2.5 / 2.2:.3f} (0.833-1.500) not met")
    assert row(lines, "DCP 8 x Shard(0) / 1 rank, merge s").endswith("<= 1.15 1.100 (1.050-1.150) met")
    assert row(lines, "DCP 2 x Shard(1) / 1 rank, merge s").endswith("<= 1.15 1.100 (1.100-1.100) met")
    # Fast enough, but its merge was not bit-identical to the 1-rank one's: never "met".
    assert row(lines, "DCP 4 x Shard(1) / 1 rank, merge s").endswith(
        "<= 1.15 1.200 (1.150-1.250) not met (output not bit-identical)"
    )
    assert row(lines, "DCP 64 x Shard(0) / 1 rank, merge s").endswith("1.500 (1.500-1.500) reported")
    assert row(lines, "peak RSS, DCP 8 x Shard(0) / 1 rank").endswith("<= 1.1 1.000 (1.000-1.000) met")
    assert row(lines, "peak RSS, DCP 64 x Shard(0) / 1 rank").endswith("<= 1.1 1.250 (1.200-1.300) not met")
    assert row(lines, "merge / floor, bench_merge case a").endswith("1.350 (1.300-1.400) reported")
    assert row(lines, "same, --no-fsync").endswith(f"{1.05 / 2:.3f} (0.500-0.550) reported")
    # Figures this run did not produce, each saying why.
    assert row(lines, "peak RSS, MoE or tiny / dense").endswith("not measured (recorded no rss_bytes / moe)")
    for weighting in ("minus-sqrt", "wma", "dyadic", "negative"):
        assert row(lines, f"{weighting} / uniform, dense, page cache, wall").endswith(
            "<= 1.1 not measured (bench_weighted.py exited 1)"
        )
    assert row(lines, "2 processes, bytes largest / smallest, one file").endswith(
        "not measured (bench_processes.py did not run)"
    )
    assert "machine: Test CPU 9000, 2 cores, load average 0.5 0.25 0.1 at start (x)" in lines
    assert "  bench_weighted.py: 3 s, exit 1" in lines
    assert status == 1  # a script failed


def test_balance_is_largest_over_smallest_bytes_per_process_and_needs_identical_outputs(
    targets: ModuleType, results: Path, capsys: pytest.CaptureFixture[str]
):
    written = {"one file": [[500, 480], [500, 480]], "700 KB shards": [[300, 200], [250, 250]]}
    write(results, "bench_processes.json", {"small": True, "bytes_written": written, "identical": True})
    _, lines = table(targets, capsys)
    assert row(lines, "2 processes, bytes largest / smallest, one file").endswith(
        f"<= 1.1 {500 / 480:.3f} ({500 / 480:.3f}-{500 / 480:.3f}) met"
    )
    assert row(lines, "same, sharded output").endswith("<= 1.1 1.250 (1.000-1.500) not met")
    write(results, "bench_processes.json", {"small": True, "bytes_written": written, "identical": False})
    _, lines = table(targets, capsys)
    assert row(lines, "2 processes, bytes largest / smallest, one file").endswith(
        "not met (outputs of 1 and 2 processes differ)"
    )


def test_a_results_file_of_another_shape_is_not_measured(
    targets: ModuleType, results: Path, capsys: pytest.CaptureFixture[str]
):
    # Rounds missing from one side, and a sample whose stdout is not the child's JSON.
    seconds = {"dense": [1.0, 1.2], "moe": [1.1], "tiny": [2.0, 2.0], "naive tiny": [3.0, 3.0]}
    write(results, "bench_layouts_small.json", {"seconds": seconds})
    merge = {"ckptavg": {"samples": [{"stdout": "Traceback"}]}, "floor": merge_samples([2.0])}
    write(results, "bench_merge.json", {"measurements": merge})
    _, lines = table(targets, capsys)
    assert row(lines, "MoE (256 KiB tensors) / dense, merge s").endswith("not measured (1 against 2 samples)")
    assert row(lines, "tiny (16 KiB tensors) / dense, merge s").endswith(f"<= 2 {2 / 1.1:.3f} (1.667-2.000) met")
    assert "not measured (bench_merge.py's results unreadable" in row(lines, "merge / floor, bench_merge case a")


def test_start_clears_the_last_runs_figures_and_time_records_a_failing_script(
    targets: ModuleType, results: Path, capsys: pytest.CaptureFixture[str]
):
    assert targets.main(["--start"]) == 0
    assert sorted(p.name for p in results.iterdir()) == ["machine.json"]
    machine = json.loads((results / "machine.json").read_text())
    assert machine["cores"] >= 1 and len(machine["load_average"]) == 3 and machine["cpu"]
    failing = [sys.executable, "-c", "raise SystemExit(3)", "bench_processes.py"]
    assert targets.main(["--time", "--", *failing]) == 0  # the next script still runs
    status, lines = table(targets, capsys)
    assert status == 1
    assert row(lines, "2 processes, bytes largest / smallest, one file").endswith(
        "not measured (bench_processes.py exited 3)"
    )
    assert row(lines, "MoE (256 KiB tensors) / dense, merge s").endswith(
        "not measured (bench_layouts_small.py did not run)"
    )
    assert any(line.startswith("  bench_processes.py: ") and line.endswith("s, exit 3") for line in lines)
