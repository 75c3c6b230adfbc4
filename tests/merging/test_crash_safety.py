"""``kill -9`` at random points of a merge: never a complete-looking wrong output, and
``--resume`` finishes byte-identical to an uninterrupted run, reusing the finished files.

A few trials run in ``make test``; ``make stress`` runs many (``CKPTAVG_KILL_TRIALS``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import make_run, run_cli_in_process, tree_of

import ckptavg
from ckptavg import MergeOptions
from ckptavg.merging.publish import OWNER_FILE
from ckptavg.merging.verify import verify

TRIALS = int(os.environ.get("CKPTAVG_KILL_TRIALS", "3"))
SHAPES = {f"model.layers.{i}.w": (1024, 1024) for i in range(12)}  # 24 MB of bf16 per checkpoint
ARGS = ["--last", "3", "--shard-size", "2MB", "--chunk-size", "256KiB", "--quiet"]


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def merge(run: Path, out: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "ckptavg", "merge", str(run), *ARGS, "--out", str(out), *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    make_run(root / "run", [1, 2, 3], SHAPES)
    proc = merge(root / "run", root / "ref", "--json")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return root, digests(root / "ref"), json.loads(out)["seconds"]


@pytest.mark.parametrize("trial", range(TRIALS))
def test_kill_at_a_random_point_then_resume(reference, tmp_path, trial):
    root, expected, merge_seconds = reference
    chance = random.Random(trial)
    out = tmp_path / "avg"
    proc = merge(root / "run", out)
    if chance.random() < 0.2:  # during start-up, before anything is written
        time.sleep(chance.uniform(0, 2.0))
    else:  # while files are written, or around the commit
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".avg.tmp-*")) and not out.exists() and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(chance.uniform(0, merge_seconds))
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    if out.exists():  # killed after the rename: then it must be the whole, right output
        assert digests(out) == expected
        verify(str(out))
        print(f"trial {trial}: killed after the output was published")
        return
    # A kill between the manifest and the rename leaves a manifest in the hidden folder: hidden, so
    # it completes nothing; a visible folder with a manifest would be an unfinished output published.
    visible = [m for m in out.parent.glob("*/ckptavg-manifest.json") if not m.parent.name.startswith(".")]
    assert not visible, "an unfinished output has a manifest"
    resumed = merge(root / "run", out, "--resume", "--json")
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    assert digests(out) == expected
    report = json.loads(stdout)
    assert 0 <= report["reused_files"] <= len([n for n in expected if n.endswith(".safetensors")])
    assert not list(tmp_path.glob(".avg.tmp-*"))  # the interrupted run's folder became the output
    print(f"trial {trial}: reused {report['reused_files']} files")


def test_resume_never_publishes_what_another_plan_left(reference, tmp_path):
    """A hidden folder left by an interrupted merge of another plan (other shard size) is picked
    up, but none of its files survives into the output."""
    root, expected, _ = reference
    stale = tmp_path / ".avg.tmp-0badc0de"
    stale.mkdir()
    (stale / ".ckptavg-journal-00000.json").write_text(json.dumps({"fingerprint": "other", "files": {}}))
    (stale / "model-00001-of-00099.safetensors").write_bytes(b"half-written")
    (stale / "junk.bin").write_bytes(b"x")
    proc = merge(root / "run", tmp_path / "avg", "--resume", "--json")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert json.loads(stdout)["reused_files"] == 0
    assert digests(tmp_path / "avg") == expected


# -- a killed merge's hidden folder: removed when provably dead, else named ------------------------


# A merge that stops itself (SIGSTOP) right after its journal first records ``files`` finished
# files: the test waits for the stop (waitpid), so where the merge stands is decided, not raced.
_STOP_AFTER_JOURNAL = """
import os, signal, sys
from ckptavg.merging.journal import Journal
write, files = Journal._write, int(sys.argv[1])
def _write(self):
    write(self)
    if len(self.content["files"]) >= files:
        Journal._write = write
        os.kill(os.getpid(), signal.SIGSTOP)
