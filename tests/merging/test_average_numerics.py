"""Numerical contract of the average, against float64 references computed here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import make_run, write_checkpoint
from references import correctly_rounded, load_merged, same_bits

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
