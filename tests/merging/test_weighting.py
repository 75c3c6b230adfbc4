"""Weighting schemes (SMA, EMA, WMA, WSM, minus-sqrt, explicit) and partial windows.

The schemes are checked against their defining properties computed here in float64 (an EMA
halves over its half-life; minus-sqrt's tail sums trace 1 - sqrt(k/n); WSM's weights are
Megatron-LM's recurrence, written out here), and merges against a float64 weighted mean of the
inputs.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from helpers import files_of, make_run
from helpers import run_cli_in_process as run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from references import correctly_rounded, load_merged

import ckptavg
from ckptavg import CkptavgError
from ckptavg.merging.api import merge
from ckptavg.merging.discovery import window_gaps
from ckptavg.plan import sampled_steps
from ckptavg.weighting import Weighting, normalised

SHAPES = {"embed.weight": (64, 48), "layers.0.mlp.weight": (96, 40), "norm.weight": (40,)}


def test_uniform_weights_are_equal() -> None:
    assert Weighting().weights([10, 20, 30, 40]) == [0.25] * 4


def test_ema_halflife_halves_the_weight_over_that_many_steps() -> None:
    steps = list(range(100, 201, 5))
    w = Weighting("ema", ema_halflife=20).weights(steps)
    by_step = dict(zip(steps, w, strict=True))
    assert by_step[180] == pytest.approx(by_step[200] / 2, rel=1e-12)
    assert by_step[160] == pytest.approx(by_step[200] / 4, rel=1e-12)
    assert math.fsum(w) == pytest.approx(1.0, abs=1e-15)


def test_ema_alpha_is_a_bias_corrected_running_ema() -> None:
    """Normalised EMA weights over every step equal Adam-style bias-corrected EMA coefficients."""
    alpha, steps = 0.1, list(range(1, 31))
    m = [0.0] * len(steps)  # coefficient of each step in the running EMA, by recursion
    for t in range(len(steps)):
        m = [(1 - alpha) * c for c in m]
        m[t] += alpha
    correction = 1 - (1 - alpha) ** len(steps)
    expected = [c / correction for c in m]
    assert Weighting("ema", ema_alpha=alpha).weights(steps) == pytest.approx(expected, rel=1e-12)


def test_ema_counts_training_steps_not_checkpoints() -> None:
    """A strided window weighs each saved step as the every-step EMA would (up to normalising)."""
    beta = 0.97
    w = Weighting("ema", ema_alpha=1 - beta).weights([100, 110, 150])
    assert w[0] / w[2] == pytest.approx(beta**50, rel=1e-12)
    assert w[1] / w[2] == pytest.approx(beta**40, rel=1e-12)


def test_wma_grows_linearly() -> None:
    w = Weighting("wma").weights([5, 10, 15, 20])
    assert w == pytest.approx([0.1, 0.2, 0.3, 0.4], rel=1e-15)


def test_minus_sqrt_tail_sums_trace_a_minus_sqrt_cooldown() -> None:
    """Gradient k reaches the average with the weights after it: 1 - sqrt(k/n) for minus-sqrt."""
    n = 12
    w = Weighting("minus-sqrt").weights(list(range(n)))
    for k in range(n + 1):
        assert math.fsum(w[k:]) == pytest.approx(1 - math.sqrt(k / n), abs=1e-14)


def test_explicit_weights_are_normalised() -> None:
    assert Weighting.from_options(weights=[1, 3]).weights([7, 9]) == [0.25, 0.75]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scheme": "ema"}, "exactly one of --ema-alpha or --ema-halflife"),
        ({"scheme": "ema", "ema_alpha": 0.1, "ema_halflife": 5}, "exactly one"),
        ({"scheme": "ema", "ema_alpha": 1.5}, "1.5"),
        ({"scheme": "ema", "ema_halflife": -3}, "-3"),
        ({"scheme": "ema", "ema_halflife": 1e-320}, "at least 1e-300, got 1e-320"),
        ({"scheme": "ema", "ema_halflife": math.inf}, "inf"),
        ({"scheme": "ema", "ema_alpha": math.nan}, "nan"),
        ({"scheme": "explicit", "explicit": (math.inf, 1.0)}, "inf,1.0"),
        ({"scheme": "wma", "ema_alpha": 0.1}, "'wma'"),
        ({"scheme": "explicit", "explicit": (1.0, -1.0)}, "1.0,-1.0"),
        ({"scheme": "explicit", "explicit": (0.0, 0.0)}, "not all zero"),
        ({"scheme": "uniform", "explicit": (1.0,)}, "cannot be combined"),
        ({"scheme": "sma"}, "'sma'"),
    ],
)
def test_bad_weighting_options_name_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(CkptavgError, match=message.replace("(", r"\(")):
        Weighting(**kwargs)


def test_explicit_weights_must_match_the_checkpoints() -> None:
    with pytest.raises(CkptavgError, match="3 weights for 2 checkpoints"):
        Weighting.from_options(weights=[1, 2, 3]).weights([10, 20])


def test_an_ema_halflife_far_below_a_step_weighs_the_newest_step_alone() -> None:
    """0.5 ** (1 / 1e-4) underflows to 0 (its log is -inf); the weights come from its log,
    -log(2) / halflife, instead: older steps weigh 0, the newest 1, and the running form agrees."""
    scheme = Weighting("ema", ema_halflife=1e-4)
    assert scheme.weights([10, 20, 30]) == [0.0, 0.0, 1.0]
    assert [scheme.running([10, 20, 30], i) for i in range(3)] == [(1.0, 1.0), (0.0, 1.0), (0.0, 1.0)]
    assert scheme.describe()["ema_decay_per_step"] == 0.0


def test_weights_near_the_float_limit_normalise_without_overflow() -> None:
    """math.fsum of 1e308 + 1e308 overflows; summed after scaling by a power of two, it does not."""
    huge = Weighting.from_options(weights=[1e308, 1e308])
    assert huge.weights([1, 2]) == [0.5, 0.5]
    assert all(0 < weight <= 1 for _, weight in (huge.running([1, 2], i) for i in range(2)))  # the hook's sums
    big = math.ldexp(1.5, 1023)  # 1.5 * 2**1023: as 1.5, 1.5, 1.5 normalise, to the bit
    assert normalised([big, big, big]) == normalised([1.5, 1.5, 1.5])
    assert normalised([5e-324, 5e-324]) == [0.5, 0.5]  # the smallest subnormals, too
    with pytest.raises(CkptavgError, match="not all zero, got 0.0,0.0"):
        normalised([0.0, 0.0])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(1e-6, 1e6), min_size=1, max_size=20))
def test_normalising_is_exactly_dividing_by_the_sum(weights: list[float]) -> None:
    """The power-of-two scaling changes no bit of ordinary weights' normalised values."""
    assert normalised(weights) == [w / math.fsum(weights) for w in weights]


