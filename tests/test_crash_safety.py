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
from conftest import make_run

from ckptavg.verify import verify

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
    assert not list(out.parent.glob("*/ckptavg-manifest.json")), "an unfinished output has a manifest"
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
