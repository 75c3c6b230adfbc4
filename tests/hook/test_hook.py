"""The training hook: exact merges in both modes, resume bit-identity, background failures, release."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest
import torch
from helpers import files_of, run_cli, stat_tree
from references import correctly_rounded, load_merged, same_bits
from training import (
    Run,
    RunningMean,
    assert_exact,
    expected_mean,
    make_model,
    store_reads_wait_for_the_optimizer,
    train_step,
)

import ckptavg
from ckptavg import CkptavgError, MergeHook, MergeHookConfig
from ckptavg.io.fs import resolve

MODES = ["accumulate", "snapshot"]


# -- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"merge_steps": [100], "mode": "median"}, "mode must be one of accumulate, snapshot, ema, blocks, got 'med"),
        ({"merge_steps": [100], "every": 0}, "every .* must be at least 1, got 0"),
        ({"merge_steps": [100], "window": 0}, "window must be at least 1 step, got 0"),
        ({}, "give exactly one of merge_steps or merge_interval"),
        ({"merge_steps": [100], "merge_interval": 50}, "give exactly one of merge_steps or merge_interval"),
        ({"merge_steps": [100], "dtype": "int8"}, "unknown dtype 'int8'"),
        ({"merge_steps": [100], "release": "never"}, "release must be one of optimizer, copy, got 'never'"),
        ({"merge_steps": [100], "keep_snapshots": False}, "keep_snapshots=False needs mode='snapshot'; mode 'accum"),
        (
            {"merge_steps": [100], "mode": "snapshot", "keep_snapshots": False, "fsync": False},
            "keep_snapshots=False needs fsync=True",
        ),
        ({"merge_steps": [100], "output_format": "gguf"}, "output_format must be one of .*, got 'gguf'"),
        ({"mode": "blocks", "block": 10, "output_format": "dcp"}, "output_format='dcp' is for merges; mode='blocks'"),
    ],
)
def test_config_errors_name_the_value(tmp_path, options, message):
    with pytest.raises(CkptavgError, match=message):
        MergeHookConfig(save_folder=str(tmp_path), **options)


def test_window_arithmetic_errors_are_the_plans(tmp_path):
    hook = MergeHook(MergeHookConfig(save_folder=str(tmp_path), merge_steps=[50, 200], window=100))
    with pytest.raises(CkptavgError, match="merge step 50 is smaller than the window of 100 steps"):
        hook.pre_train(0)
    hook.close()
    hook = MergeHook(MergeHookConfig(save_folder=str(tmp_path), merge_interval=100, window=10))
    with pytest.raises(CkptavgError, match="merge_interval needs max_steps"):
        hook.pre_train(0)
    hook.pre_train(0, max_steps=350)
    assert hook.merge_steps == [100, 200, 300]
    hook.close()


# -- numerics -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_overlapping_windows_with_stride_are_exact(tmp_path, mode):
    """bf16 parameters: the merge is the correctly rounded float64 mean, bit for bit; the two
    windows overlap (steps 12-14) and share their captures."""
    options = {"merge_steps": [14, 20], "window": 9, "every": 2, "mode": mode}
    run = Run(tmp_path, options)
    run.hook.pre_train(0)
    run.train(range(1, 23))
    run.hook.close()
    assert run.merged == [(str(tmp_path / "step14-merged"), 14), (str(tmp_path / "step20-merged"), 20)]
    for merge_step in (14, 20):
        assert_exact(tmp_path / f"step{merge_step}-merged", expected_mean(run, merge_step, 9, 2, torch.bfloat16))
    manifest = json.loads((tmp_path / "step20-merged" / "ckptavg-manifest.json").read_text())
    assert [s["step"] for s in manifest["sources"]] == [12, 14, 16, 18, 20]
    if mode == "snapshot":
        assert sorted(p.name for p in tmp_path.glob("*-snapshot")) == sorted(
            f"step{s}-snapshot" for s in {6, 8, 10, 12, 14, 16, 18, 20}
        )
    else:
        assert not list(tmp_path.glob("*-snapshot"))


def test_fp32_parameters_in_fp64_are_exact_and_fp32_sums_close(tmp_path):
    options = {"merge_steps": [12], "window": 12, "float64_accumulator": True}
    run = Run(tmp_path / "fp64", options, dtype=torch.float32)
    run.hook.pre_train(0)
    run.train(range(1, 13))
    run.hook.close()
    expected = expected_mean(run, 12, 12, 1, torch.float32)
    assert_exact(tmp_path / "fp64" / "step12-merged", expected)
    run = Run(tmp_path / "fp32", {"merge_steps": [12], "window": 12}, dtype=torch.float32)
    run.hook.pre_train(0)
    run.train(range(1, 13))
    run.hook.close()
    merged = load_merged(tmp_path / "fp32" / "step12-merged")
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=4e-7, atol=1e-7)


@pytest.mark.parametrize("mode", MODES)
def test_output_dtype_and_extra_files(tmp_path, mode):
    options = {"merge_steps": [6], "window": 4, "mode": mode, "dtype": "fp32", "extra_files": {"config.json": b"{}"}}
    run = Run(tmp_path, options)
    run.hook.pre_train(0)
    run.train(range(1, 7))
    run.hook.close()
    assert_exact(tmp_path / "step6-merged", expected_mean(run, 6, 4, 1, torch.float32))
    assert (tmp_path / "step6-merged" / "config.json").read_bytes() == b"{}"


def test_snapshots_are_what_ckptavg_merge_reads(tmp_path):
    """`ckptavg merge save_folder --merge-step S` discovers the hook's snapshots and writes the
    same bytes as the hook; `ckptavg ls` shows them."""
    run = Run(tmp_path / "run", {"merge_steps": [10], "window": 5, "mode": "snapshot"})
    run.hook.pre_train(0)
    run.train(range(1, 11))
    run.hook.close()
    out = tmp_path / "offline"
    result = run_cli("merge", str(tmp_path / "run"), "--merge-step", "10", "--window", "5", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert files_of(out) == files_of(tmp_path / "run" / "step10-merged")
    listing = run_cli("ls", str(tmp_path / "run"), "--json")
    rows = json.loads(listing.stdout)
    assert [(r["step"], r["format"], r["status"]) for r in rows if r["name"].endswith("-snapshot")] == [
        (s, "snapshot", "complete") for s in range(6, 11)
    ]


def test_a_snapshot_is_preferred_to_a_checkpoint_of_the_same_step(tmp_path):
    from helpers import write_checkpoint

    run = Run(tmp_path, {"merge_steps": [4], "window": 2, "mode": "snapshot"})
    run.hook.pre_train(0)
    run.train(range(1, 5))
    run.hook.close()
    write_checkpoint(tmp_path / "step4", {k: torch.zeros_like(v) for k, v in run.model.state_dict().items()})
    selection = ckptavg.select(str(tmp_path), merge_step=4, window=2)
    assert [c.name for c in selection.checkpoints] == ["step3-snapshot", "step4-snapshot"]


def test_integer_tensors_are_copied_and_must_not_change(tmp_path):
    model = make_model()
    model.register_buffer("counter", torch.tensor([7, 8], dtype=torch.int64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = MergeHook(MergeHookConfig(save_folder=str(tmp_path), merge_steps=[4], window=3))
    hook.pre_train(0)
    for step in range(1, 5):
        train_step(model, optimizer, step)
        hook.post_train_batch(step, model)
    hook.close()
    assert torch.equal(load_merged(tmp_path / "step4-merged")["counter"], torch.tensor([7, 8]))
    hook = MergeHook(MergeHookConfig(save_folder=str(tmp_path / "b"), merge_steps=[4], window=3))
    hook.pre_train(0)
    message = "torch.int64 tensor 'counter' changed at step 3, inside the window of merge step 4"
    with pytest.raises(CkptavgError, match=message):  # at the call after step 3's, or at close
        for step in range(1, 5):
            model.counter += 1
            train_step(model, optimizer, step)
            hook.post_train_batch(step, model)
        hook.close()
    with pytest.raises(CkptavgError, match=message):
        hook.close()
    assert not (tmp_path / "b" / "step4-merged").exists()


# -- resume ---------------------------------------------------------------------------------

RESUME_OPTIONS = {"merge_steps": [10, 16], "window": 8, "every": 1}  # windows 3-10 and 9-16 overlap


def _straight_run(folder: Path, options: dict) -> Run:
    run = Run(folder, options)
    run.hook.pre_train(0)
    run.train(range(1, 19))
    run.hook.close()
    return run


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("resume_at", [2, 3, 6, 9, 10, 11, 16])
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, mode, resume_at):
    """Checkpoint at ``resume_at``, train on along a different timeline (other data) for four
    steps, then resume from the checkpoint: the merges equal those of a run never interrupted,
    so nothing of the lost timeline is mixed in. Points: before, at the start of, inside, inside
    both, at the merge step of, just after, and at the end of the windows."""
    options = {**RESUME_OPTIONS, "mode": mode}
    straight = _straight_run(tmp_path / "straight", options)

    folder = tmp_path / "resumed"
    first = Run(folder, options)
    first.hook.pre_train(0)
    first.train(range(1, resume_at + 1))
    checkpoint = first.checkpoint()
    json.dumps(checkpoint["hook"])  # the hook state is small and JSON-serialisable
    first.train(range(resume_at + 1, resume_at + 5), seed=1)  # the lost timeline
    first.hook.close()

    if mode == "snapshot":  # a write that a kill cut short leaves a temporary file
        (folder / f"step{resume_at + 2}-snapshot").mkdir(exist_ok=True)
        (folder / f"step{resume_at + 2}-snapshot" / ".rank00000-of-00001.safetensors.tmp-0a1b2c3d").write_bytes(b"x")
    second = Run.resumed(folder, options, checkpoint, resume_at)
    second.train([resume_at + 1])
    second.hook.state_dict()  # drains the capture
    complete = [c.step for c in ckptavg.find_checkpoints(*resolve(str(folder))) if c.snapshot and c.complete]
    assert max(complete, default=0) <= resume_at + 1, "snapshots of the lost timeline are still there"
    second.train(range(resume_at + 2, 19))
    second.hook.close()
    for merge_step in (10, 16):
        assert files_of(folder / f"step{merge_step}-merged") == files_of(
            tmp_path / "straight" / f"step{merge_step}-merged"
        )
    assert_exact(folder / "step16-merged", expected_mean(straight, 16, 8, 1, torch.bfloat16))
    if mode == "snapshot":
        assert sorted(p.name for p in folder.glob("*-snapshot")) == sorted(
            p.name for p in (tmp_path / "straight").glob("*-snapshot")
        )
        for snapshot in (tmp_path / "straight").glob("*-snapshot"):
            assert files_of(folder / snapshot.name, "") == files_of(snapshot, "") != {}


@pytest.mark.parametrize("mode", MODES)
def test_a_resume_that_merges_again_to_the_same_bytes_keeps_the_published_output(tmp_path, mode, caplog):
    """A requeued run resumes inside a window whose merge the lost timeline published, and
    trains those steps again on the same data: the merge comes out byte for byte the same, so the
    published output stays as it was (not replaced; one log line). With other data it is
    replaced: test_resume_is_bit_identical_to_an_uninterrupted_run."""
    options = {**RESUME_OPTIONS, "mode": mode}
    first = Run(tmp_path, options)
    first.hook.pre_train(0)
    first.train(range(1, 7))
    checkpoint = first.checkpoint()
    first.train(range(7, 13))  # the lost timeline, on the same data: it publishes merge 10
    first.hook.close()
    before = stat_tree(tmp_path / "step10-merged")
    resumed = Run.resumed(tmp_path, options, checkpoint, 6)
    with caplog.at_level(logging.INFO, logger="ckptavg"):
        resumed.train(range(7, 19))
        resumed.hook.close()
    assert stat_tree(tmp_path / "step10-merged") == before
    kept = [r.getMessage() for r in caplog.records if "already merged" in r.getMessage()]
    assert kept == [
        f"ckptavg: {tmp_path / 'step10-merged'}: already merged, and merged again to the same bytes: kept as it was"
    ]
    assert [s for _, s in resumed.merged] == [10, 16]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".step")]  # no hidden folder left


def test_resume_in_a_window_without_state_is_refused_not_skipped(tmp_path):
    options = {**RESUME_OPTIONS}
    first = Run(tmp_path, options)
    first.hook.pre_train(0)
    first.train(range(1, 6))
    checkpoint = first.checkpoint()
    first.hook.close()
    del checkpoint["hook"]
    second = Run(tmp_path, options)
    second.model.load_state_dict(checkpoint["model"])
    second.hook.pre_train(5)
    with pytest.raises(CkptavgError, match=r"resumes after step 5, inside the window of merge step 10 \(steps 3-10\)"):
        second.train([6])
    second.hook.close()


def test_state_files_stay_until_a_checkpoint_after_the_merge(tmp_path, caplog):
    """After a checkpoint past a merge its saved sums go; a resume from an older checkpoint
    inside that window then keeps the written merge (and says so)."""
    run = Run(tmp_path, RESUME_OPTIONS)
    run.hook.pre_train(0)
    run.train(range(1, 6))
    early = run.checkpoint()
    run.train(range(6, 12))
    state_root = tmp_path / ".ckptavg-state"
    assert (state_root / "step5" / "merge10").is_dir()  # merge 10 is written, no checkpoint since
    run.checkpoint()
    assert not list(state_root.glob("*/merge10"))
    run.train(range(12, 19))
    run.hook.close()
    before = files_of(tmp_path / "step10-merged")
    resumed = Run.resumed(tmp_path, RESUME_OPTIONS, early, 5)
    with caplog.at_level(logging.WARNING, logger="ckptavg"):
        resumed.train(range(6, 19))
    resumed.hook.close()
    assert "inside the window of merge step 10, which is already written" in caplog.text
    assert files_of(tmp_path / "step10-merged") == before
    assert [s for _, s in resumed.merged] == [16]


def test_corrupt_saved_sums_are_detected(tmp_path):
    run = Run(tmp_path, RESUME_OPTIONS)
    run.hook.pre_train(0)
    run.train(range(1, 6))
    checkpoint = run.checkpoint()
    run.hook.close()
    (part,) = (tmp_path / ".ckptavg-state" / "step5" / "merge10").glob("*.safetensors")
    data = bytearray(part.read_bytes())
    data[-3] ^= 0x40
    part.write_bytes(bytes(data))
    resumed = Run.resumed(tmp_path, RESUME_OPTIONS, checkpoint, 5)
    with pytest.raises(CkptavgError, match=r"rank00000-of-00001.safetensors is corrupt: its sha256 differs"):
        resumed.train([6])
    resumed.hook.close()


def test_a_state_from_another_step_is_refused(tmp_path):
    run = Run(tmp_path, RESUME_OPTIONS)
    run.hook.pre_train(0)
    run.train(range(1, 6))
    checkpoint = run.checkpoint()
    run.hook.close()
    resumed = Run(tmp_path, RESUME_OPTIONS)
    resumed.hook.load_state_dict(checkpoint["hook"])
    resumed.hook.pre_train(7)
    with pytest.raises(CkptavgError, match="the hook state is from step 5 but training resumes after step 7"):
        resumed.train([8])
    resumed.hook.close()


# What a resume reads of the state, each of another JSON type than state_dict() writes (the
# transformers adapter reads the state back from a JSON file).
DAMAGED_STATES = {
    "windows-an-object": lambda state: state.update(windows={"10": state["windows"]}),
    "a-window-a-list": lambda state: state["windows"].__setitem__(0, [10, [3, 4, 5]]),
    "merge-step-a-string": lambda state: state["windows"][0].update(merge_step="10"),
    "steps-a-number": lambda state: state["windows"][0].update(steps=5),
    "step-a-bool": lambda state: state.update(step=True),
}


@pytest.mark.parametrize("damage", DAMAGED_STATES.values(), ids=DAMAGED_STATES)
def test_a_hook_state_of_other_types_is_refused_when_loaded(tmp_path, damage):
    run = Run(tmp_path, RESUME_OPTIONS)
    run.hook.pre_train(0)
    run.train(range(1, 6))
    state = json.loads(json.dumps(run.checkpoint()["hook"]))
    run.hook.close()
    damage(state)
    resumed = Run(tmp_path, RESUME_OPTIONS)
    with pytest.raises(CkptavgError, match="not a MergeHook state: step .*, windows .* are not what state_dict"):
        resumed.hook.load_state_dict(state)
    resumed.hook.close()


# -- the loop's contract --------------------------------------------------------------------


def test_a_skipped_step_in_a_window_is_an_error(tmp_path):
    run = Run(tmp_path, RESUME_OPTIONS)
    run.hook.pre_train(0)
    run.train(range(1, 5))
    with pytest.raises(CkptavgError, match="post_train_batch was not called for step 5, which the merge at step 10"):
        run.train([6])
    with pytest.raises(CkptavgError, match="steps must increase"):
        run.hook.post_train_batch(4, run.model)
    run.hook.close()


def test_weights_are_read_before_the_next_optimizer_step_changes_them(tmp_path):
    """A background read that comes only once the next optimizer step has begun still sees its
    step's weights: that step waits for it instead of changing the weights underneath."""
    with store_reads_wait_for_the_optimizer("begun"):
        run = Run(tmp_path, {"merge_steps": [4], "window": 4})
        run.model.insert(1, RunningMean(24))  # a buffer that changes in the forward pass, like BatchNorm's
        run.hook.pre_train(0)
        run.train(range(1, 5))
        run.hook.close()
    expected = expected_mean(run, 4, 4, 1, torch.bfloat16)
    assert "1.mean" in expected
    assert_exact(tmp_path / "step4-merged", expected)


