"""torch.distributed.checkpoint (DCP) folders: OLMo-core, torchtitan, and plain DCP saves.

A DCP folder holds ``.metadata`` (a pickle written last by the coordinator: every key's global
shape, dtype and chunks, and where each chunk's bytes lie) and ``__{rank}_{k}.distcp`` data files
of torch.save archives, one per chunk. The metadata is read once per checkpoint with an
allow-list unpickler: that works without OLMo-core installed (its metadata names its own
``_StorageInfo`` class, mapped here to torch's) and runs no code from the file. Each chunk is a
box of the full tensor; the engine's byte ranges are served from the boxes
(:mod:`.blocks`) by positional reads, so no chunk or file is ever loaded whole.

Layouts:
  OLMo-core   ``stepN/model_and_optim/`` (DCP) with ``stepN/.metadata.json`` as its completeness
              marker (written last); weights are ``model.<fqn>``, optimizer ``optim.*``.
  torchtitan  ``step-N/`` (DCP); weights unprefixed since mid-2025 (``model.<fqn>`` before),
              besides ``optimizer.*``, ``lr_scheduler.*``, ``dataloader.*``, ``train_state.*``.
  Megatron    ``iter_NNNNNNN/`` (DCP) with ``common.pt`` and ``metadata.json`` (written last):
              see :class:`MegatronReader`; the folder ``--load`` takes, with
              ``latest_checkpointed_iteration.txt`` naming one: :class:`MegatronLoadFolderReader`.
  plain DCP   any folder with ``.metadata``.
Only model weights are merged by default: every key outside the trainer-state prefixes
(:data:`NON_MODEL_PREFIXES`), which is ``model.*`` for OLMo-core and older torchtitan; a
prefix rule cannot silently drop a weight the way a ``model.*`` rule would drop an HF
``lm_head.weight``. ``--include``/``--exclude`` choose others.
"""

from __future__ import annotations

import pathlib
import pickle
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError
from ..io.files import MappedRange, RandomAccessFile, read_json, read_small_file
from ..io.fs import FileSystem, display, folder_names, join
from ..manifest import MANIFEST_FILE
from ..units import numel
from .base import (
    NON_MODEL_PREFIXES,
    CheckpointReader,
    DcpPlacement,
    MergedOutput,
    StoredObject,
    TensorInfo,
    checked_shape,
    is_natural,
    plain_file_name,
    shown_value,
)
from .blocks import Geometry, StoredBlock, check_grid
from .dtypes import READ, TORCH_DTYPES
from .repickle import Made, read_graph
from .restricted_pickle import restricted_loads
from .safetensors import parse_header
from .torch_save import Ends, SmallArchives, TorchSaveArchive, read_ends_in_order

METADATA_FILE = ".metadata"
OLMO_CORE_FOLDER = "model_and_optim"
OLMO_CORE_MARKER = ".metadata.json"
MEGATRON_CONFIG = "metadata.json"
MEGATRON_COMMON = "common.pt"
# Megatron-LM's tracker file: the iteration (or "release") whose checkpoint ``--load`` takes.
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
# About 135 bytes a chunk (57,600 chunks: 7.8 MB), so 1 GiB describes some 8 million chunks, e.g.
# 130,000 keys (weights and two optimizer states of a large MoE) of 64 chunks each. Unpickled,
# metadata takes about 14 times its size in memory: past 1 GiB, 14 GiB of objects.
MAX_METADATA_BYTES = 2**30
# Megatron's common.pt holds args and the optimizer's param groups and step counters (kilobytes
# to megabytes); a DCP output rewrites it in memory, recording each of its objects.
MAX_COMMON_BYTES = 64 * 2**20
# Where common.pt records how a merged checkpoint was made: Megatron-LM's weighted_merge.py's key.
PROVENANCE_KEY = "weighted_merge_provenance"


def _path_from_parts(*parts: str) -> str:
    return str(pathlib.PurePosixPath(*parts))


def _naturals(values: Any) -> tuple[int, ...]:
    """A chunk's offsets: :func:`~.base.is_natural` integers (``int()`` would round a float or
    parse a string, ``operator.index`` take ``True`` as 1)."""
    out = tuple(values)
    if not all(map(is_natural, out)):
        raise ValueError(f"{shown_value(list(out))} is not a list of integers from 0 to 2**63-1")
    return out


class _Record:
    """Stands for a metadata class of another framework (HyperParallel), or one a merge never
    reads (torch's save plans): it keeps the pickled fields as attributes and nothing else, so
    reading needs neither that framework nor its code."""


