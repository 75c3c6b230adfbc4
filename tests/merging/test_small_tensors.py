"""Many small tensors: runs of them that lie one after another in every source are read and
averaged as one step (:meth:`StreamingAverage._units`), to the bytes each tensor alone gives.

The checkpoints are written here byte for byte (:func:`_write_laid_out`: the safetensors format,
with its tensors in the order and with the gaps a test chooses) so that sources can differ in
where their tensors lie; every float output is compared with the correctly rounded float64 mean
computed here, every integer tensor with the newest source's, and each test also counts the
reads, which shows that the runs were taken (each tensor alone costs one read per source).
"""

from __future__ import annotations

import gc
import hashlib
import json
import struct
import tempfile
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import write_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from references import correctly_rounded, load_merged, same_bits

import ckptavg
from ckptavg import CheckpointError, MergeOptions
from ckptavg.formats import base
from ckptavg.formats.layout import ShardSpec, layout_shards
from ckptavg.formats.safetensors import SafetensorsReader
from ckptavg.formats.writers import safetensors as writer
from ckptavg.io import files
from ckptavg.io.files import MappedRange
from ckptavg.io.fs import resolve
from ckptavg.merging import job
from ckptavg.merging.engine import Candidate, EngineOptions, StreamingAverage, output_specs

SOURCES = 4  # a power of two: the mean divides exactly, so one rounding to any output dtype
TENSORS = 150
# Each tensor alone takes a read per source (those of 3,000 elements several); its runs fewer
# than half that.
FEW_READS = TENSORS // 2
NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32", torch.int64: "I64"}


def _dtype_of(i: int) -> torch.dtype:
    """Mostly bf16, an fp16 tensor after every seven, fp32 ones with int32 tensors between them."""
    return [*[torch.bfloat16] * 7, torch.float16, torch.float32, torch.float32, torch.int32, torch.float32][i % 12]


def _model(seed: int, count: int = TENSORS) -> dict[str, torch.Tensor]:
    """``count`` small tensors (1 to 200 elements; an fp32 and a bf16 one of 3,000, larger than
    a step of 4 KiB chunks, and an empty bf16 one among them), close to a common base as
    neighbouring training steps are."""
    base, noise = torch.Generator().manual_seed(0), torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(count):
        size = 3000 if i in (69, 72) else 0 if i == 90 else 1 + (i * 37) % 200
        dtype = _dtype_of(i)
        if dtype == torch.int32:
            tensors[f"layer.{i:03d}"] = torch.arange(size, dtype=dtype)
        else:
            values = torch.randn(size, generator=base) + 0.01 * torch.randn(size, generator=noise)
            tensors[f"layer.{i:03d}"] = values.to(dtype)
    return tensors


