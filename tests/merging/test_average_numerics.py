"""Numerical contract of the average, against float64 references computed here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_builders import write_fp8_checkpoint
from helpers import make_run, write_checkpoint
from references import correctly_rounded, grid_of, load_merged, nearest_by_search, same_bits

import ckptavg
from ckptavg import CkptavgError, MergeOptions, Weighting
from ckptavg.io.files import RandomAccessFile


def _merge(root: Path, steps: list[int], weighting=None, **options) -> dict[str, torch.Tensor]:
    sources = [str(root / f"step{s}") for s in steps]
    result = ckptavg.average(
        sources, str(root / "out"), steps=steps, weighting=weighting, options=MergeOptions(**options)
    )
    return load_merged(Path(result.output))


@pytest.mark.parametrize("count", [2, 3, 5, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_mean_is_correctly_rounded(tmp_path, count, dtype):
    steps = [10 * (i + 1) for i in range(count)]
    shapes = {"embed": (300, 257), "w": (4099,), "scalar": ()}
    saved = make_run(tmp_path, steps, shapes, dtype=dtype)
    # A small chunk size so that tensors span many chunks, as a 7B embedding does.
    merged = _merge(tmp_path, steps, chunk_bytes=64 * 1024)
    for name in shapes:
        mean = sum(saved[s][name].double() for s in steps) / count
        reference = correctly_rounded(mean, dtype)
        assert merged[name].dtype == dtype
        assert bool(same_bits(merged[name], reference).all()), name


def test_bf16_values_spanning_many_magnitudes(tmp_path):
    """Worst case for an fp32 running sum: one element's values differ by up to 10^7 across
    inputs, so some sums are inexact. The promise is 99.99 % correctly rounded even here
    (100 % when the sum is exact, as in the test above)."""
    generator = torch.Generator().manual_seed(1)
    steps = [1, 2, 3]
    values = {}
    for s in steps:
        x = torch.randn(1_000_000, generator=generator) * torch.exp(4 * torch.randn(1_000_000, generator=generator))
        values[s] = x.to(torch.bfloat16)
        write_checkpoint(tmp_path / f"step{s}", {"x": values[s]})
    merged = _merge(tmp_path, steps)["x"]
    reference = correctly_rounded(sum(values[s].double() for s in steps) / 3, torch.bfloat16)
    assert same_bits(merged, reference).double().mean() >= 0.9999


def test_fp32_inputs_accumulate_in_fp64(tmp_path):
    steps = [1, 2, 3]
    saved = make_run(tmp_path, steps, {"w": (100_000,)}, dtype=torch.float32)
    merged = _merge(tmp_path, steps)["w"]
    mean = sum(saved[s]["w"].double() for s in steps) / 3
    assert merged.dtype == torch.float32
    assert bool(same_bits(merged, correctly_rounded(mean, torch.float32)).all())


def test_output_dtype_option(tmp_path):
    steps = [1, 2, 3]
    saved = make_run(tmp_path, steps, {"w": (5000,)}, dtype=torch.bfloat16)
    merged = _merge(tmp_path, steps, dtype=torch.float32)["w"]
    mean = sum(saved[s]["w"].double() for s in steps) / 3
    assert merged.dtype == torch.float32
    assert bool(same_bits(merged, correctly_rounded(mean, torch.float32)).all())
    merged64 = _merge(tmp_path, steps, dtype=torch.float64, force=True)["w"]
    assert torch.equal(merged64, mean)


def test_explicit_weights(tmp_path):
    steps = [1, 2, 3]
    saved = make_run(tmp_path, steps, {"w": (5000,)}, dtype=torch.float32)
    weights = [1.0, 2.0, 5.0]
    merged = _merge(tmp_path, steps, weighting=Weighting.from_options(weights=weights))["w"]
    reference = sum(w * saved[s]["w"].double() for w, s in zip(weights, steps, strict=True)) / 8
    assert torch.allclose(merged.double(), reference, rtol=2**-23, atol=0)


def test_integer_tensors_are_copied_not_averaged(tmp_path):
    for step in (1, 2):
        write_checkpoint(
            tmp_path / f"step{step}",
            {
                "w": torch.full((4,), float(step)),
                "steps": torch.tensor([7, 8], dtype=torch.int64),
                "mask": torch.tensor([True, False]),
            },
        )
    merged = _merge(tmp_path, [1, 2])
    assert torch.equal(merged["steps"], torch.tensor([7, 8]))
    assert torch.equal(merged["mask"], torch.tensor([True, False]))
    assert torch.equal(merged["w"], torch.full((4,), 1.5))


def test_integer_tensors_that_differ_are_an_error(tmp_path):
    for step in (1, 2):
        write_checkpoint(tmp_path / f"step{step}", {"counter": torch.tensor([step], dtype=torch.int64)})
    with pytest.raises(CkptavgError, match=r"'counter' differs between .*step1.* and .*step2"):
        _merge(tmp_path, [1, 2])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_input_is_refused_by_name(tmp_path, bad):
    make_run(tmp_path, [1, 2], {"a": (10,), "b": (1000,)})
    tensors = {"a": torch.zeros(10, dtype=torch.bfloat16), "b": torch.zeros(1000, dtype=torch.bfloat16)}
    tensors["b"][123] = bad
    write_checkpoint(tmp_path / "step2", tensors)
    with pytest.raises(CkptavgError, match=r"tensor 'b' in .*step2/model.safetensors holds (NaN|Inf) \(element 123\)"):
        _merge(tmp_path, [1, 2])
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    merged = _merge(tmp_path, [1, 2], allow_nonfinite=True)
    assert not bool(torch.isfinite(merged["b"][123]))


@pytest.mark.parametrize(
    ("dtype", "value", "out_dtype", "words"),
    [
        # The fp32 sum of bf16 values near the top of the range overflows.
        (torch.bfloat16, 3e38, None, "a torch.float32 sum written as torch.bfloat16"),
        # The mean is finite in float64 but not in the asked-for output dtype.
        (torch.float32, 1e5, torch.float16, "a torch.float64 sum written as torch.float16"),
    ],
)
def test_an_average_of_finite_inputs_that_overflows_is_refused(tmp_path, dtype, value, out_dtype, words):
    for step in (1, 2):
        w = torch.linspace(-1, 1, 5000, dtype=torch.float64).to(dtype)
        w[4321] = value
        write_checkpoint(tmp_path / f"step{step}", {"w": w})
    with pytest.raises(CkptavgError, match=rf"tensor 'w': the average of its finite inputs overflows \({words}\)"):
        _merge(tmp_path, [1, 2], dtype=out_dtype)
    assert not (tmp_path / "out").exists()
    merged = _merge(tmp_path, [1, 2], dtype=out_dtype, allow_nonfinite=True)["w"]
    assert bool(merged[4321].isinf()) and int((~torch.isfinite(merged)).sum()) == 1


def test_reads_are_bounded_by_the_chunk_size(tmp_path, monkeypatch):
    """Streaming: no read (hence no buffer) is larger than a chunk, whatever the tensor size."""
    make_run(tmp_path, [1, 2, 3, 4], {"big": (1_000_000,), "small": (10,)})
    sizes: list[int] = []
    original, original_view = RandomAccessFile.read_into, RandomAccessFile.local_view

    def recording(self, offset, buffer):
        sizes.append(len(buffer))
        return original(self, offset, buffer)

    def recording_view(self, offset, nbytes):  # mapped in place: the same bound on what is in use
        sizes.append(nbytes)
        return original_view(self, offset, nbytes)

    monkeypatch.setattr(RandomAccessFile, "read_into", recording)
    monkeypatch.setattr(RandomAccessFile, "local_view", recording_view)
    chunk = 256 * 1024
    _merge(tmp_path, [1, 2, 3, 4], chunk_bytes=chunk)
    assert max(sizes) <= chunk // 2  # bf16 inputs, fp32 accumulator of `chunk` bytes
    assert sum(s for s in sizes if s > 1000) >= 4 * 2_000_000


FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
FLOAT8_IDS = ["e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz"]


@pytest.mark.parametrize("dtype", FLOAT8, ids=FLOAT8_IDS)
def test_torchs_casts_from_fp32_to_float8_round_to_nearest_even(dtype):
    """The engine rounds a float8 mean with one cast from fp32 (after rounding to odd): torch's
    cast must be round to nearest even, which a search over every value of the format decides
    here, on each midpoint, its fp32 neighbours, and random values over the whole range (the
    subnormals included)."""
    grid, _ = grid_of(dtype)
    middles = ((grid[1:] + grid[:-1]) / 2).float()
    inf = torch.tensor(float("inf"))
    near_middles = torch.cat([middles, torch.nextafter(middles, inf), torch.nextafter(middles, -inf)])
    generator = torch.Generator().manual_seed(0)
    spread = torch.randn(200_000, generator=generator, dtype=torch.float64) * torch.exp2(
        torch.randint(-20, 17, (200_000,), generator=generator).double()
    )
    values = torch.cat([near_middles.double(), spread.float().double()])
    values = values[values.abs() <= grid.max()]
    assert bool((values.float().to(dtype).double() == nearest_by_search(values, 1, dtype)).all())


@pytest.mark.parametrize(
    ("dtype", "past_the_largest"),
    [
        (torch.float8_e4m3fn, 448.0),  # no Inf: saturates, even Inf itself
        (torch.float8_e5m2, float("inf")),
        (torch.float8_e4m3fnuz, float("nan")),  # no Inf: its one NaN
        (torch.float8_e5m2fnuz, float("nan")),
    ],
    ids=FLOAT8_IDS,
)
def test_what_torchs_casts_to_float8_do_past_the_largest_value(dtype, past_the_largest):
    """Why ckptavg never converts a mean into float8 (``output_specs`` refuses it): past the
    largest value, torch's cast gives 448 for e4m3fn, a finite number that no finiteness check
    can tell from a real one. A mean of float8 values in their own dtype never gets there: it
    lies between its smallest and largest source."""
    largest = float(grid_of(dtype)[0].max())
    beyond = torch.tensor([largest * 1.2, 1e30, float("inf")])
    assert torch.equal(
        beyond.to(dtype).double().nan_to_num(nan=7.0), torch.full((3,), past_the_largest).double().nan_to_num(nan=7.0)
    )


def _float8_values(dtype: torch.dtype, count: int, generator: torch.Generator) -> torch.Tensor:
    """Values drawn alike from every finite value of ``dtype``: the subnormals, zero and the
    largest as often as any."""
    grid, _ = grid_of(dtype)
    return grid[torch.randint(len(grid), (count,), generator=generator)].to(dtype)


@pytest.mark.parametrize("count", [2, 3, 7])
@pytest.mark.parametrize("dtype", FLOAT8, ids=FLOAT8_IDS)
def test_float8_mean_is_correctly_rounded(tmp_path, dtype, count):
    """Every element the value of ``dtype`` nearest to the exact mean, found by search (ties to
    even), over values spread across the whole range: sums of the largest and the smallest
    values, which an fp32 sum of e5m2 rounds (57344 + 2**-16), included."""
    generator = torch.Generator().manual_seed(count)
    steps = list(range(1, count + 1))
    saved = {
        s: {"w": _float8_values(dtype, 20_011, generator), "scalar": _float8_values(dtype, 1, generator)[0]}
        for s in steps
    }
    for s in steps:
        write_checkpoint(tmp_path / f"step{s}", saved[s])
    merged = _merge(tmp_path, steps, chunk_bytes=64 * 1024)
    for name in ("w", "scalar"):
        sums = sum(saved[s][name].double() for s in steps)  # exact: float8 values are multiples of 2**-17
        assert merged[name].dtype == dtype
        assert bool((merged[name].double() == nearest_by_search(sums, count, dtype)).all()), name


@pytest.mark.parametrize(
    ("out_dtype", "values", "mean"),
    [
        # 18432 + 2**-18 is past the midpoint of 16384 and 20480. An fp32 sum loses the 2**-16,
        # and torch's fp64 cast goes through fp32: either way the tie would round to 16384.
        (None, (57344.0, 16384.0, 0.0, 2**-16), 20480.0),
        (torch.bfloat16, (57344.0, 16384.0, 256.0, 2**-16), 18560.0),  # 18496 + 2**-18, past 18496
    ],
    ids=["float8", "bf16"],
)
def test_float8_sums_are_exact_and_rounded_once(tmp_path, out_dtype, values, mean):
    for step, value in enumerate(values, 1):
        write_checkpoint(tmp_path / f"step{step}", {"w": torch.full((3,), value).to(torch.float8_e5m2)})
    merged = _merge(tmp_path, list(range(1, 5)), dtype=out_dtype)["w"]
    assert merged.dtype == (out_dtype or torch.float8_e5m2)
    assert merged.double().tolist() == [mean] * 3


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_float8_means_written_wider_are_correctly_rounded(tmp_path, out_dtype):
    """``--dtype`` from float8: the exact mean rounded once to the output dtype (by search in
    bf16 and fp16; fp32 and fp64 hold the fp64 quotient of exact sums, rounded as IEEE divides)."""
    generator = torch.Generator().manual_seed(5)
    saved = {s: {"w": _float8_values(torch.float8_e5m2, 20_011, generator)} for s in (1, 2, 3)}
    for s, tensors in saved.items():
        write_checkpoint(tmp_path / f"step{s}", tensors)
    merged = _merge(tmp_path, [1, 2, 3], dtype=out_dtype)["w"]
    sums = sum(saved[s]["w"].double() for s in saved)
    # fp32, fp64: the IEEE quotient of the exact sums, cast to fp32 directly (torch's one cast that rounds once).
    wide = (sums / 3).to(out_dtype).double()
    reference = nearest_by_search(sums, 3, out_dtype) if out_dtype.itemsize == 2 else wide
    assert merged.dtype == out_dtype and bool((merged.double() == reference).all())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_an_fp64_mean_written_narrower_is_rounded_once(tmp_path, out_dtype):
    """fp32 inputs sum in fp64; torch's cast of the fp64 mean to bf16 or fp16 goes through fp32,
    rounding twice: a mean just past a midpoint of the output grid lands on it in fp32, and then
    rounds to even, the wrong way. The mean of two fp32 values is exact in fp64: every element
    must be its correctly rounded value."""
    spacing = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[out_dtype]
    generator = torch.Generator().manual_seed(3)
    first = torch.randn(100_000, generator=generator)
    second = (first.double() + torch.randn(100_000, generator=generator, dtype=torch.float64) * 1e-3).float()
    # 1 + spacing/2 (a midpoint) and one fp32 ulp more: their mean lies 2**-24 past the midpoint.
    first[:2], second[:2] = 1 + spacing / 2, torch.tensor(1 + spacing / 2 + 2**-23)
    write_checkpoint(tmp_path / "step1", {"w": first})
    write_checkpoint(tmp_path / "step2", {"w": second})
    merged = _merge(tmp_path, [1, 2], dtype=out_dtype)["w"]
    mean = (first.double() + second.double()) / 2
    assert float(merged[0]) == 1 + spacing
    assert bool(same_bits(merged, correctly_rounded(mean, out_dtype)).all())


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_float8_weights_that_share_their_scales_are_averaged_and_the_scales_copied(tmp_path, scale_fmt):
    """DeepSeek-V3's layout, quantized by transformers: where every step's block scales are the
    same bits (fp32, or e8m0 powers of two), the mean of the dequantized weights is the scale times
    the mean of the raw float8 values, which is averaged as any float8 tensor; the scales are
    copied, never averaged. A norm beside them averages as usual."""
    steps = [1, 2, 3]
    saved = {s: write_fp8_checkpoint(tmp_path, s, shared_scales=True, scale_fmt=scale_fmt) for s in steps}
    merged = _merge(tmp_path, steps)
    assert set(merged) == set(saved[3])
    for name, newest in saved[3].items():
        sums = sum(saved[s][name].double() for s in steps)
        if name.endswith("_scale_inv"):
            assert merged[name].dtype == newest.dtype and bool(same_bits(merged[name], newest).all()), name
        elif newest.dtype == torch.float8_e4m3fn:
            assert bool((merged[name].double() == nearest_by_search(sums, 3, newest.dtype)).all()), name
        else:
            assert bool(same_bits(merged[name], correctly_rounded(sums / 3, newest.dtype)).all()), name


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int32])
def test_an_output_dtype_that_is_not_an_average_is_refused(dtype):
    """Written as float8, a mean past 448 would come out as 448 from e4m3fn's saturating cast
    (test_what_torchs_casts_to_float8_do_past_the_largest_value): that is quantizing, refused
    when the options are made, for a merge and for the training hook alike."""
    from ckptavg import MergeHookConfig

    with pytest.raises(CkptavgError, match=rf"dtype: ckptavg writes averages as bf16, fp16, fp32 or fp64, not {dtype}"):
        MergeOptions(dtype=dtype)
    with pytest.raises(CkptavgError, match="ckptavg writes averages as"):
        MergeHookConfig(save_folder="unused", merge_steps=[10], window=2, dtype=dtype)