def manual_sgd(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.99)


def test_a_loop_without_optimizer_needs_release_copy(tmp_path):
    model = make_model()
    hook = MergeHook(MergeHookConfig(save_folder=str(tmp_path / "a"), merge_steps=[4], window=4))
    hook.pre_train(0)
    manual_sgd(model)
    hook.post_train_batch(1, model)
    manual_sgd(model)
    with pytest.raises(CkptavgError, match="no torch.optim optimizer step ran .* needs release='copy'"):
        hook.post_train_batch(2, model)
    hook.close()


@pytest.mark.parametrize("mode", MODES)
def test_release_copy_captures_each_step(tmp_path, mode):
    """Weights changed by hand right after each call: the copies (two host buffer sets in
    rotation) still hold each step's values."""
    model = make_model()
    config = MergeHookConfig(save_folder=str(tmp_path), merge_steps=[6], window=6, release="copy", mode=mode)
    hook = MergeHook(config)
    hook.pre_train(0)
    seen = []
    for step in range(1, 7):
        manual_sgd(model)
        hook.post_train_batch(step, model)
        seen.append({k: v.double() for k, v in model.state_dict().items()})
    hook.close()
    merged = load_merged(tmp_path / "step6-merged")
    for name, tensor in merged.items():
        assert bool(same_bits(tensor, correctly_rounded(sum(s[name] for s in seen) / 6, torch.bfloat16)).all())


