"""One merge over open readers, in three steps that each process takes alike:

1. :func:`prepare`: the sources checked against each other, the weights, the output tensors;
   :meth:`MergeJob.layout` gives the output files and the fingerprint of the merge (process 0
   keeps an output that a run of this same merge already published, :func:`published_files`,
   and reads nothing), and :func:`ckptavg.merging.distributed.split_output` this process's
   share of them (whole files, and byte ranges of files it shares with others);
2. :func:`write_part`: this process's share, each file or range journaled once finished (then
   the files several processes wrote are hashed, read back);
3. :func:`publish` (process 0, once every process reported its :class:`PartResult`): the
   carried source's other files (``--copy-from``, the newest by default), the index, the
   manifest, then the commit.

:func:`average_readers` runs them; the training hook calls it over its running sums, so that
it publishes through the same writer, layout and manifest as ``ckptavg merge``.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CkptavgError, ConfigError
from ..formats import CheckpointReader, StoredObject
from ..formats.base import BlockRecord, MergedOutput
from ..formats.layout import ShardPart, ShardSpec, TensorSpec
from ..formats.writers import OutputFormat, make_output_format
from ..io.atomic import copy_file, discard_file, sync_file, write_bytes
from ..io.files import sha256_file
from ..io.fs import FileSystem, display, join, resolve
from ..manifest import MANIFEST_FILE
from ..manifest import build as build_manifest
from ..manifest import read as read_manifest
from ..version import __version__
from ..weighting import Weighting
from .distributed import Collective, split_output
from .engine import StreamingAverage, output_specs, unused_copy_rules
from .journal import Journal, fingerprint, finished_files, remove_journals
from .keys import FilteredReader, note_unused_keys
from .options import MergeOptions, PublishExtras
from .progress import ByteCount
from .publish import OWNER_FILE, AtomicFolder, check_output_location

Progress = Callable[[int], None]


@dataclass(frozen=True)
class MergeResult:
    """What a merge did, for the summary line and ``--json``."""

    output: str
    """The output folder, as shown to the user (no credentials)."""
    sources: list[dict[str, Any]]
    """One record per source: path, step, normalised weight, format."""
    tensor_count: int
    bytes_read: int
    bytes_written: int
    seconds: float
    files: dict[str, str] = field(default_factory=dict)
    """{file name: sha256} of every file of the output (on process 0; the others know their own)."""
    reused_files: int = 0
    """Whole output files an interrupted run had finished (``resume``)."""
    reused_ranges: int = 0
    """Byte ranges of files shared by processes that an interrupted run had finished."""
    already_merged: bool = False
    """The output was already published by a run of this same merge: kept as it was, nothing
    read for it (or, with ``keep_identical``, computed again to the same bytes and not replaced)."""
    removed_snapshots: list[str] = field(default_factory=list)
    """Inputs removed after the merge (``remove_consumed_snapshots``): snapshots only."""
    kept_inputs: list[str] = field(default_factory=list)
    """With ``remove_consumed_snapshots``: the inputs kept (trainer checkpoints, and snapshots that
    could not be removed)."""
    processes: list[dict[str, int]] = field(default_factory=list)
    """Per process, by rank: ``bytes_read`` and ``bytes_written`` (tensor data), the share of the
    work each one did."""

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
            "reused_ranges": self.reused_ranges,
            "already_merged": self.already_merged,
            "removed_snapshots": self.removed_snapshots,
            "kept_inputs": self.kept_inputs,
            "processes": self.processes,
        }


@dataclass(frozen=True)
class PartResult:
    """What one process reports to the others once its share of the output files is written."""

    files: dict[str, dict[str, Any]]
    """{file name: {"sha256", "record"}} of its files, those reused from an interrupted run included."""
    bytes_read: int
    reused: int
    """How many of its whole files an interrupted run had finished."""
    error: str | None = None
    """Why it failed (``files`` is then empty): every process stops with this reason."""
    bytes_written: int = 0
    """Tensor data it wrote (its share: whole files and byte ranges)."""
    reused_ranges: int = 0
    """How many of its byte ranges of shared files an interrupted run had finished."""


def engine_weights(weighting: Weighting | None, steps: Sequence[int | None] | None, sources: int) -> list[float] | None:
    """The engine's weights of the sources (unnormalised; ``None`` for the exact uniform mean)."""
    if weighting is None or weighting.uniform:
        return None
    if weighting.scheme == "explicit":
        return weighting.explicit_for(sources)
    if not weighting.needs_steps:  # by each source's place: the 1st, 2nd, ... of the window
        return weighting.raw(range(sources))
    if steps is None or any(step is None for step in steps):
        raise ConfigError(
            f"the {weighting.scheme} weighting needs the training step of every source (steps=...): "
            "it decays per training step"
        )
    return weighting.raw([int(step) for step in steps if step is not None])


