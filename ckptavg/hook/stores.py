"""What the training hook does with a captured step, and where the bytes go.

Two stores behind one interface, both built on rank files (``formats/parts.py``) and both
publishing through the same writer, layout and manifest as ``ckptavg merge``:

* :class:`AccumulateStore` keeps a running sum per window in CPU memory and writes it out only
  when asked for the hook's state (a trainer checkpoint) and at the merge step;
* :class:`SnapshotStore` writes every captured step to ``stepN-snapshot/``, where ``ckptavg
  merge`` finds it too.

The hook decides when and for which windows; a store never looks at the schedule.
"""

from __future__ import annotations

import contextlib
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch

from ..errors import CheckpointError, CkptavgError, ConfigError, OutputError
from ..formats.layout import TensorSpec
from ..formats.parts import (
    Block,
    BlockReader,
    PartsReader,
    block_info,
    missing_ranks,
    remove_rank_files,
    verify_rank_file,
    wait_for_rank_files,
    write_rank_file,
)
from ..io.atomic import atomic_write, discard_file
from ..io.fs import FileSystem, display, join
from ..manifest import has_manifest
from ..merging.api import average
from ..merging.job import average_readers
from ..merging.options import MergeOptions, PublishExtras
from ..merging.retention import remove_snapshot, verify_before_removal
from ..weighting import Weighting
from .capture import Capture, ModelLayout
from .workers import INLINE_ELEMENTS, inline_add, inline_copy, inline_divide, inline_equal, inline_start

log = logging.getLogger("ckptavg")

STATE_FOLDER = ".ckptavg-state"
# Merges published from the hook's background thread stream in chunks of this many bytes,
# so that each torch op stays within INLINE_ELEMENTS (see workers.py).
PUBLISH_CHUNK_BYTES = INLINE_ELEMENTS * 4


def _log_notice(text: str) -> None:
    """Advice a merge gives its user (e.g. a hidden folder a killed merge left): the CLI prints it,
    a training run logs it."""
    log.warning("ckptavg: %s", text)


_STEP_FOLDER = re.compile(r"^step(\d+)(-snapshot|-block)?$")


@dataclass(frozen=True)
class PublishOptions:
    """How the hook writes: its merges, and the files it keeps between them."""

    merge: MergeOptions
    """The merges' options: the hook's dtype, shard size and fsync; always ``force`` with
    ``keep_identical`` (a resumed run redoes a merge it lost, and replaces an output of the lost
    timeline only where the bytes differ), in chunks of :data:`PUBLISH_CHUNK_BYTES`. ``fsync``
    also covers the snapshots and saved sums."""
    extra_files: Mapping[str, bytes] = field(default_factory=dict)
    """Written into every output and snapshot (e.g. ``config.json``)."""
    rank_timeout_s: float = 3600.0
    """How long process 0 waits for the other processes' files at a merge."""

    @classmethod
    def of(
        cls,
        dtype: torch.dtype | None,
        shard_size: int,
        fsync: bool,
        extra_files: Mapping[str, bytes],
        rank_timeout_s: float,
        copy: tuple[str, ...] = (),
        copy_from: str = "newest",
        output_format: str = "safetensors",
    ) -> PublishOptions:
        merge = MergeOptions(
            dtype=dtype,
            shard_size=shard_size,
            chunk_bytes=PUBLISH_CHUNK_BYTES,
            force=True,
            keep_identical=True,
            fsync=fsync,
            copy=copy,
            copy_from=copy_from,
            output_format=output_format,
        )
        return cls(merge, dict(extra_files), rank_timeout_s)


