"""Run-folder discovery, selection, output layout, manifest, atomicity and input errors."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from helpers import make_run, run_cli_in_process, write_checkpoint
from hypothesis import given
from hypothesis import strategies as st
from references import assert_equal, load_merged, reference

import ckptavg
from ckptavg import CheckpointError, CkptavgError, ConfigError, MergeOptions, OutputError
from ckptavg.io.fs import resolve
from ckptavg.merging.discovery import Checkpoint, find_checkpoints, mergeable, parse_step_dir, select_checkpoints

SHAPES = {"model.embed.weight": (64, 16), "model.layers.0.w": (16, 16), "lm_head.weight": (64, 16)}


def _found(root: Path):
    fs, path = resolve(str(root))
    return mergeable(find_checkpoints(fs, path))


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("step1200", (1200, None)),
        ("step-1200", (1200, None)),
        ("checkpoint-1200", (1200, None)),
        ("global_step1200", (1200, None)),
        ("step1200-merged", (1200, "-merged")),
        ("step1200-merged-ema20", (1200, "-merged-ema20")),
        ("step1200-merged-ema-alpha1e-05", (1200, "-merged-ema-alpha1e-05")),
        ("step1200-merged-", None),
        ("step1200-tmp", (1200, "-tmp")),
        ("stepx", None),
        ("runs", None),
    ],
)
def test_step_folder_names(name, parsed):
    assert parse_step_dir(name) == parsed


def test_discovery_by_step_and_naming_scheme(run_dir):
    tensors = {"w": torch.zeros(2)}
    for name in ("step100", "step-200", "checkpoint-300", "global_step400", "step400-merged", "step500-tmp", "notes"):
        write_checkpoint(run_dir / name, tensors)
    (run_dir / "step600").mkdir()  # no weights: incomplete
    found = find_checkpoints(*resolve(str(run_dir)))
    assert [(c.step, c.complete, c.merged) for c in found] == [
        (100, True, False),
        (200, True, False),
        (300, True, False),
        (400, True, False),
        (400, True, True),
        (500, False, False),
        (600, False, False),
    ]
    assert [c.step for c in mergeable(found)] == [100, 200, 300, 400]


def test_selection_modes(run_dir):
    make_run(run_dir, [100, 150, 200, 250, 300], {"w": (4,)})
    found = _found(run_dir)
    steps = lambda chosen: [c.step for c in chosen]  # noqa: E731
    assert steps(select_checkpoints(found, merge_step=250, window=101)) == [150, 200, 250]
    assert steps(select_checkpoints(found, merge_step=260, window=100, allow_partial_window=True)) == [200, 250]
    with pytest.raises(CkptavgError, match="window 161-260 misses 1 step: 260"):
        select_checkpoints(found, merge_step=260, window=100)
    assert steps(select_checkpoints(found, last=2)) == [250, 300]
    assert steps(select_checkpoints(found, steps=[300, 100])) == [100, 300]
    with pytest.raises(CkptavgError, match="no checkpoint in the window 1-50; steps found: 100, 150, 200, 250, 300"):
        select_checkpoints(found, merge_step=50, window=50)
    with pytest.raises(CkptavgError, match="step 125 not found; steps found: 100, 150"):
        select_checkpoints(found, steps=[100, 125])
    with pytest.raises(CkptavgError, match="exactly one"):
        select_checkpoints(found, last=2, steps=[100])
    with pytest.raises(CkptavgError, match="needs --window"):
        select_checkpoints(found, merge_step=300)


def megatron_min_interval(iterations: list[int], min_interval: int) -> list[int]:
    """Megatron-LM's ``_filter_checkpoints_by_interval`` (tools/checkpoint/weighted_merge.py, PR
    5114), restated: walking back from the target, keep an iteration at least ``min_interval``
    before the last one kept."""
    kept: list[int] = []
    for iteration in reversed(iterations):
        if not kept or kept[-1] - iteration >= min_interval:
            kept.append(iteration)
    return list(reversed(kept))


@given(
    st.lists(st.integers(0, 5000), min_size=1, max_size=40, unique=True),
    st.integers(1, 6000),
    st.integers(1, 1500),
    st.data(),
)
def test_min_gap_selects_what_megatron_selects(saved, window, min_gap, data):
    """--min-gap thins a window (or the run, for --last) exactly as the peer's range mode does:
    from the merge step back; the merge step is always among them."""
    steps = sorted(saved)
    found = [Checkpoint(step, f"/run/step{step}", f"step{step}", "safetensors", True) for step in steps]
    merge_step = data.draw(st.sampled_from(steps))
    first = max(0, merge_step - window + 1)
    in_window = [s for s in steps if first <= s <= merge_step]
    chosen = select_checkpoints(found, merge_step=merge_step, window=window, min_gap=min_gap, allow_partial_window=True)
    assert [c.step for c in chosen] == megatron_min_interval(in_window, min_gap)
    assert chosen[-1].step == merge_step
    thinned = megatron_min_interval(steps, min_gap)
    last = data.draw(st.integers(1, len(thinned)))
    assert [c.step for c in select_checkpoints(found, last=last, min_gap=min_gap)] == thinned[-last:]


def test_min_gap_merges_the_thinned_window_and_says_why_not(run_dir):
    """Saves every 100 steps: ``--min-gap 300`` back from 1000 over a 700-step window averages 400,
    700 and 1000 (their float64 mean; the window is whole, so no warning); --steps refuses it."""
    saved = make_run(run_dir, list(range(100, 1001, 100)), {"w": (64,)})
    out = run_dir / "thinned"
    args = ["merge", str(run_dir), "--merge-step", "1000", "--window", "700", "--min-gap", "300", "--out", str(out)]
    done = run_cli_in_process(*args)
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr
    assert "merged 3 checkpoints (steps 400, 700, 1000" in done.stderr
    assert [s["step"] for s in json.loads((out / "ckptavg-manifest.json").read_text())["sources"]] == [400, 700, 1000]
    assert_equal(load_merged(out), reference(saved, [400, 700, 1000]))
    refused = run_cli_in_process("merge", str(run_dir), "--steps", "900,1000", "--min-gap", "300")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    assert "--min-gap thins a window or --last; --steps names the checkpoints itself" in refused.stderr
    with pytest.raises(
        ConfigError, match="--last 5 asks for more checkpoints than found at least 300 steps apart: 100, 400, 700, 1000"
    ):
        ckptavg.merge(str(run_dir), last=5, min_gap=300)


def test_same_step_twice_is_an_error(run_dir):
    write_checkpoint(run_dir / "step100", {"w": torch.zeros(2)})
    write_checkpoint(run_dir / "checkpoint-100", {"w": torch.zeros(2)})
    with pytest.raises(CkptavgError, match="step 100 is stored twice"):
        _found(run_dir)


def test_merge_writes_hf_layout_index_and_manifest(run_dir):
    saved = make_run(run_dir, [10, 20, 30, 40], SHAPES, shards=2)
    (run_dir / "step40" / "tokenizer.json").write_text("{}")
    (run_dir / "step40" / "optimizer.pt").write_bytes(b"x" * 10)
    result = ckptavg.merge(str(run_dir), merge_step=40, window=30, options=MergeOptions(shard_size=3000))
    out = run_dir / "step40-merged"
    assert result.output == str(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) >= 2
    assert shard_files == [
        f"model-{i:05d}-of-{len(shard_files):05d}.safetensors" for i in range(1, len(shard_files) + 1)
    ]
    assert index["metadata"]["total_size"] == sum(2 * torch.Size(s).numel() for s in SHAPES.values())
    for f in shard_files:
        assert (out / f).stat().st_size - 8 - struct.unpack("<Q", (out / f).read_bytes()[:8])[0] <= 3000
    merged = load_merged(out)
    mean = (
        saved[20]["lm_head.weight"].double()
        + saved[30]["lm_head.weight"].double()
        + saved[40]["lm_head.weight"].double()
    ) / 3
    assert torch.allclose(merged["lm_head.weight"].double(), mean, rtol=2**-8)
    # Non-weight files of the newest source come along; optimizer state does not.
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert not (out / "optimizer.pt").exists()
    manifest = json.loads((out / "ckptavg-manifest.json").read_text())
    assert [s["step"] for s in manifest["sources"]] == [20, 30, 40]
    assert all(abs(s["weight"] - 1 / 3) < 1e-12 for s in manifest["sources"])
    assert manifest["tensor_count"] == len(SHAPES)
    assert manifest["version"] == ckptavg.__version__
    for name, entry in manifest["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == entry["sha256"], name
    assert set(manifest["files"]) == {p.name for p in out.iterdir()} - {"ckptavg-manifest.json"}


def test_existing_output_needs_force(run_dir):
    make_run(run_dir, [1, 2], {"w": (8,)})
    ckptavg.merge(str(run_dir), last=2)
    with pytest.raises(CkptavgError, match="already exists; pass --force"):  # another merge (step 2 alone)
        ckptavg.merge(str(run_dir), last=1)
    ckptavg.merge(str(run_dir), last=1, options=MergeOptions(force=True))
    assert sorted(p.name for p in run_dir.iterdir()) == ["step1", "step2", "step2-merged"]


@pytest.mark.parametrize(
    ("out", "said"),
    [
        ("step2", "is the source checkpoint"),
        ("step1/../step2", "is the source checkpoint"),
        (".", "contains the source checkpoint"),
        ("step1/sub", "lies inside the source checkpoint"),
    ],
)
def test_average_refuses_an_output_over_its_sources(run_dir, out, said):
    """The library itself refuses (the command line is not the only caller), before anything
    is created, with ``force`` too."""
    make_run(run_dir, [1, 2], {"w": (8,)})
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    sources = [str(run_dir / "step1"), str(run_dir / "step2")]
    with pytest.raises(CkptavgError, match=said):
        ckptavg.average(sources, str(run_dir / out), options=MergeOptions(force=True))
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in run_dir.iterdir()) == ["step1", "step2"]


def test_each_error_says_its_kind(run_dir):
    """Every error is a CkptavgError; its subclass says what to fix: the call, a checkpoint, or
    the output."""
    make_run(run_dir, [1, 2], {"w": (8,)})
    with pytest.raises(ConfigError, match="no checkpoint in the window 5-6"):
        ckptavg.merge(str(run_dir), merge_step=6, window=2)
    ckptavg.merge(str(run_dir), last=2)
    with pytest.raises(OutputError, match="already exists; pass --force"):
        ckptavg.merge(str(run_dir), last=2, options=MergeOptions(dtype=torch.float32))
    (run_dir / "step2" / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        ckptavg.merge(str(run_dir), last=2, out=str(run_dir / "other"))
    assert issubclass(ConfigError, CkptavgError) and issubclass(CheckpointError, CkptavgError)
    assert issubclass(OutputError, CkptavgError)


def _no_output_left(run_dir: Path) -> None:
    assert not any(p.name.endswith("-merged") or p.name.startswith(".") for p in run_dir.iterdir())


def test_key_set_mismatch_names_key_and_files(run_dir):
    write_checkpoint(run_dir / "step1", {"a": torch.zeros(2), "b": torch.zeros(2)})
    write_checkpoint(run_dir / "step2", {"a": torch.zeros(2)})
    with pytest.raises(CkptavgError, match=r"tensor 'b' is in .*step1/model.safetensors but missing from .*step2"):
        ckptavg.merge(str(run_dir), last=2)
    _no_output_left(run_dir)


def test_shape_and_dtype_mismatch_name_both_files(run_dir):
    write_checkpoint(run_dir / "step1", {"a": torch.zeros(2, 3)})
    write_checkpoint(run_dir / "step2", {"a": torch.zeros(3, 2)})
    with pytest.raises(CkptavgError, match=r"'a' has shape \[2, 3\] in .*step1.* but \[3, 2\] in .*step2"):
        ckptavg.merge(str(run_dir), last=2)
    write_checkpoint(run_dir / "step2", {"a": torch.zeros(2, 3, dtype=torch.float16)})
    with pytest.raises(CkptavgError, match=r"'a' is torch.float32 in .*step1.* but torch.float16 in .*step2"):
        ckptavg.merge(str(run_dir), last=2)
    _no_output_left(run_dir)


def test_index_paths_are_not_trusted(run_dir):
    make_run(run_dir, [1, 2], {"w": (8,)}, shards=1)
    folder = run_dir / "step2"
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    for evil in ["../step1/model.safetensors", "/etc/passwd", "sub/x.safetensors"]:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": evil}}))
        with pytest.raises(CkptavgError, match="refusing file name"):
            ckptavg.merge(str(run_dir), last=2)
    _no_output_left(run_dir)


def test_truncated_file_is_named(run_dir):
    make_run(run_dir, [1, 2], {"w": (1000,)})
    path = run_dir / "step2" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CkptavgError, match=r"step2/model.safetensors: tensor 'w' lies outside the file"):
        ckptavg.merge(str(run_dir), last=2)
    path.write_bytes(b"\xff" * 16)
    with pytest.raises(CkptavgError, match=r"step2/model.safetensors: corrupt safetensors header"):
        ckptavg.merge(str(run_dir), last=2)
    _no_output_left(run_dir)


def test_failure_during_write_leaves_nothing(run_dir, monkeypatch):
    make_run(run_dir, [1, 2], {"a": (1000,), "b": (1000,)})
    from ckptavg.formats.writers import safetensors as safetensors_writer

    def failing_write(self, data):
        raise CkptavgError(f"cannot write {self.shown_path}: No space left on device")

    monkeypatch.setattr(safetensors_writer.SafetensorsFileWriter, "write", failing_write)
    with pytest.raises(CkptavgError, match="No space left on device"):
        ckptavg.merge(str(run_dir), last=2)
    _no_output_left(run_dir)


def test_memory_filesystem_round_trip(tmp_path):
    """fsspec URLs work end to end (here the in-memory filesystem)."""
    import fsspec

    saved = make_run(tmp_path, [1, 2], {"w": (100,)})
    fs = fsspec.filesystem("memory")
    for step in (1, 2):
        for f in (tmp_path / f"step{step}").iterdir():
            fs.pipe(f"/run/step{step}/{f.name}", f.read_bytes())
    result = ckptavg.merge("memory://run", last=2)
    assert result.output == "memory:///run/step2-merged"
    from safetensors.torch import load

    merged = load(fs.cat("/run/step2-merged/model-00001-of-00001.safetensors"))
    mean = (saved[1]["w"].double() + saved[2]["w"].double()) / 2
    assert torch.allclose(merged["w"].double(), mean, rtol=2**-8)


def _raw_safetensors(path: Path, header: bytes, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]', "corrupt safetensors header"),
        (
            json.dumps(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                }
            ).encode(),
            "tensors 'a' and 'b' overlap",
        ),
    ],
)
def test_malformed_or_overlapping_headers_are_refused(run_dir, header, message):
    _raw_safetensors(run_dir / "step1" / "model.safetensors", header, bytes(16))
    with pytest.raises(CkptavgError, match=message) as caught:
        ckptavg.merge(str(run_dir), last=1)
    assert "model.safetensors" in str(caught.value)
    assert not (run_dir / "step1-merged").exists()


@pytest.mark.parametrize("at", ["start", "end", "inside"])
def test_an_empty_tensor_overlaps_nothing(tmp_path, at):
    """A tensor of no elements holds no bytes, wherever its offsets point. The safetensors
    library writes one at the running offset, which is where the next tensor starts."""
    empty = {"start": [0, 0], "end": [16, 16], "inside": [8, 8]}[at]
    header = {
        "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},  # first: sorted by start alone, it came first
        "e": {"dtype": "F32", "shape": [0], "data_offsets": empty},
    }
    values = torch.arange(4, dtype=torch.float32)
    for step in (1, 2):
        _raw_safetensors(
            tmp_path / "run" / f"step{step}" / "model.safetensors",
            json.dumps(header).encode(),
            (values * step).numpy().tobytes(),
        )
    ckptavg.merge(str(tmp_path / "run"), last=2, options=MergeOptions(dtype=torch.float32))
    merged = load_merged(tmp_path / "run" / "step2-merged")
    assert torch.equal(merged["w"], values * 1.5) and merged["e"].shape == (0,)
