"""benchmarks/floor.py, the floor every benchmark prints beside its merges: the durable write
leaves exactly the bytes asked for (direct or, where a filesystem refuses O_DIRECT, buffered), and
a floor measured in a child reports both halves and leaves nothing behind."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
from helpers import REPO, load_script

SCRIPT = REPO / "benchmarks" / "floor.py"


@pytest.fixture(scope="module")
def floor() -> ModuleType:
    """The script as a module."""
    return load_script(SCRIPT, "ckptavg_bench_floor")


@pytest.mark.parametrize("size", [1, 4096, 4097, 8 * 2**20 + 5])
def test_the_durable_write_leaves_exactly_the_bytes_asked_for(floor: ModuleType, tmp_path: Path, size: int):
    # Sizes off the 4 KiB alignment and past one 8 MiB block: the padded last block is cut back.
    path = tmp_path / "out"
    seconds, direct = floor.write_durably(path, size)
    assert path.stat().st_size == size
    assert seconds > 0
    assert isinstance(direct, bool)


def test_a_filesystem_that_refuses_o_direct_gets_a_buffered_durable_write(
    floor: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    real_open = os.open

    def refuse_direct(path: object, flags: int, *args: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # as tmpfs before Linux 6.6 answers
        return real_open(path, flags, *args)

    monkeypatch.setattr(floor.os, "open", refuse_direct)
    seconds, direct = floor.write_durably(tmp_path / "out", 10_000)
    assert direct is False
    assert (tmp_path / "out").stat().st_size == 10_000


def test_a_floor_measured_in_a_child_reports_both_halves_and_leaves_nothing(floor: ModuleType, tmp_path: Path):
    inputs = [tmp_path / "a.bin", tmp_path / "b.bin"]
    for i, path in enumerate(inputs):
        path.write_bytes(os.urandom(1_000_000 + i))
    folder = tmp_path / "out"
    folder.mkdir()
    done = subprocess.run(
        floor.floor_command(inputs, 3_000_001, folder), capture_output=True, text=True, timeout=60, check=True
    )
    measured = floor.parse_floor(done.stdout)
    assert measured.read_bytes == 2_000_001
    assert measured.write_bytes == 3_000_001
    assert measured.seconds == max(measured.read_seconds, measured.write_seconds) > 0
    assert list(folder.iterdir()) == []  # the written file is removed
