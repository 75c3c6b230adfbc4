"""``ckptavg merge --window 20,40 --weighting uniform,ema``: several candidates from one read of
the checkpoints, each byte-identical (manifest included) to the single merge it stands for;
published, resumed and refused as a merge is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import (
    make_run,
    poison_tensor_data,
    run_cli,
    run_cli_in_process,
    stat_tree,
    torchrun,
    tree_of,
    write_checkpoint,
)

import ckptavg
from ckptavg import MergeOptions, Weighting
from ckptavg.formats.safetensors import SafetensorsReader

STEPS = [10, 20, 30, 40, 50, 60]
SHAPES = {f"model.layers.{i}.w": (32, 20 + 4 * i) for i in range(6)}
PER_SOURCE = sum(2 * a * b for a, b in SHAPES.values())  # bf16
SWEEP = ["--merge-step", "60", "--window", "20,40", "--weighting", "uniform,ema", "--ema-halflife", "15"]
NAMES = ["step60-merged-w20-uniform", "step60-merged-w20-ema15", "step60-merged-w40-uniform", "step60-merged-w40-ema15"]
SEPARATE = {
    "step60-merged-w20-uniform": ["--window", "20"],
    "step60-merged-w20-ema15": ["--window", "20", "--weighting", "ema", "--ema-halflife", "15"],
    "step60-merged-w40-uniform": ["--window", "40"],
    "step60-merged-w40-ema15": ["--window", "40", "--ema-halflife", "15"],
}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep") / "run"
    make_run(root, STEPS, SHAPES, shards=2)
    return root


@pytest.fixture(scope="module")
def separate(run, tmp_path_factory) -> dict[str, dict[str, dict[str, object]]]:
    """Every candidate merged on its own, per output format: {format: {name: file tree}}."""
    out = tmp_path_factory.mktemp("separate")
    trees: dict[str, dict[str, dict[str, object]]] = {}
    for fmt in ("safetensors", "dcp"):
        trees[fmt] = {}
        for name, args in SEPARATE.items():
            target = out / fmt / name
            result = run_cli_in_process(
                "merge",
                str(run),
                "--merge-step",
                "60",
                *args,
                "--shard-size",
                "8KB",
                "--format",
                fmt,
                "--out",
                str(target),
            )
            assert result.returncode == 0, result.stderr
            trees[fmt][name] = tree_of(target)
    return trees


def _one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptavg: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_each_candidate_is_byte_identical_to_its_separate_merge(run, separate, tmp_path, fmt):
    out = tmp_path / "sweep"
    result = run_cli_in_process("merge", str(run), *SWEEP, "--shard-size", "8KB", "--format", fmt, "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(NAMES)  # nothing else, no hidden folder
    for name in NAMES:
        assert tree_of(out / name) == separate[fmt][name], name  # every file, the manifest included
    assert "merged 4 candidates in one pass" in result.stderr


def test_every_source_byte_is_read_once_and_the_result_says_what_separate_merges_read(run, tmp_path, monkeypatch):
    read: Counter[tuple[str, str]] = Counter()
    original = SafetensorsReader.read_into

    def counting(self, name, byte_offset, buffer):
        read[(self.path, name)] += len(buffer)
        return original(self, name, byte_offset, buffer)

    original_view = SafetensorsReader.local_view

    def counting_view(self, name, byte_offset, nbytes):  # a local merge maps what it can
        view = original_view(self, name, byte_offset, nbytes)
        if view is not None:
            read[(self.path, name)] += nbytes
        return view

    monkeypatch.setattr(SafetensorsReader, "read_into", counting)
    monkeypatch.setattr(SafetensorsReader, "local_view", counting_view)
    result = ckptavg.sweep(
        str(run),
        merge_step=60,
        windows=[20, 40],
        weightings=[Weighting(), Weighting("ema", ema_halflife=15)],
        out=str(tmp_path),
        options=MergeOptions(shard_size=8000),
    )
    sources = {path for path, _ in read}
    assert sorted(Path(p).name for p in sources) == ["step30", "step40", "step50", "step60"]
    for path in sources:  # each tensor of each source read exactly once, whole
        assert sum(n for (p, _), n in read.items() if p == path) == PER_SOURCE, path
    assert result.bytes_read == 4 * PER_SOURCE == sum(read.values())
    assert result.bytes_separately == (2 + 2 + 4 + 4) * PER_SOURCE
    assert [Path(c.output).name for c in result.candidates] == NAMES
    assert [len(c.sources) for c in result.candidates] == [2, 2, 4, 4]


def test_the_engine_options_of_a_merge_reach_the_sweep(run, tmp_path, monkeypatch):
    """--threads, --mmap, --workers and --chunk-size mean the same for a sweep as for one merge."""
    import ckptavg.merging.sweep as sweep_module

    seen = []

    class Recording(sweep_module.StreamingAverage):
        def __init__(self, readers, weights, options, *rest):
            seen.append(options)
            super().__init__(readers, weights, options, *rest)

    monkeypatch.setattr(sweep_module, "StreamingAverage", Recording)
    options = MergeOptions(threads=3, mmap=True, workers=3, chunk_bytes=2**16, allow_nonfinite=True)
    ckptavg.sweep(str(run), merge_step=60, windows=[20, 40], out=str(tmp_path), options=options)
    assert seen == [options.engine_options(None)]
    assert (seen[0].threads, seen[0].mmap, seen[0].workers, seen[0].chunk_bytes) == (3, True, 3, 2**16)


def test_dry_run_lists_candidates_and_the_bytes_read_once_and_separately(run):
    before = tree_of(run)
    result = run_cli_in_process("merge", str(run), *SWEEP, "--window", "20,40,60", "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert [c["name"] for c in payload["candidates"]] == [
        *NAMES,
        "step60-merged-w60-uniform",
        "step60-merged-w60-ema15",
    ]
    assert payload["steps_read"] == STEPS
    ema = Weighting("ema", ema_halflife=15)
    for c in payload["candidates"]:
        expected_steps = [s for s in STEPS if s > 60 - c["window"]]
        assert c["steps"] == expected_steps
        assert c["weights"] == (ema if "ema" in c["name"] else Weighting()).weights(expected_steps)
    assert payload["bytes_to_read"] == 6 * PER_SOURCE
    assert payload["bytes_by_separate_merges"] == 2 * (2 + 4 + 6) * PER_SOURCE
    text = run_cli_in_process("merge", str(run), *SWEEP, "--dry-run")
    assert text.returncode == 0, text.stderr
    assert "would write 4 candidates from one read of 4 checkpoints (steps 30-60 every 10)" in text.stdout
    assert "step60-merged-w40-ema15" in text.stdout and "by 4 separate merges (3.0x)" in text.stdout
    assert tree_of(run) == before


def test_one_window_and_several_weightings_take_the_hooks_names_and_ls_and_selection_skip_them(tmp_path):
    run = tmp_path / "run"
    make_run(run, STEPS, {"w": (40,)})
    result = run_cli_in_process("merge", str(run), "--merge-step", "60", "--window", "30", "--weighting", "uniform,wma")
    assert result.returncode == 0, result.stderr
    assert (run / "step60-merged-uniform" / "ckptavg-manifest.json").is_file()
    assert (run / "step60-merged-wma" / "ckptavg-manifest.json").is_file()
    rows = json.loads(run_cli_in_process("ls", str(run), "--json").stdout)
    assert {r["name"]: r["status"] for r in rows if "merged" in r["name"]} == {
        "step60-merged-uniform": "merged",
        "step60-merged-wma": "merged",
    }
    assert [c.step for c in ckptavg.select(str(run), last=3).checkpoints] == [40, 50, 60]
    # A sweep into the run folder, then a merge of the newest steps: the outputs are not inputs.
    assert run_cli_in_process("merge", str(run), "--merge-step", "60", "--window", "20,30").returncode == 0
    assert (run / "step60-merged-w30-uniform").is_dir()
    assert [c.step for c in ckptavg.select(str(run), last=2).checkpoints] == [50, 60]
    # A single window and weighting: the name and behaviour of a single merge.
    assert run_cli_in_process("merge", str(run), "--merge-step", "60", "--window", "20").returncode == 0
    assert (run / "step60-merged" / "ckptavg-manifest.json").is_file()


def test_several_weightings_of_last_n_are_named_by_the_newest_step(tmp_path):
    run = tmp_path / "run"
    make_run(run, STEPS, {"w": (40,)})
    result = run_cli_in_process(
        "merge", str(run), "--last", "3", "--weighting", "uniform,minus-sqrt", "--out", str(tmp_path / "o")
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["step60-merged-minus-sqrt", "step60-merged-uniform"]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--last", "3", "--window", "20,40"], ("several windows", "--merge-step")),
        (["--steps", "50,60", "--window", "20,40"], ("several windows",)),
        (["--merge-step", "60", "--window", "20,40,20"], ("window 20 is given twice",)),
        (["--merge-step", "60", "--window", "20,40", "--weights", "1,2"], ("--weights", "several windows")),
        (["--merge-step", "60", "--window", "20", "--weighting", "wma,wma"], ("weighting wma is given twice",)),
        (["--merge-step", "60", "--window", "20,x"], ("'--window'", "'20,x'")),
        (["--merge-step", "60", "--window", "20,0"], ("'--window'", "at least 1 step")),
        (["--merge-step", "60", "--window", "20", "--weighting", "uniform,sma"], ("'--weighting'", "'sma'")),
        (["--merge-step", "60", "--window", "20,40", "--weighting", "uniform,wma", "--ema-alpha", "0.1"], ("ema",)),
        (["--merge-step", "60", "--window", "20,40", "--remove-consumed-snapshots"], ("single merge",)),
        (["--merge-step", "60", "--window", "20,40", "--out", "RUN/step60-merged"], ("is a merged output",)),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_bad_combinations_are_refused_in_one_line_before_anything_is_written(tmp_path, args, fragments):
    run = tmp_path / "run"
    make_run(run, STEPS, {"w": (40,)})
    write_checkpoint(run / "step60-merged", {"w": torch.zeros(40)})
    before = tree_of(tmp_path)
    args = [a.replace("RUN", str(run)) for a in args]
    _one_line_error(run_cli_in_process("merge", str(run), *args), *fragments)
    assert tree_of(tmp_path) == before


def test_candidates_the_memory_cannot_hold_are_refused_in_one_line(run, tmp_path, monkeypatch):
    import ckptavg.merging.engine as engine

    monkeypatch.setattr(engine, "available_memory", lambda: 12 * 2**20)
    args = ["merge", str(run), "--chunk-size", "1MiB", "--out", str(tmp_path / "o")]
    # One merge holds 9 chunks of 1 MiB: it fits; 4 candidates need 9 + 3 x 3.
    assert run_cli_in_process(*args, "--merge-step", "60", "--window", "20", "--dry-run").returncode == 0
    for extra in ([], ["--dry-run"]):
        _one_line_error(
            run_cli_in_process(*args, *SWEEP, *extra), "4 candidates in one pass need 18.87 MB", "--chunk-size"
        )
    assert not (tmp_path / "o").exists()


def test_a_failure_during_the_pass_publishes_no_candidate(tmp_path):
    """Only the widest window holds the NaN: the narrower candidates alone would succeed, but
    nothing is published, and no hidden folder is left."""
    run = tmp_path / "run"
    saved = make_run(run, STEPS, {"w": (40,), "v": (8,)})
    bad = dict(saved[30])
    bad["w"] = bad["w"].clone()
    bad["w"][3] = float("nan")
    write_checkpoint(run / "step30", bad)
    before = tree_of(run)
    result = run_cli_in_process("merge", str(run), *SWEEP)
    _one_line_error(result, "step30", "'w'", "NaN")
    assert tree_of(run) == before


def test_a_failure_while_publishing_leaves_only_complete_correct_candidates(run, separate, tmp_path, monkeypatch):
    import ckptavg.merging.sweep as sweep_module

    published = []
    original = sweep_module.publish

    def failing(*args, **kwargs):
        if len(published) == 2:
            raise ckptavg.OutputError("disk full (injected)")
        published.append(original(*args, **kwargs))
        return published[-1]

    monkeypatch.setattr(sweep_module, "publish", failing)
    out = tmp_path / "o"
    result = run_cli_in_process("merge", str(run), *SWEEP, "--shard-size", "8KB", "--out", str(out))
    _one_line_error(result, "disk full (injected)")
    assert sorted(p.name for p in out.iterdir()) == sorted(NAMES[:2])  # no hidden folder either
    for name in NAMES[:2]:
        assert tree_of(out / name) == separate["safetensors"][name]


def _killed(run: Path, out: Path, at: str, after: int) -> None:
    """The sweep CLI in a process that dies (``os._exit``, as under SIGKILL) once ``at`` (a
    function of ckptavg.merging.sweep) has returned ``after`` times."""
    script = (
        "import os, ckptavg.merging.sweep as s\n"
        f"calls, original = [0], s.{at}\n"
        "def dying(*args, **kwargs):\n"
        "    value = original(*args, **kwargs)\n"
        "    calls[0] += 1\n"
        f"    if calls[0] == {after}: os._exit(9)\n"
        "    return value\n"
        f"s.{at} = dying\n"
        "from ckptavg.cli import main; main()\n"
    )
    args = ["merge", str(run), *SWEEP, "--shard-size", "8KB", "--out", str(out)]
    killed = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert killed.returncode == 9, killed.stderr


@pytest.mark.parametrize(("at", "after"), [("_Slot.file_done", 5), ("publish", 2)])
def test_resume_after_a_kill_reuses_finished_files_and_keeps_published_candidates(run, separate, tmp_path, at, after):
    out = tmp_path / "o"
    _killed(run, out, at, after)
    assert any(p.name.startswith(".") for p in out.iterdir())  # what the kill left
    published = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert published == (sorted(NAMES[:2]) if at == "publish" else [])
    if not published:  # another merge's output where a candidate goes: refused, the hidden folders stay
        hidden = sorted(p.name for p in out.iterdir())
        (out / NAMES[2]).mkdir()
        (out / NAMES[2] / "ckptavg-manifest.json").write_text(json.dumps({"tool": "ckptavg", "files": {}}))
        _one_line_error(
            run_cli_in_process("merge", str(run), *SWEEP, "--shard-size", "8KB", "--out", str(out), "--resume"),
            "already exists",
        )
        assert sorted(p.name for p in out.iterdir() if p.name != NAMES[2]) == hidden
        shutil.rmtree(out / NAMES[2])
    result = run_cli_in_process(
        "merge", str(run), *SWEEP, "--shard-size", "8KB", "--out", str(out), "--resume", "--json"
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert sorted(Path(k).name for k in payload["kept"]) == published
    reused = sum(c["reused_files"] for c in payload["candidates"])
    assert reused >= (4 if at == "_Slot.file_done" else 2 * 2)
    if at == "publish":  # every file of the two unpublished candidates was finished: nothing read
        assert payload["bytes_read"] == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(NAMES)
    for name in NAMES:
        assert tree_of(out / name) == separate["safetensors"][name], name


@pytest.mark.parametrize("resume", [False, True], ids=["rerun", "rerun-with-resume"])
def test_rerunning_a_finished_sweep_keeps_every_candidate_reading_and_writing_nothing(run, tmp_path, resume):
    """A requeued sweep: every candidate is already published by the same merge, so each gets
    its note, the sweep exits 0, reads no tensor (the checkpoints' tensor data is NaN now) and
    changes no byte or time stamp; --dry-run says so per candidate."""
    mine = tmp_path / "run"
    shutil.copytree(run, mine)
    out = tmp_path / "o"
    args = ["merge", str(mine), *SWEEP, "--shard-size", "8KB", "--out", str(out)]
    assert run_cli_in_process(*args).returncode == 0
    poison_tensor_data(*(mine / f"step{step}" for step in STEPS))
    before = stat_tree(tmp_path)
    result = run_cli_in_process(*args, "--json", *(["--resume"] if resume else []))
    assert result.returncode == 0, result.stderr
    assert result.stderr == "".join(
        f"ckptavg: note: {out / name}: already merged, manifest matches; nothing to do\n" for name in NAMES
    )
    payload = json.loads(result.stdout)
    assert [Path(k).name for k in payload["kept"]] == NAMES and payload["bytes_read"] == 0
    dry = run_cli_in_process(*args, "--dry-run", "--json")
    assert dry.returncode == 0 and all(c["already_merged"] for c in json.loads(dry.stdout)["candidates"])
    assert stat_tree(tmp_path) == before


def test_force_replaces_every_candidate_and_resume_refuses_another_merge(run, separate, tmp_path):
    out = tmp_path / "o"
    args = ["merge", str(run), *SWEEP, "--shard-size", "8KB", "--out", str(out)]
    # A published output of another merge (another window) where a candidate goes.
    other = run_cli_in_process("merge", str(run), "--last", "2", "--out", str(out / NAMES[3]))
    assert other.returncode == 0, other.stderr
    _one_line_error(run_cli_in_process(*args), "already exists", "--force")
    _one_line_error(run_cli_in_process(*args, "--resume"), "already exists", "--force")
    assert sorted(p.name for p in out.iterdir()) == [NAMES[3]]  # the refusals created nothing
    result = run_cli_in_process(*args, "--force")
    assert result.returncode == 0, result.stderr
    for name in NAMES:
        assert tree_of(out / name) == separate["safetensors"][name], name


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_two_processes_write_the_same_candidates(run, separate, tmp_path, fmt):
    out = tmp_path / "two"
    result = torchrun(2, "merge", str(run), *SWEEP, "--shard-size", "8KB", "--format", fmt, "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "merged 4 candidates in one pass by 2 processes" in result.stderr
    for name in NAMES:
        assert tree_of(out / name) == separate[fmt][name], name


def test_the_real_entry_point_sweeps(run, tmp_path):
    result = run_cli("merge", str(run), *SWEEP, "--out", str(tmp_path / "o"), "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["bytes_read"] == 4 * PER_SOURCE and payload["bytes_read_by_separate_merges"] == 12 * PER_SOURCE
    assert all(os.path.isfile(os.path.join(c["output"], "ckptavg-manifest.json")) for c in payload["candidates"])


def test_candidates_on_an_object_store_are_published_manifest_last_and_equal_separate_merges(run):
    """memory:// has no rename: each candidate is written in place, its manifest last."""
    import uuid

    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"memory://ckptavg-sweep/{uuid.uuid4().hex[:12]}"
    weightings = [Weighting(), Weighting("ema", ema_halflife=15)]
    result = ckptavg.sweep(str(run), merge_step=60, windows=[20, 40], weightings=weightings, out=f"{root}/sweep")
    assert [c.output.rsplit("/", 1)[1] for c in result.candidates] == NAMES
    for candidate, (window, weighting) in zip(
        result.candidates, [(w, x) for w in (20, 40) for x in weightings], strict=True
    ):
        single = ckptavg.merge(str(run), merge_step=60, window=window, weighting=weighting, out=f"{root}/one")
        theirs = {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in fs.find(single.output)}
        mine = {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in fs.find(candidate.output)}
        assert mine == theirs and "ckptavg-manifest.json" in mine
        fs.rm(single.output, recursive=True)
