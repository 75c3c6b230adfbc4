"""Tensors stored as blocks: put full tensors back together, byte range by byte range.

A sharded checkpoint (the hook's rank files, a DCP folder) stores each tensor as boxes of its
full row-major shape, one per process or shard. The merge engine asks for flat byte ranges of
the full tensor; :class:`Geometry` maps a range to contiguous runs inside the stored boxes, so a
range is read with a few positional reads and no box is ever loaded whole.
"""

from __future__ import annotations

import bisect
import ctypes
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import CheckpointError
from ..io.files import IOV_MAX, MappedRange
from ..units import numel


class Readable(Protocol):
    """Where blocks are stored; one that can also hand out its bytes in place has
    ``local_view(offset, nbytes) -> MappedRange | None``, one that can read consecutive bytes
    into scattered memory has ``scatters`` and ``scatter_into(offset, vectors)`` (both
    :class:`RandomAccessFile`'s)."""

    def read_into(self, offset: int, buffer: memoryview) -> None: ...


@dataclass(frozen=True)
class StoredBlock:
    file: Readable  # where the block's bytes are (a file, or an item inside one)
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data_start: int  # absolute position of the block's first byte in its file


def check_grid(name: str, shape: tuple[int, ...], blocks: Sequence[StoredBlock], where: str) -> None:
    """The blocks must tile the tensor exactly. Sharded tensors (DTensor placements) always
    cut each dimension into intervals and store every cell of that grid once, which is cheap to
    check: per dimension the intervals partition it, and there is one block per grid cell."""
    cells = 1
    for dim, extent in enumerate(shape):
        position = 0
        intervals = sorted({(b.offsets[dim], b.sizes[dim]) for b in blocks})
        for offset, size in intervals:
            if offset != position:
                raise CheckpointError(
                    f"{where}: tensor {name!r} is not fully stored: dimension {dim} "
                    f"{'has a gap at' if offset > position else 'overlaps at'} {min(offset, position)}"
                )
            position += size
        if position != extent:
            raise CheckpointError(f"{where}: tensor {name!r} is not fully stored: dimension {dim} ends at {position}")
        cells *= len(intervals)
    if len(blocks) != cells or len({b.offsets for b in blocks}) != len(blocks):
        raise CheckpointError(f"{where}: tensor {name!r} is stored as {len(blocks)} blocks that do not tile it")


@dataclass(frozen=True)
class Piece:
    """``rows`` runs of ``length`` elements of one block: consecutive in the block from its
    element ``local`` on, in the full tensor from element ``flat`` on, ``stride`` elements apart
    (the tensor's rows that a column-split block holds its part of)."""

    block: StoredBlock
    local: int
    flat: int
    rows: int
    length: int
    stride: int

    @property
    def contiguous(self) -> bool:
        """Whether the piece is one run in the tensor too (one read straight into place)."""
        return self.rows == 1 or self.stride == self.length


