"""DCP saved in every layout a sharded run writes merges to the bytes of the whole-tensor save, in
few reads: tensor-parallel columns (``Shard(1)``) by 2 and 4 gloo processes, a 2-D mesh with
uneven chunks and two files per rank (chunks in another order than the keys), row shards; and
the reassembly underneath (:class:`ckptavg.formats.blocks.Geometry`) against a reference."""

from __future__ import annotations

import ctypes
import itertools
import math
import os
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
from ckptavg.io import files
from ckptavg.io.files import RandomAccessFile
from ckptavg.io.fs import resolve
from ckptavg.merging import kernel
from ckptavg.merging.distributed import PAGE_BYTES

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
    """Counts the reads of ``.distcp`` files (plain and vectored) and the bytes they read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads = self.bytes = self.vectored = 0
        plain, vectored = RandomAccessFile.read_into, RandomAccessFile.scatter_into

        def read_into(file: RandomAccessFile, offset: int, buffer: memoryview) -> None:
            if file.path.endswith(".distcp"):
                self.reads += 1
                self.bytes += len(buffer)
            plain(file, offset, buffer)

        def scatter_into(file: RandomAccessFile, offset: int, vectors: torch.Tensor) -> None:
            self.reads += 1
            self.vectored += 1
            self.bytes += int(vectors[:, 1].sum())
            vectored(file, offset, vectors)

        monkeypatch.setattr(RandomAccessFile, "read_into", read_into)
        monkeypatch.setattr(RandomAccessFile, "scatter_into", scatter_into)


def _assert_merged_as_whole(runs: dict[str, Path], layout: str, folder: Path) -> None:
    """The merge of ``layout`` in ``folder`` is bit-identical to the merge of the whole-tensor
    save and to the correctly rounded float64 mean."""
    ckptavg.merge(str(runs["whole"]), last=3, out=str(folder / "whole"))
    whole, merged = load_merged(folder / "whole"), load_merged(folder / layout)
    assert set(merged) == set(whole) == set(dtensor_weights(10))
    for name, tensor in merged.items():
        saved = [dtensor_weights(step)[name] for step in STEPS]
        expected = correctly_rounded(torch.stack([t.double() for t in saved]).mean(0), saved[0].dtype)
        assert bool(same_bits(tensor, whole[name]).all()), name
        assert bool(same_bits(tensor, expected).all()), name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_dcp_merges_to_the_whole_saves_bytes_in_few_reads(runs, layout, tmp_path, monkeypatch):
    """The merge of each layout is bit-identical to the merge of the whole-tensor save and to the
    correctly rounded float64 mean; a chunk costs at most three reads per source (its archive's
    two ends, its data: no read per row of a column-split chunk)."""
    counted = _Counted(monkeypatch)
    ckptavg.merge(str(runs[layout]), last=3, out=str(tmp_path / layout))
    chunks = sum(_chunks(runs[layout] / f"step-{step}") for step in STEPS)
    assert 0 < counted.reads <= 3 * chunks
    _assert_merged_as_whole(runs, layout, tmp_path)


@pytest.mark.parametrize("layout", ["columns-2", "columns-4", "mesh-2x2"])
def test_column_rows_read_straight_into_place_merge_to_the_whole_saves_bytes(runs, layout, tmp_path, monkeypatch):
    """Every row of a column-split chunk read as a ``preadv`` vector into its place in the
    output (the path of rows of 2 KiB and more; these are narrower), 5 vectors a call: the merge
    is still bit-identical to the whole-tensor save's and to the float64 mean."""
    monkeypatch.setattr(blocks, "SCATTER_ROW_BYTES", 1)
    monkeypatch.setattr(blocks, "IOV_MAX", 5)
    counted = _Counted(monkeypatch)
    ckptavg.merge(str(runs[layout]), last=3, out=str(tmp_path / layout))
    assert counted.vectored > 0
    _assert_merged_as_whole(runs, layout, tmp_path)


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


def _read_every_tensor(folder: Path) -> None:
    """Open the checkpoint in ``folder`` and read each of its tensors whole, once."""
    reader = open_checkpoint(*resolve(str(folder)))
    try:
        for info in reader.tensors():
            reader.read_into(info.name, 0, memoryview(bytearray(info.nbytes)))
    finally:
        reader.close()


