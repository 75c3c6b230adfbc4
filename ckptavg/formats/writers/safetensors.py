"""Streaming writer of one safetensors file whose tensor list is known up front.

The header (offsets included) is computed before any data exists, so tensor bytes can be
written as they are produced, chunk by chunk, in layout order, hashing as they go.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

from ...errors import OutputError
from ...io.atomic import close_output, open_output, open_output_range
from ...io.fs import FileSystem, is_local
from ..layout import ShardPart, ShardSpec, TensorSpec, layout_shards
from ..safetensors import DTYPE_NAMES, INDEX_FILE
from .base import OutputFormat


def build_header(shard: ShardSpec, metadata: dict[str, str] | None = None) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for spec in shard.tensors:
        header[spec.name] = {
            "dtype": DTYPE_NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    # The spec pads the header with spaces so that the data starts 8-byte aligned.
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


class SafetensorsFileWriter:
    """Writes ``shard`` to ``path``: header first, then exactly ``shard.nbytes`` of data.

    ``checksum=False`` skips the sha256 (``close`` returns "") where the bytes are rewritten
    every training step and hashing would double the CPU cost of writing them. ``fsync``: the
    file reaches a local disk before ``close`` returns."""

    def __init__(
        self,
        fs: FileSystem,
        path: str,
        shard: ShardSpec,
        shown_path: str,
        metadata: dict[str, str] | None = None,
        checksum: bool = True,
        fsync: bool = True,
    ) -> None:
        self.shard = shard
        self.shown_path = shown_path
        self._fs, self._fsync = fs, fsync
        self._hash = hashlib.sha256() if checksum else None
        self._remaining = shard.nbytes
        self.size = 0
        self._begin(lambda: open_output(fs, path, fsync, direct=True), build_header(shard, metadata))

    def _begin(self, open_file: Callable[[], BinaryIO], header: bytes) -> None:
        try:
            self._file = open_file()
        except OSError as exc:
            raise OutputError(f"cannot create {self.shown_path}: {exc.strerror or exc}") from exc
        try:
            self._write(header)
        except BaseException:
            self.abort()  # the caller gets no writer to abort, so no handle must stay open
            raise

    def _write(self, data: bytes | memoryview) -> None:
        try:
            self._file.write(data)
        except OSError as exc:
            raise OutputError(f"cannot write {self.shown_path}: {exc.strerror or exc}") from exc
        if self._hash is not None:
            self._hash.update(data)
        self.size += len(data)

    def write(self, data: memoryview) -> None:
        if len(data) > self._remaining:
            raise AssertionError(f"{self.shown_path}: more data than the header declares")
        self._remaining -= len(data)
        self._write(data)

    def close(self) -> str:
        """Finish the file and return its sha256 ("" without ``checksum``)."""
        if self._remaining:
            raise AssertionError(f"{self.shown_path}: {self._remaining} bytes were never written")
        try:
            close_output(self._fs, self._file, self._fsync)
        except OSError as exc:
            raise OutputError(f"cannot write {self.shown_path}: {exc.strerror or exc}") from exc
        return "" if self._hash is None else self._hash.hexdigest()

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()


class SafetensorsRangeWriter(SafetensorsFileWriter):
    """One process's share of a safetensors file that several processes write at once
    (:class:`ShardPart`): the bytes of the header that fall in it, then its tensor data, each at
    its place in the file. ``close`` returns the sha256 of the range (the file's is taken once
    every range is written: the first range's hash, left in ``heads``, is continued there)."""

    def __init__(
        self, fs: FileSystem, path: str, part: ShardPart, shown_path: str, heads: dict[str, Any], fsync: bool = True
    ) -> None:
        self.shard = part
        self._heads = heads if part.start == 0 else None
        self.shown_path = shown_path
        self._fs, self._fsync = fs, fsync
        self._hash = hashlib.sha256()
        self._remaining = part.nbytes
        self.size = 0
        header = build_header(part.whole)[part.start : min(part.stop, part.data_start)]
        self._begin(lambda: open_output_range(path, part.size, part.start, fsync), header)

    def close(self) -> str:
        digest = super().close()
        if self._heads is not None:
            self._heads[self.shard.file_name] = self._hash
        return digest


class SafetensorsOutput(OutputFormat):
    """Hugging Face layout: ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``."""

    name = "safetensors"

    def layout(self, specs: Sequence[TensorSpec], shard_size: int) -> list[ShardSpec]:
        return layout_shards(specs, shard_size)

    def header_size(self, shard: ShardSpec) -> int | None:
        # The header is known from the tensor list alone; positional writes need a local file.
        return len(build_header(shard)) if is_local(self.fs) else None

    def open_sink(self, shard: ShardSpec) -> SafetensorsFileWriter:
        path, shown = self.file_path(shard.file_name), self._shown(shard.file_name)
        if isinstance(shard, ShardPart):
            return SafetensorsRangeWriter(self.fs, path, shard, shown, self.heads, fsync=self.fsync)
        return SafetensorsFileWriter(self.fs, path, shard, shown, fsync=self.fsync)

    def finish(self, shards: Sequence[ShardSpec], records: dict[str, Any]) -> dict[str, str]:
        return self._write_index(INDEX_FILE, shards)
