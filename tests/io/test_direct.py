"""Direct I/O of local tensor files (ckptavg.io.direct): every byte lands where a buffered write
puts it, whatever the sizes of the writes and wherever a flush falls; filesystems that refuse
O_DIRECT, at open or at a write, get the same bytes without it; a failed write is raised in the
writing thread."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest
from helpers import files_of, make_run, run_cli_in_process

import ckptavg.io.atomic as atomic
import ckptavg.io.direct as direct
from ckptavg.io.atomic import close_output, open_output
from ckptavg.io.direct import DirectFile
from ckptavg.io.fs import resolve
from ckptavg.io.writeback import WriteBehindFile

STAGE = 3 * 4096  # small stages: the tests cross many of them


@pytest.fixture(autouse=True)
def small_stages(monkeypatch):
    monkeypatch.setattr(direct, "STAGE_BYTES", STAGE)
    monkeypatch.setattr(direct, "_free_stages", [])


def _takes_direct_io(folder: Path) -> bool:
    try:
        fd = os.open(folder / ".probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        assert exc.errno == errno.EINVAL
        return False
    os.close(fd)
    os.unlink(folder / ".probe")
    return True


def _write(path: Path, pieces: list[bytes], fsync: bool = True, flush_after: set[int] = frozenset()):
    fs, where = resolve(str(path))
    handle = open_output(fs, where, fsync, direct=True)
    for i, piece in enumerate(pieces):
        assert handle.write(memoryview(piece)) == len(piece)
        if i in flush_after:
            handle.flush()
            assert os.path.getsize(path) == sum(map(len, pieces[: i + 1]))
    close_output(fs, handle, fsync)
    return handle


SIZES = [
    [1],
    [4095],
    [4096],
    [4097],
    [STAGE],
    [STAGE + 1],
    [100, STAGE - 100, 7],  # a header, then data that ends a stage exactly, then more
    [5000] * 20,  # stage ends inside writes
    [3 * STAGE + 123],  # one write larger than both stages
    [],
]


@pytest.mark.parametrize("sizes", SIZES, ids=lambda sizes: "+".join(map(str, sizes)) or "empty")
def test_every_byte_lands_where_it_belongs(tmp_path, sizes):
    pieces = [os.urandom(n) for n in sizes]
    handle = _write(tmp_path / "out", pieces)
    assert (tmp_path / "out").read_bytes() == b"".join(pieces)
    assert isinstance(handle, DirectFile if _takes_direct_io(tmp_path) else WriteBehindFile)


def test_the_file_is_opened_with_o_direct_where_the_filesystem_takes_it(tmp_path):
    fs, where = resolve(str(tmp_path / "out"))
    handle = open_output(fs, where, True, direct=True)
    try:
        flags = fcntl.fcntl(handle.fileno(), fcntl.F_GETFL)
        assert bool(flags & os.O_DIRECT) == _takes_direct_io(tmp_path)
    finally:
        handle.close()


@pytest.mark.parametrize("flush_after", [{0}, {0, 1}, {2, 5}, {0, 1, 2, 3, 4, 5, 6, 7}], ids=str)
def test_flushes_anywhere_keep_the_file_exact(tmp_path, flush_after):
    """A flush writes the last block padded and cuts the file; the next bytes rewrite that
    block whole."""
    pieces = [os.urandom(n) for n in (100, 4000, 9000, 1, 4096, STAGE, 3, 777)]
    _write(tmp_path / "out", pieces, flush_after=flush_after)
    assert (tmp_path / "out").read_bytes() == b"".join(pieces)


def test_direct_io_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTAVG_DIRECT_IO", "0")
    pieces = [os.urandom(5000) for _ in range(5)]
    assert isinstance(_write(tmp_path / "out", pieces), WriteBehindFile)
    assert (tmp_path / "out").read_bytes() == b"".join(pieces)


def test_small_files_are_written_buffered(tmp_path):
    fs, where = resolve(str(tmp_path / "out"))
    handle = open_output(fs, where, True)
    handle.close()
    assert isinstance(handle, WriteBehindFile)


def test_a_filesystem_that_refuses_o_direct_at_open_gets_a_buffered_file(tmp_path, monkeypatch):
    def refuse(path: str, flags: int) -> int:
        os.close(os.open(path, flags & ~os.O_DIRECT, 0o600))  # Linux creates the file, then refuses
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)

    monkeypatch.setattr(atomic, "_direct", refuse)
    pieces = [os.urandom(5000) for _ in range(5)]
    assert isinstance(_write(tmp_path / "out", pieces), WriteBehindFile)
    assert (tmp_path / "out").read_bytes() == b"".join(pieces)


class _RefusesDirectWrites:
    """A raw file whose writes fail with EINVAL while "O_DIRECT" is set (as some FUSE and
    network filesystems do after accepting the flag at open). The flag lives in ``flags``, read
    and set through a stand-in for ``fcntl``, so that the test runs on any filesystem."""

    def __init__(self, path: Path) -> None:
        self.raw = open(path, "xb", buffering=0)  # noqa: SIM115 - closed by DirectFile
        self.flags = os.O_WRONLY | os.O_DIRECT
        self.refused = 0

    def write(self, data) -> int:
        if self.flags & os.O_DIRECT:
            self.refused += 1
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return self.raw.write(data)

    def fcntl(self, fd: int, command: int, argument: int = 0) -> int:
        assert fd == self.raw.fileno()
        if command == fcntl.F_SETFL:
            self.flags = argument
        return self.flags

    def __getattr__(self, name: str):
        return getattr(self.raw, name)


def test_a_filesystem_that_refuses_direct_writes_gets_them_buffered(tmp_path, monkeypatch):
    raw = _RefusesDirectWrites(tmp_path / "out")
    monkeypatch.setattr(fcntl, "fcntl", raw.fcntl)
    handle = DirectFile(raw)
    pieces = [os.urandom(n) for n in (100, STAGE, 5000, 3)]
    for piece in pieces:
        handle.write(piece)
    handle.close()
    assert raw.refused == 1 and not raw.flags & os.O_DIRECT
    assert (tmp_path / "out").read_bytes() == b"".join(pieces)


class _FailsAfter:
    """A raw file that takes ``budget`` bytes, then fails as a full disk does."""

    def __init__(self, path: Path, budget: int) -> None:
        self.raw = open(path, "xb", buffering=0)  # noqa: SIM115 - closed by DirectFile
        self.budget = budget

    def write(self, data) -> int:
        if len(data) > self.budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.budget -= len(data)
        return self.raw.write(data)

    def __getattr__(self, name: str):
        return getattr(self.raw, name)


def test_a_failed_background_write_is_raised_to_the_writer(tmp_path):
    handle = DirectFile(_FailsAfter(tmp_path / "out", STAGE))
    handle.write(os.urandom(STAGE))  # the first stage: written in the background
    handle.write(os.urandom(STAGE))  # the second: its write fails there
    with pytest.raises(OSError) as raised:
        handle.write(os.urandom(STAGE))  # waits for the failed write before reusing its stage
    assert raised.value.errno == errno.ENOSPC
    with pytest.raises(OSError):  # the writers' abort: close, its error ignored there
        handle.close()
    assert handle.closed


def test_a_failed_last_write_is_raised_by_close(tmp_path):
    handle = DirectFile(_FailsAfter(tmp_path / "out", 0))
    handle.write(b"x" * 10)
    with pytest.raises(OSError) as raised:
        handle.close()
    assert raised.value.errno == errno.ENOSPC
    assert handle.closed


def test_merges_write_the_same_bytes_with_and_without_direct_io(tmp_path, monkeypatch):
    run = tmp_path / "run"
    make_run(run, [1, 2, 3], {"a": (300, 700), "b": (12345,)})
    outputs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("CKPTAVG_DIRECT_IO", setting)
        out = tmp_path / f"out-{setting}"
        result = run_cli_in_process("merge", str(run), "--last", "3", "--out", str(out), "--shard-size", "300KB")
        assert result.returncode == 0, result.stderr
        outputs[setting] = files_of(out)
    assert len([name for name in outputs["1"] if name.endswith(".safetensors")]) > 1
    assert outputs["0"] == outputs["1"]