def copy_index(copy_from: str | int, steps: Sequence[int | None] | None, sources: int) -> int:
    """The source (its index, oldest first) that ``--copy-from`` names among ``sources`` at ``steps``."""
    if isinstance(copy_from, str):  # checked by MergeOptions: newest or oldest
        return 0 if copy_from == "oldest" else sources - 1
    if steps is None or copy_from not in steps:
        known = "" if steps is None else ", ".join(str(s) for s in steps)
        raise ConfigError(
            f"--copy-from {copy_from}: no source of this merge is step {copy_from}"
            + (f" (its steps: {known})" if known else " (give the sources' steps=...)")
        )
    return list(steps).index(copy_from)


def _block_records(readers: Sequence[CheckpointReader]) -> list[BlockRecord]:
    """The sources' block records where they are blocks of the training hook, [] where none is.
    A merge weighs each source as one: blocks are averaged only with blocks of as many steps,
    never with one step's weights."""
    records = [reader.block_record() for reader in readers]
    found = [(reader, record) for reader, record in zip(readers, records, strict=True) if record is not None]
    if not found:
        return []
    (first, record), *_ = found
    for reader, other in zip(readers, records, strict=True):
        if other is None:
            raise ConfigError(
                f"{first.display_path} is a block (the mean of {record.count} steps) and {reader.display_path} one "
                "step's weights: a merge averages blocks or single steps, never both"
            )
        if other.count != record.count:
            raise ConfigError(
                f"{first.display_path} is the mean of {record.count} steps, {reader.display_path} of {other.count}: "
                "a merge weighs each block as one source, so blocks must each average as many steps"
            )
    return [record for record in records if record is not None]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class MergeJob:
    """One merge, prepared: what every process computes alike from its sources and options."""

    engine: StreamingAverage
    specs: list[TensorSpec]
    weights: list[float] | None
    """The sources' unnormalised weights; None for the exact uniform mean."""
    weighting: Weighting | None
    dtype: torch.dtype | Mapping[str, torch.dtype] | None
    """Output dtype of floating tensors: one for all, one per tensor (the hook's), or the input's."""
    sources: list[dict[str, Any]]
    """The manifest's source records."""
    options: MergeOptions
    extras: PublishExtras
    _layout: tuple[list[ShardSpec], str] | None = field(default=None, init=False, repr=False)

    @property
    def newest(self) -> CheckpointReader:
        return self.engine.readers[-1]

    @property
    def carried(self) -> CheckpointReader:
        """The source whose other files (config, tokenizer, a trainer's state) and pickled
        objects the output takes over, as the copy rules' tensors: ``--copy-from``, the newest by
        default."""
        return self.engine.readers[self.engine.copy_from]

    def writer(self, fs: FileSystem, folder: str, shown: str) -> OutputFormat:
        return make_output_format(self.options.output_format, fs, folder, shown, self.carried, self.options.fsync)

    def layout(self, writer: OutputFormat) -> tuple[list[ShardSpec], str]:
        """The output files (the same for any folder ``writer`` writes), and the fingerprint of
        the merge: worked out once, since finding a published output, writing and the manifest
        all ask (for 25k tensors, each fingerprint took 0.04 s)."""
        if self._layout is None:
            shards = writer.layout(self.specs, self.options.shard_size)
            self._layout = shards, self.fingerprint(shards)
        return self._layout

    def fingerprint(self, shards: Sequence[ShardSpec]) -> str:
        """What this merge is, as one digest: all its manifest records but the files' sha256
        (tool version, sources with their steps and weights, weighting, dtype policy, key filter,
        format), its output files and their tensors' names, dtypes and shapes (so the shard size),
        each input tensor's dtype, and what the bytes depend on beyond the manifest (the running
        sums' totals, ``allow_nonfinite``, the hook's extra files, the source whose other files
        and objects the output carries). The one test of "the same
        merge": ``resume`` reuses only files a journal of this fingerprint vouches for, the
        manifest records it, and a rerun finding it in a published output has nothing to do."""
        return fingerprint(
            {
                "manifest": self._record({}),
                "files": [[s.file_name, [[t.name, str(t.dtype), list(t.shape)] for t in s.tensors]] for s in shards],
                "inputs": [[t.name, str(t.dtype)] for t in self.engine.tensors.values()],
                "weights": None if self.weights is None else list(self.weights),
                "carried_from": self.engine.copy_from,
                "totals": None if self.extras.totals is None else list(self.extras.totals),
                "allow_nonfinite": self.options.allow_nonfinite,
                "extra_files": {
                    name: hashlib.sha256(data).hexdigest() for name, data in self.extras.extra_files.items()
                },
            }
        )

    def manifest(
        self, shards: Sequence[ShardSpec], hashes: Mapping[str, str], carried: Sequence[StoredObject] = ()
    ) -> dict[str, Any]:
        """The output's manifest: what :func:`ckptavg.manifest.build` records, and the
        :meth:`fingerprint` a rerun compares."""
        layout = self._layout
        merge_id = layout[1] if layout is not None and list(shards) == layout[0] else self.fingerprint(shards)
        return {**self._record(hashes, carried), "fingerprint": merge_id}

    def _output_dtype(self) -> str:
        if self.dtype is None:
            return "same as input"
        if isinstance(self.dtype, Mapping):
            return "same as the trained parameters"
        return _dtype_name(self.dtype)

    def merged_output(self) -> MergedOutput:
        """What the output holds and how it was made, for a trainer file rewritten to say so (a
        Megatron ``common.pt``): fields named as Megatron-LM's ``weighted_merge.py`` names them."""
        copy_from = self.engine.copy_from
        provenance = {
            "format_version": 1,
            "tool": "ckptavg",
            "tool_version": __version__,
            "input_paths": [source["path"] for source in self.sources],
            "source_iterations": [source["step"] for source in self.sources],
            "weights": [source["weight"] for source in self.sources],
            "normalize": True,
            "merge_style": "uniform" if self.weighting is None else self.weighting.tag(),
            "output_dtype": self._output_dtype(),
            "extra_state_source_index": copy_from,
            "extra_state_source_path": self.engine.readers[copy_from].display_path,
        }
        return MergedOutput(frozenset(spec.name for spec in self.specs), provenance)

    def _record(self, hashes: Mapping[str, str], carried: Sequence[StoredObject] = ()) -> dict[str, Any]:
        newest = self.newest
        keys = None
        if isinstance(newest, FilteredReader):
            keys = {
                **newest.keys.describe(),
                "left_out": len(newest.left_out),
                "left_out_examples": newest.left_out[:5],
            }
        copy = None
        if self.options.copy:
            engine = self.engine
            copy = {
                "patterns": list(self.options.copy),
                "from": self.options.copy_from,
                "source": engine.readers[engine.copy_from].display_path,
                "tensors": len(engine.copied),
                "tensor_examples": sorted(engine.copied)[:10],
            }
        return build_manifest(
            output_format=self.options.output_format,
            sources=self.sources,
            tensor_count=len(self.specs),
            total_size=sum(s.nbytes for s in self.specs),
            input_dtypes=[_dtype_name(d) for d in {t.dtype for t in self.engine.tensors.values()}],
            output_dtype=self._output_dtype(),
            accumulate=self.extras.accumulate_policy,
            weighting=self.weighting,
            weights=self.weights,
            keys=keys,
            copied={"source": self.carried.display_path, "items": {o.name: o.why for o in carried}}
            if carried
            else None,
            copy_rules=copy,
            hashes=hashes,
            method=self.extras.method,
        )


