"""The library behind ``ckptavg merge``: choose sources, stream the average, publish the output."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import __version__
from .discovery import Checkpoint, find_checkpoints, mergeable, select_checkpoints, window_gaps
from .distributed import Collective, assign_shards
from .engine import DEFAULT_CHUNK_BYTES, EngineOptions, StreamingAverage, check_chunk_bytes, output_specs
from .errors import CkptavgError
from .formats import CheckpointReader, open_checkpoint
from .formats.outputs import make_output_format
from .journal import Journal, fingerprint, finished_files, remove_journals
from .output import (
    MANIFEST_FILE,
    OWNER_FILE,
    AtomicFolder,
    check_output_location,
    copy_file,
    discard_file,
    sha256_file,
    sync_file,
    write_bytes,
    write_json,
)
from .selection import KeySelection, SelectedReader
from .shards import DEFAULT_SHARD_SIZE
from .storage import display, join, resolve
from .weighting import Weighting


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
    reused_files: int = 0  # output files an interrupted run had finished (``resume``)

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
            "reused_files": self.reused_files,
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


def check_options(shard_size: int, chunk_bytes: int) -> None:
    """Refuse a shard size or chunk size a merge cannot use, before anything is read."""
    if shard_size <= 0:
        raise CkptavgError(f"shard size must be positive, got {shard_size}")
    check_chunk_bytes(chunk_bytes)


def average(
    sources: Sequence[str],
    out: str,
    *,
    steps: Sequence[int | None] | None = None,
    weights: Sequence[float] | None = None,
    weighting: Weighting | None = None,
    dtype: torch.dtype | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    allow_nonfinite: bool = False,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    workers: int = 2,
    output_format: str = "safetensors",
    keys: KeySelection | None = None,
    collective: Collective | None = None,
    notice: Callable[[str], None] | None = None,
    resume: bool = False,
    fsync: bool = True,
) -> MergeResult:
    """Average the checkpoint folders ``sources`` (oldest first) into a new folder ``out``.

    Sources may be local paths or fsspec URLs, in any format ckptavg reads (safetensors, DCP,
    ``.pt``); ``keys`` chooses the tensors (model weights by default). The output is
    ``output_format`` (Hugging Face sharded safetensors with an index by default; ``dcp``;
    ``pt``), the non-weight files of the newest source, and ``ckptavg-manifest.json``; it
    counts as complete only once the manifest is there.

    Uniform by default; ``weighting`` (a scheme over ``steps``, see :mod:`ckptavg.weighting`)
    or ``weights`` (one number per source) make it a weighted mean, normalised.

    ``out`` must not be, contain or lie inside a source, nor be or contain the working folder:
    that is refused before anything is written, ``force`` or not. ``fsync`` (default) makes every
    file of a local output durable before it is published (see :mod:`ckptavg.output`).
    """
    if not sources:
        raise CkptavgError("nothing to average: no sources")
    if steps is not None and len(steps) != len(sources):
        raise CkptavgError(f"{len(steps)} steps given for {len(sources)} sources")
    check_options(shard_size, chunk_bytes)
    readers = _open_all(sources, keys)
    try:
        return average_readers(
            readers,
            out,
            steps=steps,
            weights=weights,
            weighting=weighting,
            dtype=dtype,
            shard_size=shard_size,
            allow_nonfinite=allow_nonfinite,
            force=force,
            progress=progress,
            chunk_bytes=chunk_bytes,
            workers=workers,
            output_format=output_format,
            keys=keys or KeySelection(),
            collective=collective,
            notice=notice,
            resume=resume,
            fsync=fsync,
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
    weighting: Weighting | None = None,
    dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    allow_nonfinite: bool = False,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    workers: int = 2,
    source_records: list[dict[str, Any]] | None = None,
    accumulate_policy: str | None = None,
    totals: Sequence[float] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    output_format: str = "safetensors",
    keys: KeySelection | None = None,
    collective: Collective | None = None,
    notice: Callable[[str], None] | None = None,
    resume: bool = False,
    fsync: bool = True,
) -> MergeResult:
    """:func:`average` over already-open readers (any :class:`CheckpointReader`), so that the
    training hook publishes through the same writer, layout and manifest.

    For the hook: ``dtype`` may map tensor names to output dtypes; ``totals`` are the weights
    each source already sums (``weighting`` then only describes them in the manifest);
    ``extra_files`` (name to bytes, e.g. a ``config.json``) are written into the output besides
    the newest source's own; ``source_records`` replaces the manifest's
    per-reader source list; ``keys`` is recorded in the manifest (the readers already apply it).

    With a ``collective`` of several processes (``torchrun``, ``srun``), each process writes
    whole output files of the same plan, balanced by bytes, and process 0 writes the index and
    manifest once all have finished: the output is byte-identical whatever the number of
    processes. ``progress`` is called with the bytes read; if it has ``start(total)``, that is
    called first with the bytes this process will read; ``notice`` receives advice for the log.

    Every finished output file is journaled; with ``resume``, an interrupted run of the same
    merge (killed at any point) is picked up: its finished files are reused if their sha256
    still matches, the rest is redone, and the output is byte-identical to an uninterrupted run."""
    check_options(shard_size, chunk_bytes)
    weights = None if totals is not None else _given_weights(weighting, weights, steps, len(readers))
    collective = collective or Collective()
    out_fs, out_path = resolve(out)
    started = time.perf_counter()
    options = EngineOptions(dtype=dtype, allow_nonfinite=allow_nonfinite, chunk_bytes=chunk_bytes, workers=workers)
    bytes_read = 0

    def count(nbytes: int) -> None:
        nonlocal bytes_read
        bytes_read += nbytes
        if progress is not None:
            progress(nbytes)

    engine = StreamingAverage(readers, weights, options, count, totals)
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
    with contextlib.ExitStack() as stack:
        folder, resumed = _output_folder(
            stack, collective, out_fs, out_path, readers, force=force, resume=resume, fsync=fsync, notice=notice
        )
        tmp = folder.tmp
        writer = make_output_format(output_format, out_fs, tmp, display(out_fs, out_path), newest.format_name, fsync)
        shards = writer.plan(specs, shard_size)
        merge_id = fingerprint(
            {
                "version": __version__,
                "format": output_format,
                "sources": source_records,
                "files": [[s.file_name, [[t.name, str(t.dtype), list(t.shape)] for t in s.tensors]] for s in shards],
                "weights": None if weights is None else list(weights),
                "totals": None if totals is None else list(totals),
                "allow_nonfinite": allow_nonfinite,
            }
        )
        mine = assign_shards(shards, collective.world_size)[collective.rank]
        reused = _reusable(out_fs, writer, tmp, mine, merge_id, fsync) if resumed else {}
        mine = [shard for shard in mine if shard.file_name not in reused]
        journal = Journal(out_fs, tmp, collective.rank, merge_id, reused, fsync)
        if len(shards) < collective.world_size and collective.rank == 0 and notice is not None:
            notice(
                f"the output has {len(shards)} file(s) for {collective.world_size} processes, so some have nothing "
                "to do: a smaller --shard-size spreads the work"
            )
        if progress is not None and hasattr(progress, "start"):
            progress.start(engine.read_bytes(mine))
        parts = collective.all_gather(_write_part(engine, mine, writer, collective, journal, lambda: bytes_read))
        failed = [(rank, part[1]) for rank, part in enumerate(parts) if part[0] == "error"]
        if failed:
            rank, message = failed[0]
            raise CkptavgError(f"rank {rank} of {collective.world_size} failed: {message}")
        done = {name: entry for part in parts for name, entry in part[1].items()}
        hashes = {writer.relative(name): entry["sha256"] for name, entry in done.items()}
        records = {name: entry["record"] for name, entry in done.items()}
        bytes_read = sum(part[2] for part in parts)
        reused_files = sum(part[3] for part in parts)
        status = None
        if collective.rank == 0:
            try:
                remove_journals(out_fs, tmp)
                for name in newest.extra_files():
                    source = join(newest.fs, newest.path, name)
                    hashes[name] = copy_file(newest.fs, source, out_fs, join(out_fs, tmp, name), fsync)
                for name, data in (extra_files or {}).items():
                    hashes[name] = write_bytes(out_fs, join(out_fs, tmp, name), data, fsync)
                hashes.update(writer.finish(shards, records))
                _prune(out_fs, tmp, set(hashes) | {OWNER_FILE})
                manifest = _manifest(
                    engine,
                    specs,
                    weighting,
                    weights,
                    dtype,
                    output_format,
                    source_records,
                    accumulate_policy,
                    keys,
                    hashes,
                )
                write_json(out_fs, join(out_fs, tmp, MANIFEST_FILE), manifest, fsync)
                folder.commit()
            except BaseException as exc:
                if collective.world_size > 1:  # the others wait for the outcome: tell them
                    collective.broadcast(str(exc) or type(exc).__name__)
                raise
        status = collective.broadcast(status)
        if status is not None:
            raise CkptavgError(f"rank 0 of {collective.world_size} failed while publishing: {status}")
    return MergeResult(
        output=display(out_fs, out_path),
        sources=source_records,
        tensor_count=len(specs),
        bytes_read=bytes_read,
        bytes_written=sum(s.nbytes for s in shards),
        seconds=time.perf_counter() - started,
        files=dict(sorted(hashes.items())),
        reused_files=reused_files,
    )


def _given_weights(
    weighting: Weighting | None, weights: Sequence[float] | None, steps: Sequence[int | None] | None, sources: int
) -> list[float] | None:
    """The engine's weights (unnormalised; ``None`` for the exact uniform mean)."""
    if weighting is None or weighting.uniform:
        return None if weights is None else list(weights)
    if weights is not None:
        raise CkptavgError("give weights or a weighting scheme, not both")
    if weighting.scheme == "explicit":
        return weighting.explicit_for(sources)
    if steps is None or any(step is None for step in steps):
        raise CkptavgError(f"the {weighting.scheme} weighting needs the training step of every source")
    return weighting.raw([int(step) for step in steps if step is not None])


