"""Several processes share a merge by bytes, not by whole output files: a one-file output and
uneven small shards alike give each of 2 processes half the work (byte ranges of shared files
written in place), the output byte-identical to one process's; a failing or killed process
leaves nothing published, and a resume reuses the ranges the interrupted run finished."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_run, run_cli, torchrun, write_checkpoint
from hypothesis import given
from hypothesis import strategies as st
from references import assert_equal, load_merged, reference
from test_distributed_merge import srun

from ckptavg.errors import OutputError
from ckptavg.formats.layout import ShardPart, ShardSpec, TensorSpec, layout_shards
from ckptavg.formats.writers.safetensors import SafetensorsOutput, build_header
from ckptavg.io.fs import resolve
from ckptavg.merging.distributed import PAGE_BYTES, assign_shards, split_output

# ~1.6 MB of bf16 per checkpoint, tensors of uneven sizes: pages (4 KiB) are a fraction of a share.
SHAPES = {f"model.layers.{i}.w": (256, 64 + 64 * i) for i in range(10)}
STEPS = [10, 20, 30]
# One file; and 3 files of 491-685 KB that whole-file assignment splits 685 KB / 1113 KB.
LAYOUTS = {"one-file": [], "small-shards": ["--shard-size", "700KB"]}


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def header_size(shard: ShardSpec) -> int:
    return len(build_header(shard))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("balance") / "run"
    return root, make_run(root, STEPS, SHAPES, shards=2)


def _spread(values: list[int]) -> float:
    return max(values) / min(values)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_processes_each_do_half_the_work_and_write_the_bytes_of_one(run, tmp_path, layout):
    root, saved = run
    args = ["merge", str(root), "--last", "3", "--json", *LAYOUTS[layout]]
    assert run_cli(*args, "--out", str(tmp_path / "one")).returncode == 0
    files = sorted((tmp_path / "one").glob("*.safetensors"))
    if len(files) > 1:  # the case is one that whole files cannot balance
        as_files = [ShardSpec(f.name, (TensorSpec(f.name, torch.uint8, (f.stat().st_size,)),)) for f in files]
        assert _spread([sum(s.nbytes for s in share) for share in assign_shards(as_files, 2)]) > 1.5
    result = torchrun(2, *args, "--out", str(tmp_path / "two"))
    assert result.returncode == 0, result.stderr
    assert "some have nothing to do" not in result.stderr
    processes = json.loads(result.stdout[result.stdout.index("{") :])["processes"]
    assert len(processes) == 2
    read, written = [p["bytes_read"] for p in processes], [p["bytes_written"] for p in processes]
    total = sum(t.numel() * 2 for t in saved[10].values())
    assert sum(written) == total and sum(read) == 3 * total  # every byte once, by one process
    assert _spread(read) <= 1.1 and _spread(written) <= 1.1, processes
    assert digests(tmp_path / "two") == digests(tmp_path / "one")  # the manifest's sha256 included
    assert_equal(load_merged(tmp_path / "two"), reference(saved, STEPS))


@given(
    st.lists(st.integers(1, 3 * 10**5), min_size=1, max_size=12),
    st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.uint8]),
    st.integers(1, 10**6),
    st.integers(2, 9),
)
def test_shares_tile_every_file_on_pages_and_are_equal_to_a_page(sizes, dtype, shard_size, world):
    specs = [TensorSpec(f"t{i}", dtype, (n,)) for i, n in enumerate(sizes)]
    shards = layout_shards(specs, shard_size)
    shares = split_output(shards, world, header_size)
    assert shares == split_output(shards, world, header_size)  # every process computes the same
    total = sum(header_size(s) + s.nbytes for s in shards)
    elements: dict[str, list[tuple[int, int]]] = {spec.name: [] for spec in specs}
    ranges: dict[str, list[tuple[int, int]]] = {s.file_name: [] for s in shards}
    for share in shares:
        file_bytes = 0
        for piece in share:
            if isinstance(piece, ShardPart):
                ranges[piece.file_name].append((piece.start, piece.stop))
                assert piece.start % PAGE_BYTES == 0 or piece.start == 0
                assert piece.stop % PAGE_BYTES == 0 or piece.stop == piece.size
                file_bytes += piece.stop - piece.start
            else:
                ranges[piece.file_name].append((0, header_size(piece) + piece.nbytes))
                file_bytes += header_size(piece) + piece.nbytes
            for spec, first, end in piece.ranges():
                elements[spec.name].append((first, end))
        # Each cut moved back by less than a page: a share is within a page of an equal one.
        assert abs(file_bytes - total / world) < PAGE_BYTES + 1
    for shard in shards:  # every byte of every file, once, in order
        pieces = ranges[shard.file_name]
        assert pieces[0][0] == 0 and pieces[-1][1] == header_size(shard) + shard.nbytes
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
    for spec in specs:  # every element of every tensor, once, in order
        covered = elements[spec.name]
        assert covered[0][0] == 0 and covered[-1][1] == spec.shape[0]
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))


def test_outputs_no_process_can_write_in_ranges_keep_whole_files():
    """An object store takes uploads, not positional writes; ``.pt`` and DCP files are
    ``torch.save``'s: their processes share whole files."""
    shards = layout_shards([TensorSpec(f"t{i}", torch.float32, (1000 + i,)) for i in range(5)], 4000)
    fs, path = resolve("memory://balance/out")
    remote = SafetensorsOutput(fs, path, "memory://balance/out")
    assert remote.header_size(shards[0]) is None
    assert split_output(shards, 2, remote.header_size) == assign_shards(shards, 2)