def prepare(
    readers: Sequence[CheckpointReader],
    steps: Sequence[int | None] | None,
    weighting: Weighting | None,
    options: MergeOptions,
    extras: PublishExtras,
    count: Progress,
) -> MergeJob:
    """Check the sources against each other and fix the weights and output tensors (before any
    output exists: a source that does not fit the others leaves nothing behind)."""
    totals = extras.totals
    weights = None if totals is not None else engine_weights(weighting, steps, len(readers))
    blocks = _block_records(readers)
    dtype = extras.dtypes if extras.dtypes is not None else options.dtype
    copy_from = copy_index(options.copy_from, steps, len(readers))
    if dtype is None and blocks:  # a block keeps float32 means of bf16 parameters: written as trained
        dtype = blocks[-1].dtypes
    engine = StreamingAverage(readers, weights, options.engine_options(dtype), count, totals, copy_from)
    specs = output_specs(list(engine.tensors.values()), dtype, engine.copied)
    sources = extras.sources
    if sources is None:
        sources = [
            {
                "path": reader.display_path,
                "step": None if steps is None else steps[i],
                "weight": engine.weights[i],
                "format": reader.format_name,
                **({"block": blocks[i].describe()} if blocks else {}),
            }
            for i, reader in enumerate(readers)
        ]
    return MergeJob(engine, specs, weights, weighting, dtype, sources, options, extras)


