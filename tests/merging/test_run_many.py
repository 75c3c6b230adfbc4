"""The engine's one-pass API (:meth:`StreamingAverage.run_many`): every candidate's bytes are
those of a separate :meth:`StreamingAverage.run` of its sources, and every source byte is read
once, however many candidates hold it."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from helpers import write_checkpoint

from ckptavg import CheckpointError, ConfigError
from ckptavg.formats import CheckpointReader, open_checkpoint
from ckptavg.formats.layout import ShardSpec, TensorSpec
from ckptavg.io.fs import resolve
from ckptavg.merging.engine import Candidate, EngineOptions, StreamingAverage, output_specs


class MemorySink:
    """A shard written to memory, hashed as the real writers hash their files."""

    def __init__(self, store: dict[str, bytes], name: str) -> None:
        self.store, self.name, self.data = store, name, bytearray()

    def write(self, data: memoryview) -> None:
        self.data += bytes(data)

    def close(self) -> str:
        self.store[self.name] = bytes(self.data)
        return hashlib.sha256(self.data).hexdigest()

    def abort(self) -> None:
        self.store.pop(self.name, None)


class CountingReader:
    """A reader that records every byte range read from it (copied or mapped), per tensor."""

    def __init__(self, reader: CheckpointReader) -> None:
        self._reader = reader
        self.ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)

    def __getattr__(self, name: str):
        return getattr(self._reader, name)

    def read_into(self, name: str, byte_offset: int, buffer: memoryview) -> None:
        self.ranges[name].append((byte_offset, byte_offset + len(buffer)))
        self._reader.read_into(name, byte_offset, buffer)

    def local_view(self, name: str, byte_offset: int, nbytes: int):
        view = self._reader.local_view(name, byte_offset, nbytes)
        if view is not None:  # else the engine falls back to read_into, which records it
            self.ranges[name].append((byte_offset, byte_offset + nbytes))
        return view


STEPS = [10, 20, 30, 40]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("many")
    generator = torch.Generator().manual_seed(3)
    base = {"w16": torch.randn(70, 33, generator=generator), "w32": torch.randn(1001, generator=generator)}
    for i, step in enumerate(STEPS):
        tensors = {
            "w16": (base["w16"] + 0.03 * torch.randn(70, 33, generator=generator)).to(torch.bfloat16),
            "w32": base["w32"] + 0.03 * torch.randn(1001, generator=generator),
            "counter": torch.tensor([7, 7], dtype=torch.int64),
            "odd": torch.tensor([i], dtype=torch.int32) if i >= 2 else torch.tensor([0], dtype=torch.int32),
        }
        write_checkpoint(root / f"step{step}", tensors)
    return root


def _readers(run: Path) -> list[CountingReader]:
    return [CountingReader(open_checkpoint(*resolve(str(run / f"step{s}")))) for s in STEPS]


def _shards(engine: StreamingAverage, dtype: torch.dtype | None, names: list[str]) -> list[ShardSpec]:
    specs = [s for s in output_specs(list(engine.tensors.values()), dtype) if s.name in names]
    return [ShardSpec("a.bin", specs[:1]), ShardSpec("b.bin", specs[1:])]


def _separate(run: Path, candidate: Candidate, options: EngineOptions, names: list[str]) -> dict[str, bytes]:
    readers = _readers(run)
    engine = StreamingAverage(
        [readers[i] for i in candidate.sources],
        None if candidate.weights is None else list(candidate.weights),
        options,
        copy_from=None if candidate.copy_from is None else candidate.sources.index(candidate.copy_from),
    )
    store: dict[str, bytes] = {}
    engine.run(_shards(engine, options.dtype, names), lambda shard: MemorySink(store, shard.file_name))
    return store


CANDIDATES = [
    Candidate((0, 1, 2, 3)),
    Candidate((2, 3)),
    Candidate((0, 1, 2, 3), (0.125, 0.25, 0.5, 1.0)),
    Candidate((1, 3), (3.0, 1.0)),
    Candidate((3,)),
    Candidate((0, 2)),  # not ending at the newest source
    Candidate((1, 2, 3)),  # a divisor that is no power of two
    Candidate((0, 1, 3)),
    Candidate((0, 1, 2, 3), (2.0, -0.5, 0.75, -1.0)),  # negative weights: fp64, compensated
    Candidate((1, 3), (-1.0, 3.0)),
]


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_each_candidate_is_byte_identical_to_its_own_run_and_every_byte_is_read_once(run, dtype):
    # A small chunk, so that every tensor spans several chunks.
    options = EngineOptions(dtype=dtype, chunk_bytes=1024)
    names = ["w16", "w32", "counter"]
    readers = _readers(run)
    read: list[int] = []
    engine = StreamingAverage(readers, None, options, progress=read.append)
    shards = _shards(engine, dtype, names)
    stores: list[dict[str, bytes]] = [{} for _ in CANDIDATES]
    done: list[list[str]] = [[] for _ in CANDIDATES]
    hashes = engine.run_many(
        shards,
        CANDIDATES,
        [lambda shard, store=store: MemorySink(store, shard.file_name) for store in stores],
        [lambda name, digest, seen=seen: seen.append(name) for seen in done],
    )
    for k, candidate in enumerate(CANDIDATES):
        expected = _separate(run, candidate, options, names)
        assert stores[k] == expected, candidate
        assert hashes[k] == {name: hashlib.sha256(data).hexdigest() for name, data in expected.items()}
        assert done[k] == ["a.bin", "b.bin"]
    # Read once: per source and tensor, the ranges read tile the tensor without overlap.
    sizes = {t.name: t.nbytes for t in engine.tensors.values()}
    for reader in readers:
        assert set(reader.ranges) == set(names)
        for name, ranges in reader.ranges.items():
            ranges.sort()
            assert ranges[0][0] == 0 and ranges[-1][1] == sizes[name]
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), name
            assert len(ranges) > 1 or sizes[name] <= 1024
    assert sum(read) == sum(sizes[n] for n in names) * len(STEPS)


def test_sources_no_candidate_holds_are_not_read(run):
    readers = _readers(run)
    engine = StreamingAverage(readers, None, EngineOptions())
    shards = _shards(engine, None, ["w16", "w32"])
    stores: list[dict[str, bytes]] = [{}, {}]
    engine.run_many(
        shards,
        [Candidate((1, 3)), Candidate((3,))],
        [lambda shard, store=store: MemorySink(store, shard.file_name) for store in stores],
    )
    assert not readers[0].ranges and not readers[2].ranges and readers[1].ranges


def test_integer_tensors_come_from_each_candidates_newest_source_and_must_agree_within_it(run):
    options = EngineOptions()
    readers = _readers(run)
    engine = StreamingAverage(readers, None, options)
    shards = _shards(engine, None, ["w32", "odd"])
    # Sources 0 and 1 agree on "odd" (0), 2 and 3 differ (2, 3): each candidate alone agrees.
    stores: list[dict[str, bytes]] = [{}, {}, {}]
    engine.run_many(
        shards,
        [Candidate((0, 1)), Candidate((2,)), Candidate((3,))],
        [lambda shard, store=store: MemorySink(store, shard.file_name) for store in stores],
    )
    assert [store["b.bin"] for store in stores] == [
        torch.tensor([v], dtype=torch.int32).numpy().tobytes() for v in (0, 2, 3)
    ]
    with pytest.raises(CheckpointError, match=r"tensor 'odd' differs between .*step30.*step40"):
        engine.run_many(
            shards,
            [Candidate((0, 1)), Candidate((2, 3))],
            [lambda shard, store=store: MemorySink(store, shard.file_name) for store in stores[:2]],
        )


def test_copy_rules_take_each_candidates_chosen_source_whatever_the_others_hold(run):
    """``odd`` differs between sources 2 and 3; copied by a rule, each candidate takes it from
    its own ``copy_from`` (its newest by default), as its separate merge does."""
    options = EngineOptions(copy=("odd",))
    readers = _readers(run)
    engine = StreamingAverage(readers, None, options)
    names = ["w16", "odd"]
    shards = _shards(engine, None, names)
    candidates = [
        Candidate((0, 1, 2, 3), copy_from=2),
        Candidate((2, 3)),
        Candidate((0, 1, 2, 3), (2.0, -1.0, 0.5, 0.5), copy_from=0),
    ]
    stores: list[dict[str, bytes]] = [{} for _ in candidates]
    engine.run_many(
        shards, candidates, [lambda shard, store=store: MemorySink(store, shard.file_name) for store in stores]
    )
    for store, candidate, odd in zip(stores, candidates, (2, 3, 0), strict=True):
        assert store == _separate(run, candidate, options, names)
        assert torch.tensor([odd], dtype=torch.int32).numpy().tobytes() in store.values()  # its own file


@pytest.mark.parametrize(
    "candidate",
    [
        Candidate(()),
        Candidate((1, 0)),
        Candidate((0, 0)),
        Candidate((4,)),
        Candidate((0, 1), (1.0,)),
        Candidate((0, 1), copy_from=2),
        Candidate((0, 1), (1.0, -1.0)),
    ],
)
def test_bad_candidates_are_refused(run, candidate):
    engine = StreamingAverage(_readers(run), None, EngineOptions())
    with pytest.raises(ConfigError):
        engine.run_many(
            [ShardSpec("a.bin", [TensorSpec("w32", torch.float32, (1001,))])], [candidate], [lambda s: None]
        )
