"""The output folder, published so that nothing half-written ever looks like a finished merge.

On a local disk the folder is written beside the target under a hidden name and renamed when
complete: a crash leaves at most a hidden ``.NAME.tmp-*`` folder. Object stores have no rename
(``mv`` copies every byte), so there the files are written in place and the manifest, the last
file written, is what marks the folder complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
from collections.abc import Iterable, Iterator
from fnmatch import fnmatch
from typing import Any

from .errors import CkptavgError
from .storage import RandomAccessFile, display, is_local, join, local_file_inside_folder

MANIFEST_FILE = "ckptavg-manifest.json"
# Files of a source folder that are weights, optimizer or trainer state: never copied.
NOT_COPIED = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.distcp",
    "*.pkl",
    "trainer_state.json",
    MANIFEST_FILE,
    ".*",
)
_HASH_BLOCK = 16 * 2**20


def _parent_and_name(fs: Any, path: str) -> tuple[str, str]:
    path = path.rstrip("/")
    parent, _, name = path.rpartition("/")
    return parent or "/", name


class AtomicFolder:
    """Context manager: ``tmp`` is where to write; :meth:`commit` publishes it as ``target``.

    Local disk: ``tmp`` is a hidden sibling folder, renamed to ``target`` by :meth:`commit`; an
    existing target is replaced only with ``force``, and only after the new one is complete.

    Any other filesystem (object stores, ``memory://``): ``tmp`` is ``target`` itself and the
    caller's last file, :data:`MANIFEST_FILE`, is the commit marker. A target with a manifest is
    replaced only with ``force``: its manifest goes first (so it stops looking complete), then
    its other files, then the new files are written. A target without a manifest needs
    ``force`` too: it may be a crashed merge, but it may as well be any folder ``--out`` points
    at, and its files are not ours to delete unasked. An error before :meth:`commit` removes
    what was written (best effort; the manifest first), so nothing half-written looks complete.
    """

    def __init__(self, fs: Any, target: str, force: bool = False, resume: bool = False) -> None:
        self.fs = fs
        self.target = target.rstrip("/")
        self.force = force
        self.resume = resume
        self.resumed = False
        self.in_place = not is_local(fs)
        parent, name = _parent_and_name(fs, self.target)
        self._parent, self._name = parent, name
        self.tmp = self.target if self.in_place else join(fs, parent, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
        self.committed = False

    def _check_target(self) -> None:
        if self.fs.exists(self.target) and not self.force:
            raise CkptavgError(f"output {display(self.fs, self.target)} already exists; pass --force to replace it")

    def __enter__(self) -> AtomicFolder:
        if self.in_place:
            if self.resume and self._unfinished_in_place():
                self.resumed = True
                return self
            self._clear_in_place()
            return self
        self._check_target()
        if self.resume:
            earlier = self._unfinished_sibling()
            if earlier is not None:
                self.tmp, self.resumed = earlier, True
                return self
        try:
            self.fs.makedirs(self._parent, exist_ok=True)
            self.fs.makedirs(self.tmp, exist_ok=False)
        except OSError as exc:
            # Named by the target: the hidden folder is ours, the output folder is what was asked for.
            raise CkptavgError(f"cannot create output {display(self.fs, self.target)}: {exc.strerror or exc}") from exc
        return self

    def _unfinished_sibling(self) -> str | None:
        """The newest hidden folder an interrupted merge into this target left. Adopting it is
        safe whatever it holds (a run may die before its journal exists, or while writing it):
        a file is reused only where a journal of this same merge vouches for its sha256, and
        everything else is removed before publishing."""
        prefix = f".{self._name}.tmp-"
        try:
            entries = self.fs.ls(self._parent, detail=True)
        except FileNotFoundError:
            return None
        found = [
            (entry.get("mtime", 0), entry["name"])
            for entry in entries
            if entry.get("type") == "directory" and entry["name"].rstrip("/").rsplit("/", 1)[-1].startswith(prefix)
        ]
        return max(found)[1].rstrip("/") if found else None

    def _unfinished_in_place(self) -> bool:
        from .journal import has_journal

        return not self.fs.isfile(join(self.fs, self.target, MANIFEST_FILE)) and has_journal(self.fs, self.target)

    def _existing_files(self) -> list[str]:
        try:
            return self.fs.find(self.target)
        except FileNotFoundError:
            return []

    def _clear_in_place(self) -> None:
        """Make room for an in-place write: refuse or remove what is at the target."""
        if not self._existing_files():
            return
        shown = display(self.fs, self.target)
        if not self.force:
            if self.fs.isfile(join(self.fs, self.target, MANIFEST_FILE)):
                raise CkptavgError(f"output {shown} already exists; pass --force to replace it")
            raise CkptavgError(
                f"output {shown} already exists but has no {MANIFEST_FILE} (an unfinished merge?); "
                "pass --force to replace it"
            )
        try:
            self._remove_in_place()
        except OSError as exc:
            raise CkptavgError(f"cannot remove the old {shown}: {exc.strerror or exc}") from exc

    def _remove_in_place(self) -> None:
        """Remove the target's files, the manifest first so the folder never looks complete."""
        discard_file(self.fs, join(self.fs, self.target, MANIFEST_FILE))
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.target, recursive=True)

    def commit(self) -> None:
        if self.in_place:
            self.committed = True  # the manifest, written last, already made it complete
            return
        self._check_target()
        shown = display(self.fs, self.target)
        old = None
        try:
            if self.fs.exists(self.target):
                aside = join(self.fs, self._parent, f".{self._name}.old-{uuid.uuid4().hex[:8]}")
                os.rename(self.target, aside)  # each rename is atomic on one filesystem
                old = aside
            os.rename(self.tmp, self.target)
        except OSError as exc:
            # E.g. another merge published the same target meanwhile (ENOTEMPTY): put back what
            # was there; the caller's __exit__ removes the new files.
            if old is not None:
                with contextlib.suppress(OSError):
                    os.rename(old, self.target)
            raise CkptavgError(f"cannot publish output {shown}: {exc.strerror or exc}") from exc
        self.committed = True
        if old is not None:
            try:
                self.fs.rm(old, recursive=True)
            except OSError as exc:
                raise CkptavgError(
                    f"output {shown} is published, but the output it replaced is left in {display(self.fs, old)}: "
                    f"{exc.strerror or exc}"
                ) from exc

    def __exit__(self, *exc: object) -> None:
        if self.committed:
            return
        # Best effort: a failed clean-up must never hide the error that brought us here.
        with contextlib.suppress(Exception):
            if self.in_place:
                self._remove_in_place()
            else:
                self.fs.rm(self.tmp, recursive=True)