def write_part(
    job: MergeJob,
    writer: OutputFormat,
    share: Sequence[ShardSpec],
    shards: Sequence[ShardSpec],
    collective: Collective,
    journal: Journal,
    bytes_read: Callable[[], int],
) -> PartResult:
    """Write ``shards``, what is left to write of this process's ``share`` of the output (whole
    files and byte ranges of shared ones: :func:`~.distributed.split_output`; the rest an
    interrupted run finished, in ``journal``), journaling each one as it is finished.

    Alone, a failure is raised as it is; with others, it is reported to them first, so that every
    process stops with the failing rank's reason and nothing gets published."""
    reused = [shard for shard in share if shard.journal_name in journal.content["files"]]
    ranges = sum(isinstance(shard, ShardPart) for shard in reused)
    names = {shard.file_name: shard.journal_name for shard in shards}  # a process has one share of a file

    def write() -> PartResult:
        job.engine.run(
            shards, writer.open_sink, lambda name, digest: journal.record(names[name], digest, writer.record(name))
        )
        written = sum(shard.nbytes for shard in shards)
        files = dict(journal.content["files"])
        return PartResult(files, bytes_read(), len(reused) - ranges, bytes_written=written, reused_ranges=ranges)

    return _reported(collective, write)


def _reported(collective: Collective, action: Callable[[], PartResult]) -> PartResult:
    """``action``'s result; with other processes, a failure as a result that tells them why."""
    try:
        return action()
    except Exception as exc:
        if collective.world_size == 1:
            raise
        return PartResult({}, 0, 0, str(exc) if isinstance(exc, CkptavgError) else f"{type(exc).__name__}: {exc}")


def _gathered(collective: Collective, mine: PartResult) -> list[PartResult]:
    """Every process's result, or the first failing one's reason raised on every process."""
    parts: list[PartResult] = collective.all_gather(mine)
    failed = [(index, part.error) for index, part in enumerate(parts) if part.error is not None]
    if failed:
        failed_rank, message = failed[0]
        raise CkptavgError(f"rank {failed_rank} of {collective.world_size} failed: {message}")
    return parts


