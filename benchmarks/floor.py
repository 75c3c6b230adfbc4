"""The real floor of a merge on this machine: reading its inputs from the page cache, and writing
its output's size durably. Every benchmark prints its merge figures beside this floor, measured
in the same run, and reports merge / floor.

Why both, and why the larger one: a merge reads every input byte once and writes the output
once. With warm inputs the read is a copy out of the page cache (``raw_read.py``); the write goes
to the disk, and a durable one (ckptavg fsyncs by default, and writes its tensor files with
``O_DIRECT``: ckptavg/io/direct.py) cannot finish before the disk has taken every byte. The two
can overlap, so the floor is ``max(read, write)``; on this project's VM the write is usually the
larger (a 0.94 GB ``dd oflag=direct conv=fsync`` took 2.0-2.7 s on 2026-12-05, the read of four
times as much from the page cache about 0.6 s).

The write is what ``dd if=/dev/urandom of=F bs=8M oflag=direct conv=fsync`` does, without dd:
8 MiB blocks from one page-aligned buffer (random bytes, so that no layer below can shortcut
zeros), the last block padded to the 4 KiB alignment ``O_DIRECT`` needs and the file cut to its
size, then fsync; timed from open to the end of fsync, and the file removed afterwards. Where the
filesystem refuses ``O_DIRECT`` (tmpfs before Linux 6.6) the write is buffered and fsynced, and
the result says so (``direct: false``).

Use it from a benchmark driver in one of two ways:

* in a child process, so the driver's own RSS stays small (bench_merge.py's rule): run
  ``floor_command(paths, write_bytes, folder)`` like any measured command; it prints one JSON
  line (``parse_floor`` reads it back);
* in-process: ``measure_floor(paths, write_bytes, folder)`` returns a ``Floor`` (read and write
  seconds) directly, for scripts that do not mind 8 + 16 MiB of buffers in their own process.

Stdlib only: importing it loads neither torch nor ckptavg.
"""

from __future__ import annotations

import argparse
import errno
import json
import mmap
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from raw_read import read_all

HERE = Path(__file__).resolve().parent
BLOCK_BYTES = 8 * 2**20
ALIGN = 4096


@dataclass(frozen=True)
class Floor:
    """Seconds to read the inputs from the page cache and to write the output's size durably."""

    read_bytes: int
    read_seconds: float
    write_bytes: int
    write_seconds: float
    direct: bool  # whether the write bypassed the page cache (O_DIRECT), as ckptavg's does

    @property
    def seconds(self) -> float:
        """The floor itself: reading and writing can overlap, so the slower of the two."""
        return max(self.read_seconds, self.write_seconds)

    def record(self) -> dict[str, float | int | bool]:
        return {**asdict(self), "seconds": self.seconds}


def _open_for_writing(path: Path) -> tuple[int, bool]:
    """``path`` opened for writing with ``O_DIRECT`` where the filesystem takes it, else buffered."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, flags, 0o600), False


def write_durably(path: Path, write_bytes: int) -> tuple[float, bool]:
    """Write ``write_bytes`` random bytes to a new file ``path`` and fsync it: the seconds it took
    (open to the end of fsync), and whether the write was direct."""
    block = mmap.mmap(-1, BLOCK_BYTES)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(BLOCK_BYTES))
    view = memoryview(block)
    try:
        started = time.perf_counter()
        fd, direct = _open_for_writing(path)
        try:
            left = write_bytes
            while left > 0:
                n = min(BLOCK_BYTES, -(-left // ALIGN) * ALIGN)  # the last block padded to ALIGN
                os.write(fd, view[:n])
                left -= n
            os.ftruncate(fd, write_bytes)
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - started, direct
    finally:
        view.release()
        block.close()


def durable_write_seconds(write_bytes: int, folder: Path) -> tuple[float, bool]:
    """``write_durably`` to a new file in ``folder``, removed afterwards."""
    path = folder / f".floor-write-{os.getpid()}"
    try:
        return write_durably(path, write_bytes)
    finally:
        path.unlink(missing_ok=True)


def measure_floor(read_paths: Sequence[Path], write_bytes: int, write_folder: Path) -> Floor:
    """Read ``read_paths`` end to end (warm them first: this is the page-cache floor), then write
    ``write_bytes`` durably in ``write_folder`` (on the output's filesystem): one ``Floor``."""
    started = time.perf_counter()
    read_bytes = read_all(list(read_paths))
    read_seconds = time.perf_counter() - started
    os.sync()  # the write is timed alone, with no one else's dirty pages going out meanwhile
    write_seconds, direct = durable_write_seconds(write_bytes, write_folder)
    return Floor(read_bytes, read_seconds, write_bytes, write_seconds, direct)


def floor_command(read_paths: Sequence[Path], write_bytes: int, write_folder: Path) -> list[str]:
    """The command that measures ``measure_floor(...)`` in a child and prints it as one JSON line."""
    command = [sys.executable, str(HERE / "floor.py"), "--write-bytes", str(write_bytes)]
    return command + ["--write-folder", str(write_folder), *map(str, read_paths)]


def parse_floor(stdout: str) -> Floor:
    """The ``Floor`` a child of ``floor_command`` printed."""
    record = json.loads(stdout)
    record.pop("seconds")
    return Floor(**record)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("read_paths", nargs="+", type=Path, help="the merge's input files, already in the page cache")
    parser.add_argument("--write-bytes", type=int, required=True, help="the output's size in bytes")
    parser.add_argument("--write-folder", type=Path, required=True, help="a folder on the output's filesystem")
    args = parser.parse_args(argv)
    print(json.dumps(measure_floor(args.read_paths, args.write_bytes, args.write_folder).record()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