class _MetadataIndex:
    """Stands for DCP's ``MetadataIndex``, the key of each storage entry. It is hashed by its
    fields (as a dict key, while the pickle loads), so they are checked when the pickle sets
    them, once, and flat: torch's frozen dataclass takes whatever a BUILD gives it, at any time,
    and hashing fields that nest without bound crashes the interpreter (:mod:`.pickle_scan`)."""

    __slots__ = ("fqn", "offset", "index")

    def __setstate__(self, state: Any) -> None:
        if hasattr(self, "fqn") or not isinstance(state, dict) or not isinstance(state.get("fqn"), str):
            raise pickle.UnpicklingError("a storage key (MetadataIndex) is malformed or set twice")
        offset = state.get("offset")
        self.fqn, self.index = state["fqn"], state.get("index")
        self.offset = None if offset is None else _naturals(offset)

    def _key(self) -> tuple[str, tuple[int, ...] | None]:
        return self.fqn, self.offset

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _MetadataIndex) and self._key() == other._key()


class _TensorProperties:
    """Stands for DCP's ``TensorProperties``, of which a merge needs the dtype. torch's class
    decodes the memory format through an enum whose members the whole process shares: handed
    to the pickle, one of them would take attributes from a BUILD, for every later save."""

    __slots__ = ("dtype",)

    def __setstate__(self, state: Any) -> None:
        # torch pickles (dtype, layout, requires_grad, memory format code, pin_memory).
        self.dtype = state[0] if isinstance(state, tuple) and state else None


def _enum_value(value: Any) -> Any:
    """Stands for an enum of DCP's in the pickle (``_MEM_FORMAT_ENCODING`` in the properties,
    which :class:`_TensorProperties` ignores; the planner's ``WriteItemType``): the value itself,
    never the process's enum member, which a BUILD would change for every later save."""
    return value


_HYPER_PARALLEL = "hyper_parallel.core.distributed_checkpoint"
_MINDSPORE_DTYPES = {
    "Float64": torch.float64,
    "Float32": torch.float32,
    "Float16": torch.float16,
    "BFloat16": torch.bfloat16,
    "Int64": torch.int64,
    "Int32": torch.int32,
    "Int16": torch.int16,
    "Int8": torch.int8,
    "UInt8": torch.uint8,
    "Bool": torch.bool,
}