def _layout_order(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names in the order of the output's layout: wider elements first, then by name (so the
    int32 tensors lie between the fp32 ones)."""
    return sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))


def _write_laid_out(
    folder: Path, tensors: dict[str, torch.Tensor], order: list[str] | None = None, gaps: dict[str, int] | None = None
) -> Path:
    """``folder/model.safetensors`` holding ``tensors`` in ``order`` (by default
    :func:`_layout_order`), with ``gaps[name]`` bytes of 0xAB after that tensor (values, if a
    run crossed them)."""
    gaps = gaps or {}
    tensors = {name: tensors[name] for name in order or _layout_order(tensors)}
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    data = bytearray()
    for name, tensor in tensors.items():
        raw = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {
            "dtype": NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw + b"\xab" * gaps.get(name, 0)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(data))
    return folder


def _reference(saved: list[dict[str, torch.Tensor]], name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The correctly rounded float64 mean of ``name`` (integers: the newest source's values)."""
    newest = saved[-1][name]
    if not newest.is_floating_point():
        return newest
    mean = torch.stack([s[name].double() for s in saved]).mean(0)
    return correctly_rounded(mean, dtype or newest.dtype) if mean.numel() else newest.to(dtype or newest.dtype)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Calls of ``SafetensorsReader.read_into`` and ``local_view`` (``--mmap``), per file."""
    counted: Counter[str] = Counter()
    read, view = SafetensorsReader.read_into, SafetensorsReader.local_view

    def read_into(self: SafetensorsReader, name: str, byte_offset: int, buffer: memoryview) -> None:
        counted[self.tensors()[0].file] += 1
        read(self, name, byte_offset, buffer)

    def local_view(self: SafetensorsReader, name: str, byte_offset: int, nbytes: int) -> MappedRange | None:
        counted[self.tensors()[0].file] += 1
        return view(self, name, byte_offset, nbytes)

    monkeypatch.setattr(SafetensorsReader, "read_into", read_into)
    monkeypatch.setattr(SafetensorsReader, "local_view", local_view)
    return counted


def _assert_merged(out: Path, saved: list[dict[str, torch.Tensor]], dtype: torch.dtype | None = None) -> None:
    merged = load_merged(out)
    assert set(merged) == set(saved[-1])
    for name, tensor in merged.items():
        want = _reference(saved, name, dtype if saved[-1][name].is_floating_point() else None)
        assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
        assert bool(same_bits(tensor, want).all()), name


@pytest.mark.parametrize("writer", ["safetensors", "interleaved"])
@pytest.mark.parametrize("chunk_bytes", [4096, 2**24])
def test_runs_of_small_tensors_of_mixed_dtypes_are_exact_and_read_in_few_steps(tmp_path, reads, chunk_bytes, writer):
    """bf16, fp16 and fp32 tensors with int32 ones between the fp32: runs end at every change
    of dtype, at each integer tensor (copied, and compared) and where a step is full (4 KiB
    chunks: 1,024 elements; one tensor of 3,000 has several steps of its own). The files are
    written by the safetensors library too, which orders them by dtype, then by name."""
    saved = [_model(seed) for seed in range(SOURCES)]
    if writer == "safetensors":
        sources = [str(write_checkpoint(tmp_path / f"step{i}", t)) for i, t in enumerate(saved)]
    else:
        sources = [str(_write_laid_out(tmp_path / f"step{i}", t)) for i, t in enumerate(saved)]
    ckptavg.average(sources, str(tmp_path / "out"), options=MergeOptions(chunk_bytes=chunk_bytes, fsync=False))
    _assert_merged(tmp_path / "out", saved)
    assert len(reads) == SOURCES and max(reads.values()) < FEW_READS, reads


@pytest.mark.parametrize("mmap", [False, True])
def test_runs_end_where_a_source_lays_its_tensors_out_otherwise(tmp_path, reads, mmap):
    """One source stores two neighbours swapped, another leaves gaps after two tensors: runs
    are cut there in every source. Read or mapped (``--mmap``) alike."""
    saved = [_model(seed) for seed in range(SOURCES)]
    folders = [_write_laid_out(tmp_path / f"step{i}", t) for i, t in enumerate(saved[:2])]
    order = _layout_order(saved[2])
    at = order.index("layer.013")  # and layer.014 after it: both bf16, of one run elsewhere
    order[at : at + 2] = order[at + 1], order[at]
    folders.append(_write_laid_out(tmp_path / "step2", saved[2], order))
    folders.append(_write_laid_out(tmp_path / "step3", saved[3], gaps={"layer.012": 2, "layer.100": 64}))
    options = MergeOptions(fsync=False, mmap=mmap)
    ckptavg.average([str(f) for f in folders], str(tmp_path / "out"), options=options)
    _assert_merged(tmp_path / "out", saved)
    assert max(reads.values()) < FEW_READS, reads


@pytest.mark.parametrize("bad", [0, 1, 77, 149])
def test_a_nan_in_a_run_names_its_tensor_source_and_element(tmp_path, reads, bad):
    """The error of a run names the tensor, the source and the element a merge of that tensor
    alone would name: the first tensor of the run whose average is not finite."""
    saved = [_model(seed) for seed in range(SOURCES)]
    name = f"layer.{[i for i in range(bad, TENSORS) if _dtype_of(i) == torch.bfloat16][0]:03d}"
    element = min(5, saved[1][name].numel() - 1)
    saved[1][name][element] = float("nan")
    later = f"layer.{int(name[6:]) + 1:03d}" if bad != 149 else None
    if later is not None and _dtype_of(int(later[6:])) == torch.bfloat16:
        saved[2][later][0] = float("inf")  # in the same run, after it: not the one reported
    sources = [str(_write_laid_out(tmp_path / f"step{i}", t)) for i, t in enumerate(saved)]
    with pytest.raises(CheckpointError) as error:
        ckptavg.average(sources, str(tmp_path / "out"), options=MergeOptions(fsync=False))
    assert str(error.value) == (
        f"tensor {name!r} in {tmp_path}/step1/model.safetensors holds NaN (element {element}); "
        "pass --allow-nonfinite to merge it anyway"
    )
    # Each tensor alone, up to this one in the output's order, would have taken a read per source.
    alone = sum(1 for n, t in saved[0].items() if t.numel() and (-t.element_size(), n) <= (-2, name))
    assert max(reads.values()) < alone * 2 // 3, (alone, reads)


def _memory_run(engine: StreamingAverage, candidates: list[Candidate] | None = None) -> list[dict[str, bytes]]:
    """The files of ``engine``'s output (one file of every tensor), per candidate, in memory."""
    shards = _layout(engine)
    stores: list[dict[str, bytes]] = [{} for _ in candidates or [None]]

    class Sink:
        def __init__(self, store: dict[str, bytes]) -> None:
            self.store, self.data = store, bytearray()

        def write(self, data: memoryview) -> None:
            self.data += data

        def close(self) -> str:
            self.store["model.bin"] = bytes(self.data)
            return hashlib.sha256(self.data).hexdigest()

        def abort(self) -> None:
            pass

    if candidates is None:
        engine.run(shards, lambda _shard: Sink(stores[0]))
    else:
        engine.run_many(shards, candidates, [lambda _shard, store=store: Sink(store) for store in stores])
    return stores


