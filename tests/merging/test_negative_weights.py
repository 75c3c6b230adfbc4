"""Extrapolation and subtractive merges: ``--weights`` with negative values.

Every output element must be the exact weighted sum of the inputs with the normalised float64
weights correctly rounded (round to nearest, ties to even), and for an fp64 output within one ulp
of it, which the tests compute with rationals, element by element. The inputs are built to
cancel: the oldest checkpoint is chosen as the value that makes the weighted sum nearly vanish,
so that an accumulator's rounding errors, bounded by the size of the terms, would be many ulps of
the result.
"""

from __future__ import annotations

import hashlib
import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from helpers import files_of, write_checkpoint
from helpers import run_cli_in_process as run_cli
from references import load_merged, nearest_rational

import ckptavg
from ckptavg import CkptavgError, MergeHookConfig, Weighting
from ckptavg.merging import kernel
from ckptavg.merging.kernel import WeightedSum

WEIGHTS = (3.4, -1.0, -0.4)  # normalised: 1.7, -0.5, -0.2
# Significant bits and smallest normal exponent of each dtype, for its ulp (written out here).
PRECISION = {
    torch.bfloat16: (8, -126),
    torch.float16: (11, -14),
    torch.float32: (24, -126),
    torch.float64: (53, -1022),
    torch.float8_e4m3fn: (4, -6),
    torch.float8_e5m2: (3, -14),
}
DTYPES = list(PRECISION)


def ulp(value: Fraction, dtype: torch.dtype) -> Fraction:
    """The spacing of ``dtype`` at ``value`` (subnormals included), as a rational."""
    bits, lowest = PRECISION[dtype]
    exponent = lowest if value == 0 else max(math.frexp(abs(float(value)))[1] - 1, lowest)
    return Fraction(2) ** (exponent - bits + 1)


def exact_sums(sources: list[torch.Tensor], weights: list[float]) -> list[Fraction]:
    """The exact weighted sum of every element, with rationals."""
    columns = zip(*(source.double().tolist() for source in sources), strict=True)
    return [
        sum((Fraction(w) * Fraction(v) for w, v in zip(weights, column, strict=True)), Fraction(0))
        for column in columns
    ]


def ulps_off(out: torch.Tensor, exact: list[Fraction]) -> list[Fraction]:
    return [abs(Fraction(v) - r) / ulp(r, out.dtype) for v, r in zip(out.double().tolist(), exact, strict=True)]


