"""The training-side hook: merged checkpoints appear while training runs, and survive resumes.

``MergeHook`` decides *when* and *what*: which steps each merge window averages (the same pure
functions as ``ckptavg plan``), which captured step goes into which window, and what a resume
keeps, redoes or refuses. *How* bytes get off the model and onto disk is left to
:mod:`ckptavg.hook.capture` and :mod:`ckptavg.hook.stores`.

Step numbers follow OLMo-core: ``post_train_batch(step, model)`` sees the weights after ``step``
optimizer steps, and ``step{S}-merged`` averages the weights after steps ``S-window+1 .. S``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import queue
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ..errors import ConfigError
from ..formats.base import is_natural, shown_value
from ..formats.layout import DEFAULT_SHARD_SIZE
from ..formats.writers import OUTPUT_FORMATS
from ..io.fs import display, resolve
from ..merging.engine import check_output_dtype
from ..plan import compute_interval_merge_steps, sampled_steps, steps_between, validate_merge_steps, window_start
from ..units import parse_dtype
from ..weighting import Weighting, tag_number
from .capture import RELEASE_MODES, Capture, ModelLayout, WeightCapture, layout_of
from .stores import EMA_WINDOW, AccumulateStore, BlockStore, EmaStore, PublishOptions, SnapshotStore, WindowStore
from .workers import BackgroundWorker

log = logging.getLogger("ckptavg")

MODES = ("accumulate", "snapshot", "ema", "blocks")
STATE_FORMAT = "ckptavg.MergeHook"
STATE_VERSION = 1
# torchtitan's default (PR 3985, arXiv 2602.03702): a half-life of 5 % of the current step.
DEFAULT_EMA_HORIZON_FRACTION = 0.05


def ema_decay(step: int, previous: int, horizon_fraction: float | None, halflife: float | None) -> float:
    """The decay of the hook's EMA from captured step ``previous`` to captured step ``step``, in
    float64: ``2 ** (-(step - previous) / (horizon_fraction * step))``, a half-life of that
    fraction of the current step (torchtitan's ``2 ** (-1 / (fraction * t))`` when every step is
    captured), or with a fixed ``halflife`` ``2 ** (-(step - previous) / halflife)``."""
    half_life = horizon_fraction * step if horizon_fraction is not None else halflife
    assert half_life is not None
    return float(2.0 ** (-(step - previous) / half_life))


@dataclass
class MergeHookConfig:
    """What to merge and how.

    Give ``merge_steps`` (one or several), or ``merge_interval`` with ``max_steps`` (here or at
    ``pre_train``). ``window`` steps end at each merge step; every ``every``-th of them, counted
    back from the merge step, is averaged, uniformly or as ``weighting`` says (the same schemes,
    with the same meaning, as ``ckptavg merge``: e.g. ``Weighting("ema", ema_halflife=50)``).
    """

    save_folder: str
    """Where ``step{S}-merged/`` folders go (path or fsspec URL); also the hook's own files."""
    merge_steps: int | Sequence[int] | None = None
    """The merge step, or several."""
    merge_interval: int | None = None
    """Instead of ``merge_steps``: merge every this many steps (needs ``max_steps``)."""
    max_steps: int | None = None
    """The run's length in steps, for ``merge_interval`` (or give it to ``pre_train``)."""
    window: int = 100
    """Steps that end at each merge step; the merge averages them."""
    every: int = 1
    """Average every ``every``-th step of the window, counted back from the merge step."""
    weighting: Weighting | str | Sequence[Weighting | str] = "uniform"
    """A :class:`~ckptavg.Weighting`, or the name of a scheme without parameters; or several, e.g.
    ``["uniform", Weighting("ema", ema_halflife=20)]``: each merge step then gets one output per
    weighting, ``step{S}-merged-<tag>`` (:meth:`~ckptavg.Weighting.tag`: ``step{S}-merged-uniform``,
    ``step{S}-merged-ema20``), from the same captures. Memory: accumulate mode keeps one running
    sum per weighting per open window; snapshot mode merges the same snapshots once per weighting."""
    mode: str = "accumulate"
    """``accumulate`` (running sums in memory), ``snapshot`` (files per captured step), ``ema``
    (one horizon-free EMA of the whole run, exported at each merge step as
    ``step{S}-merged-<tag>``) or ``blocks`` (the mean of every ``block`` steps, as ``step{S}-block/``,
    from which ``ckptavg merge`` builds windows)."""
    ema_horizon_fraction: float | None = None
    """``ema``: the EMA's half-life as a fraction of the current step (default 0.05): each
    captured step ``t`` folds in as ``ema = d * ema + (1 - d) * weights`` with
    ``d = 2 ** (-1 / (fraction * t))`` (with ``every``: ``2 ** (-every / (fraction * t))``)."""
    ema_halflife: float | None = None
    """``ema``, instead of ``ema_horizon_fraction``: a fixed half-life in training steps."""
    block: int | None = None
    """``blocks``: steps per block; block ``k`` holds steps ``(k-1)*block+1 .. k*block``."""
    keep_snapshots: bool = True
    """Snapshot mode: False removes each snapshot once every merge that averages it is published
    and verified, at the first trainer checkpoint (``state_dict()``) after the last such merge."""
    dtype: torch.dtype | str | None = None
    """Output dtype of floating tensors (a torch dtype or ``bf16``, ``fp16``, ``fp32``,
    ``fp64``, as ``--dtype``); None keeps each parameter's."""
    float64_accumulator: bool = False
    """Sum fp32 parameters in fp64, as ``ckptavg merge`` does (twice the memory)."""
    release: str = "optimizer"
    """``copy`` for loops that change weights without ``torch.optim``'s ``step()``."""
    on_merged: Callable[[str, int], None] | None = None
    """Called with (path, merge step) of each merged output, on process 0, in the training thread."""
    extra_files: Mapping[str, bytes] = field(default_factory=dict)
    """Written into each output (e.g. ``config.json``)."""
    shard_size: int = DEFAULT_SHARD_SIZE
    """Largest output file, in bytes."""
    output_format: str = "safetensors"
    """Format of the merged outputs, as ``ckptavg merge --format``: ``safetensors``, ``dcp`` (torch
    Distributed Checkpoint, which torchtitan loads as ``initial_load_path``) or ``pt``. Blocks are
    always ckptavg's own rank files."""
    rank_timeout_s: float = 3600.0
    """How long process 0 waits for the other processes' files at a merge."""
    fsync: bool = True
    """Sync every file written to a local disk (in the hook's workers, never in training's thread)."""
    copy: Sequence[str] = ()
    """Globs over parameter and buffer names (``ckptavg merge --copy``): matching tensors are not
    averaged but taken from one captured step of the window (``copy_from``), and may change
    within it: MoE ``expert_bias`` buffers, counters, Transformer Engine ``_extra_state``."""
    copy_from: str = "newest"
    """Which step of each window ``copy`` takes: ``newest`` (the merge step) or ``oldest``."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.release not in RELEASE_MODES:
            raise ConfigError(f"release must be one of {', '.join(RELEASE_MODES)}, got {self.release!r}")
        if self.window < 1:
            raise ConfigError(f"window must be at least 1 step, got {self.window}")
        if self.every < 1:
            raise ConfigError(f"every (the stride inside a window) must be at least 1, got {self.every}")
        self._check_ema()
        self._check_blocks()
        if self.mode == "blocks":
            if self.merge_steps is not None or self.merge_interval is not None:
                raise ConfigError(
                    "mode='blocks' writes a block every `block` steps and merges nothing itself: drop merge_steps and "
                    "merge_interval (ckptavg merge SAVE_FOLDER --merge-step S --window W builds merges from the blocks)"
                )
        elif (self.merge_steps is None) == (self.merge_interval is None):
            raise ConfigError("give exactly one of merge_steps or merge_interval")
        if self.merge_interval is not None and self.merge_interval <= 0:
            raise ConfigError(f"merge interval must be positive, got {self.merge_interval}")
        if isinstance(self.dtype, str):
            self.dtype = parse_dtype(self.dtype)
        if self.dtype is not None:
            check_output_dtype(self.dtype, "dtype")
        if self.shard_size <= 0:
            raise ConfigError(f"shard size must be positive, got {self.shard_size}")
        if self.output_format not in OUTPUT_FORMATS:
            raise ConfigError(
                f"output_format must be one of {', '.join(OUTPUT_FORMATS)}, got {shown_value(self.output_format)}"
            )
        if self.mode == "blocks" and self.output_format != "safetensors":
            raise ConfigError(
                f"output_format={self.output_format!r} is for merges; mode='blocks' writes ckptavg's own block files "
                "(ckptavg merge --format builds merges from them in any format)"
            )
        if not self.keep_snapshots and self.mode != "snapshot":
            raise ConfigError(f"keep_snapshots=False needs mode='snapshot'; mode {self.mode!r} writes no snapshots")
        if not self.keep_snapshots and not self.fsync:
            raise ConfigError("keep_snapshots=False needs fsync=True: a snapshot goes only once its merge is on disk")
        self.weighting = _weightings(self.weighting)
        for weighting in self.weightings:
            if weighting.explicit is not None and min(weighting.explicit) < 0:
                raise ConfigError(
                    f"weighting {weighting.describe()} has negative weights; the hook's running sums are kept in "
                    "fp32 and cannot hold such cancellation: merge the snapshots offline with ckptavg merge "
                    "--allow-negative-weights"
                )
        if isinstance(self.copy, str) or not all(isinstance(p, str) and p for p in self.copy):
            raise ConfigError(f"copy must be a list of globs ('*.expert_bias', ...), got {shown_value(self.copy)}")
        self.copy = tuple(self.copy)
        if self.copy_from not in ("newest", "oldest"):
            raise ConfigError(
                f"copy_from must be 'newest' or 'oldest' (each window's own steps), got {shown_value(self.copy_from)}"
            )
        if self.mode in ("ema", "blocks") and self.weightings != (Weighting(),):
            raise ConfigError(
                f"mode={self.mode!r} takes no weighting (got {self.describe_weighting()}): the EMA decays as "
                "ema_horizon_fraction or ema_halflife say; blocks are plain means, weighted when a merge "
                "builds a window of them (ckptavg merge --weighting)"
            )

    def _check_ema(self) -> None:
        given = {"ema_horizon_fraction": self.ema_horizon_fraction, "ema_halflife": self.ema_halflife}
        if self.mode != "ema":
            for name, value in given.items():
                if value is not None:
                    raise ConfigError(f"{name} is for mode='ema', not mode={self.mode!r}")
            return
        if self.ema_horizon_fraction is not None and self.ema_halflife is not None:
            raise ConfigError("give one of ema_horizon_fraction or ema_halflife, not both")
        if self.ema_halflife is None and self.ema_horizon_fraction is None:
            self.ema_horizon_fraction = DEFAULT_EMA_HORIZON_FRACTION
        for name, value in given.items():
            if value is not None and not (
                isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf
            ):
                raise ConfigError(f"{name} must be a positive finite number, got {shown_value(value)}")

    def _check_blocks(self) -> None:
        if self.mode != "blocks":
            if self.block is not None:
                raise ConfigError(f"block is for mode='blocks', not mode={self.mode!r}")
            return
        if not is_natural(self.block) or self.block < 1:
            raise ConfigError(
                f"mode='blocks' needs block, the steps per block (at least 1), got {shown_value(self.block)}"
            )
        if self.block % self.every:
            raise ConfigError(
                f"every={self.every} must divide block={self.block}: each block averages every "
                f"{self.every}-th of its steps"
            )

    @property
    def ema_tag(self) -> str:
        """What names the EMA's exports, ``step{S}-merged-<tag>``: ``ema-horizon0.05``, ``ema-halflife50``."""
        if self.ema_halflife is not None:
            return f"ema-halflife{tag_number(self.ema_halflife)}"
        assert self.ema_horizon_fraction is not None
        return f"ema-horizon{tag_number(self.ema_horizon_fraction)}"

    def describe_ema(self) -> dict[str, Any]:
        """The EMA, for the manifest of its exports and the hook state."""
        if self.ema_halflife is not None:
            return {
                "scheme": "running-ema",
                "ema_halflife_steps": float(self.ema_halflife),
                "decay": "2 ** (-(t - s) / halflife) from captured step s to captured step t",
            }
        return {
            "scheme": "running-ema",
            "ema_horizon_fraction": float(cast(float, self.ema_horizon_fraction)),
            "decay": "2 ** (-(t - s) / (fraction * t)) from captured step s to captured step t",
        }

    @property
    def weightings(self) -> tuple[Weighting, ...]:
        """The weightings, each one output per merge step."""
        if isinstance(self.weighting, Weighting):
            return (self.weighting,)
        return cast(tuple[Weighting, ...], self.weighting)  # converted in __post_init__

    def describe_weighting(self) -> dict[str, Any] | list[dict[str, Any]]:
        """For the hook state: one weighting as before several were possible, several as a list
        (in ema mode, the EMA)."""
        if self.mode == "ema":
            return self.describe_ema()
        described = [w.describe() for w in self.weightings]
        return described[0] if len(described) == 1 else described

    @property
    def output_dtype(self) -> torch.dtype | None:
        assert not isinstance(self.dtype, str)  # converted in __post_init__
        return self.dtype

    def merge_step_list(self, max_steps: int | None) -> list[int]:
        if self.mode == "blocks":
            return []
        if self.merge_interval is not None:
            if max_steps is None:
                raise ConfigError("merge_interval needs max_steps (in the config or at pre_train)")
            steps = compute_interval_merge_steps(self.merge_interval, max_steps)
        else:
            assert self.merge_steps is not None
            steps = [self.merge_steps] if isinstance(self.merge_steps, int) else sorted(self.merge_steps)
        if self.mode != "ema":
            validate_merge_steps(steps, self.window)
            return steps
        validate_merge_steps(steps, 1)  # the EMA has no window
        for step in steps:
            if step % self.every:
                raise ConfigError(
                    f"merge step {step} is no multiple of every={self.every}: the EMA is updated (and exported) at "
                    "those steps only"
                )
        return steps


