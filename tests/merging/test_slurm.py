"""The SLURM examples (``examples/slurm/*.sbatch``) as written, on a real two-node SLURM cluster
(the session's ``slurm`` fixture, tests/slurm_cluster.py): submitted with ``sbatch``, resources
lowered on its command line only, then requeued, signalled and resubmitted as SLURM and users do.

The scenarios run side by side, one thread each (the module's ``jobs`` fixture starts them all;
each node holds several jobs at once), and each test waits for its own and checks it. Where a job
must be interrupted at a chosen point, the program it runs holds there (it writes a marker file,
then does nothing more until SLURM's SIGTERM), and the test signals or requeues the job once the
marker is there: what the job had done by then is decided, not raced.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import REPO, clean_env, files_of, make_run, run_cli_in_process, stat_tree, tree_of
from slurm_cluster import ENDED, SlurmCluster

EXAMPLES = REPO / "examples" / "slurm"
# What both examples ask for, lowered to what the test machine has (the scripts stay as written).
RESOURCES = ("--nodes=2", "--cpus-per-task=1", "--mem=200M")
SHAPES = {f"model.layers.{i}.w": (64, 48) for i in range(8)}  # 6 KB of bf16 each
MERGE = {"MERGE_STEP": "30", "WINDOW": "30", "SHARD_SIZE": "8KB"}  # one tensor a file: 4 per task
MERGE_ARGS = ("--merge-step", "30", "--window", "30", "--shard-size", "8KB")  # the same, for ckptavg
MERGE_STEPS = (200, 400, 600)  # train_then_merge.sbatch's plan: a merge every 200 steps ...
WINDOW = 20  # ... each over the 20 steps before it
REUSED = "reusing 2 files of the interrupted run"  # each of the 2 tasks had finished one

# Programs on PATH ahead of the real ones, for the jobs that must be interrupted at a chosen
# point: the first time only (no marker file in HOLD_DIR yet), the program writes its pid to the
# marker and holds there until SLURM's SIGTERM; the test waits for the marker.
_HOLD = """\
import os
from pathlib import Path

def mark(marker: Path) -> bool:
    \"\"\"Write the marker unless it exists; whether it was written.\"\"\"
    if marker.exists():
        return False
    marker.with_suffix(".tmp").write_text(str(os.getpid()))
    marker.with_suffix(".tmp").rename(marker)
    return True
"""

# `ckptavg`: a merge task holds once its journal records a finished file (marker rank<R>). The
# journal is written by the thread that finishes files, so none finishes after that one; SIGTERM
# (ckptavg has no handler for it) then ends the process.
CKPTAVG_HOLDING = f"""\
{_HOLD}
import threading
from ckptavg.merging.journal import Journal

marker = Path(os.environ["HOLD_DIR"]) / f"rank{{os.environ.get('SLURM_PROCID', '0')}}"
write = Journal._write

def _write(self):
    write(self)
    if self.content["files"] and mark(marker):
        threading.Event().wait()

Journal._write = _write
from ckptavg.cli import main
main()
"""

# `python` (for train_tiny.py): holds once it has saved the checkpoint folder named HOLD_AFTER
# (marker trainer) until the trainer's own SIGTERM handler has run, then goes on.
PYTHON_HOLDING = f"""\
{_HOLD}
import runpy, signal, sys, threading, time
import safetensors.torch

handled = threading.Event()
install = signal.signal

def _signal(signum, handler):
    if signum == signal.SIGTERM and callable(handler):
        def handle(number, frame):
            handler(number, frame)
            handled.set()
        return install(signum, handle)
    return install(signum, handler)

signal.signal = _signal
marker = Path(os.environ["HOLD_DIR"]) / "trainer"
save = safetensors.torch.save_file

def save_file(tensors, filename, metadata=None):
    save(tensors, filename, metadata=metadata)
    if Path(filename).parent.name == os.environ["HOLD_AFTER"] and mark(marker):
        while not handled.is_set():  # handlers run in this thread, between two sleeps
            time.sleep(0.01)