def test_each_distinct_item_layout_is_parsed_once_per_checkpoint(runs, monkeypatch):
    """The chunks of a many-rank save come in a few layouts (one per chunk shape and dtype):
    each layout's zip directory is parsed once per checkpoint, and every other chunk of it is
    recognised by comparing bytes, to the same place of its tensor's bytes."""
    folder = runs["rows-4"] / "step-10"
    parsed = []
    original = torch_save._central_directory
    monkeypatch.setattr(torch_save, "_central_directory", lambda tail, *a: parsed.append(tail) or original(tail, *a))
    _read_every_tensor(folder)
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
    _read_every_tensor(folder)
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


def _assert_ranges_read_as_stored(geometry: Geometry, full: torch.Tensor, rng: random.Random, grid: object) -> None:
    """Six random element ranges of ``full`` read through ``geometry``: each the tensor's bytes."""
    expected = full.view(torch.uint8).flatten().numpy().tobytes()
    item = full.element_size()
    for _ in range(6):
        first = rng.randrange(full.numel())
        end = rng.randint(first + 1, full.numel())
        buffer = bytearray(b"\x00" * ((end - first) * item))
        geometry.read_into(item, first * item, memoryview(buffer))
        assert bytes(buffer) == expected[first * item : end * item], (full.shape, grid, first, end)


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
        _assert_ranges_read_as_stored(Geometry(shape, stored), full, rng, grid)


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


# --- rows read straight into place (preadv vectors) ----------------------------------------------


def _local(memory: _Memory, stored: list[StoredBlock], folder: Path) -> tuple[RandomAccessFile, list[StoredBlock]]:
    """The same blocks, in a local file: the store whose rows are read straight into place."""
    path = folder / "blocks.bin"
    path.write_bytes(memory.data)
    file = RandomAccessFile(*resolve(str(path)))
    return file, [StoredBlock(file, b.offsets, b.sizes, b.data_start) for b in stored]


class _Scatters:
    """Counts the vectored reads (``scatter_into``) and the plain ones of the file."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = self.plain = 0
        scatter, plain = RandomAccessFile.scatter_into, RandomAccessFile.read_into

        def counted_scatter(file: RandomAccessFile, offset: int, vectors: torch.Tensor) -> None:
            self.calls += 1
            scatter(file, offset, vectors)

        def counted_plain(file: RandomAccessFile, offset: int, buffer: memoryview) -> None:
            self.plain += 1
            plain(file, offset, buffer)

        monkeypatch.setattr(RandomAccessFile, "scatter_into", counted_scatter)
        monkeypatch.setattr(RandomAccessFile, "read_into", counted_plain)


@pytest.mark.parametrize("seed", range(4))
def test_any_range_of_any_grid_is_read_straight_into_place_from_a_local_file(seed, tmp_path, monkeypatch):
    """Random shapes (1-4 dimensions, odd widths), grids on any dimensions, any element range
    (a process's share starts and ends mid-row): with every row read as a ``preadv`` vector into
    its place, 3 vectors a call, the bytes are the tensor's."""
    monkeypatch.setattr(blocks, "SCATTER_ROW_BYTES", 1)
    monkeypatch.setattr(blocks, "IOV_MAX", 3)
    counted = _Scatters(monkeypatch)
    rng = random.Random(seed)
    for _ in range(40):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(2, 4)))
        dtype = rng.choice([torch.bfloat16, torch.float32, torch.int8, torch.float64])
        full = (torch.arange(math.prod(shape)) % 251).to(dtype).reshape(shape)
        grid = [_cuts(extent, rng.randint(1, 3), rng) for extent in shape]
        file, stored = _local(*_stored(full, grid, rng), tmp_path)
        with file:
            _assert_ranges_read_as_stored(Geometry(shape, stored), full, rng, grid)
    assert counted.calls > 0