def test_background_failures_surface_at_the_next_call_and_stick(tmp_path, monkeypatch):
    from ckptavg.formats import parts

    def disk_full(*args, **kwargs):
        raise CkptavgError("cannot write snapshot: No space left on device")

    monkeypatch.setattr("ckptavg.hook.stores.write_rank_file", disk_full)
    run = Run(tmp_path, {"merge_steps": [6], "window": 4, "mode": "snapshot"})
    run.hook.pre_train(0)
    run.train(range(1, 4))
    run.hook._captures._jobs.join()  # the failed write of step 3 has happened
    with pytest.raises(CkptavgError, match="No space left on device"):
        run.train([4])
    with pytest.raises(CkptavgError, match="No space left on device"):
        run.hook.state_dict()
    with pytest.raises(CkptavgError, match="No space left on device"):
        run.hook.close()
    assert parts.write_rank_file is not disk_full  # the store's reference was patched, not the module's


def test_on_merged_runs_in_the_training_thread(tmp_path):
    threads = []
    hook = MergeHook(
        MergeHookConfig(
            save_folder=str(tmp_path),
            merge_steps=[3],
            window=2,
            on_merged=lambda path, step: threads.append((threading.current_thread(), Path(path).name, step)),
        )
    )
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hook.pre_train(0)
    for step in range(1, 4):
        train_step(model, optimizer, step)
        hook.post_train_batch(step, model)
    hook.close()
    assert threads == [(threading.main_thread(), "step3-merged", 3)]


