"""Write-behind for buffered local output files: a file's bytes start for the disk while the
rest of it is still being produced, and leave the page cache once they are on it.

Tensor files take direct I/O instead (:mod:`.direct`) where the filesystem allows it; this
serves them where it does not (or with ``CKPTAVG_DIRECT_IO=0``), and the small files.

Without it a merge writes its whole output into the page cache and then waits, in the file's
final fsync, for the disk to take all of it: the arithmetic and the disk take turns. And the
output crowds the page cache: a 140 GB merge would push out its own inputs' pages and other
jobs' on a shared node, and on this project's VM growing the page cache by the output's size
cost more system time than the merge's arithmetic. With it, every :data:`WINDOW_BYTES` written
start their write-back at once (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not
wait), and the window :data:`LAG_WINDOWS` earlier is dropped from the page cache
(``POSIX_FADV_DONTNEED``); a durable file (``wait``, the merge's default) waits for that window
to be on disk first, so at most ``LAG_WINDOWS + 1`` windows of it are dirty or in flight and its
own fsync (still what makes it durable: ``sync_file_range`` writes no metadata and flushes no
disk cache) waits for little. Without ``wait`` (``--no-fsync``) only pages already written back
are dropped and nothing waits for the disk.

Measured on the 2-core VM (4 x 1.98 GB bf16 merged into 1.98 GB, 3 runs each): 5.0-5.4 s with
write-behind and fsync, 6.2-10.3 s without dropping, 6.9-8.2 s with neither (``--no-fsync``);
a bare 2 GiB write + fsync 0.7-0.8 s this way against 1.6-5.7 s written, then fsynced.

Linux only (``sync_file_range`` through ctypes: Python's os module lacks it); elsewhere, or on a
filesystem that refuses it, a file is written as before (and synced when closed).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import os
import sys
from collections import deque
from collections.abc import Callable
from typing import Any

WINDOW_BYTES = 64 * 2**20
"""Bytes written between two starts of write-back (large enough that the calls cost nothing)."""
LAG_WINDOWS = 4
"""Windows in flight before the oldest is waited for: the disk's queue stays full meanwhile."""

# <linux/fs.h>: SYNC_FILE_RANGE_WAIT_BEFORE = 1, SYNC_FILE_RANGE_WRITE = 2, SYNC_FILE_RANGE_WAIT_AFTER = 4.
_START = 2
_START_AND_WAIT = 1 | 2 | 4
# What a filesystem (or a kernel) that has no write-back to start answers: fall back to the fsync.
_UNSUPPORTED = frozenset({errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ESPIPE})


@functools.cache
def sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range(fd, offset, nbytes, flags)`` (0 or -1 with errno), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _errno() -> int:
    import ctypes

    return ctypes.get_errno()


class WriteBehindFile(io.BufferedWriter):
    """A local file written front to back (every writer of an output file is, from the start of
    its range where several processes write one file: :func:`.atomic.open_output_range`) whose finished
    windows go to disk while the next ones are written; with ``wait``, each waited for
    :data:`LAG_WINDOWS` windows later. See the module's docstring."""

    def __init__(self, raw: io.RawIOBase, wait: bool = True) -> None:
        super().__init__(raw)
        self._wait = wait
        self._function = sync_file_range()
        self._since = 0  # bytes written since the last window was started
        # The file's bytes before this offset have had their write-back started (or are another
        # writer's: a process writing its byte range of a shared file starts where its range does).
        self._started = raw.tell()
        self._in_flight: deque[tuple[int, int]] = deque()

    def write(self, data: Any) -> int:
        written = super().write(data)
        self._since += written
        if self._function is not None and self._since >= WINDOW_BYTES:
            self._since = 0
            self.flush()  # the window's bytes in the page cache, not in this object's buffer
            self._next_window(self.tell())
        return written

    def _next_window(self, end: int) -> None:
        if not self._call(self._started, end - self._started, _START):
            return
        self._in_flight.append((self._started, end))
        self._started = end
        while len(self._in_flight) > LAG_WINDOWS:
            start, stop = self._in_flight.popleft()
            if self._wait and not self._call(start, stop - start, _START_AND_WAIT):
                return
            # Only advice: the pages are clean now, and nothing here reads them back.
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(self.fileno(), start, stop - start, os.POSIX_FADV_DONTNEED)

    def _call(self, offset: int, nbytes: int, flags: int) -> bool:
        """Whether write-back goes on: False once the filesystem turns it down (the file's
        fsync then does all the work, as without write-behind); a write error is raised."""
        assert self._function is not None
        while self._function(self.fileno(), offset, nbytes, flags) != 0:
            code = _errno()
            if code == errno.EINTR:
                continue
            if code in _UNSUPPORTED:
                self._function = None
                return False
            raise OSError(code, os.strerror(code))
        return True
