"""The training hook under faults: background write errors, a killed training process, damaged
saved sums.

* An OS error in the hook's background work (disk full, permission denied) reaches the training
  thread as a one-line error naming the path, at the next hook call and at every call after.
* A training process killed at any point of a snapshot write never leaves a folder that
  ``ckptavg ls`` calls complete but that holds other weights than its step's, and ``ckptavg
  merge`` either averages complete snapshots only or refuses.
* Saved running sums that are damaged, missing or stale are refused on resume, never averaged.
"""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TESTS, fail_writes, run_cli_in_process
from references import correctly_rounded, load_merged, same_bits
from training import Run

from ckptavg import CkptavgError
from ckptavg.formats.parts import PartsReader
from ckptavg.io.fs import resolve

# -- (a) background failures ----------------------------------------------------------------
# test_hook.py's test_background_failures_surface_at_the_next_call_and_stick raises a ready-made
# CkptavgError in the store; here the OS itself fails, below ckptavg's own code.


def _wait_for_background(run: Run) -> None:
    """Let the capture and publish workers finish what they have (without raising their error)."""
    run.hook._captures._jobs.join()
    run.hook._publishes._jobs.join()


def _raises_naming(call, *fragments: str) -> None:
    with pytest.raises(CkptavgError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and all(f in message for f in fragments), message


def test_a_full_disk_under_a_snapshot_write_stops_training_naming_the_file(tmp_path, monkeypatch):
    run = Run(tmp_path, {"merge_steps": [6], "window": 4, "mode": "snapshot"})
    run.hook.pre_train(0)
    run.train([1, 2])
    fail_writes(monkeypatch, tmp_path, errno.ENOSPC, budget=0)
    run.train([3])  # the first captured step: its write fails in the background
    _wait_for_background(run)
    shown = (str(tmp_path / "step3-snapshot" / "rank00000-of-00001.safetensors"), "No space left on device")
    _raises_naming(lambda: run.train([4]), *shown)
    _raises_naming(run.hook.state_dict, *shown)
    _raises_naming(run.hook.close, *shown)
    assert list((tmp_path / "step3-snapshot").iterdir()) == []  # the partial file is gone
    assert not (tmp_path / "step6-merged").exists()


def test_a_full_disk_under_the_merged_output_stops_training_and_publishes_nothing(tmp_path, monkeypatch):
    """accumulate mode: the merge is written by the publish worker; its failure surfaces at the
    next call after the merge step."""
    run = Run(tmp_path, {"merge_steps": [4], "window": 3})
    run.hook.pre_train(0)
    run.train([1, 2, 3])
    fail_writes(monkeypatch, str(tmp_path / ".step4-merged"), errno.ENOSPC, budget=0)
    run.train([4])
    _wait_for_background(run)
    _raises_naming(lambda: run.train([5]), str(tmp_path), "step4-merged", "No space left on device")
    _raises_naming(run.hook.close, "step4-merged", "No space left on device")
    assert not [p.name for p in tmp_path.iterdir() if "step4-merged" in p.name]
    assert run.merged == []


def test_no_permission_for_the_saved_sums_stops_training_naming_the_folder(tmp_path, monkeypatch):
    """accumulate mode: ``state_dict()`` writes the running sums; a folder it may not create is
    an error there and at every later call, not a checkpoint without the sums."""
    run = Run(tmp_path, {"merge_steps": [6], "window": 4})
    run.hook.pre_train(0)
    run.train([1, 2, 3])
    fail_writes(monkeypatch, tmp_path, errno.EACCES)
    shown = (str(tmp_path / ".ckptavg-state" / "step3" / "merge6"), "Permission denied")
    _raises_naming(run.hook.state_dict, *shown)
    _raises_naming(lambda: run.train([4]), *shown)
    _raises_naming(run.hook.close, *shown)


def test_no_permission_for_a_snapshot_folder_stops_training_naming_it(tmp_path, monkeypatch):
    run = Run(tmp_path, {"merge_steps": [6], "window": 4, "mode": "snapshot"})
    run.hook.pre_train(0)
    run.train([1, 2])
    fail_writes(monkeypatch, tmp_path, errno.EACCES)
    run.train([3])
    _wait_for_background(run)
    shown = f"cannot create {tmp_path / 'step3-snapshot'}: Permission denied"
    _raises_naming(lambda: run.train([4]), shown)
    _raises_naming(run.hook.close, shown)


# -- (b) a training process killed while it writes a snapshot ---------------------------------

# One process imports torch once and forks a training run per trial (an interpreter with torch
# costs ~3 s). argv: tests folder, trials folder, then one kill per trial: "<event>:<n>" dies
# (os._exit: no clean-up of any kind) just before the n-th "write" (the header or a block of a
# rank file) or "publish" (the rename of a finished rank file or of its marker); "sigkill"
# sleeps at each of those events while this process sends SIGKILL at a random moment.
# Each run trains 6 steps with a snapshot of each (window 6, merge step 6), by a hand-written
# update (release="copy"), because torch.optim's first step imports torch._dynamo (~3 s). It
# first saves the weights of each step, trained the same way without the hook, as the
# reference the snapshots must hold.
CHILD = r"""
import json, os, random, signal, sys, time
from pathlib import Path

sys.path.insert(0, sys.argv[1])
import torch

torch.set_num_threads(1)
import ckptavg.io.atomic
from ckptavg import MergeHook, MergeHookConfig
from ckptavg.formats import parts
from ckptavg.formats.writers.safetensors import SafetensorsFileWriter
from training import make_model


def update(model, step):
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.9).add_(0.01 * step)


def train(folder, kill):
    event, _, nth = kill.partition(":")
    counts = {"write": 0, "publish": 0}

    def reached(kind):
        counts[kind] += 1
        if kind == event and counts[kind] == int(nth):
            os._exit(9)
        if event == "sigkill":
            time.sleep(0.01)

    original_write, original_publish = SafetensorsFileWriter._write, ckptavg.io.atomic.publish_file

    def write(self, data):
        reached("write")
        original_write(self, data)

    def publish(fs, tmp, path, *args):
        reached("publish")
        original_publish(fs, tmp, path, *args)

    SafetensorsFileWriter._write = write
    parts.publish_file = ckptavg.io.atomic.publish_file = publish
    model, reference = make_model(), {}
    for step in range(1, 7):
        update(model, step)
        reference[step] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(reference, folder / "reference.pt")
    model = make_model()
    config = MergeHookConfig(str(folder / "run"), merge_steps=[6], window=6, mode="snapshot", release="copy")
    with MergeHook(config) as hook:
        hook.pre_train(0)
        for step in range(1, 7):
            update(model, step)
            hook.post_train_batch(step, model)


statuses, delay = {}, None
for number, kill in enumerate(sys.argv[3:]):
    folder = Path(sys.argv[2]) / f"trial{number}"
    folder.mkdir()
    pid = os.fork()
    if pid == 0:
        try:
            train(folder, kill)
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if kill == "sigkill":
        while not (folder / "run" / "step1-snapshot").exists():  # the first write has begun
            time.sleep(0.002)
        delay = random.uniform(0.0, 0.5)  # 6 snapshots of ~7 slowed events, then the merge
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
    statuses[kill] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps({"statuses": statuses, "delay": delay}))
"""

# Per rank file: the header and 4 blocks (the model's 4 tensors), then 2 publishes (file, marker).
KILLS = {
    "write:2": [],  # step 1's file has its header only
    "publish:1": [],  # step 1's file is whole but still under its temporary name
    "write:9": [1],  # step 2's file is cut after two of its four blocks
    "publish:4": [1],  # step 2's file is in place, its marker is not
}


def _assert_mean(folder: Path, reference: dict, steps: list[int], where: str) -> None:
    for name, tensor in load_merged(folder).items():
        mean = sum(reference[s][name].double() for s in steps) / len(steps)
        assert bool(same_bits(tensor, correctly_rounded(mean, torch.bfloat16)).all()), (where, folder, name)


def _check_snapshots(trial: Path, expected_complete: list[int] | None, where: str) -> None:
    """Every snapshot ``ckptavg ls`` calls complete holds exactly its step's weights, and
    ``ckptavg merge`` averages only those or refuses; a merge the hook published is whole."""
    reference = torch.load(trial / "reference.pt", weights_only=True)
    run = trial / "run"
    if not run.exists():  # killed before the hook wrote anything
        assert not expected_complete, where
        return
    listing = run_cli_in_process("ls", str(run), "--json")
    assert listing.returncode == 0, (where, listing.stderr)
    rows = [r for r in json.loads(listing.stdout) if r["name"].endswith("-snapshot")]
    complete = [r["step"] for r in rows if r["status"] == "complete"]
    if expected_complete is not None:
        assert complete == expected_complete, (where, rows)
        # The kill left an unfinished folder: a temporary file, or a file without its marker.
        assert any(r["status"].startswith("incomplete") for r in rows), (where, rows)
    for step in complete:
        with PartsReader(*resolve(str(run / f"step{step}-snapshot"))) as reader:
            assert {t.name for t in reader.tensors()} == set(reference[step]), where
            for info in reader.tensors():
                out = torch.empty(info.shape, dtype=info.dtype)
                reader.read_block(info.name, [0] * len(info.shape), out)
                assert bool(same_bits(out, reference[step][info.name]).all()), (where, step, info.name)
    if (run / "step6-merged").exists():  # the rename that publishes it came before the kill
        _assert_mean(run / "step6-merged", reference, list(range(1, 7)), where)
    offline = trial / "offline"
    merged = run_cli_in_process("merge", str(run), "--merge-step", "6", "--window", "6", "--out", str(offline))
    if merged.returncode == 0:
        manifest = json.loads((offline / "ckptavg-manifest.json").read_text())
        used = [s["step"] for s in manifest["sources"]]
        assert used == complete, (where, used, complete)
        _assert_mean(offline, reference, used, where)
    else:  # e.g. a window that misses steps
        assert merged.returncode == 1 and len(merged.stderr.splitlines()) == 1, (where, merged.stderr)
        assert merged.stderr.startswith("ckptavg: error: ") and not offline.exists(), where


def test_a_training_process_killed_mid_snapshot_leaves_nothing_a_merge_would_misuse(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    trials = [*KILLS, "sigkill"]
    command = [sys.executable, str(script), str(TESTS), str(tmp_path), *trials]
    child = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout)
    for number, kill in enumerate(trials):
        folder, status = tmp_path / f"trial{number}", report["statuses"][kill]
        where = f"trial {kill!r} (random SIGKILL after {report['delay']:.3f} s)"
        # 9: died where planned; the random SIGKILL may also come after a finished run (0).
        assert status in ((9,) if kill in KILLS else (-signal.SIGKILL, 0)), (where, status, child.stderr)
        _check_snapshots(folder, KILLS.get(kill), where)


# -- (c) damaged saved sums on resume --------------------------------------------------------

RESUME = {"merge_steps": [10, 16], "window": 8}  # at step 5 the window 3-10 holds steps 3, 4, 5


def _sums(folder: Path, step: int) -> Path:
    return folder / ".ckptavg-state" / f"step{step}" / "merge10"


def _truncate(state: Path, _: Path) -> None:
    data = state / "rank00000-of-00001.safetensors"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _damage_header(state: Path, _: Path) -> None:
    """The step list the sums claim to hold, [3, 4, 5], becomes [3, 4, 6] (same length)."""
    data = state / "rank00000-of-00001.safetensors"
    raw = data.read_bytes()
    assert raw.count(b"[3, 4, 5]") == 1
    data.write_bytes(raw.replace(b"[3, 4, 5]", b"[3, 4, 6]"))


def _marker_sha(state: Path, _: Path) -> None:
    marker = state / "rank00000-of-00001.json"
    content = json.loads(marker.read_text())
    content["sha256"] = "0" * 64
    marker.write_text(json.dumps(content))


def _marker_garbage(state: Path, _: Path) -> None:
    (state / "rank00000-of-00001.json").write_text("{not json")


def _delete_data(state: Path, _: Path) -> None:
    (state / "rank00000-of-00001.safetensors").unlink()


def _delete_marker(state: Path, _: Path) -> None:
    (state / "rank00000-of-00001.json").unlink()


def _delete_folder(state: Path, _: Path) -> None:
    for path in state.iterdir():
        path.unlink()
    state.rmdir()


def _stale(state: Path, folder: Path) -> None:
    """The sums saved at step 4 (whole, with a matching sha256) in place of step 5's."""
    for path in _sums(folder, 4).iterdir():
        (state / path.name).write_bytes(path.read_bytes())


CORRUPT = "rank00000-of-00001.safetensors is corrupt: its sha256 differs"
MISSING = "inside the window of merge step 10 (steps 3-10), but its saved running sums are missing"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_truncate, CORRUPT),
        (_damage_header, CORRUPT),
        (_marker_sha, CORRUPT),
        (_marker_garbage, "cannot verify"),
        (_delete_data, MISSING),
        (_delete_marker, MISSING),
        (_delete_folder, MISSING),
        (_stale, "holds steps [3, 4], but the hook state says [3, 4, 5]"),
    ],
    ids=lambda value: value.__name__.strip("_") if callable(value) else "",
)
def test_damaged_saved_sums_are_refused_on_resume(tmp_path, damage, message):
    run = Run(tmp_path, RESUME)
    run.hook.pre_train(0)
    run.train(range(1, 5))
    run.checkpoint()
    run.train([5])
    checkpoint = run.checkpoint()
    run.hook.close()
    damage(_sums(tmp_path, 5), tmp_path)
    resumed = Run.resumed(tmp_path, RESUME, checkpoint, 5)
    with pytest.raises(CkptavgError) as caught:
        resumed.train([6])
    assert message in str(caught.value)
    if message == MISSING:  # and where they were looked for
        assert f"missing from {_sums(tmp_path, 5)}" in str(caught.value)
    resumed.hook.close()
    assert not list(tmp_path.glob("*step10-merged*"))
