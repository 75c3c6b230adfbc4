"""Reading files: positional reads into caller-owned buffers, bounded small files, strict JSON.

Every input ckptavg reads goes through :class:`RandomAccessFile`: a local file must be a regular
file inside the folder that names it, and no read runs past its end.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import mmap
import os
import stat
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import torch

from ..errors import CheckpointError
from .fs import FileSystem, display, is_local

_HASH_BLOCK = 16 * 2**20
# Linux 5.14's MADV_POPULATE_READ (Python 3.11 has no name for it): maps a whole range of
# cached pages in one call, where touching them would take a page fault per 64 KiB.
_MADV_POPULATE_READ = 22


def _libc_preadv() -> Any:
    """libc's ``preadv`` through ctypes (which drops the GIL for the call), or None where there
    is none or ``struct iovec`` is not two 64-bit words. ``os.preadv`` takes a Python buffer per
    vector: for the rows of a column-split tensor, a few hundred bytes each, building those
    objects cost more than the copy they save; here the vectors are an int64 tensor."""
    if ctypes.sizeof(ctypes.c_void_p) != 8 or ctypes.sizeof(ctypes.c_size_t) != 8:
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).preadv
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    function.restype = ctypes.c_ssize_t
    return function


def _iov_max() -> int:
    try:
        limit = os.sysconf("SC_IOV_MAX")
    except (ValueError, OSError):
        limit = -1
    return min(1024, limit) if limit > 0 else 16  # POSIX's minimum where the system does not say


_preadv = _libc_preadv()
IOV_MAX = _iov_max()
"""The most vectors one :meth:`RandomAccessFile.scatter_into` takes."""


class MappedRange:
    """Bytes of a local file seen in place through a memory mapping (no copy): ``data`` stays
    valid until the file is closed. :meth:`populate` maps the pages in advance (from a reader
    thread, so the arithmetic takes no page faults); :meth:`release` drops them from this
    process once consumed, so that its resident memory stays flat however much it reads."""

    def __init__(self, mapping: mmap.mmap, offset: int, nbytes: int) -> None:
        self._mapping = mapping
        self.data = memoryview(mapping)[offset : offset + nbytes]
        # madvise wants page-aligned starts.
        self._start = offset - offset % mmap.PAGESIZE
        self._end = offset + nbytes

    def _advise(self, option: int, end: int) -> None:
        if end > self._start and not self._mapping.closed:
            self._mapping.madvise(option, self._start, end - self._start)

    def populate(self) -> None:
        """Only advice: where it fails, the pages fault in when read."""
        try:
            self._advise(_MADV_POPULATE_READ, self._end)
        except OSError:  # before Linux 5.14: start the read-ahead, and the faults do the rest
            with contextlib.suppress(OSError):
                self._advise(mmap.MADV_WILLNEED, self._end)

    def release(self) -> None:
        """Drop the pages up to the last whole one: the page the range ends in is usually where
        the next range starts, already populated; dropping it would make that range fault on
        it, and a fault maps the 16 pages around it back in (fault-around), pages of this range
        included, which no release would ever drop again. The next range's release drops it."""
        self._advise(mmap.MADV_DONTNEED, self._end - self._end % mmap.PAGESIZE)


# Remote reads: one read of ``n`` bytes becomes min(REMOTE_PARTS, n // REMOTE_MIN_PART) (at
# least 1) concurrent range requests, and at most REMOTE_REQUESTS of them run at once in the
# process. An object store answers a request after tens of milliseconds, and serves each
# connection at a bounded rate (S3: on the order of 100 MB/s), so a merge's two reader threads,
# one request each, leave most of the bandwidth idle. The default chunk's read of bf16 input
# (8 MiB) becomes 4 requests of 2 MiB: the two readers keep 8 in flight. Smaller parts cost
# more per byte (request overhead: on loopback S3, 1 MiB parts read slower than 8 MiB ones).
# 8, plus the reader threads' own small requests, stays within botocore's default pool of 10
# connections per s3fs client, where more requests would only queue for a connection.
REMOTE_PARTS = 8
REMOTE_MIN_PART = 2 * 2**20
REMOTE_REQUESTS = 8