class WindowStore(ABC):
    """Storage side of the hook. ``add``, ``finished`` and ``save_state`` run on the capture
    worker, ``publish`` on the publish worker; the rest runs in the training thread while
    neither worker has work in flight."""

    def __init__(self, fs: FileSystem, folder: str, options: PublishOptions, weightings: Sequence[Weighting]) -> None:
        self.fs = fs
        self.folder = folder
        self.options = options
        self.weightings = tuple(weightings)  # one output per merge step each; their tags differ

    def suffix(self, weighting: Weighting) -> str:
        """What tells the outputs (and saved sums) of ``weighting`` from the other weightings':
        nothing when there is one, so that its output stays ``step{S}-merged``."""
        return "" if len(self.weightings) == 1 else f"-{weighting.tag()}"

    def merged_path(self, merge_step: int, weighting: Weighting) -> str:
        return join(self.fs, self.folder, f"step{merge_step}-merged{self.suffix(weighting)}")

    def merged_paths(self, merge_step: int) -> list[str]:
        return [self.merged_path(merge_step, w) for w in self.weightings]

    def published(self, merge_step: int) -> bool:
        """Every weighting's output of ``merge_step`` is complete."""
        return all(has_manifest(self.fs, path) for path in self.merged_paths(merge_step))

    def _subfolders(self, folder: str) -> list[tuple[str, re.Match]]:
        try:
            entries = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            return []
        named = ((str(e).rstrip("/").rsplit("/", 1)[-1], str(e).rstrip("/")) for e in entries)
        return [(path, match) for name, path in named if (match := _STEP_FOLDER.match(name))]

    def _remove_folder_if_empty(self, path: str) -> None:
        # Several processes empty the same folder; whoever empties it last removes it.
        with contextlib.suppress(OSError):
            if not self.fs.ls(path, detail=False):
                self.fs.rmdir(path)

    def _write_extra_files(self, folder: str, layout: ModelLayout) -> None:
        """Process 0: the extra files into a folder of rank files (before any rank file counts)."""
        try:
            self.fs.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create {display(self.fs, folder)}: {exc.strerror or exc}") from exc
        if layout.rank == 0:
            for name, data in self.options.extra_files.items():
                with atomic_write(self.fs, join(self.fs, folder, name), self.options.merge.fsync) as handle:
                    handle.write(data)

    def _withdraw_after(self, step: int, suffix: str, first_step: Callable[[int], int], layout: ModelLayout) -> None:
        """Withdraw this process's files (process 0: and the extra files) of the folders
        ``step{S}{suffix}`` that hold only steps after ``step`` (``first_step(S)`` the first): a
        lost timeline's, which must never be mixed into a merge."""
        for path, match in self._subfolders(self.folder):
            if match.group(2) == suffix and first_step(int(match.group(1))) > step:
                remove_rank_files(self.fs, path, layout.rank, layout.world_size)
                if layout.rank == 0:
                    for name in self.options.extra_files:
                        discard_file(self.fs, join(self.fs, path, name))
                self._remove_folder_if_empty(path)

    @abstractmethod
    def add(self, capture: Capture, layout: ModelLayout, factors: Mapping[int, Sequence[tuple[float, float]]]) -> None:
        """Include the captured step in the windows of the merge steps keyed in ``factors``, for
        each weighting as ``sum = decay * sum + weight * step`` with its ``(decay, weight)`` (one
        per weighting, in the order of :attr:`weightings`)."""

    @abstractmethod
    def finished(self, merge_step: int, steps: Sequence[int]) -> list[Any]:
        """Take what the publishes of ``merge_step`` need, one per weighting; ``steps`` are the
        window's captured steps."""

    @abstractmethod
    def publish(self, finished: Any) -> str | None:
        """Write one weighting's output of a merge step (an item of :meth:`finished`); returns its
        path on the process that wrote it."""

    @abstractmethod
    def save_state(self, step: int) -> list[dict[str, Any]]:
        """Persist what a resume from ``step`` needs; returns the open windows it covers."""

    @abstractmethod
    def restore(
        self, step: int, merge_step: int, done: list[int], saved: Mapping[str, Any] | None, layout: ModelLayout
    ) -> bool:
        """Resuming after ``step`` inside the window of ``merge_step``, whose steps ``done`` were
        captured before: bring them back (``saved`` is the window's entry of the hook state, if
        any). False when that is no longer possible; raises when data that must exist is gone."""

    def state_location(self, step: int, merge_step: int) -> str | None:
        """Where :meth:`save_state` at ``step`` keeps the window of ``merge_step``, for messages;
        None for a store that keeps no state of its own."""
        return None

    @abstractmethod
    def discard_after(self, step: int, layout: ModelLayout) -> None:
        """Withdraw whatever this process wrote for steps after ``step`` (a lost timeline)."""

    @abstractmethod
    def forget_published(self, step: int) -> None:
        """A trainer checkpoint of ``step`` exists: drop what only a resume from before a merge
        published by then could have needed."""


def _accumulator_dtype(dtype: torch.dtype, float64_accumulator: bool) -> torch.dtype:
    if not dtype.is_floating_point:
        return dtype  # integers and bools are copied, never summed
    if dtype == torch.float64 or (float64_accumulator and dtype == torch.float32):
        return torch.float64
    return torch.float32


@dataclass(eq=False)  # compared and hashed by identity: a key of the factors in AccumulateStore.add
class _Sums:
    """A window's running sum of one weighting over this process's owned blocks, and the total
    weight it holds: the average is ``sum / total``."""

    merge_step: int
    weighting: Weighting
    steps: list[int] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    total: float = 0.0


