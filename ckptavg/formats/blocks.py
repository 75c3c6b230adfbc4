"""Tensors stored as blocks: put full tensors back together, byte range by byte range.

A sharded checkpoint (the hook's rank files, a DCP folder) stores each tensor as boxes of its
full row-major shape, one per process or shard. The merge engine asks for flat byte ranges of
the full tensor; :class:`Geometry` maps a range to contiguous runs inside the stored boxes, so a
range is read with a few positional reads and no box is ever loaded whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..errors import CheckpointError
from ..io.files import MappedRange
from ..units import numel


class Readable(Protocol):
    """Where blocks are stored; one that can also hand out its bytes in place has
    ``local_view(offset, nbytes) -> MappedRange | None`` (:class:`RandomAccessFile`'s)."""

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


class Geometry:
    """Maps flat element ranges of a full tensor onto the stored blocks.

    Past the last dimension that some block does not span in full (``split``), every block is
    contiguous; so the flat tensor is a sequence of slabs, one per index over the dimensions
    before ``split``, and each block holds one contiguous run of each slab it meets. Dimension-0
    sharding (FSDP) is the case of one slab: one run per block.
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

    def runs(self, first: int, end: int) -> Iterator[tuple[StoredBlock, int, int, int]]:
        """(block, element index in the block, element index in the tensor, count) covering
        elements ``[first, end)`` of the flat tensor, in order."""
        k, inner = self.split, self.inner
        outer_shape = self.shape[:k]
        for slab in range(first // self.slab, (end - 1) // self.slab + 1):
            outer = _unravel(slab, outer_shape)
            for block in self.blocks:
                if any(not block.offsets[j] <= outer[j] < block.offsets[j] + block.sizes[j] for j in range(k)):
                    continue
                run_start = slab * self.slab + block.offsets[k] * inner
                run_length = block.sizes[k] * inner
                lo, hi = max(run_start, first), min(run_start + run_length, end)
                if lo >= hi:
                    continue
                local_outer = _ravel([outer[j] - block.offsets[j] for j in range(k)], block.sizes[:k])
                yield block, local_outer * run_length + (lo - run_start), lo, hi - lo

    def read_into(self, itemsize: int, byte_offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the full tensor's bytes from ``byte_offset`` on."""
        first = byte_offset // itemsize
        for block, local, flat, count in self.runs(first, first + len(buffer) // itemsize):
            at = (flat - first) * itemsize
            block.file.read_into(block.data_start + local * itemsize, buffer[at : at + count * itemsize])

    def local_view(self, itemsize: int, byte_offset: int, nbytes: int) -> MappedRange | None:
        """The bytes :meth:`read_into` would copy, in place, when they are one run of one block
        in a local file (a range inside one FSDP shard); None otherwise."""
        first = byte_offset // itemsize
        runs = list(self.runs(first, first + nbytes // itemsize))
        if len(runs) != 1:
            return None
        block, local, _, _ = runs[0]
        view = getattr(block.file, "local_view", None)  # some stores of blocks can only be read
        return None if view is None else view(block.data_start + local * itemsize, nbytes)


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
    for _, local, flat, count in geometry.runs(0, numel(shape)):
        yield local, flat, count
