"""Rank files: each process of a (possibly sharded) run writes the blocks of the tensors it holds.

A folder of rank files is what the training hook writes for a snapshot (``stepN-snapshot/``) and
for its running sums. Process ``r`` of ``R`` writes ``rank{r:05d}-of-{R:05d}.safetensors`` with
the blocks it owns (a DTensor's local shard, or whole tensors), then ``rank{r:05d}-of-{R:05d}.json``
as its commit marker. No process reads or waits for another while writing, so a snapshot never
needs a collective call in the training loop.

Each file is plain safetensors; its ``__metadata__`` holds, as JSON, the full tensor table (name,
dtype, global shape) and where each stored block lies in its full tensor. :class:`PartsReader`
puts the full tensors back together, byte range by byte range, for the merge engine, and can
cut any other block out of them (a resume with another sharding).
"""

from __future__ import annotations

import ctypes
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from ..errors import CheckpointError, CkptavgError, OutputError
from ..io.atomic import atomic_write, discard_file, publish_file, temp_path
from ..io.files import MappedRange, RandomAccessFile, parse_json, read_json, sha256_file
from ..io.fs import FileSystem, display, folder_names, join
from .base import BlockRecord, CheckpointReader, TensorInfo, checked_shape, is_natural, shown_value
from .blocks import Geometry, StoredBlock, check_grid
from .layout import ShardSpec, TensorSpec
from .safetensors import DTYPE_NAMES, DTYPES, parse_header
from .writers.safetensors import SafetensorsFileWriter

_RANK_FILE = re.compile(r"^rank(\d{5})-of-(\d{5})\.(safetensors|json)$")
# What output.temp_path names a rank file while it is written; left behind by a killed process.
_RANK_TEMP = re.compile(r"^\.rank(\d{5})-of-\d{5}\.(safetensors|json)\.tmp-[0-9a-f]+$")
METADATA_KEY = "ckptavg.part"
FORMAT_VERSION = 1
# The training hook's blocks (mode="blocks"): a folder of rank files named so, whose record says so.
BLOCK_KIND = "block mean"
_BLOCK_FOLDER = re.compile(r"^step(\d+)-block$")


def rank_file_name(rank: int, world_size: int, suffix: str = "safetensors") -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.{suffix}"


@dataclass(frozen=True)
class Block:
    """The part of tensor ``name`` this process stores: ``data`` sits at ``offsets`` in the full
    tensor. ``data`` is a CPU tensor; it is read, never copied, while the file is written."""

    name: str
    offsets: tuple[int, ...]
    data: torch.Tensor


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy; the caller keeps it alive."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def write_rank_file(
    fs: FileSystem,
    folder: str,
    rank: int,
    world_size: int,
    table: Sequence[TensorSpec],
    blocks: Sequence[Block],
    info: Mapping[str, Any],
    checksum: bool = False,
    fsync: bool = True,
) -> str | None:
    """Write this process's blocks into ``folder``; returns the file's sha256 with ``checksum``.

    The data file is renamed into place complete; the marker written after it is what makes it
    count (on object stores, which cannot rename, the marker alone is the commit). With
    ``fsync`` each is durable before it is renamed, and its rename before the next step.
    """
    try:
        fs.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create {display(fs, folder)}: {exc.strerror or exc}") from exc
    # Files of an earlier run with another world size would make the folder ambiguous.
    remove_rank_files(fs, folder, rank, world_size, keep_current=True)
    # Largest elements first, so that every block starts aligned to its element size.
    ordered = sorted((b for b in blocks if b.data.numel()), key=lambda b: -b.data.element_size())
    shard = ShardSpec("", tuple(TensorSpec(b.name, b.data.dtype, tuple(b.data.shape)) for b in ordered))
    described = {
        "version": FORMAT_VERSION,
        "rank": rank,
        "world_size": world_size,
        "tensors": {t.name: [DTYPE_NAMES[t.dtype], list(t.shape)] for t in table},
        "offsets": {b.name: list(b.offsets) for b in ordered},
        "info": dict(info),
    }
    path = join(fs, folder, rank_file_name(rank, world_size))
    tmp = temp_path(fs, path)
    writer = None
    try:
        # The constructor writes the header: a full disk can refuse it already.
        writer = SafetensorsFileWriter(
            fs,
            tmp,
            shard,
            display(fs, path),
            metadata={METADATA_KEY: json.dumps(described)},
            checksum=checksum,
            fsync=fsync,
        )
        for block in ordered:
            writer.write(tensor_bytes(block.data.contiguous()))
        digest = writer.close() or None
    except BaseException:
        if writer is not None:
            writer.abort()
        discard_file(fs, tmp)
        raise
    publish_file(fs, tmp, path, fsync)
    marker = {"rank": rank, "world_size": world_size, "bytes": writer.size, "sha256": digest}
    with atomic_write(fs, join(fs, folder, rank_file_name(rank, world_size, "json")), fsync) as handle:
        handle.write(json.dumps(marker).encode())
    return digest