def temp_path(fs: Any, path: str) -> str:
    """Where to write ``path`` before :func:`publish_file`: a hidden sibling on a local disk; the
    path itself on object stores, which have no rename and make an object visible only once its
    upload is complete."""
    if not is_local(fs):
        return path
    parent, name = _parent_and_name(fs, path)
    return join(fs, parent, f".{name}.tmp-{uuid.uuid4().hex[:8]}")


def publish_file(fs: Any, tmp: str, path: str) -> None:
    """Give a file written at ``temp_path(fs, path)`` its final name (atomic on a local disk)."""
    if tmp == path:
        return
    try:
        os.replace(tmp, path)
    except OSError as exc:
        raise CkptavgError(f"cannot write {display(fs, path)}: {exc.strerror or exc}") from exc


def discard_file(fs: Any, path: str) -> None:
    """Remove a file if it is there; a missing file is not an error."""
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)


@contextlib.contextmanager
def atomic_write(fs: Any, path: str) -> Iterator[Any]:
    """A binary file handle whose content appears at ``path`` complete or not at all."""
    tmp = temp_path(fs, path)
    try:
        handle = fs.open(tmp, "wb")
    except OSError as exc:
        raise CkptavgError(f"cannot create {display(fs, path)}: {exc.strerror or exc}") from exc
    try:
        with handle:
            yield handle
    except OSError as exc:
        discard_file(fs, tmp)
        raise CkptavgError(f"cannot write {display(fs, path)}: {exc.strerror or exc}") from exc
    except BaseException:
        discard_file(fs, tmp)
        raise
    publish_file(fs, tmp, path)


def files_to_copy(fs: Any, source_dir: str, weight_files: Iterable[str]) -> list[str]:
    """Top-level non-weight files of a source folder (config, tokenizer, generation config).

    A symbolic link to a file counts (fsspec lists it as "other"): one into the same folder is
    copied, and :func:`copy_file` refuses one that leaves it, rather than dropping it silently."""
    skip = set(weight_files)
    names = []
    for entry in fs.ls(source_dir, detail=True):
        if entry.get("type") != "file" and not (entry.get("islink") and fs.isfile(entry["name"])):
            continue
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if name in skip or any(fnmatch(name, pattern) for pattern in NOT_COPIED):
            continue
        names.append(name)
    return sorted(names)


def copy_file(fs: Any, source: str, dest_fs: Any, dest: str) -> str:
    """Copy one small file from ``fs`` to ``dest_fs`` (a run on one filesystem may be merged into
    an output on another); return its sha256. A local ``source`` must resolve inside its folder:
    a config file linked to, say, a private key would otherwise travel into the output."""
    digest = hashlib.sha256()
    real = local_file_inside_folder(source) if is_local(fs) else source
    try:
        with fs.open(real, "rb") as src, dest_fs.open(dest, "wb") as dst:
            while block := src.read(4 * 2**20):
                digest.update(block)
                dst.write(block)
    except OSError as exc:
        raise CkptavgError(
            f"cannot copy {display(fs, source)} to {display(dest_fs, dest)}: {exc.strerror or exc}"
        ) from exc
    return digest.hexdigest()


def sha256_file(fs: Any, path: str) -> tuple[str, int]:
    """(sha256, size) of a file, read in 16 MiB blocks as every input is read
    (:class:`~ckptavg.storage.RandomAccessFile`): a local file must be a regular file inside
    its folder, since a FIFO would never open and a link to ``/dev/zero`` never end."""
    digest = hashlib.sha256()
    with RandomAccessFile(fs, path) as file:
        view = memoryview(bytearray(min(_HASH_BLOCK, file.size)))
        for offset in range(0, file.size, _HASH_BLOCK):
            block = view[: min(_HASH_BLOCK, file.size - offset)]
            file.read_into(offset, block)
            digest.update(block)
    return digest.hexdigest(), file.size


def write_json(fs: Any, path: str, payload: dict) -> str:
    """Write a JSON file; return its sha256."""
    return write_bytes(fs, path, (json.dumps(payload, indent=2, sort_keys=False) + "\n").encode())


def write_bytes(fs: Any, path: str, data: bytes) -> str:
    """Write a small file; return its sha256."""
    try:
        with fs.open(path, "wb") as handle:
            handle.write(data)
    except OSError as exc:
        raise CkptavgError(f"cannot write {display(fs, path)}: {exc.strerror or exc}") from exc
    return hashlib.sha256(data).hexdigest()
