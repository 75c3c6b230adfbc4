"""Plan arithmetic against the rules of OLMo-core's helpers, restated independently here."""

from __future__ import annotations

import itertools

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
from ckptavg.plan import MAX_MERGES, Span
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


# -- windows and warmups in tokens; warnings for windows in the warmup or a decay ---------------


@given(st.integers(1, 10**6), st.sampled_from(["K", "M", "B", "G", "T"]), st.integers(1, 10**10))
def test_a_length_with_a_suffix_is_tokens_and_becomes_steps(number, suffix, tokens_per_step):
    """``80B`` is tokens: a window takes the steps those tokens fill, rounded down; a warmup lasts
    until the step that completes its tokens, rounded up. A bare number is steps."""
    tokens = number * {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}[suffix]
    span = Span.parse(f"{number}{suffix}", "--window")
    assert (span.count, span.tokens) == (tokens, True)
    assert span.steps(tokens_per_step, "--window") * tokens_per_step <= tokens
    assert (span.steps(tokens_per_step, "--window") + 1) * tokens_per_step > tokens
    warmup = span.steps(tokens_per_step, "--warmup", round_up=True)
    assert (warmup - 1) * tokens_per_step < tokens <= warmup * tokens_per_step
    assert Span.parse(str(number), "--window") == Span(number, tokens=False)
    assert Span.parse(str(number), "--window").steps(None, "--window") == number


@pytest.mark.parametrize("text", ["1e3", "1.5", "-3", "80X", "B", "", "80 B tokens"])
def test_a_length_is_steps_or_tokens_with_a_suffix(text):
    with pytest.raises(CkptavgError, match="--window .* is neither a number of steps"):
        Span.parse(text, "--window")


def test_a_window_in_tokens_needs_the_tokens_per_step():
    with pytest.raises(CkptavgError, match="--window 80B is in tokens: give --tokens-per-step"):
        Span.parse("80B", "--window").steps(None, "--window")


def reference_warned(windows, warmup, decays):
    """The merge steps whose window [start, merge step] holds a step before the warmup's end or a
    step of a decay phase (decay_start + 1 .. end), by looking at every step."""
    return [
        merge_step
        for start, merge_step in windows
        if any(s < warmup or any(first < s <= last for first, last in decays) for s in range(start, merge_step + 1))
    ]


@given(st.integers(1, 400), st.integers(1, 4000), st.integers(1, 400), st.floats(0, 1), st.integers(0, 4000))
def test_warnings_name_the_windows_in_the_warmup_or_the_final_decay(interval, max_steps, window, fraction, warmup):
    assume(interval <= max_steps and window <= interval)
    plan = plan_from_interval(interval, max_steps, window, decay_fraction=fraction, warmup=warmup)
    decay_start = max_steps - int(round(fraction * max_steps))
    assert plan.periods[0].decay_start_step == decay_start
    windows = [(max(0, m - window + 1), m) for m in range(interval, max_steps + 1, interval)]
    warned = [int(line.split()[3].rstrip(":")) for line in plan.warnings()]
    assert sorted(set(warned)) == reference_warned(windows, warmup, [(decay_start, max_steps)])


@given(
    st.lists(st.integers(1, 400), min_size=1, max_size=5),
    st.integers(0, 100),
    st.integers(1, 200),
    st.integers(0, 600),
)
def test_warnings_name_the_windows_that_reach_into_an_earlier_decay(periods, decay, window, warmup):
    """Short periods after long ones: a window reaches back into the previous period's decay."""
    assume(all(decay <= length for length in periods))
    merge_steps = reference_merge_steps(periods, 1, decay=decay)
    assume(all(m >= window for m in merge_steps) and len(set(merge_steps)) == len(merge_steps))
    plan = plan_from_schedule(periods, 1, window, decay=decay, warmup=warmup)
    ends = list(itertools.accumulate(periods))
    decays = [(end - decay, end) for end in ends]
    windows = [(max(0, m - window + 1), m) for m in merge_steps]
    warned = [int(line.split()[3].rstrip(":")) for line in plan.warnings()]
    assert sorted(set(warned)) == reference_warned(windows, warmup, decays)


def test_warning_lines_say_which_window_reaches_where():
    plan = plan_from_schedule([2000, 300], 1, 400, decay=200, warmup=2000)
    assert plan.warnings() == [
        "merge at step 1800: its window 1401-1800 starts inside the warmup, which ends at step 2000",
        "merge at step 2100: its window 1701-2100 starts inside the warmup, which ends at step 2000",
        "merge at step 2100: its window 1701-2100 reaches into the decay phase of period 1 (steps 1801-2000)",
    ]
    assert plan_from_schedule([2000, 300], 1, 400, decay=200, warmup=1401).warnings() == [
        "merge at step 2100: its window 1701-2100 reaches into the decay phase of period 1 (steps 1801-2000)"
    ]


def test_an_interval_plan_takes_its_decay_in_tokens_or_as_a_fraction():
    by_tokens = plan_from_interval(1000, 10000, 100, tokens_per_step=4 * 10**6, decay=8 * 10**9)
    assert by_tokens.periods[0].decay_start_step == 8000
    assert plan_from_interval(1000, 10000, 100, decay_fraction=0.25).periods[0].decay_start_step == 7500
    assert plan_from_interval(1000, 10000, 100).periods == ()
    with pytest.raises(CkptavgError, match="--decay is in tokens: give --tokens-per-step"):
        plan_from_interval(1000, 10000, 100, decay=10)
    with pytest.raises(CkptavgError, match="decay .50000000000 tokens. is longer than the run .40000000000 tokens."):
        plan_from_interval(1000, 10000, 100, tokens_per_step=4 * 10**6, decay=5 * 10**10)