def remove_rank_files(fs: FileSystem, folder: str, rank: int, world_size: int, keep_current: bool = False) -> None:
    """Withdraw this process's file from ``folder``, whatever world size wrote it; process 0
    also withdraws those of ranks that no longer exist. Markers go first, so the folder never
    looks complete on the way. ``keep_current`` spares the files of the current world size.
    Temporary files of this process (a write cut short by a kill) go too."""
    for name in folder_names(fs, folder):
        match = _RANK_TEMP.match(name)
        if match and int(match.group(1)) == rank:
            discard_file(fs, join(fs, folder, name))
    for suffix in ("json", "safetensors"):
        for (owner, world), kinds in sorted(_rank_files(fs, folder).items()):
            if keep_current and world == world_size:
                continue
            if suffix in kinds and (owner == rank or (rank == 0 and owner >= world_size)):
                discard_file(fs, join(fs, folder, rank_file_name(owner, world, suffix)))


def _rank_files(fs: FileSystem, path: str) -> dict[tuple[int, int], set[str]]:
    """{(rank, world size): {"safetensors", "json"}} of the rank files in ``path``."""
    found: dict[tuple[int, int], set[str]] = {}
    for name in folder_names(fs, path):
        match = _RANK_FILE.match(name)
        if match:
            found.setdefault((int(match.group(1)), int(match.group(2))), set()).add(match.group(3))
    return found


def missing_ranks(fs: FileSystem, path: str) -> tuple[int, list[int]]:
    """(world size, ranks whose file or marker is missing) of a folder of rank files; the world
    size is the one the file names give."""
    found = _rank_files(fs, path)
    worlds = {world for _, world in found}
    if len(worlds) != 1:
        sizes = ", ".join(map(str, sorted(worlds))) or "none"
        raise CheckpointError(f"{display(fs, path)}: rank files of several world sizes ({sizes})")
    (world_size,) = worlds
    done = {rank for (rank, _), kinds in found.items() if kinds == {"safetensors", "json"}}
    return world_size, [r for r in range(world_size) if r not in done]


def wait_for_rank_files(fs: FileSystem, path: str, timeout_s: float) -> None:
    """Wait until every process has committed its rank file in ``path`` (other processes write
    theirs in their own time; no collective call is involved)."""
    deadline = time.monotonic() + timeout_s
    pause = 0.01
    while True:
        found = _rank_files(fs, path)
        world, missing = missing_ranks(fs, path) if found else (0, [])
        if found and not missing:
            return
        if time.monotonic() > deadline:
            what = f"ranks {', '.join(map(str, missing))} of {world}" if found else "no process"
            raise CheckpointError(f"{display(fs, path)}: {what} did not write their files within {timeout_s:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 1.0)


def verify_rank_file(fs: FileSystem, path: str, rank: int, world_size: int) -> None:
    """Compare a rank file with the sha256 its marker recorded; a mismatch is corruption."""
    marker_path = join(fs, path, rank_file_name(rank, world_size, "json"))
    data_path = join(fs, path, rank_file_name(rank, world_size))
    try:
        marker = read_json(fs, marker_path, "a rank file's marker")
        expected = marker.get("sha256") if isinstance(marker, dict) else None
        digest, _ = sha256_file(fs, data_path)
    except CkptavgError as exc:
        raise CheckpointError(f"cannot verify {display(fs, data_path)}: {exc}") from None
    if expected is None or digest != expected:
        raise CheckpointError(
            f"{display(fs, data_path)} is corrupt: its sha256 differs from the one recorded when it was written"
        )


@dataclass(frozen=True)
class _Described:
    """What a rank file says of itself in its ``__metadata__`` (JSON): the full tensor table
    (name -> dtype name, global shape), where each of its blocks lies in its tensor, and the
    hook's own info."""

    tensors: dict[str, tuple[str, tuple[int, ...]]]
    offsets: dict[str, tuple[int, ...]]
    info: dict[str, Any]

    @classmethod
    def of(cls, file: RandomAccessFile, metadata: dict[str, str], rank: int, world: int) -> _Described:
        """Read and checked: a value of another JSON type anywhere (a list for the table, a
        string for a shape) is one error naming the file, never a Python error later."""
        where = file.display_path

        def refuse(why: str) -> NoReturn:
            raise CheckpointError(f"{where}: not a ckptavg rank file ({why})")

        if METADATA_KEY not in metadata:
            refuse(f"no {METADATA_KEY!r} in its metadata")
        described = parse_json(metadata[METADATA_KEY], f"{where}: {METADATA_KEY}")
        if not isinstance(described, dict):
            refuse(f"{METADATA_KEY} is {shown_value(described)}, not a JSON object")

        def part(key: str, default: Any = None) -> dict[str, Any]:
            value = described.get(key, default)
            if not isinstance(value, dict):
                refuse(f"its {key!r} is {shown_value(value)}, not a JSON object")
            return value

        listed, placed, info = part("tensors"), part("offsets"), part("info", {})
        said = described.get("rank"), described.get("world_size")
        if not all(map(is_natural, said)) or said != (rank, world):
            refuse(f"it says rank {shown_value(said[0])} of {shown_value(said[1])}")
        tensors = {}
        for name, entry in listed.items():
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and entry[0] in DTYPES):
                refuse(f"tensor {name!r} is listed as {shown_value(entry)}, not [dtype, shape]")
            tensors[name] = (entry[0], checked_shape(entry[1], f"{where}: tensor {name!r}", DTYPES[entry[0]].itemsize))
        offsets = {}
        for name, at in placed.items():
            if not (isinstance(at, list) and all(map(is_natural, at))):
                refuse(f"tensor {name!r} has block offsets {shown_value(at)}, not integers from 0 to 2**63-1")
            offsets[name] = tuple(at)
        return cls(tensors, offsets, info)


