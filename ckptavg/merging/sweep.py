"""Several merges from one read: every window and weighting of a sweep averaged in one pass.

Which window and weighting is best is the question a merge answers next, and at scale the cost
of a merge is reading the checkpoints: K separate merges read the widest window up to K times.
A sweep reads every block of every checkpoint once and adds it into one accumulator per
candidate holding it (:meth:`~ckptavg.merging.engine.StreamingAverage.run_many`), so each
candidate's output is byte-identical to the single merge it stands for.

Naming (:func:`candidate_name`): ``step{S}-merged`` for one candidate, as a single merge;
``step{S}-merged-<tag>`` for several weightings of one window (the training hook's names; the tag
is :meth:`Weighting.tag`); ``step{S}-merged-w{W}-<tag>`` once there are several windows.

Each candidate is published as a merge alone is (its own hidden folder, journal, manifest and
commit), once every candidate's files are written: a failure during the pass publishes none.
A candidate that an earlier run already published (its manifest records the same merge, as
:func:`~ckptavg.merging.job.published_files` tells) is kept without reading anything for it;
``resume`` picks up each candidate's interrupted folder; ``force`` replaces every candidate's
output.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CkptavgError, ConfigError, OutputError
from ..formats import CheckpointReader
from ..formats.layout import ShardSpec
from ..formats.writers import OutputFormat, ShardSink
from ..io.fs import display, is_local, join, resolve
from ..manifest import MANIFEST_FILE, has_manifest
from ..units import format_bytes
from ..weighting import Weighting
from . import engine as _engine
from .discovery import Checkpoint, choose_window, complete_blocks, find_checkpoints, mergeable
from .distributed import Collective, assign_shards
from .engine import Candidate, EngineOptions, StreamingAverage
from .job import (
    MergeJob,
    MergeResult,
    PartResult,
    Progress,
    _reusable,
    already_merged_note,
    note_unused_copy_rules,
    prepare,
    publish,
    published_files,
)
from .journal import Journal
from .keys import note_unused_keys
from .options import MergeOptions, PublishExtras
from .progress import ByteCount
from .publish import AtomicFolder, check_output_location

# Chunk-sized buffers each candidate beyond the first adds to a merge's: its writer's queue and
# the output step being filled. The inputs are shared, and the threads' accumulator blocks shrink
# as candidates are added (the engine splits one cache-sized block between them).
BUFFERS_PER_CANDIDATE = 3


def sweep_memory(candidates: int, chunk_bytes: int) -> int:
    """Bytes of buffers a pass of ``candidates`` holds (``chunk_bytes`` each)."""
    return chunk_bytes * (EngineOptions(chunk_bytes=chunk_bytes).buffers + (candidates - 1) * BUFFERS_PER_CANDIDATE)


def check_memory(candidates: int, chunk_bytes: int) -> None:
    """Refuse a sweep whose buffers the available memory cannot hold (one accumulator block per
    candidate), before anything is read."""
    needed = sweep_memory(candidates, chunk_bytes)
    available = _engine.available_memory()
    if available is not None and needed > available:
        raise ConfigError(
            f"{candidates} candidates in one pass need {format_bytes(needed)} of buffers (one accumulator of "
            f"--chunk-size {format_bytes(chunk_bytes)} each) but {format_bytes(available)} of memory is available: "
            "sweep fewer windows or weightings at once, or pass a smaller --chunk-size"
        )


def candidate_name(merge_step: int, window: int | None, weighting: Weighting, windows: int, weightings: int) -> str:
    """The output folder's name of one candidate of a sweep of ``windows`` x ``weightings``."""
    if windows > 1:
        return f"step{merge_step}-merged-w{window}-{weighting.tag()}"
    if weightings > 1:
        return f"step{merge_step}-merged-{weighting.tag()}"
    return f"step{merge_step}-merged"


@dataclass(frozen=True)
class SweepCandidate:
    """One output of a sweep: a window (None with ``last``/``steps``) and a weighting."""

    name: str
    output: str
    window: int | None
    weighting: Weighting
    checkpoints: list[Checkpoint]
    missing: str = ""
    """The window's missing steps, described, when it may be partial."""


@dataclass(frozen=True)
class SweepSelection:
    """The checkpoints a sweep reads (those of its widest window) and its candidates."""

    run_dir: str
    merge_step: int
    checkpoints: list[Checkpoint]
    candidates: list[SweepCandidate]

    def sources_of(self, candidate: SweepCandidate) -> tuple[int, ...]:
        """The candidate's checkpoints as indices into :attr:`checkpoints`."""
        index = {c.url: i for i, c in enumerate(self.checkpoints)}
        return tuple(index[c.url] for c in candidate.checkpoints)


