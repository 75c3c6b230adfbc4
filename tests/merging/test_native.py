"""The compiled mean loop (ckptavg/merging/native.c) writes torch's bits, refuses what torch's path
refuses, and merges fall back to torch's ops wherever it cannot be had."""

from __future__ import annotations

import math
import os
import platform

import pytest
import torch

from ckptavg.errors import CheckpointError
from ckptavg.merging import native as native_module
from ckptavg.merging.engine import EngineOptions, StreamingAverage
from ckptavg.merging.kernel import WeightedSum, finish_mean
from ckptavg.merging.native import NativeMean, native_mean, torch_mean
from tests.helpers import write_checkpoint
from tests.merging.test_engine_exactness import _assert_identical, _engine_outputs, _readers, reference
from tests.references import correctly_rounded, weighted_correctly_rounded


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test compiles into its own cache and sees its own environment."""
    monkeypatch.setenv("CKPTAVG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CKPTAVG_NATIVE", raising=False)
    native_mean.cache_clear()
    yield
    native_mean.cache_clear()


def _adversarial(seed: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    """Magnitudes over many binades (sums that are not exact in the accumulator, so the order of
    additions shows), signed zeros, subnormals, and values on the output's rounding ties."""
    generator = torch.Generator().manual_seed(seed)
    span = min(40, int(math.log2(torch.finfo(dtype).max)) - 6)  # fp16: 2^-10..2^10, all finite
    values = torch.randn(n, generator=generator, dtype=torch.float64) * torch.exp2(
        torch.randint(-span, span, (n,), generator=generator).double()
    )
    values[::11] = -0.0
    values[5::13] = torch.finfo(dtype).tiny / 8 * torch.randint(1, 8, (len(values[5::13]),), generator=generator)
    # 1 and its upper neighbour in alternate sources: means of two land halfway between them.
    values[7::17] = 1.0 + torch.finfo(dtype).eps * (seed % 2)
    return values.to(dtype)


class CountingNative(NativeMean):
    """The compiled loop, counting its calls (so that a test sees which path ran)."""

    calls = 0

    def mean(self, *args, **kwargs):
        CountingNative.calls += 1
        return super().mean(*args, **kwargs)

    def weighted(self, *args, **kwargs):
        CountingNative.calls += 1
        return super().weighted(*args, **kwargs)


