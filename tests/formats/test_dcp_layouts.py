"""DCP saved in every layout a sharded run writes merges to the bytes of the whole-tensor save, in
few reads: tensor-parallel columns (``Shard(1)``) by 2 and 4 gloo processes, a 2-D mesh with
uneven chunks and two files per rank (chunks in another order than the keys), row shards; and
the reassembly underneath (:class:`ckptavg.formats.blocks.Geometry`) against a reference."""

from __future__ import annotations

import itertools
import math
import random
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_builders import (
    DTensorRun,
    dtensor_weights,
    read_dcp_metadata,
    write_dtensor_dcp_runs,
    write_whole_dcp_run,
)
from references import correctly_rounded, load_merged, same_bits

import ckptavg
from ckptavg.errors import CheckpointError
from ckptavg.formats import blocks, open_checkpoint, torch_save
from ckptavg.formats.blocks import Geometry, StoredBlock
from ckptavg.io.files import RandomAccessFile
from ckptavg.io.fs import resolve
from ckptavg.merging import kernel

STEPS = (10, 20, 30)
COLUMNS = {"wide": (1,), "cols": (1,), "odd": (1,), "cube": (2,), "vec": (0,)}
LAYOUTS = {
    "columns-2": (2, DTensorRun("", (2,), COLUMNS)),
    "columns-4": (4, DTensorRun("", (4,), COLUMNS)),
    # rows x columns, columns x rows; a vector sharded on one mesh dimension, replicated on the
    # other. (A 3-D tensor split on both of its last two dimensions costs a read per index over
    # its first, and is left to the reassembly's own test below.)
    "mesh-2x2": (
        4,
        DTensorRun("", (2, 2), {"wide": (0, 1), "cols": (1, 0), "odd": (0, 1), "cube": (0, 2), "vec": (0, None)}, 2),
    ),
    "rows-4": (4, DTensorRun("", (4,), {})),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each layout's run of STEPS (two spawns: 2 and 4 processes), and the whole-tensor run."""
    root = tmp_path_factory.mktemp("dcp-layouts")
    found = {"whole": root / "whole"}
    write_whole_dcp_run(found["whole"], STEPS)
    for world in (2, 4):
        chosen = {name: run for name, (size, run) in LAYOUTS.items() if size == world}
        specs = [DTensorRun(root / name, run.mesh, run.placements, run.files_per_rank) for name, run in chosen.items()]
        write_dtensor_dcp_runs(specs, world, STEPS)
        found.update({name: root / name for name in chosen})
    return found


def _chunks(folder: Path) -> int:
    metadata = read_dcp_metadata(folder)
    return sum(len(entry.chunks) for entry in metadata.state_dict_metadata.values() if hasattr(entry, "chunks"))


class _Counted:
    """Counts the reads of ``.distcp`` files and the bytes they read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads = self.bytes = 0
        original = RandomAccessFile.read_into

        def read_into(file: RandomAccessFile, offset: int, buffer: memoryview) -> None:
            if file.path.endswith(".distcp"):
                self.reads += 1
                self.bytes += len(buffer)
            original(file, offset, buffer)

        monkeypatch.setattr(RandomAccessFile, "read_into", read_into)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_dcp_merges_to_the_whole_saves_bytes_in_few_reads(runs, layout, tmp_path, monkeypatch):
    """The merge of each layout is bit-identical to the merge of the whole-tensor save and to the
    correctly rounded float64 mean; a chunk costs at most three reads per source (its archive's
    two ends, its data: no read per row of a column-split chunk)."""
    ckptavg.merge(str(runs["whole"]), last=3, out=str(tmp_path / "whole"))
    counted = _Counted(monkeypatch)
    ckptavg.merge(str(runs[layout]), last=3, out=str(tmp_path / layout))
    chunks = sum(_chunks(runs[layout] / f"step-{step}") for step in STEPS)
    assert 0 < counted.reads <= 3 * chunks
    whole, merged = load_merged(tmp_path / "whole"), load_merged(tmp_path / layout)
    assert set(merged) == set(whole) == set(dtensor_weights(10))
    for name, tensor in merged.items():
        saved = [dtensor_weights(step)[name] for step in STEPS]
        expected = correctly_rounded(torch.stack([t.double() for t in saved]).mean(0), saved[0].dtype)
        assert bool(same_bits(tensor, whole[name]).all()), name
        assert bool(same_bits(tensor, expected).all()), name


def test_a_dcp_items_archive_is_read_at_its_two_ends_and_each_pickle_unpickled_once(runs, monkeypatch):
    """Listing where each chunk's bytes lie reads at most 4 KiB at each end of its torch.save
    archive (not 64 KiB blocks, which cost more than a small chunk's data), and unpickles each
    distinct pickle once per checkpoint (a key's chunks share theirs), not once per chunk."""
    folder = runs["rows-4"] / "step-10"
    unpickled = []
    original = torch_save.restricted_loads
    monkeypatch.setattr(
        torch_save, "restricted_loads", lambda data, *a, **k: unpickled.append(data) or original(data, *a, **k)
    )
    counted = _Counted(monkeypatch)
    reader = open_checkpoint(*resolve(str(folder)))
    try:
        for info in reader.tensors():
            reader.read_into(info.name, 0, memoryview(bytearray(info.nbytes)))
            assert counted.reads  # each key read through the counted files
        data = sum(info.nbytes for info in reader.tensors())
    finally:
        reader.close()
    chunks = _chunks(folder)
    assert counted.bytes <= data + chunks * 2 * 4096
    assert len(unpickled) == len(set(unpickled)) < chunks


def test_each_distinct_item_layout_is_parsed_once_per_checkpoint(runs, monkeypatch):
    """The chunks of a many-rank save come in a few layouts (one per chunk shape and dtype):
    each layout's zip directory is parsed once per checkpoint, and every other chunk of it is
    recognised by comparing bytes, to the same place of its tensor's bytes."""
    folder = runs["rows-4"] / "step-10"
    parsed = []
    original = torch_save._central_directory
    monkeypatch.setattr(torch_save, "_central_directory", lambda tail, *a: parsed.append(tail) or original(tail, *a))
    reader = open_checkpoint(*resolve(str(folder)))
    try:
        for info in reader.tensors():
            reader.read_into(info.name, 0, memoryview(bytearray(info.nbytes)))
    finally:
        reader.close()
    metadata = read_dcp_metadata(folder)
    layouts = {
        (metadata.storage_data[index].length, key.properties.dtype, tuple(chunk.sizes))
        for name, key in metadata.state_dict_metadata.items()
        if hasattr(key, "chunks")
        for chunk in key.chunks
        if 0 not in chunk.sizes  # an empty chunk is never read
        for index in metadata.storage_data
        if index.fqn == name and tuple(index.offset) == tuple(chunk.offsets)
    }
    assert len(parsed) == len(layouts) < _chunks(folder)


def test_the_items_of_a_data_file_are_located_in_one_pass_one_read_each(runs, monkeypatch):
    """On the first read of any of its chunks, a ``.distcp``'s items are located together in file
    order: the tail of one item and the head of the next (side by side) are one read, so a chunk
    costs one read to locate and one for its data, where it cost two and one."""
    folder = runs["rows-4"] / "step-10"
    counted = _Counted(monkeypatch)
    reader = open_checkpoint(*resolve(str(folder)))
    try:
        for info in reader.tensors():
            reader.read_into(info.name, 0, memoryview(bytearray(info.nbytes)))
    finally:
        reader.close()
    chunks, files = _chunks(folder), len(list(folder.glob("*.distcp")))
    assert files < chunks
    assert counted.reads <= 2 * chunks + files  # located: one read per item and per file; data: one per chunk


def test_a_damaged_item_is_refused_when_it_is_read_not_with_its_files_other_items(runs, tmp_path):
    """Items are located a file at a time, but each keeps its own result: another key's chunks in
    the same file still read, and the damaged one is refused in one line naming its file and key."""
    folder = tmp_path / "step-10"
    shutil.copytree(runs["rows-4"] / "step-10", folder)
    metadata = read_dcp_metadata(folder)
    victim = next(index for index in metadata.storage_data if index.fqn == "wide")
    stored = metadata.storage_data[victim]
    path = folder / stored.relative_path
    data = bytearray(path.read_bytes())
    data[stored.offset + stored.length - 22 : stored.offset + stored.length - 18] = b"XXXX"  # its end record
    path.write_bytes(bytes(data))
    others = {
        index.fqn
        for index in metadata.storage_data
        if metadata.storage_data[index].relative_path == stored.relative_path
    }
    reader = open_checkpoint(*resolve(str(folder)))
    try:
        for info in reader.tensors():
            if info.name != "wide":
                reader.read_into(info.name, 0, memoryview(bytearray(info.nbytes)))
        with pytest.raises(CheckpointError) as caught:
            reader.read_into("wide", 0, memoryview(bytearray(16)))
    finally:
        reader.close()
    assert others - {"wide"}  # the file holds other keys' items, read above
    message = str(caught.value)
    assert "\n" not in message and stored.relative_path in message and "'wide'" in message


# --- the reassembly itself ------------------------------------------------------------------------


class _Memory:
    """Bytes read by position, counting the reads."""

    def __init__(self, data: bytes) -> None:
        self.data, self.reads = data, 0

    def read_into(self, offset: int, buffer: memoryview) -> None:
        assert offset + len(buffer) <= len(self.data)
        self.reads += 1
        buffer[:] = self.data[offset : offset + len(buffer)]


def _cuts(extent: int, parts: int, rng: random.Random) -> list[tuple[int, int]]:
    points = sorted(rng.sample(range(1, extent), min(parts, extent) - 1))
    bounds = [0, *points, extent]
    return [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(len(bounds) - 1)]


def _stored(full: torch.Tensor, grid: list[list[tuple[int, int]]], rng: random.Random) -> tuple[_Memory, list]:
    """The boxes of ``grid`` in a shuffled order in one file, bytes of padding between them."""
    data, placed = bytearray(b"\xee" * rng.randint(0, 9)), []
    cells = list(itertools.product(*grid))
    rng.shuffle(cells)
    for cell in cells:
        box = full[tuple(slice(o, o + s) for o, s in cell)].contiguous()
        placed.append((tuple(o for o, _ in cell), tuple(s for _, s in cell), len(data)))
        data += box.view(torch.uint8).flatten().numpy().tobytes() + b"\xdd" * rng.randint(0, 3)
    memory = _Memory(bytes(data))
    return memory, [StoredBlock(memory, offsets, sizes, start) for offsets, sizes, start in placed]


@pytest.mark.parametrize("seed", range(6))
def test_any_range_of_any_grid_reads_the_tensors_bytes(seed, monkeypatch):
    """Random shapes (1-4 dimensions), grids cut on any dimensions, boxes stored in any order,
    any element range: the bytes are the tensor's. Scratch buffer and copies made tiny, so that
    pieces are read in many parts and copied in many slices."""
    monkeypatch.setattr(blocks, "SCRATCH_BYTES", 24)
    monkeypatch.setattr(blocks, "COPY_ELEMENTS", 5)
    rng = random.Random(seed)
    for _ in range(150):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 4)))
        dtype = rng.choice([torch.bfloat16, torch.float32, torch.int8, torch.float64])
        full = (torch.arange(math.prod(shape)) % 251).to(dtype).reshape(shape)
        grid = [_cuts(extent, rng.randint(1, 3), rng) for extent in shape]
        _, stored = _stored(full, grid, rng)
        geometry = Geometry(shape, stored)
        expected = full.view(torch.uint8).flatten().numpy().tobytes() if full.numel() else b""
        item = full.element_size()
        for _ in range(6):
            first = rng.randrange(full.numel())
            end = rng.randint(first + 1, full.numel())
            buffer = bytearray(b"\x00" * ((end - first) * item))
            geometry.read_into(item, first * item, memoryview(buffer))
            assert bytes(buffer) == expected[first * item : end * item], (shape, grid, first, end)


def test_column_blocks_are_read_in_one_read_each():
    """A matrix split on its columns (tensor parallelism) is read with one read per block and
    range, whatever its number of rows, where a read per row took 1000 here."""
    rows, widths = 500, [(0, 24), (24, 40)]
    full = torch.randn(rows, 64).bfloat16()
    memory, stored = _stored(full, [[(0, rows)], widths], random.Random(0))
    buffer = bytearray(full.numel() * 2)
    Geometry(tuple(full.shape), stored).read_into(2, 0, memoryview(buffer))
    assert memory.reads == len(widths)
    assert bytes(buffer) == full.view(torch.uint8).flatten().numpy().tobytes()


def test_the_copy_slices_stay_within_atens_grain():
    """Reader threads copy rows in slices that run inline (no OpenMP team in a reader thread)."""
    assert blocks.COPY_ELEMENTS == kernel.INLINE_ELEMENTS