Journal._write = _write
from ckptavg.cli import main
sys.argv = ["ckptavg", *sys.argv[2:]]
main()
"""


def _merge_stopped_at(run: Path, out: Path, files: int, *extra: str) -> subprocess.Popen:
    """A merge into ``out``, stopped once its journal vouches for ``files`` finished files."""
    command = [sys.executable, "-c", _STOP_AFTER_JOURNAL, str(files), "merge", str(run), *ARGS, "--out", str(out)]
    proc = subprocess.Popen([*command, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    if not os.WIFSTOPPED(status):
        proc.returncode = os.waitstatus_to_exitcode(status)
        raise AssertionError(f"the merge ended before its journal held {files} files: {proc.stderr.read()}")
    return proc


def _start_and_catch(run: Path, out: Path) -> tuple[subprocess.Popen, Path]:
    """A merge into ``out``, caught (stopped) once its hidden folder holds a journal (set up)."""
    proc = _merge_stopped_at(run, out, 0)
    (found,) = out.parent.glob(f".{out.name}.tmp-*/.ckptavg-journal-*.json")
    return proc, found.parent


def _rerun(run: Path, out: Path, *extra: str):
    args = [a for a in ARGS if a != "--quiet"]
    return run_cli_in_process("merge", str(run), *args, "--out", str(out), *extra)


def _notes(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ckptavg: note: ")]


def test_a_rerun_removes_the_folder_of_a_killed_merge_of_the_same_output(reference, tmp_path):
    root, expected, _ = reference
    proc, hidden = _start_and_catch(root / "run", tmp_path / "avg")
    proc.kill()
    proc.communicate(timeout=60)
    result = _rerun(root / "run", tmp_path / "avg")
    assert result.returncode == 0, result.stderr
    assert _notes(result.stderr) == []
    assert not hidden.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["avg"]
    assert digests(tmp_path / "avg") == expected


def test_a_folder_a_live_merge_owns_is_never_adopted_nor_removed(reference, tmp_path):
    """A merge still running (here: stopped) holds its folder: --resume refuses it in one line,
    a plain rerun leaves it alone and says so in one line."""
    root, expected, _ = reference
    proc, hidden = _start_and_catch(root / "run", tmp_path / "avg")  # stopped, alive
    try:
        before = digests(hidden)
        resumed = _rerun(root / "run", tmp_path / "avg", "--resume")
        assert resumed.returncode == 1 and len(resumed.stderr.splitlines()) == 1, resumed.stderr
        assert resumed.stderr.startswith(f"ckptavg: error: cannot resume from {hidden}: ")
        assert f"pid {proc.pid}" in resumed.stderr and "still running" in resumed.stderr
        assert digests(hidden) == before
        plain = _rerun(root / "run", tmp_path / "avg")
        assert plain.returncode == 0, plain.stderr
        notes = _notes(plain.stderr)
        assert len(notes) == 1 and str(hidden) in notes[0] and "still running" in notes[0], plain.stderr
        assert digests(hidden) == before and digests(tmp_path / "avg") == expected
    finally:
        proc.kill()
        proc.communicate(timeout=60)


@pytest.mark.parametrize("left", ["by-another-host", "without-owner"])
def test_a_folder_not_provably_dead_is_kept_and_named_in_one_line(reference, tmp_path, left):
    """Another host's merge may be alive (clusters share the disk), and a folder without an owner
    file may be anything: neither is removed; one note says how to resume or remove it."""
    root, expected, _ = reference
    if left == "by-another-host":
        proc, hidden = _start_and_catch(root / "run", tmp_path / "avg")
        proc.kill()
        proc.communicate(timeout=60)
        owner = json.loads((hidden / OWNER_FILE).read_text())
        (hidden / OWNER_FILE).write_text(json.dumps({**owner, "host": "some-other-node"}))
    else:
        hidden = tmp_path / ".avg.tmp-0badc0de"
        hidden.mkdir()
        (hidden / "model-00001-of-00099.safetensors").write_bytes(b"half-written")
    before = digests(hidden)
    result = _rerun(root / "run", tmp_path / "avg")
    assert result.returncode == 0, result.stderr
    notes = _notes(result.stderr)
    assert len(notes) == 1, result.stderr
    assert str(hidden) in notes[0] and "--resume" in notes[0] and f"rm -r {hidden}" in notes[0], notes[0]
    assert digests(hidden) == before and digests(tmp_path / "avg") == expected


# -- durability: every byte reaches the disk before the output is published ------------------------


def _record_sync_and_renames(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """Every fsync (by the path of its descriptor), rename (the publishing ones included) and
    replace, in order."""
    import ckptavg.merging.publish as publish

    events: list[tuple[str, ...]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace
    real_no_replace = publish.rename_no_replace

    def rename_no_replace(src, dst):
        events.append(("rename", str(src), str(dst)))
        return real_no_replace(src, dst)

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst, *args, **kwargs):
        events.append(("rename", str(src), str(dst)))
        return real_rename(src, dst, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(publish, "rename_no_replace", rename_no_replace)
    return events


@pytest.mark.parametrize("output_format", ["safetensors", "dcp"])
def test_every_file_and_folder_is_fsynced_before_the_publish_and_the_parent_after(tmp_path, monkeypatch, output_format):
    make_run(tmp_path / "run", [1, 2], {"a": (64,), "b": (64,)})
    out = tmp_path / "out" / "avg"
    (tmp_path / "out").mkdir()
    (out).mkdir()  # replaced with force: the old output goes aside first
    events = _record_sync_and_renames(monkeypatch)
    ckptavg.merge(
        str(tmp_path / "run"),
        last=2,
        out=str(out),
        options=MergeOptions(force=True, shard_size=200, output_format=output_format),
    )
    monkeypatch.undo()
    publish = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(out))
    hidden = Path(events[publish][1])
    synced_before = {e[1] for e in events[:publish] if e[0] == "fsync"}
    files = [p.relative_to(out) for p in out.rglob("*") if p.is_file()]
    assert len(files) >= 4
    assert {str(hidden / f) for f in files} <= synced_before
    folders = [hidden] + [hidden / p.relative_to(out) for p in out.rglob("*") if p.is_dir()]
    assert {str(f) for f in folders} <= synced_before
    # Each folder after the last file written into it.
    last_file = max(i for i, e in enumerate(events[:publish]) if e[0] == "fsync" and Path(e[1]).parent == hidden)
    assert ("fsync", str(hidden)) in events[last_file:publish]
    assert ("fsync", str(out.parent)) in events[publish + 1 :]
    # Each journal is durable before it replaces the last one, and its folder after.
    journals = [i for i, e in enumerate(events) if e[0] == "replace" and ".ckptavg-journal-" in e[2]]
    assert journals
    for i in journals:
        assert ("fsync", events[i][1]) in events[:i]
        assert ("fsync", str(Path(events[i][2]).parent)) in events[i + 1 :]


def test_no_fsync_makes_no_fsync_call(tmp_path, monkeypatch):
    make_run(tmp_path / "run", [1, 2], {"a": (64,), "b": (64,)})
    events = _record_sync_and_renames(monkeypatch)
    result = run_cli_in_process("merge", str(tmp_path / "run"), "--last", "2", "--shard-size", "200", "--no-fsync")
    monkeypatch.undo()
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run" / "step2-merged" / "ckptavg-manifest.json").is_file()
    assert [e for e in events if e[0] == "fsync"] == []
    assert any(e[0] == "rename" for e in events)


def test_files_reused_from_a_no_fsync_run_are_made_durable_by_resume(reference, tmp_path, monkeypatch):
    """The interrupted run may have run with --no-fsync: what its journal vouches for is still in
    the page cache only, so a resume with fsync on syncs every file it reuses before publishing."""
    root, expected, _ = reference
    out = tmp_path / "avg"
    proc = _merge_stopped_at(root / "run", out, 1, "--no-fsync")
    proc.kill()
    proc.communicate(timeout=60)
    events = _record_sync_and_renames(monkeypatch)
    result = _rerun(root / "run", out, "--resume", "--json")
    monkeypatch.undo()
    assert result.returncode == 0, result.stderr
    reused = json.loads(result.stdout)["reused_files"]
    assert reused >= 1
    publish = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(out))
    synced = {Path(e[1]).name for e in events[:publish] if e[0] == "fsync"}
    assert {n for n in expected if n.endswith(".safetensors")} <= synced
    assert digests(out) == expected


def test_journal_entries_that_are_not_objects_vouch_for_nothing(reference, tmp_path):
    """A journal whose file entries a damaged disk turned into lists: --resume reuses none of
    those files (it writes them again) and publishes the bytes of an uninterrupted run."""
    root, expected, _ = reference
    out = tmp_path / "avg"
    proc = merge(root / "run", out)
    deadline = time.monotonic() + 120
    while not (journals := [j for j in tmp_path.glob(".avg.tmp-*/.ckptavg-journal-*.json") if _journaled(j)]):
        assert proc.poll() is None and time.monotonic() < deadline, "the merge finished no file in time"
        time.sleep(0.002)
    proc.kill()
    proc.communicate(timeout=60)
    for journal in journals:
        content = json.loads(journal.read_text())
        content["files"] = {name: [entry["sha256"]] for name, entry in content["files"].items()}
        journal.write_text(json.dumps(content))
    result = _rerun(root / "run", out, "--resume", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["reused_files"] == 0
    assert digests(out) == expected


def _journaled(journal: Path) -> bool:
    """Whether ``journal`` (of a merge still running) records a finished file yet."""
    try:
        return bool(json.loads(journal.read_text()).get("files"))
    except (OSError, ValueError):  # replaced or half-visible as it is read
        return False


def test_an_output_moved_aside_by_an_interrupted_replace_is_named_not_removed(reference, tmp_path):
    """A --force replace killed between its two renames leaves the old output in .NAME.old-*:
    perhaps the only complete output left, so it is named, never removed unasked."""
    root, expected, _ = reference
    aside = tmp_path / ".avg.old-0123abcd"
    aside.mkdir()
    (aside / "model.safetensors").write_bytes(b"the earlier output")
    result = _rerun(root / "run", tmp_path / "avg")
    assert result.returncode == 0, result.stderr
    notes = _notes(result.stderr)
    assert len(notes) == 1 and str(aside) in notes[0] and f"rm -r {aside}" in notes[0], result.stderr
    assert (aside / "model.safetensors").read_bytes() == b"the earlier output"
    assert digests(tmp_path / "avg") == expected


# -- two merges into one output: exactly one publishes, the other says so in one line ------------

RACE_SHAPES = {"a": (64, 8), "b": (64,)}


def _race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other: list[str]) -> dict[str, object]:
    """Merge A (``--last 3``) of a fresh run into ``tmp_path/avg``; at A's first folder sync inside
    its commit (its checks done, its files complete), merge B (``--last 2`` and ``other``) runs
    to completion into the same output. Returns B's output as B left it."""
    import ckptavg.merging.publish as publish

    make_run(tmp_path / "run", [1, 2, 3], RACE_SHAPES)
    real_sync, theirs = publish.sync_folder, {}

    def sync_then_let_b_publish(fs, path, fsync):
        if not theirs and Path(path).name.startswith(".avg.tmp-"):
            theirs["tree"] = {}  # B's own syncs pass through
            args = ["merge", str(tmp_path / "run"), "--last", "2", "--out", str(tmp_path / "avg"), *other]
            assert run_cli_in_process(*args).returncode == 0
            theirs["tree"] = tree_of(tmp_path / "avg")
        return real_sync(fs, path, fsync)

    monkeypatch.setattr(publish, "sync_folder", sync_then_let_b_publish)
    return theirs