class PartsReader(CheckpointReader):
    """A folder of rank files, read as full tensors."""

    format_name = "snapshot"

    @classmethod
    def detect(cls, fs: FileSystem, path: str) -> bool:
        return bool(_rank_files(fs, path))

    @classmethod
    def incomplete_reason(cls, fs: FileSystem, path: str) -> str | None:
        try:
            world, missing = missing_ranks(fs, path)
        except CkptavgError as exc:
            return str(exc).split(": ", 1)[-1]
        if missing:
            return f"{world - len(missing)} of {world} rank files written"
        return None

    def __init__(self, fs: FileSystem, path: str) -> None:
        super().__init__(fs, path)
        self._files: list[RandomAccessFile] = []
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        world, missing = missing_ranks(self.fs, self.path)
        if missing:
            raise CheckpointError(
                f"{self.display_path}: incomplete, rank files of ranks {', '.join(map(str, missing))} "
                f"(of {world}) are missing"
            )
        self.world_size = world
        table: dict[str, tuple[str, tuple[int, ...]]] | None = None
        blocks: dict[str, list[StoredBlock]] = {}
        for rank in range(world):
            file = RandomAccessFile(self.fs, join(self.fs, self.path, rank_file_name(rank, world)))
            self._files.append(file)
            metadata, entries = parse_header(file)
            described = _Described.of(file, metadata, rank, world)
            if table is None:
                table, self.info = described.tensors, described.info
            elif described.tensors != table:
                differing = sorted(set(described.tensors.items()) ^ set(table.items()))
                raise CheckpointError(
                    f"{file.display_path}: tensor {differing[0][0]!r} differs from rank 0's tensor list"
                )
            elif described.info != self.info:  # what the processes wrote of one step (or block) agrees
                raise CheckpointError(
                    f"{file.display_path}: its record {shown_value(described.info)} differs from rank 0's"
                )
            for name, dtype, shape, start, _end in entries:
                blocks.setdefault(name, []).append(self._block(file, described, table, name, dtype, shape, start))
        assert table is not None
        self._infos: dict[str, TensorInfo] = {}
        self._geometry: dict[str, Geometry] = {}
        shown = f"{self.display_path}/rank*-of-{world:05d}.safetensors"
        for name, (dtype_name, shape) in table.items():
            info = TensorInfo(name, DTYPES[dtype_name], tuple(shape), shown)
            stored = blocks.get(name, [])
            if info.numel:
                check_grid(name, info.shape, stored, self.display_path)
            self._infos[name] = info
            self._geometry[name] = Geometry(info.shape, stored)

    @staticmethod
    def _block(
        file: RandomAccessFile,
        described: _Described,
        table: dict[str, tuple[str, tuple[int, ...]]],
        name: str,
        dtype: torch.dtype,
        sizes: tuple[int, ...],
        start: int,
    ) -> StoredBlock:
        where = file.display_path
        if name not in table:
            raise CheckpointError(f"{where}: tensor {name!r} is stored but not in the tensor list")
        dtype_name, shape = table[name]
        offsets = described.offsets.get(name, ())
        if DTYPES[dtype_name] != dtype:
            raise CheckpointError(f"{where}: tensor {name!r} is stored as {dtype} but listed as {dtype_name}")
        if (
            len(offsets) != len(shape)
            or len(sizes) != len(shape)
            or any(o + s > extent for o, s, extent in zip(offsets, sizes, shape, strict=True))
        ):
            raise CheckpointError(
                f"{where}: tensor {name!r} block {list(sizes)} at {list(offsets)} lies outside its shape {list(shape)}"
            )
        return StoredBlock(file, offsets, sizes, start)

    def tensors(self) -> list[TensorInfo]:
        return list(self._infos.values())

    def read_into(self, name: str, byte_offset: int, buffer: memoryview) -> None:
        self._geometry[name].read_into(self._infos[name].dtype.itemsize, byte_offset, buffer)

    def local_view(self, name: str, byte_offset: int, nbytes: int) -> MappedRange | None:
        return self._geometry[name].local_view(self._infos[name].dtype.itemsize, byte_offset, nbytes)

    def read_block(self, name: str, offsets: Sequence[int], out: torch.Tensor) -> None:
        """Fill ``out`` (contiguous, of the stored dtype) with the block of ``name`` at ``offsets``."""
        info = self._infos[name]
        if out.dtype != info.dtype or len(offsets) != len(info.shape):
            raise CheckpointError(f"{self.display_path}: tensor {name!r} cannot fill a {out.dtype} block")
        self._geometry[name].read_box(info.dtype.itemsize, offsets, tuple(out.shape), tensor_bytes(out))

    def weight_files(self) -> set[str]:
        return {
            rank_file_name(rank, self.world_size, suffix)
            for rank in range(self.world_size)
            for suffix in ("safetensors", "json")
        }

    def close(self) -> None:
        for file in self._files:
            file.close()
        self._files.clear()


