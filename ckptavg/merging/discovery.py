"""Finding checkpoints in a run folder by step, and choosing the ones a merge averages."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..errors import CheckpointError, CkptavgError, ConfigError
from ..formats import detect_format, open_checkpoint
from ..formats.base import BlockRecord
from ..io.fs import FileSystem, display, is_local, join, resolve
from ..manifest import MANIFEST_FILE
from ..plan import sampled_steps, steps_between, window_start
from ..units import every

# stepN (OLMo-core), step-N (torchtitan), checkpoint-N (HF Trainer), global_stepN (DeepSpeed),
# global_step_N (HyperParallel), iter_NNNNNNN (Megatron-LM).
# OLMo-core writes stepN-tmp/ while saving and the merge callback stepN-merged/; the ckptavg
# training hook writes stepN-snapshot/, stepN-block/ (the mean of a block of steps), and
# stepN-merged-<tag>/ when it merges a window with several weightings (Weighting.tag()) or
# exports its EMA.
_STEP_DIR = re.compile(
    r"^(?:step[-_]?|checkpoint-|global_step_?|iter_)(\d+)(-merged(?:-[A-Za-z0-9.+-]+)?|-tmp|-snapshot|-block)?$"
)
# Checkpoint files (Lightning's ModelCheckpoint): a ``step=N`` field of the name
# (``epoch=1-step=20.ckpt``, ``step=20-v1.ckpt``, ``model-step=20-val_loss=0.52.ckpt``) or a
# folder's name before the extension (``step20.ckpt``); a name without a step (``last.ckpt``)
# takes the one the file records.
_STEP_FIELD = re.compile(r"(?:^|[-_])step=(\d+)(?=[-_.]|$)")
# Entries of a remote run folder probed at once (find_checkpoints).
_PROBE_THREADS = 8


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: str  # inside ``fs``
    name: str
    format: str | None
    complete: bool
    note: str = ""
    merged: bool = False  # a finished merged output (``stepN-merged`` with its manifest)
    url: str = ""
    snapshot: bool = False
    same_as: str = ""  # a file whose name tells no step (``last.ckpt``), and the checkpoint named by its step
    block: bool = False  # the training hook's mean of the block of steps ending at ``step`` (``stepN-block``)


def parse_step_file(name: str) -> int | None:
    """``epoch=1-step=20.ckpt`` -> 20, ``step20.ckpt`` -> 20, ``last.ckpt`` -> None."""
    match = _STEP_FIELD.search(name)
    if match:
        return int(match.group(1))
    parsed = parse_step_dir(name.rsplit(".", 1)[0])
    return parsed[0] if parsed is not None and parsed[1] is None else None


def parse_step_dir(name: str) -> tuple[int, str | None] | None:
    """``step1200`` -> (1200, None), ``step1200-merged`` -> (1200, "-merged"),
    ``step1200-merged-ema20`` -> (1200, "-merged-ema20"), other -> None."""
    match = _STEP_DIR.match(name)
    if not match:
        return None
    return int(match.group(1)), match.group(2)


def find_checkpoints(fs: FileSystem, run_dir: str) -> list[Checkpoint]:
    """Every checkpoint directly under ``run_dir``: step folders, and files of a single-file
    format; sorted by step (merged outputs included, flagged, so that ``ls`` can show them;
    selection skips them).

    A ``stepN-merged`` folder without its manifest is an unfinished merge (on an object store a
    merge writes in place, the manifest last), so it is incomplete and not flagged merged.
    Trainer checkpoints never have a manifest and need none. A file whose name tells no step
    takes the one it records (opening it); if a file's name tells that step, the two are one
    save (Lightning's ``last.ckpt``), flagged ``same_as``."""
    try:
        entries = fs.ls(run_dir, detail=True)
    except FileNotFoundError as exc:
        raise ConfigError(f"run folder {display(fs, run_dir)} does not exist") from exc
    except NotADirectoryError as exc:
        raise ConfigError(f"{display(fs, run_dir)} is not a folder") from exc
    if is_local(fs) or len(entries) < 2:
        probed = [_probe_entry(fs, run_dir, entry) for entry in entries]
    else:
        # Each entry costs a few requests (format probes, the index, a manifest), one after
        # another; an object store answers each after tens of ms, so a run of a hundred
        # checkpoints took seconds to list. The listing above set up the connection.
        with ThreadPoolExecutor(max_workers=_PROBE_THREADS, thread_name_prefix="ckptavg-probe") as pool:
            probed = list(pool.map(lambda entry: _probe_entry(fs, run_dir, entry), entries))
    found = [ckpt for ckpt, named_by_step in filter(None, probed) if named_by_step]
    unnamed = [ckpt for ckpt, named_by_step in filter(None, probed) if not named_by_step]
    named = {c.step: c.name for c in found if c.complete and not c.merged}
    found += [replace(c, same_as=named.get(c.step, "")) for c in unnamed]
    found.sort(key=lambda c: (c.step, c.merged, bool(c.same_as), c.name))
    return found


def _probe_entry(fs: FileSystem, run_dir: str, entry: dict) -> tuple[Checkpoint, bool] | None:
    """The checkpoint an entry of a run folder's listing is, if any, and whether its name tells
    its step (a file such as ``last.ckpt`` takes the one it records)."""
    if entry.get("type") == "file" or (entry.get("islink") and fs.isfile(entry["name"])):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        step = parse_step_file(name)
        ckpt = _step_file(fs, join(fs, run_dir, name), name, step)
        return None if ckpt is None else (ckpt, step is not None)
    # fsspec lists a link as "other": a linked step folder counts (a run spread over
    # disks); the files it names must still resolve inside it (RandomAccessFile checks).
    if entry.get("type") != "directory" and not (entry.get("islink") and fs.isdir(entry["name"])):
        return None
    name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
    parsed = parse_step_dir(name)
    if parsed is None:
        return None
    step, suffix = parsed
    merged_output = suffix is not None and suffix.startswith("-merged")
    path = join(fs, run_dir, name)
    reader = detect_format(fs, path, single_file=False)
    fmt = reader.folder_format(fs, path) if reader else None
    if suffix == "-tmp":
        complete, note = False, "temporary folder of a save in progress or interrupted"
    elif merged_output:
        # The manifest, written last, is what completes a merged output, whatever its format.
        complete = fs.isfile(join(fs, path, MANIFEST_FILE))
        note = "" if complete else f"no {MANIFEST_FILE}: the merge did not finish (or ckptavg did not write it)"
    elif reader is None:
        complete, note = False, "no supported weights (model.safetensors or an index)"
    else:
        reason = reader.incomplete_reason(fs, path)
        complete, note = reason is None, reason or ""
    ckpt = Checkpoint(
        step,
        path,
        name,
        fmt,
        complete,
        note,
        merged_output and complete,
        display(fs, path),
        suffix == "-snapshot",
        block=suffix == "-block",
    )
    return ckpt, True


def _step_file(fs: FileSystem, path: str, name: str, step: int | None) -> Checkpoint | None:
    """A checkpoint file of a single-file format at ``step`` (None: the step it records), or
    None (another file, or one that records no step and whose name tells none)."""
    reader = detect_format(fs, path, single_file=True)
    if reader is None:
        return None
    if step is None:
        step = reader.stored_step(fs, path)
        if step is None:
            return None
    reason = reader.incomplete_reason(fs, path)
    return Checkpoint(step, path, name, reader.format_name, reason is None, reason or "", url=display(fs, path))


def mergeable(checkpoints: Sequence[Checkpoint]) -> list[Checkpoint]:
    """Complete, not-yet-merged checkpoints of one step each (blocks are :func:`complete_blocks`),
    each save once (a ``same_as`` file is another name of one); two checkpoints for one step is an
    error, except that the training hook's snapshot of a step is taken over the trainer's
    checkpoint of it (the same weights), so that a window merges snapshots of one dtype and layout."""
    chosen: dict[int, Checkpoint] = {}
    for ckpt in checkpoints:
        if ckpt.merged or not ckpt.complete or ckpt.same_as or ckpt.block:  # a block is no one step's weights
            continue
        other = chosen.get(ckpt.step)
        if other is not None and other.snapshot != ckpt.snapshot:
            chosen[ckpt.step] = ckpt if ckpt.snapshot else other
            continue
        if other is not None:
            raise CheckpointError(f"step {ckpt.step} is stored twice: {chosen[ckpt.step].url} and {ckpt.url}")
        chosen[ckpt.step] = ckpt
    return [chosen[s] for s in sorted(chosen)]


def complete_blocks(checkpoints: Sequence[Checkpoint]) -> dict[int, Checkpoint]:
    """The training hook's complete blocks (``stepN-block``), by the step each ends at."""
    return {c.step: c for c in checkpoints if c.block and c.complete}


def _block_record(ckpt: Checkpoint) -> BlockRecord:
    with open_checkpoint(*resolve(ckpt.url)) as reader:
        record = reader.block_record()
    if record is None:  # named a block, not read as one: BlockReader claims every such folder
        raise CheckpointError(f"{ckpt.url}: not a block of the training hook")
    return record


def window_of_blocks(
    blocks: Mapping[int, Checkpoint], merge_step: int, window: int
) -> tuple[list[Checkpoint], int] | str:
    """The blocks that tile the window ``[merge_step - window + 1, merge_step]`` exactly (from
    step 1 on), oldest first, and how many steps they average together; or why no blocks do, for
    a message. Each block's record is read and checked, and they must be alike (one length, one
    stride)."""
    newest = blocks.get(merge_step)
    if newest is None:
        return f"none ends at step {merge_step}"
    record = _block_record(newest)
    size = record.block
    if window % size:
        return f"they hold {size} steps each, so only a window of a multiple of {size} steps is built from them"
    ends = range(max(size, merge_step - window + size), merge_step + 1, size)
    # Counted, not enumerated (as window_gaps): a window of 10**15 steps costs the blocks found.
    present = sorted(end for end in blocks if end in ends)
    if len(present) < (ends.stop - ends.start + size - 1) // size:  # len(ends) fails past 2**63
        return f"those ending at steps {_first_absent(ends, present)} are missing or incomplete"
    records = [record if end == merge_step else _block_record(blocks[end]) for end in ends]
    for end, other in zip(ends, records, strict=True):
        if (other.block, other.every) != (size, record.every):
            raise CheckpointError(
                f"{blocks[end].url} holds a block of {other.block} steps (every {other.every}), {newest.url} one of "
                f"{size} (every {record.every}): the blocks of one window must be alike"
            )
    return [blocks[end] for end in ends], sum(r.count for r in records)


def _first_absent(ends: range, present: Sequence[int], listed: int = 5) -> str:
    """The first ``listed`` of ``ends`` not in ``present`` (ascending, all in ``ends``), shown."""
    absent: list[int] = []
    after = ends.start - 1
    for end in [*present, ends.stop]:
        absent.extend(steps_between(ends, after, end)[: listed + 1 - len(absent)])
        after = end
    return ", ".join(map(str, absent[:listed])) + (" ..." if len(absent) > listed else "")


def _found(steps: Sequence[int]) -> str:
    return ", ".join(str(s) for s in steps) if steps else "none"


def select_checkpoints(
    available: Sequence[Checkpoint],
    *,
    merge_step: int | None = None,
    window: int | None = None,
    last: int | None = None,
    steps: Sequence[int] | None = None,
    every: int | None = None,
    allow_partial_window: bool = False,
    min_gap: int | None = None,
) -> list[Checkpoint]:
    """The checkpoints of one merge, ascending by step. Exactly one selection is allowed:
    ``merge_step`` with ``window`` (steps in ``[merge_step - window + 1, merge_step]``),
    ``last`` (the newest K), or explicit ``steps``.

    A window with missing steps (see :func:`window_gaps`) is an error unless
    ``allow_partial_window``: an average over fewer checkpoints than planned is a different
    average, and a lost save should be noticed, not absorbed. ``min_gap`` then thins the window
    (or the run, for ``last``) as :func:`thin_by_gap` does."""
    chosen_modes = [merge_step is not None, last is not None, steps is not None]
    if sum(chosen_modes) != 1:
        raise ConfigError("choose the checkpoints with exactly one of --merge-step/--window, --last or --steps")
    if min_gap is not None and steps is not None:
        raise ConfigError("--min-gap thins a window or --last; --steps names the checkpoints itself")
    by_step = {c.step: c for c in available}
    all_steps = sorted(by_step)
    if merge_step is not None:
        if window is None:
            raise ConfigError("--merge-step needs --window (the number of steps the merge averages)")
        if window < 1:
            raise ConfigError(f"--window must be at least 1 step, got {window}")
        first = window_start(merge_step, window)
        selected = [by_step[s] for s in all_steps if first <= s <= merge_step]
        if not selected:
            raise ConfigError(f"no checkpoint in the window {first}-{merge_step}; steps found: {_found(all_steps)}")
        gaps = window_gaps([c.step for c in selected], merge_step, window, every)
        if gaps and not allow_partial_window:
            raise ConfigError(
                f"window {first}-{merge_step} misses {gaps.describe()}; "
                f"pass --allow-partial-window to average the {len(selected)} found"
            )
        return thin_by_gap(selected, min_gap)
    if last is not None:
        if last < 1:
            raise ConfigError(f"--last must be at least 1, got {last}")
        if not all_steps:
            raise ConfigError("no complete checkpoint found")
        pool = [c.step for c in thin_by_gap([by_step[s] for s in all_steps], min_gap)]
        if last > len(pool):
            apart = "" if min_gap is None else f" at least {min_gap} steps apart"
            raise ConfigError(f"--last {last} asks for more checkpoints than found{apart}: {_found(pool)}")
        return [by_step[s] for s in pool[-last:]]
    assert steps is not None
    if not steps:
        raise ConfigError("--steps lists no step")
    missing = [s for s in steps if s not in by_step]
    if missing:
        raise ConfigError(f"step {missing[0]} not found; steps found: {_found(all_steps)}")
    if len(set(steps)) != len(steps):
        raise ConfigError(f"--steps repeats a step: {list(steps)}")
    return [by_step[s] for s in sorted(steps)]


def thin_by_gap(checkpoints: Sequence[Checkpoint], min_gap: int | None) -> list[Checkpoint]:
    """``checkpoints`` (ascending by step) thinned as Megatron-LM's ``weighted_merge.py`` does
    with ``--min-iteration-interval``: walking back from the newest, which is always kept, a
    checkpoint is kept when it lies at least ``min_gap`` steps before the last one kept. Saves
    every 250 steps with ``min_gap`` 1000 keep S, S-1000, ...; None keeps them all."""
    if min_gap is None:
        return list(checkpoints)
    if min_gap < 1:
        raise ConfigError(f"--min-gap must be at least 1 step, got {min_gap}")
    kept: list[Checkpoint] = []
    for ckpt in reversed(checkpoints):
        if not kept or kept[-1].step - ckpt.step >= min_gap:
            kept.append(ckpt)
    return kept[::-1]


def choose_window(
    found: Sequence[Checkpoint],
    run_display: str,
    *,
    merge_step: int | None,
    window: int | None,
    last: int | None,
    steps: Sequence[int] | None,
    every: int | None,
    allow_partial_window: bool,
    min_gap: int | None = None,
    blocks: Mapping[int, Checkpoint] | None = None,
) -> tuple[list[Checkpoint], str]:
    """The checkpoints of one window (as :func:`select_checkpoints`), with the description of the
    steps it misses ("" when whole); errors name the run folder, ``run_display``.

    With the training hook's ``blocks`` (:func:`complete_blocks`), a window ``merge_step`` /
    ``window`` is built from the blocks that tile it (:func:`window_of_blocks`) where they average
    more of its steps than the checkpoints of single steps found there; on a tie those win (their
    mean is exact). The two are never mixed."""
    try:
        chosen = select_checkpoints(
            found,
            merge_step=merge_step,
            window=window,
            last=last,
            steps=steps,
            every=every,
            allow_partial_window=allow_partial_window,
            min_gap=min_gap,
        )
        failure = None
    except CkptavgError as exc:
        chosen, failure = [], exc
    tiled: tuple[list[Checkpoint], int] | str | None = None
    if blocks and merge_step is not None and window is not None:
        tiled = window_of_blocks(blocks, merge_step, window)
        if not isinstance(tiled, str) and tiled[1] > len(chosen):
            return tiled[0], ""
    if failure is not None:  # name the run folder: "no checkpoint in the window" of which run?
        hint = f"; blocks of the training hook: {tiled}" if isinstance(tiled, str) else ""
        raise type(failure)(f"{run_display}: {failure}{hint}") from None
    missing = ""
    if merge_step is not None and window is not None:
        # The whole window's steps, before --min-gap thinned them: what it leaves out is no gap.
        first = window_start(merge_step, window)
        gaps = window_gaps([c.step for c in found if first <= c.step <= merge_step], merge_step, window, every)
        missing = gaps.describe() if gaps else ""
    return chosen, missing


@dataclass(frozen=True)
class WindowGaps:
    """The steps a window should hold and does not (how many, and the first few), and the save
    stride that says so."""

    stride: int
    inferred: bool
    count: int  # missing steps
    first: tuple[int, ...]  # the first of them, ascending

    def __bool__(self) -> bool:
        return self.count > 0

    def describe(self) -> str:
        shown = ", ".join(map(str, self.first)) + (" ..." if self.count > len(self.first) else "")
        how = "inferred from the steps found; --every sets it" if self.inferred else "--every"
        noun = "step" if self.count == 1 else "steps"
        return f"{self.count} {noun}: {shown} (checkpoints {every(self.stride)}, {how})"


def window_gaps(
    found: Sequence[int], merge_step: int, window: int, every: int | None = None, listed: int = 10
) -> WindowGaps:
    """Which steps of the window ``[merge_step - window + 1, merge_step]`` are missing from
    ``found`` (the steps present in it): how many, and the first ``listed`` of them.

    The merge step always belongs to its window. With ``every``, so does every ``every``-th step
    before it, as the training hook captures them. Without it, the stride is the gcd of the gaps
    between the steps found, and the steps on that grid are expected: strided saves (every 5 or
    50 steps) need no option, while a hole in a regular series shows. Only the window is looked
    at, so a run that saved every 1000 steps and snapshots every 5 inside its windows is judged
    by the snapshots. A hole the steps cannot reveal (a window of two saves that holds only the
    merge step) needs ``every``.

    Counted, not enumerated: the cost grows with the steps found, not with the window (a window
    of 10**12 steps that holds three checkpoints is three steps of work).
    """
    if every is not None and every < 1:
        raise ConfigError(f"--every must be at least 1 step, got {every}")
    present = sorted(set(found))
    if every is not None:
        stride, grid = every, sampled_steps(merge_step, window, every)
    else:
        stride = math.gcd(*(b - a for a, b in itertools.pairwise(present))) or window
        first = present[0] if present else merge_step
        grid = range(first - (first - window_start(merge_step, window)) // stride * stride, merge_step + 1, stride)
    on_grid = [s for s in present if s in grid]
    missing: list[int] = []
    after = grid.start - 1
    for step in [*on_grid, grid.stop]:
        missing.extend(steps_between(grid, after, step)[: listed - len(missing)])
        after = step
    # The merge step is expected even off the grid (saves every 50 steps, a merge at step 260).
    off_grid = int(merge_step not in grid)
    if off_grid and len(missing) < listed:
        missing.append(merge_step)
    # len(grid) fails past 2**63 steps; the arithmetic does not.
    expected = (grid.stop - grid.start + stride - 1) // stride + off_grid
    return WindowGaps(stride, every is None, expected - len(on_grid), tuple(missing))
