"""Plan arithmetic against the rules of OLMo-core's helpers, restated independently here."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from ckptavg import (
    CkptavgError,
    compute_interval_merge_steps,
    compute_merge_steps_from_decay_schedule,
    compute_merge_window_starts,
    plan_from_interval,
    plan_from_schedule,
)
from ckptavg.plan import MAX_MERGES
from ckptavg.units import format_count, parse_count, parse_size


def reference_merge_steps(periods, tokens_per_step, decay=None, decay_fraction=None):
    steps, cumulative = [], 0
    for length in periods:
        cumulative += length
        decay_tokens = decay if decay is not None else int(round(decay_fraction * length))
        steps.append((cumulative - decay_tokens) // tokens_per_step)
    return steps


def reference_window_starts(merge_steps, n):
    starts, previous = [], -1
    for ms in sorted(merge_steps):
        start = max(0, ms - n + 1)
        if start > previous:
            starts.append(start)
        previous = ms
    return starts


periods_st = st.lists(st.integers(min_value=10**6, max_value=10**13), min_size=1, max_size=6)
tps_st = st.integers(min_value=1, max_value=10**7)


@given(periods_st, tps_st, st.floats(min_value=0.0, max_value=1.0, allow_nan=False))
def test_merge_steps_match_rule_with_fraction(periods, tps, fraction):
    assert compute_merge_steps_from_decay_schedule(periods, tps, decay_fraction=fraction) == reference_merge_steps(
        periods, tps, decay_fraction=fraction
    )


@given(periods_st, tps_st, st.integers(min_value=0, max_value=10**6))
def test_merge_steps_match_rule_with_decay_tokens(periods, tps, decay):
    assert compute_merge_steps_from_decay_schedule(periods, tps, decay=decay) == reference_merge_steps(
        periods, tps, decay=decay
    )


@given(st.lists(st.integers(min_value=1, max_value=10**6), min_size=0, max_size=12), st.integers(1, 5000))
def test_window_starts_match_rule(merge_steps, n):
    starts = compute_merge_window_starts(merge_steps, n)
    assert starts == reference_window_starts(merge_steps, n)
    # Every merge window begins at or after some kept start, and no kept start is inside
    # the window of an earlier merge (so one checkpoint serves each overlapping group).
    for ms in merge_steps:
        assert any(s <= max(0, ms - n + 1) for s in starts)


@given(st.integers(1, 10**5), st.integers(1, 10**6))
def test_interval_steps(interval, max_steps):
    expected = list(range(interval, max_steps + 1, interval))
    if len(expected) <= MAX_MERGES:
        assert compute_interval_merge_steps(interval, max_steps) == expected
    else:  # a merge per step of a long run is a typo; refused before the list is built
        with pytest.raises(CkptavgError, match=f"makes {len(expected)} merges, more than the {MAX_MERGES} a plan"):
            compute_interval_merge_steps(interval, max_steps)


@given(periods_st, tps_st, st.floats(0.0, 0.5), st.integers(1, 10**4))
def test_plan_from_schedule_is_consistent(periods, tps, fraction, window):
    expected = reference_merge_steps(periods, tps, decay_fraction=fraction)
    assume(all(ms >= window for ms in expected) and len(set(expected)) == len(expected))
    plan = plan_from_schedule(periods, tps, window, decay_fraction=fraction)
    assert plan.merge_steps == expected
    assert list(plan.fixed_steps) == reference_window_starts(expected, window)
    for w in plan.windows:
        assert w.start == max(0, w.merge_step - window + 1)
        assert len(w.steps) == w.merge_step - w.start + 1
        assert w.tokens_at_merge == w.merge_step * tps


def test_olmo_style_example():
    # Two 100B-token periods at 4M tokens/step, 10 % decay each: merges at 22500 and 47500.
    plan = plan_from_schedule([100 * 10**9, 100 * 10**9], 4 * 10**6, 100, decay_fraction=0.1)
    assert plan.merge_steps == [22500, 47500]
    assert [(w.start, w.end) for w in plan.windows] == [(22401, 22500), (47401, 47500)]
    assert plan.fixed_steps == (22401, 47401)


def test_overlapping_windows_share_a_start():
    assert compute_merge_window_starts([100, 150, 400], 80) == [21, 321]


def test_decay_longer_than_period_is_rejected():
    with pytest.raises(CkptavgError, match="decay of period 1"):
        plan_from_schedule([1000], 10, 5, decay=2000)


def test_window_longer_than_merge_step_is_rejected():
    with pytest.raises(CkptavgError, match="merge step 90 is smaller than the window of 100"):
        plan_from_schedule([1000], 10, 100, decay=100)


def test_nothing_to_merge_is_rejected():
    with pytest.raises(CkptavgError, match="nothing to merge"):
        plan_from_interval(500, 100, 10)


def test_decay_and_fraction_are_exclusive():
    with pytest.raises(CkptavgError, match="exactly one"):
        compute_merge_steps_from_decay_schedule([1000], 10, decay=1, decay_fraction=0.1)
    with pytest.raises(CkptavgError, match="exactly one"):
        compute_merge_steps_from_decay_schedule([1000], 10)


@pytest.mark.parametrize(
    ("text", "value"),
    [("100B", 10**11), ("2.5T", 2_500_000_000_000), ("4M", 4 * 10**6), ("1e9", 10**9), ("12345", 12345), ("7k", 7000)],
)
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["abc", "1.5", "4X", "", "-3B"])
def test_parse_count_rejects(text):
    with pytest.raises(CkptavgError, match="token count"):
        parse_count(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1e400", "'1e400' is too large (at most 9223372036854775807)"),  # inf as a float
        ("1e5000", "'1e5000' is too large"),  # a 5000-digit integer
        ("1e99999999999999999999", "too large"),  # past what Decimal takes
        ("9223372036854775808", "too large"),  # 2**63
        ("9.3e18", "too large"),
        ("1e-999999999", "not a whole number"),  # not a zero
        ("1.00000000000000000000000000001T", "not a whole number"),  # 30 digits: exact, not rounded to 1T
        ("nan", "cannot parse"),
        ("inf", "cannot parse"),
        ("1e" + "9" * 5000, "'1e" + "9" * 35 + "...' is too large"),  # quoted, cut short
    ],
)
def test_parse_count_refuses_absurd_values_in_one_short_line(text, message):
    with pytest.raises(CkptavgError) as refused:
        parse_count(text, "--periods")
    line = str(refused.value)
    assert message in line and "--periods" in line and "\n" not in line and len(line) < 120


def test_parse_count_is_exact_for_long_decimal_strings():
    assert parse_count("9223372036854775807") == 2**63 - 1
    assert parse_count("9.223372036854775807e18") == 2**63 - 1
    assert parse_count("1234567890123456.789e3") == 1234567890123456789
    assert parse_count("0.000000000000000000000000000000000000001e39") == 1
    assert parse_count("1.50000000000000000000000000000000000000000000000000T") == 15 * 10**11
    assert parse_count("0e5000") == parse_count("0.0T") == 0
    assert parse_size("1.5TiB") == 3 * 2**39


def test_a_plan_of_more_than_max_merges_is_refused():
    with pytest.raises(CkptavgError, match=f"the plan makes {MAX_MERGES + 1} merges, more than the {MAX_MERGES}"):
        plan_from_schedule([1] * (MAX_MERGES + 1), 1, 1, decay=0)
    assert len(plan_from_interval(1, MAX_MERGES, 1).windows) == MAX_MERGES


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("100") == 100


@given(st.integers(0, 10**15))
def test_format_count_round_trips_approximately(value):
    text = format_count(value)
    assert abs(parse_count_loose(text) - value) <= max(1, value) * 1e-3


def parse_count_loose(text: str) -> float:
    scale = {"T": 1e12, "B": 1e9, "M": 1e6, "K": 1e3}
    if text[-1] in scale:
        return float(text[:-1]) * scale[text[-1]]
    return float(text)


@given(st.integers(1, 3000), st.integers(1, 200), st.integers(1, 50), st.integers(-5, 3100), st.integers(-5, 3100))
def test_sampled_steps_and_steps_between(merge_step, window, every, after, before):
    """The sampled steps of a window, restated by brute force: counting back from the merge
    step by ``every`` while inside the window; and the ones strictly between two steps."""
    from ckptavg.plan import sampled_steps, steps_between

    sampled = sampled_steps(merge_step, window, every)
    expected = []
    step = merge_step
    while step >= max(0, merge_step - window + 1):
        expected.append(step)
        step -= every
    assert list(sampled) == expected[::-1]
    assert list(steps_between(sampled, after, before)) == [s for s in expected[::-1] if after < s < before]
