"""Several weightings of the same windows in one hook: each published as ``step{S}-merged-<tag>``,
byte-identical to the output of a hook with that weighting alone, from one capture per step, and
across a resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem
from helpers import files_of
from training import Run

from ckptavg import CkptavgError, MergeHookConfig, Weighting
from ckptavg.merging.discovery import find_checkpoints

# Windows 6-14 and 12-20, every 2nd step: they overlap (12 and 14 are in both).
OPTIONS = {"merge_steps": [14, 20], "window": 9, "every": 2}
EMA = Weighting("ema", ema_halflife=3)
TWO = ["uniform", EMA]
THREE = [*TWO, Weighting("minus-sqrt")]


def _trained(folder: Path, options: dict, last: int = 22) -> Run:
    run = Run(folder, options)
    run.hook.pre_train(0)
    run.train(range(1, last + 1))
    run.hook.close()
    return run


def _output(folder: Path, root: Path) -> dict[str, object]:
    """Every file of a merged output; in the manifest, the sources' paths relative to ``root``
    (a snapshot merge names its snapshots, which lie in another run's folder), and no fingerprint
    (a digest of the manifest, those paths included)."""
    files: dict[str, object] = files_of(folder, "")
    manifest = json.loads(files.pop("ckptavg-manifest.json"))
    del manifest["fingerprint"]
    for source in manifest["sources"]:
        if source["path"] is not None:
            source["path"] = str(Path(source["path"]).relative_to(root))
    return {**files, "ckptavg-manifest.json": manifest}


def _single_outputs(root: Path, options: dict, weightings: list) -> dict[tuple[int, str], dict[str, object]]:
    """(merge step, tag) -> the output of a hook run with that weighting alone."""
    outputs = {}
    for weighting in weightings:
        tag = weighting if isinstance(weighting, str) else weighting.tag()
        _trained(root / tag, {**options, "weighting": weighting})
        for merge_step in options["merge_steps"]:
            outputs[merge_step, tag] = _output(root / tag / f"step{merge_step}-merged", root / tag)
    return outputs


def _tags(weightings: list) -> list[str]:
    return [w if isinstance(w, str) else w.tag() for w in weightings]


@pytest.mark.parametrize("weightings", [TWO, THREE], ids=["two", "three"])
def test_each_weighting_is_byte_identical_to_its_own_hook(tmp_path, weightings):
    """Accumulate mode, overlapping windows: one running sum per weighting per window, each output
    (manifest included) the bytes that hook with that weighting alone writes; on_merged once per
    output, in the weightings' order."""
    expected = _single_outputs(tmp_path / "single", OPTIONS, weightings)
    folder = tmp_path / "several"
    run = _trained(folder, {**OPTIONS, "weighting": weightings})
    tags = _tags(weightings)
    assert run.merged == [(str(folder / f"step{s}-merged-{tag}"), s) for s in (14, 20) for tag in tags]
    assert not (folder / "step14-merged").exists()
    for (merge_step, tag), files in expected.items():
        assert _output(folder / f"step{merge_step}-merged-{tag}", folder) == files, (merge_step, tag)
    assert len({frozenset(files_of(folder / f"step20-merged-{tag}").items()) for tag in tags}) == len(tags)
    listed = [c for c in find_checkpoints(LocalFileSystem(), str(folder)) if c.merged]
    assert sorted(c.name for c in listed) == sorted(f"step{s}-merged-{tag}" for s in (14, 20) for tag in tags)


@pytest.mark.parametrize("resume_at", [9, 13, 16])
def test_a_resume_mid_window_gives_every_weighting_the_same_bytes(tmp_path, resume_at):
    """Checkpoint at ``resume_at`` (inside window 14; inside both; inside window 20 only), a lost
    timeline, then a fresh hook from the checkpoint: every weighting's outputs equal an
    uninterrupted run's."""
    options = {**OPTIONS, "weighting": TWO}
    straight = tmp_path / "straight"
    _trained(straight, options)
    folder = tmp_path / "resumed"
    first = Run(folder, options)
    first.hook.pre_train(0)
    first.train(range(1, resume_at + 1))
    checkpoint = first.checkpoint()
    assert checkpoint["hook"]["weighting"] == [{"scheme": "uniform"}, EMA.describe()]
    first.train(range(resume_at + 1, resume_at + 4), seed=1)  # the lost timeline
    first.hook.close()
    second = Run.resumed(folder, options, checkpoint, resume_at)
    second.train(range(resume_at + 1, 23))
    second.hook.close()
    for name in [f"step{s}-merged-{tag}" for s in (14, 20) for tag in _tags(TWO)]:
        assert files_of(folder / name, "") == files_of(straight / name, ""), name
    assert [s for _, s in second.merged] == ([14, 14] if resume_at < 14 else []) + [20, 20]


@pytest.mark.parametrize("keep_snapshots", [True, False])
def test_snapshot_mode_merges_the_snapshots_once_per_weighting(tmp_path, keep_snapshots):
    """Each output equals a snapshot hook's with that weighting alone (its manifest's sources
    aside from their folder); without keep_snapshots the snapshots go only once every weighting's
    output of the merges averaging them is verified."""
    options = {**OPTIONS, "mode": "snapshot"}
    expected = _single_outputs(tmp_path / "single", options, TWO)
    folder = tmp_path / "several"
    run = Run(folder, {**options, "weighting": TWO, "keep_snapshots": keep_snapshots})
    run.hook.pre_train(0)
    run.train(range(1, 23))
    run.checkpoint()
    run.hook.close()
    assert [s for _, s in run.merged] == [14, 14, 20, 20]
    for (merge_step, tag), files in expected.items():
        assert _output(folder / f"step{merge_step}-merged-{tag}", folder) == files, (merge_step, tag)
    assert bool(list(folder.glob("*-snapshot"))) == keep_snapshots


def test_a_resume_with_another_set_of_weightings_is_refused(tmp_path):
    options = {**OPTIONS, "weighting": TWO}
    first = Run(tmp_path, options)
    first.hook.pre_train(0)
    first.train(range(1, 14))
    checkpoint = first.checkpoint()
    first.hook.close()
    for other in (["uniform"], ["uniform", Weighting("ema", ema_halflife=4)], [*TWO, "wma"]):
        with pytest.raises(
            CkptavgError, match=r"open windows are weighted \[\{'scheme': 'uniform'\}, .*this hook weighs"
        ):
            Run.resumed(tmp_path, {**options, "weighting": other}, checkpoint, 13)
    reordered = Run.resumed(tmp_path, {**options, "weighting": TWO[::-1]}, checkpoint, 13)  # the same set
    reordered.hook.close()


def test_a_resume_missing_one_weightings_sums_is_refused(tmp_path):
    """The sums of every weighting come back, or none: one weighting's gone refuses the resume."""
    options = {**OPTIONS, "weighting": TWO}
    first = Run(tmp_path, options)
    first.hook.pre_train(0)
    first.train(range(1, 14))
    checkpoint = first.checkpoint()
    first.hook.close()
    state = tmp_path / ".ckptavg-state" / "step13"
    assert sorted(p.name for p in state.iterdir()) == sorted(f"merge{s}-{t}" for s in (14, 20) for t in _tags(TWO))
    shutil.rmtree(state / "merge20-ema3")
    resumed = Run.resumed(tmp_path, options, checkpoint, 13)
    with pytest.raises(CkptavgError, match=r"inside the window of merge step 20 .*missing from .*merge20-uniform, .*"):
        resumed.train([14])
    resumed.hook.close()


@pytest.mark.parametrize(
    ("weighting", "message"),
    [
        (["uniform", "uniform"], "two weightings have the tag 'uniform'"),
        (
            [Weighting("ema", ema_halflife=20), Weighting("ema", ema_halflife=20.0)],
            "two weightings have the tag 'ema20'",
        ),
        (["wma", Weighting("explicit", explicit=(1, 2)), Weighting("explicit", explicit=(2, 1))], "tag 'explicit'"),
        ([], "weighting needs at least one scheme"),
    ],
)
def test_weightings_whose_outputs_would_share_a_name_are_refused(tmp_path, weighting, message):
    with pytest.raises(CkptavgError, match=message):
        MergeHookConfig(save_folder=str(tmp_path), merge_steps=[20], weighting=weighting)


def test_tags_name_the_scheme_and_its_parameter():
    assert [
        w.tag()
        for w in (
            Weighting(),
            Weighting("ema", ema_halflife=20.0),
            Weighting("ema", ema_halflife=0.5),
            Weighting("ema", ema_alpha=0.1),
            Weighting("wma"),
            Weighting("minus-sqrt"),
            Weighting("explicit", explicit=(1, 2)),
        )
    ] == ["uniform", "ema20", "ema0.5", "ema-alpha0.1", "wma", "minus-sqrt", "explicit"]


def test_one_weighting_in_a_list_keeps_the_single_name(tmp_path):
    run = _trained(tmp_path, {**OPTIONS, "weighting": [EMA]}, last=14)
    assert run.merged == [(str(tmp_path / "step14-merged"), 14)]