def test_a_failing_process_of_a_shared_file_publishes_nothing(tmp_path):
    """Rank 1's range of the one output file holds a NaN: both exit 1 naming rank 1 and the
    tensor (rank 0 finished its range of the same file); no output, no hidden folder."""
    root = tmp_path / "run"
    saved = make_run(root, [10, 20], SHAPES)
    (layout,) = layout_shards([TensorSpec(k, torch.bfloat16, s) for k, s in SHAPES.items()], 5 * 10**9)
    second = split_output([layout], 2, header_size)[1][0]
    assert isinstance(second, ShardPart)
    spec, first, _ = second.ranges()[-1]
    broken = dict(saved[20])
    broken[spec.name] = broken[spec.name].clone()
    broken[spec.name].view(-1)[first + 5] = float("nan")
    write_checkpoint(root / "step20", broken)
    outcomes = srun(2, "merge", str(root), "--last", "2", "--out", str(tmp_path / "avg"))
    assert [code for code, _ in outcomes] == [1, 1], outcomes
    for _, stderr in outcomes:
        assert "rank 1 of 2 failed" in stderr and spec.name in stderr and "NaN" in stderr, stderr
        assert "Traceback" not in stderr
    assert not (tmp_path / "avg").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".avg.tmp-")]


_KILL_AFTER_FIRST_RANGE = (
    "import os, ckptavg.merging.journal as j\n"
    "original = j.Journal.record\n"
    "def record(self, name, *args):\n"
    "    original(self, name, *args)\n"
    "    if '@' in name: os._exit(9)\n"
    "j.Journal.record = record\n"
    "from ckptavg.cli import main; main()\n"
)
_KILL_IN_A_RANGE = (
    "import os, ckptavg.formats.writers.safetensors as w\n"
    "def write(self, data): os._exit(9)\n"
    "w.SafetensorsRangeWriter.write = write\n"
    "from ckptavg.cli import main; main()\n"
)


def test_processes_killed_in_and_after_their_ranges_resume_to_the_same_bytes(run, tmp_path):
    """A preempted job: rank 1 dies while writing its range of the one output file, and the
    others find it gone: nothing published. Then both die right after journaling their range
    (``os._exit``, no cleanup): a 2-process ``--resume`` reuses both ranges, and the output is the
    bytes of an uninterrupted one-process merge. A resume under 3 processes cuts the file
    elsewhere: it reuses nothing and writes the same bytes."""
    root, _ = run
    args = ["merge", str(root), "--last", "3"]
    assert run_cli(*args, "--out", str(tmp_path / "one")).returncode == 0
    expected = digests(tmp_path / "one")
    out = ["--out", str(tmp_path / "avg")]

    outcomes = srun(2, *args, *out, rank_prefix={1: [sys.executable, "-c", _KILL_IN_A_RANGE]})
    assert [code for code, _ in outcomes] == [1, 9], outcomes
    assert "lost contact with the other processes" in outcomes[0][1], outcomes[0][1]
    assert not (tmp_path / "avg").exists()

    killer = [sys.executable, "-c", _KILL_AFTER_FIRST_RANGE]
    outcomes = srun(2, *args, *out, "--resume", rank_prefix={0: killer, 1: killer})
    assert [code for code, _ in outcomes] == [9, 9], outcomes
    assert not (tmp_path / "avg").exists()
    outcomes = srun(2, *args, *out, "--resume")
    assert [code for code, _ in outcomes] == [0, 0], outcomes
    assert "reusing 2 byte ranges of the interrupted run" in outcomes[0][1], outcomes[0][1]
    assert digests(tmp_path / "avg") == expected
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".avg.tmp-")]

    outcomes = srun(2, *args, "--out", str(tmp_path / "three"), "--resume", rank_prefix={0: killer, 1: killer})
    assert [code for code, _ in outcomes] == [9, 9], outcomes
    outcomes = srun(3, *args, "--out", str(tmp_path / "three"), "--resume")
    assert [code for code, _ in outcomes] == [0, 0, 0], outcomes
    assert "reusing" not in outcomes[0][1]
    assert digests(tmp_path / "three") == expected


