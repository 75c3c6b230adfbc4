"""Weighted means are the exact weighted sum correctly rounded, everywhere (issue 32, item 1).

The exact sum is that of the inputs times the normalised float64 weights the manifest records;
the reference (``tests/references.py``: ``weighted_correctly_rounded``) takes it with rationals
wherever a float64 sum could round otherwise. The inputs are built to cancel (the oldest
checkpoint is the value that makes the weighted sum nearly vanish), where an fp32 accumulator
came out up to 146 ulps off, and the weightings are ckptavg's own: minus-sqrt, EMA, WSM, WMA
(rational weights, whose sums lie within 2^-50 of a midpoint of the grid in a few percent of
the elements) and negative weights. Both the compiled loop and torch's ops
(``CKPTAVG_NATIVE=0``) must give those bits.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from checkpoint_builders import write_hf_checkpoint
from helpers import files_of, write_checkpoint
from helpers import run_cli_in_process as run_cli
from references import load_merged, same_bits, weighted_correctly_rounded

from ckptavg.merging.engine import EngineOptions, StreamingAverage
from ckptavg.merging.kernel import WeightedSum
from ckptavg.merging.native import native_mean
from ckptavg.weighting import Weighting, normalised
from tests.merging.test_engine_exactness import _engine_outputs, _readers


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("native-cache")


@pytest.fixture(autouse=True)
def compiled_once(module_cache, monkeypatch):
    """The loops compiled once for this module, from this checkout's native.c, into a cache of
    its own (test_native.py's tests, about the cache itself, compile each into theirs); each
    test loads them afresh and sees its own environment."""
    monkeypatch.setenv("CKPTAVG_CACHE_DIR", str(module_cache))
    monkeypatch.delenv("CKPTAVG_NATIVE", raising=False)
    native_mean.cache_clear()
    yield
    native_mean.cache_clear()


STEPS = [10, 20, 30, 40]
SCHEMES = {
    "minus-sqrt": Weighting("minus-sqrt"),
    "ema": Weighting("ema", ema_halflife=15),
    "wsm-cosine": Weighting("wsm", shape="cosine"),
    "wma": Weighting("wma"),
    "negative": Weighting("explicit", explicit=(-1.0, 0.5, 2.0, 1.3), allow_negative=True),
    "dyadic": Weighting("explicit", explicit=(1.0, 1.0, 2.0, 4.0)),
}


def cancelling(dtype: torch.dtype, weights: list[float], count: int = 3000) -> list[torch.Tensor]:
    """``len(weights)`` sources, oldest first: values over 24 binades (8 for fp16's range), the
    oldest chosen (in two elements of three) as the value of ``dtype`` nearest to what makes the
    weighted sum vanish, so that what is left is its own rounding error, far below the terms."""
    generator = torch.Generator().manual_seed(len(weights) + dtype.itemsize)
    span = 4 if dtype == torch.float16 else 12
    scales = torch.exp2(torch.randint(-span, span, (len(weights), count), generator=generator).double())
    sources = (torch.randn(len(weights), count, generator=generator, dtype=torch.float64) * scales).to(dtype)
    newer = sum(w * s.double() for w, s in zip(weights[1:], sources[1:], strict=True))
    oldest = (-newer / weights[0]).to(dtype)
    sources[0][count // 3 :] = oldest[count // 3 :]
    return list(sources)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Dyadic weights of few bits: every product exact in fp64, exact ties common (they round to even).
# Only bf16's fp32 sums of them rounded before; fp16's and fp32's were exact, and stay so.
CASES = [(d, s) for d in DTYPES for s in SCHEMES if s != "dyadic" or d == "bf16"]


@pytest.mark.parametrize(("dtype", "scheme"), CASES)
def test_weighted_means_of_cancelling_inputs_are_correctly_rounded(tmp_path, dtype, scheme):
    dtype = DTYPES[dtype]
    raw = SCHEMES[scheme].raw(STEPS)
    weights = normalised(raw, allow_negative=True)
    sources = cancelling(dtype, weights)
    folders = [write_checkpoint(tmp_path / f"step{s}", {"w": x}) for s, x in zip(STEPS, sources, strict=True)]
    want = weighted_correctly_rounded(sources, weights, dtype)
    # The adversary: the weighted sum in the accumulator of positive weights before (fp32 for
    # 16-bit inputs, fp64 for fp32, one rounding per product and sum) misses many elements.
    accumulator = torch.float64 if dtype == torch.float32 else torch.float32
    plain = torch.zeros(3000, dtype=accumulator)
    for source, weight in zip(sources, weights, strict=True):
        plain += source.to(accumulator) * weight
    assert int((plain.to(dtype) != want).sum()) >= 20
    for native in (True, False):
        for threads, chunk in [(1, 2**20), (3, 4096)]:
            options = EngineOptions(threads=threads, chunk_bytes=chunk, native=native)
            got = _engine_outputs(StreamingAverage(_readers(folders), raw, options))[0]["w"]
            wrong = int((~same_bits(got, want)).sum())
            assert wrong == 0, f"native={native}, threads={threads}: {wrong} of 3000 not correctly rounded"


def test_a_real_weighted_merge_is_correctly_rounded_everywhere(tmp_path, monkeypatch):
    """Four bf16 checkpoints of a tiny Llama (written by transformers' save_pretrained after a
    real AdamW step), merged through the command line with rational (wma) and irrational
    (minus-sqrt) weights: every element of every tensor is the exact weighted sum with the
    manifest's weights, correctly rounded, and torch's ops write the same files."""
    saved = {step: write_hf_checkpoint(tmp_path / "run", step, dtype=torch.bfloat16, scale=0.05) for step in STEPS}
    for scheme in ("wma", "minus-sqrt"):
        outputs = {}
        for native in ("1", "0"):
            monkeypatch.setenv("CKPTAVG_NATIVE", native)
            native_mean.cache_clear()
            out = tmp_path / f"{scheme}-{native}"
            result = run_cli("merge", str(tmp_path / "run"), "--last", "4", "--weighting", scheme, "--out", str(out))
            assert result.returncode == 0, result.stderr
            outputs[native] = out
        assert files_of(outputs["1"]) == files_of(outputs["0"])
        manifest = json.loads((outputs["1"] / "ckptavg-manifest.json").read_text())
        weights = normalised(manifest["weighting"]["unnormalised"])
        merged = load_merged(outputs["1"])
        assert merged
        elements = 0
        for name, tensor in merged.items():
            values = [saved[step][name] for step in STEPS]
            want = weighted_correctly_rounded(values, weights, torch.bfloat16).reshape(tensor.shape)
            assert bool(same_bits(tensor, want).all()), f"{scheme}: {name}"
            elements += tensor.numel()
        assert elements > 25_000


def near_edges(dtype: torch.dtype, count: int, n: int = 512 * 9 + 37) -> list[torch.Tensor]:
    """``count`` sources whose weighted means (weights summing to 1) fall within a few ulps of
    the places where rounding the fp64 sum's own bits can go wrong: on either side of powers of
    two (a carry into the exponent, the finer grid below), of the smallest normal value (the
    subnormals below), of the largest finite value, and of zero; each source is one target
    value moved by a few ulps of ``dtype`` (so the sums cover the midpoints between), mixed
    with easy elements in every block of 512."""
    generator = torch.Generator().manual_seed(count * 10 + dtype.itemsize)
    info = torch.finfo(dtype)
    edges = torch.tensor([1.0, 2.0**-3, 2.0**5, info.tiny, 2 * info.tiny, info.max, info.tiny / 4], dtype=torch.float64)
    pick = torch.randint(0, len(edges), (n,), generator=generator)
    signs = torch.randint(0, 2, (n,), generator=generator).double() * 2 - 1
    targets = edges[pick] * signs
    targets[::5] = torch.randn(len(targets[::5]), generator=generator, dtype=torch.float64)  # easy ones
    targets[3::97] = 0.0
    sources = []
    for _ in range(count):
        moved = targets * (1 + torch.randn(n, generator=generator, dtype=torch.float64) * 3 * info.eps)
        moved = moved + torch.randint(-3, 4, (n,), generator=generator).double() * info.smallest_normal * info.eps
        sources.append(moved.clamp(-info.max, info.max).to(dtype))
    return sources


def _assert_loop_correctly_rounded(sources, weights, dtype, loops, label="", want=None) -> None:
    """The compiled loop's weighted sum of ``sources`` is ``want`` (by default the rational
    reference), bit for bit, everywhere."""
    if want is None:
        want = weighted_correctly_rounded(sources, weights, dtype)
    got = torch.empty_like(sources[0])
    WeightedSum(got.numel()).mean(sources, weights, got, loops)
    wrong = (~same_bits(got, want)).nonzero().flatten()
    first = wrong[:5]
    assert len(wrong) == 0, f"{label}: {len(wrong)} wrong, first at {first.tolist()}: {got[first]} != {want[first]}"


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("count", [1, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("scheme", ["minus-sqrt", "dyadic", "wma"])
def test_the_compiled_loop_rounds_sums_at_the_edges_of_the_grid(dtype, count, scheme):
    """The compiled loop's fast path rounds the fp64 sums' bits itself and vouches for a whole
    block with one bound: against the rational reference, at powers of two, the smallest normal
    value, the largest finite value and zero, for sources added four per pass (and the rest),
    with irrational, dyadic (exact products) and rational weights."""
    loops = native_mean()
    assert loops is not None, "this machine has a C compiler: the compiled loop must build"
    if dtype not in loops.dtypes:  # fp16 without F16C: torch's ops (test_native says when)
        return
    raw = {
        "minus-sqrt": [1 / (i + 1) ** 0.5 for i in range(count)],
        "dyadic": [1.0] + [2.0 ** (i - 1) for i in range(1, count)],
        "wma": [float(i + 1) for i in range(count)],
    }[scheme]
    weights = normalised(raw)
    sources = near_edges(dtype, count)
    _assert_loop_correctly_rounded(sources, weights, dtype, loops)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dyadic_sums_whose_additions_lose_bits_are_not_taken_as_exact(dtype):
    """Dyadic weights make every product exact, and a sum whose every addition was exact is the
    exact sum (error 0); but inputs 60 binades apart make an addition inexact: 1, the midpoint's
    offset 2^-p and ±2^-70 (weights 1, 1, 2, 4 over 8) sum in fp64 to the very midpoint between
    two values of the grid, whose exact side only the lost 2^-70 decides. Planted among easy
    elements (in every block of 512), compiled loop and torch's ops, against the rational
    reference."""
    bits = 8 if dtype == torch.bfloat16 else 24
    generator = torch.Generator().manual_seed(7)
    n = 512 * 3 + 5
    sources = [torch.randn(n, generator=generator, dtype=torch.float64) for _ in range(4)]
    planted = torch.arange(3, n, 37)
    signs = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(len(planted))[: len(planted)]
    sides = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64).repeat(len(planted))[: len(planted)]
    sources[0][planted] = signs
    sources[1][planted] = signs * 2.0**-bits
    sources[2][planted] = signs * sides * 2.0**-70
    sources[3][planted] = 0.0
    sources = [s.to(dtype) for s in sources]
    weights = normalised([1.0, 1.0, 2.0, 4.0])
    want = weighted_correctly_rounded(sources, weights, dtype)
    assert not bool(same_bits(want[planted], (sources[0][planted].double() * (1 + 2.0**-bits) / 8).to(dtype)).all())
    loops = native_mean()
    assert loops is not None, "this machine has a C compiler: the compiled loop must build"
    for native in (loops, None):
        got = torch.empty_like(sources[0])
        WeightedSum(n).mean(sources, weights, got, native)
        wrong = (~same_bits(got, want)).nonzero().flatten()
        path = "compiled loop" if native else "torch's ops"
        assert len(wrong) == 0, f"{path}: {len(wrong)} wrong, first at {wrong[:5].tolist()}"


def near_midpoints(dtype: torch.dtype, weights: list[float], n: int = 512 * 2 + 13) -> list[torch.Tensor]:
    """Sources whose exact weighted sums lie within a few fp32 roundings (the fp32 pass's error
    bound, ``(len(weights) + 1) 2^-24 sum|w| max|x|``) of a midpoint of ``dtype``'s grid, on
    either side: the first sources near a target of magnitudes over the whole normal range (its
    bottom and top binades, and mantissas just above a power of two, where a rounding errs most
    relative to its value, included), the last three (two for fp16, fewer for fewer sources)
    each the value that brings the sum nearest the target in turn, so that the sum ends within
    ~2^-27 of it. In three elements of four the first sources are up to 2^8 times the target
    (the last ones cancel them). Not multiples of 8 or 512 long."""
    count = len(weights)
    generator = torch.Generator().manual_seed(count * 10 + dtype.itemsize)
    info = torch.finfo(dtype)
    bits, lowest, highest = 1 - int(math.log2(info.eps)), int(math.log2(info.tiny)), int(math.log2(info.max))
    exponent = torch.randint(lowest, highest, (n,), generator=generator)
    exponent[::7], exponent[1::7] = lowest, highest - 1
    mantissa = 1 + torch.rand(n, generator=generator, dtype=torch.float64)
    mantissa[::3] = 1 + torch.randint(0, 4, (len(mantissa[::3]),), generator=generator).double() * 2.0**-bits
    sign = torch.randint(0, 2, (n,), generator=generator).double() * 2 - 1
    grid = (sign * mantissa * torch.exp2(exponent.double())).to(dtype).double()  # a value of the grid
    midpoint = grid + sign * torch.exp2(exponent.double() - bits)
    total = sum(abs(w) for w in weights)
    bound = (count + 1) * 2.0**-24 * total * midpoint.abs()
    target = midpoint + torch.randn(n, generator=generator, dtype=torch.float64) * bound
    first = grid * torch.exp2(torch.randint(0, 9, (n,), generator=generator).double())
    first[1::4] = grid[1::4]
    tuners = min(count - 1, 3 if dtype == torch.bfloat16 else 2)
    rest, sources = target.clone(), []
    for k, weight in enumerate(weights):
        if k < count - tuners:
            share = first * (1 + torch.randn(n, generator=generator, dtype=torch.float64) * 2.0**-bits)
        else:  # the rest of the target, as far as this source's grid reaches
            share = rest / weight
        source = share.clamp(-info.max, info.max).to(dtype)
        rest = rest - weight * source.double()
        sources.append(source)
    return sources


FP32_PASS_SCHEMES = {
    "minus-sqrt": lambda count: [1 / (i + 1) ** 0.5 for i in range(count)],
    "wma": lambda count: [float(i + 1) for i in range(count)],
    "negative": lambda count: [-1.0] + [2.0] * (count - 1) if count > 1 else [1.0],
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("count", range(1, 10))
def test_the_fp32_pass_decides_sums_near_midpoints_exactly(dtype, count):
    """bf16 and fp16 outputs are first summed in fp32 and vouched for with a bound on that sum's
    error (native.c, "the fp32 pass"): against the rational reference, sums placed within that
    bound of the grid's midpoints on either side, cancelling ones, in the lowest and highest
    binades, 1 to 9 sources (four to a pass, and the rest), irrational, rational and negative
    weights (the schemes in one test: each test compiles the loops)."""
    loops = native_mean()
    assert loops is not None, "this machine has a C compiler: the compiled loop must build"
    if dtype not in loops.dtypes:  # fp16 without F16C: torch's ops (test_native says when)
        return
    for scheme, raw in FP32_PASS_SCHEMES.items():
        weights = normalised(raw(count), allow_negative=True)
        sources = near_midpoints(dtype, weights)
        _assert_loop_correctly_rounded(sources, weights, dtype, loops, scheme)


def neighbouring_steps(dtype: torch.dtype, count: int, n: int = 512 * 16 + 5) -> list[torch.Tensor]:
    """Benign data: ``count`` checkpoints of neighbouring training steps (one base plus noise of a
    tenth of it, as benchmarks/bench_weighted.py writes)."""
    generator = torch.Generator().manual_seed(count)
    base = torch.randn(n, generator=generator) * 0.02
    return [(base + torch.randn(n, generator=generator) * 0.002).to(dtype) for _ in range(count)]


@pytest.mark.parametrize(("dtype", "share"), [(torch.bfloat16, 0.02), (torch.float16, 0.1), (torch.float32, 1.0)])
def test_the_fp32_pass_vouches_for_nearly_every_element_of_benign_data(dtype, share):
    """The fp32 pass is what makes bf16 (and fp16) weighted means fast: on neighbouring training
    steps (8 sources, minus-sqrt weights) it must leave at most 2 % of bf16 elements (10 % of
    fp16's, 3 more bits) to the fp64 path, counted by the loops (ckptavg_fp64_elements), and
    fp32 outputs, which have no bits to spare, all; the outputs the rational reference's."""
    loops = native_mean()
    assert loops is not None, "this machine has a C compiler: the compiled loop must build"
    if dtype not in loops.dtypes:
        return
    weights = normalised([1 / (i + 1) ** 0.5 for i in range(8)])
    sources = neighbouring_steps(dtype, 8)
    n = sources[0].numel()
    got = torch.empty_like(sources[0])
    before = loops.fp64_elements()
    WeightedSum(n).mean(sources, weights, got, loops)
    summed = loops.fp64_elements() - before
    assert summed <= share * n, f"{summed} of {n} elements summed in fp64"
    if dtype != torch.float32:
        assert summed > 0  # the counter counts (some sums are near a midpoint)
    assert bool(same_bits(got, weighted_correctly_rounded(sources, weights, dtype)).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("count", [5, 7, 9])
def test_the_fp32_pass_bound_holds_where_every_rounding_errs_one_way(dtype, count):
    """The fp32 pass's bound, ``(count + 1) 2^-24 sum|w| max|x|``, is tight within a factor 2 on
    a sum built so that every fp32 rounding errs by nearly its most, all downward: x_1 = ±1 with
    w_1 = M - d + (1 - 2^-6) 2^-24 (M = 1 + half a spacing of the grid, a midpoint; d = (count
    - 1) // 2 fp32 ulps), whose fp32 rounding drops the last term, and count - 1 sources whose
    products (1 - 2^-6) 2^-24 each fmaf drops again (half an ulp of 1 is 2^-24). The fp32 sum is
    M - d, the exact one above M: it rounds up. The loops must send those elements to the fp64
    path (counted) and write the exact rounding; a bound of half (checked by hand) writes the
    fp32 sum's rounding there instead."""
    loops = native_mean()
    assert loops is not None, "this machine has a C compiler: the compiled loop must build"
    if dtype not in loops.dtypes:
        return
    bits = 8 if dtype == torch.bfloat16 else 11
    drop = 2.0**-24 - 2.0**-30  # below half an fp32 ulp of 1
    weights = [1 + 2.0**-bits - (count - 1) // 2 * 2.0**-23 + drop] + [2.0**-10] * (count - 1)
    n = 512 * 2 + 3
    generator = torch.Generator().manual_seed(count)
    values = torch.randn(count, n, generator=generator, dtype=torch.float64) * 0.02
    planted = torch.arange(5, n, 101)
    signs = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(len(planted))[: len(planted)]
    values[0, planted] = signs
    values[1:, planted] = signs * drop / 2.0**-10
    sources = list(values.to(dtype))
    assert bool((sources[1].double()[planted] == values[1, planted]).all())  # the tiny values are exact
    want = weighted_correctly_rounded(sources, weights, dtype)
    assert bool((want[planted].double() == signs * (1 + 2.0 ** (1 - bits))).all())  # rounded up
    before = loops.fp64_elements()
    _assert_loop_correctly_rounded(sources, weights, dtype, loops, want=want)
    assert loops.fp64_elements() - before >= len(planted)
