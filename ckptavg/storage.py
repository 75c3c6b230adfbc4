"""The I/O edge: fsspec paths, positional reads into caller-owned buffers, atomic folders.

Everything above this module speaks in ``(fs, path)`` pairs, so a local folder, ``file://``,
``memory://`` or an object store all go through the same code.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import CkptavgError


def resolve(url: str) -> tuple[Any, str]:
    """Split a path or URL into an fsspec filesystem and the path inside it."""
    try:
        fs, path = fsspec.core.url_to_fs(str(url))
    except (ImportError, ValueError) as exc:
        raise CkptavgError(f"cannot open {url}: {exc}") from exc
    return fs, path.rstrip("/") or "/"


def join(fs: Any, *parts: str) -> str:
    sep = getattr(fs, "sep", "/")
    return sep.join(p.rstrip(sep) for p in parts if p)


def is_local(fs: Any) -> bool:
    return isinstance(fs, LocalFileSystem)


def display(fs: Any, path: str) -> str:
    """A path as the user should see it in messages (with its protocol when not local)."""
    if is_local(fs):
        return path
    return fs.unstrip_protocol(path)


class RandomAccessFile:
    """A file read at explicit offsets, safe to share between reader threads.

    Local files use ``os.preadv`` straight into the caller's buffer (no seek, no lock, no
    copy); other filesystems fall back to seek + readinto under a lock.
    """

    def __init__(self, fs: Any, path: str) -> None:
        self.path = path
        self.display_path = display(fs, path)
        try:
            if is_local(fs):
                self._fd: int | None = os.open(path, os.O_RDONLY)
                self._file = None
                self.size = os.fstat(self._fd).st_size
            else:
                self._fd = None
                self._file = fs.open(path, "rb")
                self.size = fs.size(path)
        except OSError as exc:
            raise CkptavgError(f"cannot open {self.display_path}: {exc.strerror or exc}") from exc
        self._lock = threading.Lock()

    def read_into(self, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the bytes at ``offset``; a short file is an error, not a retry."""
        wanted = len(buffer)
        if offset < 0 or offset + wanted > self.size:
            raise CkptavgError(
                f"{self.display_path}: read of {wanted} bytes at offset {offset} "
                f"runs past the end of the file ({self.size} bytes); the file is truncated"
            )
        done = 0
        try:
            if self._fd is not None:
                while done < wanted:
                    n = os.preadv(self._fd, [buffer[done:]], offset + done)
                    if n == 0:
                        break
                    done += n
            else:
                with self._lock:
                    self._file.seek(offset)
                    while done < wanted:
                        n = self._file.readinto(buffer[done:])
                        if not n:
                            break
                        done += n
        except OSError as exc:
            raise CkptavgError(f"cannot read {self.display_path}: {exc.strerror or exc}") from exc
        if done != wanted:
            raise CkptavgError(f"{self.display_path}: file ended early at offset {offset + done}")

    def read(self, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        self.read_into(offset, memoryview(buffer))
        return bytes(buffer)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._file is not None:
            self._file.close()
            self._file = None