def _file_hashes(
    writer: OutputFormat,
    shards: Sequence[ShardSpec],
    share: Sequence[ShardSpec],
    parts: Sequence[PartResult],
    collective: Collective,
) -> dict[str, dict[str, Any]]:
    """{file name: {"sha256", "record"}} of every output file once all are written: as its
    process reported it where one wrote it whole; else (several wrote byte ranges of it, and
    sha256 does not combine) hashed by the process that wrote its first range, continuing that
    range's hash over the rest of the file, read back (from the start where that range was
    reused from an interrupted run). Only a file a cut crosses is read again, and only past its
    first range: at most one per process boundary."""
    done = {name: entry for part in parts for name, entry in part.files.items()}
    whole = {shard.file_name: done[shard.file_name] for shard in shards if shard.file_name in done}
    if len(whole) == len(shards):
        return whole
    firsts = [shard for shard in share if isinstance(shard, ShardPart) and shard.start == 0]

    def read_back() -> PartResult:
        digests = {}
        for first in firsts:
            head = writer.heads.get(first.file_name)
            start = 0 if head is None else first.stop
            digests[first.file_name] = sha256_file(writer.fs, writer.file_path(first.file_name), start, head=head)[0]
        return PartResult({name: {"sha256": digest, "record": None} for name, digest in digests.items()}, 0, 0)

    hashed = _gathered(collective, _reported(collective, read_back))
    return whole | {name: entry for part in hashed for name, entry in part.files.items()}


def published_files(fs: FileSystem, path: str, job: MergeJob) -> dict[str, str] | None:
    """{file name: sha256} of ``path`` if it is an output a run of the merge ``job`` published
    (its manifest records the :meth:`MergeJob.fingerprint`); None otherwise. Reads the manifest
    only: a rerun of a finished merge (a requeued job) keeps it as it is."""
    try:
        manifest = read_manifest(fs, path, display(fs, join(fs, path, MANIFEST_FILE)))
    except CkptavgError:
        return None
    _, merge_id = job.layout(job.writer(fs, path, display(fs, path)))
    if manifest.get("fingerprint") != merge_id:
        return None
    return {name: entry["sha256"] for name, entry in manifest["files"].items()}


def note_unused_copy_rules(
    engine: StreamingAverage, options: MergeOptions, notice: Callable[[str], None] | None
) -> None:
    """Tell ``notice`` of each ``--copy`` pattern that matches no tensor of the merge."""
    if notice is not None:
        for note in unused_copy_rules(engine.tensors, options.copy):
            notice(note)


def already_merged_note(shown: str) -> str:
    """The note of a merge whose output ``shown`` a run of it already published."""
    return f"{shown}: already merged, manifest matches; nothing to do"


def publish(
    job: MergeJob,
    folder: AtomicFolder,
    writer: OutputFormat,
    shards: Sequence[ShardSpec],
    done: Mapping[str, Mapping[str, Any]],
) -> dict[str, str]:
    """Process 0, once every output file is written: the carried source's other files (each as
    it is, or as the source rewrites it for the output) and the objects the format carries over
    from it, the extra files, the index, then the commit, which writes the manifest last.
    Returns {file name: sha256}."""
    fs, tmp, fsync = folder.fs, folder.tmp, job.options.fsync
    hashes = {writer.relative(name): entry["sha256"] for name, entry in done.items()}
    remove_journals(fs, tmp)
    source, output = job.carried, job.merged_output()
    for name in writer.files_to_carry(source):
        target = writer.carried_name(name)
        rewritten = source.companion_for(name, output)
        if rewritten is None:
            hashes[target] = copy_file(source.fs, join(source.fs, source.path, name), fs, join(fs, tmp, target), fsync)
        else:
            hashes[target] = write_bytes(fs, join(fs, tmp, target), rewritten, fsync)
    for name, data in job.extras.extra_files.items():
        hashes[name] = write_bytes(fs, join(fs, tmp, name), data, fsync)
    hashes.update(writer.carry(source, shards))
    hashes.update(writer.finish(shards, {name: entry["record"] for name, entry in done.items()}))
    _prune(fs, tmp, set(hashes) | {OWNER_FILE})
    folder.commit(job.manifest(shards, hashes, writer.carried))
    return hashes