class _SumStore(WindowStore):
    """What the stores that keep running sums in CPU memory share: the sums' dtypes (fp32; fp64
    for fp64 parameters, and for fp32 ones if asked), folding a captured step in, and writing
    and reading back this process's sums as rank files (with their sha256)."""

    def __init__(
        self,
        fs: FileSystem,
        folder: str,
        options: PublishOptions,
        weightings: Sequence[Weighting],
        float64_accumulator: bool = False,
    ) -> None:
        super().__init__(fs, folder, options, weightings)
        self.float64_accumulator = float64_accumulator
        self._layout: ModelLayout | None = None
        self._scratch: dict[torch.dtype, torch.Tensor] = {}

    def _sum_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """What a window holds of tensor ``name``: a sum, or (copy rules) the value itself."""
        return dtype if self._copied(name) else _accumulator_dtype(dtype, self.float64_accumulator)

    def _copied(self, name: str) -> bool:
        return any(fnmatchcase(name, pattern) for pattern in self.options.merge.copy)

    def _fold(self, capture: Capture, factor: Mapping[_Sums, tuple[float, float]]) -> None:
        """Fold the captured step into each of ``factor``'s sums as ``sum = decay * sum + weight *
        step``; a sum that holds no step yet starts as ``weight * step``. Integer and bool tensors
        are copied (:meth:`_integer_step` says what a later step does with them)."""
        started = [w for w in factor if not w.steps]
        running = [w for w in factor if w.steps]
        capture.wait_ready()
        newest = self.options.merge.copy_from == "newest"
        for block in capture.blocks:
            value = block.data
            copied = self._copied(block.name)
            for window in started:
                window.tensors[block.name] = torch.empty(value.shape, dtype=self._sum_dtype(block.name, value.dtype))
                if value.dtype.is_floating_point and not copied:
                    inline_start(window.tensors[block.name], value, factor[window][1])
                else:
                    inline_copy(window.tensors[block.name], value)
            if not running:
                continue
            if copied:  # the window's newest value so far, or its first one kept
                for window in running if newest else ():
                    inline_copy(window.tensors[block.name], value)
            elif value.dtype.is_floating_point:
                sums = [w.tensors[block.name] for w in running]
                scales = [factor[w] for w in running]
                inline_add(sums, value, self._scratch_for(sums[0].dtype), scales)
            else:
                for window in running:
                    self._integer_step(window, block.name, value, capture.step)

    def _integer_step(self, window: _Sums, name: str, value: torch.Tensor, step: int) -> None:
        if not inline_equal(window.tensors[name], value):
            raise ConfigError(
                f"{value.dtype} tensor {name!r} changed at step {step}, inside the window of merge step "
                f"{window.merge_step}; integer tensors are copied, not averaged, so they must stay the same "
                f"within a window (copy=[{name!r}] takes it from one step instead)"
            )

    def _scratch_for(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._scratch:
            self._scratch[dtype] = torch.empty(INLINE_ELEMENTS, dtype=dtype)
        return self._scratch[dtype]

    def _table(self, layout: ModelLayout) -> list[TensorSpec]:
        return [TensorSpec(e.name, self._sum_dtype(e.name, e.dtype), e.shape) for e in layout.entries]

    def _rank_count(self, folder: str) -> int | None:
        """How many processes wrote the sums in ``folder``; None when a rank file is missing."""
        try:
            world, missing = missing_ranks(self.fs, folder)
        except CkptavgError:  # no rank files at all (or a mix): nothing to restore from
            return None
        return None if missing else world

    def _read_sums(
        self, folder: str, world: int, expected: Mapping[str, Any], layout: ModelLayout
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """This process's blocks of the sums saved in ``folder``, and what they record of
        themselves, which must say what the hook state says (``expected``)."""
        # Same sharding: this process reads back its own file only; otherwise any of them.
        for rank in [layout.rank] if world == layout.world_size else range(world):
            verify_rank_file(self.fs, folder, rank, world)
        tensors = {}
        with PartsReader(self.fs, folder) as reader:
            for key, value in expected.items():
                if reader.info.get(key) != value:
                    raise CheckpointError(
                        f"{reader.display_path} holds {key} {reader.info.get(key)}, but the hook state says {value}"
                    )
            stored = {t.name: t for t in reader.tensors()}
            for entry in layout.owned:
                wanted = self._sum_dtype(entry.name, entry.dtype)
                info = stored.get(entry.name)
                if info is None or info.dtype != wanted or info.shape != entry.shape:
                    raise CheckpointError(
                        f"{reader.display_path}: tensor {entry.name!r} was saved as "
                        f"{'nothing' if info is None else f'{info.dtype} {list(info.shape)}'}, the resumed run "
                        f"needs {wanted} {list(entry.shape)}"
                    )
                out = torch.empty(entry.local_shape, dtype=wanted)
                reader.read_block(entry.name, entry.offsets, out)
                tensors[entry.name] = out
            return tensors, reader.info


class AccumulateStore(_SumStore):
    """Running sums in CPU memory, fp32 (fp64 for fp64 parameters, and for fp32 ones if asked):
    one per weighting per open window."""

    def __init__(
        self,
        fs: FileSystem,
        folder: str,
        options: PublishOptions,
        weightings: Sequence[Weighting],
        float64_accumulator: bool = False,
    ) -> None:
        super().__init__(fs, folder, options, weightings, float64_accumulator)
        self._windows: dict[int, list[_Sums]] = {}  # merge step -> its sums, one per weighting
        self._published: list[int] = []  # by this process, not yet forgotten

    def _state_folder(self, step: int, merge_step: int, weighting: Weighting) -> str:
        return join(self.fs, self.folder, STATE_FOLDER, f"step{step}", f"merge{merge_step}{self.suffix(weighting)}")

    def state_location(self, step: int, merge_step: int) -> str | None:
        return ", ".join(display(self.fs, self._state_folder(step, merge_step, w)) for w in self.weightings)

    def add(self, capture: Capture, layout: ModelLayout, factors: Mapping[int, Sequence[tuple[float, float]]]) -> None:
        self._layout = layout
        factor = {
            window: scale
            for merge_step, scales in factors.items()
            for window, scale in zip(self._open(merge_step), scales, strict=True)
        }
        self._fold(capture, factor)
        for window, (decay, weight) in factor.items():
            window.total = decay * window.total + weight
            window.steps.append(capture.step)

    def _open(self, merge_step: int) -> list[_Sums]:
        if merge_step not in self._windows:
            self._windows[merge_step] = [_Sums(merge_step, w) for w in self.weightings]
        return self._windows[merge_step]

    def finished(self, merge_step: int, steps: Sequence[int]) -> list[_Sums]:
        windows = self._windows.pop(merge_step)
        captured = windows[0].steps  # every weighting's sums hold the same steps
        if captured != list(steps):
            missing = sorted(set(steps) - set(captured))
            raise ConfigError(
                f"the window of merge step {merge_step} lacks steps {missing}; a merge is never averaged over "
                "fewer steps than planned"
            )
        return windows

    def _write_sums(self, window: _Sums, step: int) -> None:
        layout = self._layout
        assert layout is not None
        blocks = [Block(e.name, e.offsets, window.tensors[e.name]) for e in layout.owned]
        info = {
            "kind": "running sums",
            "merge_step": window.merge_step,
            "step": step,
            "steps": window.steps,
            "total": window.total,
        }
        folder = self._state_folder(step, window.merge_step, window.weighting)
        table = self._table(layout)
        fsync = self.options.merge.fsync
        write_rank_file(self.fs, folder, layout.rank, layout.world_size, table, blocks, info, True, fsync)

    def publish(self, finished: _Sums) -> str | None:
        layout = self._layout
        assert layout is not None
        merge_step, steps = finished.merge_step, finished.steps
        self._write_sums(finished, merge_step)
        if layout.rank != 0:
            return None
        folder = self._state_folder(merge_step, merge_step, finished.weighting)
        wait_for_rank_files(self.fs, folder, self.options.rank_timeout_s)
        with PartsReader(self.fs, folder) as reader:
            if reader.info.get("steps") != steps:
                raise CheckpointError(f"{reader.display_path}: the processes summed different steps")
            weights = finished.weighting.weights(steps)
            extras = PublishExtras(
                totals=[finished.total],
                # Without a dtype of the hook's own, each parameter's.
                dtypes=None if self.options.merge.dtype else {e.name: e.dtype for e in layout.entries},
                sources=[
                    {"path": None, "step": s, "weight": w, "format": "training hook running sum"}
                    for s, w in zip(steps, weights, strict=True)
                ],
                accumulate_policy=(
                    "running sum in the training process: float32 for 8/16-bit floats, float64 for float64 "
                    f"{'and float32 ' if self.float64_accumulator else ''}parameters, each step folded in as "
                    "sum = decay * sum + weight * step; the mean (sum / total weight) rounded once from "
                    "float64; integer and bool tensors copied (they must not change in the window)"
                ),
                extra_files=self.options.extra_files,
            )
            result = average_readers(
                [reader],
                display(self.fs, self.merged_path(merge_step, finished.weighting)),
                weighting=finished.weighting,
                options=self.options.merge,
                extras=extras,
                notice=_log_notice,
            )
        if merge_step not in self._published:  # the first of its weightings
            self._published.append(merge_step)
        return result.output

    def forget_published(self, step: int) -> None:
        """Saved sums of a published window stay until a trainer checkpoint after its merge
        step exists: until then a crash resumes from before the merge, which is redone from
        them. A resume from an older checkpoint later finds them gone and keeps the merge."""
        root = join(self.fs, self.folder, STATE_FOLDER)
        for merge_step in [s for s in self._published if s <= step]:
            self._published.remove(merge_step)
            for step_folder, _ in self._subfolders(root):
                for weighting in self.weightings:
                    with contextlib.suppress(FileNotFoundError):
                        name = f"merge{merge_step}{self.suffix(weighting)}"
                        self.fs.rm(join(self.fs, step_folder, name), recursive=True)
                self._remove_folder_if_empty(step_folder)
        self._remove_folder_if_empty(root)

    def save_state(self, step: int) -> list[dict[str, Any]]:
        saved = []
        for merge_step, windows in sorted(self._windows.items()):
            if windows[0].steps:
                for window in windows:
                    self._write_sums(window, step)
                saved.append({"merge_step": merge_step, "steps": list(windows[0].steps)})
        return saved

    def restore(
        self, step: int, merge_step: int, done: list[int], saved: Mapping[str, Any] | None, layout: ModelLayout
    ) -> bool:
        """Every weighting's saved sums, or False if any of them is gone (then none is restored)."""
        if saved is None:
            return False
        folders = [self._state_folder(step, merge_step, w) for w in self.weightings]
        worlds = [self._rank_count(folder) for folder in folders]
        if None in worlds:
            return False
        windows = []
        for weighting, folder, world in zip(self.weightings, folders, worlds, strict=True):
            assert world is not None
            tensors, info = self._read_sums(folder, world, {"steps": done}, layout)
            total = info.get("total", len(done))  # sums saved before weightings: the step count
            if not isinstance(total, (int, float)) or not total > 0:
                raise CheckpointError(f"{display(self.fs, folder)}: total weight {total!r} is not a positive number")
            windows.append(_Sums(merge_step, weighting, list(done), tensors, float(total)))
        self._layout = layout
        self._windows[merge_step] = windows
        return True

    def discard_after(self, step: int, layout: ModelLayout) -> None:
        """Nothing to do: sums saved for later steps are never read (a hook state names its
        step), and they go when their window is published."""


class BlockStore(AccumulateStore):
    """The means of consecutive blocks of ``block`` steps (``mode="blocks"``): a running sum per
    block, kept, saved and restored as accumulate mode keeps a window's; at the block's last step
    each process divides its sums by the count and writes them as its rank file of
    ``step{S}-block/``, whose record (:func:`~ckptavg.formats.parts.block_info`: the steps, their
    count, the trained dtypes) a merge checks before it builds a window from blocks. No merge is
    published: ``ckptavg merge`` builds windows of whole blocks."""

    def __init__(
        self,
        fs: FileSystem,
        folder: str,
        options: PublishOptions,
        block: int,
        every: int,
        float64_accumulator: bool = False,
    ) -> None:
        super().__init__(fs, folder, options, (Weighting(),), float64_accumulator)
        self.block = block
        self.every = every

    def merged_path(self, merge_step: int, weighting: Weighting | None = None) -> str:
        return join(self.fs, self.folder, f"step{merge_step}-block")

    def published(self, merge_step: int) -> bool:
        return BlockReader.incomplete_reason(self.fs, self.merged_path(merge_step)) is None

    def publish(self, finished: _Sums) -> str | None:
        layout = self._layout
        assert layout is not None
        step = finished.merge_step
        for entry in layout.owned:
            if entry.dtype.is_floating_point:  # each element rounded once, from the sum
                inline_divide(finished.tensors[entry.name], finished.total)
        folder = self.merged_path(step)
        self._write_extra_files(folder, layout)
        info = block_info(step, self.block, self.every, len(finished.steps), {e.name: e.dtype for e in layout.entries})
        blocks = [Block(e.name, e.offsets, finished.tensors[e.name]) for e in layout.owned]
        fsync = self.options.merge.fsync
        write_rank_file(self.fs, folder, layout.rank, layout.world_size, self._table(layout), blocks, info, True, fsync)
        if layout.rank == 0:
            self._published.append(step)  # its saved sums go at a checkpoint after it (forget_published)
            log.info(
                "ckptavg: the mean of steps %d-%d written to %s", finished.steps[0], step, display(self.fs, folder)
            )
        return None

    def discard_after(self, step: int, layout: ModelLayout) -> None:
        """Blocks wholly after ``step`` are a lost timeline's; the block holding ``step`` is
        written again from its saved sums, or kept (as a written merge is) when they are gone."""
        self._withdraw_after(step, "-block", lambda end: end - self.block + 1, layout)


EMA_WINDOW = 0
"""The key of the EMA's one running average in the factors the hook hands :meth:`EmaStore.add`."""


@dataclass(frozen=True)
class _EmaExport:
    """The EMA as of an export step, copied for the publish worker while the next steps fold in."""

    merge_step: int
    tensors: dict[str, torch.Tensor]
    info: dict[str, Any]


class EmaStore(_SumStore):
    """One EMA of the weights for the whole run (``mode="ema"``), in CPU memory, never reset: it
    starts as the first captured step's weights, and every later captured step folds in as
    ``ema = decay * ema + weight * step`` with the hook's factors, in the accumulator dtype
    (float32; float64 for float64 parameters, and for float32 ones with ``float64_accumulator``).
    Integer tensors take the newest step's values.

    At each merge step a copy of it is written as rank files to ``.ckptavg-state/step{S}/ema-<tag>/``
    and published from them as ``step{S}-merged-<tag>`` through the merge writer; each trainer
    checkpoint saves it to its step's folder alike (sha256 checked on resume). Those of trainer
    checkpoints stay (a resume from any of them needs its own); those of merge steps without a
    checkpoint go at the next checkpoint."""

    def __init__(
        self,
        fs: FileSystem,
        folder: str,
        options: PublishOptions,
        tag: str,
        description: Mapping[str, Any],
        float64_accumulator: bool = False,
    ) -> None:
        super().__init__(fs, folder, options, (Weighting(),), float64_accumulator)
        self.tag = tag
        self.description = dict(description)
        self._ema = _Sums(EMA_WINDOW, Weighting())  # steps: the last one folded in
        self._first_step: int | None = None
        self._count = 0
        self._export_step: int | None = None  # the newest export: its folder is that step's state
        self._exports: list[int] = []  # on process 0: published, not (yet) a checkpoint's state

    def merged_path(self, merge_step: int, weighting: Weighting | None = None) -> str:
        return join(self.fs, self.folder, f"step{merge_step}-merged-{self.tag}")

    def _ema_folder(self, step: int) -> str:
        return join(self.fs, self.folder, STATE_FOLDER, f"step{step}", f"ema-{self.tag}")

    def state_location(self, step: int, merge_step: int = EMA_WINDOW) -> str:
        return display(self.fs, self._ema_folder(step))

    def record(self) -> dict[str, Any] | None:
        """What the hook state keeps of the EMA: its first and last step and how many steps it
        holds; None before its first step."""
        if self._first_step is None:
            return None
        return {"first_step": self._first_step, "last_step": self._ema.steps[-1], "count": self._count}

    def _info(self, step: int) -> dict[str, Any]:
        record = self.record()
        assert record is not None
        return {"kind": "ema", "step": step, **record}

    def add(self, capture: Capture, layout: ModelLayout, factors: Mapping[int, Sequence[tuple[float, float]]]) -> None:
        self._layout = layout
        (scale,) = factors[EMA_WINDOW]
        self._fold(capture, {self._ema: scale})
        self._ema.steps = [capture.step]  # not every step: the list would grow with the run
        if self._first_step is None:
            self._first_step = capture.step
        self._count += 1

    def _integer_step(self, window: _Sums, name: str, value: torch.Tensor, step: int) -> None:
        inline_copy(window.tensors[name], value)  # a whole run's counters change: the newest

    def finished(self, merge_step: int, steps: Sequence[int]) -> list[_EmaExport]:
        frozen = {}
        for name, tensor in self._ema.tensors.items():
            frozen[name] = torch.empty_like(tensor)
            inline_copy(frozen[name], tensor)
        self._export_step = merge_step
        return [_EmaExport(merge_step, frozen, self._info(merge_step))]

    def _write(self, folder: str, tensors: Mapping[str, torch.Tensor], info: Mapping[str, Any]) -> None:
        layout = self._layout
        assert layout is not None
        blocks = [Block(e.name, e.offsets, tensors[e.name]) for e in layout.owned]
        fsync = self.options.merge.fsync
        write_rank_file(self.fs, folder, layout.rank, layout.world_size, self._table(layout), blocks, info, True, fsync)

    def publish(self, finished: _EmaExport) -> str | None:
        layout = self._layout
        assert layout is not None
        step = finished.merge_step
        folder = self._ema_folder(step)
        self._write(folder, finished.tensors, finished.info)
        if layout.rank != 0:
            return None
        wait_for_rank_files(self.fs, folder, self.options.rank_timeout_s)
        with PartsReader(self.fs, folder) as reader:  # each process's record is checked to be rank 0's
            info = finished.info
            extras = PublishExtras(
                totals=[1.0],  # the EMA is the average itself: rounded once to the output dtype
                dtypes=None if self.options.merge.dtype else {e.name: e.dtype for e in layout.entries},
                sources=[
                    {
                        "path": None,
                        "step": step,
                        "weight": 1.0,
                        "format": "training hook EMA",
                        "first_step": info["first_step"],
                        "steps_averaged": info["count"],
                    }
                ],
                accumulate_policy=(
                    "running EMA in the training process: float32 for 8/16-bit floats, float64 for float64 "
                    f"{'and float32 ' if self.float64_accumulator else ''}parameters, each captured step folded in "
                    "as ema = decay * ema + (1 - decay) * step, decay computed in float64; rounded once to the "
                    "output dtype; integer and bool tensors from the newest step"
                ),
                extra_files=self.options.extra_files,
                method=self.description,
            )
            result = average_readers(
                [reader],
                display(self.fs, self.merged_path(step)),
                options=self.options.merge,
                extras=extras,
                notice=_log_notice,
            )
        self._exports.append(step)
        return result.output

    def save_state(self, step: int) -> list[dict[str, Any]]:
        """The EMA as of ``step``, into that step's folder (at an export step the export writes it)."""
        if self._first_step is not None and step != self._export_step:
            self._write(self._ema_folder(step), self._ema.tensors, self._info(step))
        return []

    def saved(self, step: int) -> bool:
        """Whether an EMA was saved as of ``step`` (whole or not)."""
        return PartsReader.detect(self.fs, self._ema_folder(step))

    def restore(
        self, step: int, merge_step: int, done: list[int], saved: Mapping[str, Any] | None, layout: ModelLayout
    ) -> bool:
        """The EMA saved as of ``step``, which the hook state's record of it (``saved``) describes;
        False when its files are gone or incomplete."""
        assert saved is not None
        folder = self._ema_folder(step)
        world = self._rank_count(folder)
        if world is None:
            return False
        tensors, _ = self._read_sums(folder, world, {"kind": "ema", "step": step, **saved}, layout)
        self._ema = _Sums(EMA_WINDOW, Weighting(), [int(saved["last_step"])], tensors)
        self._first_step, self._count = int(saved["first_step"]), int(saved["count"])
        self._layout = layout
        return True

    def forget_published(self, step: int) -> None:
        """A trainer checkpoint of ``step`` exists: the export of ``step`` is now its state; those
        of earlier merge steps are no checkpoint's state, and go."""
        for exported in [s for s in self._exports if s <= step]:
            self._exports.remove(exported)
            if exported < step:
                self._remove_state(exported)

    def _remove_state(self, step: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._ema_folder(step), recursive=True)
        root = join(self.fs, self.folder, STATE_FOLDER)
        self._remove_folder_if_empty(join(self.fs, root, f"step{step}"))
        self._remove_folder_if_empty(root)

    def discard_after(self, step: int, layout: ModelLayout) -> None:
        """The EMAs a lost timeline saved after ``step``: this process's files go."""
        root = join(self.fs, self.folder, STATE_FOLDER)
        for step_folder, match in self._subfolders(root):
            if int(match.group(1)) > step:
                folder = join(self.fs, step_folder, f"ema-{self.tag}")
                remove_rank_files(self.fs, folder, layout.rank, layout.world_size)
                self._remove_folder_if_empty(folder)
                self._remove_folder_if_empty(step_folder)


@dataclass(frozen=True)
class _SnapshotWindow:
    merge_step: int
    steps: list[int]
    weighting: Weighting


class SnapshotStore(WindowStore):
    """Every captured step becomes ``step{N}-snapshot/``; merges read them back like any run.

    Without ``keep_snapshots``, process 0 removes a snapshot once every merge that averages it
    is published, verified, and behind a trainer checkpoint (see :meth:`forget_published`)."""

    def __init__(
        self,
        fs: FileSystem,
        folder: str,
        options: PublishOptions,
        weightings: Sequence[Weighting],
        keep_snapshots: bool = True,
    ) -> None:
        super().__init__(fs, folder, options, weightings)
        self.keep_snapshots = keep_snapshots
        self._rank = 0
        self._staging: dict[str, torch.Tensor] = {}  # one host copy of the weights, reused
        # Without keep_snapshots, on process 0: captured step -> the merges averaging it that are
        # not yet forgotten; and the merges published and verified, not yet behind a checkpoint.
        self._readers: dict[int, set[int]] = {}
        self._verified: list[int] = []

    def _count_readers(self, rank: int, steps: Sequence[int], merge_steps: Sequence[int]) -> None:
        if not self.keep_snapshots and rank == 0:
            for step in steps:
                self._readers.setdefault(step, set()).update(merge_steps)

    def snapshot_path(self, step: int) -> str:
        return join(self.fs, self.folder, f"step{step}-snapshot")

    def add(self, capture: Capture, layout: ModelLayout, factors: Mapping[int, Sequence[tuple[float, float]]]) -> None:
        self._rank = layout.rank
        folder = self.snapshot_path(capture.step)
        self._write_extra_files(folder, layout)
        capture.wait_ready()
        # A memory copy, then the optimizer may go on while the (much slower) write runs.
        blocks = capture.detached(self._staging)
        capture.release_parameters()
        info = {"kind": "weights", "step": capture.step}
        fsync = self.options.merge.fsync
        write_rank_file(self.fs, folder, layout.rank, layout.world_size, layout.table, blocks, info, fsync=fsync)
        self._count_readers(layout.rank, [capture.step], list(factors))

    def finished(self, merge_step: int, steps: Sequence[int]) -> list[_SnapshotWindow]:
        return [_SnapshotWindow(merge_step, list(steps), w) for w in self.weightings]

    def publish(self, finished: _SnapshotWindow) -> str | None:
        if self._rank != 0:
            return None
        folders = [self.snapshot_path(step) for step in finished.steps]
        for folder in folders:
            wait_for_rank_files(self.fs, folder, self.options.rank_timeout_s)
        result = average(
            [display(self.fs, f) for f in folders],
            display(self.fs, self.merged_path(finished.merge_step, finished.weighting)),
            steps=finished.steps,
            weighting=finished.weighting,
            options=self.options.merge,
            notice=_log_notice,
        )
        if not self.keep_snapshots and finished.weighting == self.weightings[-1]:  # its merge step's last output
            self._check_before_removal(finished.merge_step)
        return result.output

    def _check_before_removal(self, merge_step: int) -> None:
        """Verify the outputs just published, one per weighting (every file's sha256 against its
        manifest, the tensors), before their snapshots may go; one that fails (or a publish that
        failed) keeps them, and training goes on."""
        try:
            for path in self.merged_paths(merge_step):
                verify_before_removal(display(self.fs, path))
        except CkptavgError as exc:
            log.warning("ckptavg: %s; keeping the snapshots of merge step %d", exc, merge_step)
            return
        self._verified.append(merge_step)

    def discard_after(self, step: int, layout: ModelLayout) -> None:
        self._withdraw_after(step, "-snapshot", lambda captured: captured, layout)

    def save_state(self, step: int) -> list[dict[str, Any]]:
        return []  # every captured step is on disk already

    def forget_published(self, step: int) -> None:
        """Without ``keep_snapshots``: a trainer checkpoint of ``step`` exists, so remove the
        snapshots whose every merge is published, verified and at most ``step``. A snapshot a
        later window shares stays until that window's merge goes the same way. As with the saved
        sums of accumulate mode, a resume from an older checkpoint inside such a window then
        finds its snapshots gone and keeps the written merge (:meth:`restore`)."""
        forgotten = {s for s in self._verified if s <= step}
        if not forgotten:
            return
        self._verified = [s for s in self._verified if s not in forgotten]
        consumed = []
        for captured, readers in sorted(self._readers.items()):
            readers -= forgotten
            if not readers:
                del self._readers[captured]
                consumed.append(captured)
        for captured in consumed:
            path = self.snapshot_path(captured)
            try:
                remove_snapshot(self.fs, path)
            except OSError as exc:  # the merge stands; a snapshot left over is only disk space
                log.warning("ckptavg: could not remove the snapshot %s: %s", display(self.fs, path), exc)
        if consumed:
            log.info(
                "ckptavg: removed the snapshots of steps %s, consumed by merge steps %s", consumed, sorted(forgotten)
            )

    def restore(
        self, step: int, merge_step: int, done: list[int], saved: Mapping[str, Any] | None, layout: ModelLayout
    ) -> bool:
        """The window's snapshots are on disk; or they were removed after its merge was published
        (False: the hook keeps that merge); or one is missing and the merge cannot be made."""
        for captured in done:
            folder = self.snapshot_path(captured)
            try:
                world, missing = missing_ranks(self.fs, folder)
            except CkptavgError:
                world, missing = 0, [0]
            if missing and self.published(merge_step):
                return False
            if missing:
                raise CheckpointError(
                    f"{display(self.fs, folder)}: the snapshot of step {captured} is missing or incomplete "
                    f"({world - len(missing)} of {world} rank files), so merge step {merge_step} cannot be complete"
                )
        self._count_readers(layout.rank, done, [merge_step])
        return True
