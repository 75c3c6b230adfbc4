"""``ckptavg merge --remove-consumed-snapshots``: once the output is published and verified, the
training hook's snapshots it averaged go; trainer checkpoints, and anything not a snapshot, stay;
a failed merge or a failed verification removes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import files_of, run_cli_in_process, torchrun, tree_of, write_checkpoint
from training import Run

from ckptavg import OutputError

CONSUMED = ["step8-snapshot", "step9-snapshot", "step10-snapshot"]


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """Hook snapshots of steps 4-10, trainer checkpoints of steps 2 and 8 (the snapshot of
    step 8 is chosen over it), and a trainer checkpoint that is named like a snapshot (step 3)."""
    folder = tmp_path / "run"
    training = Run(folder, {"merge_steps": [10], "window": 7, "mode": "snapshot"})
    training.hook.pre_train(0)
    training.train(range(1, 11))
    training.hook.close()
    weights = {k: v.detach().clone() for k, v in training.model.state_dict().items()}
    for name in ("step2", "step8", "step3-snapshot"):
        write_checkpoint(folder / name, weights)
    return folder


def merge(run: Path, out: Path, *extra: str):
    return run_cli_in_process("merge", str(run), "--steps", "2,3,8,9,10", "--out", str(out), *extra)


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("ckptavg: error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_only_the_snapshots_the_merge_averaged_are_removed(run, tmp_path):
    plain = merge(run, tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr
    before = tree_of(run)
    result = merge(run, tmp_path / "out", "--remove-consumed-snapshots")
    assert result.returncode == 0, result.stderr
    assert files_of(tmp_path / "out") == files_of(tmp_path / "plain")
    gone = {key for key in before if key.split("/")[0] in CONSUMED}
    assert tree_of(run) == {key: value for key, value in before.items() if key not in gone}
    assert (
        f"ckptavg: removed 3 consumed snapshot(s): {run}/step8-snapshot, {run}/step9-snapshot, "
        f"{run}/step10-snapshot; kept 2 other input(s): {run}/step2, {run}/step3-snapshot\n"
    ) in result.stderr
    assert run_cli_in_process("verify", str(tmp_path / "out")).returncode == 0


def test_the_library_reports_what_it_removed(run, tmp_path):
    import ckptavg

    options = ckptavg.MergeOptions(remove_consumed_snapshots=True)
    result = ckptavg.merge(str(run), steps=[9, 10], out=str(tmp_path / "out"), options=options)
    assert result.removed_snapshots == [f"{run}/step9-snapshot", f"{run}/step10-snapshot"]
    assert result.kept_inputs == []
    assert result.to_dict()["removed_snapshots"] == result.removed_snapshots
    assert not (run / "step9-snapshot").exists() and (run / "step8-snapshot").is_dir()


def test_dry_run_lists_what_would_be_removed_and_removes_nothing(run, tmp_path):
    before = tree_of(tmp_path)
    result = merge(run, tmp_path / "out", "--remove-consumed-snapshots", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "once the output is verified: would remove 3 consumed snapshot(s)" in result.stdout
    assert f"would keep 2 other input(s): {run}/step2, {run}/step3-snapshot" in result.stdout
    listed = merge(run, tmp_path / "out", "--remove-consumed-snapshots", "--dry-run", "--json")
    assert json.loads(listed.stdout)["would_remove"] == [f"{run}/{name}" for name in CONSUMED]
    assert tree_of(tmp_path) == before


def test_two_processes_remove_once_after_both_finished(run, tmp_path):
    """Under torchrun each process writes its share of the files; process 0 removes the
    snapshots once the output is published, and every process exits 0."""
    plain = merge(run, tmp_path / "plain", "--shard-size", "200B")
    assert plain.returncode == 0, plain.stderr
    result = torchrun(
        2,
        "merge",
        str(run),
        "--steps",
        "2,3,8,9,10",
        "--out",
        str(tmp_path / "out"),
        "--shard-size",
        "200B",
        "--remove-consumed-snapshots",
    )
    assert result.returncode == 0, result.stderr
    assert "by 2 processes" in result.stderr
    assert files_of(tmp_path / "out") == files_of(tmp_path / "plain")
    assert len(files_of(tmp_path / "out")) >= 3  # more than one weight file: work for both processes
    assert result.stderr.count("ckptavg: removed 3 consumed snapshot(s)") == 1
    assert not any((run / name).exists() for name in CONSUMED)
    assert (run / "step2").is_dir() and (run / "step8").is_dir() and (run / "step3-snapshot").is_dir()


def test_a_failed_merge_removes_nothing(run, tmp_path):
    write_checkpoint(run / "step2", {"not.the.model": torch.zeros(3)})
    before = tree_of(tmp_path)
    result = merge(run, tmp_path / "out", "--remove-consumed-snapshots")
    assert result.returncode == 1
    assert "step2" in one_error_line(result.stderr)
    assert tree_of(tmp_path) == before


def test_an_output_that_fails_verification_removes_nothing(run, tmp_path, monkeypatch):
    def corrupt(out: str) -> None:
        message = "sha256 differs from the manifest's; the file changed or is corrupt"
        raise OutputError(f"{out}/model.safetensors: {message}")

    monkeypatch.setattr("ckptavg.merging.retention.verify", corrupt)
    result = merge(run, tmp_path / "out", "--remove-consumed-snapshots")
    assert result.returncode == 1
    assert one_error_line(result.stderr).endswith(
        "sha256 differs from the manifest's; the file changed or is corrupt; the merged output failed "
        "verification, so no snapshot was removed"
    )
    assert all((run / name).is_dir() for name in CONSUMED)
    assert (tmp_path / "out" / "ckptavg-manifest.json").is_file()  # published: only the removal was refused


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--no-fsync", "removing the consumed snapshots needs the output synced to disk first; drop --no-fsync"),
        ("--allow-nonfinite", "removing the consumed snapshots needs an output verified finite; drop --allow-nonf"),
    ],
)
def test_removal_without_fsync_or_with_nonfinite_values_is_refused(run, tmp_path, option, message):
    before = tree_of(tmp_path)
    result = merge(run, tmp_path / "out", "--remove-consumed-snapshots", option)
    assert result.returncode == 1
    assert message in one_error_line(result.stderr)
    assert tree_of(tmp_path) == before
