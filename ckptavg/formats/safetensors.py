"""Hugging Face safetensors checkpoints: ``model.safetensors`` or a sharded set with an index.

The format is parsed here (8-byte little-endian header length, JSON header, raw data) instead
of going through ``safetensors.safe_open``, so that a tensor can be read a byte range at a time
into a buffer the engine reuses, over any fsspec filesystem, with range reads only.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import Any, NamedTuple

import torch

from ..errors import CheckpointError
from ..io.files import MappedRange, RandomAccessFile, parse_json
from ..io.fs import FileSystem, join
from .base import CheckpointReader, TensorInfo, is_natural, read_weight_map

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# A header is a few hundred bytes per tensor; anything past this is a corrupt or hostile file.
MAX_HEADER_BYTES = 100 * 2**20

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
}
# The safetensors library also names F4 (two float4 per byte, a shape that counts halves of
# bytes), F6_E2M3, F6_E3M2 and C64: ckptavg reads none of them (the header names the dtype).
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


class StoredTensor(NamedTuple):
    # A tuple, not a frozen dataclass: made once per tensor and checkpoint (100k and more), and
    # a frozen dataclass sets each field through object.__setattr__.
    info: TensorInfo
    file_name: str
    offset: int  # absolute byte offset of the tensor's data in its file
    end: int  # and of the byte after it


def parse_header(
    file: RandomAccessFile,
) -> tuple[dict[str, Any], list[tuple[str, torch.dtype, tuple[int, ...], int, int]]]:
    """Validate a safetensors header; return its metadata and (name, dtype, shape, start, end).

    Offsets are absolute positions in the file. Every inconsistency is reported with the file
    and, where there is one, the tensor (:func:`read_header`)."""
    metadata, entries = read_header(file)
    return metadata, [(info.name, info.dtype, info.shape, start, end) for info, start, end in entries]


def read_header(file: RandomAccessFile) -> tuple[dict[str, Any], list[tuple[TensorInfo, int, int]]]:
    """Validate a safetensors header; return its metadata and each tensor with its absolute
    (start, end) in the file, in file order. Every inconsistency is reported with the file and,
    where there is one, the tensor; each shape is checked once, by its :class:`TensorInfo`."""
    where = file.display_path
    if file.size < 8:
        raise CheckpointError(f"{where}: not a safetensors file (only {file.size} bytes)")
    (header_len,) = struct.unpack("<Q", file.read(0, 8))
    if header_len > MAX_HEADER_BYTES or 8 + header_len > file.size:
        raise CheckpointError(f"{where}: corrupt safetensors header length {header_len}")
    header = parse_json(file.read(8, header_len), f"{where}: corrupt safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{where}: corrupt safetensors header (__metadata__ is not an object of strings)")
    data_start = 8 + header_len
    data_size = file.size - data_start
    entries = []
    for name, entry in header.items():
        problem = _entry_problem(entry)
        if problem:
            raise CheckpointError(f"{where}: tensor {name!r} has an invalid header entry ({problem})")
        info = TensorInfo(name, DTYPES[entry["dtype"]], entry.get("shape"), where)
        start, end = entry["data_offsets"]
        if not start <= end <= data_size:
            raise CheckpointError(
                f"{where}: tensor {name!r} lies outside the file (bytes {start}-{end} of "
                f"{data_size}); the file is truncated or corrupt"
            )
        if end - start != info.nbytes:
            raise CheckpointError(
                f"{where}: tensor {name!r} has {end - start} bytes but shape {list(info.shape)} "
                f"{entry['dtype']} needs {info.nbytes}"
            )
        entries.append((info, data_start + start, data_start + end))
    entries.sort(key=itemgetter(1, 2))
    # A tensor of no elements holds no bytes, so overlaps none, wherever its offsets point (the
    # safetensors library writes it at the offset where the next tensor starts).
    holding = [e for e in entries if e[2] > e[1]]
    for before, after in zip(holding, holding[1:], strict=False):
        if after[1] < before[2]:
            raise CheckpointError(
                f"{where}: tensors {before[0].name!r} and {after[0].name!r} overlap; the header is corrupt"
            )
    return metadata, entries


def _entry_problem(entry: Any) -> str | None:
    """What is wrong with a tensor's header entry, or None."""
    if not isinstance(entry, dict):
        return "not a JSON object"
    dtype = entry.get("dtype")
    if not isinstance(dtype, str):
        return "dtype is not a string"
    if dtype not in DTYPES:
        return f"dtype {dtype[:40]!r} is not a supported safetensors dtype"
    offsets = entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and is_natural(offsets[0]) and is_natural(offsets[1])):
        return "data_offsets is not a pair of integers from 0 to 2**63-1"
    return None


class SafetensorsReader(CheckpointReader):
    format_name = "safetensors"

    @classmethod
    def detect(cls, fs: FileSystem, path: str) -> bool:
        return fs.isfile(join(fs, path, INDEX_FILE)) or fs.isfile(join(fs, path, SINGLE_FILE))

    def __init__(self, fs: FileSystem, path: str) -> None:
        super().__init__(fs, path)
        self._files: dict[str, RandomAccessFile] = {}
        self._tensors: dict[str, StoredTensor] = {}
        index_path = join(fs, path, INDEX_FILE)
        self._shard_names: Mapping[str, set[str] | None]
        self._index_name: str | None
        try:
            if fs.isfile(index_path):
                self._shard_names = read_weight_map(fs, index_path, ".safetensors")
                self._index_name = INDEX_FILE
            else:
                self._shard_names = {SINGLE_FILE: None}
                self._index_name = None
            for file_name, expected in self._shard_names.items():
                self._load_shard(file_name, expected)
        except BaseException:
            self.close()
            raise

    def _load_shard(self, file_name: str, expected: set[str] | None) -> None:
        file_path = join(self.fs, self.path, file_name)
        if not self.fs.isfile(file_path):
            raise CheckpointError(f"{self.display_path}/{file_name}: missing (listed in the index)")
        file = RandomAccessFile(self.fs, file_path)
        self._files[file_name] = file
        _, entries = read_header(file)
        if expected is not None and (names := {info.name for info, _, _ in entries}) != expected:
            missing = sorted(expected - names) or sorted(names - expected)
            raise CheckpointError(
                f"{file.display_path}: tensor {missing[0]!r} is "
                + (
                    "listed in the index but not in the file"
                    if expected - names
                    else "in the file but not in the index"
                )
            )
        for info, start, end in entries:
            if info.name in self._tensors:
                other = self._tensors[info.name].info.file
                raise CheckpointError(f"{file.display_path}: tensor {info.name!r} is stored twice (also in {other})")
            self._tensors[info.name] = StoredTensor(info, file_name, start, end)

    def tensors(self) -> list[TensorInfo]:
        return [t.info for t in self._tensors.values()]

    def read_into(self, name: str, byte_offset: int, buffer: memoryview) -> None:
        stored = self._tensors[name]
        self._files[stored.file_name].read_into(stored.offset + byte_offset, buffer)

    def local_view(self, name: str, byte_offset: int, nbytes: int) -> MappedRange | None:
        stored = self._tensors[name]
        return self._files[stored.file_name].local_view(stored.offset + byte_offset, nbytes)

    def adjacent(self, names: Sequence[str]) -> list[bool]:
        stored = [self._tensors[name] for name in names]
        return [b.file_name == a.file_name and b.offset == a.end for a, b in zip(stored, stored[1:], strict=False)]

    def weight_files(self) -> set[str]:
        names = set(self._shard_names)
        if self._index_name:
            names.add(self._index_name)
        return names

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()
