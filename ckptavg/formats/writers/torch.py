"""Outputs written with ``torch.save``: ``.pt`` state dicts and DCP folders.

Both need each tensor whole (``torch.save`` serialises a tensor, not a stream of chunks), so
their sinks gather one tensor's chunks before saving it: a DCP output holds one tensor at a time
in memory, a ``.pt`` shard holds its whole shard (``--shard-size`` bounds it).

The DCP output is what ``torch.distributed.checkpoint``'s own ``FileSystemWriter`` produces from
one process: each tensor an item saved with ``torch.save`` into ``__0_{k}.distcp`` files, and
``.metadata`` built from DCP's own metadata classes, pickled last. ``dcp.load`` (any world size,
any sharding) and OLMo-core's ``load_model_and_optim_state`` read it back.
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
from collections.abc import Sequence
from typing import Any, BinaryIO, cast

import torch

from ...errors import OutputError
from ...io.atomic import close_output, open_output, output_file, write_bytes
from ...io.fs import FileSystem, join
from ..base import CheckpointReader, DcpPlacement, StoredObject
from ..layout import ShardSpec, TensorSpec, layout_shards
from .base import OutputFormat

PT_INDEX_FILE = "pytorch_model.bin.index.json"
DCP_METADATA_FILE = ".metadata"
_COPY_BLOCK = 4 * 2**20


class _HashingStream:
    """A write-only stream that hashes and counts what passes through (``tell`` is the count)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()
        self.position = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.handle.write(view)
        self.digest.update(view)
        self.position += len(view)
        return len(view)

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        self.handle.flush()

    def as_file(self) -> BinaryIO:
        """This stream where a binary file is expected: ``torch.save`` calls only ``write``,
        ``flush`` and ``tell``."""
        return cast(BinaryIO, self)