@settings(max_examples=200, deadline=None)
@given(
    scheme=st.sampled_from(["uniform", "ema", "wma", "minus-sqrt"]),
    gaps=st.lists(st.integers(1, 50), min_size=0, max_size=40),
    halflife=st.floats(0.5, 1e4),
)
def test_weights_are_a_monotone_distribution(scheme: str, gaps: list[int], halflife: float) -> None:
    """EMA and WMA never favour older steps; minus-sqrt does (its cooldown drops fastest first)."""
    steps = [1000]
    for gap in gaps:
        steps.append(steps[-1] + gap)
    w = Weighting(scheme, ema_halflife=halflife if scheme == "ema" else None).weights(steps)
    assert all(x >= 0 for x in w)
    assert math.fsum(w) == pytest.approx(1.0, abs=1e-12)
    newer_first = list(reversed(w)) if scheme == "minus-sqrt" else w
    assert all(b >= a * (1 - 1e-12) for a, b in zip(newer_first, newer_first[1:], strict=False))


def _weighted_reference(saved: dict, steps: list[int], weights: list[float]) -> dict[str, torch.Tensor]:
    total = math.fsum(weights)
    return {
        name: sum(saved[s][name].double() * (w / total) for s, w in zip(steps, weights, strict=True)) for name in SHAPES
    }


