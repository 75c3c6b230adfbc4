"""The merge schedule: which steps to merge at, which steps each merge averages, which
checkpoints to keep (:mod:`.schedule`, pure functions), printed (:mod:`.report`) and drawn
(:mod:`.plot`). Shared by ``ckptavg plan`` and the training hook; no torch anywhere."""

from __future__ import annotations

from .schedule import (
    MAX_MERGES,
    MergePlan,
    MergeWindow,
    Period,
    Span,
    compute_interval_merge_steps,
    compute_merge_steps_from_decay_schedule,
    compute_merge_window_starts,
    period_decay_tokens,
    plan_from_interval,
    plan_from_schedule,
    sampled_steps,
    steps_between,
    validate_merge_steps,
    window_start,
)

__all__ = [
    "MAX_MERGES",
    "MergePlan",
    "MergeWindow",
    "Period",
    "Span",
    "compute_interval_merge_steps",
    "compute_merge_steps_from_decay_schedule",
    "compute_merge_window_starts",
    "period_decay_tokens",
    "plan_from_interval",
    "plan_from_schedule",
    "sampled_steps",
    "steps_between",
    "validate_merge_steps",
    "window_start",
]
