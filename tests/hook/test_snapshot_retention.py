"""Snapshot mode with ``keep_snapshots=False``: a snapshot goes once every merge averaging it is
published, verified and behind a trainer checkpoint; shared snapshots wait for the last window
that averages them; a resume across the removal still writes the same bytes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from helpers import files_of
from training import Run

from ckptavg import OutputError

# Windows 3-10 and 9-16 overlap: steps 9 and 10 are averaged by both merges.
OPTIONS = {"merge_steps": [10, 16], "window": 8, "mode": "snapshot", "keep_snapshots": False}


def snapshot_steps(folder: Path) -> list[int]:
    return sorted(int(p.name[len("step") : -len("-snapshot")]) for p in folder.glob("step*-snapshot"))


def straight_merges(folder: Path) -> dict[int, dict[str, bytes]]:
    """The merges of an uninterrupted run that keeps its snapshots."""
    run = Run(folder, {**OPTIONS, "keep_snapshots": True})
    run.hook.pre_train(0)
    run.train(range(1, 19))
    run.hook.close()
    return {s: files_of(folder / f"step{s}-merged") for s in (10, 16)}


def test_shared_snapshots_stay_until_the_last_window_using_them_is_published(tmp_path):
    expected = straight_merges(tmp_path / "straight")
    folder = tmp_path / "run"
    run = Run(folder, OPTIONS)
    run.hook.pre_train(0)
    run.train(range(1, 13))
    run.hook._captures.drain()
    run.hook._publishes.drain()  # merge 10 is written and verified, but no checkpoint is behind it yet
    assert (folder / "step10-merged" / "ckptavg-manifest.json").is_file()
    assert snapshot_steps(folder) == list(range(3, 13))
    run.checkpoint()
    assert snapshot_steps(folder) == list(range(9, 13)), "only merge 10's own snapshots go; 9 and 10 are merge 16's"
    run.train(range(13, 19))
    run.checkpoint()
    run.hook.close()
    assert snapshot_steps(folder) == []
    assert {s: files_of(folder / f"step{s}-merged") for s in (10, 16)} == expected


@pytest.mark.parametrize("resume_at", [5, 9, 12])
def test_a_resume_across_the_removal_writes_the_same_merges(tmp_path, resume_at, caplog):
    """Checkpoints at ``resume_at`` and at step 12 (which removes merge 10's own snapshots),
    two more steps of a lost timeline, then a resume from the ``resume_at`` checkpoint: inside
    window 10 only (5), inside both windows (9), after merge 10 (12). A resume that needs a
    removed snapshot keeps the written merge instead; the merges equal an uninterrupted run's."""
    expected = straight_merges(tmp_path / "straight")
    folder = tmp_path / "run"
    first = Run(folder, OPTIONS)
    first.hook.pre_train(0)
    first.train(range(1, resume_at + 1))
    checkpoint = first.checkpoint()
    first.train(range(resume_at + 1, 13))
    if resume_at < 12:
        first.checkpoint()
    assert snapshot_steps(folder) == list(range(9, 13))
    first.train([13, 14], seed=1)  # the lost timeline, then a preemption
    first.hook.close()

    second = Run.resumed(folder, OPTIONS, checkpoint, resume_at)
    with caplog.at_level(logging.WARNING, logger="ckptavg"):
        second.train(range(resume_at + 1, 19))
    second.checkpoint()
    second.hook.close()
    assert {s: files_of(folder / f"step{s}-merged") for s in (10, 16)} == expected
    assert [s for _, s in second.merged] == [16]
    if resume_at < 10:
        assert "inside the window of merge step 10, which is already written" in caplog.text
    assert snapshot_steps(folder) == []


def test_a_merge_that_fails_verification_keeps_its_snapshots(tmp_path, monkeypatch, caplog):
    def corrupt(out: str) -> None:
        raise OutputError(f"{out}/model.safetensors: sha256 differs from the manifest's")

    monkeypatch.setattr("ckptavg.merging.retention.verify", corrupt)
    run = Run(tmp_path, {**OPTIONS, "merge_steps": [6], "window": 4})
    run.hook.pre_train(0)
    with caplog.at_level(logging.WARNING, logger="ckptavg"):
        run.train(range(1, 8))
        run.checkpoint()
    run.hook.close()
    assert snapshot_steps(tmp_path) == [3, 4, 5, 6]
    assert "failed verification, so no snapshot was removed; keeping the snapshots of merge step 6" in caplog.text


def test_a_snapshot_that_cannot_be_removed_is_a_notice_not_an_error(tmp_path, monkeypatch, caplog):
    def refuse(fs, path: str) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("ckptavg.hook.stores.remove_snapshot", refuse)
    run = Run(tmp_path, {**OPTIONS, "merge_steps": [6], "window": 4})
    run.hook.pre_train(0)
    with caplog.at_level(logging.WARNING, logger="ckptavg"):
        run.train(range(1, 8))
        run.checkpoint()
    run.train([8])  # training goes on
    run.hook.close()
    assert snapshot_steps(tmp_path) == [3, 4, 5, 6]
    assert f"could not remove the snapshot {tmp_path}/step3-snapshot: [Errno 13] Permission denied" in caplog.text
