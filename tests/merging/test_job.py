"""One merge's steps, each on its own: prepare, write_part, publish; and rank 0's decision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import files_of, make_run, write_checkpoint

import ckptavg
from ckptavg import CheckpointError, CkptavgError, MergeOptions, OutputError
from ckptavg.formats import open_checkpoint
from ckptavg.io.fs import resolve
from ckptavg.merging.distributed import Collective
from ckptavg.merging.job import PartResult, prepare, publish, write_part
from ckptavg.merging.journal import Journal
from ckptavg.merging.keys import FilteredReader, KeyFilter
from ckptavg.merging.options import PublishExtras
from ckptavg.merging.publish import AtomicFolder
from ckptavg.merging.verify import verify


class TwoRanks(Collective):
    """Rank ``rank`` of two processes whose peer's answers are given (what broadcast returns,
    in order); records what this rank broadcast."""

    world_size = 2

    def __init__(self, rank: int, answers: list[object] | None = None) -> None:
        self.rank, self.answers, self.sent = rank, list(answers or []), []

    def broadcast(self, obj: object) -> object:
        self.sent.append(obj)
        return obj if self.rank == 0 else self.answers.pop(0)


def _readers(run: Path, steps: list[int]) -> list[FilteredReader]:
    return [FilteredReader(open_checkpoint(*resolve(str(run / f"step{s}"))), KeyFilter()) for s in steps]


def test_the_three_steps_alone_write_what_average_writes(tmp_path):
    make_run(tmp_path / "run", [1, 2, 3], {"a": (300, 7), "b": (1000,)})
    options = MergeOptions(shard_size=4000)
    sources = [str(tmp_path / "run" / f"step{s}") for s in (1, 2, 3)]
    expected = ckptavg.average(sources, str(tmp_path / "one"), steps=[1, 2, 3], options=options)
    readers = _readers(tmp_path / "run", [1, 2, 3])
    fs, out = resolve(str(tmp_path / "two"))
    job = prepare(readers, [1, 2, 3], None, options, PublishExtras(), lambda n: None)
    assert [s.name for s in job.specs] == ["a", "b"] and job.weights is None
    with AtomicFolder(fs, out) as folder:
        writer = job.writer(fs, folder.tmp, out)
        shards, merge_id = job.layout(writer)
        part = write_part(
            job, writer, shards, shards, Collective(), Journal(fs, folder.tmp, 0, merge_id, {}), lambda: 0
        )
        assert isinstance(part, PartResult) and part.error is None and set(part.files) == {s.file_name for s in shards}
        hashes = publish(job, folder, writer, shards, part.files)
    for reader in readers:
        reader.close()
    assert files_of(tmp_path / "two") == files_of(tmp_path / "one") and len(shards) > 1
    assert hashes == expected.files
    verify(str(tmp_path / "two"))


def test_prepare_refuses_sources_that_differ_before_any_output(tmp_path):
    write_checkpoint(tmp_path / "run" / "step1", {"a": torch.zeros(2)})
    write_checkpoint(tmp_path / "run" / "step2", {"a": torch.zeros(3)})
    readers = _readers(tmp_path / "run", [1, 2])
    with pytest.raises(CheckpointError, match=r"'a' has shape \[2\]"):
        prepare(readers, None, None, MergeOptions(), PublishExtras(), lambda n: None)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step1", "step2"]


def test_a_failing_part_is_reported_to_the_others_not_raised(tmp_path):
    """With other processes, a failure becomes the PartResult's error (every rank stops with
    it); alone, it is raised as it is."""
    make_run(tmp_path / "run", [1, 2], {"w": (100,)})
    tensors = {"w": torch.zeros(100, dtype=torch.bfloat16)}
    tensors["w"][7] = float("nan")
    write_checkpoint(tmp_path / "run" / "step2", tensors)
    readers = _readers(tmp_path / "run", [1, 2])
    fs, out = resolve(str(tmp_path / "out"))
    job = prepare(readers, None, None, MergeOptions(), PublishExtras(), lambda n: None)
    with AtomicFolder(fs, out) as folder:
        writer = job.writer(fs, folder.tmp, out)
        shards, merge_id = job.layout(writer)
        journal = Journal(fs, folder.tmp, 1, merge_id, {})
        part = write_part(job, writer, shards, shards, TwoRanks(1), journal, lambda: 0)
        assert part.files == {} and "holds NaN (element 7)" in (part.error or "")
        with pytest.raises(CkptavgError, match="holds NaN"):
            write_part(job, writer, shards, shards, Collective(), journal, lambda: 0)
    for reader in readers:
        reader.close()


def test_rank_0_decides_and_every_rank_gets_the_value_or_the_error():
    assert Collective().decide(lambda: 42) == 42
    rank0 = TwoRanks(0)
    assert rank0.decide(lambda: "chosen") == "chosen" and rank0.sent == [("chosen", None)]
    assert TwoRanks(1, [("chosen", None)]).decide(lambda: pytest.fail("only rank 0 decides")) == "chosen"

    def refuse() -> None:
        raise OutputError("output x already exists")

    rank0 = TwoRanks(0)
    with pytest.raises(OutputError, match="^output x already exists$"):  # its own error, as it is
        rank0.decide(refuse, "rank 0 of 2 failed while publishing: ")
    assert rank0.sent == [(None, "output x already exists")]  # told the other rank first
    rank1 = TwoRanks(1, rank0.sent)
    with pytest.raises(CkptavgError, match="^rank 0 of 2 failed while publishing: output x already exists$"):
        rank1.decide(lambda: None, "rank 0 of 2 failed while publishing: ")
    rank0 = TwoRanks(0)
    with pytest.raises(ZeroDivisionError):  # not only a CkptavgError: none leaves the others waiting
        rank0.decide(lambda: 1 / 0)
    assert rank0.sent == [(None, "division by zero")]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("workers", 0, "MergeOptions.workers must be an integer of at least 1, got 0"),
        ("workers", True, "MergeOptions.workers must be an integer of at least 1, got True"),
        ("threads", 0, "--threads must be at least 1, got 0"),
        ("dtype", "int7", "unknown MergeOptions.dtype 'int7' (choose from"),
        ("dtype", 16, "MergeOptions.dtype must be a dtype (torch.bfloat16, 'bf16', ...) or None, got 16"),
        ("output_format", "xyz", "MergeOptions.output_format must be one of safetensors, dcp, pt, got 'xyz'"),
        ("shard_size", "lots", "cannot parse MergeOptions.shard_size 'lots'"),
        ("shard_size", 2.5, "MergeOptions.shard_size must be a byte count"),
        ("chunk_bytes", None, "MergeOptions.chunk_bytes must be a byte count"),
        ("keys", "model.*", "MergeOptions.keys must be a KeyFilter, got 'model.*'"),
        ("force", "yes", "MergeOptions.force must be True or False, got 'yes'"),
    ],
)
def test_merge_options_are_checked_when_built(field: str, value: object, message: str) -> None:
    with pytest.raises(CkptavgError) as info:
        MergeOptions(**{field: value})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_merge_options_take_the_command_lines_spellings(tmp_path: Path) -> None:
    """``dtype="bf16"`` (the hook's config takes it too), sizes as text, a format in any case:
    the same options as their typed spellings, and a merge that runs with them."""
    spelled = MergeOptions(dtype="bf16", shard_size="1KB", chunk_bytes="1MiB", output_format="DCP")
    assert spelled == MergeOptions(dtype=torch.bfloat16, shard_size=1000, chunk_bytes=2**20, output_format="dcp")
    make_run(tmp_path / "run", [1, 2], {"a": (64,), "b": (64,)}, dtype=torch.float32)
    ckptavg.merge(str(tmp_path / "run"), last=2, out=str(tmp_path / "out"), options=spelled)
    assert verify(str(tmp_path / "out")).tensors_checked == 2
