"""Merge planning: which steps to merge at, which steps each merge averages, which to keep.

Pure functions only, shared by ``ckptavg plan`` and the training hook so that both give the
same numbers as OLMo-core's ``compute_merge_steps_from_decay_schedule`` and
``compute_merge_window_starts``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from ..units import every

# More merges than this in one run is a typo (a merge every step of a long run?): each merge is a
# checkpoint written, and a plan of millions would print megabytes. Refused before it is built.
MAX_MERGES = 100_000


def compute_merge_steps_from_decay_schedule(
    period_lengths: Sequence[int],
    tokens_per_step: int,
    decay: int | None = None,
    decay_fraction: float | None = None,
) -> list[int]:
    """One merge step per period: the last step before that period's decay phase begins.

    For each period, ``(cumulative tokens - decay tokens of the period) // tokens_per_step``,
    where the decay tokens are ``decay`` or ``round(decay_fraction * period_length)``.
    """
    decay_tokens = period_decay_tokens(period_lengths, decay, decay_fraction)
    if tokens_per_step <= 0:
        raise ConfigError(f"tokens per step must be positive, got {tokens_per_step}")
    merge_steps = []
    cumulative = 0
    for index, (length, decay_len) in enumerate(zip(period_lengths, decay_tokens, strict=True)):
        if length <= 0:
            raise ConfigError(f"period {index + 1} has length {length}; periods must be positive")
        if decay_len > length:
            raise ConfigError(
                f"decay of period {index + 1} ({decay_len} tokens) is longer than the period ({length} tokens)"
            )
        cumulative += length
        merge_steps.append((cumulative - decay_len) // tokens_per_step)
    return merge_steps


def period_decay_tokens(period_lengths: Sequence[int], decay: int | None, decay_fraction: float | None) -> list[int]:
    """Decay-phase length in tokens of each period (``decay``, or a fraction of the period)."""
    if (decay is None) == (decay_fraction is None):
        raise ConfigError("give exactly one of decay (--decay, tokens) or decay fraction (--decay-fraction)")
    if decay is not None:
        if decay < 0:
            raise ConfigError(f"decay must not be negative, got {decay}")
        return [decay for _ in period_lengths]
    assert decay_fraction is not None
    if not 0.0 <= decay_fraction <= 1.0:
        raise ConfigError(f"decay fraction must lie in [0, 1], got {decay_fraction}")
    # Python's round (half to even) on the float product, exactly as OLMo-core computes it.
    return [int(round(decay_fraction * length)) for length in period_lengths]


def compute_interval_merge_steps(interval: int, max_steps: int) -> list[int]:
    """Merge every ``interval`` steps: ``interval, 2*interval, ... <= max_steps``."""
    if interval <= 0:
        raise ConfigError(f"merge interval must be positive, got {interval}")
    if max_steps <= 0:
        raise ConfigError(f"max steps must be positive, got {max_steps}")
    _check_merge_count(max_steps // interval, f"a merge {every(interval)} up to step {max_steps}")
    return list(range(interval, max_steps + 1, interval))


def _check_merge_count(count: int, plan: str) -> None:
    if count > MAX_MERGES:
        raise ConfigError(f"{plan} makes {count} merges, more than the {MAX_MERGES} a plan may have")


def window_start(merge_step: int, window: int) -> int:
    """First step averaged by the merge at ``merge_step`` (the window is ``[start, merge_step]``)."""
    return max(0, merge_step - window + 1)


def compute_merge_window_starts(merge_steps: Sequence[int], window: int) -> list[int]:
    """Checkpoint steps a trainer must keep so that a resume can always redo a whole window.

    Over the sorted merge steps, a window start is kept only when it lies after the previous
    merge step: overlapping windows share the earliest start of their group.
    """
    starts: list[int] = []
    previous_merge_step = -1
    for merge_step in sorted(merge_steps):
        start = window_start(merge_step, window)
        if start > previous_merge_step:
            starts.append(start)
        previous_merge_step = merge_step
    return starts


def validate_merge_steps(merge_steps: Sequence[int], window: int) -> None:
    """Reject plans that cannot be carried out; each message names the offending value."""
    if window < 1:
        raise ConfigError(f"window must be at least 1 step, got {window}")
    if not merge_steps:
        raise ConfigError("nothing to merge: the plan has no merge step")
    _check_merge_count(len(merge_steps), "the plan")
    for merge_step in merge_steps:
        if merge_step < window:
            raise ConfigError(f"merge step {merge_step} is smaller than the window of {window} steps")
    if len(set(merge_steps)) != len(merge_steps):
        raise ConfigError(f"merge steps repeat: {sorted(merge_steps)}")


def sampled_steps(merge_step: int, window: int, every: int = 1) -> range:
    """Steps of a window that are captured, ascending: the merge step and every ``every``-th
    step before it, down to the window start (counting back from the merge step, so it is
    always included). A range: membership and length cost nothing, whatever the window."""
    if every < 1:
        raise ConfigError(f"every (the stride inside a window) must be at least 1, got {every}")
    start = window_start(merge_step, window)
    first = merge_step - (merge_step - start) // every * every
    return range(first, merge_step + 1, every)


def steps_between(steps: range, after: int, before: int) -> range:
    """The steps of an ascending range that lie strictly between ``after`` and ``before``."""
    skip = 0 if after < steps.start else (after - steps.start) // steps.step + 1
    first = steps.start + skip * steps.step
    return range(first, min(before, steps.stop), steps.step)


@dataclass(frozen=True)
class MergeWindow:
    """One merge: the weights after steps ``start..merge_step`` (inclusive) are averaged."""

    merge_step: int
    start: int
    period: int | None = None
    tokens_at_merge: int | None = None

    @property
    def end(self) -> int:
        return self.merge_step

    @property
    def steps(self) -> range:
        return range(self.start, self.merge_step + 1)


@dataclass(frozen=True)
class Period:
    """One warmup-stable-decay period, in steps, for drawing the timeline."""

    index: int
    start_step: int
    decay_start_step: int
    end_step: int


@dataclass(frozen=True)
class MergePlan:
    """What a run merges and which checkpoints it must keep."""

    window: int
    windows: tuple[MergeWindow, ...]
    fixed_steps: tuple[int, ...]
    max_steps: int
    tokens_per_step: int | None = None
    periods: tuple[Period, ...] = ()

    @property
    def merge_steps(self) -> list[int]:
        return [w.merge_step for w in self.windows]

    def to_dict(self) -> dict:
        return {
            "window": self.window,
            "max_steps": self.max_steps,
            "tokens_per_step": self.tokens_per_step,
            "merge_steps": self.merge_steps,
            "fixed_steps": list(self.fixed_steps),
            "merges": [
                {
                    "period": w.period,
                    "merge_step": w.merge_step,
                    "window_start": w.start,
                    "window_end": w.end,
                    "tokens_at_merge": w.tokens_at_merge,
                }
                for w in self.windows
            ],
            "periods": [
                {
                    "period": p.index,
                    "start_step": p.start_step,
                    "decay_start_step": p.decay_start_step,
                    "end_step": p.end_step,
                }
                for p in self.periods
            ],
        }


def plan_from_schedule(
    period_lengths: Sequence[int],
    tokens_per_step: int,
    window: int,
    decay: int | None = None,
    decay_fraction: float | None = None,
) -> MergePlan:
    """Plan one merge just before the decay phase of each warmup-stable-decay period (the same
    merge steps as OLMo-core's ``compute_merge_steps_from_decay_schedule``).

    Args:
        period_lengths: tokens of each period, in order.
        tokens_per_step: tokens per optimizer step.
        window: steps each merge averages; its last step is the merge step.
        decay: decay-phase tokens of every period; or
        decay_fraction: the decay phase as a fraction of each period.

    Example::

        plan = plan_from_schedule([100 * 10**9, 100 * 10**9], 4 * 10**6, window=100, decay_fraction=0.1)
        [w.merge_step for w in plan.windows]  # [22500, 47500]
    """
    if not period_lengths:
        raise ConfigError("nothing to merge: no periods given")
    merge_steps = compute_merge_steps_from_decay_schedule(
        period_lengths, tokens_per_step, decay=decay, decay_fraction=decay_fraction
    )
    validate_merge_steps(merge_steps, window)
    decays = period_decay_tokens(period_lengths, decay, decay_fraction)
    periods = []
    cumulative = 0
    for index, (length, decay_len) in enumerate(zip(period_lengths, decays, strict=True), 1):
        start = cumulative // tokens_per_step
        cumulative += length
        periods.append(Period(index, start, (cumulative - decay_len) // tokens_per_step, cumulative // tokens_per_step))
    windows = tuple(
        MergeWindow(ms, window_start(ms, window), index, ms * tokens_per_step)
        for index, ms in enumerate(merge_steps, 1)
    )
    return MergePlan(
        window=window,
        windows=windows,
        fixed_steps=tuple(compute_merge_window_starts(merge_steps, window)),
        max_steps=periods[-1].end_step,
        tokens_per_step=tokens_per_step,
        periods=tuple(periods),
    )


def plan_from_interval(interval: int, max_steps: int, window: int, tokens_per_step: int | None = None) -> MergePlan:
    """Plan a merge every ``interval`` steps up to ``max_steps``.

    Args:
        interval: steps between merges.
        max_steps: the run's length in steps.
        window: steps each merge averages; its last step is the merge step.
        tokens_per_step: tokens per optimizer step, to show tokens too (optional).

    Example::

        plan = plan_from_interval(1000, 3000, window=50)
        [(w.start, w.merge_step) for w in plan.windows]  # [(951, 1000), (1951, 2000), (2951, 3000)]
    """
    merge_steps = compute_interval_merge_steps(interval, max_steps)
    validate_merge_steps(merge_steps, window)
    windows = tuple(
        MergeWindow(
            ms,
            window_start(ms, window),
            None,
            ms * tokens_per_step if tokens_per_step else None,
        )
        for ms in merge_steps
    )
    return MergePlan(
        window=window,
        windows=windows,
        fixed_steps=tuple(compute_merge_window_starts(merge_steps, window)),
        max_steps=max_steps,
        tokens_per_step=tokens_per_step,
    )