def _dtype(value: Any) -> torch.dtype | None:
    """A dtype as DCP (``torch.bfloat16``) or HyperParallel (``"torch.bfloat16"``, MindSpore's
    ``"BFloat16"``) records it."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        return TORCH_DTYPES.get(value.removeprefix("torch.")) or _MINDSPORE_DTYPES.get(value)
    return None


def _allowed() -> dict[tuple[str, str], Any]:
    """The classes a DCP ``.metadata`` pickle may name, each mapped to a harmless torch dataclass
    (made afresh, checked after the load) or a record of this module."""
    from torch.distributed.checkpoint import filesystem, metadata

    names = {
        ("torch.distributed.checkpoint.metadata", name): getattr(metadata, name)
        for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "StorageMeta")
    }
    names.update(
        {
            ("torch.distributed.checkpoint.metadata", "MetadataIndex"): _MetadataIndex,
            ("torch.distributed.checkpoint.metadata", "TensorProperties"): _TensorProperties,
            ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _enum_value,
            # Megatron-core pickles the save plans too (Metadata.all_local_plans), which a merge
            # never reads: inert records, like a foreign framework's classes.
            ("torch.distributed.checkpoint.planner", "WriteItemType"): _enum_value,
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
            ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"): filesystem._StoragePrefix,
            # OLMo-core pickles its own copy of the class; the fields are the same.
            ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
            ("torch", "Size"): torch.Size,
            ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
            ("collections", "OrderedDict"): OrderedDict,
            ("pathlib", "PosixPath"): _path_from_parts,
            ("pathlib", "PurePosixPath"): _path_from_parts,
            ("pathlib", "WindowsPath"): _path_from_parts,
        }
    )
    # Every dtype: immutable values; a key of one ckptavg does not read is refused by name below.
    names.update({("torch", name): dtype for name, dtype in TORCH_DTYPES.items()})
    planner_classes = ("SavePlan", "WriteItem", "TensorWriteData", "BytesIOWriteData")
    names.update(
        {("torch.distributed.checkpoint.planner", name): type(name, (_Record,), {}) for name in planner_classes}
    )
    for module, classes in (
        ("metadata", ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata")),
        ("metadata", ("BytesStorageMetadata", "MetadataIndex")),
        ("storage", ("StorageInfo",)),
    ):
        names.update({(f"{_HYPER_PARALLEL}.{module}", name): type(name, (_Record,), {}) for name in classes})
    return names


def read_metadata(fs: FileSystem, folder: str) -> Any:
    """The DCP ``Metadata`` of ``folder`` (costly for big runs: read it once per checkpoint)."""
    path = join(fs, folder, METADATA_FILE)
    where = display(fs, path)
    data = read_small_file(fs, path, MAX_METADATA_BYTES, "a DCP .metadata")
    metadata = restricted_loads(data, _allowed(), where)
    if not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointError(f"{where}: not DCP metadata")
    return metadata


class _DataFile:
    """The items of one ``.distcp`` file, located together: on the first read of any of them,
    the ends of all of them are read in file order, neighbours' ends in one read
    (:func:`~.torch_save.read_ends_in_order`), and parsed in one loop. Each item keeps what it
    found (where its tensor starts, or why it cannot be read) for its own reads, so an item
    that a merge never reads refuses nothing, as when each was located on its own."""

    def __init__(self, file: RandomAccessFile, small: SmallArchives) -> None:
        self.file, self.small = file, small
        self.items: list[_Item] = []
        self._lock = threading.Lock()
        self._located = False

    def locate(self) -> None:
        with self._lock:
            if self._located:
                return
            items = sorted(self.items, key=lambda item: item.offset)
            spans = [(item.offset, item.length) for item in items]
            for item, ends in zip(items, read_ends_in_order(self.file, spans), strict=True):
                item.locate(ends)
            self._located = True


class _Item:
    """One chunk's torch.save archive inside a ``.distcp`` file; located with the other items of
    its file on the first read of any (so listing a checkpoint reads only ``.metadata``)."""

    __slots__ = ("data_file", "file", "offset", "length", "key", "sizes", "dtype", "_start")

    def __init__(
        self, data_file: _DataFile, offset: int, length: int, key: str, sizes: tuple[int, ...], dtype: torch.dtype
    ):
        self.data_file, self.file = data_file, data_file.file
        self.offset, self.length = offset, length
        self.key, self.sizes, self.dtype = key, sizes, dtype
        self._start: int | CheckpointError | None = None  # where the tensor starts, once located
        data_file.items.append(self)

    def locate(self, ends: Ends) -> None:
        where = f"{self.file.display_path} (tensor {self.key!r}, item at byte {self.offset})"
        try:
            table = self.data_file.small.table(self.file, self.offset, self.length, where, ends)
            stored = table.get("")
            if stored is None or len(table) != 1:
                raise CheckpointError(f"{where}: the item is not a single tensor")
            if stored.dtype != self.dtype or stored.shape != self.sizes:
                raise CheckpointError(
                    f"{where}: stored as {stored.dtype} {list(stored.shape)} but the metadata says "
                    f"{self.dtype} {list(self.sizes)}"
                )
            if stored.offset + stored.nbytes > self.offset + self.length:
                raise CheckpointError(f"{where}: the tensor runs past its item")
            self._start = stored.offset
        except CheckpointError as exc:
            self._start = exc

    def _resolve(self) -> int:
        if self._start is None:
            self.data_file.locate()
        if isinstance(self._start, CheckpointError):
            raise self._start
        assert self._start is not None
        return self._start

    def read_into(self, offset: int, buffer: memoryview) -> None:
        self.file.read_into(self._resolve() + offset, buffer)

    def local_view(self, offset: int, nbytes: int) -> MappedRange | None:
        return self.file.local_view(self._resolve() + offset, nbytes)

    @property
    def scatters(self) -> bool:
        return self.file.scatters

    def scatter_into(self, offset: int, vectors: torch.Tensor) -> None:
        self.file.scatter_into(self._resolve() + offset, vectors)


@dataclass(frozen=True)
class _Key:
    info: TensorInfo
    geometry: Geometry
    first_byte: tuple[str, int]  # (file, offset) of its first chunk, for storage order


class DcpReader(CheckpointReader):
    """A DCP folder; ``dcp_folder`` is where ``.metadata`` lives (the checkpoint folder itself,
    or its ``model_and_optim/`` for OLMo-core)."""

    format_name = "dcp"

    @classmethod
    def dcp_folder(cls, fs: FileSystem, path: str) -> str:
        return path

    @classmethod
    def detect(cls, fs: FileSystem, path: str) -> bool:
        folder = cls.dcp_folder(fs, path)
        return fs.isfile(join(fs, folder, METADATA_FILE)) or any(
            str(name).endswith(".distcp") for name in folder_names(fs, folder)
        )

    @classmethod
    def incomplete_reason(cls, fs: FileSystem, path: str) -> str | None:
        if not fs.isfile(join(fs, cls.dcp_folder(fs, path), METADATA_FILE)):
            return "no .metadata (DCP writes it last: the save did not finish)"
        return None

    def __init__(self, fs: FileSystem, path: str) -> None:
        super().__init__(fs, path)
        self._files: dict[str, RandomAccessFile] = {}
        self._held = 0  # bytes of the files opened so far
        # The items' pickles and layouts, parsed once each: chunks of one shape and dtype share theirs.
        self._small = SmallArchives()
        self._data_files: dict[str, _DataFile] = {}  # by path: the items of each, located together
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _file(self, name: str) -> RandomAccessFile:
        if name not in self._files:
            self._files[name] = file = RandomAccessFile(self.fs, join(self.fs, self.folder, name))
            self._held += file.size
        return self._files[name]

    def _open(self) -> None:
        reason = self.incomplete_reason(self.fs, self.path)
        if reason is not None:
            raise CheckpointError(f"{self.display_path}: incomplete checkpoint: {reason}")
        self.folder = self.dcp_folder(self.fs, self.path)
        shown = display(self.fs, self.folder)
        where = f"{shown}/{METADATA_FILE}"
        metadata = read_metadata(self.fs, self.folder)
        try:
            # Keyed by (key, chunk offsets) whatever class the index is (torch's, OLMo-core's or
            # HyperParallel's); non-tensor entries have no offsets.
            storage = {
                (index.fqn, None if index.offset is None else tuple(index.offset)): info
                for index, info in metadata.storage_data.items()
            }
        except (AttributeError, TypeError) as exc:
            raise CheckpointError(f"{where}: malformed storage index ({exc})") from None
        keys = []
        self._objects: dict[str, tuple[StoredObject, RandomAccessFile, int]] = {}
        claimed = 0  # bytes of the chunks seen so far
        for key, entry in metadata.state_dict_metadata.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{where}: key {shown_value(key)} is not a string")
            if not hasattr(entry, "chunks"):
                # A pickled object (a step counter, an RNG state): never averaged; an output may carry it.
                self._add_object(key, storage.get((key, None)), where)
                continue
            try:
                raw_dtype, raw_shape = entry.properties.dtype, entry.size
                chunks = [(chunk.sizes, _naturals(chunk.offsets)) for chunk in entry.chunks]
            except (AttributeError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{where}: key {key!r} has malformed metadata ({exc})") from None
            dtype = _dtype(raw_dtype)
            if dtype not in READ:
                raise CheckpointError(f"{where}: key {key!r} has unsupported dtype {shown_value(raw_dtype)}")
            shape = checked_shape(raw_shape, f"{where}: key {key!r}", dtype.itemsize)
            blocks = []
            positions = []
            for raw_sizes, offsets in chunks:
                sizes = checked_shape(raw_sizes, f"{where}: key {key!r} chunk at {list(offsets)}", dtype.itemsize)
                if len(sizes) != len(shape) or len(offsets) != len(shape):
                    raise CheckpointError(f"{where}: key {key!r} has a chunk of the wrong rank")
                if any(o + s > e for o, s, e in zip(offsets, sizes, shape, strict=True)):
                    raise CheckpointError(f"{where}: key {key!r} has a chunk outside its shape {list(shape)}")
                if 0 in sizes:
                    continue
                stored = storage.get((key, offsets))
                if stored is None:
                    raise CheckpointError(f"{where}: key {key!r} chunk at {list(offsets)} has no storage entry")
                file_name = self._stored_file_name(stored, key, where)
                source, start, position = self._chunk_data(self._file(file_name), stored, key, sizes, dtype)
                # Chunks lie apart in the files they name, so together they cannot claim more bytes
                # than those hold: a claim past that is refused now, before a merge allocates for it
                # (a DCP output gathers each tensor whole) rather than when a read reaches it.
                claimed += numel(sizes) * dtype.itemsize
                if claimed > self._held:
                    raise CheckpointError(
                        f"{where}: key {key!r} chunk at {list(offsets)} brings the chunks' tensor data to "
                        f"{claimed} bytes, more than the {self._held} bytes of the data files they name"
                    )
                blocks.append(StoredBlock(source, offsets, sizes, start))
                positions.append((file_name, position))
            info = TensorInfo(key, dtype, shape, f"{shown}/__*.distcp")
            if info.numel:
                check_grid(key, shape, blocks, shown)
            keys.append(_Key(info, Geometry(shape, blocks), min(positions, default=("", 0))))
        keys.sort(key=lambda k: k.first_byte)
        self._keys = {k.info.name: k for k in keys}

    @staticmethod
    def _stored_file_name(stored: Any, key: str, where: str) -> str:
        """The data file of a storage entry: a plain name in this folder, and no transforms."""
        if getattr(stored, "transform_descriptors", None):
            raise CheckpointError(
                f"{where}: key {key!r} is stored with transforms {shown_value(stored.transform_descriptors)} "
                "(compressed or extended DCP), which ckptavg does not read"
            )
        file_name = getattr(stored, "relative_path", None)
        if not isinstance(file_name, str):
            raise CheckpointError(f"{where}: key {key!r} has a storage entry without a file name")
        return plain_file_name(file_name, where)

    @staticmethod
    def _byte_range(file: RandomAccessFile, stored: Any, key: str) -> tuple[int, int]:
        """``(offset, length)`` of a storage entry, inside its file."""
        offset, length = getattr(stored, "offset", None), getattr(stored, "length", None)
        if not (is_natural(offset) and is_natural(length)):
            raise CheckpointError(
                f"{file.display_path}: key {key!r} has a malformed storage entry (offset {shown_value(offset)}, "
                f"length {shown_value(length)})"
            )
        if offset + length > file.size:
            raise CheckpointError(f"{file.display_path}: key {key!r} lies past the end; the file is truncated")
        return offset, length

    def _chunk_data(
        self, file: RandomAccessFile, stored: Any, key: str, sizes: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[Any, int, int]:
        """Where one chunk's row-major bytes are: (something with ``read_into``, the offset to
        read from in it, position in the file for storage order). Here a torch.save archive at
        ``(offset, length)``, parsed on its first read."""
        offset, length = self._byte_range(file, stored, key)
        if file.path not in self._data_files:
            self._data_files[file.path] = _DataFile(file, self._small)
        return _Item(self._data_files[file.path], offset, length, key, sizes, dtype), 0, offset

    def carries(self, name: str) -> str | None:
        """Why a merged DCP output takes the byte item ``name`` over from the source it carries, or
        None when it leaves it out: here those of the model, not the trainer's state (an
        optimizer's param groups, a data loader's position)."""
        return "a pickled object, not a tensor" if self.is_model_weight(name) else None

    def _add_object(self, key: str, stored: Any, where: str) -> None:
        why = self.carries(key)
        if why is None:
            return
        if stored is None:
            raise CheckpointError(f"{where}: key {key!r} has no storage entry")
        file = self._file(self._stored_file_name(stored, key, where))
        offset, length = self._byte_range(file, stored, key)
        self._objects[key] = (StoredObject(key, length, why), file, offset)

    def carried_objects(self) -> list[StoredObject]:
        return [stored for stored, _, _ in self._objects.values()]

    def read_object_into(self, name: str, byte_offset: int, buffer: memoryview) -> None:
        _, file, offset = self._objects[name]
        file.read_into(offset + byte_offset, buffer)

    def tensors(self) -> list[TensorInfo]:
        return [k.info for k in self._keys.values()]

    def is_model_weight(self, name: str) -> bool:
        return not name.startswith(NON_MODEL_PREFIXES)

    def read_into(self, name: str, byte_offset: int, buffer: memoryview) -> None:
        key = self._keys[name]
        key.geometry.read_into(key.info.dtype.itemsize, byte_offset, buffer)

    def local_view(self, name: str, byte_offset: int, nbytes: int) -> MappedRange | None:
        key = self._keys[name]
        return key.geometry.local_view(key.info.dtype.itemsize, byte_offset, nbytes)

    def weight_files(self) -> set[str]:
        return {name for name in folder_names(self.fs, self.path) if name.endswith(".distcp") or name == METADATA_FILE}

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()


class OlmoCoreReader(DcpReader):
    format_name = "dcp-olmo-core"

    @classmethod
    def dcp_folder(cls, fs: FileSystem, path: str) -> str:
        return join(fs, path, OLMO_CORE_FOLDER)

    @classmethod
    def detect(cls, fs: FileSystem, path: str) -> bool:
        return fs.isdir(cls.dcp_folder(fs, path)) and super().detect(fs, path)

    def dcp_placement(self) -> DcpPlacement:
        return DcpPlacement(data=OLMO_CORE_FOLDER)  # where OLMo-core's loader looks

    @classmethod
    def incomplete_reason(cls, fs: FileSystem, path: str) -> str | None:
        # A ckptavg output in OLMo-core's layout is completed by its manifest instead.
        if not fs.isfile(join(fs, path, OLMO_CORE_MARKER)) and not fs.isfile(join(fs, path, MANIFEST_FILE)):
            return f"no {OLMO_CORE_MARKER} (OLMo-core writes it last: the save did not finish)"
        return super().incomplete_reason(fs, path)


class MegatronReader(DcpReader):
    """Megatron-core ``dist_checkpointing`` (Megatron-LM, NeMo): a DCP folder beside
    ``common.pt`` (``torch.save`` of the state that is not sharded: args, iteration, the
    optimizer's param groups) and ``metadata.json`` (the backend, written last).

    Keys are the ``ShardedTensor`` keys (``decoder.layers.*`` stacked over layers); the optimizer
    is ``optimizer.*`` (``optimizer.state.fp32_param.<key>``: the fp32 master weights of bf16
    parameters). Byte items (``<linear>._extra_state/shard_*``, ``rng_state/shard_*``) are never
    averaged; a DCP output takes those of the model over from one source (``--copy-from``, the
    newest by default), with ``common.pt`` (rewritten: :meth:`companion_for`) and
    ``metadata.json``, since ``dist_checkpointing.load`` needs each of them (the optimizer's,
    never: see :meth:`carries`). Other outputs (safetensors, ``.pt``) hold weights only: neither
    file goes there."""

    format_name = "dcp-megatron"

    @classmethod
    def detect(cls, fs: FileSystem, path: str) -> bool:
        names = set(folder_names(fs, path))
        return MEGATRON_COMMON in names and (MEGATRON_CONFIG in names or super().detect(fs, path))

    @classmethod
    def incomplete_reason(cls, fs: FileSystem, path: str) -> str | None:
        # Whatever its backend: a save that wrote metadata.json is finished (the reader refuses
        # a backend it cannot read, rather than letting a merge skip it as incomplete).
        if not fs.isfile(join(fs, path, MEGATRON_CONFIG)):
            return f"no {MEGATRON_CONFIG} (Megatron writes it last: the save did not finish)"
        return None

    def _open(self) -> None:
        self._placement: DcpPlacement | None = None  # read from common.pt when a DCP output asks
        self._optimizer_objects: set[str] = set()  # never carried: see carries()
        if self.incomplete_reason(self.fs, self.path) is None:
            self._check_backends()
        super()._open()

    def _check_backends(self) -> None:
        """One line naming a backend ckptavg cannot read (zarr, a later torch_dist version),
        where the merge would otherwise fail on a file it does not know."""
        path = join(self.fs, self.path, MEGATRON_CONFIG)
        config = read_json(self.fs, path, "Megatron's metadata.json")
        if not isinstance(config, dict):
            raise CheckpointError(f"{display(self.fs, path)}: not Megatron's checkpoint config (not a JSON object)")
        # Absent fields take the defaults of Megatron's CheckpointingConfig.
        for kind, wanted, default in (("sharded", "torch_dist", None), ("common", "torch", "torch")):
            backend, version = config.get(f"{kind}_backend", default), config.get(f"{kind}_backend_version", 1)
            if (backend, version) != (wanted, 1):
                raise CheckpointError(
                    f"{display(self.fs, path)}: Megatron {kind} backend {shown_value(backend)} version "
                    f"{shown_value(version)}: ckptavg reads {wanted!r} version 1 only (Megatron-LM re-saves a "
                    "checkpoint as torch_dist with --ckpt-convert-format torch_dist)"
                )

    def is_model_weight(self, name: str) -> bool:
        # A module's extra state is a byte item in torch_dist; should a version store it as a
        # (uint8) tensor, it is still no weight.
        return super().is_model_weight(name) and not ("._extra_state" in name or name.startswith("rng_state"))

    def carries(self, name: str) -> str | None:
        if name.startswith(NON_MODEL_PREFIXES):
            # The DistributedOptimizer's layouts store its state as objects: the newest one
            # beside averaged weights would be a state no run had; an output leaves it out.
            return None
        if name.startswith("rng_state"):
            return "RNG state of one (pipeline, tensor) rank: Megatron-LM loads it unless --no-load-rng"
        if "._extra_state" in name:
            return "a module's extra state (Transformer Engine's FP8 metadata, or None): Megatron loads it"
        return "a pickled object (ShardedObject), not a tensor"

    def _add_object(self, key: str, stored: Any, where: str) -> None:
        if key.startswith("optimizer."):
            self._optimizer_objects.add(key)
        super()._add_object(key, stored, where)

    def _holds_optimizer(self, keys: frozenset[str]) -> bool | None:
        """Whether an output holding ``keys`` holds all of this checkpoint's optimizer state
        under its own names; None when this checkpoint has none."""
        state = {name for name in self._keys if name.startswith("optimizer.")} | self._optimizer_objects
        return (state <= keys) if state else None

    def companion_for(self, name: str, output: MergedOutput) -> bytes | None:
        """``common.pt`` for a merged output: the merge's provenance added (under Megatron-LM's
        ``weighted_merge.py``'s key and field names); and where this checkpoint had optimizer
        state that the output does not hold, the optimizer's common part (param groups, step
        counters: half an optimizer) left out and ``args.no_save_optim`` set, as Megatron-LM
        saves with ``--no-save-optim``, so that its loader asks the output for no optimizer state
        instead of failing inside ``dist_checkpointing.load`` on the first ``optimizer.state.*``
        key. Every other object stays as it was, written back without being made
        (:mod:`.repickle`)."""
        if name != MEGATRON_COMMON:
            return None
        path = join(self.fs, self.path, MEGATRON_COMMON)
        data = read_small_file(self.fs, path, MAX_COMMON_BYTES, "Megatron's common.pt")
        graph = read_graph(data, display(self.fs, path))
        if not isinstance(graph.root, dict):
            raise CheckpointError(f"{graph.where}: not Megatron's common state (not a dict)")
        common = dict(graph.root)
        holds_optimizer = self._holds_optimizer(output.keys)
        if holds_optimizer is False:
            common.pop("optimizer", None)
            _set_arg(common.get("args"), "no_save_optim", True)
        common[PROVENANCE_KEY] = {
            **output.provenance,
            "output_iteration": common.get("iteration"),
            "optimizer_merged": bool(holds_optimizer),
            "rng_merged": False,
        }
        return graph.saved(common)

    def extra_files(self) -> list[str]:
        # metadata.json says "a torch_dist checkpoint": true only of a DCP output (a companion).
        return [name for name in super().extra_files() if name != MEGATRON_CONFIG]

    def companion_files(self) -> list[str]:
        # dist_checkpointing.load needs common.pt (args, iteration, the optimizer's param groups:
        # a pickle, never run here) and metadata.json, so a DCP output takes those of the source
        # it carries: metadata.json as it is, common.pt as companion_for() rewrites it.
        return [MEGATRON_COMMON, MEGATRON_CONFIG]

    def dcp_placement(self) -> DcpPlacement:
        """Megatron-LM's own layout, which its ``--load`` takes as it is: the checkpoint in
        ``iter_NNNNNNN/`` and the tracker file naming it beside it. The iteration is the one the
        carried ``common.pt`` records, from which Megatron-LM resumes (not the folder's name): the
        merge step whenever the window holds it."""
        if self._placement is None:
            iteration = self.iteration()
            self._placement = DcpPlacement(
                f"iter_{iteration:07d}", beside=((MEGATRON_TRACKER, str(iteration).encode()),)
            )
        return self._placement

    def iteration(self) -> int:
        """The ``iteration`` that ``common.pt`` records, read with the allow-list unpickler (its
        other objects, ``args`` a Namespace among them, stand as classes that run nothing)."""
        file = RandomAccessFile(self.fs, join(self.fs, self.path, MEGATRON_COMMON))
        try:
            root = TorchSaveArchive(file, 0, file.size, file.display_path, skip_unknown=True).root
        finally:
            file.close()
        iteration = root.get("iteration") if isinstance(root, dict) else None
        if not is_natural(iteration):
            raise CheckpointError(
                f"{file.display_path}: iteration is {shown_value(iteration)}, not a step from 0 to 2**63-1 "
                "(Megatron-LM resumes from it; a DCP output names its iter_NNNNNNN folder by it)"
            )
        return iteration


def _set_arg(args: Any, name: str, value: Any) -> None:
    """Set ``name`` in Megatron-LM's ``args`` as :mod:`.repickle` records it (an
    ``argparse.Namespace``: its class, then its ``__dict__`` as state); args of another shape
    are left as they are."""
    if isinstance(args, Made) and isinstance(args.state, dict):
        args.state = {**args.state, name: value}


class MegatronLoadFolderReader(MegatronReader):
    """The folder Megatron-LM's ``--load`` takes: ``latest_checkpointed_iteration.txt`` names the
    checkpoint inside it (``iter_NNNNNNN/`` by its iteration, or ``release/``), which is read as
    :class:`MegatronReader` reads it. ckptavg's DCP outputs of Megatron runs are such folders."""

    @classmethod
    def detect(cls, fs: FileSystem, path: str) -> bool:
        return MEGATRON_TRACKER in folder_names(fs, path)

    @classmethod
    def checkpoint_folder(cls, fs: FileSystem, path: str) -> str:
        """The checkpoint folder the tracker names, as Megatron-LM's ``read_metadata`` reads it."""
        tracker = join(fs, path, MEGATRON_TRACKER)
        text = read_small_file(fs, tracker, 64, "Megatron's tracker file").decode("ascii", "replace").strip()
        if text == "release":
            return join(fs, path, "release")
        if not (text.isdigit() and text.isascii() and is_natural(int(text))):
            raise CheckpointError(f"{display(fs, tracker)}: {text!r} is neither an iteration nor 'release'")
        return join(fs, path, f"iter_{int(text):07d}")

    @classmethod
    def incomplete_reason(cls, fs: FileSystem, path: str) -> str | None:
        if not cls.detect(fs, path):  # the checkpoint folder itself: an opened reader's path
            return super().incomplete_reason(fs, path)
        try:
            folder = cls.checkpoint_folder(fs, path)
        except CheckpointError as exc:  # a listing notes it; opening the folder refuses it
            return str(exc)
        if not fs.isdir(folder):
            return f"{MEGATRON_TRACKER} names {folder.rsplit('/', 1)[-1]}/, which is not there"
        return super().incomplete_reason(fs, folder)

    def __init__(self, fs: FileSystem, path: str) -> None:
        reason = self.incomplete_reason(fs, path)
        if reason is not None:
            raise CheckpointError(f"{display(fs, path)}: incomplete checkpoint: {reason}")
        # Read as the checkpoint it names: its files (common.pt, the data files) are that folder's.
        super().__init__(fs, self.checkpoint_folder(fs, path))