def _output_folder(
    stack: contextlib.ExitStack,
    collective: Collective,
    fs: Any,
    path: str,
    readers: Sequence[CheckpointReader],
    **options: Any,
) -> tuple[AtomicFolder | _SharedFolder, bool]:
    """Process 0 checks where the output goes (never over a source), creates the (temporary)
    output folder, or finds the one an interrupted run of this merge left with ``resume``, and
    tells the others where it is. ``options``: :class:`AtomicFolder`'s."""
    shared: tuple[str | None, bool, str | None] = (None, False, None)
    folder: AtomicFolder | None = None
    if collective.rank == 0:
        try:
            check_output_location(fs, path, [(reader.fs, reader.path) for reader in readers])
            folder = stack.enter_context(AtomicFolder(fs, path, **options))
            shared = (folder.tmp, folder.resumed, None)
        except CkptavgError as exc:
            if collective.world_size == 1:
                raise
            shared = (None, False, str(exc))
    tmp, resumed, error = collective.broadcast(shared)
    if error is not None:
        raise CkptavgError(error)
    return (folder if folder is not None else _SharedFolder(tmp)), resumed


def _prune(fs: Any, folder: str, keep: set[str]) -> None:
    """Remove every file of ``folder`` the manifest will not list: what an interrupted run of a
    resumed merge left half-written, or wrote for another plan, must never be published."""
    prefix = folder.rstrip("/") + "/"
    for path in fs.find(folder):
        if str(path)[len(prefix) :] not in keep:
            discard_file(fs, path)


