"""Write-behind of local output files (ckptavg.io.writeback): which ranges start for the disk,
which are waited for and dropped, in what order, and that no byte of an output changes."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import sys

import pytest
import torch
from helpers import files_of, make_run, run_cli_in_process

import ckptavg.io.writeback as writeback
from ckptavg.io.atomic import close_output, open_output
from ckptavg.io.fs import resolve

START, START_AND_WAIT = 2, 7
WINDOW = 4096


def _record(monkeypatch: pytest.MonkeyPatch, refuse: int | None = None) -> list[tuple]:
    """Every sync_file_range, fadvise and fsync call, in order; ``refuse``: each
    sync_file_range fails with that errno instead."""
    events: list[tuple] = []
    real_sfr = writeback.sync_file_range()
    real_fadvise, real_fsync = os.posix_fadvise, os.fsync

    def sfr(fd: int, offset: int, nbytes: int, flags: int) -> int:
        events.append(("range", offset, nbytes, flags))
        if refuse is not None:
            ctypes.set_errno(refuse)
            return -1
        return real_sfr(fd, offset, nbytes, flags) if real_sfr is not None else 0

    def fadvise(fd: int, offset: int, nbytes: int, advice: int) -> None:
        events.append(("drop", offset, nbytes, advice))
        real_fadvise(fd, offset, nbytes, advice)

    def fsync(fd: int) -> None:
        events.append(("fsync",))
        real_fsync(fd)

    # Tensor files take direct I/O where the disk allows it (ckptavg.io.direct); write-behind
    # is what they get where it does not.
    monkeypatch.setenv("CKPTAVG_DIRECT_IO", "0")
    monkeypatch.setattr(writeback, "sync_file_range", lambda: sfr)
    monkeypatch.setattr(writeback, "WINDOW_BYTES", WINDOW)
    monkeypatch.setattr(writeback, "LAG_WINDOWS", 2)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.setattr(os, "fsync", fsync)
    return events


def _write(path, pieces: list[bytes], fsync: bool) -> None:
    fs, where = resolve(str(path))
    handle = open_output(fs, where, fsync)
    for piece in pieces:
        handle.write(memoryview(piece))
    close_output(fs, handle, fsync)


def _pieces() -> list[bytes]:
    """Uneven writes (a header-like 100 bytes, then 3000-byte chunks): window ends fall inside them."""
    return [os.urandom(100)] + [os.urandom(3000) for _ in range(20)]


def test_a_durable_file_starts_each_window_and_waits_and_drops_the_one_two_back(tmp_path, monkeypatch):
    events = _record(monkeypatch)
    pieces = _pieces()
    _write(tmp_path / "out", pieces, fsync=True)
    assert (tmp_path / "out").read_bytes() == b"".join(pieces)

    ranges = [e for e in events if e[0] == "range"]
    starts = [(o, n) for _, o, n, flags in ranges if flags == START]
    # Back to back from 0, each ending with the write that took it past a window (100 + 2 x 3000
    # bytes, then 2 x 3000): 60,100 bytes in 10 windows.
    assert starts == [(0, 6100)] + [(6100 + 6000 * k, 6000) for k in range(9)]
    # The window two back is waited for, then dropped, in that order, after the next one started.
    waits = [(o, n) for _, o, n, flags in ranges if flags == START_AND_WAIT]
    assert waits == starts[: len(starts) - 2]
    drops = [(o, n) for _, o, n, _ in (e for e in events if e[0] == "drop")]
    assert drops == waits
    for window in waits:
        started = events.index(("range", *window, START))
        waited = events.index(("range", *window, START_AND_WAIT))
        dropped = events.index(("drop", *window, os.POSIX_FADV_DONTNEED))
        assert started < waited < dropped
        assert events[waited - 1][0] == "range" and events[waited - 1][3] == START  # right after a newer start
    # The fsync still makes the file durable, last.
    assert events[-1] == ("fsync",)


def test_without_fsync_nothing_waits_for_the_disk(tmp_path, monkeypatch):
    events = _record(monkeypatch)
    pieces = _pieces()
    _write(tmp_path / "out", pieces, fsync=False)
    assert (tmp_path / "out").read_bytes() == b"".join(pieces)
    flags = {e[3] for e in events if e[0] == "range"}
    assert flags == {START}
    assert ("fsync",) not in events
    assert [e for e in events if e[0] == "drop"]  # pages already written back still leave the cache


def test_a_file_smaller_than_a_window_makes_no_call(tmp_path, monkeypatch):
    events = _record(monkeypatch)
    _write(tmp_path / "out", [b"x" * (WINDOW - 1)], fsync=True)
    assert events == [("fsync",)]


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ESPIPE])
def test_a_filesystem_that_refuses_write_back_gets_the_file_written_as_before(tmp_path, monkeypatch, code):
    events = _record(monkeypatch, refuse=code)
    pieces = _pieces()
    _write(tmp_path / "out", pieces, fsync=True)
    assert (tmp_path / "out").read_bytes() == b"".join(pieces)
    assert [e[0] for e in events] == ["range", "fsync"]  # asked once, then left to the fsync


def test_an_interrupted_call_is_repeated(tmp_path, monkeypatch):
    answers = iter([errno.EINTR])
    calls = []

    def flaky(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append(offset)
        code = next(answers, None)
        if code is not None:
            ctypes.set_errno(code)
            return -1
        return 0

    monkeypatch.setattr(writeback, "sync_file_range", lambda: flaky)
    monkeypatch.setattr(writeback, "WINDOW_BYTES", WINDOW)
    _write(tmp_path / "out", [b"y" * WINDOW, b"z"], fsync=True)
    assert calls == [0, 0]


def test_a_write_back_error_fails_the_merge_in_one_line_and_publishes_nothing(tmp_path, monkeypatch):
    make_run(tmp_path / "run", [1, 2], {"a": (4096,), "b": (64,)})
    _record(monkeypatch, refuse=errno.EIO)
    out = tmp_path / "merged"
    result = run_cli_in_process("merge", str(tmp_path / "run"), "--last", "2", "--out", str(out))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot write" in lines[0] and "model" in lines[0] and "Input/output error" in lines[0]
    assert not out.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_linux_has_the_call_and_a_merge_through_small_windows_is_byte_identical(tmp_path, monkeypatch):
    assert writeback.sync_file_range() is not None
    make_run(tmp_path / "run", [1, 2, 3], {"a": (3, 5000), "b": (777,)}, dtype=torch.float32)
    command = ("merge", str(tmp_path / "run"), "--last", "3", "--chunk-size", "16384")  # many writes
    plain = tmp_path / "plain"
    assert run_cli_in_process(*command, "--out", str(plain)).returncode == 0
    events = _record(monkeypatch)  # the real call underneath, 4 KiB windows
    windowed = tmp_path / "windowed"
    assert run_cli_in_process(*command, "--out", str(windowed)).returncode == 0
    assert any(e[0] == "range" and e[3] == START_AND_WAIT for e in events)
    assert files_of(windowed) == files_of(plain)
    # The hash taken while writing (the manifest's) is that of the bytes on disk.
    manifest = (windowed / "ckptavg-manifest.json").read_text()
    for name, data in files_of(windowed).items():
        assert hashlib.sha256(data).hexdigest() in manifest, name