@pytest.mark.parametrize(
    ("options", "scheme_weights"),
    [
        (["--ema-halflife", "30"], lambda steps: [0.5 ** ((steps[-1] - s) / 30) for s in steps]),
        (["--weighting", "wma"], lambda steps: [float(i + 1) for i in range(len(steps))]),
        (
            ["--weighting", "minus-sqrt"],
            lambda steps: [math.sqrt((i + 1) / len(steps)) - math.sqrt(i / len(steps)) for i in range(len(steps))],
        ),
        (["--weights", "1,2,3,4,10"], lambda steps: [1.0, 2.0, 3.0, 4.0, 10.0]),
        (
            ["--weighting", "wsm:cosine"],
            lambda steps: megatron_recurrence("cosine", [i / len(steps) for i in range(len(steps))]),
        ),
        (
            ["--weighting", "wsm:poly:2:reverse", "--positions", "steps"],
            lambda steps: megatron_recurrence(
                "poly:2", [(len(steps) - 1) * (s - steps[0]) / (len(steps) * (steps[-1] - steps[0])) for s in steps]
            )[::-1],
        ),
    ],
    ids=["ema", "wma", "minus-sqrt", "explicit", "wsm-cosine", "wsm-poly2-steps-reverse"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_weighted_merge_matches_a_float64_reference(
    run_dir: Path, options: list[str], scheme_weights, dtype: torch.dtype
) -> None:
    steps = [960, 970, 980, 990, 1000]
    saved = make_run(run_dir, [900, *steps], SHAPES, dtype=dtype)
    result = run_cli("merge", str(run_dir), "--merge-step", "1000", "--window", "50", *options)
    assert result.returncode == 0, result.stderr
    merged = load_merged(run_dir / "step1000-merged")
    reference = _weighted_reference(saved, steps, scheme_weights(steps))
    for name, ref in reference.items():
        out = merged[name]
        assert out.dtype == dtype
        exact = correctly_rounded(ref, dtype)
        # Weights are applied in the accumulator's precision (fp32 for bf16, fp64 for fp32), so
        # a value may land one step away from the correctly rounded mean; never further.
        ulp = (exact.double().abs() * 2.0 ** -(7 if dtype == torch.bfloat16 else 23)).clamp(min=1e-30)
        assert torch.all((out.double() - ref).abs() <= ulp), name
        assert (out == exact).double().mean() > 0.95, name
    manifest = json.loads((run_dir / "step1000-merged" / "ckptavg-manifest.json").read_text())
    expected = [w / math.fsum(scheme_weights(steps)) for w in scheme_weights(steps)]
    assert [s["weight"] for s in manifest["sources"]] == pytest.approx(expected, rel=1e-12)
    assert manifest["method"] == manifest["weighting"]["scheme"] != "uniform"
    verified = run_cli("verify", str(run_dir / "step1000-merged"), "--against", str(run_dir), "--sample", "3")
    assert verified.returncode == 0, verified.stderr


@pytest.mark.parametrize("scheme", ["wma", "minus-sqrt"])
def test_schemes_by_place_need_no_steps_in_the_library(tmp_path: Path, scheme: str) -> None:
    """``average`` of folders named without steps: wma and minus-sqrt weigh each source by its
    place, as the same merge with explicit weights does, byte for byte."""
    make_run(tmp_path / "run", [10, 20, 30], SHAPES)
    sources = [str(tmp_path / "run" / f"step{s}") for s in (10, 20, 30)]
    ckptavg.average(sources, str(tmp_path / "placed"), weighting=Weighting(scheme))
    explicit = Weighting("explicit", explicit=tuple(Weighting(scheme).raw([1, 2, 3])))
    ckptavg.average(sources, str(tmp_path / "explicit"), weighting=explicit)
    assert files_of(tmp_path / "placed") == files_of(tmp_path / "explicit")


def test_a_weighting_is_one_merge_however_its_numbers_are_spelled(tmp_path: Path) -> None:
    """``ema_halflife=20`` (the library) and ``--ema-halflife 20`` (a float, the CLI) are one
    weighting: the same manifest, so a rerun through the other keeps the output."""
    assert Weighting("ema", ema_halflife=20) == Weighting("ema", ema_halflife=20.0)
    assert Weighting("ema", ema_halflife=20).describe() == Weighting("ema", ema_halflife=20.0).describe()
    assert Weighting("explicit", explicit=(1, 2)) == Weighting("explicit", explicit=(1.0, 2.0))
    make_run(tmp_path / "run", [10, 20, 30], SHAPES)
    done = run_cli("merge", str(tmp_path / "run"), "--merge-step", "30", "--window", "30", "--ema-halflife", "20")
    assert done.returncode == 0, done.stderr
    again = merge(str(tmp_path / "run"), merge_step=30, window=30, weighting=Weighting("ema", ema_halflife=20))
    assert again.already_merged


def test_ema_in_the_library_without_steps_is_one_line_asking_for_them(tmp_path: Path) -> None:
    make_run(tmp_path / "run", [10, 20], SHAPES)
    sources = [str(tmp_path / "run" / f"step{s}") for s in (10, 20)]
    with pytest.raises(
        CkptavgError, match=r"the ema weighting needs the training step of every source \(steps="
    ) as info:
        ckptavg.average(sources, str(tmp_path / "out"), weighting=Weighting("ema", ema_halflife=5))
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()


def test_uniform_default_stays_exact_and_unweighted(run_dir: Path) -> None:
    saved = make_run(run_dir, [10, 20, 30], SHAPES)
    merge(str(run_dir), merge_step=30, window=30)
    merged = load_merged(run_dir / "step30-merged")
    for name in SHAPES:
        ref = sum(saved[s][name].double() for s in (10, 20, 30)) / 3
        assert torch.equal(merged[name], correctly_rounded(ref, torch.bfloat16))
    manifest = json.loads((run_dir / "step30-merged" / "ckptavg-manifest.json").read_text())
    assert manifest["method"] == "uniform" and "weighting" not in manifest


def test_dry_run_shows_the_weights(run_dir: Path) -> None:
    make_run(run_dir, [10, 20], {"w": (4,)})
    result = run_cli("merge", str(run_dir), "--last", "2", "--weights", "1,3", "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert [s["weight"] for s in payload["sources"]] == [0.25, 0.75]
    assert payload["weighting"]["scheme"] == "explicit"


def test_weights_count_mismatch_is_one_line(run_dir: Path) -> None:
    make_run(run_dir, [10, 20], {"w": (4,)})
    result = run_cli("merge", str(run_dir), "--last", "2", "--weights", "1,2,3")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["ckptavg: error: --weights gives 3 weights for 2 checkpoints"]
    assert not (run_dir / "step20-merged").exists()


def test_weights_of_1e308_merge_as_equal_weights(run_dir: Path) -> None:
    make_run(run_dir, [10, 20], {"w": (64,)}, dtype=torch.float32)
    huge = run_cli("merge", str(run_dir), "--last", "2", "--weights", "1e308,1e308", "--out", str(run_dir / "huge"))
    assert huge.returncode == 0, huge.stderr
    ones = run_cli("merge", str(run_dir), "--last", "2", "--weights", "1,1", "--out", str(run_dir / "ones"))
    assert ones.returncode == 0, ones.stderr
    assert files_of(run_dir / "huge") == files_of(run_dir / "ones") != {}
    manifest = json.loads((run_dir / "huge" / "ckptavg-manifest.json").read_text())
    assert [s["weight"] for s in manifest["sources"]] == [0.5, 0.5]
    verified = run_cli("verify", str(run_dir / "huge"), "--against", str(run_dir))
    assert verified.returncode == 0, verified.stderr


def test_an_ema_halflife_of_1e_4_steps_merges_the_newest_checkpoint(run_dir: Path) -> None:
    saved = make_run(run_dir, [10, 20, 30], {"w": (64,)})
    result = run_cli("merge", str(run_dir), "--last", "3", "--ema-halflife", "1e-4")
    assert result.returncode == 0, result.stderr
    assert torch.equal(load_merged(run_dir / "step30-merged")["w"], saved[30]["w"])


# ---- WSM: weights from a decay shape -------------------------------------------------------

# The decays f(x) of the issue, written out here: 1 at x = 0, 0 at x = 1.
DECAYS = {
    "linear": lambda x: 1 - x,
    "1-sqrt": lambda x: 1 - math.sqrt(x),
    "cosine": lambda x: (1 + math.cos(math.pi * x)) / 2,
    "poly:2": lambda x: 1 - x**2,
    "poly:0.5": lambda x: 1 - x**0.5,
}


def megatron_recurrence(shape: str, positions: list[float]) -> list[float]:
    """Megatron-LM's coefficients: d[i] = f(x_i), c[N-1] = d[N-1], c[i] = d[i] - d[i+1] for
    0 < i < N-1, c[0] = 1 - d[1]; one checkpoint weighs 1."""
    n = len(positions)
    if n == 1:
        return [1.0]
    d = [DECAYS[shape](x) for x in positions]
    c = [0.0] * n
    c[n - 1] = d[n - 1]
    for i in range(1, n - 1):
        c[i] = d[i] - d[i + 1]
    c[0] = 1 - d[1]
    return c


@pytest.mark.parametrize("shape", sorted(DECAYS))
def test_wsm_weights_are_megatrons_recurrence_for_every_n(shape: str) -> None:
    """The raw weights are the recurrence to the bit (Megatron's own code takes c[0] as 1 minus
    the sum of the others: the same number up to its rounding), normalised they sum to 1."""
    for n in range(1, 65):
        expected = megatron_recurrence(shape, [i / n for i in range(n)])
        scheme = Weighting.parse(f"wsm:{shape}")
        assert scheme.raw(list(range(100, 100 + n))) == expected, n
        assert scheme.raw(list(range(n))) == Weighting("wsm", shape=shape).raw(list(range(n)))
        megatron_code = [1 - sum(expected[1:]), *expected[1:]]
        assert scheme.raw(list(range(n))) == pytest.approx(megatron_code, abs=1e-15)
        assert math.fsum(scheme.weights(list(range(n)))) == pytest.approx(1.0, abs=1e-15)


def test_wsm_1_sqrt_of_four_checkpoints_favours_the_oldest_as_the_issue_says() -> None:
    assert [round(w, 4) for w in Weighting.parse("wsm:1-sqrt").weights([10, 20, 30, 40])] == [
        0.5,
        0.2071,
        0.1589,
        0.1340,
    ]
    assert Weighting.parse("wsm:linear").weights(list(range(7))) == pytest.approx([1 / 7] * 7, rel=1e-14)


def test_minus_sqrt_is_wsm_1_sqrt_for_every_n() -> None:
    """One formula: the same numbers to the bit (and so the same merges)."""
    for n in range(1, 300):
        steps = list(range(n))
        assert Weighting("minus-sqrt").raw(steps) == Weighting.parse("wsm:1-sqrt").raw(steps), n
        assert [Weighting("minus-sqrt").running(steps, i) for i in range(n)] == [
            Weighting.parse("wsm:1-sqrt").running(steps, i) for i in range(n)
        ]


@pytest.mark.parametrize("shape", ["1-sqrt", "poly:2"])
def test_reverse_is_megatrons_reverse(shape: str) -> None:
    for n in (1, 2, 5, 12):
        forward = megatron_recurrence(shape, [i / n for i in range(n)])
        assert Weighting.parse(f"wsm:{shape}:reverse").raw(list(range(n))) == forward[::-1]


@settings(max_examples=300, deadline=None)
@given(
    shape=st.sampled_from(sorted(DECAYS)),
    first=st.integers(0, 10**12),
    gap=st.integers(1, 10**6),
    n=st.integers(1, 60),
    reverse=st.booleans(),
)
def test_evenly_spaced_steps_give_exactly_the_index_weights(
    shape: str, first: int, gap: int, n: int, reverse: bool
) -> None:
    steps = [first + i * gap for i in range(n)]
    by_steps = Weighting("wsm", shape=shape, positions="steps", reverse=reverse)
    by_index = Weighting("wsm", shape=shape, reverse=reverse)
    assert by_steps.raw(steps) == by_index.raw(steps)
    assert by_steps.weights(steps) == by_index.weights(steps)


@settings(max_examples=200, deadline=None)
@given(
    shape=st.sampled_from(sorted(DECAYS)),
    gaps=st.lists(st.integers(1, 1000), min_size=1, max_size=30),
)
def test_uneven_steps_are_placed_by_step(shape: str, gaps: list[int]) -> None:
    """x_i = (N-1)(s_i - s_0) / (N (s_last - s_0)), computed here with rationals: the window spans
    its steps and one mean gap; each checkpoint weighs the decay's drop over its own interval."""
    steps = [0]
    for gap in gaps:
        steps.append(steps[-1] + gap)
    n = len(steps)
    positions = [float(Fraction((n - 1) * (s - steps[0]), n * (steps[-1] - steps[0]))) for s in steps]
    scheme = Weighting("wsm", shape=shape, positions="steps")
    assert scheme.raw(steps) == megatron_recurrence(shape, positions)
    assert scheme.needs_steps and not Weighting("wsm", shape=shape).needs_steps
    # Tail sums trace the decay at each checkpoint's position (what makes the merge a decay).
    weights = scheme.raw(steps)
    for k in range(1, n):
        assert math.fsum(weights[k:]) == pytest.approx(DECAYS[shape](positions[k]), abs=1e-12)


def test_positions_steps_merges_uneven_checkpoints_by_their_steps(run_dir: Path) -> None:
    """Steps 900, 960, 990, 1000: the merge is the float64 weighted mean with the weights of the
    checkpoints placed by step (within one output ulp, as every weighted mean), the manifest says
    so, and ``verify --against`` recomputes it."""
    steps = [900, 960, 990, 1000]
    saved = make_run(run_dir, steps, SHAPES, dtype=torch.float32)
    options = ["--steps", ",".join(map(str, steps)), "--weighting", "wsm:1-sqrt", "--positions", "steps"]
    result = run_cli("merge", str(run_dir), *options)
    assert result.returncode == 0, result.stderr
    positions = [3 * (s - 900) / (4 * 100) for s in steps]  # (N-1)(s_i - s_0) / (N (s_last - s_0))
    weights = megatron_recurrence("1-sqrt", positions)
    assert weights != megatron_recurrence("1-sqrt", [i / 4 for i in range(4)])  # not the index weights
    merged = load_merged(run_dir / "step1000-merged")
    for name, ref in _weighted_reference(saved, steps, weights).items():
        ulp = (correctly_rounded(ref, torch.float32).double().abs() * 2.0**-23).clamp(min=1e-30)
        assert torch.all((merged[name].double() - ref).abs() <= ulp), name
    manifest = json.loads((run_dir / "step1000-merged" / "ckptavg-manifest.json").read_text())
    assert manifest["weighting"] == {
        "scheme": "wsm",
        "shape": "1-sqrt",
        "positions": "steps",
        "reverse": False,
        "unnormalised": weights,
    }
    verified = run_cli("verify", str(run_dir / "step1000-merged"), "--against", str(run_dir))
    assert verified.returncode == 0, verified.stderr


def test_wsm_tags_describe_and_parse() -> None:
    assert Weighting.parse("wsm:1-sqrt").tag() == "wsm-1-sqrt"
    assert Weighting.parse("wsm:poly:2.0:reverse").tag() == "wsm-poly2-reverse"
    assert Weighting.parse("wsm:poly:2.0") == Weighting.parse("wsm:poly:2")
    assert Weighting.parse("wsm:cosine", positions="steps").tag() == "wsm-cosine-steps"
    assert Weighting.parse("wsm:linear:reverse").describe() == {
        "scheme": "wsm",
        "shape": "linear",
        "positions": "index",
        "reverse": True,
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("wsm:quadratic", "unknown wsm shape 'quadratic'"),
        ("wsm:", "needs a decay shape"),
        ("wsm:reverse", "needs a decay shape"),
        ("wsm:poly:0", "P of poly:P must be a finite number above 0"),
        ("wsm:poly:x", "P of poly:P"),
        ("wsm:poly:inf", "P of poly:P"),
        ("uniform:reverse", "only wsm takes a shape"),
    ],
)
def test_bad_wsm_names_are_one_line_naming_them(text: str, message: str) -> None:
    with pytest.raises(CkptavgError, match=message):
        Weighting.parse(text)


def test_wsm_options_belong_to_wsm() -> None:
    with pytest.raises(CkptavgError, match="apply to the wsm weighting, not 'uniform'"):
        Weighting("uniform", positions="steps")
    with pytest.raises(CkptavgError, match="wsm positions must be one of index, steps, got 'time'"):
        Weighting("wsm", shape="linear", positions="time")
    with pytest.raises(CkptavgError, match="--positions applies to the wsm weighting, not 'wma'"):
        Weighting.from_options("wma", positions="steps")


def test_a_sweep_of_wsm_shapes_writes_each_as_its_own_merge(run_dir: Path) -> None:
    """``--weighting uniform,wsm:1-sqrt,wsm:cosine:reverse`` from one read, each candidate the
    bytes of its separate merge; ``minus-sqrt`` alone, the bytes of ``wsm:1-sqrt``."""
    make_run(run_dir, [10, 20, 30, 40], SHAPES)
    names = "uniform,wsm:1-sqrt,wsm:cosine:reverse"
    swept = run_cli("merge", str(run_dir), "--last", "4", "--weighting", names, "--out", str(run_dir / "sweep"))
    assert swept.returncode == 0, swept.stderr
    folders = sorted(p.name for p in (run_dir / "sweep").iterdir())
    assert folders == ["step40-merged-uniform", "step40-merged-wsm-1-sqrt", "step40-merged-wsm-cosine-reverse"]
    for name, scheme in [("wsm-1-sqrt", "wsm:1-sqrt"), ("wsm-cosine-reverse", "wsm:cosine:reverse")]:
        alone = run_cli("merge", str(run_dir), "--last", "4", "--weighting", scheme, "--out", str(run_dir / name))
        assert alone.returncode == 0, alone.stderr
        assert files_of(run_dir / "sweep" / f"step40-merged-{name}") == files_of(run_dir / name) != {}
    minus = run_cli("merge", str(run_dir), "--last", "4", "--weighting", "minus-sqrt", "--out", str(run_dir / "m"))
    assert minus.returncode == 0, minus.stderr
    assert files_of(run_dir / "m") == files_of(run_dir / "wsm-1-sqrt")


# ---- partial windows -----------------------------------------------------------------------


def _missing(found: list[int], merge_step: int, window: int, every: int | None = None) -> list[int]:
    """Every missing step of the window (listed without a cap: ``listed`` past the window's size)."""
    gaps = window_gaps(found, merge_step, window, every, listed=window + 1)
    assert gaps.count == len(gaps.first) and bool(gaps) == (gaps.count > 0)
    return list(gaps.first)


def test_window_gaps_infers_strided_saves() -> None:
    assert _missing([950, 960, 970, 980, 990, 1000], 1000, 60) == []
    gaps = window_gaps([950, 960, 980, 990, 1000], 1000, 60)
    assert (gaps.stride, gaps.count, gaps.first) == (10, 1, (970,))
    assert _missing([950, 960, 970, 980, 990], 1000, 60) == [1000]  # the merge step itself
    assert _missing([200, 250], 260, 100) == [260]  # saves every 50, off the merge step's grid
    # One save in a window of two cannot show its hole; --every can.
    assert _missing([1000], 1000, 100) == []
    assert _missing([1000], 1000, 100, every=50) == [950]


def test_window_gaps_of_a_huge_window_are_counted_not_listed() -> None:
    """A window of 10**15 steps (or past 2**63) holding two checkpoints costs two steps of work:
    the count and the first ten missing steps, never a set of every step."""
    step = 10**15
    gaps = window_gaps([step - 5, step], step, step, every=1)
    assert (gaps.count, gaps.first) == (step - 2, tuple(range(1, 11)))
    assert gaps.describe().startswith(f"{step - 2} steps: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 ... (checkpoints every step, ")
    top = 2**70  # past 2**63, where len() of a range fails
    inferred = window_gaps([top - 20, top - 10, top], top, top)  # saves every 10: the grid ends ..., top
    low = top % 10  # the grid's first step in the window [1, top]
    assert (inferred.stride, inferred.count) == (10, (top - low) // 10 + 1 - 3)
    assert inferred.first[:3] == (low, low + 10, low + 20)


@settings(max_examples=300, deadline=None)
@given(
    merge_step=st.integers(1, 10_000),
    window=st.integers(1, 500),
    every=st.integers(1, 60),
    data=st.data(),
)
def test_window_gaps_finds_exactly_the_removed_steps(merge_step: int, window: int, every: int, data) -> None:
    expected = list(sampled_steps(merge_step, window, every))
    removed = set(data.draw(st.sets(st.sampled_from(expected), max_size=len(expected) - 1)))
    found = [s for s in expected if s not in removed]
    assert _missing(found, merge_step, window, every) == sorted(removed)
    inferred = _missing(found, merge_step, window)
    assert set(inferred) <= removed  # never a step that is there or off the saving grid
    assert (merge_step in inferred) == (merge_step in removed)
    if not removed:  # a complete strided window needs no --every
        assert inferred == []
    listed = window_gaps(found, merge_step, window, every)  # the default: a count and the first ten
    assert (listed.count, listed.first) == (len(removed), tuple(sorted(removed)[:10]))


def test_a_window_with_a_missing_step_is_refused_by_default(run_dir: Path) -> None:
    make_run(run_dir, [950, 960, 980, 990, 1000], {"w": (8,)})
    result = run_cli("merge", str(run_dir), "--merge-step", "1000", "--window", "60")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "misses 1 step: 970" in lines[0] and "--allow-partial-window" in lines[0]
    assert not (run_dir / "step1000-merged").exists()
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".")]


def test_allow_partial_window_warns_naming_the_missing_steps(run_dir: Path) -> None:
    saved = make_run(run_dir, [950, 960, 980, 990], {"w": (8,)})
    result = run_cli("merge", str(run_dir), "--merge-step", "1000", "--window", "60", "--allow-partial-window")
    assert result.returncode == 0, result.stderr
    assert "warning: partial window: it misses 2 steps: 970, 1000" in result.stderr
    merged = load_merged(run_dir / "step1000-merged")
    ref = sum(saved[s]["w"].double() for s in saved) / 4
    assert torch.equal(merged["w"], correctly_rounded(ref, torch.bfloat16))


def test_every_reveals_a_hole_at_the_window_start(run_dir: Path) -> None:
    make_run(run_dir, [960, 980, 1000], {"w": (8,)})
    assert run_cli("merge", str(run_dir), "--merge-step", "1000", "--window", "60", "--dry-run").returncode == 0
    result = run_cli("merge", str(run_dir), "--merge-step", "1000", "--window", "60", "--every", "10", "--dry-run")
    assert result.returncode == 1
    assert "misses 3 steps: 970, 990, 950" not in result.stderr  # ascending, not a set's order
    assert "misses 3 steps: 950, 970, 990 (checkpoints every 10 steps, --every)" in result.stderr


# ---- the training hook: same schemes, same meaning ----------------------------------------

HOOK_SCHEMES = {
    "ema": Weighting("ema", ema_halflife=3),
    "wma": Weighting("wma"),
    "minus-sqrt": Weighting("minus-sqrt"),
    "wsm": "wsm:cosine:reverse",  # the hook reads the command line's names too
    "explicit": Weighting("explicit", explicit=(1, 0, 2, 5, 1)),
}


def _independent_weights(name: str, steps: list[int]) -> list[float]:
    if name == "ema":
        raw = [0.5 ** ((steps[-1] - s) / 3) for s in steps]
    elif name == "wma":
        raw = [float(i + 1) for i in range(len(steps))]
    elif name == "minus-sqrt":
        raw = [math.sqrt((i + 1) / len(steps)) - math.sqrt(i / len(steps)) for i in range(len(steps))]
    elif name == "wsm":
        raw = megatron_recurrence("cosine", [i / len(steps) for i in range(len(steps))])[::-1]
    else:
        raw = [1, 0, 2, 5, 1]
    return [w / math.fsum(raw) for w in raw]


@pytest.mark.parametrize("mode", ["accumulate", "snapshot"])
@pytest.mark.parametrize("name", sorted(HOOK_SCHEMES))
def test_hook_weighting_matches_a_float64_reference(tmp_path: Path, mode: str, name: str) -> None:
    """Window 12-20 every 2 (five steps): the hook's merge is the float64 weighted mean within
    the accumulator's rounding; snapshot merges, read back by `ckptavg merge`, too."""
    from training import Run

    options = {"merge_steps": [20], "window": 9, "every": 2, "mode": mode, "weighting": HOOK_SCHEMES[name]}
    run = Run(tmp_path, options, dtype=torch.float32)
    run.hook.pre_train(0)
    run.train(range(1, 21))
    run.hook.close()
    steps = [12, 14, 16, 18, 20]
    weights = _independent_weights(name, steps)
    merged = load_merged(tmp_path / "step20-merged")
    for tensor_name, out in merged.items():
        reference = sum(run.seen[s][tensor_name] * w for s, w in zip(steps, weights, strict=True))
        torch.testing.assert_close(out.double(), reference, rtol=2e-6, atol=1e-7)
    manifest = json.loads((tmp_path / "step20-merged" / "ckptavg-manifest.json").read_text())
    assert manifest["method"] == name
    assert [s["weight"] for s in manifest["sources"]] == pytest.approx(weights, rel=1e-12)


@pytest.mark.parametrize("resume_at", [13, 16])
def test_hook_ema_resume_is_bit_identical(tmp_path: Path, resume_at: int) -> None:
    """The running EMA (sums and total weight) survives a resume inside its window exactly."""
    from training import Run

    options = {"merge_steps": [20], "window": 9, "every": 1, "weighting": Weighting("ema", ema_alpha=0.3)}
    straight = Run(tmp_path / "straight", options)
    straight.hook.pre_train(0)
    straight.train(range(1, 21))
    straight.hook.close()
    first = Run(tmp_path / "resumed", options)
    first.hook.pre_train(0)
    first.train(range(1, resume_at + 1))
    checkpoint = first.checkpoint()
    first.train(range(resume_at + 1, resume_at + 3), seed=1)  # a lost timeline
    first.hook.close()
    second = Run.resumed(tmp_path / "resumed", options, checkpoint, resume_at)
    second.train(range(resume_at + 1, 21))
    second.hook.close()
    straight_files = files_of(tmp_path / "straight" / "step20-merged")
    assert files_of(tmp_path / "resumed" / "step20-merged") == straight_files != {}


def test_hook_refuses_to_continue_sums_with_another_weighting(tmp_path: Path) -> None:
    from training import Run

    options = {"merge_steps": [20], "window": 9, "weighting": Weighting("ema", ema_alpha=0.3)}
    first = Run(tmp_path, options)
    first.hook.pre_train(0)
    first.train(range(1, 15))
    checkpoint = first.checkpoint()
    first.hook.close()
    with pytest.raises(CkptavgError, match="open windows are weighted .*'ema'.* this hook weighs .*'wma'"):
        Run.resumed(tmp_path, {**options, "weighting": "wma"}, checkpoint, 14)


def test_hook_explicit_weights_must_fit_every_window(tmp_path: Path) -> None:
    from ckptavg import MergeHook, MergeHookConfig

    config = MergeHookConfig(
        save_folder=str(tmp_path), merge_steps=[20], window=9, weighting=Weighting("explicit", explicit=(1, 2))
    )
    hook = MergeHook(config)
    with pytest.raises(CkptavgError, match="--weights gives 2 weights for 9 checkpoints"):
        hook.pre_train(0)
    hook.close()


def test_running_factors_fold_into_the_offline_weights() -> None:
    steps = [3, 4, 7, 8, 15]
    for scheme in [*(Weighting.parse(s) if isinstance(s, str) else s for s in HOOK_SCHEMES.values()), Weighting()]:
        coefficients: list[float] = []
        total = 0.0
        for index in range(len(steps)):
            decay, weight = scheme.running(steps, index)
            coefficients = [c * decay for c in coefficients] + [weight]
            total = decay * total + weight
        assert [c / total for c in coefficients] == pytest.approx(scheme.weights(steps), rel=1e-12)