def _layout(engine: StreamingAverage) -> list[ShardSpec]:
    """One file of every tensor, in the order a safetensors output writes them."""
    return layout_shards(output_specs(list(engine.tensors.values()), engine.options.dtype), 2**40)


def _tensors_of(data: bytes, engine: StreamingAverage) -> dict[str, torch.Tensor]:
    """The tensors of a file written by :func:`_memory_run`."""
    out, at = {}, 0
    for spec in _layout(engine)[0].tensors:
        raw = bytearray(data[at : at + spec.nbytes])
        out[spec.name] = torch.frombuffer(raw, dtype=spec.dtype) if raw else torch.empty(0, dtype=spec.dtype)
        at += spec.nbytes
    return out


def _readers(folders: list[Path]) -> list[SafetensorsReader]:
    return [SafetensorsReader(*resolve(str(folder))) for folder in folders]


def test_candidates_of_runs_equal_their_own_merges_and_read_each_source_once(tmp_path, reads):
    saved = [_model(seed) for seed in range(SOURCES)]
    folders = [_write_laid_out(tmp_path / f"step{i}", t) for i, t in enumerate(saved)]
    candidates = [Candidate((0, 1, 2, 3)), Candidate((1, 3)), Candidate((0, 2, 3), (0.2, 0.3, 0.5))]
    options = EngineOptions(threads=2)
    together = _memory_run(StreamingAverage(_readers(folders), None, options), candidates)
    assert max(reads.values()) < FEW_READS, reads
    for candidate, store in zip(candidates, together, strict=True):
        readers = [_readers(folders)[i] for i in candidate.sources]
        alone = _memory_run(StreamingAverage(readers, candidate.weights, options))[0]
        assert store == alone, candidate
    engine = StreamingAverage(_readers(folders), None, options)
    for index, sources in [(0, (0, 1, 2, 3)), (1, (1, 3))]:
        merged = _tensors_of(together[index]["model.bin"], engine)
        for name, tensor in merged.items():
            assert bool(same_bits(tensor, _reference([saved[i] for i in sources], name)).all()), name


def test_runs_converted_to_another_dtype_are_exact(tmp_path, reads):
    """``--dtype float32``: the floats' runs are written as fp32, each the float64 mean rounded once."""
    saved = [_model(seed) for seed in range(SOURCES)]
    sources = [str(_write_laid_out(tmp_path / f"step{i}", t)) for i, t in enumerate(saved)]
    options = MergeOptions(dtype=torch.float32, fsync=False)
    ckptavg.average(sources, str(tmp_path / "out"), options=options)
    _assert_merged(tmp_path / "out", saved, torch.float32)
    assert max(reads.values()) < FEW_READS, reads