def _distinct(values: Sequence[Any], what: str) -> None:
    seen: set[Any] = set()
    for value in values:
        if value in seen:
            raise ConfigError(f"{what} {value} is given twice; each candidate needs an output of its own")
        seen.add(value)


def select_sweep(
    run_dir: str,
    *,
    merge_step: int | None = None,
    windows: Sequence[int] | None = None,
    weightings: Sequence[Weighting] = (Weighting(),),
    last: int | None = None,
    steps: Sequence[int] | None = None,
    out: str | None = None,
    every: int | None = None,
    allow_partial_window: bool = False,
    min_gap: int | None = None,
) -> SweepSelection:
    """Discover the checkpoints of ``run_dir`` once and choose those of every candidate
    (``windows`` x ``weightings``). Candidate outputs go under ``out`` (default: the run folder),
    named by :func:`candidate_name`; an ``out`` that is itself a merged output, and an output
    that would replace the run folder or a chosen checkpoint, are refused here already.

    Example::

        selection = select_sweep("runs/llama", merge_step=5000, windows=[50, 100, 200])
        print([(c.name, [k.step for k in c.checkpoints]) for c in selection.candidates])
    """
    if not weightings:
        raise ConfigError("a sweep needs at least one weighting")
    window_list: list[int | None] = list(windows) if windows else [None]
    if len(window_list) > 1 and merge_step is None:
        raise ConfigError(
            f"several windows (--window {','.join(map(str, window_list))}) end at one --merge-step; "
            "they cannot be combined with --last or --steps"
        )
    _distinct(window_list, "window")
    _distinct([w.tag() for w in weightings], "weighting")
    if len(window_list) > 1 and any(w.scheme == "explicit" for w in weightings):
        raise ConfigError(
            "--weights gives one weight per checkpoint of one window; it cannot be used with several windows"
        )
    if out is not None:
        _check_parent(out)
    fs, path = resolve(run_dir)
    listed = find_checkpoints(fs, path)
    found, blocks = mergeable(listed), complete_blocks(listed)
    parent_fs, parent = resolve(out) if out is not None else (fs, path)
    chosen: dict[int | None, tuple[list[Checkpoint], str]] = {}
    for window in window_list:
        picked, missing = choose_window(
            found,
            display(fs, path),
            merge_step=merge_step,
            window=window,
            last=last,
            steps=steps,
            every=every,
            allow_partial_window=allow_partial_window,
            min_gap=min_gap,
            blocks=blocks,
        )
        chosen[window] = (picked, missing)
    _one_kind(chosen)
    union = {c.url: c for picked, _ in chosen.values() for c in picked}
    checkpoints = sorted(union.values(), key=lambda c: c.step)
    step = merge_step if merge_step is not None else checkpoints[-1].step
    candidates = []
    for window in window_list:
        picked, missing = chosen[window]
        for weighting in weightings:
            name = candidate_name(step, window, weighting, len(window_list), len(weightings))
            output = display(parent_fs, join(parent_fs, parent, name))
            check_output_location(*resolve(output), [(fs, c.path) for c in checkpoints], run_folder=(fs, path))
            candidates.append(SweepCandidate(name, output, window, weighting, picked, missing))
    return SweepSelection(display(fs, path), step, checkpoints, candidates)


def _one_kind(chosen: dict[int | None, tuple[list[Checkpoint], str]]) -> None:
    """One pass reads blocks or single steps, not both: their tensors differ in dtype, and each
    candidate averages one kind alone anyway."""
    kinds = {window: picked[0].block for window, (picked, _) in chosen.items()}
    if len(set(kinds.values())) > 1:
        by_blocks = [str(w) for w, block in kinds.items() if block]
        by_steps = [str(w) for w, block in kinds.items() if not block]
        raise ConfigError(
            f"windows {','.join(by_blocks)} are built from the training hook's blocks, windows {','.join(by_steps)} "
            "from checkpoints of single steps: sweep each kind on its own"
        )


def _check_parent(out: str) -> None:
    """With several candidates ``--out`` is the folder that holds them: refuse one that is itself
    a merged output (a single merge's ``--out``), where the candidates would be nested."""
    fs, path = resolve(out)
    if has_manifest(fs, path):
        raise ConfigError(
            f"--out {display(fs, path)} is a merged output (it has {MANIFEST_FILE}); with several candidates "
            "--out names the folder that holds them (stepS-merged-w<W>-<tag> each): choose another"
        )


@dataclass(frozen=True)
class SweepOutput:
    """One candidate of :func:`average_sweep`: its sources (indices, ascending) and output."""

    sources: tuple[int, ...]
    out: str
    weighting: Weighting | None = None