safetensors.torch.save_file = save_file
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@dataclass(repr=False)  # no bytes in an assertion's message
class Outcome:
    """What a scenario left: the job's state after each of its runs, its log, and whatever the
    scenario recorded on the way (``seen``)."""

    root: Path
    runs: list[dict[str, str]]
    log: str
    seen: dict


class Scenario:
    """One scenario's folder, programs on PATH and jobs."""

    def __init__(self, slurm: SlurmCluster, root: Path, holding: dict[str, str] | None = None) -> None:
        self.slurm, self.root = slurm, root
        self.markers = root / "markers"
        self.markers.mkdir(parents=True)
        path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
        if holding:
            bin_dir = root / "bin"
            bin_dir.mkdir()
            for name, source in holding.items():
                (bin_dir / name).write_text(f"#!{sys.executable}\n{source}")
                (bin_dir / name).chmod(0o755)
            path = f"{bin_dir}:{path}"
        self.env = clean_env(PATH=path, HOLD_DIR=str(self.markers), RUN_DIR=str(root / "run"))

    def submit(self, script: str, log: str = "job.log", **env: str) -> int:
        return self.slurm.sbatch(
            *RESOURCES, f"--output={self.root / log}", str(EXAMPLES / script), env={**self.env, **env}, cwd=REPO
        )

    def holding(self, job: int, marker: str, timeout: float = 180) -> None:
        """Wait until the program that writes ``marker`` holds."""
        deadline = time.monotonic() + timeout
        while not (self.markers / marker).exists():
            fields = self.slurm.job(job)
            assert fields["JobState"] not in ENDED, f"job {job} ended before {marker} held: {fields}"
            assert time.monotonic() < deadline, f"job {job}: {marker} did not hold within {timeout} s"
            time.sleep(0.1)

    def log(self, name: str = "job.log") -> str:
        return (self.root / name).read_text()


def _scancel(slurm: SlurmCluster, job: int, *options: str) -> None:
    slurm.run("scancel", *options, str(job))


def _journaled(run: Path) -> dict[str, int]:
    """How many finished files each journal of the hidden folder of ``run``'s step-30 merge lists."""
    journals = run.glob(".step30-merged.tmp-*/.ckptavg-journal-*.json")
    return {p.name: len(json.loads(p.read_text())["files"]) for p in sorted(journals)}


# -- the scenarios -------------------------------------------------------------------------------


def merge_requeued_then_rerun(slurm: SlurmCluster, root: Path) -> Outcome:
    """merge.sbatch held mid-merge (each task has finished one file) and requeued by the trap
    the script sets for ``--signal=B:USR1@120`` (USR1 to the batch shell; the trap runs
    ``scontrol requeue``); once that run has published, requeued again from outside."""
    scenario = Scenario(slurm, root, {"ckptavg": CKPTAVG_HOLDING})
    make_run(root / "run", [10, 20, 30], SHAPES)
    job = scenario.submit("merge.sbatch", **MERGE)
    for rank in (0, 1):
        scenario.holding(job, f"rank{rank}")
    seen = {"journaled": _journaled(root / "run")}
    _scancel(slurm, job, "--batch", "--signal=USR1")
    slurm.release(job, run=1)
    runs = [slurm.ended(job, run=1)]
    seen["published"] = stat_tree(root / "run" / "step30-merged")
    slurm.run("scontrol", "requeue", str(job))
    slurm.release(job, run=2)
    runs.append(slurm.ended(job, run=2))
    return Outcome(root, runs, scenario.log(), seen)