def _prune(fs: FileSystem, folder: str, keep: set[str]) -> None:
    """Remove every file of ``folder`` the manifest will not list: what an interrupted run of a
    resumed merge left half-written, or wrote for another layout, must never be published."""
    prefix = folder.rstrip("/") + "/"
    for path in fs.find(folder):
        if str(path)[len(prefix) :] not in keep:
            discard_file(fs, path)


def _reusable(
    fs: FileSystem, writer: OutputFormat, tmp: str, shards: Sequence[ShardSpec], merge_id: str, fsync: bool
) -> dict[str, Any]:
    """The files (or a process's byte ranges of shared files) of ``shards`` an interrupted run of
    the same merge finished and that still hash to what its journal recorded; with ``fsync``
    made durable, whatever the interrupted run was told (it may have run with ``--no-fsync``).
    A range is reused only where the interrupted run cut the file at the same places (as many
    processes); else it is written again."""
    done = finished_files(fs, tmp, merge_id)
    reusable = {}
    for shard in shards:
        entry = done.get(shard.journal_name)
        if entry is None:
            continue
        path = writer.file_path(shard.file_name)
        try:
            if isinstance(shard, ShardPart):
                digest, size = sha256_file(fs, path, shard.start, shard.stop)
                if size != shard.size:
                    continue
            else:
                digest, _ = sha256_file(fs, path)
        except CkptavgError:  # gone or unreadable: written again
            continue
        if digest == entry.get("sha256"):
            sync_file(fs, path, fsync)
            reusable[shard.journal_name] = entry
    return reusable


@dataclass(frozen=True)
class _Place:
    """Where process 0 put the output, for every process."""

    tmp: str | None
    """The (temporary) folder to write; None when a run of this merge already published it."""
    resumed: bool = False
    published: dict[str, str] = field(default_factory=dict)
    """{file name: sha256} of the output already published."""


def _output_folder(
    stack: contextlib.ExitStack,
    collective: Collective,
    fs: FileSystem,
    path: str,
    job: MergeJob,
    notice: Callable[[str], None] | None,
) -> tuple[AtomicFolder | None, _Place]:
    """Process 0 checks where the output goes (never over a source); keeps an output a run of
    this merge already published (unless ``force``), or creates the (temporary) output folder,
    or finds the one an interrupted run of this merge left with ``resume``; and tells the others
    (the folder on process 0)."""
    folder: AtomicFolder | None = None
    options = job.options

    def create() -> _Place:
        nonlocal folder
        check_output_location(fs, path, [(reader.fs, reader.path) for reader in job.engine.readers])
        published = None if options.force else published_files(fs, path, job)
        if published is not None:
            if notice is not None:
                notice(already_merged_note(display(fs, path)))
            return _Place(None, published=published)
        folder = stack.enter_context(
            AtomicFolder(
                fs,
                path,
                force=options.force,
                resume=options.resume,
                fsync=options.fsync,
                notice=notice,
                keep_identical=options.keep_identical,
            )
        )
        return _Place(folder.tmp, folder.resumed)

    place = collective.decide(create)
    return folder, place


