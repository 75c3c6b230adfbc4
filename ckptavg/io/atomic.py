"""Writing files so that each appears complete or not at all, and durable before it counts.

Durability (local disks; on by default, ``fsync=False`` to skip it): every file is fsynced
through the handle that wrote it before it is closed, and a folder after a rename in it, as
``torch.distributed.checkpoint``'s FileSystemWriter does: a power loss cannot publish a
complete-looking file whose bytes never reached the disk. An object store upload is durable
once it completes; there is nothing to fsync. Local output files are always created new
(``O_EXCL``, ``O_NOFOLLOW``): whatever held the name is removed first, so nothing is ever
written through a symbolic or hard link.

The output *folder* of a merge (hidden while written, renamed when complete) is built from
these in :mod:`ckptavg.merging.publish`, which publishes it with :func:`rename_no_replace` and,
on object stores, claims it with :func:`create_object`: neither ever replaces what another
process put at the name.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import io
import json
import os
import stat
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, cast

from ..errors import OutputError
from .direct import DirectFile
from .files import local_file_inside_folder
from .fs import FileSystem, display, is_local, join
from .writeback import WriteBehindFile


def parent_and_name(fs: FileSystem, path: str) -> tuple[str, str]:
    """The folder that holds ``path`` and its name in it."""
    path = path.rstrip("/")
    parent, _, name = path.rpartition("/")
    return parent or "/", name


def open_output(fs: FileSystem, path: str, fsync: bool = False, direct: bool = False) -> BinaryIO:
    """A new binary file at ``path``, to write front to back and then close with
    :func:`close_output` (with the same ``fsync``).

    On a local disk whatever holds the name already (a half-written file of an interrupted run,
    a link planted in the folder) is removed first, then the file is created with ``O_EXCL``:
    nothing is ever written through a symbolic link or into the inode of a hard link. With
    ``direct`` (tensor data: files of megabytes to gigabytes) its bytes bypass the page cache
    (:mod:`.direct`) where the filesystem allows it and ``CKPTAVG_DIRECT_IO`` is not ``0``;
    otherwise they start for the disk while it is written (:mod:`.writeback`; with ``fsync``,
    waited for)."""
    if not is_local(fs):
        return fs.open(path, "wb")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    if direct and _direct_io():
        try:
            raw = open(path, "xb", buffering=0, opener=_direct)  # noqa: SIM115 - closed with the file
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this filesystem takes no O_DIRECT
                raise
            # Linux refuses the flag only after creating the file.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        else:
            return cast(BinaryIO, DirectFile(raw))
    raw = open(path, "xb", buffering=0, opener=_no_follow)  # noqa: SIM115 - closed with the file
    return WriteBehindFile(raw, wait=fsync)


def _direct_io() -> bool:
    """Whether tensor files are written with ``O_DIRECT``: where the OS has it, unless
    ``CKPTAVG_DIRECT_IO=0``."""
    return hasattr(os, "O_DIRECT") and os.environ.get("CKPTAVG_DIRECT_IO", "1") != "0"


def open_output_range(path: str, size: int, start: int, fsync: bool = False) -> BinaryIO:
    """A local file of ``size`` bytes that several processes write at once, each its own byte
    range; positioned at ``start`` (a multiple of :data:`.direct.ALIGN`), to write front to back
    from there and close with :func:`close_output`. Created if absent but never removed first
    (another process may be writing it already); sized by every process alike (extending or
    cutting it only past ``size``, where nobody writes). Never a link: ``O_NOFOLLOW``, and one
    name only. Written as :func:`open_output` writes tensor data (direct I/O where the filesystem
    takes it, else write-behind): ranges are whole blocks but at the file's end, so no block is
    written by two processes."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    direct = _direct_io()
    try:
        fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o666)
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:  # EINVAL: this filesystem takes no O_DIRECT
            raise
        direct, fd = False, os.open(path, flags, 0o666)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_nlink != 1:
            raise OSError(errno.EEXIST, "exists and is not a file of its own (a link or a special file)")
        os.ftruncate(fd, size)
        os.lseek(fd, start, os.SEEK_SET)
        raw = io.FileIO(fd, "w")
    except BaseException:
        os.close(fd)
        raise
    return cast(BinaryIO, DirectFile(raw, start)) if direct else WriteBehindFile(raw, wait=fsync)


