"""``ckptavg plan --png``: the run's learning-rate shape with its periods, decay phases and merges.

The table gives the numbers; the picture shows at a glance whether each window sits in the
stable phase just before a decay, how wide the windows are next to the run, and where the
periods restart. matplotlib is an optional extra (``ckptavg[plot]``), imported only here and
only when a PNG is asked for, so ``ckptavg plan`` and the training hook never pay for it.
"""

from __future__ import annotations

import io
from typing import Any

from ..errors import ConfigError
from ..io.atomic import atomic_write
from ..io.fs import resolve
from ..units import format_count
from .schedule import MergePlan

# Above this many merges the step labels would overlap: the lines and the legend stay.
MAX_LABELLED_MERGES = 20
# Narrowest drawn window, as a fraction of the run: a 200-step window in a 50k-step run (or a
# 1-step one) would otherwise be a hairline hidden under its merge-step line.
MIN_WINDOW_FRACTION = 0.006

_LR_COLOR = "tab:blue"
_DECAY_COLOR = "tab:orange"
_MERGE_COLOR = "tab:green"


def lr_shape(plan: MergePlan) -> list[tuple[int, float]]:
    """Breakpoints ``(step, learning-rate multiplier)`` of the schedule, joined by straight lines.

    A plan records each period's start, decay start and end and the warmup's length, not the
    curves, so the shape rises linearly from 0 over the warmup and decays linearly: 1.0 through
    each stable phase, down to 0 at the period's end, and back to 1.0 where the next period starts
    (two points at one step, a vertical jump), as a multi-period WSD schedule restarts. A period
    without a decay phase stays at 1.0. A plan without periods (``--interval`` without a decay)
    is one flat line after its warmup.
    """
    warmup = [(0, 0.0)] if plan.warmup_steps else []
    if not plan.periods:
        return [*warmup, (plan.warmup_steps, 1.0), (plan.max_steps, 1.0)]
    points: list[tuple[int, float]] = []
    for period in plan.periods:
        end_value = 0.0 if period.end_step > period.decay_start_step else 1.0
        # The warmup ends inside the first period's stable phase (or the period starts at 1.0).
        start = max(period.start_step, min(plan.warmup_steps, period.decay_start_step))
        points += [(start, 1.0), (period.decay_start_step, 1.0), (period.end_step, end_value)]
    points = [*warmup, *points]
    # Drop repeats (a decay that fills its period, a period without decay, a period's start that
    # is the previous period's end at 1.0) so that every breakpoint is a change of slope.
    return [point for index, point in enumerate(points) if index == 0 or point != points[index - 1]]


def render_png(plan: MergePlan, path: str) -> None:
    """Draw ``plan`` and write it as a PNG at ``path``, a local path or an fsspec URL.

    The image is rendered in memory before anything is opened, then written with
    :func:`~ckptavg.io.atomic.atomic_write`: a failure at any point (no matplotlib, a bad path)
    leaves no file, and a local file appears complete or not at all.
    """
    png = _draw(plan)
    fs, fs_path = resolve(path)
    with atomic_write(fs, fs_path) as handle:
        handle.write(png)


def _label_once(label: str, index: int) -> str:
    """A legend entry for the first of a series of spans or lines only (``_`` hides the rest)."""
    return label if index == 0 else f"_{label}"


def _draw(plan: MergePlan) -> bytes:
    """The PNG bytes of the plan's picture.

    Figure with the Agg canvas, not pyplot: pyplot would pick a backend for the whole process
    (a display in a notebook or a desktop session) and keep every figure in its registry;
    this never touches a display, global state or anything left open.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError as exc:
        raise ConfigError("--png needs matplotlib: pip install 'ckptavg[plot]'") from exc

    figure = Figure(figsize=(11, 5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    total = max(plan.max_steps, 1)

    steps, values = zip(*lr_shape(plan), strict=True)
    axes.plot(steps, values, color=_LR_COLOR, linewidth=2, label="learning-rate multiplier", zorder=3)

    decays = [p for p in plan.periods if p.end_step > p.decay_start_step]
    for index, period in enumerate(decays):
        axes.axvspan(
            period.decay_start_step,
            period.end_step,
            color=_DECAY_COLOR,
            alpha=0.18,
            linewidth=0,
            label=_label_once("decay phase", index),
        )
    for index, period in enumerate(plan.periods):
        axes.text(
            (period.start_step + period.end_step) / 2,
            1.06,
            f"period {period.index}",
            ha="center",
            va="bottom",
            color="dimgray",
        )
        if index:
            axes.axvline(
                period.start_step,
                color="dimgray",
                linestyle=":",
                linewidth=1,
                label=_label_once("period boundary", index - 1),
            )

    min_width = MIN_WINDOW_FRACTION * total
    for index, window in enumerate(plan.windows):
        axes.axvspan(
            min(window.start, window.end - min_width),
            window.end,
            color=_MERGE_COLOR,
            alpha=0.35,
            linewidth=0,
            label=_label_once(f"merge window ({plan.window} steps)", index),
        )
        axes.axvline(
            window.merge_step,
            color=_MERGE_COLOR,
            linewidth=1.5,
            label=_label_once("merge step", index),
            zorder=4,
        )
        if len(plan.windows) <= MAX_LABELLED_MERGES:
            axes.text(
                window.merge_step,
                0.03,
                f" {window.merge_step:,} ",
                rotation=90,
                ha="right",
                va="bottom",
                fontsize="small",
                color="darkgreen",
            )

    axes.set_xlim(0, total)
    axes.set_ylim(0, 1.15)
    axes.set_xlabel("step")
    axes.set_ylabel("learning-rate multiplier")
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{int(value):,}"))
    axes.grid(alpha=0.3)
    tokens_per_step = plan.tokens_per_step
    if tokens_per_step:

        def to_tokens(steps: Any) -> Any:  # numpy arrays, as matplotlib passes them
            return steps * tokens_per_step

        def to_steps(tokens: Any) -> Any:
            return tokens / tokens_per_step

        tokens = axes.secondary_xaxis("top", functions=(to_tokens, to_steps))
        tokens.set_xlabel("tokens")
        tokens.xaxis.set_major_formatter(FuncFormatter(lambda value, _: format_count(round(value))))

    merges = len(plan.windows)
    title = f"ckptavg plan: {merges} merge{'s' if merges != 1 else ''}, window {plan.window:,} steps"
    if plan.periods:
        title += f", {len(plan.periods)} period{'s' if len(plan.periods) != 1 else ''}"
    else:
        title += f", {plan.max_steps:,} steps"
    axes.set_title(title)
    figure.legend(loc="outside lower center", ncols=5, frameon=False)

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    return buffer.getvalue()
