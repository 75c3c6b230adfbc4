"""The library behind ``ckptavg merge``: choose sources, stream the average, publish the output."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import __version__
from .discovery import Checkpoint, find_checkpoints, mergeable, select_checkpoints
from .engine import DEFAULT_CHUNK_BYTES, EngineOptions, StreamingAverage, output_specs
from .errors import CkptavgError
from .formats import CheckpointReader, open_checkpoint
from .formats.outputs import make_output_format
from .output import MANIFEST_FILE, AtomicFolder, copy_file, write_bytes, write_json
from .selection import KeySelection, SelectedReader
from .shards import DEFAULT_SHARD_SIZE
from .storage import display, join, redact, resolve


@dataclass(frozen=True)
class MergeResult:
    """What a merge did, for the summary line and ``--json``."""

    output: str
    sources: list[dict[str, Any]]
    tensor_count: int
    bytes_read: int
    bytes_written: int
    seconds: float
    files: dict[str, str] = field(default_factory=dict)

    @property
    def read_gb_per_s(self) -> float:
        return self.bytes_read / max(self.seconds, 1e-9) / 1e9

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "sources": self.sources,
            "tensor_count": self.tensor_count,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 3),
            "read_gb_per_s": round(self.read_gb_per_s, 3),
            "files": self.files,
        }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _output_policy(dtype: torch.dtype | Mapping[str, torch.dtype] | None) -> str:
    if dtype is None:
        return "same as input"
    if isinstance(dtype, Mapping):
        return "same as the trained parameters"
    return _dtype_name(dtype)


def _open_all(paths: Sequence[str], keys: KeySelection | None = None) -> list[CheckpointReader]:
    readers: list[CheckpointReader] = []
    try:
        for path in paths:
            fs, inner = resolve(path)
            reader = open_checkpoint(fs, inner)
            try:
                readers.append(SelectedReader(reader, keys or KeySelection()))
            except BaseException:
                reader.close()
                raise
    except BaseException:
        for reader in readers:
            reader.close()
        raise
    return readers


def _check_options(shard_size: int, chunk_bytes: int) -> None:
    if shard_size <= 0:
        raise CkptavgError(f"shard size must be positive, got {shard_size}")
    if chunk_bytes < 64:
        raise CkptavgError(f"chunk size must be at least 64 bytes, got {chunk_bytes}")


def average(
    sources: Sequence[str],
    out: str,
    *,
    steps: Sequence[int | None] | None = None,
    weights: Sequence[float] | None = None,
    dtype: torch.dtype | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    allow_nonfinite: bool = False,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    workers: int = 2,
    output_format: str = "safetensors",
    keys: KeySelection | None = None,
) -> MergeResult:
    """Average the checkpoint folders ``sources`` (oldest first) into a new folder ``out``.

    Sources may be local paths or fsspec URLs, in any format ckptavg reads (safetensors, DCP,
    ``.pt``); ``keys`` chooses the tensors (model weights by default). The output is
    ``output_format`` (Hugging Face sharded safetensors with an index by default; ``dcp``;
    ``pt``), the non-weight files of the newest source, and ``ckptavg-manifest.json``; it
    counts as complete only once the manifest is there.
    """
    if not sources:
        raise CkptavgError("nothing to average: no sources")
    if steps is not None and len(steps) != len(sources):
        raise CkptavgError(f"{len(steps)} steps given for {len(sources)} sources")
    _check_options(shard_size, chunk_bytes)
    out_path = resolve(out)[1]
    for source in sources:
        if resolve(source)[1] == out_path:
            raise CkptavgError(f"output {redact(out)} is one of the sources")
    readers = _open_all(sources, keys)
    try:
        return average_readers(
            readers,
            out,
            steps=steps,
            weights=weights,
            dtype=dtype,
            shard_size=shard_size,
            allow_nonfinite=allow_nonfinite,
            force=force,
            progress=progress,
            chunk_bytes=chunk_bytes,
            workers=workers,
            output_format=output_format,
            keys=keys or KeySelection(),
        )
    finally:
        for reader in readers:
            reader.close()


def average_readers(
    readers: Sequence[CheckpointReader],
    out: str,
    *,
    steps: Sequence[int | None] | None = None,
    weights: Sequence[float] | None = None,
    dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    allow_nonfinite: bool = False,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    workers: int = 2,
    source_records: list[dict[str, Any]] | None = None,
    accumulate_policy: str | None = None,
    counts: Sequence[int] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    output_format: str = "safetensors",
    keys: KeySelection | None = None,
) -> MergeResult:
    """:func:`average` over already-open readers (any :class:`CheckpointReader`), so that the
    training hook publishes through the same writer, layout and manifest.

    For the hook: ``dtype`` may map tensor names to output dtypes; ``counts`` are the steps each
    source already sums; ``extra_files`` (name to bytes, e.g. a ``config.json``) are written
    into the output besides the newest source's own; ``source_records`` replaces the manifest's
    per-reader source list; ``keys`` is recorded in the manifest (the readers already apply it)."""
    _check_options(shard_size, chunk_bytes)
    out_fs, out_path = resolve(out)
    started = time.perf_counter()
    options = EngineOptions(dtype=dtype, allow_nonfinite=allow_nonfinite, chunk_bytes=chunk_bytes, workers=workers)
    bytes_read = 0

    def count(nbytes: int) -> None:
        nonlocal bytes_read
        bytes_read += nbytes
        if progress is not None:
            progress(nbytes)

    engine = StreamingAverage(readers, weights, options, count, counts)
    specs = output_specs(list(engine.tensors.values()), dtype)
    if source_records is None:
        source_records = [
            {
                "path": reader.display_path,
                "step": None if steps is None else steps[i],
                "weight": engine.weights[i],
                "format": reader.format_name,
            }
            for i, reader in enumerate(readers)
        ]
    newest = readers[-1]
    with AtomicFolder(out_fs, out_path, force=force) as folder:
        writer = make_output_format(output_format, out_fs, folder.tmp, display(out_fs, out_path), newest.format_name)
        shards = writer.plan(specs, shard_size)
        hashes = {writer.relative(name): digest for name, digest in engine.run(shards, writer.open_sink).items()}
        for name in newest.extra_files():
            source = join(newest.fs, newest.path, name)
            hashes[name] = copy_file(newest.fs, source, out_fs, join(out_fs, folder.tmp, name))
        for name, data in (extra_files or {}).items():
            hashes[name] = write_bytes(out_fs, join(out_fs, folder.tmp, name), data)
        total_size = sum(s.nbytes for s in specs)
        hashes.update(writer.finish(shards))
        input_dtypes = sorted({_dtype_name(t.dtype) for t in engine.tensors.values()})
        manifest = {
            "tool": "ckptavg",
            "version": __version__,
            "method": "uniform" if weights is None else "weighted",
            "format": output_format,
            "sources": source_records,
            "tensor_count": len(specs),
            "total_size": total_size,
            "dtype_policy": {
                "input_dtypes": input_dtypes,
                "output": _output_policy(dtype),
                "accumulate": accumulate_policy
                or "float32 for 8/16-bit floats, float64 for 32/64-bit floats; "
                "integer and bool tensors copied from the newest source",
                "rounding": "round to nearest even of the mean",
            },
            "files": {name: {"sha256": digest} for name, digest in sorted(hashes.items())},
        }
        if keys is not None:
            left_out = getattr(newest, "left_out", [])
            manifest["keys"] = {**keys.describe(), "left_out": len(left_out), "left_out_examples": left_out[:5]}
        write_json(out_fs, join(out_fs, folder.tmp, MANIFEST_FILE), manifest)
        folder.commit()
    return MergeResult(
        output=display(out_fs, out_path),
        sources=source_records,
        tensor_count=len(specs),
        bytes_read=bytes_read,
        bytes_written=sum(s.nbytes for s in shards),
        seconds=time.perf_counter() - started,
        files=dict(sorted(hashes.items())),
    )


@dataclass(frozen=True)
class MergeSelection:
    """The checkpoints one merge averages and where it writes (what ``--dry-run`` shows)."""

    run_dir: str
    checkpoints: list[Checkpoint]
    output: str
    merge_step: int


def select(
    run_dir: str,
    *,
    merge_step: int | None = None,
    window: int | None = None,
    last: int | None = None,
    steps: Sequence[int] | None = None,
    out: str | None = None,
) -> MergeSelection:
    """Discover the checkpoints of ``run_dir`` and choose those of one merge."""
    fs, path = resolve(run_dir)
    found = mergeable(find_checkpoints(fs, path))
    chosen = select_checkpoints(found, merge_step=merge_step, window=window, last=last, steps=steps)
    step = merge_step if merge_step is not None else chosen[-1].step
    output = out if out is not None else display(fs, join(fs, path, f"step{step}-merged"))
    return MergeSelection(display(fs, path), chosen, output, step)


def read_bytes(selection: MergeSelection, keys: KeySelection | None = None) -> tuple[int, int]:
    """(bytes a merge of ``selection`` reads, tensors per source), from headers alone."""
    readers = _open_all([c.url for c in selection.checkpoints], keys)
    try:
        tensors = StreamingAverage(readers, None, EngineOptions()).tensors
        return sum(t.nbytes for t in tensors.values()) * len(readers), len(tensors)
    finally:
        for reader in readers:
            reader.close()


def merge(
    run_dir: str,
    *,
    merge_step: int | None = None,
    window: int | None = None,
    last: int | None = None,
    steps: Sequence[int] | None = None,
    out: str | None = None,
    **options: Any,
) -> MergeResult:
    """Select checkpoints of ``run_dir`` (as :func:`select`) and :func:`average` them.

    The default output is ``RUN_DIR/step{S}-merged`` (OLMo-core's name), where S is the merge
    step, or the newest selected step with ``last``/``steps``.
    """
    selection = select(run_dir, merge_step=merge_step, window=window, last=last, steps=steps, out=out)
    return average(
        [c.url for c in selection.checkpoints],
        selection.output,
        steps=[c.step for c in selection.checkpoints],
        **options,
    )