@pytest.mark.parametrize("mode", MODES)
def test_the_hook_leaves_training_threads_alone(tmp_path, mode):
    """torch's intra-op thread count is process-wide: neither the background sums nor the
    merge published from a background thread may change the training loop's."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        run = Run(tmp_path, {"merge_steps": [4], "window": 3, "mode": mode})
        run.hook.pre_train(0)
        run.train(range(1, 6))
        run.hook.close()
        assert run.merged and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fsync", [True, False], ids=["fsync", "no-fsync"])
@pytest.mark.parametrize("mode", MODES)
def test_hook_outputs_are_fsynced_in_the_background_only(tmp_path, monkeypatch, mode, fsync):
    """What the hook publishes is as durable as a ``ckptavg merge`` (every merged file, saved
    sums and snapshots reach the disk before they count); the fsyncs run in the hook's workers,
    never in the training thread; ``fsync=False`` makes none."""
    calls: list[tuple[str, str]] = []
    real_fsync = os.fsync

    def fsync_recorded(fd: int) -> None:
        calls.append((threading.current_thread().name, os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_recorded)
    run = Run(tmp_path, {"merge_steps": [4], "window": 3, "mode": mode, "fsync": fsync})
    run.hook.pre_train(0)
    run.train(range(1, 4))
    run.hook.state_dict()  # accumulate mode: saved sums
    run.train([4])
    run.hook.close()
    monkeypatch.undo()
    assert run.merged
    if not fsync:
        assert calls == []
        return
    assert calls and all(thread != threading.main_thread().name for thread, _ in calls), calls
    synced = {Path(path).name for _, path in calls}
    assert {p.name for p in (tmp_path / "step4-merged").iterdir()} <= synced
    state = "-snapshot/" if mode == "snapshot" else "/.ckptavg-state/"
    assert any(state in path and ".safetensors.tmp-" in path for _, path in calls), calls  # rank files