def _direct(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_DIRECT, 0o666)


def _no_follow(path: str, flags: int) -> int:
    # "x" already makes it O_CREAT | O_EXCL, which never follows a link; O_NOFOLLOW says so twice.
    return os.open(path, flags | os.O_NOFOLLOW, 0o666)


def close_output(fs: FileSystem, handle: BinaryIO, fsync: bool) -> None:
    """Close a file from :func:`open_output`; with ``fsync`` its bytes reach a local disk first,
    through the handle that wrote them (where a write-back error is reported)."""
    try:
        if fsync and is_local(fs):
            handle.flush()
            os.fsync(handle.fileno())
    finally:
        handle.close()


@contextlib.contextmanager
def output_file(fs: FileSystem, path: str, fsync: bool) -> Iterator[BinaryIO]:
    """:func:`open_output` for a ``with`` block: closed by :func:`close_output` when the block
    ends normally, just closed when it raises."""
    handle = open_output(fs, path, fsync)
    try:
        yield handle
        close_output(fs, handle, fsync)
    finally:
        handle.close()


def _sync_path(path: str, flags: int) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_folder(fs: FileSystem, path: str, fsync: bool) -> None:
    """With ``fsync``, make a local folder's entries durable (files created, renamed or removed
    in it): a rename is on disk only once its folder is synced."""
    if fsync and is_local(fs):
        _sync_path(path, os.O_DIRECTORY)


def sync_file(fs: FileSystem, path: str, fsync: bool) -> None:
    """With ``fsync``, make a local file that this process did not write durable (a file an
    interrupted run wrote, perhaps with ``--no-fsync``, and a resumed run reuses)."""
    if fsync and is_local(fs):
        _sync_path(path, os.O_NOFOLLOW)


def temp_path(fs: FileSystem, path: str) -> str:
    """Where to write ``path`` before :func:`publish_file`: a hidden sibling on a local disk; the
    path itself on object stores, which have no rename and make an object visible only once its
    upload is complete."""
    if not is_local(fs):
        return path
    parent, name = parent_and_name(fs, path)
    return join(fs, parent, f".{name}.tmp-{uuid.uuid4().hex[:8]}")


def publish_file(fs: FileSystem, tmp: str, path: str, fsync: bool = True) -> None:
    """Give a file written at ``temp_path(fs, path)`` its final name (atomic on a local disk, and
    with ``fsync`` durable: the file was synced when closed, its folder is synced after)."""
    if tmp == path:
        return
    try:
        os.replace(tmp, path)
        sync_folder(fs, parent_and_name(fs, path)[0], fsync)
    except OSError as exc:
        raise OutputError(f"cannot write {display(fs, path)}: {exc.strerror or exc}") from exc


# <fcntl.h>: AT_FDCWD; <linux/fs.h>: RENAME_NOREPLACE.
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
# What a kernel without renameat2, or a filesystem that does not take the flag, answers.
_NO_RENAMEAT2 = frozenset({errno.ENOSYS, errno.EINVAL})