def _reusable(fs: Any, writer: Any, tmp: str, shards: Sequence[Any], merge_id: str, fsync: bool) -> dict[str, Any]:
    """The files of ``shards`` an interrupted run of the same merge finished and that still
    hash to what its journal recorded; with ``fsync`` made durable, whatever the interrupted run
    was told (it may have run with ``--no-fsync``)."""
    done = finished_files(fs, tmp, merge_id)
    reusable = {}
    for shard in shards:
        entry = done.get(shard.file_name)
        if entry is None:
            continue
        try:
            digest, _ = sha256_file(fs, writer.file_path(shard.file_name))
        except CkptavgError:  # gone or unreadable: written again
            continue
        if digest == entry.get("sha256"):
            sync_file(fs, writer.file_path(shard.file_name), fsync)
            reusable[shard.file_name] = entry
    return reusable


@dataclass(frozen=True)
class _SharedFolder:
    """Process 0's output folder as the other processes see it: they write into it, never publish."""

    tmp: str


def _write_part(
    engine: StreamingAverage,
    shards: Sequence[Any],
    writer: Any,
    collective: Collective,
    journal: Journal,
    bytes_read: Callable[[], int],
) -> tuple:
    """This process's output files: ("ok", {file: {"sha256", "record"}} including reused ones,
    bytes read, files reused) or ("error", message).

    Alone, a failure is raised as it is; with others, it is reported to them first, so that every
    process stops with the failing rank's reason and nothing gets published."""
    reused = len(journal.content["files"])
    try:
        engine.run(shards, writer.open_sink, lambda name, digest: journal.record(name, digest, writer.record(name)))
        return ("ok", dict(journal.content["files"]), bytes_read(), reused)
    except Exception as exc:
        if collective.world_size == 1:
            raise
        return ("error", str(exc) if isinstance(exc, CkptavgError) else f"{type(exc).__name__}: {exc}")


