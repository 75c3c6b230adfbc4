"""``ckptavg merge`` across processes (torchrun, srun): byte-identical to one process; a failing
or killed process stops all of them with its reason and leaves nothing complete-looking."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import clean_env, make_run, poison_tensor_data, run_cli, stat_tree, torchrun, write_checkpoint
from hypothesis import given
from hypothesis import strategies as st

from ckptavg import CkptavgError
from ckptavg.formats.layout import ShardSpec, TensorSpec, layout_shards
from ckptavg.formats.writers.safetensors import build_header
from ckptavg.merging.distributed import assign_shards, first_host, launch_from_environment, split_output

SHAPES = {f"model.layers.{i}.w": (64, 24 + 8 * i) for i in range(10)}


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def srun(processes: int, *args: str, rank_prefix: dict[int, list[str]] | None = None) -> list:
    """What ``srun -n N ckptavg ...`` starts: N processes told their place only by SLURM variables."""
    job = str(random.randrange(10**6))
    procs = []
    for rank in range(processes):
        env = clean_env(
            SLURM_JOB_ID=job,
            SLURM_STEP_ID="0",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_NTASKS=str(processes),
            SLURM_STEP_NUM_TASKS=str(processes),
            SLURM_STEP_NODELIST="localhost",
        )
        command = (rank_prefix or {}).get(rank, [sys.executable, "-m", "ckptavg"]) + list(args)
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return [(p.wait(timeout=300), p.stderr.read()) for p in procs]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dist") / "run"
    make_run(root, [10, 20, 30], SHAPES, shards=2)
    return root


def test_one_two_and_three_processes_write_the_same_bytes(run, tmp_path):
    args = ["merge", str(run), "--last", "3", "--shard-size", "20KB"]
    single = run_cli(*args, "--out", str(tmp_path / "one"))
    assert single.returncode == 0, single.stderr
    expected = digests(tmp_path / "one")
    assert len([n for n in expected if n.endswith(".safetensors")]) >= 4  # work to share
    for processes in (2, 3):
        result = torchrun(processes, *args, "--out", str(tmp_path / f"n{processes}"))
        assert result.returncode == 0, result.stderr
        assert digests(tmp_path / f"n{processes}") == expected, processes
        assert f"by {processes} processes" in result.stderr
        assert f"rank 1/{processes}: joined (torchrun" in result.stderr


def test_srun_launch_and_dcp_output_are_byte_identical(run, tmp_path):
    args = ["merge", str(run), "--last", "2", "--shard-size", "20KB", "--format", "dcp"]
    assert run_cli(*args, "--out", str(tmp_path / "one")).returncode == 0
    outcomes = srun(2, *args, "--out", str(tmp_path / "two"))
    assert [code for code, _ in outcomes] == [0, 0], outcomes
    assert "rank 1/2: joined (slurm, master localhost)" in outcomes[1][1]
    assert digests(tmp_path / "two") == digests(tmp_path / "one")


def _no_output(parent: Path, name: str) -> None:
    assert not (parent / name).exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{name}.tmp-")]


def test_a_failing_rank_stops_every_rank_with_its_reason(tmp_path):
    """Rank 1's share holds a NaN: both exit 1 naming rank 1 and the tensor; nothing is left."""
    root = tmp_path / "run"
    saved = make_run(root, [10, 20], SHAPES, shards=1)
    layout = layout_shards([TensorSpec(k, torch.bfloat16, s) for k, s in SHAPES.items()], 1)
    rank1_tensor = split_output(layout, 2, lambda shard: len(build_header(shard)))[1][-1].tensors[-1].name
    broken = {k: v.clone() for k, v in saved[20].items()}
    broken[rank1_tensor][3, 3] = float("nan")
    write_checkpoint(root / "step20", broken)
    outcomes = srun(2, "merge", str(root), "--last", "2", "--shard-size", "1B", "--out", str(tmp_path / "avg"))
    assert [code for code, _ in outcomes] == [1, 1]
    for _, stderr in outcomes:
        assert "rank 1 of 2 failed" in stderr and rank1_tensor in stderr and "NaN" in stderr, stderr
        assert "Traceback" not in stderr
    _no_output(tmp_path, "avg")


def test_a_killed_rank_stops_the_others_and_a_rerun_completes(run, tmp_path):
    """Rank 1 dies without any cleanup (``os._exit``, as under SIGKILL) while merging."""
    die = (
        "import os, ckptavg.merging.engine as e\n"
        "def killed(*args, **kwargs): os._exit(9)\n"
        "e.StreamingAverage.run = killed\n"
        "from ckptavg.cli import main; main()\n"
    )
    args = ["merge", str(run), "--last", "3", "--shard-size", "20KB", "--out", str(tmp_path / "avg")]
    outcomes = srun(2, *args, rank_prefix={1: [sys.executable, "-c", die]})
    assert outcomes[1][0] == 9 and outcomes[0][0] == 1
    assert "lost contact with the other processes" in outcomes[0][1], outcomes[0][1]
    _no_output(tmp_path, "avg")
    assert run_cli(*args).returncode == 0  # no --force needed: nothing complete-looking was left
    assert (tmp_path / "avg" / "ckptavg-manifest.json").is_file()


