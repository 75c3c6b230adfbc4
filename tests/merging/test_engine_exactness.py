"""The blocked, multi-threaded engine computes exactly what the one-chunk-at-a-time engine did.

The reference below is that engine's per-element op sequence written out on whole tensors:
newest source first, copied into the accumulator (then ``mul_(weight)`` when weighted), every
other source converted and added (``add_(x, alpha=weight)`` when weighted), then divided by the
source count (or summed totals) in the accumulator's dtype and cast. Elementwise ops give the
same bits whatever the block, step, thread or chunk boundaries, so every output must equal it
bit for bit; the float64 mean checks the reference itself.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch

from ckptavg.errors import CheckpointError, ConfigError
from ckptavg.formats.layout import ShardSpec
from ckptavg.formats.safetensors import SafetensorsReader
from ckptavg.io.fs import resolve
from ckptavg.merging import engine as engine_module
from ckptavg.merging.engine import (
    Candidate,
    EngineOptions,
    StreamingAverage,
    accumulator_dtype,
    default_threads,
    output_specs,
)
from ckptavg.merging.options import MergeOptions
from tests.helpers import write_checkpoint
from tests.references import correctly_rounded, same_bits, weighted_correctly_rounded

SHAPES = {"big": (300_007,), "odd": (37, 29), "scalar": (), "empty": (0, 4)}
SOURCES = 5


class MemorySink:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: memoryview) -> None:
        self.data += data

    def close(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def abort(self) -> None:
        self.data = bytearray()


class CountingReader:
    """A reader that counts the bytes asked of it, copied or mapped."""

    def __init__(self, inner: SafetensorsReader) -> None:
        self.inner = inner
        self.display_path = inner.display_path
        self.asked = 0
        self.largest = 0

    def tensors(self):
        return self.inner.tensors()

    def _count(self, nbytes: int) -> None:
        self.asked += nbytes
        self.largest = max(self.largest, nbytes)

    def read_into(self, name, byte_offset, buffer):
        self._count(len(buffer))
        self.inner.read_into(name, byte_offset, buffer)

    def local_view(self, name, byte_offset, nbytes):
        self._count(nbytes)
        return self.inner.local_view(name, byte_offset, nbytes)

    def adjacent(self, names):
        return self.inner.adjacent(names)


def _tensors(seed: int, dtype: torch.dtype, scale: float = 1.0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = {name: (torch.randn(shape, generator=generator) * scale).to(dtype) for name, shape in SHAPES.items()}
    out["counter"] = torch.tensor([7, 11, 13], dtype=torch.int64)
    out["mask"] = torch.tensor([True, False, True])
    return out


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16, torch.float32, torch.float64])
def run(request, tmp_path_factory) -> tuple[list[Path], list[dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp(str(request.param).split(".")[1])
    saved = [_tensors(i, request.param) for i in range(SOURCES)]
    folders = [write_checkpoint(root / f"step{i}", t, shards=2 if i % 2 else 1) for i, t in enumerate(saved)]
    return folders, saved


def _readers(folders):
    return [SafetensorsReader(*resolve(str(f))) for f in folders]


def _engine_outputs(engine: StreamingAverage, dtype=None, candidates=None) -> list[dict[str, torch.Tensor]]:
    """Run the engine (one shard per tensor, so each output tensor comes back on its own)."""
    specs = output_specs(list(engine.tensors.values()), dtype)
    shards = [ShardSpec(spec.name, (spec,)) for spec in specs]
    count = 1 if candidates is None else len(candidates)
    sinks: list[dict[str, MemorySink]] = [{} for _ in range(count)]

    def opener(k):
        def open_sink(shard):
            sinks[k][shard.file_name] = MemorySink()
            return sinks[k][shard.file_name]

        return open_sink

    if candidates is None:
        engine.run(shards, opener(0))
    else:
        engine.run_many(shards, candidates, [opener(k) for k in range(count)])

    def tensor(data: bytearray, spec) -> torch.Tensor:
        if not data:
            return torch.empty(spec.shape, dtype=spec.dtype)
        return torch.frombuffer(bytearray(data), dtype=spec.dtype).reshape(spec.shape)

    return [{spec.name: tensor(sink[spec.name].data, spec) for spec in specs} for sink in sinks]


def reference(values, weights=None, out_dtype=None, divisor=None) -> torch.Tensor:
    """The former engine's op sequence on whole tensors; ``values`` oldest first. Weighted means
    written in fewer than 64 bits: the exact weighted sum correctly rounded."""
    out_dtype = out_dtype or values[0].dtype
    acc_dtype = accumulator_dtype(values[0].dtype, out_dtype)
    normalised = None if weights is None else [w / math.fsum(weights) for w in weights]
    if normalised is not None and out_dtype != torch.float64:
        return weighted_correctly_rounded(values, normalised, out_dtype).reshape(values[0].shape)
    order = list(range(len(values) - 1, -1, -1))
    acc = values[order[0]].to(acc_dtype, copy=True).reshape(-1)
    if normalised is not None:
        acc.mul_(normalised[order[0]])
    for i in order[1:]:
        converted = values[i].to(acc_dtype).reshape(-1)
        if normalised is None:
            acc.add_(converted)
        else:
            acc.add_(converted, alpha=normalised[i])
    if normalised is None:
        acc = torch.div(acc, len(values) if divisor is None else divisor)
    if acc.dtype == torch.float64 and out_dtype.itemsize < 4:
        # Rounded once: torch's cast from fp64 rounds twice (through fp32), which the engine avoids.
        return correctly_rounded(acc, out_dtype).reshape(values[0].shape)
    return acc.to(out_dtype).reshape(values[0].shape)


def _assert_identical(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert bool(same_bits(got, want).all()), what


@pytest.mark.parametrize(
    ("threads", "use_mmap", "chunk_bytes"),
    [(1, True, 2**20), (3, True, 4096), (2, False, 2**20), (4, False, 100_000)],
)
@pytest.mark.parametrize("mode", ["uniform", "weights", "totals"])
def test_outputs_equal_the_former_op_sequence(run, threads, use_mmap, chunk_bytes, mode):
    folders, saved = run
    dtype = saved[0]["big"].dtype
    weights = [0.1, 0.7, 0.3, 1.9, 1.1] if mode == "weights" else None
    totals = [3.0, 1.0, 2.5, 4.0, 0.5] if mode == "totals" else None
    options = EngineOptions(threads=threads, mmap=use_mmap, chunk_bytes=chunk_bytes)
    readers = _readers(folders)
    merged = _engine_outputs(StreamingAverage(readers, weights, options, totals=totals))[0]
    for name in SHAPES:
        values = [s[name] for s in saved]
        want = reference(values, weights, divisor=None if totals is None else sum(totals))
        _assert_identical(merged[name], want, name)
        # The reference itself is the float64 mean, rounded (correctly, for uniform 16-bit means).
        mean = sum(v.double() * w for v, w in zip(values, weights or [1] * SOURCES, strict=True))
        mean = mean / (sum(weights) if weights else sum(totals) if totals else SOURCES)
        if mode == "uniform" and dtype.itemsize == 2:
            _assert_identical(want, correctly_rounded(mean, dtype), name)
        else:
            # One rounding to the output (half an ulp) and the accumulator's own rounding errors.
            largest = max(float(v.double().abs().amax()) if v.numel() else 0.0 for v in values)
            slack = 8 * torch.finfo(accumulator_dtype(dtype, dtype)).eps * largest
            assert torch.allclose(want.double(), mean, rtol=torch.finfo(dtype).eps, atol=slack), name
    for name in ("counter", "mask"):
        assert torch.equal(merged[name], saved[-1][name])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_dtype_conversion_equals_the_former_op_sequence(run, out_dtype):
    folders, saved = run
    options = EngineOptions(dtype=out_dtype, threads=2, chunk_bytes=65536)
    merged = _engine_outputs(StreamingAverage(_readers(folders), None, options), out_dtype)[0]
    for name in SHAPES:
        _assert_identical(merged[name], reference([s[name] for s in saved], out_dtype=out_dtype), name)
    assert merged["counter"].dtype == torch.int64  # integers keep their dtype, copied


def test_threads_and_mmap_never_change_a_byte(run):
    folders, _ = run
    outputs = []
    for threads, use_mmap in [(1, False), (1, True), (2, True), (5, False)]:
        options = EngineOptions(threads=threads, mmap=use_mmap, chunk_bytes=2**18)
        outputs.append(_engine_outputs(StreamingAverage(_readers(folders), [1, 2, 3, 4, 5], options))[0])
    for other in outputs[1:]:
        for name, tensor in outputs[0].items():
            _assert_identical(other[name], tensor, name)


def test_candidates_equal_separate_runs_and_read_each_source_once(run):
    folders, _ = run
    candidates = [
        Candidate((0, 1, 2, 3, 4)),
        Candidate((1, 3), (2.0, 1.0)),
        Candidate((2,)),
        Candidate((0, 2, 4), (0.2, 0.3, 0.5)),
    ]
    options = EngineOptions(threads=2, chunk_bytes=2**17)
    counting = [CountingReader(r) for r in _readers(folders)]
    together = _engine_outputs(StreamingAverage(counting, None, options), candidates=candidates)
    tensor_bytes = sum(info.nbytes for info in counting[0].tensors())
    assert [r.asked for r in counting] == [tensor_bytes] * SOURCES  # one pass: each byte once
    for candidate, output in zip(candidates, together, strict=True):
        readers = [_readers(folders)[i] for i in candidate.sources]
        alone = _engine_outputs(StreamingAverage(readers, candidate.weights, options))[0]
        for name, tensor in alone.items():
            _assert_identical(output[name], tensor, f"{candidate}: {name}")


def test_memory_per_step_stays_flat_as_sources_are_added(tmp_path):
    """The inputs of a step, all sources together, fit the same budget for 4 and 16 sources."""
    tensors = {"w": torch.zeros(200_000, dtype=torch.bfloat16)}
    folders = [write_checkpoint(tmp_path / f"s{i}", tensors) for i in range(16)]
    chunk = 2**18
    options = EngineOptions(chunk_bytes=chunk, threads=2)
    budget = chunk * options.read_ahead // 2
    for count in (4, 16):
        counting = [CountingReader(r) for r in _readers(folders[:count])]
        _engine_outputs(StreamingAverage(counting, None, options))
        assert sum(r.largest for r in counting) <= budget
    assert counting[0].largest < chunk // 2  # 16 sources: steps shorter than a chunk


def test_nonfinite_is_refused_naming_the_file_per_candidate(tmp_path):
    saved = [_tensors(i, torch.bfloat16) for i in range(3)]
    saved[0]["big"][123_456] = float("nan")
    folders = [write_checkpoint(tmp_path / f"step{i}", t) for i, t in enumerate(saved)]
    options = EngineOptions(threads=2, chunk_bytes=2**16)
    with pytest.raises(
        CheckpointError, match=r"tensor 'big' in .*step0/model.safetensors holds NaN \(element 123456\)"
    ):
        _engine_outputs(StreamingAverage(_readers(folders), None, options))
    with pytest.raises(CheckpointError, match=r"step0/model.safetensors holds NaN"):
        _engine_outputs(
            StreamingAverage(_readers(folders), None, options), candidates=[Candidate((1, 2)), Candidate((0, 2))]
        )
    clean = _engine_outputs(StreamingAverage(_readers(folders), None, options), candidates=[Candidate((1, 2))])[0]
    _assert_identical(clean["big"], reference([saved[1]["big"], saved[2]["big"]]), "big")
    allowed = EngineOptions(threads=2, chunk_bytes=2**16, allow_nonfinite=True)
    merged = _engine_outputs(StreamingAverage(_readers(folders), None, allowed))[0]
    want = reference([s["big"] for s in saved])
    assert bool(merged["big"][123_456].isnan()) and bool(want[123_456].isnan())
    finite = torch.ones_like(want, dtype=torch.bool)
    finite[123_456] = False
    _assert_identical(merged["big"][finite], want[finite], "big")


def test_integer_tensors_must_agree_within_each_candidate(tmp_path):
    saved = [_tensors(i, torch.float32) for i in range(3)]
    saved[0]["counter"] = torch.tensor([7, 11, 14])
    folders = [write_checkpoint(tmp_path / f"step{i}", t) for i, t in enumerate(saved)]
    engine = StreamingAverage(_readers(folders), None, EngineOptions(threads=2))
    with pytest.raises(CheckpointError, match=r"tensor 'counter' differs between .*step0/.* and .*step2/"):
        _engine_outputs(engine, candidates=[Candidate((1, 2)), Candidate((0, 1, 2))])
    merged = _engine_outputs(engine, candidates=[Candidate((1, 2))])[0]
    assert torch.equal(merged["counter"], saved[2]["counter"])


@pytest.mark.parametrize(
    "candidate",
    [Candidate(()), Candidate((2, 1)), Candidate((1, 1)), Candidate((0, 3)), Candidate((0, 1), (1.0,))],
)
def test_bad_candidates_are_refused(tmp_path, candidate):
    folders = [write_checkpoint(tmp_path / f"step{i}", {"w": torch.zeros(4)}) for i in range(3)]
    engine = StreamingAverage(_readers(folders), None, EngineOptions())
    with pytest.raises(ConfigError):
        engine.run_many([], [candidate], [lambda shard: MemorySink()])


@pytest.mark.parametrize("threads", [0, -2])
def test_threads_below_one_are_refused(threads):
    with pytest.raises(ConfigError, match=f"threads must be at least 1, got {threads}"):
        MergeOptions(threads=threads)
    with pytest.raises(ConfigError, match=f"threads must be at least 1, got {threads}"):
        EngineOptions(threads=threads)


def test_default_threads_share_the_node_between_local_processes(monkeypatch):
    monkeypatch.setattr(engine_module.os, "sched_getaffinity", lambda _pid: set(range(32)))
    monkeypatch.setattr(engine_module.os, "cpu_count", lambda: 32)
    assert default_threads({}) == 32
    assert default_threads({"LOCAL_WORLD_SIZE": "8"}) == 4
    assert default_threads({"SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_TASKS_PER_NODE": "4(x4)"}) == 8
    assert default_threads({"LOCAL_WORLD_SIZE": "64"}) == 1
    # An affinity already narrowed (srun --cpu-bind, taskset) is this process's share.
    monkeypatch.setattr(engine_module.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    assert default_threads({"LOCAL_WORLD_SIZE": "8"}) == 4


def test_candidate_is_exported_lazily():
    import ckptavg.merging

    assert ckptavg.merging.Candidate is Candidate