def cancelling_sources(dtype: torch.dtype, count: int = 1500, seed: int = 0) -> list[torch.Tensor]:
    """Three sources, oldest first, whose weighted sum (``WEIGHTS``) nearly cancels: the oldest
    is the value of ``dtype`` nearest to what makes it vanish. Also exact cancellation, values
    2^100 apart (2^100 - 2^100 + 2^-100) where the range allows, signed zeros and subnormals."""
    generator = torch.Generator().manual_seed(seed)
    w = [x / math.fsum(WEIGHTS) for x in WEIGHTS]
    newer = [torch.randn(count, generator=generator, dtype=torch.float64).to(dtype) for _ in range(2)]
    oldest = (-(w[1] * newer[0].double() + w[2] * newer[1].double()) / w[0]).to(dtype)
    big, small = {torch.float16: (2.0**10, 2.0**-14), torch.float8_e4m3fn: (2.0**4, 2.0**-6)}.get(
        dtype, (2.0**98, 2.0**-100)
    )
    if dtype == torch.float8_e5m2:
        big, small = 2.0**10, 2.0**-14
    # Columns of (oldest, middle, newest): 1.7 * 5 big - 0.5 * 17 big cancels up to the weights'
    # own rounding, far below the terms; zeros of both signs; the smallest normals.
    tiny = torch.finfo(dtype).tiny
    special = [(5 * big, 17 * big, small), (0.0, -0.0, 0.0), (tiny, tiny, -tiny), (1.0, 3.4, 0.0)]
    sources = [oldest, *newer]
    for column, values in enumerate(special):
        for source, value in zip(sources, values, strict=True):
            source[column] = value
    return sources


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32", "fp64", "e4m3fn", "e5m2"])
def test_extrapolation_is_within_one_ulp_of_the_exact_weighted_sum(tmp_path: Path, dtype: torch.dtype) -> None:
    """Through the command line: every element within one ulp of the exact sum, and the same
    bytes for any thread count and chunk size (the sum is elementwise)."""
    sources = cancelling_sources(dtype)
    for step, source in zip((10, 20, 30), sources, strict=True):
        write_checkpoint(tmp_path / "run" / f"step{step}", {"w": source})
    weights = ",".join(map(str, WEIGHTS))
    merged = run_cli("merge", str(tmp_path / "run"), "--last", "3", "--weights", weights, "--allow-negative-weights")
    assert merged.returncode == 0, merged.stderr
    out_folder = tmp_path / "run" / "step30-merged"
    out = load_merged(out_folder)["w"]
    normalised = [w / math.fsum(WEIGHTS) for w in WEIGHTS]
    exact = exact_sums(sources, normalised)
    assert max(ulps_off(out, exact)) <= 1
    if dtype != torch.float64:
        assert out.double().tolist() == [nearest_rational(r, dtype) for r in exact]
    assert out[1].item() == 0.0
    # The adversary: summed as positive weights are (fp32 for 16-bit inputs, fp64 for fp32 and
    # fp64, products rounded), many elements would be ulps away. (Float8 values have so few bits
    # that their fp64 sums are all but exact: for them the point is one rounding of the sum.)
    if dtype.itemsize > 1:
        accumulator = torch.float64 if dtype.itemsize >= 4 else torch.float32
        plain = sum(s.to(accumulator) * w for s, w in zip(sources, normalised, strict=True)).to(dtype)
        assert sum(off > 1 for off in ulps_off(plain, exact)) >= 5
    again = run_cli(
        "merge",
        str(tmp_path / "run"),
        "--last",
        "3",
        "--weights",
        weights,
        "--allow-negative-weights",
        "--threads",
        "3",
        "--chunk-size",
        "1KiB",
        "--out",
        str(tmp_path / "threads"),
    )
    assert again.returncode == 0, again.stderr
    assert files_of(tmp_path / "threads") == files_of(out_folder)


def test_the_manifest_records_negative_weights_and_verify_recomputes_them(tmp_path: Path) -> None:
    sources = cancelling_sources(torch.bfloat16, count=300)
    for step, source in zip((10, 20, 30), sources, strict=True):
        write_checkpoint(tmp_path / "run" / f"step{step}", {"w": source})
    result = run_cli("merge", str(tmp_path / "run"), "--last", "3", "--weights=3.4,-1,-0.4", "--allow-negative-weights")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "run" / "step30-merged"
    manifest = json.loads((out / "ckptavg-manifest.json").read_text())
    assert manifest["weighting"] == {
        "scheme": "explicit",
        "given": [3.4, -1.0, -0.4],
        "unnormalised": [0.85, -0.25, -0.1],  # scaled by a power of two: the same ratios
        "negative_weights": True,
    }
    assert [s["weight"] for s in manifest["sources"]] == pytest.approx([1.7, -0.5, -0.2], rel=1e-15)
    assert "compensated" in manifest["dtype_policy"]["accumulate"]
    verified = run_cli("verify", str(out), "--against", str(tmp_path / "run"))
    assert verified.returncode == 0, verified.stderr
    # The recomputation is the merge's: change one element by one ulp and verify says where.
    shard = next(out.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-2] ^= 1
    shard.write_bytes(bytes(data))
    manifest["files"][shard.name]["sha256"] = hashlib.sha256(data).hexdigest()
    (out / "ckptavg-manifest.json").write_text(json.dumps(manifest))
    tampered = run_cli("verify", str(out), "--against", str(tmp_path / "run"))
    assert tampered.returncode == 1
    assert "tensor 'w' differs from the average of its sources at element 299" in tampered.stderr