def _payload(shard: ShardSpec) -> bytes:
    return bytes(range(256)) * (shard.nbytes // 256) + bytes(shard.nbytes % 256)


def test_ranges_written_in_any_order_make_the_file_one_writer_makes_each_synced(tmp_path, monkeypatch):
    """The ranges of a file, written by their own writers (last first, as processes may), make
    the bytes of the whole-file writer; each range's handle is fsynced before it closes, and
    each returns the sha256 of its range."""
    (shard,) = layout_shards([TensorSpec(f"t{i}", torch.bfloat16, (3000 + 500 * i,)) for i in range(6)], 10**9)
    writer = SafetensorsOutput(*resolve(str(tmp_path)), str(tmp_path))
    data = _payload(shard)
    whole = writer.open_sink(ShardSpec("whole.safetensors", shard.tensors))
    whole.write(memoryview(data))
    whole.close()
    expected = (tmp_path / "whole.safetensors").read_bytes()
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    parts = split_output([shard], 3, writer.header_size)
    assert all(isinstance(p, ShardPart) for share in parts for p in share)
    for (part,) in reversed(parts):
        sink = writer.open_sink(part)
        offset = max(part.start, part.data_start) - part.data_start
        sink.write(memoryview(data)[offset : offset + part.nbytes])
        assert sink.close() == hashlib.sha256(expected[part.start : part.stop]).hexdigest()
    assert (tmp_path / shard.file_name).read_bytes() == expected
    assert len(synced) == 3


def test_a_range_is_never_written_through_a_link(tmp_path):
    (shard,) = layout_shards([TensorSpec("t", torch.float32, (5000,))], 10**9)
    writer = SafetensorsOutput(*resolve(str(tmp_path)), str(tmp_path))
    (part,), _ = split_output([shard], 2, writer.header_size)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (tmp_path / shard.file_name).symlink_to(victim)
    with pytest.raises(OutputError, match=f"cannot create .*{shard.file_name}"):
        writer.open_sink(part)
    (tmp_path / shard.file_name).unlink()
    (tmp_path / shard.file_name).hardlink_to(victim)
    with pytest.raises(OutputError, match="not a file of its own"):
        writer.open_sink(part)
    assert victim.read_bytes() == b"keep"


def test_two_processes_cut_a_file_of_small_tensors_inside_a_run(tmp_path):
    """Runs of small tensors (read and averaged as one step) and a process's share cut inside
    one of them: each process averages its part of the cut tensor alone, the rest in runs, and
    the file is the one process's, byte for byte."""
    shapes = {f"model.experts.{i}.w": (8, 40 + 8 * (i % 7)) for i in range(300)}  # 640-1408 bytes
    saved = make_run(tmp_path / "run", STEPS, shapes)
    args = ["merge", str(tmp_path / "run"), "--last", "3", "--json"]
    assert run_cli(*args, "--out", str(tmp_path / "one")).returncode == 0
    result = torchrun(2, *args, "--out", str(tmp_path / "two"))
    assert result.returncode == 0, result.stderr
    written = [p["bytes_written"] for p in json.loads(result.stdout[result.stdout.index("{") :])["processes"]]
    # The file's bytes are shared, its header (~20 KB for 300 names) in the first share.
    (file,) = (tmp_path / "two").glob("*.safetensors")
    header = file.stat().st_size - sum(written)
    assert abs(written[0] + header - written[1]) <= 2 * PAGE_BYTES, (header, written)  # cut moved back < a page
    assert digests(tmp_path / "two") == digests(tmp_path / "one")
    assert_equal(load_merged(tmp_path / "two"), reference(saved, STEPS))
