"""Render a :class:`~ckptavg.plan.MergePlan` for people (table, timeline) and scripts (json, env)."""

from __future__ import annotations

import json
import shlex

from ..units import format_count
from .schedule import MergePlan

TIMELINE_WIDTH = 72


def render_table(plan: MergePlan) -> str:
    header = ("period", "merge step", "window (steps)", "tokens at merge")
    rows = [
        (
            "-" if w.period is None else str(w.period),
            str(w.merge_step),
            f"{w.start}-{w.end}",
            "-" if w.tokens_at_merge is None else format_count(w.tokens_at_merge),
        )
        for w in plan.windows
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    fixed = " ".join(str(s) for s in plan.fixed_steps)
    lines.append("")
    if plan.window_tokens is not None and plan.tokens_per_step is not None:
        spanned = plan.window * plan.tokens_per_step
        rounded = "" if spanned == plan.window_tokens else f" ({spanned} tokens: rounded down to whole steps)"
        lines.append(
            f"window: {format_count(plan.window_tokens)} tokens = {plan.window} steps of "
            f"{plan.tokens_per_step} tokens{rounded}"
        )
    lines.append(f"checkpoints to keep so that a resume can redo a whole window (fixed steps): {fixed}")
    lines.append("an offline `ckptavg merge` averages the checkpoints saved inside each window")
    return "\n".join(lines)


def render_timeline(plan: MergePlan, width: int = TIMELINE_WIDTH) -> str:
    """A one-line picture of the run: ``/`` warmup, ``=`` stable, ``\\`` decay, ``[#]`` merge windows."""
    total = max(plan.max_steps, 1)

    def column(step: int) -> int:
        return min(width - 1, step * width // total)

    schedule = ["="] * width
    if plan.warmup_steps:
        for col in range(column(plan.warmup_steps - 1) + 1):
            schedule[col] = "/"
    for period in plan.periods:
        for col in range(column(period.decay_start_step), column(period.end_step - 1) + 1):
            schedule[col] = "\\"
        if period.index > 1:
            schedule[column(period.start_step)] = "|"
    windows = [" "] * width
    for w in plan.windows:
        first, last = column(w.start), column(w.end)
        for col in range(first, last + 1):
            windows[col] = "#"
        windows[last] = "^"
    ends = f"0{' ' * (width - 1 - len(str(plan.max_steps)))}{plan.max_steps}"
    legend = [
        *(["/ warmup"] if plan.warmup_steps else []),
        *(["= stable"] if plan.warmup_steps or plan.periods else []),
        *(["\\ decay"] if plan.periods else []),
        *(["| period boundary"] if len(plan.periods) > 1 else []),
        "# window",
        "^ merge step",
    ]
    return "\n".join(
        [
            f"steps    {ends}",
            f"schedule {''.join(schedule)}",
            f"merges   {''.join(windows)}".rstrip(),
            f"         {'  '.join(legend)}",
        ]
    )


def render_text(plan: MergePlan) -> str:
    return f"{render_table(plan)}\n\n{render_timeline(plan)}"


def render_json(plan: MergePlan) -> str:
    return json.dumps(plan.to_dict(), indent=2)


def render_env(plan: MergePlan) -> str:
    """Shell-sourceable variables: ``eval "$(ckptavg plan ... --format env)"`` in a SLURM script."""
    values = {
        "CKPTAVG_MERGE_STEPS": " ".join(str(s) for s in plan.merge_steps),
        "CKPTAVG_WINDOW_STARTS": " ".join(str(w.start) for w in plan.windows),
        "CKPTAVG_FIXED_STEPS": " ".join(str(s) for s in plan.fixed_steps),
        "CKPTAVG_WINDOW": str(plan.window),
        "CKPTAVG_MAX_STEPS": str(plan.max_steps),
    }
    if plan.tokens_per_step is not None:
        values["CKPTAVG_TOKENS_PER_STEP"] = str(plan.tokens_per_step)
    return "\n".join(f"{key}={shlex.quote(value)}" for key, value in values.items())
