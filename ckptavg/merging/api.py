"""The library behind ``ckptavg merge``: choose checkpoints (:func:`select`), average them
(:func:`average`), or both (:func:`merge`)."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..errors import ConfigError
from ..formats import CheckpointReader, open_checkpoint
from ..io.fs import display, join, resolve
from ..manifest import has_manifest
from ..weighting import Weighting
from .discovery import Checkpoint, choose_window, complete_blocks, find_checkpoints, mergeable
from .distributed import Collective
from .engine import EngineOptions, StreamingAverage
from .job import MergeResult, Progress, average_readers, prepare, published_files
from .keys import FilteredReader, KeyFilter
from .options import MergeOptions, PublishExtras
from .publish import check_output_location
from .retention import remove_consumed_snapshots
from .sweep import SweepOutput, SweepResult, SweepSelection, average_sweep, select_sweep

__all__ = [
    "MergeResult",
    "MergeSelection",
    "SweepResult",
    "SweepSelection",
    "already_merged",
    "average",
    "merge",
    "read_bytes",
    "select",
    "select_sweep",
    "sweep",
    "sweep_read_bytes",
]


# Checkpoints opened at once: each open reads an index and every shard's header, one request
# after another, so on an object store (tens of ms per request) opening them one by one took
# longer than averaging a small model.
_OPEN_THREADS = 8


def _open_all(paths: Sequence[str], keys: KeyFilter) -> list[CheckpointReader]:
    """Open every checkpoint, the first alone, the others concurrently. The first one's open
    imports what its format needs (DCP's classes) and makes the filesystem's first requests
    (s3fs creates its client then, with no lock: concurrent first requests could each create
    one), so that the others share both rather than race for them. On a failure, every opened
    reader is closed and the error of the first failing path, in order, is raised."""

    def open_one(path: str) -> CheckpointReader:
        fs, inner = resolve(path)
        reader = open_checkpoint(fs, inner)
        try:
            return FilteredReader(reader, keys)
        except BaseException:
            reader.close()
            raise

    if not paths:
        return []
    first = open_one(paths[0])
    with ThreadPoolExecutor(max_workers=_OPEN_THREADS, thread_name_prefix="ckptavg-open") as pool:
        futures = [pool.submit(open_one, path) for path in paths[1:]]
    opened = [first] + [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for reader in opened:
            reader.close()
        raise errors[0]  # type: ignore[misc]
    return opened


@contextlib.contextmanager
def _opened(paths: Sequence[str], keys: KeyFilter) -> Iterator[list[CheckpointReader]]:
    """The checkpoints ``paths`` (:func:`_open_all`), open until the block ends; in the main
    thread, Python's cyclic garbage collector is paused while they are opened and spares what
    that made until they are closed (``gc.freeze``, ``gc.unfreeze``).

    Why: a full collection walks every object, and the readers' tables hold several per tensor
    and checkpoint (half a million for 4 checkpoints of 24,576 tensors); the collector starts one
    each time a quarter more objects have survived, so opening them paid 1.1 s of collections
    for 0.7 s of work (measured), and planning the output (its specs, its files' headers) then
    0.2-0.3 s per collection, more than the whole merge of the same bytes in large tensors.
    Opening local checkpoints makes no reference cycles for the collector to find (its garbage
    goes by reference counts); cycles that a remote filesystem's client makes meanwhile are
    frozen with the rest and freed once the readers close. A merge in a background thread (the
    training hook's) leaves the collector as training set it, and so does one in a process where
    objects are frozen already (unfreezing them would undo that)."""
    owner = threading.current_thread() is threading.main_thread() and gc.isenabled() and not gc.get_freeze_count()
    if owner:
        gc.disable()
    try:
        readers = _open_all(paths, keys)
        if owner:
            gc.freeze()
    finally:
        if owner:
            gc.enable()
    try:
        yield readers
    finally:
        for reader in readers:
            reader.close()
        if owner:
            gc.unfreeze()


def average(
    sources: Sequence[str],
    out: str,
    *,
    steps: Sequence[int | None] | None = None,
    weighting: Weighting | None = None,
    options: MergeOptions | None = None,
    progress: Progress | None = None,
    collective: Collective | None = None,
    notice: Callable[[str], None] | None = None,
) -> MergeResult:
    """Average the checkpoint folders ``sources`` (oldest first) into a new folder ``out``.

    Sources may be local paths or fsspec URLs, in any format ckptavg reads (safetensors, DCP,
    ``.pt``). The output is ``options.output_format`` (Hugging Face sharded safetensors with an
    index by default; ``dcp``; ``pt``), the non-weight files of the newest source, and
    ``ckptavg-manifest.json``; it counts as complete only once the manifest is there.

    ``out`` must not be, contain or lie inside a source, nor be or contain the working folder:
    that is refused before anything is written, ``force`` or not.

    Args:
        sources: checkpoint folders, oldest first.
        out: the output folder (path or URL); it must not exist unless ``options.force``, or
            hold an output of this same merge (kept as it is: ``result.already_merged``).
        steps: the training step of each source; ``ema`` needs them (it decays per training
            step); the other schemes weigh each source by its place in ``sources``.
        weighting: uniform by default; a scheme (:class:`~ckptavg.Weighting`: ``ema``, ``wma``,
            ``minus-sqrt``, or ``explicit`` weights, one per source) makes it a weighted mean,
            normalised.
        options: dtype, shard and chunk size, format, keys, ``force``, ``resume``, ...
            (:class:`~ckptavg.MergeOptions`).
        progress: called with the bytes read; if it has ``start(total)``, that is called first.
        collective: the processes of a multi-process merge (the CLI makes one under torchrun or
            srun); one process by default.
        notice: receives advice for the log (a hidden folder a killed merge left, ...).

    With ``options.remove_consumed_snapshots``, process 0 then verifies the published output and
    removes the sources that are training hook snapshots (``result.removed_snapshots``); a failed
    merge or a failed verification removes nothing.

    Example::

        result = ckptavg.average(["run/step900", "run/step1000"], "run/avg", options=MergeOptions(dtype=torch.bfloat16))
        print(result.output, result.files)
    """
    if not sources:
        raise ConfigError("nothing to average: no sources")
    if steps is not None and len(steps) != len(sources):
        raise ConfigError(f"{len(steps)} steps given for {len(sources)} sources")
    options = options or MergeOptions()
    collective = collective or Collective()
    with _opened(sources, options.keys) as readers:
        result = average_readers(
            readers,
            out,
            steps=steps,
            weighting=weighting,
            options=options,
            progress=progress,
            collective=collective,
            notice=notice,
        )
    if not options.remove_consumed_snapshots:
        return result
    # After the collective decision that published the output; process 0 removes, and tells
    # the others what (or why not).
    removal = collective.decide(
        lambda: remove_consumed_snapshots(out, sources, notice),
        f"rank 0 of {collective.world_size} failed while removing the consumed snapshots: ",
    )
    return replace(result, removed_snapshots=removal.removed, kept_inputs=removal.kept)


@dataclass(frozen=True)
class MergeSelection:
    """The checkpoints one merge averages and where it writes (what ``--dry-run`` shows)."""

    run_dir: str
    checkpoints: list[Checkpoint]
    output: str
    merge_step: int
    missing: str = ""
    """The window's missing steps, described, when it may be partial."""


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
    min_gap: int | None = None,
) -> MergeSelection:
    """Discover the checkpoints of ``run_dir`` and choose those of one merge. An output that
    would replace the run folder or a chosen checkpoint is refused here already.

    Args:
        run_dir: the run folder holding ``stepN/`` checkpoint folders (path or fsspec URL).
        merge_step: the last step of the window; with ``window``.
        window: the window's length in steps: every checkpoint in ``[merge_step - window + 1,
            merge_step]``, or the training hook's blocks that tile it where they average more of
            its steps (:func:`~ckptavg.merging.discovery.choose_window`).
        last: instead, the newest ``last`` complete checkpoints.
        steps: instead, exactly these steps.
        out: the output folder (default ``RUN_DIR/step{S}-merged``).
        every: the save stride inside the window (default: inferred from the steps found).
        allow_partial_window: accept a window with missing steps (named in ``missing``).
        min_gap: keep only checkpoints at least this many steps apart, walking back from the
            merge step (or the newest, with ``last``), which is always kept: Megatron-LM's
            ``weighted_merge.py --min-iteration-interval``.

    Example::

        selection = ckptavg.select("runs/llama", merge_step=5000, window=100)
        print([c.step for c in selection.checkpoints], selection.output)
    """
    fs, path = resolve(run_dir)
    listed = find_checkpoints(fs, path)
    chosen, missing = choose_window(
        mergeable(listed),
        display(fs, path),
        merge_step=merge_step,
        window=window,
        last=last,
        steps=steps,
        every=every,
        allow_partial_window=allow_partial_window,
        min_gap=min_gap,
        blocks=complete_blocks(listed),
    )
    step = merge_step if merge_step is not None else chosen[-1].step
    output = out if out is not None else display(fs, join(fs, path, f"step{step}-merged"))
    check_output_location(*resolve(output), [(fs, c.path) for c in chosen], run_folder=(fs, path))
    return MergeSelection(display(fs, path), chosen, output, step, missing)


def read_bytes(selection: MergeSelection, keys: KeyFilter | None = None) -> tuple[int, int]:
    """(bytes a merge of ``selection`` reads, tensors per source), from headers alone."""
    with _opened([c.url for c in selection.checkpoints], keys or KeyFilter()) as readers:
        tensors = StreamingAverage(readers, None, EngineOptions()).tensors
        return sum(t.nbytes for t in tensors.values()) * len(readers), len(tensors)


def already_merged(
    checkpoints: Sequence[Checkpoint],
    output: str,
    weighting: Weighting | None = None,
    options: MergeOptions | None = None,
) -> bool:
    """Whether ``output`` is an output that a run of this same merge (``checkpoints`` averaged
    with ``weighting`` and ``options``) already published, so that a merge would keep it as it
    is (what ``--dry-run`` tells); from the manifest and the checkpoints' headers alone."""
    options = options or MergeOptions()
    if options.force:
        return False
    fs, path = resolve(output)
    if not has_manifest(fs, path):  # the common case: nothing to open
        return False
    with _opened([c.url for c in checkpoints], options.keys) as readers:
        steps = [c.step for c in checkpoints]
        job = prepare(readers, steps, weighting, options, PublishExtras(), lambda _n: None)
        return published_files(fs, path, job) is not None


def sweep_read_bytes(selection: SweepSelection, keys: KeyFilter | None = None) -> tuple[int, int]:
    """(bytes of one checkpoint a sweep of ``selection`` reads, tensors per checkpoint), from
    headers alone: a sweep reads that for each checkpoint once, separate merges once per candidate
    holding it."""
    with _opened([c.url for c in selection.checkpoints], keys or KeyFilter()) as readers:
        tensors = StreamingAverage(readers, None, EngineOptions()).tensors
        return sum(t.nbytes for t in tensors.values()), len(tensors)


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
    min_gap: int | None = None,
    weighting: Weighting | None = None,
    options: MergeOptions | None = None,
    progress: Progress | None = None,
    collective: Collective | None = None,
    notice: Callable[[str], None] | None = None,
    selection: MergeSelection | None = None,
) -> MergeResult:
    """Choose checkpoints of ``run_dir`` (as :func:`select`) and :func:`average` them.

    The default output is ``RUN_DIR/step{S}-merged`` (OLMo-core's name), where S is the merge
    step, or the newest chosen step with ``last``/``steps``.

    Args:
        run_dir, merge_step, window, last, steps, out, every, allow_partial_window, min_gap: as
            :func:`select` (exactly one of ``merge_step`` with ``window``, ``last``, ``steps``).
        weighting, options, progress, collective, notice: as :func:`average`.
        selection: a :func:`select` already made (the CLI's process 0 chooses for all); the
            selection arguments are then ignored.

    Example::

        result = ckptavg.merge("runs/llama", merge_step=5000, window=100, options=MergeOptions(output_format="dcp"))
    """
    if selection is None:
        selection = select(
            run_dir,
            merge_step=merge_step,
            window=window,
            last=last,
            steps=steps,
            out=out,
            every=every,
            allow_partial_window=allow_partial_window,
            min_gap=min_gap,
        )
    return average(
        [c.url for c in selection.checkpoints],
        selection.output,
        steps=[c.step for c in selection.checkpoints],
        weighting=weighting,
        options=options,
        progress=progress,
        collective=collective,
        notice=notice,
    )


def sweep(
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
    options: MergeOptions | None = None,
    progress: Progress | None = None,
    collective: Collective | None = None,
    notice: Callable[[str], None] | None = None,
    selection: SweepSelection | None = None,
) -> SweepResult:
    """Merge every window of ``windows`` with every weighting of ``weightings`` from ONE read of
    the checkpoints of the widest window: each candidate is written as its own complete output
    (with its manifest), byte-identical to :func:`merge` of that window and weighting.

    Outputs go under ``out`` (default: the run folder), named ``step{S}-merged-w{W}-<tag>`` with
    several windows, ``step{S}-merged-<tag>`` with one window and several weightings (the tag is
    :meth:`Weighting.tag`: ``uniform``, ``ema20``, ``wma``, ...), ``step{S}-merged`` for a single
    candidate. ``out`` must not be a merged output itself.

    Memory: one accumulator block (``options.chunk_bytes``) per candidate; more candidates than the
    available memory holds are refused before anything is read. ``options.resume`` picks up each
    candidate's interrupted output and keeps the candidates an interrupted sweep already
    published; ``options.force`` replaces every candidate's output.

    Args:
        run_dir, merge_step, last, steps, every, allow_partial_window, min_gap: as :func:`select`;
            several ``windows`` need ``merge_step``.
        windows: window lengths in steps, each ending at ``merge_step``.
        weightings: the weightings of every window (explicit weights only with one window).
        options, progress, collective, notice: as :func:`average`
            (``remove_consumed_snapshots`` is for single merges).
        selection: a :func:`select_sweep` already made (the CLI's process 0 chooses for all);
            the selection arguments are then ignored.

    Example::

        result = ckptavg.sweep(
            "runs/llama", merge_step=5000, windows=[50, 100, 200],
            weightings=[Weighting(), Weighting("ema", ema_halflife=20)],
        )
        print([c.output for c in result.candidates], result.bytes_read, result.bytes_separately)
    """
    options = options or MergeOptions()
    if options.remove_consumed_snapshots:
        raise ConfigError("--remove-consumed-snapshots removes the inputs of a single merge, not of a sweep")
    if selection is None:
        selection = select_sweep(
            run_dir,
            merge_step=merge_step,
            windows=windows,
            weightings=weightings,
            last=last,
            steps=steps,
            out=out,
            every=every,
            allow_partial_window=allow_partial_window,
            min_gap=min_gap,
        )
    with _opened([c.url for c in selection.checkpoints], options.keys) as readers:
        return average_sweep(
            readers,
            [SweepOutput(selection.sources_of(c), c.output, c.weighting) for c in selection.candidates],
            steps=[c.step for c in selection.checkpoints],
            options=options,
            progress=progress,
            collective=collective,
            notice=notice,
        )