@dataclass(frozen=True)
class SweepResult:
    """What a sweep did, for the summary and ``--json``."""

    candidates: list[MergeResult]
    """One per candidate, in order; each one's ``bytes_read`` is what a merge of it alone reads."""
    bytes_read: int
    """What the one pass read (all processes together)."""
    seconds: float
    kept: list[str] = field(default_factory=list)
    """Outputs an earlier run of the same candidate had already published: kept, nothing read for them."""

    @property
    def bytes_separately(self) -> int:
        """What merging each candidate on its own would read."""
        return sum(c.bytes_read for c in self.candidates)

    def to_dict(self) -> dict[str, Any]:
        return {
            "candidates": [c.to_dict() for c in self.candidates],
            "bytes_read": self.bytes_read,
            "bytes_read_by_separate_merges": self.bytes_separately,
            "seconds": round(self.seconds, 3),
            "kept": self.kept,
        }


class _Reused:
    """The sink of a file an interrupted run of this candidate finished: the pass computes it
    for the other candidates, this one keeps its file and journal entry as they are."""

    def __init__(self, sha256: str) -> None:
        self.sha256 = sha256

    def write(self, data: memoryview) -> None:
        pass

    def close(self) -> str:
        return self.sha256

    def abort(self) -> None:
        pass


@dataclass
class _Slot:
    """One candidate being written: its job, folder, writer and journal on this process."""

    job: MergeJob
    folder: AtomicFolder | None  # on process 0
    writer: OutputFormat
    reused: dict[str, Any]
    journal: Journal

    def open_sink(self, shard: ShardSpec) -> ShardSink:
        entry = self.reused.get(shard.file_name)
        return _Reused(entry["sha256"]) if entry is not None else self.writer.open_sink(shard)

    def file_done(self, name: str, digest: str) -> None:
        if name not in self.reused:
            self.journal.record(name, digest, self.writer.record(name))