def _counting(monkeypatch) -> None:
    built = native_mean()
    assert built is not None, "this machine has a C compiler: the compiled loop must build"
    counting = CountingNative.__new__(CountingNative)
    counting.__dict__.update(built.__dict__)
    CountingNative.calls = 0
    monkeypatch.setattr("ckptavg.merging.engine.native_mean", lambda: counting)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("sources", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("weighted", [False, True], ids=["uniform", "weighted"])
def test_compiled_loop_writes_the_bits_of_torchs_ops(tmp_path, monkeypatch, dtype, sources, weighted):
    _counting(monkeypatch)
    weights = [0.5 + (7 * i % 5) / 3 for i in range(sources)] if weighted else None
    lengths = {"long": 100_003, "short": 5, "one": 1, "block_edge": 512 * 3 + 1}
    saved = [{name: _adversarial(7 * i + len(name), dtype, n) for name, n in lengths.items()} for i in range(sources)]
    folders = [write_checkpoint(tmp_path / f"step{i}", t) for i, t in enumerate(saved)]
    for threads, use_mmap, chunk in [(1, False, 2**20), (3, True, 4096)]:
        base = {"threads": threads, "mmap": use_mmap, "chunk_bytes": chunk}
        outputs = {}
        for path, options in {
            "torch's ops": EngineOptions(**base, native=False),
            "torch's ops, --allow-nonfinite": EngineOptions(**base, allow_nonfinite=True),
            "compiled loop": EngineOptions(**base),
        }.items():
            calls = CountingNative.calls
            outputs[path] = _engine_outputs(StreamingAverage(_readers(folders), weights, options))[0]
            assert (CountingNative.calls > calls) == (path == "compiled loop" and dtype in native_mean().dtypes), path
        for name in lengths:
            want = reference([s[name] for s in saved], weights)
            for path, output in outputs.items():
                _assert_identical(output[name], want, f"{path}: {name}")


def test_compiled_loop_rounds_uniform_bf16_means_correctly(tmp_path, monkeypatch):
    """Against an independent reference: the float64 mean rounded once (exact sums here)."""
    _counting(monkeypatch)
    generator = torch.Generator().manual_seed(3)
    saved = [{"w": torch.randn(50_000, generator=generator).to(torch.bfloat16)} for _ in range(3)]
    folders = [write_checkpoint(tmp_path / f"step{i}", t) for i, t in enumerate(saved)]
    merged = _engine_outputs(StreamingAverage(_readers(folders), None, EngineOptions(threads=2)))[0]
    assert CountingNative.calls > 0
    mean = torch.stack([s["w"].double() for s in saved]).mean(0)
    _assert_identical(merged["w"], correctly_rounded(mean, torch.bfloat16), "w")


@pytest.mark.parametrize(
    ("dtype", "poison", "message"),
    [
        (torch.bfloat16, float("nan"), r"tensor 'w' in .*step1/model.safetensors holds NaN \(element 4321\)"),
        (torch.float32, float("inf"), r"tensor 'w' in .*step1/model.safetensors holds Inf \(element 4321\)"),
        (torch.bfloat16, 3.0e38, r"tensor 'w': the average of its finite inputs overflows"),
        (torch.float16, float("nan"), r"tensor 'w' in .*step1/model.safetensors holds NaN \(element 4321\)"),
        (torch.float16, float("-inf"), r"tensor 'w' in .*step1/model.safetensors holds Inf \(element 4321\)"),
    ],
)
def test_compiled_loop_refuses_what_torchs_path_refuses(tmp_path, monkeypatch, dtype, poison, message):
    _counting(monkeypatch)
    saved = [{"w": torch.ones(10_000, dtype=dtype)} for _ in range(3)]
    saved[1]["w"][4321] = poison
    if poison == 3.0e38:  # finite everywhere, but the sum of three leaves the accumulator's range
        for s in saved:
            s["w"][4321] = poison
    folders = [write_checkpoint(tmp_path / f"step{i}", t) for i, t in enumerate(saved)]
    with pytest.raises(CheckpointError, match=message):
        _engine_outputs(StreamingAverage(_readers(folders), None, EngineOptions(threads=2, chunk_bytes=4096)))
    assert (CountingNative.calls > 0) == (dtype in native_mean().dtypes)


@pytest.mark.parametrize(
    "environment",
    [{"CKPTAVG_NATIVE": "0"}, {"CC": "/nonexistent/cc"}, {"CC": "false"}],
    ids=["switched-off", "no-compiler", "failing-compiler"],
)
def test_merges_fall_back_to_torchs_ops(tmp_path, monkeypatch, environment):
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    assert native_mean() is None
    saved = [{"w": _adversarial(i, torch.bfloat16, 3000)} for i in range(3)]
    folders = [write_checkpoint(tmp_path / f"step{i}", t) for i, t in enumerate(saved)]
    merged = _engine_outputs(StreamingAverage(_readers(folders), None, EngineOptions(threads=2)))[0]
    _assert_identical(merged["w"], reference([s["w"] for s in saved]), "w")
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-built left behind


def test_the_build_is_cached_and_reused(tmp_path):
    assert native_mean() is not None
    (library,) = (tmp_path / "cache").glob("native-*.so")
    built_at = library.stat().st_mtime_ns
    native_mean.cache_clear()
    assert native_mean() is not None
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [library.name]  # no temporaries left
    assert library.stat().st_mtime_ns == built_at
    assert oct(os.stat(tmp_path / "cache").st_mode & 0o777) == oct(0o700)
    assert native_module.SOURCE.exists()


def test_no_library_is_loaded_from_a_folder_others_can_write(tmp_path):
    (tmp_path / "cache").mkdir(mode=0o700)
    assert native_mean() is not None  # builds there while the folder is private
    (tmp_path / "cache").chmod(0o777)
    native_mean.cache_clear()
    assert native_mean() is None


def _fp16_loop_expected() -> bool:
    """Whether this is an x86-64 CPU with F16C, AVX2 and FMA, as Linux reports them
    (independently of the loop's own cpuid check)."""
    if platform.machine() != "x86_64":
        return False
    with open("/proc/cpuinfo") as info:
        flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    return "f16c" in flags and "avx2" in flags and "fma" in flags


def test_fp16_takes_the_compiled_loop_where_the_cpu_has_f16c():
    loops = native_mean()
    assert loops is not None
    assert {torch.bfloat16, torch.float32} <= set(loops.dtypes)
    assert (torch.float16 in loops.dtypes) == _fp16_loop_expected()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_finite_16_bit_value_survives_a_mean_of_one(dtype):
    """Every finite bf16 or fp16 pattern, converted to the sum and rounded back, is itself (the
    conversion is exact and the rounding keeps representable values), and a mean of two
    random tensors equals torch's, ties and subnormals included."""
    loops = native_mean()
    assert loops is not None
    if dtype not in loops.dtypes:  # fp16 without F16C: torch's ops (the test above says when)
        assert dtype == torch.float16 and not _fp16_loop_expected()
        return
    generator = torch.Generator().manual_seed(11)
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    every = every[torch.isfinite(every)].contiguous()
    out = torch.empty_like(every)
    assert loops.mean(dtype, [every.data_ptr()], every.numel(), out.data_ptr(), divisor=1.0)
    _assert_identical(out, every, str(dtype))
    low, high = (-26, 14) if dtype == torch.bfloat16 else (-26, 13)  # fp16: subnormals below 2^-14
    span = torch.randint(low, high, (2, 200_000), generator=generator).float()
    a, b = (torch.randn(2, 200_000, generator=generator) * torch.exp2(span)).to(dtype)
    for divisor in (2.0, 3.0):
        want = ((a.float() + b.float()) / divisor).to(dtype)
        got = torch.empty_like(a)
        addresses = [a.data_ptr(), b.data_ptr()]
        finite = loops.mean(dtype, addresses, a.numel(), got.data_ptr(), divisor=divisor)
        assert finite == bool(torch.isfinite(want).all())
        _assert_identical(got, want, f"{dtype} / {divisor}")


def test_loops_that_round_otherwise_than_torch_are_not_used(monkeypatch):
    """The check against torch's ops at load time: a disagreement leaves the work to torch."""

    def perturbed_finish_mean(total, out, scratch, divisor):
        finish_mean(total, out, scratch, divisor)
        out[-1:].view(torch.int16 if out.element_size() == 2 else torch.int32).add_(1)  # one ulp off

    assert native_mean() is not None
    monkeypatch.setattr(native_module, "finish_mean", perturbed_finish_mean)
    native_mean.cache_clear()
    assert native_mean() is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_the_elements_past_the_last_vector_round_as_torchs_ops_do(dtype):
    """Calls of 1-7 elements run only the scalar tails of the vector loops: thousands of them,
    weighted and uniform, against torch's ops over the same elements."""
    loops = native_mean()
    assert loops is not None
    if dtype not in loops.dtypes:
        assert dtype == torch.float16 and not _fp16_loop_expected()
        return
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    n = 7 * 4000
    sources = torch.stack([_adversarial(seed, dtype, n) for seed in range(3)])
    for weights in (None, (0.3, 0.45, 0.25)):
        want = torch_mean(sources, weights)
        got = torch.empty(n, dtype=dtype)
        item = dtype.itemsize
        start = 0
        while start < n:
            length = min(1 + start % 7, n - start)
            if weights is None:
                addresses = [source.data_ptr() + start * item for source in sources]
                loops.mean(dtype, addresses, length, got.data_ptr() + start * item, 3.0)
            else:
                part = [source[start : start + length] for source in sources]
                WeightedSum(16).mean(part, weights, got[start : start + length], loops)
            start += length
        assert torch.equal(got.view(bits), want.view(bits)), f"{dtype}, weights {weights}"


def test_the_baseline_build_writes_the_bits_of_the_clones_this_cpu_picks(monkeypatch):
    """``CKPTAVG_NATIVE_BASELINE=1`` builds the loops without their AVX2 + FMA clones (the code a
    CPU without AVX2 runs: SSE2 vectors, fma() from libm) into a cache entry of its own; it passes
    the check against torch's ops, leaves fp16 to them, and writes the bits of the build this CPU
    picks: uniform and weighted (irrational, rational, dyadic and negative weights), adversarial
    values, against torch's ops and the rational reference."""
    picked = native_mean()
    assert picked is not None
    monkeypatch.setenv("CKPTAVG_NATIVE_BASELINE", "1")
    native_mean.cache_clear()
    baseline = native_mean()
    assert baseline is not None, "the baseline build must agree with torch's ops"
    assert torch.float16 not in baseline.dtypes
    assert len(list(native_module.cache_dir().glob("native-*.so"))) == 2
    raw = {
        "minus-sqrt": [1 / math.sqrt(i + 1) for i in range(5)],
        "wma": [float(i + 1) for i in range(5)],
        "dyadic": [1.0, 1.0, 2.0, 4.0, 8.0],
        "negative": [-1.0, 2.0, 2.0, 2.0, 2.0],
    }
    for dtype in (torch.bfloat16, torch.float32):
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        n = 512 * 5 + 3
        sources = torch.stack([_adversarial(seed, dtype, n) for seed in range(5)])
        want = torch_mean(sources)
        for loops in (picked, baseline):
            got = torch.empty(n, dtype=dtype)
            loops.mean(dtype, [source.data_ptr() for source in sources], n, got.data_ptr(), 5.0)
            assert torch.equal(got.view(bits), want.view(bits)), f"{dtype}, uniform"
        for name, weights in raw.items():
            weights = [w / sum(weights) for w in weights]
            want = weighted_correctly_rounded(list(sources), weights, dtype).view(bits)
            for loops in (picked, baseline):
                got = torch.empty(n, dtype=dtype)
                WeightedSum(n).mean(list(sources), weights, got, loops)
                assert torch.equal(got.view(bits), want), f"{dtype}, {name}"
