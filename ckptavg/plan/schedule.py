"""Merge planning: which steps to merge at, which steps each merge averages, which to keep.

Pure functions only, shared by ``ckptavg plan`` and the training hook so that both give the
same numbers as OLMo-core's ``compute_merge_steps_from_decay_schedule`` and
``compute_merge_window_starts``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from ..units import every, format_count, parse_count

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


_STEPS = re.compile(r"^\s*[0-9]+\s*$")
_TOKENS = re.compile(r"^\s*[0-9.]+(?:[eE][+-]?[0-9]+)?\s*[KMBGTkmbgt]\s*$")


@dataclass(frozen=True)
class Span:
    """A length as ``ckptavg plan`` takes it: a number of steps (``--window 100``), or of tokens
    when it has a suffix (``--window 80B``), converted with the tokens per step."""

    count: int
    tokens: bool

    @classmethod
    def parse(cls, text: str, what: str) -> Span:
        """``100`` -> 100 steps; ``80B``, ``2.5T``, ``500M``, ``4e3K`` -> tokens (the suffix is
        what says tokens: a bare ``1e3`` is neither)."""
        if _STEPS.match(text):
            return cls(parse_count(text, what), tokens=False)
        if _TOKENS.match(text):
            return cls(parse_count(text, what), tokens=True)
        raise ConfigError(f"{what} {text!r} is neither a number of steps (100) nor of tokens, with a suffix (80B)")

    def steps(self, tokens_per_step: int | None, what: str, round_up: bool = False) -> int:
        """The length in steps: a token count divided by ``tokens_per_step``, rounded down (a
        window never spans more tokens than asked) or, with ``round_up``, up (a warmup lasts
        until the step that completes its tokens)."""
        if not self.tokens:
            return self.count
        if tokens_per_step is None:
            raise ConfigError(
                f"{what} {format_count(self.count)} is in tokens: give --tokens-per-step "
                "(or --batch-size and --seq-len)"
            )
        return -(-self.count // tokens_per_step) if round_up else self.count // tokens_per_step


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
    warmup_steps: int = 0
    """Steps of the warmup at the run's start: the learning rate reaches its peak at this step."""
    window_tokens: int | None = None
    """The window as asked for in tokens (``--window 80B``), or None when asked for in steps."""

    @property
    def merge_steps(self) -> list[int]:
        return [w.merge_step for w in self.windows]

    def warnings(self) -> list[str]:
        """One line for each merge whose window reaches into the warmup or into a decay phase
        (a decay phase begins after its period's merge step): its average then mixes in weights
        trained at another learning rate than the stable phase's, the ones a merge before a decay
        is meant to average."""
        lines = []
        for w in self.windows:
            where = f"merge at step {w.merge_step}: its window {w.start}-{w.end}"
            if w.start < self.warmup_steps:
                lines.append(f"{where} starts inside the warmup, which ends at step {self.warmup_steps}")
            for period in self.periods:
                first, last = period.decay_start_step + 1, period.end_step
                if first <= min(last, w.end) and w.start <= last:
                    of = f" of period {period.index}" if len(self.periods) > 1 else ""
                    lines.append(f"{where} reaches into the decay phase{of} (steps {first}-{last})")
        return lines

    def to_dict(self) -> dict:
        return {
            "window": self.window,
            "window_tokens": self.window_tokens,
            "warmup_steps": self.warmup_steps,
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
            "warnings": self.warnings(),
        }


def plan_from_schedule(
    period_lengths: Sequence[int],
    tokens_per_step: int,
    window: int,
    decay: int | None = None,
    decay_fraction: float | None = None,
    warmup: int = 0,
) -> MergePlan:
    """Plan one merge just before the decay phase of each warmup-stable-decay period (the same
    merge steps as OLMo-core's ``compute_merge_steps_from_decay_schedule``).

    Args:
        period_lengths: tokens of each period, in order.
        tokens_per_step: tokens per optimizer step.
        window: steps each merge averages; its last step is the merge step.
        decay: decay-phase tokens of every period; or
        decay_fraction: the decay phase as a fraction of each period.
        warmup: steps of the warmup at the run's start (:meth:`MergePlan.warnings` names the
            windows that reach into it).

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
    _check_warmup(warmup)
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
        warmup_steps=warmup,
    )


def _check_warmup(warmup: int) -> None:
    if warmup < 0:
        raise ConfigError(f"warmup must not be negative, got {warmup}")


def plan_from_interval(
    interval: int,
    max_steps: int,
    window: int,
    tokens_per_step: int | None = None,
    decay: int | None = None,
    decay_fraction: float | None = None,
    warmup: int = 0,
) -> MergePlan:
    """Plan a merge every ``interval`` steps up to ``max_steps``.

    Args:
        interval: steps between merges.
        max_steps: the run's length in steps.
        window: steps each merge averages; its last step is the merge step.
        tokens_per_step: tokens per optimizer step, to show tokens too (optional).
        decay: tokens of a decay phase that ends the run (needs ``tokens_per_step``); or
        decay_fraction: that decay phase as a fraction of the run. The run is then one period,
            as :func:`plan_from_schedule` reckons it; merges stay every ``interval`` steps, and
            :meth:`MergePlan.warnings` names those whose window reaches into the decay.
        warmup: steps of the warmup at the run's start.

    Example::

        plan = plan_from_interval(1000, 3000, window=50)
        [(w.start, w.merge_step) for w in plan.windows]  # [(951, 1000), (1951, 2000), (2951, 3000)]
    """
    merge_steps = compute_interval_merge_steps(interval, max_steps)
    validate_merge_steps(merge_steps, window)
    _check_warmup(warmup)
    periods: tuple[Period, ...] = ()
    if decay is not None or decay_fraction is not None:
        if decay is not None and tokens_per_step is None:
            raise ConfigError("--decay is in tokens: give --tokens-per-step (or --batch-size and --seq-len)")
        unit = tokens_per_step or 1  # a fraction of the run needs no tokens: reckon in steps
        length = max_steps * unit
        (decay_len,) = period_decay_tokens([length], decay, decay_fraction)
        if decay_len > length:
            raise ConfigError(f"decay ({decay_len} tokens) is longer than the run ({length} tokens)")
        periods = (Period(1, 0, (length - decay_len) // unit, max_steps),)
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
        periods=periods,
        warmup_steps=warmup,
    )