@pytest.mark.parametrize("force", [False, True], ids=["new-output", "replacing-with-force"])
def test_of_two_merges_into_one_output_exactly_one_publishes(tmp_path, monkeypatch, force):
    """Without --force, B publishes while A is publishing; with it, A was to replace an earlier
    output and B replaced that one first. Either way A never replaces B's output, which stays byte
    for byte as B wrote it: A exits 1 with one line naming the output and leaves no hidden folder."""
    if force:
        make_run(tmp_path / "first", [9], RACE_SHAPES)
        ckptavg.average([str(tmp_path / "first" / "step9")], str(tmp_path / "avg"))
    theirs = _race(tmp_path, monkeypatch, ["--force"] if force else [])
    flags = ["--force"] if force else []
    result = run_cli_in_process("merge", str(tmp_path / "run"), "--last", "3", "--out", str(tmp_path / "avg"), *flags)
    monkeypatch.undo()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    said = "another process replaced it while this merge ran" if force else "another process published it"
    assert len(lines) == 1 and lines[0].startswith(f"ckptavg: error: cannot publish output {tmp_path / 'avg'}: ")
    assert said in lines[0] and "this merge published nothing" in lines[0], lines[0]
    assert theirs["tree"] and tree_of(tmp_path / "avg") == theirs["tree"]
    manifest = json.loads((tmp_path / "avg" / "ckptavg-manifest.json").read_text())
    assert [s["step"] for s in manifest["sources"]] == [2, 3]  # B's merge
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["avg", "run"] + (["first"] if force else []))