def average_sweep(
    readers: Sequence[CheckpointReader],
    outputs: Sequence[SweepOutput],
    *,
    steps: Sequence[int | None] | None = None,
    options: MergeOptions | None = None,
    progress: Progress | None = None,
    collective: Collective | None = None,
    notice: Callable[[str], None] | None = None,
) -> SweepResult:
    """Average each of ``outputs`` (a subset of ``readers`` with a weighting) into its own
    folder, reading every block of every reader once. Each output is byte-identical to
    :func:`ckptavg.merging.job.average_readers` of its sources alone, manifest included, and is
    published as that merge would be; processes share the files as a merge does.

    Refused before anything is read or created: no outputs, two outputs into one folder, or more
    candidates than the available memory holds an accumulator block for (:func:`check_memory`).
    """
    options = options or MergeOptions()
    collective = collective or Collective()
    if not outputs:
        raise ConfigError("nothing to sweep: no candidates")
    _distinct([o.out for o in outputs], "output")
    check_memory(len(outputs), options.chunk_bytes)
    started = time.perf_counter()
    count = ByteCount(progress)

    def sub(values: Sequence[Any] | None, output: SweepOutput) -> list[Any] | None:
        return None if values is None else [values[i] for i in output.sources]

    jobs = [
        prepare(sub(readers, o) or [], sub(steps, o), o.weighting, options, PublishExtras(), lambda _n: None)
        for o in outputs
    ]
    note_unused_keys(readers, notice if collective.rank == 0 else None)
    engine = StreamingAverage(
        readers,
        None,
        options.engine_options(options.dtype),
        count,
    )
    note_unused_copy_rules(engine, options, notice if collective.rank == 0 else None)
    places = [resolve(o.out) for o in outputs]
    world, rank = collective.world_size, collective.rank
    with contextlib.ExitStack() as stack:
        folders: list[AtomicFolder | None] = [None] * len(outputs)

        def create() -> list[tuple[str, bool] | None]:
            """Process 0: each candidate's (temporary folder, resumed), or None when kept."""
            kept = []
            for k, (fs, path) in enumerate(places):
                check_output_location(fs, path, [(reader.fs, reader.path) for reader in readers])
                kept.append(not options.force and published_files(fs, path, jobs[k]) is not None)
                # Every target checked before any folder is entered: a refusal must not remove the
                # interrupted folders that candidates before it adopted with resume.
                if not kept[k] and not options.force and (has_manifest(fs, path) or (is_local(fs) and fs.exists(path))):
                    raise OutputError(f"output {display(fs, path)} already exists; pass --force to replace it")
            made: list[tuple[str, bool] | None] = []
            for k, (fs, path) in enumerate(places):
                if kept[k]:
                    if notice is not None:
                        notice(already_merged_note(display(fs, path)))
                    made.append(None)
                    continue
                folder = stack.enter_context(
                    AtomicFolder(
                        fs, path, force=options.force, resume=options.resume, fsync=options.fsync, notice=notice
                    )
                )
                folders[k] = folder
                made.append((folder.tmp, folder.resumed))
            return made

        made = collective.decide(create)
        slots: dict[int, _Slot] = {}
        shards: list[ShardSpec] | None = None
        for k, place in enumerate(made):
            if place is None:
                continue
            (fs, path), (tmp, resumed) = places[k], place
            writer = jobs[k].writer(fs, tmp, display(fs, path))
            layout, merge_id = jobs[k].layout(writer)
            if shards is None:
                shards = layout
            elif layout != shards:
                raise ConfigError(f"{outputs[k].out} has another layout than the other candidates: merge it on its own")
            mine = assign_shards(layout, world)[rank]
            reused = _reusable(fs, writer, tmp, mine, merge_id, options.fsync) if resumed else {}
            journal = Journal(fs, tmp, rank, merge_id, reused, options.fsync)
            slots[k] = _Slot(jobs[k], folders[k], writer, reused, journal)
        todo: list[ShardSpec] = []
        if shards is not None:
            todo = [
                s
                for s in assign_shards(shards, world)[rank]
                if any(s.file_name not in x.reused for x in slots.values())
            ]
        start = getattr(progress, "start", None)
        if start is not None:
            start(engine.read_bytes(todo))
        gathered: list[tuple[dict[int, PartResult], int]] = collective.all_gather(
            _write_parts(engine, outputs, slots, todo, world, lambda: count.total)
        )
        parts = [part for part, _ in gathered]
        failed = [(r, p.error) for r, part in enumerate(parts) for p in part.values() if p.error is not None]
        if failed:
            failed_rank, message = failed[0]
            raise CkptavgError(f"rank {failed_rank} of {world} failed: {message}")

        def publish_on_rank0() -> dict[int, dict[str, str]]:
            hashes = {}
            for k, slot in slots.items():
                assert slot.folder is not None and shards is not None  # process 0 holds the folders
                done = {name: entry for part in parts for name, entry in part[k].files.items()}
                hashes[k] = publish(slot.job, slot.folder, slot.writer, shards, done)
            return hashes

        hashes = collective.decide(publish_on_rank0, f"rank 0 of {world} failed while publishing: ")
    per_source = sum(t.nbytes for t in engine.tensors.values())
    results = [
        MergeResult(
            output=display(*places[k]),
            sources=job.sources,
            tensor_count=len(job.specs),
            bytes_read=per_source * len(output.sources),
            bytes_written=sum(s.nbytes for s in job.specs),
            seconds=time.perf_counter() - started,
            files=dict(sorted(hashes.get(k, {}).items())),
            reused_files=sum(part[k].reused for part in parts if k in part),
        )
        for k, (output, job) in enumerate(zip(outputs, jobs, strict=True))
    ]
    return SweepResult(
        results,
        sum(read for _, read in gathered),
        time.perf_counter() - started,
        [display(*places[k]) for k, place in enumerate(made) if place is None],
    )


def _write_parts(
    engine: StreamingAverage,
    outputs: Sequence[SweepOutput],
    slots: dict[int, _Slot],
    todo: Sequence[ShardSpec],
    world: int,
    bytes_read: Callable[[], int],
) -> tuple[dict[int, PartResult], int]:
    """This process's files of every candidate, from one pass over ``todo``, and the bytes it
    read; alone, a failure is raised as it is, with others it is reported to them (as
    :func:`ckptavg.merging.job.write_part` does)."""
    order = sorted(slots)
    try:
        if todo:
            engine.run_many(
                todo,
                [_candidate(outputs[k], slots[k].job) for k in order],
                [slots[k].open_sink for k in order],
                [slots[k].file_done for k in order],
            )
        parts = {k: PartResult(dict(slots[k].journal.content["files"]), 0, len(slots[k].reused)) for k in order}
        return parts, bytes_read()
    except Exception as exc:
        if world == 1:
            raise
        reason = str(exc) if isinstance(exc, CkptavgError) else f"{type(exc).__name__}: {exc}"
        return {k: PartResult({}, 0, 0, reason) for k in order}, 0


def _candidate(output: SweepOutput, job: MergeJob) -> Candidate:
    """What the pass computes for ``output``: its sources, weights and copy source, as its own
    merge (``job``) would."""
    weights = None if job.weights is None else tuple(job.weights)
    return Candidate(output.sources, weights, output.sources[job.engine.copy_from])