def test_every_rank_of_a_rerun_of_a_finished_merge_exits_0_having_read_nothing(tmp_path):
    """A requeued srun job reruns a merge that had finished: rank 0 finds the published output of
    the same merge and decides for all; every rank exits 0, with or without --resume, none reads a
    tensor (their data is NaN now), nothing changes; one note, from rank 0."""
    run = tmp_path / "run"
    make_run(run, [10, 20], SHAPES, shards=2)
    args = ["merge", str(run), "--last", "2", "--shard-size", "20KB"]
    assert run_cli(*args).returncode == 0
    poison_tensor_data(run / "step10", run / "step20")
    before = stat_tree(tmp_path)
    note = f"ckptavg: note: {run / 'step20-merged'}: already merged, manifest matches; nothing to do"
    for resume in ([], ["--resume"]):
        outcomes = srun(2, *args, *resume)
        assert [code for code, _ in outcomes] == [0, 0], outcomes
        assert note in outcomes[0][1].splitlines() and "already merged" not in outcomes[1][1], outcomes
    assert stat_tree(tmp_path) == before


def test_launch_environment():
    assert launch_from_environment({}) is None
    torchrun_env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"}
    launch = launch_from_environment(torchrun_env)
    assert (launch.rank, launch.world_size, launch.master_addr, launch.master_port, launch.launcher) == (
        1,
        4,
        "n1",
        1234,
        "torchrun",
    )
    assert launch_from_environment({"RANK": "0", "WORLD_SIZE": "1"}) is None
    slurm = {
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_STEP_NODELIST": "gpu[017-020,033]",
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "3",
    }
    launch = launch_from_environment(slurm)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.master_addr) == (5, 8, 1, "gpu017")
    assert 20000 <= launch.master_port < 32768
    # Never in Linux's ephemeral range (from 32768), where an outgoing connection may hold it.
    ports = {launch_from_environment({**slurm, "SLURM_JOB_ID": str(j)}).master_port for j in range(20000)}
    assert min(ports) >= 20000 and max(ports) < 32768 and len(ports) == 12767  # every one drawn
    assert launch_from_environment({**slurm, "MASTER_ADDR": "head", "MASTER_PORT": "7"}).master_addr == "head"
    # A batch script sees its allocation's task count but is one process: never wait for others.
    assert launch_from_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"}) is None
    with pytest.raises(CkptavgError, match="WORLD_SIZE"):
        launch_from_environment({"RANK": "0", "WORLD_SIZE": "two"})


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("node07", "node07"), ("node[03-05,09],gpu1", "node03"), ("a-1,b", "a-1"), ("gpu[100]", "gpu100")],
)
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert first_host(nodelist) == first


@given(st.lists(st.integers(min_value=1, max_value=10**6), min_size=1, max_size=40), st.integers(1, 9))
def test_every_file_goes_to_exactly_one_process_balanced_by_bytes(sizes, world):
    shards = [ShardSpec(f"f{i:03d}", (TensorSpec(f"t{i}", torch.uint8, (n,)),)) for i, n in enumerate(sizes)]
    parts = assign_shards(shards, world)
    assert parts == assign_shards(shards, world)  # deterministic
    names = [s.file_name for part in parts for s in part]
    assert sorted(names) == sorted(s.file_name for s in shards)
    for part in parts:  # plan order kept inside a process
        assert [s.file_name for s in part] == sorted(s.file_name for s in part)
    loads = [sum(s.nbytes for s in part) for part in parts]
    # Greedy largest-first: no process exceeds the lightest by more than the largest file.
    assert max(loads) - min(loads) <= max(sizes)


def test_a_selection_error_reaches_every_rank(run, tmp_path):
    outcomes = srun(2, "merge", str(run), "--merge-step", "5", "--window", "2", "--out", str(tmp_path / "avg"))
    assert [code for code, _ in outcomes] == [1, 1]
    assert all("no checkpoint in the window 4-5" in stderr for _, stderr in outcomes), outcomes


def test_resume_after_every_rank_was_killed_is_byte_identical(run, tmp_path):
    """A preempted job: both ranks die (``os._exit``, no cleanup) right after journaling their
    second file. A 2-process ``--resume`` reuses the journaled files of both ranks and writes
    the bytes of an uninterrupted one-process merge."""
    die = (
        "import os, ckptavg.merging.journal as j\n"
        "original = j.Journal.record\n"
        "def record(self, *args):\n"
        "    original(self, *args)\n"
        "    if len(self.content['files']) == 2: os._exit(9)\n"
        "j.Journal.record = record\n"
        "from ckptavg.cli import main; main()\n"
    )
    args = ["merge", str(run), "--last", "3", "--shard-size", "8KB"]
    assert run_cli(*args, "--out", str(tmp_path / "one")).returncode == 0
    expected = digests(tmp_path / "one")
    assert len([n for n in expected if n.endswith(".safetensors")]) >= 6  # three or more per rank
    killer = [sys.executable, "-c", die]
    outcomes = srun(2, *args, "--out", str(tmp_path / "avg"), rank_prefix={0: killer, 1: killer})
    assert [code for code, _ in outcomes] == [9, 9], outcomes
    assert not (tmp_path / "avg").exists()
    (hidden,) = [p for p in tmp_path.iterdir() if p.name.startswith(".avg.tmp-")]
    assert sorted(p.name for p in hidden.glob(".ckptavg-journal-*")) == [
        ".ckptavg-journal-00000.json",
        ".ckptavg-journal-00001.json",
    ]
    outcomes = srun(2, *args, "--out", str(tmp_path / "avg"), "--resume")
    assert [code for code, _ in outcomes] == [0, 0], outcomes
    assert "reusing 3 files and 1 byte range of the interrupted run" in outcomes[0][1], outcomes[0][1]
    assert digests(tmp_path / "avg") == expected  # the manifest included: no trace of the interruption
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".avg.tmp-")]