def block_info(step: int, block: int, every: int, count: int, dtypes: Mapping[str, torch.dtype]) -> dict[str, Any]:
    """The record the training hook writes into each rank file of a block (every process the
    same): which steps it averages, and the trained parameters' dtypes."""
    return {
        "kind": BLOCK_KIND,
        "step": step,
        "block": block,
        "every": every,
        "count": count,
        "dtypes": {name: DTYPE_NAMES[dtype] for name, dtype in dtypes.items()},
    }


class BlockReader(PartsReader):
    """A block of the training hook, ``step{S}-block/``: rank files holding the mean of the steps
    of one block, in each tensor's accumulator dtype (float32 for 16-bit parameters). Its record
    (:class:`~ckptavg.formats.base.BlockRecord`, in every rank file) is checked when it is opened:
    a merge never takes a block for what it is not."""

    format_name = "block"

    @classmethod
    def detect(cls, fs: FileSystem, path: str) -> bool:
        return bool(_BLOCK_FOLDER.match(path.rstrip("/").rsplit("/", 1)[-1])) and super().detect(fs, path)

    def _open(self) -> None:
        super()._open()
        self._record = self._checked_record()

    def block_record(self) -> BlockRecord:
        return self._record

    def _checked_record(self) -> BlockRecord:
        def refuse(why: str) -> NoReturn:
            raise CheckpointError(f"{self.display_path}: not a block of the training hook ({why})")

        info = self.info
        if info.get("kind") != BLOCK_KIND:
            refuse(f"its record's kind is {shown_value(info.get('kind'))}, not {BLOCK_KIND!r}")
        numbers = []
        for key in ("step", "block", "every", "count"):
            value = info.get(key)
            if not is_natural(value) or value == 0:
                refuse(f"its {key!r} is {shown_value(value)}, not a positive integer")
            numbers.append(value)
        step, block, every, count = numbers
        match = _BLOCK_FOLDER.match(self.path.rstrip("/").rsplit("/", 1)[-1])
        assert match is not None  # detected by its name
        if step != int(match.group(1)):
            refuse(f"it records step {step}, its name step {match.group(1)}")
        # Blocks end at multiples of their length; each holds the steps every-th back from its end.
        if step % block or block % every or count != block // every:
            refuse(f"{count} steps every {every} in a block of {block} ending at step {step} do not tile it")
        dtypes = info.get("dtypes")
        if not isinstance(dtypes, dict) or set(dtypes) != set(self._infos):
            refuse(f"its 'dtypes' are {shown_value(dtypes)}, not one per tensor")
        trained = {}
        for name, dtype_name in dtypes.items():
            stored = self._infos[name].dtype
            dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
            if dtype is None or dtype.is_floating_point != stored.is_floating_point or dtype.itemsize > stored.itemsize:
                refuse(f"tensor {name!r} is stored as {stored} for a parameter of dtype {shown_value(dtype_name)}")
            trained[name] = dtype
        return BlockRecord(step, block, every, count, trained)