def _manifest(
    engine: StreamingAverage,
    specs: Sequence[Any],
    weighting: Weighting | None,
    weights: Sequence[float] | None,
    dtype: Any,
    output_format: str,
    source_records: list[dict[str, Any]],
    accumulate_policy: str | None,
    keys: KeySelection | None,
    hashes: Mapping[str, str],
) -> dict[str, Any]:
    """The manifest: what was merged and how, and the sha256 of every file (nothing that
    differs between runs of the same merge, such as times or process counts)."""
    scheme = weighting if weighting is not None and not weighting.uniform else None
    manifest: dict[str, Any] = {
        "tool": "ckptavg",
        "version": __version__,
        "method": scheme.scheme if scheme else ("uniform" if weights is None else "weighted"),
        "format": output_format,
        "sources": source_records,
        "tensor_count": len(specs),
        "total_size": sum(s.nbytes for s in specs),
        "dtype_policy": {
            "input_dtypes": sorted({_dtype_name(t.dtype) for t in engine.tensors.values()}),
            "output": _output_policy(dtype),
            "accumulate": accumulate_policy
            or "float32 for 8/16-bit floats, float64 for 32/64-bit floats; "
            "integer and bool tensors copied from the newest source",
            "rounding": "round to nearest even of the mean",
        },
        "files": {name: {"sha256": digest} for name, digest in sorted(hashes.items())},
    }
    if weights is not None or scheme is not None:
        manifest["weighting"] = scheme.describe() if scheme else {"scheme": "weighted"}
    if weights is not None:
        # The numbers before normalising: `verify --against` feeds them back to reproduce the
        # normalisation's rounding exactly (normalising the normalised weights need not).
        manifest["weighting"]["unnormalised"] = list(weights)
    if keys is not None:
        left_out = getattr(engine.readers[-1], "left_out", [])
        manifest["keys"] = {**keys.describe(), "left_out": len(left_out), "left_out_examples": left_out[:5]}
    return manifest


@dataclass(frozen=True)
class MergeSelection:
    """The checkpoints one merge averages and where it writes (what ``--dry-run`` shows)."""

    run_dir: str
    checkpoints: list[Checkpoint]
    output: str
    merge_step: int
    missing: str = ""  # the window's missing steps, described, when allowed to be partial


def select(
    run_dir: str,
    *,
    merge_step: int | None = None,
    window: int | None = None,
    last: int | None = None,
    steps: Sequence[int] | None = None,
    out: str | None = None,
    every: int | None = None,
    allow_partial_window: bool = False,
) -> MergeSelection:
    """Discover the checkpoints of ``run_dir`` and choose those of one merge (a window with
    missing steps only with ``allow_partial_window``; ``every`` is the save stride in it). An
    output that would replace the run folder or a chosen checkpoint is refused here already."""
    fs, path = resolve(run_dir)
    found = mergeable(find_checkpoints(fs, path))
    try:
        chosen = select_checkpoints(
            found,
            merge_step=merge_step,
            window=window,
            last=last,
            steps=steps,
            every=every,
            allow_partial_window=allow_partial_window,
        )
    except CkptavgError as exc:  # name the run folder: "no checkpoint in the window" of which run?
        raise CkptavgError(f"{display(fs, path)}: {exc}") from None
    missing = ""
    if merge_step is not None and window is not None:
        gaps = window_gaps([c.step for c in chosen], merge_step, window, every)
        missing = gaps.describe() if gaps else ""
    step = merge_step if merge_step is not None else chosen[-1].step
    output = out if out is not None else display(fs, join(fs, path, f"step{step}-merged"))
    check_output_location(*resolve(output), [(fs, c.path) for c in chosen], run_folder=(fs, path))
    return MergeSelection(display(fs, path), chosen, output, step, missing)


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
    every: int | None = None,
    allow_partial_window: bool = False,
    **options: Any,
) -> MergeResult:
    """Select checkpoints of ``run_dir`` (as :func:`select`) and :func:`average` them.

    The default output is ``RUN_DIR/step{S}-merged`` (OLMo-core's name), where S is the merge
    step, or the newest selected step with ``last``/``steps``.
    """
    selection = select(
        run_dir,
        merge_step=merge_step,
        window=window,
        last=last,
        steps=steps,
        out=out,
        every=every,
        allow_partial_window=allow_partial_window,
    )
    return average(
        [c.url for c in selection.checkpoints],
        selection.output,
        steps=[c.step for c in selection.checkpoints],
        **options,
    )