def merge_terminated_then_resubmitted(slurm: SlurmCluster, root: Path) -> Outcome:
    """merge.sbatch sent SIGTERM by ``scancel --signal=TERM`` mid-merge (each task has finished
    one file), then submitted again."""
    scenario = Scenario(slurm, root, {"ckptavg": CKPTAVG_HOLDING})
    make_run(root / "run", [10, 20, 30], SHAPES)
    job = scenario.submit("merge.sbatch", log="first.log", **MERGE)
    for rank in (0, 1):
        scenario.holding(job, f"rank{rank}")
    _scancel(slurm, job, "--signal=TERM")
    runs = [slurm.ended(job)]
    seen = {"left": tree_of(root / "run"), "journaled": _journaled(root / "run")}
    again = scenario.submit("merge.sbatch", log="again.log", **MERGE)
    runs.append(slurm.ended(again))
    return Outcome(root, runs, scenario.log("first.log") + scenario.log("again.log"), seen)


def train_then_merge(slurm: SlurmCluster, root: Path) -> Outcome:
    """train_then_merge.sbatch, never stopped."""
    scenario = Scenario(slurm, root)
    job = scenario.submit("train_then_merge.sbatch")
    return Outcome(root, [slurm.ended(job)], scenario.log(), {})


def train_preempted_in_a_window(slurm: SlurmCluster, root: Path) -> Outcome:
    """train_then_merge.sbatch with the trainer held just after saving step 190 (inside the
    window 181-200), then sent what ``--signal=B:USR1@120`` sends before a time limit: the trap
    requeues the job, SLURM sends SIGTERM (the trainer saves its state and exits) and runs the
    job again."""
    scenario = Scenario(slurm, root, {"python": PYTHON_HOLDING})
    job = scenario.submit("train_then_merge.sbatch", HOLD_AFTER="step190")
    scenario.holding(job, "trainer")
    _scancel(slurm, job, "--batch", "--signal=USR1")
    slurm.release(job, run=1)
    return Outcome(root, [slurm.ended(job, run=1)], scenario.log(), {})


SCENARIOS: dict[str, Callable[[SlurmCluster, Path], Outcome]] = {
    f.__name__: f
    for f in (
        merge_requeued_then_rerun,
        merge_terminated_then_resubmitted,
        train_then_merge,
        train_preempted_in_a_window,
    )
}


@pytest.fixture(scope="module")
def jobs(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Outcome]]]:
    """Every scenario, started at once on the cluster; each test takes the outcome of its own."""
    root = tmp_path_factory.mktemp("slurm-jobs")
    with ThreadPoolExecutor(len(SCENARIOS)) as pool:
        yield {name: pool.submit(scenario, slurm, root / name) for name, scenario in SCENARIOS.items()}


def outcome(jobs: dict[str, Future[Outcome]], scenario: Callable) -> Outcome:
    return jobs[scenario.__name__].result(timeout=600)


def _completed(run: dict[str, str], log: str) -> None:
    assert (run["JobState"], run["ExitCode"]) == ("COMPLETED", "0:0"), f"{run}\n{log[-4000:]}"


def _one_process_merge(run: Path, out: Path, *args: str) -> dict[str, str]:
    result = run_cli_in_process("merge", str(run), *args, "--out", str(out))
    assert result.returncode == 0, result.stderr
    return digests(out)


# -- the tests -----------------------------------------------------------------------------------


def test_merge_requeued_mid_merge_resumes_and_requeued_after_publishing_keeps_its_output(jobs, tmp_path):
    """merge.sbatch on 2 nodes, requeued while each task had one file finished: the requeued run
    reuses both files and publishes the bytes of a one-process merge; requeued after publishing,
    it finds the merge done (one note) and changes nothing. Both runs end COMPLETED, and the log
    (``--open-mode=append``) holds all three runs."""
    result = outcome(jobs, merge_requeued_then_rerun)
    assert result.seen["journaled"] == {".ckptavg-journal-00000.json": 1, ".ckptavg-journal-00001.json": 1}
    for run in result.runs:
        _completed(run, result.log)
        assert run["NodeList"] == "n[1-2]"
    out = result.root / "run" / "step30-merged"
    assert digests(out) == _one_process_merge(result.root / "run", tmp_path / "one", *MERGE_ARGS)
    assert result.log.count("would average 3 checkpoints") == 3  # the dry run of each of the 3 runs
    assert result.log.count("rank 1/2: joined (slurm, master n1)") == 3
    assert REUSED in result.log
    assert f"ckptavg: note: {out}: already merged, manifest matches; nothing to do" in result.log
    assert stat_tree(out) == result.seen["published"]  # not a byte, inode or mtime changed


