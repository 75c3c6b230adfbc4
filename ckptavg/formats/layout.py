"""The layout of an output: from the tensor list alone, which file holds which tensor.

The layout depends only on names, shapes, dtypes and the shard size, never on how many
processes write it, so every launch of the same merge produces the same files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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

    # Cached, as ShardSpec's: a merge asks several times per tensor (layout, headers, planning,
    # sharing files out), which for 100k small tensors cost more than averaging them.
    @cached_property
    def nbytes(self) -> int:
        return numel(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ShardSpec:
    """One output file and the tensors it holds, in the order they are written."""

    file_name: str
    tensors: tuple[TensorSpec, ...]

    @cached_property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


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
