"""``ckptavg plan --png``: the learning-rate shape against the plan's numbers, and the PNG file."""

from __future__ import annotations

import sys

import fsspec
import pytest

from ckptavg import CkptavgError, plan_from_interval, plan_from_schedule
from ckptavg.plan.plot import lr_shape, render_png

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PERIODS = [100 * 10**9, 100 * 10**9]
TOKENS_PER_STEP = 4 * 10**6


def schedule_plan():
    return plan_from_schedule(PERIODS, TOKENS_PER_STEP, 200, decay_fraction=0.1)


def test_lr_shape_follows_periods_and_decays():
    # Restated from the tokens: each period is stable at 1.0 until its last 10% of tokens, decays
    # linearly to 0 at its end, and the next period restarts at 1.0 on that same step.
    expected, cumulative = [], 0
    for length in PERIODS:
        start = cumulative // TOKENS_PER_STEP
        cumulative += length
        decay_start = (cumulative - round(0.1 * length)) // TOKENS_PER_STEP
        expected += [(start, 1.0), (decay_start, 1.0), (cumulative // TOKENS_PER_STEP, 0.0)]
    assert lr_shape(schedule_plan()) == expected
    assert expected == [(0, 1.0), (22500, 1.0), (25000, 0.0), (25000, 1.0), (47500, 1.0), (50000, 0.0)]


def test_lr_shape_without_decay_or_periods_is_flat():
    no_decay = plan_from_schedule(PERIODS, TOKENS_PER_STEP, 200, decay=0)
    assert lr_shape(no_decay) == [(0, 1.0), (25000, 1.0), (50000, 1.0)]
    assert lr_shape(plan_from_interval(1000, 5000, 50)) == [(0, 1.0), (5000, 1.0)]


def test_lr_shape_rises_over_the_warmup_and_decays_at_the_end_of_an_interval_plan():
    warmed = plan_from_schedule(PERIODS, TOKENS_PER_STEP, 200, decay_fraction=0.1, warmup=2000)
    assert lr_shape(warmed) == [
        (0, 0.0),
        (2000, 1.0),
        (22500, 1.0),
        (25000, 0.0),
        (25000, 1.0),
        (47500, 1.0),
        (50000, 0.0),
    ]
    assert lr_shape(plan_from_interval(1000, 5000, 50, warmup=300)) == [(0, 0.0), (300, 1.0), (5000, 1.0)]
    assert lr_shape(plan_from_interval(1000, 5000, 50, decay_fraction=0.2)) == [(0, 1.0), (4000, 1.0), (5000, 0.0)]


@pytest.mark.parametrize(
    "plan",
    [schedule_plan(), plan_from_interval(1000, 20000, 1, TOKENS_PER_STEP), plan_from_interval(1000, 5000, 50)],
    ids=["schedule", "interval-tokens", "interval-steps"],
)
def test_png_is_written(tmp_path, plan):
    target = tmp_path / "plan.png"
    render_png(plan, str(target))
    data = target.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 10_000
    assert [p.name for p in tmp_path.iterdir()] == ["plan.png"]  # no temp file left beside it


def test_png_to_fsspec_url():
    url = "memory://ckptavg-plan-plot/plan.png"
    try:
        render_png(schedule_plan(), url)
        with fsspec.open(url, "rb") as handle:
            assert handle.read(len(PNG_MAGIC)) == PNG_MAGIC
    finally:
        fsspec.filesystem("memory").rm("/ckptavg-plan-plot", recursive=True)


def test_missing_matplotlib_is_a_user_error_and_writes_nothing(tmp_path, monkeypatch):
    # Not installed: the package and any submodule an earlier test imported are unimportable.
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(CkptavgError, match=r"--png needs matplotlib: pip install 'ckptavg\[plot\]'"):
        render_png(schedule_plan(), str(tmp_path / "plan.png"))
    assert list(tmp_path.iterdir()) == []


def test_unwritable_path_is_a_user_error(tmp_path):
    with pytest.raises(CkptavgError, match="cannot create"):
        render_png(schedule_plan(), str(tmp_path / "missing" / "plan.png"))
    assert list(tmp_path.iterdir()) == []
