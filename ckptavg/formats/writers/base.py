"""The interface of an output format: how the averaged bytes reach files, and what indexes them.

The engine streams every output shard's tensors, in layout order, chunk by chunk, into a
sink (``write`` / ``close`` -> sha256 / ``abort``) opened here; once all shards are closed,
:meth:`OutputFormat.finish` writes what indexes them (an index JSON, DCP's ``.metadata``). The
merge then adds the manifest last.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from ...io.atomic import write_json
from ...io.fs import FileSystem, join
from ..base import CheckpointReader, StoredObject
from ..layout import ShardSpec, TensorSpec

OUTPUT_FORMATS = ("safetensors", "dcp", "pt")


class ShardSink(Protocol):
    """Where the engine streams one output file: its bytes in layout order, then ``close`` (the
    file's sha256) or, on failure, ``abort``."""

    def write(self, data: memoryview) -> None: ...
    def close(self) -> str: ...
    def abort(self) -> None: ...


class OutputFormat(ABC):
    """One merge's writer for one format (it may keep state between shards, e.g. DCP offsets)."""

    name: ClassVar[str]

    def __init__(
        self, fs: FileSystem, folder: str, shown: str, source: CheckpointReader | None = None, fsync: bool = True
    ) -> None:
        self.fs, self.folder, self.shown = fs, folder, shown
        self.source = source  # the source whose other files the output carries (see make_output_format)
        self.fsync = fsync  # every file synced to a local disk when closed (io.atomic.close_output)
        self.carried: list[StoredObject] = []  # what carry() took over
        # {file name: sha256 of its first bytes}: the state of the hash of a shared file's first
        # range, from the process that wrote it, which then reads back only the rest to hash the file.
        self.heads: dict[str, Any] = {}

    @property
    def data_folder(self) -> str:
        """Where shard files go, relative to the output folder ("" for the folder itself)."""
        return ""

    @abstractmethod
    def layout(self, specs: Sequence[TensorSpec], shard_size: int) -> list[ShardSpec]:
        """The output files and their tensors (deterministic: names, shapes, dtypes, size only)."""

    def header_size(self, shard: ShardSpec) -> int | None:
        """The bytes of ``shard``'s file before its tensor data, where the whole file's layout
        follows from its tensor list and several processes can write byte ranges of it at once
        (a local file); None where only one process can write it, front to back (``torch.save``
        serialises whole objects; an object store takes an upload, not positional writes)."""
        return None

    @abstractmethod
    def open_sink(self, shard: ShardSpec) -> ShardSink:
        """The sink of one file of the layout, or of a byte range of it (a
        :class:`~..layout.ShardPart`, only where :meth:`header_size` is not None)."""

    def files_to_carry(self, source: CheckpointReader) -> list[str]:
        """The files of ``source`` (the one it carries) that the output takes over: its
        config and tokenizer files; a format that holds trainer objects adds the files those
        belong with (:meth:`CheckpointReader.companion_files`)."""
        return source.extra_files()

    def carried_name(self, name: str) -> str:
        """Where the file ``name`` of the carried source's folder goes, relative to the output."""
        return name

    def carry(self, source: CheckpointReader, shards: Sequence[ShardSpec]) -> dict[str, str]:
        """Take over the pickled objects of ``source`` (the one it carries) that this format can hold,
        byte for byte, before :meth:`finish` indexes them; return {relative file name: sha256}.
        :attr:`carried` lists them after. This format holds none."""
        return {}

    def record(self, file_name: str) -> Any:
        """What :meth:`finish` needs to know of one file this process wrote, as JSON values (it
        travels to process 0, and into the journal a resumed merge reads back)."""
        return None

    @abstractmethod
    def finish(self, shards: Sequence[ShardSpec], records: dict[str, Any]) -> dict[str, str]:
        """Write the index of all the shards; return {relative file name: sha256}."""

    def file_path(self, name: str) -> str:
        parts = [self.folder, self.data_folder, name] if self.data_folder else [self.folder, name]
        return join(self.fs, *parts)

    def _shown(self, name: str) -> str:
        return f"{self.shown}/{self.data_folder}/{name}" if self.data_folder else f"{self.shown}/{name}"

    def relative(self, name: str) -> str:
        return f"{self.data_folder}/{name}" if self.data_folder else name

    def _write_index(self, index_name: str, shards: Sequence[ShardSpec]) -> dict[str, str]:
        """The Hugging Face index (``total_size`` and ``weight_map``) of sharded weight files."""
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in shards)},
            "weight_map": dict(sorted((t.name, s.file_name) for s in shards for t in s.tensors)),
        }
        return {self.relative(index_name): write_json(self.fs, self.file_path(index_name), index, self.fsync)}