def test_a_merge_published_between_the_two_renames_of_a_replace_loses_neither_output(tmp_path, monkeypatch):
    """--force moves the output it replaces aside, then renames the new one in; another merge
    that publishes in between keeps its output, and the one moved aside is kept and named."""
    import ckptavg.merging.publish as publish

    make_run(tmp_path / "run", [1, 2, 3], RACE_SHAPES)
    out = tmp_path / "avg"
    ckptavg.merge(str(tmp_path / "run"), last=1, out=str(out))
    earlier = tree_of(out)
    real_rename, theirs = publish.rename_no_replace, {}

    def rename(source, target):
        if not theirs and Path(target) == out and ".tmp-" in Path(source).name:
            theirs["tree"] = {}
            ckptavg.merge(str(tmp_path / "run"), last=2, out=str(out))
            theirs["tree"] = tree_of(out)
        return real_rename(source, target)

    monkeypatch.setattr(publish, "rename_no_replace", rename)
    result = run_cli_in_process("merge", str(tmp_path / "run"), "--last", "3", "--out", str(out), "--force")
    monkeypatch.undo()
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    (aside,) = tmp_path.glob(".avg.old-*")
    assert f"the output it was replacing is kept in {aside}" in result.stderr
    assert tree_of(out) == theirs["tree"] and tree_of(aside) == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == [aside.name, "avg", "run"]