class _TensorGatherSink:
    """Collects the chunks of each tensor of a shard, in layout order, into a whole tensor and
    hands it to :meth:`tensor_done`."""

    def __init__(self, fs: FileSystem, path: str, shard: ShardSpec, shown: str, fsync: bool) -> None:
        self.shard, self.shown = shard, shown
        self._fs, self._fsync = fs, fsync
        self._pending = [t for t in shard.tensors]
        self._buffer: bytearray | None = None
        self._filled = 0
        try:
            self._handle = open_output(fs, path, fsync, direct=True)
        except OSError as exc:
            raise OutputError(f"cannot create {shown}: {exc.strerror or exc}") from exc
        self.stream = _HashingStream(self._handle)
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self._pending and self._pending[0].nbytes == 0:
            spec = self._pending.pop(0)
            self._save(spec, torch.empty(spec.shape, dtype=spec.dtype))

    def write(self, data: memoryview) -> None:
        while len(data):
            if not self._pending:
                raise AssertionError(f"{self.shown}: more data than laid out")
            spec = self._pending[0]
            if self._buffer is None:
                self._buffer, self._filled = bytearray(spec.nbytes), 0
            n = min(len(data), spec.nbytes - self._filled)
            self._buffer[self._filled : self._filled + n] = data[:n]
            self._filled += n
            data = data[n:]
            if self._filled == spec.nbytes:
                tensor = torch.frombuffer(self._buffer, dtype=spec.dtype).reshape(spec.shape)
                self._buffer = None
                self._pending.pop(0)
                self._save(spec, tensor)
                self._skip_empty()

    def _save(self, spec: TensorSpec, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def _guarded(self, action: Any) -> None:
        try:
            action()
        except OSError as exc:
            raise OutputError(f"cannot write {self.shown}: {exc.strerror or exc}") from exc

    def close(self) -> str:
        if self._pending:
            raise AssertionError(f"{self.shown}: tensor {self._pending[0].name!r} was never completed")
        self._guarded(lambda: close_output(self._fs, self._handle, self._fsync))
        return self.stream.digest.hexdigest()

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._handle.close()


class _PtShardSink(_TensorGatherSink):
    def __init__(self, *args: Any) -> None:
        self.state_dict: dict[str, torch.Tensor] = {}
        super().__init__(*args)

    def _save(self, spec: TensorSpec, tensor: torch.Tensor) -> None:
        self.state_dict[spec.name] = tensor

    def close(self) -> str:
        # Plan order, not the largest-first storage order, so the file lists keys as the index does.
        ordered = {name: self.state_dict[name] for name in sorted(self.state_dict)}
        self._guarded(lambda: torch.save(ordered, self.stream.as_file()))
        self.state_dict.clear()
        return super().close()


class PtOutput(OutputFormat):
    """transformers' ``pytorch_model-0000i-of-0000n.bin`` shards with ``pytorch_model.bin.index.json``."""

    name = "pt"

    def layout(self, specs: Sequence[TensorSpec], shard_size: int) -> list[ShardSpec]:
        return layout_shards(specs, shard_size, prefix="pytorch_model", suffix=".bin")

    def open_sink(self, shard: ShardSpec) -> _PtShardSink:
        return _PtShardSink(self.fs, self.file_path(shard.file_name), shard, self._shown(shard.file_name), self.fsync)

    def finish(self, shards: Sequence[ShardSpec], records: dict[str, Any]) -> dict[str, str]:
        return self._write_index(PT_INDEX_FILE, shards)


class _DcpFileSink(_TensorGatherSink):
    def __init__(self, *args: Any) -> None:
        self.items: list[tuple[TensorSpec, int, int]] = []  # (tensor, offset, length)
        super().__init__(*args)

    def _save(self, spec: TensorSpec, tensor: torch.Tensor) -> None:
        start = self.stream.tell()
        self._guarded(lambda: torch.save(tensor, self.stream.as_file()))
        self.items.append((spec, start, self.stream.tell() - start))


def _copy_object(source: CheckpointReader, stored: StoredObject, stream: _HashingStream) -> None:
    """The stored bytes of one object, in blocks (an object may be large: a data loader's state)."""
    block = memoryview(bytearray(min(_COPY_BLOCK, stored.nbytes)))
    for offset in range(0, stored.nbytes, _COPY_BLOCK):
        part = block[: min(_COPY_BLOCK, stored.nbytes - offset)]
        source.read_object_into(stored.name, offset, part)
        stream.write(part)


class DcpOutput(OutputFormat):
    """A DCP folder (``__0_{k}.distcp`` + ``.metadata``), placed where the trainer of the source it
    carries loads it from (:meth:`~..base.CheckpointReader.dcp_placement`): inside
    ``model_and_optim/`` for OLMo-core runs, as ``iter_NNNNNNN/`` beside
    ``latest_checkpointed_iteration.txt`` for Megatron runs. That source's pickled objects
    (byte items) follow the tensors in one more data file, their bytes as stored (DCP loads a
    byte item with ``torch.load`` of exactly those bytes), indexed as byte items."""

    name = "dcp"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._sinks: dict[str, _DcpFileSink] = {}
        self._objects: list[tuple[str, str, int, int]] = []  # (name, file, offset, length)
        self.placement = self.source.dcp_placement() if self.source is not None else DcpPlacement()

    def files_to_carry(self, source: CheckpointReader) -> list[str]:
        return [*source.extra_files(), *source.companion_files()]

    def carried_name(self, name: str) -> str:
        return self.placement.of(name)

    def carry(self, source: CheckpointReader, shards: Sequence[ShardSpec]) -> dict[str, str]:
        objects = source.carried_objects()
        if not objects:
            return {}
        averaged = {spec.name for shard in shards for spec in shard.tensors}
        for stored in objects:
            if stored.name in averaged:
                raise OutputError(
                    f"key {stored.name!r} of {source.display_path} is both an averaged tensor (after the key "
                    "filter) and an object copied from that source: one DCP key cannot hold both"
                )
        file_name = f"__0_{len(shards)}.distcp"
        try:
            with output_file(self.fs, self.file_path(file_name), self.fsync) as handle:
                stream = _HashingStream(handle)
                for stored in objects:
                    start = stream.tell()
                    _copy_object(source, stored, stream)
                    self._objects.append((stored.name, file_name, start, stored.nbytes))
        except OSError as exc:
            raise OutputError(f"cannot write {self._shown(file_name)}: {exc.strerror or exc}") from exc
        self.carried = objects
        return {self.relative(file_name): stream.digest.hexdigest()}

    @property
    def data_folder(self) -> str:
        return self.placement.data_folder

    def layout(self, specs: Sequence[TensorSpec], shard_size: int) -> list[ShardSpec]:
        shards = layout_shards(specs, shard_size)
        return [ShardSpec(f"__0_{i}.distcp", shard.tensors) for i, shard in enumerate(shards)]

    def open_sink(self, shard: ShardSpec) -> _DcpFileSink:
        if self.data_folder:
            self.fs.makedirs(self.file_path(""), exist_ok=True)
        sink = _DcpFileSink(self.fs, self.file_path(shard.file_name), shard, self._shown(shard.file_name), self.fsync)
        self._sinks[shard.file_name] = sink
        return sink

    def record(self, file_name: str) -> Any:
        return [[spec.name, offset, length] for spec, offset, length in self._sinks[file_name].items]

    def finish(self, shards: Sequence[ShardSpec], records: dict[str, Any]) -> dict[str, str]:
        from torch.distributed.checkpoint import filesystem
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            StorageMeta,
            TensorProperties,
            TensorStorageMetadata,
        )

        tensors: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        storage: dict[MetadataIndex, Any] = {}
        for shard in shards:
            specs = {spec.name: spec for spec in shard.tensors}
            for name, offset, length in records[shard.file_name]:
                spec = specs[name]
                origin, size = torch.Size([0] * len(spec.shape)), torch.Size(spec.shape)
                tensors[spec.name] = TensorStorageMetadata(
                    TensorProperties(dtype=spec.dtype), size, [ChunkStorageMetadata(origin, size)]
                )
                storage[MetadataIndex(spec.name, origin)] = filesystem._StorageInfo(shard.file_name, offset, length)
        for name, file_name, offset, length in self._objects:
            tensors[name] = BytesStorageMetadata()
            storage[MetadataIndex(name)] = filesystem._StorageInfo(file_name, offset, length)
        ordered = dict(sorted(tensors.items()))
        metadata = Metadata(
            state_dict_metadata=ordered,
            # How DCP nests flat keys when it loads without a target state dict: ``model.x``
            # under ``model`` (the trainers' layout), everything else at the top level.
            planner_data={name: ("model", name[6:]) if name.startswith("model.") else (name,) for name in ordered},
            storage_data=storage,
            storage_meta=StorageMeta(),
            version=getattr(filesystem, "CURRENT_DCP_VERSION", None),
        )
        data = pickle.dumps(metadata)
        path = self.file_path(DCP_METADATA_FILE)
        hashes = {self.relative(DCP_METADATA_FILE): write_bytes(self.fs, path, data, self.fsync)}
        # After the checkpoint they name, as the trainer writes them (Megatron's tracker file).
        for name, content in self.placement.beside:
            hashes[name] = write_bytes(self.fs, join(self.fs, self.folder, name), content, self.fsync)
        return hashes
