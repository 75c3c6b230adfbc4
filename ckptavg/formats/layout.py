"""The layout of an output: from the tensor list alone, which file holds which tensor.

The layout depends only on names, shapes, dtypes and the shard size, never on how many
processes write it, so every launch of the same merge produces the same files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from ..units import numel

DEFAULT_SHARD_SIZE = 5 * 10**9  # bytes per output file, as transformers' save_pretrained


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an output: its name, output dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    # Computed once: a merge asks several times per tensor (layout, headers, planning, sharing
    # files out), which for 100k small tensors cost more than averaging them (a cached_property
    # takes a lock on its first use in Python 3.11).
    numel: int = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", numel(self.shape))
        object.__setattr__(self, "nbytes", self.numel * self.dtype.itemsize)


@dataclass(frozen=True)
class ShardSpec:
    """One output file and the tensors it holds, in the order they are written."""

    file_name: str
    tensors: tuple[TensorSpec, ...]

    @cached_property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def journal_name(self) -> str:
        """The name a resume journal records this share of the output under."""
        return self.file_name

    def ranges(self) -> tuple[tuple[TensorSpec, int, int], ...]:
        """(tensor, first element, end element) of each tensor written, in file order."""
        return tuple((t, 0, t.numel) for t in self.tensors)


@dataclass(frozen=True)
class ShardPart(ShardSpec):
    """Bytes ``[start, stop)`` of the file of ``whole``, whose tensor data begin at byte
    ``data_start`` (its header before them): one process's share of a file that several write at
    once (:func:`ckptavg.merging.distributed.split_output`). ``tensors`` are those with bytes in
    it; cuts fall on element boundaries (whole pages of the file, or a file's ends)."""

    whole: ShardSpec
    data_start: int
    start: int
    stop: int

    @classmethod
    def of(cls, whole: ShardSpec, data_start: int, start: int, stop: int) -> ShardPart:
        tensors = tuple(spec for spec, _, _ in _tensor_ranges(whole, data_start, start, stop))
        return cls(whole.file_name, tensors, whole, data_start, start, stop)

    @property
    def size(self) -> int:
        """The whole file's size."""
        return self.data_start + self.whole.nbytes

    @property
    def nbytes(self) -> int:
        return sum((end - first) * spec.dtype.itemsize for spec, first, end in self.ranges())

    @property
    def journal_name(self) -> str:
        return f"{self.file_name}@{self.start}-{self.stop}"

    def ranges(self) -> tuple[tuple[TensorSpec, int, int], ...]:
        return _tensor_ranges(self.whole, self.data_start, self.start, self.stop)


def _tensor_ranges(whole: ShardSpec, data_start: int, start: int, stop: int) -> tuple[tuple[TensorSpec, int, int], ...]:
    """The element ranges of ``whole``'s tensors inside the file bytes ``[start, stop)``."""
    ranges = []
    offset = data_start
    for spec in whole.tensors:
        first, end = max(start, offset), min(stop, offset + spec.nbytes)
        if first < end:
            item = spec.dtype.itemsize
            ranges.append((spec, (first - offset) // item, (end - offset) // item))
        offset += spec.nbytes
    return tuple(ranges)


def shard_file_name(index: int, count: int, prefix: str = "model", suffix: str = ".safetensors") -> str:
    return f"{prefix}-{index:05d}-of-{count:05d}{suffix}"


def layout_shards(
    tensors: Sequence[TensorSpec], max_shard_bytes: int, prefix: str = "model", suffix: str = ".safetensors"
) -> list[ShardSpec]:
    """Greedy split in the given order, as ``transformers`` does: a new shard starts when the
    next tensor would push the current one past ``max_shard_bytes`` (a larger tensor gets a
    shard of its own). Inside a shard, tensors are ordered by element size, largest first,
    so that every tensor's data stays aligned to its element size without padding.
    """
    groups: list[list[TensorSpec]] = []
    current_bytes = 0
    for spec in tensors:
        if not groups or (groups[-1] and current_bytes + spec.nbytes > max_shard_bytes):
            groups.append([])
            current_bytes = 0
        groups[-1].append(spec)
        current_bytes += spec.nbytes
    count = len(groups)
    return [
        ShardSpec(
            shard_file_name(i, count, prefix, suffix),
            tuple(sorted(group, key=lambda t: -t.dtype.itemsize)),
        )
        for i, group in enumerate(groups, 1)
    ]