def average_readers(
    readers: Sequence[CheckpointReader],
    out: str,
    *,
    steps: Sequence[int | None] | None = None,
    weighting: Weighting | None = None,
    options: MergeOptions | None = None,
    extras: PublishExtras | None = None,
    progress: Progress | None = None,
    collective: Collective | None = None,
    notice: Callable[[str], None] | None = None,
) -> MergeResult:
    """:func:`ckptavg.average` over already-open readers (any :class:`CheckpointReader`); the
    key filter is the readers' own (:class:`~ckptavg.merging.keys.FilteredReader`), recorded in
    the manifest.

    With a ``collective`` of several processes (``torchrun``, ``srun``), each process writes
    an equal share of the bytes of the same layout (local safetensors outputs: byte ranges of
    shared files; other outputs: whole files, balanced by bytes), and process 0 writes the index
    and manifest once all have finished: the output is byte-identical whatever the number of
    processes. ``progress`` is called with the bytes read; if it has ``start(total)``, that is
    called first with the bytes this process will read; ``notice`` receives advice for the log.

    Every finished output file is journaled; with ``options.resume``, an interrupted run of the
    same merge (killed at any point) is picked up: its finished files are reused if their sha256
    still matches, the rest is redone, and the output is byte-identical to an uninterrupted run.
    An output that a run of the same merge already published is kept as it is unless
    ``options.force`` (nothing read or written; ``already_merged`` in the result, and a note)."""
    options = options or MergeOptions()
    extras = extras or PublishExtras()
    collective = collective or Collective()
    out_fs, out_path = resolve(out)
    started = time.perf_counter()
    count = ByteCount(progress)

    job = prepare(readers, steps, weighting, options, extras, count)
    world, rank = collective.world_size, collective.rank
    note_unused_keys(readers, notice if rank == 0 else None)
    note_unused_copy_rules(job.engine, options, notice if rank == 0 else None)
    shown = display(out_fs, out_path)
    with contextlib.ExitStack() as stack:
        folder, place = _output_folder(stack, collective, out_fs, out_path, job, notice)
        if place.tmp is None:
            return _already_merged(job, shown, place.published, started)
        tmp, resumed = place.tmp, place.resumed
        writer = job.writer(out_fs, tmp, shown)
        shards, merge_id = job.layout(writer)
        share = split_output(shards, world, writer.header_size)[rank]
        reused = _reusable(out_fs, writer, tmp, share, merge_id, options.fsync) if resumed else {}
        mine = [shard for shard in share if shard.journal_name not in reused]
        journal = Journal(out_fs, tmp, rank, merge_id, reused, options.fsync)
        # The header sizes last, asked only where the note may be due: sizing one builds it
        # (0.04 s for 25k tensors).
        if (
            len(shards) < world
            and rank == 0
            and notice is not None
            and any(writer.header_size(shard) is None for shard in shards)
        ):
            notice(
                f"the output has {len(shards)} file(s) for {world} processes, so some have nothing "
                "to do: a smaller --shard-size spreads the work"
            )
        start = getattr(progress, "start", None)
        if start is not None:
            start(job.engine.read_bytes(mine))
        parts = _gathered(collective, write_part(job, writer, share, mine, collective, journal, lambda: count.total))
        done = _file_hashes(writer, shards, share, parts, collective)

        def publish_on_rank0() -> tuple[dict[str, str], bool]:
            assert folder is not None  # process 0 holds the folder
            hashes = publish(job, folder, writer, shards, done)
            if folder.kept and notice is not None:
                notice(f"{shown}: already merged, and merged again to the same bytes: kept as it was")
            return hashes, folder.kept

        hashes, kept = collective.decide(publish_on_rank0, f"rank 0 of {world} failed while publishing: ")
    return MergeResult(
        output=shown,
        sources=job.sources,
        tensor_count=len(job.specs),
        bytes_read=sum(part.bytes_read for part in parts),
        bytes_written=0 if kept else sum(s.nbytes for s in shards),
        seconds=time.perf_counter() - started,
        files=dict(sorted(hashes.items())),
        reused_files=sum(part.reused for part in parts),
        reused_ranges=sum(part.reused_ranges for part in parts),
        already_merged=kept,
        processes=[{"bytes_read": part.bytes_read, "bytes_written": part.bytes_written} for part in parts],
    )


def _already_merged(job: MergeJob, shown: str, published: dict[str, str], started: float) -> MergeResult:
    """The result of a merge whose output a run of it already published: nothing read or written."""
    return MergeResult(
        output=shown,
        sources=job.sources,
        tensor_count=len(job.specs),
        bytes_read=0,
        bytes_written=0,
        seconds=time.perf_counter() - started,
        files=dict(sorted(published.items())),
        already_merged=True,
    )