_range_pool: ThreadPoolExecutor | None = None
_range_pool_lock = threading.Lock()


def _remote_range_pool() -> ThreadPoolExecutor:
    """The process's pool for the parts of remote reads, shared by every file and merge so that
    their requests together stay within REMOTE_REQUESTS; its threads start on first use."""
    global _range_pool
    with _range_pool_lock:
        if _range_pool is None:
            _range_pool = ThreadPoolExecutor(max_workers=REMOTE_REQUESTS, thread_name_prefix="ckptavg-range")
        return _range_pool


def split_range(length: int) -> list[tuple[int, int]]:
    """(start, end) of the parts one remote read of ``length`` bytes is fetched in: at most
    REMOTE_PARTS, none under REMOTE_MIN_PART (one part below that), sizes differing by at most one."""
    parts = max(1, min(REMOTE_PARTS, length // REMOTE_MIN_PART))
    base, extra = divmod(length, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        bounds.append((start, end))
        start = end
    return bounds


def local_file_inside_folder(path: str) -> str:
    """The real path of the local file ``path``, which must resolve inside the folder that names
    it. Readers open only plain names in a checkpoint folder (``plain_file_name``), but such a
    name can still be a symbolic link leading elsewhere: reading it would average (with one
    source: copy) the bytes of any file the user can read into the output. The folder itself
    may be a link; only what it names is checked."""
    folder = os.path.realpath(os.path.dirname(path) or ".")
    real = os.path.realpath(path)
    if os.path.commonpath([folder, real]) != folder or real == folder:
        raise CheckpointError(
            f"{path}: refusing a symbolic link that leaves its checkpoint folder (it resolves to {real})"
        )
    return real


class RandomAccessFile:
    """A file read at explicit offsets, safe to share between reader threads.

    Local files use ``os.preadv`` straight into the caller's buffer (no seek, no lock, no
    copy); they must resolve inside the folder that names them
    (:func:`local_file_inside_folder`). Other filesystems get one range request per read
    (``cat_file`` with start and end), a large read several at once (:func:`split_range`):
    reader threads fetch in parallel, and nothing is read ahead of what is asked, where a
    buffered handle would fetch whole blocks past a safetensors header or a tensor's end and
    serialise the threads on one seek position.
    """

    def __init__(self, fs: FileSystem, path: str) -> None:
        self.path = path
        self.display_path = display(fs, path)
        self._fs = fs
        self._fd: int | None = None
        self._mapping: mmap.mmap | None = None
        self._map_lock = threading.Lock()
        try:
            if is_local(fs):
                # O_NONBLOCK: opening a FIFO for reading would wait for a writer, forever; it
                # changes nothing for the regular files that are all this accepts.
                self._fd = os.open(local_file_inside_folder(path), os.O_RDONLY | os.O_NONBLOCK)
                status = os.fstat(self._fd)
                if not stat.S_ISREG(status.st_mode):
                    self.close()
                    raise CheckpointError(f"{self.display_path}: not a regular file (a FIFO, device or socket)")
                self.size = status.st_size
            else:
                size = fs.size(path)
                if size is None:
                    raise CheckpointError(f"cannot open {self.display_path}: the store does not tell its size")
                self.size = int(size)
        except OSError as exc:
            raise CheckpointError(f"cannot open {self.display_path}: {exc.strerror or exc}") from exc

    def _check_range(self, offset: int, wanted: int) -> None:
        if offset < 0 or offset + wanted > self.size:
            raise CheckpointError(
                f"{self.display_path}: read of {wanted} bytes at offset {offset} "
                f"runs past the end of the file ({self.size} bytes); the file is truncated"
            )

    def local_view(self, offset: int, nbytes: int) -> MappedRange | None:
        """The bytes at ``offset`` in place, through a private read-only-in-practice mapping of
        the whole file (``mmap`` ``ACCESS_COPY``: writable for ``torch.frombuffer``, never
        written); None for a file of an object store, or where the file cannot be mapped. A
        file truncated by someone else while mapped raises SIGBUS instead of an error, one
        reason why merges only map with ``--mmap``."""
        self._check_range(offset, nbytes)
        if self._fd is None or nbytes == 0:
            return None
        with self._map_lock:
            if self._mapping is None:
                try:
                    self._mapping = mmap.mmap(self._fd, self.size, access=mmap.ACCESS_COPY)
                except (OSError, ValueError):
                    return None
        return MappedRange(self._mapping, offset, nbytes)

    def read_into(self, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the bytes at ``offset``; a short file is an error, not a retry."""
        wanted = len(buffer)
        self._check_range(offset, wanted)
        try:
            done = self._pread(self._fd, offset, buffer) if self._fd is not None else self._range_read(offset, buffer)
        except OSError as exc:
            raise CheckpointError(f"cannot read {self.display_path}: {exc.strerror or exc}") from exc
        if done != wanted:
            raise CheckpointError(f"{self.display_path}: file ended early at offset {offset + done}")

    @property
    def scatters(self) -> bool:
        """Whether :meth:`scatter_into` can be used: a local file, and libc's ``preadv``."""
        return self._fd is not None and _preadv is not None

    def scatter_into(self, offset: int, vectors: torch.Tensor) -> None:
        """Fill the memory that ``vectors`` describes with the file's consecutive bytes from
        ``offset`` on, in one ``preadv`` (another only after a short read). ``vectors`` is a
        contiguous int64 tensor of at most :data:`IOV_MAX` rows (address, length): a ``struct
        iovec`` array, whose memory the caller owns and keeps alive. Only where :attr:`scatters`."""
        assert self._fd is not None and _preadv is not None
        wanted = int(vectors[:, 1].sum())
        self._check_range(offset, wanted)
        done = 0
        while done < wanted:
            got = _preadv(self._fd, vectors.data_ptr(), len(vectors), offset + done)
            if got < 0:
                code = ctypes.get_errno()
                if code == errno.EINTR:
                    continue
                raise CheckpointError(f"cannot read {self.display_path}: {os.strerror(code)}")
            if got == 0:
                raise CheckpointError(f"{self.display_path}: file ended early at offset {offset + done}")
            done += got
            if done < wanted:
                vectors = _unfilled(vectors, got)

    @staticmethod
    def _pread(fd: int, offset: int, buffer: memoryview) -> int:
        done = 0
        while done < len(buffer):
            n = os.preadv(fd, [buffer[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    def _range_read(self, offset: int, buffer: memoryview) -> int:
        target = buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B")
        parts = split_range(len(target))
        if len(parts) == 1:
            return self._fetch(offset, target)
        pool = _remote_range_pool()
        futures = [pool.submit(self._fetch, offset + start, target[start:end]) for start, end in parts]
        _, pending = wait(futures, return_when=FIRST_EXCEPTION)
        if pending:
            # A part failed: the others must not write into the caller's buffer after this
            # returns, so cancel those not started and wait for the running ones.
            for future in pending:
                future.cancel()
            wait(pending)
            for future in futures:
                if not future.cancelled():
                    future.result()  # raises the failed part's error
        done = 0
        for (start, end), future in zip(parts, futures, strict=True):
            got = future.result()
            if got != end - start:
                return start + got  # the file ended early inside this part
            done = end
        return done

    def _fetch(self, offset: int, target: memoryview) -> int:
        if not len(target):
            return 0
        data = self._fs.cat_file(self.path, start=offset, end=offset + len(target))
        done = min(len(data), len(target))
        target[:done] = memoryview(data)[:done]
        return done

    def read(self, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        self.read_into(offset, memoryview(buffer))
        return bytes(buffer)

    def close(self) -> None:
        if self._mapping is not None:
            with contextlib.suppress(BufferError):  # views still exported: unmapped with the last one
                self._mapping.close()
            self._mapping = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RandomAccessFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unfilled(vectors: torch.Tensor, filled: int) -> torch.Tensor:
    """The vectors still to fill after a read of ``filled`` bytes into ``vectors`` (a copy: the
    caller's are left as they are)."""
    ends = vectors[:, 1].cumsum(0)
    first = int(torch.searchsorted(ends, filled, right=True))  # the first vector not filled in full
    rest = vectors[first:].clone()
    into = filled - (int(ends[first - 1]) if first else 0)
    rest[0, 0] += into
    rest[0, 1] -= into
    return rest


def read_small_file(fs: FileSystem, path: str, limit: int, what: str) -> bytes:
    """The whole of a file that describes a checkpoint (an index, a DCP ``.metadata``), opened
    as :class:`RandomAccessFile` opens every input (inside its folder, a regular file) and
    refused from its size, before a byte is read, when larger than ``limit``: such files are
    read into memory whole, and a sparse file of any size costs its writer nothing."""
    with RandomAccessFile(fs, path) as file:
        if file.size > limit:
            raise CheckpointError(
                f"{file.display_path}: {file.size} bytes, more than the {limit} bytes {what} can plausibly take"
            )
        return file.read(0, file.size)


# A JSON file of a checkpoint or an output lists at most a few hundred bytes per tensor or file:
# the index of a 671B model (92k tensors) is 9 MB. 64 MiB is room for seven times that.
MAX_JSON_BYTES = 64 * 2**20


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused when it repeats a key: Python would keep the last value where other
    readers (the safetensors library) refuse the file, so it would mean one thing to ckptavg and
    another, or nothing, to them."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r:.100}")
        obj[key] = value
    return obj


def parse_json(data: bytes | str, where: str) -> Any:
    """JSON of a checkpoint or an output; any failure is one line naming ``where``: malformed
    text or encoding, a repeated key, nesting past the recursion limit, or an integer past
    Python's 4300-digit conversion limit (a plain ValueError, not a JSONDecodeError)."""
    try:
        value = json.loads(data)
        if _no_key_repeated(data, value):
            return value
        return json.loads(data, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{where}: not valid JSON ({exc})") from None


def _no_key_repeated(data: bytes | str, value: Any) -> bool:
    """Whether ``value``, parsed from ``data``, proves at C speed that no object of ``data``
    repeats a key (False: maybe one does, and :func:`_unique_keys` must see every pair, which
    cost a Python call per object: 0.1 s per header of 25k tensors).

    The proof: every key of the text is followed by a ``:`` (one byte 0x3A in any encoding
    JSON allows), so the text's count of them is at least its keys, which are at least those
    of the parsed objects (a repeat loses one), which are at least those counted here (the top
    object's and its objects'). The first and the last equal, all are equal: no key was lost. A
    ``:`` inside a string, or an object nested deeper, makes them differ, and the pairs are
    checked one by one."""
    colons = data.count(":") if isinstance(data, str) else data.count(b":")
    if type(value) is not dict:
        return colons == 0
    return colons == len(value) + sum(len(inner) for inner in value.values() if type(inner) is dict)


def read_json(fs: FileSystem, path: str, what: str) -> Any:
    """A JSON file of a checkpoint or an output (:func:`read_small_file`, :func:`parse_json`)."""
    return parse_json(read_small_file(fs, path, MAX_JSON_BYTES, what), display(fs, path))


def sha256_file(
    fs: FileSystem, path: str, start: int = 0, stop: int | None = None, head: Any = None
) -> tuple[str, int]:
    """(sha256, size) of a file, or of its bytes ``[start, stop)`` (as far as it holds them),
    read in 16 MiB blocks as every input is read (:class:`RandomAccessFile`): a local file must
    be a regular file inside its folder, since a FIFO would never open and a link to
    ``/dev/zero`` never end. ``head``: a sha256 of the bytes before ``start``, continued (a
    copy: it stays as it was)."""
    digest = hashlib.sha256() if head is None else head.copy()
    with RandomAccessFile(fs, path) as file:
        end = file.size if stop is None else min(stop, file.size)
        view = memoryview(bytearray(max(0, min(_HASH_BLOCK, end - start))))
        for offset in range(start, end, _HASH_BLOCK):
            block = view[: min(_HASH_BLOCK, end - offset)]
            file.read_into(offset, block)
            digest.update(block)
    return digest.hexdigest(), file.size