class HyperParallelReader(DcpReader):
    """HyperParallel's DCP (``global_step_N/``): its own metadata classes in ``.metadata``, and one
    safetensors file per rank (``_rank{r}_.safetensors``) holding the rank's chunks under the key
    the storage entry names (``tensor_key``, else the key itself)."""

    format_name = "dcp-hyper-parallel"

    @classmethod
    def detect(cls, fs: FileSystem, path: str) -> bool:
        return any(name.startswith("_rank") and name.endswith("_.safetensors") for name in folder_names(fs, path))

    def _chunk_data(
        self, file: RandomAccessFile, stored: Any, key: str, sizes: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[Any, int, int]:
        if file.path not in self._headers:
            self._headers[file.path] = {e[0]: e for e in parse_header(file)[1]}
        name = getattr(stored, "tensor_key", None) or key
        if not isinstance(name, str):
            raise CheckpointError(
                f"{file.display_path}: key {key!r} names its tensor {shown_value(name)}, not a string"
            )
        entry = self._headers[file.path].get(name)
        if entry is None:
            raise CheckpointError(f"{file.display_path}: tensor {name!r} (of key {key!r}) is not in the file")
        _, stored_dtype, shape, start, _end = entry
        if stored_dtype != dtype or shape != sizes:
            raise CheckpointError(
                f"{file.display_path}: tensor {name!r} is {stored_dtype} {list(shape)} but the metadata says "
                f"{dtype} {list(sizes)}"
            )
        return file, start, start

    def _open(self) -> None:
        self._headers: dict[str, dict[str, tuple]] = {}
        super()._open()

    def is_model_weight(self, name: str) -> bool:
        return not name.startswith((*NON_MODEL_PREFIXES, "extra_state."))

    def carries(self, name: str) -> str | None:
        return None  # its byte items are plain pickles for its own loader, not torch.save payloads

    def weight_files(self) -> set[str]:
        names = folder_names(self.fs, self.path)
        return {
            n
            for n in names
            if n == METADATA_FILE or (n.startswith("_rank") and n.endswith(("_.safetensors", "_.bytes")))
        }