def test_merge_terminated_mid_merge_leaves_nothing_complete_and_its_resubmission_finishes(jobs, tmp_path):
    """``scancel --signal=TERM`` while each task had one file finished: the job FAILED, no output
    folder and no manifest outside the hidden folder; the same job submitted again reuses both
    files and publishes the bytes of a one-process merge."""
    result = outcome(jobs, merge_terminated_then_resubmitted)
    terminated, again = result.runs
    assert terminated["JobState"] == "FAILED", terminated
    left = result.seen["left"]
    assert "step30-merged" not in left
    hidden = [name for name in left if name.startswith(".step30-merged.tmp-") and "/" not in name]
    assert len(hidden) == 1
    assert not [name for name in left if name.endswith("ckptavg-manifest.json")]
    assert result.seen["journaled"] == {".ckptavg-journal-00000.json": 1, ".ckptavg-journal-00001.json": 1}
    _completed(again, result.log)
    assert REUSED in result.log
    out = result.root / "run" / "step30-merged"
    assert digests(out) == _one_process_merge(result.root / "run", tmp_path / "one", *MERGE_ARGS)


def test_train_then_merge_follows_the_plan_and_merges_as_one_process_does(jobs, tmp_path):
    """train_then_merge.sbatch as written: ``ckptavg plan --format env`` gives the merge steps,
    window starts and steps to keep; the trainer saves exactly the windows' steps; each window is
    merged by 2 tasks into the bytes of a one-process merge made after the fact."""
    result = outcome(jobs, train_then_merge)
    _completed(result.runs[0], result.log)
    assert "merge steps: 200 400 600; windows start at: 181 381 581; keep: 181 381 581" in result.log
    run = result.root / "run"
    windows = {step for merge in MERGE_STEPS for step in range(merge - WINDOW + 1, merge + 1)}
    assert {p.name for p in run.iterdir()} == {f"step{s}" for s in windows} | {
        f"step{s}-merged" for s in MERGE_STEPS
    } | {"resume"}
    assert result.log.count(" by 2 processes: read ") == len(MERGE_STEPS)
    for step in MERGE_STEPS:
        one = tmp_path / f"one{step}"
        _one_process_merge(run, one, "--merge-step", str(step), "--window", str(WINDOW))
        assert files_of(run / f"step{step}-merged") == files_of(one)


def test_training_preempted_in_a_merge_window_resumes_to_the_same_checkpoints_and_merges(jobs):
    """train_then_merge.sbatch whose trainer is preempted just after saving step 190 (the trap
    for ``--signal=B:USR1@120`` requeues the job; SLURM's SIGTERM makes the trainer save its state
    and exit): the requeued job resumes training from step 190 and ends COMPLETED, with every
    checkpoint and all three merges bit-identical to those of the job never stopped."""
    result = outcome(jobs, train_preempted_in_a_window)
    _completed(result.runs[0], result.log)
    assert "SIGTERM: saved the state after step 190; a rerun resumes there" in result.log
    assert "resumed from step 190" in result.log
    assert result.log.count(" by 2 processes: read ") == len(MERGE_STEPS)
    reference = outcome(jobs, train_then_merge).root / "run"
    preempted = result.root / "run"
    checkpoints = sorted(p.name for p in reference.glob("step*") if not p.name.endswith("-merged"))
    assert sorted(p.name for p in preempted.glob("step*") if not p.name.endswith("-merged")) == checkpoints
    for name in checkpoints:
        assert tree_of(preempted / name) == tree_of(reference / name), name
    for step in MERGE_STEPS:
        assert files_of(preempted / f"step{step}-merged") == files_of(reference / f"step{step}-merged")