class Geometry:
    """Maps flat element ranges of a full tensor onto the stored blocks.

    Past the last dimension that some block does not span in full (``split``), every block is
    contiguous; so the flat tensor is a sequence of slabs, one per index over the dimensions
    before ``split``, and each block holds one contiguous run of each slab it meets. Dimension-0
    sharding (FSDP) is the case of one slab: one run per block. A block's runs of consecutive
    slabs lie one after another in the block, so a range of them is one read (:class:`Piece`),
    however narrow each run: a tensor split on its last dimension (tensor-parallel columns) is
    read in a few large reads, not one per row.
    """

    def __init__(self, shape: tuple[int, ...], blocks: Sequence[StoredBlock]) -> None:
        if not shape:  # a scalar: one element, one block
            shape = (1,)
            blocks = [StoredBlock(b.file, (0,), (1,), b.data_start) for b in blocks]
        self.shape = shape
        self.blocks = list(blocks)
        partial = [d for b in blocks for d, size in enumerate(b.sizes) if size != shape[d]]
        self.split = max(partial, default=0)
        self.inner = math.prod(shape[self.split + 1 :])
        self.slab = shape[self.split] * self.inner
        self._rows_index = _RowBlocks.of(self) if self.split == 0 else None

    def _groups(self, block: StoredBlock) -> tuple[int, Iterator[int]]:
        """(slabs per group, the first slab of each group) of ``block``: its runs fall into
        groups of consecutive slabs, one group for each index over the dimensions before the
        last one (before ``split``) that the block does not span; one group in all where it
        spans every one of them (a block of a matrix, whatever the mesh)."""
        k = self.split
        partial = [j for j in range(k) if block.sizes[j] != self.shape[j]]
        if not partial:
            return math.prod(block.sizes[:k]), iter((0,))
        m = partial[-1]
        prefix = block.sizes[:m]
        below = math.prod(self.shape[m:k])  # slabs per index over the dimensions before m
        start = block.offsets[m] * math.prod(self.shape[m + 1 : k])

        def firsts() -> Iterator[int]:
            for index in range(math.prod(prefix)):
                coords = [o + c for o, c in zip(block.offsets[:m], _unravel(index, prefix), strict=True)]
                yield _ravel(coords, self.shape[:m]) * below + start

        return math.prod(block.sizes[m:k]), firsts()

    def pieces(self, first: int, end: int) -> Iterator[Piece]:
        """The pieces covering elements ``[first, end)`` of the flat tensor, block by block."""
        if first >= end:
            return
        if self._rows_index is not None:
            yield from self._rows_index.pieces(first, end)
            return
        top, bottom = first // self.slab, (end - 1) // self.slab + 1  # the slabs the range meets
        for block in self.blocks:
            length = block.sizes[self.split] * self.inner
            within = block.offsets[self.split] * self.inner  # where its run starts in a slab
            per_group, firsts = self._groups(block)
            for group, group_first in enumerate(firsts):
                if group_first >= bottom:
                    break
                lo, hi = max(group_first, top), min(group_first + per_group, bottom)
                if lo < hi:
                    local_row = group * per_group + lo - group_first
                    yield from self._rows(block, local_row, lo, hi, length, within, first, end)

    def _rows(
        self, block: StoredBlock, local_row: int, lo: int, hi: int, length: int, within: int, first: int, end: int
    ) -> Iterator[Piece]:
        """The pieces of ``block``'s runs in slabs ``[lo, hi)`` (the run in slab ``lo`` is the
        block's run ``local_row``), clipped to ``[first, end)``: only the first and the last run
        can be cut by the range; the whole ones between are one piece."""
        slab = self.slab

        def piece(row: int, rows: int) -> Piece | None:
            start = row * slab + within
            a, b = max(start, first), min(start + (rows - 1) * slab + length, end)
            if a >= b:
                return None
            local = (local_row + row - lo) * length + a - start
            return Piece(block, local, a, rows, length if rows > 1 else b - a, slab)

        def whole(row: int) -> bool:
            start = row * slab + within
            return first <= start and start + length <= end

        # (first slab, slabs) of each piece: a cut run alone, the whole ones together.
        spans = {(row, 1) for row in (lo, hi - 1) if not whole(row)}
        inner_lo, inner_hi = lo + (not whole(lo)), hi - (not whole(hi - 1))
        if inner_lo < inner_hi:
            spans.add((inner_lo, inner_hi - inner_lo))
        for row, count in sorted(spans):
            found = piece(row, count)
            if found is not None:
                yield found

    def read_into(self, itemsize: int, byte_offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the full tensor's bytes from ``byte_offset`` on."""
        first = byte_offset // itemsize
        rows = _RowReads(buffer)
        for piece in self.pieces(first, first + len(buffer) // itemsize):
            _read_piece(rows, piece, itemsize, buffer, (piece.flat - first) * itemsize, every_run=False)
        rows.flush()

    def read_box(self, itemsize: int, offsets: Sequence[int], sizes: Sequence[int], buffer: memoryview) -> None:
        """Fill ``buffer`` with the box of the full tensor at ``offsets`` of ``sizes``, row-major
        (a process's own block of a tensor split otherwise than it was saved). From a local file
        every run of the box is a vector, whatever its width (a vector costs the kernel tens of
        nanoseconds, a read of its own microseconds), and runs that follow one another in a
        stored block share calls: a box that is a stored block is one call per IOV_MAX rows."""
        rows = _RowReads(buffer)
        for local, flat, count in box_runs(self.shape, offsets, sizes):
            for piece in self.pieces(flat, flat + count):
                _read_piece(rows, piece, itemsize, buffer, (local + piece.flat - flat) * itemsize, every_run=True)
        rows.flush()

    def local_view(self, itemsize: int, byte_offset: int, nbytes: int) -> MappedRange | None:
        """The bytes :meth:`read_into` would copy, in place, when they are one run of one block
        in a local file (a range inside one FSDP shard); None otherwise."""
        first = byte_offset // itemsize
        pieces = list(self.pieces(first, first + nbytes // itemsize))
        if len(pieces) != 1 or not pieces[0].contiguous:
            return None
        block, local = pieces[0].block, pieces[0].local
        view = getattr(block.file, "local_view", None)  # some stores of blocks can only be read
        return None if view is None else view(block.data_start + local * itemsize, nbytes)


def _read_piece(rows: _RowReads, piece: Piece, itemsize: int, buffer: memoryview, at: int, *, every_run: bool) -> None:
    """Read ``piece`` into ``buffer`` from byte ``at`` on: as vectors of ``rows`` where its file
    can scatter and either ``every_run`` or its rows lie apart and are at least
    :data:`SCATTER_ROW_BYTES` wide; else in one read where it is one run; else through scratch."""
    start = piece.block.data_start + piece.local * itemsize
    row_bytes, file = piece.length * itemsize, piece.block.file
    if getattr(file, "scatters", False) and (every_run or (not piece.contiguous and row_bytes >= SCATTER_ROW_BYTES)):
        rows.add(file, start, at, piece.rows, row_bytes, piece.stride * itemsize)
    elif piece.contiguous:
        file.read_into(start, buffer[at : at + piece.rows * row_bytes])
    else:
        _read_rows(piece, start, itemsize, buffer, at)


# The narrowest rows read straight into place (:class:`_RowReads`); narrower ones go through the
# scratch buffer (:func:`_read_rows`). The kernel's cost per vector outweighs the copy it saves
# below ~2 KiB: reading 128 MiB of cached two-block columns (benchmarks/bench_column_reads.py,
# CPU seconds, shared 2-core VM), straight / scratch: 512 B rows 0.0130 / 0.0098, 1 KiB 0.0097 /
# 0.0093, 2 KiB 0.0084 / 0.0094, 4 KiB 0.0055 / 0.0090, 8 KiB 0.0054 / 0.0094.
SCATTER_ROW_BYTES = 2048


class _RowReads:
    """The rows of column-split pieces, read straight into their places in a buffer: each row
    one vector of a ``preadv``, up to :data:`IOV_MAX` rows a call, so the bytes are copied once
    (by the kernel), not read into scratch and copied again. Pieces whose bytes follow one
    another in one file (the groups of a block of a 3-D tensor split on its last two
    dimensions) share calls."""

    def __init__(self, buffer: memoryview) -> None:
        self._buffer = buffer
        self._base: int | None = None  # the buffer's address, found on the first row
        self._vectors = _thread_vectors()
        self._count = 0
        self._file: Readable | None = None
        self._start = self._end = 0  # the file's bytes that the vectors so far take

    def add(self, file: Readable, start: int, at: int, rows: int, row_bytes: int, stride_bytes: int) -> None:
        """Read ``rows`` runs of ``row_bytes``, consecutive in ``file`` from ``start`` on, into
        the buffer from byte ``at`` on, ``stride_bytes`` apart."""
        # The kernel writes where the vectors point, unchecked: a row past the buffer (or rows
        # overlapping) would overwrite memory without a fault, so the layout's arithmetic is checked.
        last = at + (rows - 1) * stride_bytes + row_bytes
        if rows and (at < 0 or (rows > 1 and row_bytes > stride_bytes) or last > self._buffer.nbytes):
            size = self._buffer.nbytes
            raise RuntimeError(
                f"{rows} rows of {row_bytes} bytes, {stride_bytes} apart from {at}, overrun {size} bytes"
            )
        if file is not self._file or start != self._end:
            self.flush()
            self._file, self._start = file, start
        if self._base is None:
            self._base = torch.frombuffer(self._buffer, dtype=torch.uint8).data_ptr()
        done = 0
        while done < rows:
            if self._count == IOV_MAX:
                self.flush()
            take = min(rows - done, IOV_MAX - self._count)
            vectors = self._vectors[self._count : self._count + take]
            torch.mul(_ROW_INDEX[:take], stride_bytes, out=vectors[:, 0])
            vectors[:, 0].add_(self._base + at + done * stride_bytes)
            vectors[:, 1].fill_(row_bytes)
            self._count += take
            done += take
        self._end = start + rows * row_bytes

    def flush(self) -> None:
        """Read the rows added since the last flush."""
        if self._count:
            vectors = self._vectors[: self._count]
            self._file.scatter_into(self._start, vectors)  # type: ignore[union-attr]
            self._start += int(vectors[:, 1].sum())
            self._count = 0


_ROW_INDEX = torch.arange(IOV_MAX, dtype=torch.int64)
_vectors = threading.local()


def _thread_vectors() -> torch.Tensor:
    """This thread's ``struct iovec`` array (:data:`IOV_MAX` rows of address and length)."""
    vectors = getattr(_vectors, "array", None)
    if vectors is None or len(vectors) < IOV_MAX:
        vectors = _vectors.array = torch.empty((IOV_MAX, 2), dtype=torch.int64)
    return vectors


class _RowBlocks:
    """The blocks of a tensor split on its first dimension only (FSDP's ``Shard(0)``, one
    block per rank), which tile the flat tensor as one run each, indexed by where each run
    starts: a range finds its blocks by bisection, a piece per block it meets, in place of the
    general walk over every block (which cost most of a many-rank read's Python time)."""

    def __init__(self, starts: list[int], runs: list[tuple[StoredBlock, int]], slab: int) -> None:
        self.starts, self.runs, self.slab = starts, runs, slab

    @classmethod
    def of(cls, geometry: Geometry) -> _RowBlocks | None:
        """The index of ``geometry``'s blocks; None unless they tile its flat tensor end to end
        (else the general walk finds every piece, overlaps and gaps included)."""
        inner = geometry.inner
        runs = sorted(((b.offsets[0] * inner, b.sizes[0] * inner, b) for b in geometry.blocks), key=lambda r: r[:2])
        position = 0
        for start, length, _block in runs:
            if start != position:
                return None
            position += length
        if position != geometry.slab:
            return None
        return cls([start for start, _, _ in runs], [(block, length) for _, length, block in runs], geometry.slab)

    def pieces(self, first: int, end: int) -> Iterator[Piece]:
        index = max(0, bisect.bisect_right(self.starts, first) - 1)
        while index < len(self.starts) and self.starts[index] < end:
            start, (block, length) = self.starts[index], self.runs[index]
            lo, hi = max(start, first), min(start + length, end)
            if lo < hi:
                yield Piece(block, lo - start, lo, 1, hi - lo, self.slab)
            index += 1


# Bytes a reader thread reads a column-split piece into before copying its rows into place: the
# copy runs in the thread, and the piece is read in as many parts as it takes.
SCRATCH_BYTES = 4 * 2**20
# ATen's grain size (merging.kernel.INLINE_ELEMENTS): a copy of at most this many elements runs
# in the calling thread; a larger one would start an OpenMP team in a reader thread, whose
# spinning takes the cores of the arithmetic (or, for the training hook, of training).
COPY_ELEMENTS = 32768
_scratch = threading.local()


def _scratch_bytes(nbytes: int) -> memoryview:
    """This thread's scratch buffer, at least ``nbytes`` long (kept for its next piece), starting
    on a page: the kernel copies into a page-aligned buffer faster than into a bytearray's own
    16-byte-aligned start (an ad-hoc measurement on the shared VM, 4 MiB reads of a cached DCP
    file: 0.083-0.087 against 0.107 ns per byte; not one a repository command repeats)."""
    scratch = getattr(_scratch, "buffer", None)
    if scratch is None or len(scratch) < nbytes:
        raw = bytearray(nbytes + _PAGE)
        skip = -ctypes.addressof(ctypes.c_char.from_buffer(raw)) % _PAGE
        scratch = _scratch.buffer = memoryview(raw)[skip : skip + nbytes]
    return scratch[:nbytes]


_PAGE = 4096


def _read_rows(piece: Piece, start: int, itemsize: int, buffer: memoryview, at: int) -> None:
    """Read a piece whose rows lie apart in ``buffer`` (from byte ``at`` on) from a store that
    cannot scatter (an object store, fsspec's) or in rows too narrow to be worth it: its bytes, which
    are consecutive in the block, in parts of whole rows into this thread's scratch buffer, each
    part copied into place by strided copies in the widest unit that the row length, the row
    stride and the position allow."""
    row_bytes, stride_bytes = piece.length * itemsize, piece.stride * itemsize
    unit = next(u for u in (8, 4, 2, 1) if row_bytes % u == 0 and stride_bytes % u == 0 and at % u == 0)
    wide = _UNITS[unit]
    row_units, stride_units = row_bytes // unit, stride_bytes // unit
    span = (piece.rows - 1) * stride_bytes + row_bytes
    placed = torch.frombuffer(buffer, dtype=torch.uint8)[at : at + span].view(wide)
    rows_out = placed.as_strided((piece.rows, row_units), (stride_units, 1))
    per_part = max(1, min(piece.rows, SCRATCH_BYTES // row_bytes))
    for row in range(0, piece.rows, per_part):
        rows = min(per_part, piece.rows - row)
        scratch = _scratch_bytes(rows * row_bytes)
        piece.block.file.read_into(start + row * row_bytes, scratch)
        _copy_inline(rows_out[row : row + rows], torch.frombuffer(scratch, dtype=wide).view(rows, row_units))


_UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _copy_inline(out: torch.Tensor, rows: torch.Tensor) -> None:
    """``out.copy_(rows)`` for 2-D tensors, in copies of at most :data:`COPY_ELEMENTS`."""
    count, width = rows.shape
    if width <= COPY_ELEMENTS:
        step = COPY_ELEMENTS // width
        for row in range(0, count, step):
            out[row : row + step].copy_(rows[row : row + step])
        return
    for row in range(count):
        for column in range(0, width, COPY_ELEMENTS):
            out[row, column : column + COPY_ELEMENTS].copy_(rows[row, column : column + COPY_ELEMENTS])


def _unravel(index: int, shape: Sequence[int]) -> list[int]:
    coords = []
    for extent in reversed(shape):
        index, coord = divmod(index, extent)
        coords.append(coord)
    return coords[::-1]


def _ravel(coords: Sequence[int], shape: Sequence[int]) -> int:
    index = 0
    for coord, extent in zip(coords, shape, strict=True):
        index = index * extent + coord
    return index


def box_runs(shape: tuple[int, ...], offsets: Sequence[int], sizes: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(element index in the box, element index in the full tensor, count): the contiguous runs
    of a box of a row-major tensor, in order."""
    box = StoredBlock(None, tuple(offsets), tuple(sizes), 0)  # type: ignore[arg-type]
    geometry = Geometry(tuple(shape), [box])
    if numel(sizes) == 0:
        return
    for piece in geometry.pieces(0, numel(shape)):
        for row in range(piece.rows):
            yield piece.local + row * piece.length, piece.flat + row * piece.stride, piece.length