def _weightings(given: Weighting | str | Sequence[Weighting | str]) -> Weighting | tuple[Weighting, ...]:
    """One weighting as itself (a list of one included: its output keeps the name
    ``step{S}-merged``); several as a tuple whose tags differ, since the tags name the outputs."""
    listed = [given] if isinstance(given, (str, Weighting)) else list(given)
    if not listed:
        raise ConfigError("weighting needs at least one scheme, got an empty list")
    weightings = tuple(w if isinstance(w, Weighting) else Weighting.parse(w) for w in listed)
    tags = [w.tag() for w in weightings]
    for tag in tags:
        if tags.count(tag) > 1:
            raise ConfigError(
                f"two weightings have the tag {tag!r}, which names their outputs (step{{S}}-merged-{tag}); "
                "each output needs a tag of its own (one explicit weighting per hook)"
            )
    return weightings[0] if len(weightings) == 1 else weightings


def _check_resume_fields(state: Mapping[str, Any]) -> None:
    """The fields a resume reads, of the types it reads them as (a state read back from a file,
    as the transformers adapter's JSON, may hold anything): the step, and each open window's
    merge step and captured steps."""
    windows = state.get("windows", [])
    if not (
        is_natural(state.get("step"))
        and isinstance(windows, list)
        and all(
            isinstance(w, Mapping)
            and is_natural(w.get("merge_step"))
            and isinstance(w.get("steps"), list)
            and all(map(is_natural, w["steps"]))
            for w in windows
        )
    ):
        raise ConfigError(
            f"not a MergeHook state: step {shown_value(state.get('step'))}, windows {shown_value(windows)} are not "
            "what state_dict() writes (a step, and a list of objects with a merge_step and its steps)"
        )
    ema = state.get("ema")
    if ema is not None and not (
        isinstance(ema, Mapping)
        and all(is_natural(ema.get(key)) for key in ("first_step", "last_step", "count"))
        and ema["first_step"] <= ema["last_step"] <= state["step"]
        and ema["count"] >= 1
    ):
        raise ConfigError(
            f"not a MergeHook state: its EMA {shown_value(ema)} is not what state_dict() writes (an object with "
            "first_step <= last_step <= step, and a count of at least 1)"
        )