def test_cancellation_past_the_compensated_bound_is_recomputed_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """2^100 - 2^100 + 2^-100: the fp64 sum gets it right, but its error bound (relative to
    2^101) cannot vouch for one ulp of 2^-100 (nor can a compensated sum's for an fp64 output),
    so the element is recomputed with rationals; ordinary elements almost never are (the
    fallback costs microseconds per element)."""
    calls: list[list[float]] = []
    exact = kernel._exact
    monkeypatch.setattr(kernel, "_exact", lambda values, weights: calls.append(values) or exact(values, weights))
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        sources = [torch.tensor([2.0**100, 1.5], dtype=dtype), torch.tensor([2.0**100, 1.5], dtype=dtype)]
        sources.append(torch.tensor([2.0**-100, 1.5], dtype=dtype))
        out = torch.empty(2, dtype=dtype)
        WeightedSum(16).mean(sources, [0.7, -0.7, 1.0], out)  # (1, -1, 1 would sum exactly)
        assert out.tolist() == [2.0**-100, 1.5]
        assert calls == [[2.0**100, 2.0**100, 2.0**-100]]
        calls.clear()
    generator = torch.Generator().manual_seed(1)
    ordinary = [torch.randn(50_000, generator=generator).bfloat16() for _ in range(3)]
    WeightedSum(2**15).mean([o[:30_000] for o in ordinary], [1.5, -0.7, 0.2], torch.empty(30_000, dtype=torch.bfloat16))
    # (but those whose terms cancel to far below their size: 1 of these 30,000, summing to -3e-5)
    assert len(calls) <= 1 and all(abs(1.5 * a - 0.7 * b + 0.2 * c) < 1e-4 for a, b, c in calls)


def test_an_overflowing_extrapolation_is_refused_in_one_line(tmp_path: Path) -> None:
    top = torch.finfo(torch.bfloat16).max
    write_checkpoint(tmp_path / "run" / "step1", {"w": torch.tensor([-top, 1.0], dtype=torch.bfloat16)})
    write_checkpoint(tmp_path / "run" / "step2", {"w": torch.tensor([top, 1.0], dtype=torch.bfloat16)})
    result = run_cli("merge", str(tmp_path / "run"), "--last", "2", "--weights=-1,2", "--allow-negative-weights")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "ckptavg: error: tensor 'w': the average of its finite inputs overflows (a torch.float64 sum written as "
        "torch.bfloat16)"
    ]
    assert not (tmp_path / "run" / "step2-merged").exists()


def test_the_hook_refuses_negative_weights(tmp_path: Path) -> None:
    with pytest.raises(CkptavgError, match="negative weights; the hook's running sums"):
        MergeHookConfig(
            str(tmp_path),
            merge_steps=[4],
            window=2,
            weighting=Weighting("explicit", explicit=(2, -1), allow_negative=True),
        )


def test_the_library_takes_negative_weights_with_the_permission_only(tmp_path: Path) -> None:
    for step in (1, 2):
        write_checkpoint(tmp_path / "run" / f"step{step}", {"w": torch.full((8,), float(step))})
    sources = [str(tmp_path / "run" / f"step{s}") for s in (1, 2)]
    with pytest.raises(CkptavgError, match="--allow-negative-weights permits"):
        ckptavg.average(sources, str(tmp_path / "out"), weighting=Weighting("explicit", explicit=(-1, 2)))
    extrapolated = Weighting("explicit", explicit=(-1, 2), allow_negative=True)
    # The permission is no part of the merge: positive weights are one merge with or without it.
    assert Weighting("explicit", explicit=(1, 2), allow_negative=True) == Weighting("explicit", explicit=(1, 2))
    ckptavg.average(sources, str(tmp_path / "out"), weighting=extrapolated)
    assert load_merged(tmp_path / "out")["w"].tolist() == [3.0] * 8  # 2 * 2 - 1