def test_the_readers_tables_are_spared_by_the_collector_while_a_merge_runs(tmp_path):
    """Frozen during a merge in the main thread (the collector's full passes would walk every
    reader's tables), unfrozen after it, failed or not; left alone by a merge in another thread."""
    saved = [_model(seed) for seed in range(2)]
    sources = [str(_write_laid_out(tmp_path / f"step{i}", t)) for i, t in enumerate(saved)]
    seen: list[tuple[int, bool]] = []

    def progress(_bytes: int) -> None:
        seen.append((gc.get_freeze_count(), gc.isenabled()))

    assert gc.get_freeze_count() == 0
    ckptavg.average(sources, str(tmp_path / "out"), options=MergeOptions(fsync=False), progress=progress)
    assert seen and all(frozen > 1000 and enabled for frozen, enabled in seen)
    assert gc.get_freeze_count() == 0 and gc.isenabled()

    seen.clear()
    thread = threading.Thread(
        target=ckptavg.average,
        args=(sources, str(tmp_path / "beside")),
        kwargs={"options": MergeOptions(fsync=False), "progress": progress},
    )
    thread.start()
    thread.join()
    assert seen and all(frozen == 0 for frozen, _ in seen)

    saved[0]["layer.000"][0] = float("nan")
    _write_laid_out(tmp_path / "step0", saved[0])
    with pytest.raises(CheckpointError, match="holds NaN"):
        ckptavg.average(sources, str(tmp_path / "failed"), options=MergeOptions(fsync=False))
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def _edited(order: list[str], swaps: list[tuple[int, int]]) -> list[str]:
    edited = list(order)
    for i, j in swaps:
        edited[i], edited[j] = edited[j], edited[i]
    return edited


layouts = st.lists(
    st.tuples(
        st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99)), max_size=2),  # swaps of two tensors
        st.dictionaries(st.integers(0, 99), st.integers(1, 9), max_size=2),  # gaps after tensors, in bytes
    ),
    min_size=SOURCES,
    max_size=SOURCES,
)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layouts=layouts)
def test_any_layout_of_each_source_merges_exactly_in_as_few_runs_as_it_allows(reads, layouts):
    """100 bf16 tensors, each source laid out with up to two swaps and two gaps of its own: the
    float64 reference, in at most one read per source for each place some source breaks the
    order (a swap breaks it at most 4 times, a gap once), where a tensor at a time takes 100."""
    reads.clear()
    saved = [{name: t.to(torch.bfloat16) for name, t in _model(seed, 100).items()} for seed in range(SOURCES)]
    names = _layout_order(saved[0])
    breaks = 0
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        sources = []
        for i, (swaps, gaps) in enumerate(layouts):
            order = _edited(names, swaps)
            sources.append(
                str(_write_laid_out(root / f"step{i}", saved[i], order, {names[g]: n for g, n in gaps.items()}))
            )
            breaks += 4 * sum(a != b for a, b in swaps) + len(gaps)
        ckptavg.average(sources, str(root / "out"), options=MergeOptions(fsync=False))
        _assert_merged(root / "out", saved)
    assert max(reads.values()) <= 1 + breaks, (breaks, reads)


def test_per_tensor_work_is_done_once_per_merge(tmp_path, monkeypatch):
    """What a merge does per tensor, done once: each shape read from a file checked once per
    checkpoint (by its ``TensorInfo``; the key filter's view reuses it), no header's keys
    compared pair by pair in Python when none can repeat (:func:`ckptavg.io.files.parse_json`),
    the merge's fingerprint computed once and the output's header built once. For 25k tensors
    each of these repeats cost 0.04 s or more. The output is still the float64 mean, and the
    manifest records the fingerprint a rerun compares."""
    calls: Counter[str] = Counter()

    def counted(module: object, name: str) -> None:
        original = getattr(module, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for module, name in [
        (base, "checked_shape"),
        (files, "_unique_keys"),
        (job, "fingerprint"),
        (writer, "build_header"),
    ]:
        counted(module, name)
    saved = [_model(seed) for seed in range(SOURCES)]
    sources = [str(_write_laid_out(tmp_path / f"step{i}", t)) for i, t in enumerate(saved)]
    ckptavg.average(sources, str(tmp_path / "out"), options=MergeOptions(fsync=False))
    _assert_merged(tmp_path / "out", saved)
    assert calls == {"checked_shape": SOURCES * TENSORS, "fingerprint": 1, "build_header": 1}, calls
    # The manifest records the fingerprint of this merge: a rerun finds it and has nothing to do.
    again = ckptavg.average(sources, str(tmp_path / "out"), options=MergeOptions(fsync=False))
    assert again.already_merged