class MergeHook:
    """Call it from a training loop; see docs/hook.md for the plain loop and the adapters.

    * ``pre_train(step, max_steps)`` once, before the first batch (``step``: steps already done);
    * ``post_train_batch(step, model)`` after every optimizer step;
    * ``state_dict()`` with every trainer checkpoint, ``load_state_dict(sd)`` when resuming;
    * ``close()`` at the end: waits for the last merge and re-raises any background failure.

    A failure in the background (disk full, permission denied) is raised at the next call,
    and every call after it raises it again.

    Args:
        config: what to merge and how (:class:`MergeHookConfig`).

    Example::

        with MergeHook(MergeHookConfig(save_folder="runs/llama", merge_steps=[5000], window=100)) as hook:
            hook.pre_train(step=0, max_steps=10_000)
            for step in range(1, 10_001):
                train_step(model, optimizer)
                hook.post_train_batch(step, model)  # step5000-merged/ appears while training goes on
    """

    def __init__(self, config: MergeHookConfig) -> None:
        self.config = config
        self.fs, self.folder = resolve(config.save_folder)
        options = PublishOptions.of(
            config.output_dtype,
            config.shard_size,
            config.fsync,
            config.extra_files,
            config.rank_timeout_s,
            tuple(config.copy),
            config.copy_from,
            config.output_format,
        )
        self.store = _store(config, self.fs, self.folder, options)
        self._capture = WeightCapture(config.release)
        # No torch.set_num_threads here: it is process-wide, and would take training's threads.
        self._captures = BackgroundWorker("ckptavg-capture", max_pending=2)
        self._publishes = BackgroundWorker("ckptavg-publish", max_pending=2)
        self._merged: queue.Queue[tuple[str, int]] = queue.Queue()
        self._merge_steps: list[int] | None = None
        # merge step -> its sampled steps, for the merges still to do (blocks: those begun so far)
        self._windows: dict[int, range] = {}
        self._exports: list[int] = []  # ema: the merge steps still to export at
        self._ema_last: int | None = None  # ema: the last captured step (None: the EMA starts at the next)
        self._first_block = 0  # blocks: the end of the first block this process may write
        self._resume_step: int | None = None
        self._loaded: dict[str, Any] | None = None
        self._last_step: int | None = None
        self._closed = False

    # -- the schedule ------------------------------------------------------------------------

    def _schedule(self, max_steps: int | None) -> None:
        self._merge_steps = self.config.merge_step_list(max_steps if max_steps is not None else self.config.max_steps)
        if self.config.mode == "ema":
            self._exports = list(self._merge_steps)
            return
        self._windows = {s: sampled_steps(s, self.config.window, self.config.every) for s in self._merge_steps}
        for weighting in self.config.weightings:
            if weighting.explicit is not None:  # they must fit every window: say so now, not at its end
                for steps in self._windows.values():
                    weighting.explicit_for(len(steps), steps)

    def _merges_using(self, step: int) -> list[int]:
        if self.config.mode == "ema":
            return [EMA_WINDOW] if step % self.config.every == 0 else []
        if self.config.mode == "blocks":
            self._open_block(step)
        return [s for s, steps in self._windows.items() if step in steps]

    def _open_block(self, step: int) -> None:
        """Blocks mode: the window of the block holding ``step``, if this process writes it."""
        size = cast(int, self.config.block)
        end = -(-step // size) * size  # the block's last step
        if end >= max(self._first_block, size):
            self._windows.setdefault(end, sampled_steps(end, size, self.config.every))

    def _ending(self, step: int, merges: list[int]) -> list[tuple[int, list[int]]]:
        """The merges (ema: exports) that end at ``step``, each with its steps."""
        if self.config.mode == "ema":
            return [(step, [])] if step in self._exports else []
        return [(s, list(self._windows[s])) for s in merges if s == step]

    @property
    def merge_steps(self) -> list[int]:
        """The merge steps of the run (known after ``pre_train``)."""
        return list(self._merge_steps or [])

    # -- hooks -------------------------------------------------------------------------------

    def pre_train(self, step: int = 0, max_steps: int | None = None) -> None:
        """Before the first batch: ``step`` optimizer steps are already done (0, or the resumed
        checkpoint's step); ``max_steps`` is the run length (needed with ``merge_interval``)."""
        self._check_open()
        if self._last_step is not None:
            raise ConfigError("pre_train must come before the first post_train_batch")
        if step < 0:
            raise ConfigError(f"pre_train step must not be negative, got {step}")
        self._schedule(max_steps)
        self._resume_step = step

    def post_train_batch(self, step: int, model: torch.nn.Module | Mapping[str, torch.Tensor]) -> None:
        """After the optimizer step that produced the weights of ``step``: capture them if a
        merge window samples this step; start the merge if it is a merge step."""
        self._check()
        self._deliver_merged()
        if self._last_step is None:
            self._start(step, model)
        elif step <= self._last_step:
            raise ConfigError(f"post_train_batch got step {step} after step {self._last_step}; steps must increase")
        else:
            self._check_not_skipped(self._last_step, step)
        self._last_step = step
        merges = self._merges_using(step)
        if not merges:
            return
        factors = {s: self._running(s, step) for s in merges}
        capture = self._capture.take(step, model)
        layout = self._capture.layout
        assert layout is not None
        ending = self._ending(step, merges)
        try:
            self._captures.submit(lambda: self._process(capture, layout, factors, ending))
        except BaseException:
            capture.release()
            raise
        for merge_step, _ in ending:
            if self.config.mode == "ema":
                self._exports.remove(merge_step)
            else:
                del self._windows[merge_step]

    def _running(self, merge_step: int, step: int) -> list[tuple[float, float]]:
        """Each weighting's ``(decay, weight)`` for folding ``step`` into the window of ``merge_step``
        (ema: the EMA's, and the EMA now holds ``step``)."""
        if self.config.mode == "ema":
            previous, self._ema_last = self._ema_last, step
            if previous is None:
                return [(1.0, 1.0)]  # the EMA starts as the weights of its first step
            decay = ema_decay(step, previous, self.config.ema_horizon_fraction, self.config.ema_halflife)
            return [(decay, 1.0 - decay)]
        steps = self._windows[merge_step]
        return [w.running(steps, steps.index(step)) for w in self.config.weightings]

    def _process(
        self,
        capture: Capture,
        layout: ModelLayout,
        factors: dict[int, list[tuple[float, float]]],
        ending: list[tuple[int, list[int]]],
    ) -> None:
        """Capture worker: add the step to its windows, then hand finished windows on."""
        try:
            self.store.add(capture, layout, factors)
        finally:
            capture.release()
        for merge_step, steps in ending:
            for finished in self.store.finished(merge_step, steps):  # one per weighting
                self._publishes.submit(functools.partial(self._publish, finished, merge_step))

    def _publish(self, finished: Any, merge_step: int) -> None:
        path = self.store.publish(finished)
        if path is not None:
            log.info("ckptavg: merge of step %d written to %s", merge_step, path)
            self._merged.put((path, merge_step))

    def state_dict(self) -> dict[str, Any]:
        """The hook's state as of the last step, to store with the trainer's checkpoint.

        Waits for the step's capture and every merge up to it; in accumulate mode each process
        also writes its running sums of the open windows (once per checkpoint, not per step)
        under ``save_folder/.ckptavg-state/``. The returned dict is small and JSON-serialisable.
        """
        self._check()
        if self._last_step is None and self._loaded is not None:
            return dict(self._loaded)  # resumed, not stepped yet: the loaded state is still the state
        step = self._last_step if self._last_step is not None else self._resume_step or 0
        saved = self._captures.submit(lambda: self.store.save_state(step))
        self._captures.drain()
        self._publishes.drain()
        self.store.forget_published(step)
        self._deliver_merged()
        state = {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "mode": self.config.mode,
            "weighting": self.config.describe_weighting(),
            "copy": self._copy_rules(),
            "step": step,
            "windows": saved.result(),
        }
        if isinstance(self.store, EmaStore):
            state["ema"] = self.store.record()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a trainer checkpoint: ``state`` is what ``state_dict()`` returned then."""
        self._check_open()
        if self._last_step is not None:
            raise ConfigError("load_state_dict must come before the first post_train_batch")
        if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"not a MergeHook state (format {state.get('format')!r}, version {state.get('version')!r})"
            )
        if state.get("mode") != self.config.mode:
            raise ConfigError(f"the hook state is from mode {state.get('mode')!r}, this hook runs {self.config.mode!r}")
        _check_resume_fields(state)
        # Running sums folded with one set of weightings cannot be continued with another (in
        # another order they can: each weighting's sums are found by its tag).
        saved_weighting = state.get("weighting", {"scheme": "uniform"})
        if (state.get("windows") or state.get("ema")) and _unordered(saved_weighting) != _unordered(
            self.config.describe_weighting()
        ):
            raise ConfigError(
                f"the hook state's open windows are weighted {saved_weighting}, this hook weighs "
                f"{self.config.describe_weighting()}"
            )
        # A tensor of the copy rules is held as a value, the others as sums: saved ones cannot be
        # continued under other rules.
        saved_copy = state.get("copy", {"patterns": [], "from": "newest"})
        if state.get("windows") and saved_copy != self._copy_rules():
            raise ConfigError(
                f"the hook state's open windows copy {saved_copy}, this hook copies {self._copy_rules()}: "
                "a tensor it sums would be read as a copied value, or the other way round"
            )
        self._loaded = dict(state)

    def _copy_rules(self) -> dict[str, Any]:
        return {"patterns": list(self.config.copy), "from": self.config.copy_from}

    def close(self) -> None:
        """Wait for the last captures and merges; re-raise a background failure."""
        if not self._closed:
            self._closed = True
            try:
                self._captures.close()
                self._publishes.close()
                self._deliver_merged()
            finally:
                self._capture.close()
        self._check_background()

    def __enter__(self) -> MergeHook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- resume ------------------------------------------------------------------------------

    def _start(self, step: int, model: Any) -> None:
        """First batch of this process: line the schedule up with where training resumed."""
        loaded = self._loaded
        resume = self._resume_step
        if resume is None:
            resume = int(loaded["step"]) if loaded is not None else step - 1
        if self._merge_steps is None:
            self._schedule(None)
        if loaded is not None and int(loaded["step"]) != resume:
            raise ConfigError(
                f"the hook state is from step {loaded['step']} but training resumes after step {resume}; "
                "store hook.state_dict() with every trainer checkpoint"
            )
        if step <= resume:
            raise ConfigError(f"post_train_batch got step {step}, but training resumed after step {resume}")
        layout = layout_of(model)
        saved = {int(w["merge_step"]): w for w in (loaded or {}).get("windows", [])}
        self.store.discard_after(resume, layout)
        if isinstance(self.store, EmaStore):
            self._resume_ema(self.store, resume, loaded, layout)
        if self.config.mode == "blocks":
            self._open_block(resume + 1)  # the block that training resumes in
        for merge_step, steps in list(self._windows.items()):
            done = list(steps_between(steps, steps.start - 1, resume + 1))
            if merge_step <= resume:
                del self._windows[merge_step]
                if layout.rank == 0 and not self.store.published(merge_step):
                    log.warning(
                        "ckptavg: merge step %d lies before the resume step %d and was never written",
                        merge_step,
                        resume,
                    )
            elif done:
                self._resume_window(merge_step, done, resume, saved.get(merge_step), layout)
        self._check_not_skipped(resume, step)

    def _resume_ema(self, store: EmaStore, resume: int, loaded: Mapping[str, Any] | None, layout: ModelLayout) -> None:
        """Bring the EMA back as of the resume step, or start it at this run's first captured step
        where no run had one; refuse to restart one a run had."""
        for merge_step in [s for s in self._exports if s <= resume]:
            self._exports.remove(merge_step)
            if layout.rank == 0 and not store.published(merge_step):
                log.warning(
                    "ckptavg: merge step %d lies before the resume step %d and was never written", merge_step, resume
                )
        record = (loaded or {}).get("ema")
        if record is not None:
            if not store.restore(resume, EMA_WINDOW, [], record, layout):
                raise ConfigError(
                    f"training resumes after step {resume} with the EMA of steps {record['first_step']}-"
                    f"{record['last_step']}, but its saved state is missing from {store.state_location(resume)}; "
                    "it cannot go on without it"
                )
            self._ema_last = int(record["last_step"])
            return
        if loaded is None and resume > 0:
            exported = [s for s in self.merge_steps if s <= resume and store.published(s)]
            if store.saved(resume) or exported:
                where = store.state_location(resume) if store.saved(resume) else f"exported at step {exported[-1]}"
                raise ConfigError(
                    f"training resumes after step {resume} without a hook state, but this run had an EMA ({where}); "
                    "pass the hook.state_dict() saved with that checkpoint to load_state_dict() (a new EMA would "
                    f"start at step {resume + 1})"
                )
        log.info("ckptavg: the EMA starts at the first captured step after step %d", resume)

    def _resume_window(
        self, merge_step: int, done: list[int], resume: int, saved: Mapping[str, Any] | None, layout: ModelLayout
    ) -> None:
        """A window that was open at the resume step: bring its first steps back, or keep the
        merge the lost timeline already wrote, or refuse."""
        if saved is not None and [int(s) for s in saved["steps"]] != done:
            raise ConfigError(
                f"the hook state holds steps {saved['steps']} of merge step {merge_step}, but steps {done} were due"
            )
        if self.store.restore(resume, merge_step, done, saved, layout):
            return
        if self.store.published(merge_step):
            # Saved sums go once a checkpoint after the merge exists; a run resumed from an
            # older checkpoint inside the window keeps the written merge (it cannot redo it).
            log.warning(
                "ckptavg: resumed after step %d inside the window of merge step %d, which is already written "
                "(%s); keeping it",
                resume,
                merge_step,
                ", ".join(display(self.fs, path) for path in self.store.merged_paths(merge_step)),
            )
            del self._windows[merge_step]
            return
        if self.config.mode == "blocks" and self._loaded is None:
            # A hook begun inside a block (none ran before it): its first block is the next one.
            log.warning(
                "ckptavg: the hook starts after step %d, inside the block of steps %d-%d: that block is not written",
                resume,
                merge_step - cast(int, self.config.block) + 1,
                merge_step,
            )
            del self._windows[merge_step]
            self._first_block = merge_step + cast(int, self.config.block)
            return
        where = "no hook state covers it"
        if saved is not None:
            where = f"its saved running sums are missing from {self.store.state_location(resume, merge_step)}"
        raise ConfigError(
            f"training resumes after step {resume}, inside the window of merge step {merge_step} "
            f"(steps {window_start(merge_step, self.config.window)}-{merge_step}), but {where}; pass the "
            "hook.state_dict() saved with that checkpoint to load_state_dict(), or use mode='snapshot'"
        )

    def _check_not_skipped(self, previous: int, step: int) -> None:
        skipped = self._first_skipped(previous, step)
        if skipped is not None:
            at, what = skipped
            raise ConfigError(
                f"post_train_batch was not called for step {at}, which {what} averages; call it after every "
                "optimizer step"
            )

    def _first_skipped(self, previous: int, step: int) -> tuple[int, str] | None:
        """The first step between ``previous`` and ``step`` that the hook captures, and what
        averages it; None when there is none."""
        mode, every, size = self.config.mode, self.config.every, self.config.block or 1
        # The EMA (once begun) and the blocks (from the first one this process writes) capture
        # every multiple of ``every``: a block's steps are every every-th back from its end.
        if (mode == "ema" and self._ema_last is not None) or mode == "blocks":
            after = previous if mode == "ema" else max(previous, self._first_block - size)
            first = after - after % every + every
            if first < step:
                return first, "the EMA" if mode == "ema" else f"the block ending at step {-(-first // size) * size}"
        for merge_step, steps in self._windows.items():
            skipped = steps_between(steps, previous, step)
            if skipped:
                return skipped[0], f"the merge at step {merge_step}"
        return None

    # -- errors and results ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("the MergeHook is closed")

    def _check_background(self) -> None:
        # Asked at every call on purpose: a background failure cannot raise into the loop itself.
        self._captures.check()
        self._publishes.check()

    def _check(self) -> None:
        self._check_background()
        self._check_open()

    def _deliver_merged(self) -> None:
        while True:
            try:
                path, merge_step = self._merged.get_nowait()
            except queue.Empty:
                return
            if self.config.on_merged is not None:
                self.config.on_merged(path, merge_step)


def _store(config: MergeHookConfig, fs: Any, folder: str, options: PublishOptions) -> WindowStore:
    """The store of the config's mode."""
    if config.mode == "snapshot":
        return SnapshotStore(fs, folder, options, config.weightings, config.keep_snapshots)
    if config.mode == "ema":
        return EmaStore(fs, folder, options, config.ema_tag, config.describe_ema(), config.float64_accumulator)
    if config.mode == "blocks":
        return BlockStore(fs, folder, options, cast(int, config.block), config.every, config.float64_accumulator)
    return AccumulateStore(fs, folder, options, config.weightings, config.float64_accumulator)


def _unordered(described: Any) -> list[str]:
    """A recorded weighting, or list of them, as a comparable set."""
    return sorted(json.dumps(d, sort_keys=True) for d in (described if isinstance(described, list) else [described]))
