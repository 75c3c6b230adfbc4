"""Reads from an object store keep enough requests in flight to hide its latency.

A filesystem that answers each range request only once K of them are in flight at the same time
(or after a timeout) makes the concurrency observable without timing anything: a merge with the
default options must reach K, and its output must still be the exact mean.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from helpers import make_run, upload
from references import correctly_rounded, load_merged, same_bits

import ckptavg
from ckptavg import CheckpointError, CkptavgError
from ckptavg.io.files import REMOTE_MIN_PART, REMOTE_PARTS, REMOTE_REQUESTS, RandomAccessFile, split_range
from ckptavg.io.fs import resolve
from ckptavg.merging.discovery import find_checkpoints

# One tensor whose reads are full 8 MiB chunks (16 MiB of float32 accumulator, bf16 input).
SHAPES = {"model.big.weight": (1024, 4096), "model.norm.weight": (64,)}


class CountingFileSystem(MemoryFileSystem):
    """``memory://`` with a store of its own, counting range requests in flight: each request of
    ``large`` bytes or more (a tensor's data, not a header) waits until ``wanted`` are in flight
    at once (at most ``patience`` seconds), then answers."""

    protocol = "countingmem"
    store: dict = {}  # noqa: RUF012 (fsspec's MemoryFileSystem keeps its files on the class)
    pseudo_dirs = [""]  # noqa: RUF012
    wanted = REMOTE_REQUESTS
    patience = 2.0
    large = 2**16
    fail_at: int | None = None  # a start offset whose request fails
    lock = threading.Condition()
    in_flight = 0
    peak = 0
    requests = 0

    @classmethod
    def reset(cls) -> None:
        cls.in_flight = cls.peak = cls.requests = 0
        cls.fail_at = None

    def cat_file(self, path, start=None, end=None, **kwargs):
        cls = type(self)
        with cls.lock:
            cls.in_flight += 1
            cls.requests += 1
            cls.peak = max(cls.peak, cls.in_flight)
            cls.lock.notify_all()
            if start is not None and end is not None and end - start >= cls.large:
                cls.lock.wait_for(lambda: cls.peak >= cls.wanted, timeout=cls.patience)
        try:
            if start is not None and start == cls.fail_at:
                raise OSError(5, "Input/output error")
            return super().cat_file(path, start=start, end=end, **kwargs)
        finally:
            with cls.lock:
                cls.in_flight -= 1


@pytest.fixture
def counting_url():
    fsspec.register_implementation(CountingFileSystem.protocol, CountingFileSystem, clobber=True)
    CountingFileSystem.reset()
    yield f"countingmem://run-{uuid.uuid4().hex[:12]}"
    CountingFileSystem.store.clear()
    CountingFileSystem.pseudo_dirs[:] = [""]


def test_split_range_covers_the_read_in_bounded_parts():
    for length in (0, 1, REMOTE_MIN_PART - 1, REMOTE_MIN_PART, 3 * REMOTE_MIN_PART + 5, 8 * 2**20, 2**30 + 7):
        parts = split_range(length)
        assert parts[0][0] == 0 and parts[-1][1] == length
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))
        assert len(parts) <= REMOTE_PARTS
        sizes = [end - start for start, end in parts]
        assert max(sizes) - min(sizes) <= 1
        if len(parts) > 1:
            assert min(sizes) >= REMOTE_MIN_PART
    # The default chunk's read of bf16 input (8 MiB): two reader threads keep 8 requests in flight.
    assert 2 * len(split_range(8 * 2**20)) >= REMOTE_REQUESTS


def test_default_merge_keeps_requests_in_flight_and_the_exact_mean(tmp_path, counting_url):
    saved = make_run(tmp_path / "local", [10, 20], SHAPES)
    upload(tmp_path / "local", counting_url)
    CountingFileSystem.reset()

    ckptavg.merge(counting_url, last=2, out=str(tmp_path / "out"))

    assert CountingFileSystem.peak >= REMOTE_REQUESTS, CountingFileSystem.peak
    merged = load_merged(tmp_path / "out")
    for name, tensor in merged.items():
        mean = (saved[10][name].double() + saved[20][name].double()) / 2
        assert bool(same_bits(tensor, correctly_rounded(mean, torch.bfloat16)).all()), name


def test_parts_of_a_read_are_concurrent_and_exact(counting_url):
    data = torch.randint(0, 256, (5 * REMOTE_MIN_PART + 3,), dtype=torch.uint8).numpy().tobytes()
    fs, root = resolve(counting_url)
    fs.pipe_file(f"{root}/blob", data)
    CountingFileSystem.reset()
    CountingFileSystem.wanted = 5
    try:
        file = RandomAccessFile(fs, f"{root}/blob")
        buffer = bytearray(len(data) - 1)
        file.read_into(1, memoryview(buffer))
    finally:
        CountingFileSystem.wanted = REMOTE_REQUESTS
    assert bytes(buffer) == data[1:]
    assert CountingFileSystem.requests == 5 and CountingFileSystem.peak == 5


def test_a_failed_part_is_one_error_naming_the_file(counting_url):
    fs, root = resolve(counting_url)
    fs.pipe_file(f"{root}/blob", bytes(4 * REMOTE_MIN_PART))
    CountingFileSystem.reset()
    CountingFileSystem.wanted = 1
    CountingFileSystem.fail_at = 2 * REMOTE_MIN_PART
    try:
        file = RandomAccessFile(fs, f"{root}/blob")
        with pytest.raises(CheckpointError, match=r"cannot read countingmem://.*/blob: .*Input/output error"):
            file.read_into(0, memoryview(bytearray(4 * REMOTE_MIN_PART)))
    finally:
        CountingFileSystem.wanted = REMOTE_REQUESTS
    # Every part has finished once the error is raised: none writes into the buffer afterwards.
    assert CountingFileSystem.in_flight == 0


def test_opening_several_checkpoints_fails_on_the_first_bad_one_in_order(tmp_path):
    make_run(tmp_path / "run", [10, 20, 30], SHAPES)
    (tmp_path / "run" / "step20" / "model.safetensors").write_bytes(b"not a safetensors file")
    (tmp_path / "run" / "step30" / "model.safetensors").unlink()
    with pytest.raises(CkptavgError, match="step20"):
        ckptavg.average([str(tmp_path / "run" / f"step{s}") for s in (10, 20, 30)], str(tmp_path / "out"))
    assert not Path(tmp_path / "out").exists()


def test_a_remote_run_folder_lists_as_its_local_copy(tmp_path, counting_url):
    """The step folders of a remote run are probed concurrently; the listing is the local one's."""
    make_run(tmp_path / "run", [10, 20, 30, 40], SHAPES | {"model.big.weight": (4, 4)}, shards=2)
    (tmp_path / "run" / "step30" / "model-00002-of-00002.safetensors").unlink()  # incomplete
    (tmp_path / "run" / "step50-tmp").mkdir()
    (tmp_path / "run" / "step50-tmp" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "run" / "notes").mkdir()
    (tmp_path / "run" / "notes" / "a.txt").write_text("not a checkpoint")
    upload(tmp_path / "run", counting_url)

    def listing(url: str) -> list[tuple]:
        return [(c.step, c.name, c.format, c.complete, c.note, c.merged) for c in find_checkpoints(*resolve(url))]

    assert len(listing(counting_url)) == 5
    assert listing(counting_url) == listing(str(tmp_path / "run"))