@functools.cache
def renameat2() -> Callable[[int, bytes, int, bytes, int], int] | None:
    """libc's ``renameat2(olddirfd, old, newdirfd, new, flags)`` (0 or -1 with errno; glibc 2.28
    and later), or None. Python's os module lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def rename_no_replace(source: str, target: str) -> None:
    """Rename the local folder ``source`` to ``target`` unless something is at ``target``
    already: then raise :class:`FileExistsError` and leave both as they are.

    On Linux this is one atomic step, ``renameat2(RENAME_NOREPLACE)``. Where that is missing
    (another OS, an older C library or kernel) or the filesystem refuses the flag (``EINVAL``:
    some network filesystems), the name is checked and then renamed with POSIX ``rename``, which
    never replaces a folder that holds anything (``ENOTEMPTY``/``EEXIST``), nor a file with a
    folder (``ENOTDIR``): in the moment between the two, only an empty folder made at ``target``
    can be replaced, never an output, which always holds its manifest."""
    function = renameat2()
    if function is not None:
        if function(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE) == 0:
            return
        import ctypes

        code = ctypes.get_errno()
        if code not in _NO_RENAMEAT2:
            raise OSError(code, os.strerror(code), source, None, target)  # EEXIST: a FileExistsError
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), target)
    try:
        os.rename(source, target)
    except OSError as exc:
        if os.path.lexists(target):  # made meanwhile: ENOTEMPTY, EEXIST or ENOTDIR
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), target) from exc
        raise


def create_object(fs: FileSystem, path: str, data: bytes) -> None:
    """Create the small object ``path`` on an object store, or raise :class:`FileExistsError` if
    it exists. Atomic where the store takes a conditional write: s3fs sends ``If-None-Match: *``,
    and AWS S3 (and the S3 servers that implement it) refuse the second of two racing creates.
    Elsewhere (``memory://``, stores whose fsspec ``x`` mode only checks) the existence check
    made here first leaves a moment between check and write."""
    if fs.exists(path):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
    with fs.open(path, "xb") as handle:
        handle.write(data)


def discard_file(fs: FileSystem, path: str) -> None:
    """Remove a file if it is there; a missing file is not an error."""
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)


@contextlib.contextmanager
def atomic_write(fs: FileSystem, path: str, fsync: bool = True) -> Iterator[BinaryIO]:
    """A binary file handle whose content appears at ``path`` complete or not at all (and, with
    ``fsync``, durable before it appears)."""
    tmp = temp_path(fs, path)
    opened = False
    try:
        with output_file(fs, tmp, fsync) as handle:
            opened = True
            yield handle
    except OSError as exc:
        discard_file(fs, tmp)
        action = "write" if opened else "create"
        raise OutputError(f"cannot {action} {display(fs, path)}: {exc.strerror or exc}") from exc
    except BaseException:
        discard_file(fs, tmp)
        raise
    publish_file(fs, tmp, path, fsync)


def copy_file(fs: FileSystem, source: str, dest_fs: FileSystem, dest: str, fsync: bool = True) -> str:
    """Copy one small file from ``fs`` to ``dest_fs`` (a run on one filesystem may be merged into
    an output on another); return its sha256. A local ``source`` must resolve inside its folder:
    a config file linked to, say, a private key would otherwise travel into the output."""
    digest = hashlib.sha256()
    real = local_file_inside_folder(source) if is_local(fs) else source
    try:
        with fs.open(real, "rb") as src, output_file(dest_fs, dest, fsync) as dst:
            while block := src.read(4 * 2**20):
                digest.update(block)
                dst.write(block)
    except OSError as exc:
        raise OutputError(
            f"cannot copy {display(fs, source)} to {display(dest_fs, dest)}: {exc.strerror or exc}"
        ) from exc
    return digest.hexdigest()


def write_json(fs: FileSystem, path: str, payload: dict[str, Any], fsync: bool = True) -> str:
    """Write a JSON file; return its sha256."""
    return write_bytes(fs, path, (json.dumps(payload, indent=2, sort_keys=False) + "\n").encode(), fsync)


def write_bytes(fs: FileSystem, path: str, data: bytes, fsync: bool = True) -> str:
    """Write a small file; return its sha256."""
    try:
        with output_file(fs, path, fsync) as handle:
            handle.write(data)
    except OSError as exc:
        raise OutputError(f"cannot write {display(fs, path)}: {exc.strerror or exc}") from exc
    return hashlib.sha256(data).hexdigest()