def test_a_process_share_of_a_column_split_tensor_is_read_straight_into_place(tmp_path, monkeypatch):
    """Rows of 2 KiB and more are read straight into place by default; a tensor cut at output
    pages between two processes (``distributed.split_output``'s cuts fall mid-row) reads, half by
    half, the tensor's bytes, its 3 column blocks in one vectored read each per half."""
    rows, widths = 37, [(0, 1100), (1100, 1024), (2124, 1030)]  # rows of 2,200, 2,048, 2,060 bytes
    full = torch.randn(rows, 3154, dtype=torch.float64).bfloat16()
    file, stored = _local(*_stored(full, [[(0, rows)], widths], random.Random(1)), tmp_path)
    counted = _Scatters(monkeypatch)
    cut = full.numel() * 2 // 2 // PAGE_BYTES * PAGE_BYTES
    buffer = bytearray(full.numel() * 2)
    with file:
        geometry = Geometry(tuple(full.shape), stored)
        geometry.read_into(2, 0, memoryview(buffer)[:cut])
        geometry.read_into(2, cut, memoryview(buffer)[cut:])
    assert bytes(buffer) == full.view(torch.uint8).flatten().numpy().tobytes()
    # one vectored read per block and half; the block whose row the cut falls in reads its cut
    # row's part on each side as one plain read
    assert counted.calls == 2 * len(widths) and counted.plain == 2


def test_the_groups_of_a_block_of_a_3d_tensor_share_vectored_reads(tmp_path, monkeypatch):
    """A 3-D tensor split on its last two dimensions: a block's runs for each index over its
    first dimension follow one another in the file, so they are read together (one ``preadv``
    per block here), not one read per index."""
    monkeypatch.setattr(blocks, "SCATTER_ROW_BYTES", 1)
    full = torch.randn(64, 6, 10, dtype=torch.float64).float()
    grid = [[(0, 64)], [(0, 3), (3, 3)], [(0, 4), (4, 6)]]
    file, stored = _local(*_stored(full, grid, random.Random(2)), tmp_path)
    counted = _Scatters(monkeypatch)
    buffer = bytearray(full.numel() * 4)
    with file:
        Geometry(tuple(full.shape), stored).read_into(4, 0, memoryview(buffer))
    assert bytes(buffer) == full.view(torch.uint8).flatten().numpy().tobytes()
    assert counted.calls == 4  # one per block: 64 * 3 = 192 rows each, within IOV_MAX


@pytest.mark.parametrize(
    ("at", "rows", "row_bytes", "stride"), [(0, 3, 20, 30), (-1, 1, 4, 4), (0, 2, 20, 10), (60, 1, 20, 20)]
)
def test_rows_that_would_overrun_the_buffer_are_refused_before_any_read(at, rows, row_bytes, stride):
    """The kernel writes where the vectors point, unchecked: rows past the buffer's end (the
    last of 3 rows 30 apart ends at 80 of 70 bytes), before its start, or overlapping one another
    are an error of the layout's arithmetic, raised before anything is read or written."""
    buffer = bytearray(70)
    with pytest.raises(RuntimeError, match="overrun"):
        blocks._RowReads(memoryview(buffer)).add(object(), 0, at, rows, row_bytes, stride)  # type: ignore[arg-type]
    assert buffer == bytearray(70)


def test_short_reads_resume_inside_a_row(tmp_path, monkeypatch):
    """A ``preadv`` that returns fewer bytes than asked (a signal, a file system's limit), cut
    inside a vector: the read goes on from that byte, and the bytes are the tensor's."""
    monkeypatch.setattr(blocks, "SCATTER_ROW_BYTES", 1)
    real, short = files._preadv, []

    def preadv(fd: int, address: int, count: int, offset: int) -> int:
        vectors = torch.frombuffer((ctypes.c_int64 * (2 * count)).from_address(address), dtype=torch.int64)
        vectors = vectors.view(count, 2).clone()
        limit = 13  # bytes a call: cuts rows of 12 and 14 bytes
        ends = vectors[:, 1].cumsum(0)
        keep = min(count, int(torch.searchsorted(ends, limit)) + 1)  # the vectors it fills, some
        vectors = vectors[:keep].clone()
        vectors[-1, 1] -= int(vectors[:, 1].sum()) - min(limit, int(ends[-1]))
        short.append(int(vectors[:, 1].sum()) < int(ends[-1]))
        return real(fd, vectors.data_ptr(), keep, offset)

    monkeypatch.setattr(files, "_preadv", preadv)
    full = torch.randn(20, 13, dtype=torch.float64).bfloat16()
    file, stored = _local(*_stored(full, [[(0, 20)], [(0, 6), (6, 7)]], random.Random(3)), tmp_path)
    buffer = bytearray(full.numel() * 2)
    with file:
        Geometry(tuple(full.shape), stored).read_into(2, 6, memoryview(buffer)[6:])
    assert bytes(buffer)[6:] == full.view(torch.uint8).flatten().numpy().tobytes()[6:]
    assert any(short)


def test_a_file_cut_short_under_a_vectored_read_is_one_error_naming_it(tmp_path, monkeypatch):
    """The file shrinks after it was opened (another process truncates it): the vectored read
    ends early and says where, naming the file; nothing is retried forever."""
    monkeypatch.setattr(blocks, "SCATTER_ROW_BYTES", 1)
    full = torch.randn(40, 16, dtype=torch.float64).float()
    file, stored = _local(*_stored(full, [[(0, 40)], [(0, 8), (8, 8)]], random.Random(4)), tmp_path)
    with file:
        os.truncate(file.path, file.size // 2)
        with pytest.raises(CheckpointError, match=r"blocks\.bin: file ended early at offset \d+"):
            Geometry(tuple(full.shape), stored).read_into(4, 0, memoryview(bytearray(full.numel() * 4)))


def test_the_scratch_buffer_starts_on_a_page():
    """Rows narrower than the vectored reads' threshold go through scratch, which the kernel
    fills fastest page-aligned."""
    for size in (100, 5000, 2**20):
        scratch = blocks._scratch_bytes(size)
        assert len(scratch) == size
        assert ctypes.addressof(ctypes.c_char.from_buffer(scratch)) % 4096 == 0


@pytest.mark.parametrize("local", [True, False], ids=["local-file", "other-store"])
def test_any_box_of_any_grid_reads_the_boxs_bytes(local, tmp_path, monkeypatch):
    """A process's own box of a tensor stored in other boxes (a resume under another layout;
    ``PartsReader.read_block``): random shapes, grids and boxes, from a local file (every run a
    vector, 3 a call) and from a store that can only read; the bytes are the box's."""
    monkeypatch.setattr(blocks, "IOV_MAX", 3)
    rng = random.Random(7)
    for _ in range(60):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 4)))
        dtype = rng.choice([torch.bfloat16, torch.float32, torch.int8])
        full = (torch.arange(math.prod(shape)) % 251).to(dtype).reshape(shape)
        grid = [_cuts(extent, rng.randint(1, 3), rng) for extent in shape]
        memory, stored = _stored(full, grid, rng)
        file, stored = _local(memory, stored, tmp_path) if local else (None, stored)
        box = [sorted(rng.sample(range(extent + 1), 2)) if extent > 1 else [0, 1] for extent in shape]
        offsets, sizes = [lo for lo, _ in box], [hi - lo for lo, hi in box]
        expected = full[tuple(slice(lo, hi) for lo, hi in box)].contiguous()
        buffer = bytearray(expected.numel() * full.element_size())
        Geometry(shape, stored).read_box(full.element_size(), offsets, sizes, memoryview(buffer))
        if file is not None:
            file.close()
        assert bytes(buffer) == expected.view(torch.uint8).flatten().numpy().tobytes(), (shape, grid, box)


def test_a_box_that_is_a_stored_block_is_one_vectored_read(tmp_path, monkeypatch):
    """A resume under the layout that saved: its box is one stored block of a column-split
    matrix, 300 rows of 48 bytes, read in one ``preadv`` (it took one read per row)."""
    full = torch.randn(300, 64, dtype=torch.float64).float()
    file, stored = _local(*_stored(full, [[(0, 300)], [(0, 12), (12, 52)]], random.Random(5)), tmp_path)
    counted = _Scatters(monkeypatch)
    out = torch.empty(300, 12)
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    with file:
        Geometry(tuple(full.shape), stored).read_box(4, (0, 0), (300, 12), view)
    assert bool(same_bits(out, full[:, :12]).all())
    assert counted.calls == 1 and counted.plain == 0
