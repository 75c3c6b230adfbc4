"""The output folder of a merge, published so that nothing half-written ever looks finished.

On a local disk the folder is written beside the target under a hidden name and renamed when
complete: a crash leaves at most a hidden ``.NAME.tmp-*`` folder. Object stores have no rename
(``mv`` copies every byte), so there the files are written in place and the manifest, the last
file written, is what marks the folder complete.

Durability (local disks, unless ``fsync=False``): the files are synced by whoever writes them
(:mod:`ckptavg.io.atomic`), each folder before it is renamed into place, and the parent after
the rename: a power loss after the rename cannot publish a complete-looking output whose bytes
never reached the disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence

from ..errors import OutputError
from ..io.atomic import discard_file, parent_and_name, sync_folder
from ..io.fs import FileSystem, display, is_local, join, location_key, location_within
from ..manifest import MANIFEST_FILE, has_manifest
from .journal import has_journal

# Inside a local hidden folder while a merge writes it: who writes it (host, pid, target), and
# locked (flock) for the life of that merge, so that a rerun can tell a dead merge from a live one.
OWNER_FILE = ".ckptavg-owner.json"


def check_output_location(
    fs: FileSystem,
    path: str,
    sources: Iterable[tuple[FileSystem, str]],
    run_folder: tuple[FileSystem, str] | None = None,
) -> None:
    """Refuse, before anything is created or renamed and ``force`` or not, an output that would
    destroy what the merge reads: one that is, or lies above, a source checkpoint, the run folder
    or (on a local disk) the working folder would replace it; one inside a source would change
    it. Places are compared by :func:`location_key`, so no spelling gets past. An output inside
    the run folder (the default ``RUN/stepS-merged``) is fine."""
    out = location_key(fs, path)
    protected = [] if run_folder is None else [(*run_folder, "the run folder", False)]
    protected += [(source_fs, source, "the source checkpoint", True) for source_fs, source in sources]
    if is_local(fs):
        with contextlib.suppress(FileNotFoundError):  # a working folder removed meanwhile protects nothing
            protected.append((fs, os.getcwd(), "the current directory", False))
    for place_fs, place, what, inside_counts in protected:
        key = location_key(place_fs, place)
        if out == key:
            relation, harm = "is", "replacing it would destroy it"
        elif location_within(out, key):
            relation, harm = "contains", "replacing it would destroy it"
        elif inside_counts and location_within(key, out):
            relation, harm = "lies inside", "writing into it would change it"
        else:
            continue
        raise OutputError(
            f"output {display(fs, path)} {relation} {what} {display(place_fs, place)}: {harm} "
            "(--force does not change that); choose another --out"
        )


def _kind_of_entry(mode: int) -> str | None:
    """What a non-regular, non-folder entry is (None for a file or a folder)."""
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    if stat.S_ISLNK(mode):
        return "symbolic link"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device or other special file"


class _Owner:
    """This merge's claim on a local hidden folder: :data:`OWNER_FILE`, held under an exclusive
    ``flock`` for the life of the merge. The kernel drops the lock when the process dies, however
    it dies, so a lock that can be taken proves the owner dead; on another host a free lock proves
    nothing (a shared filesystem may not share locks), and without locks nothing is proved."""

    def __init__(self, folder: str, create: bool) -> None:
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        self.fd = os.open(os.path.join(folder, OWNER_FILE), flags, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(self.fd).st_mode):  # O_NONBLOCK: a FIFO opens, and ends here
                raise OSError(f"{OWNER_FILE} is not a file")
            self.record = json.loads(os.pread(self.fd, 1 << 16, 0) or b"null")
            self.locked = self._lock()
        except BaseException:
            os.close(self.fd)
            raise

    def _lock(self) -> bool | None:
        """True: locked by us; False: a live process holds it; None: the filesystem has no locks."""
        import fcntl  # POSIX only, like the rest of the local publishing

        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError:
            return None
        return True

    @classmethod
    def probe(cls, folder: str) -> _Owner | None:
        """The owner file of ``folder``, opened and lock tried; None without a readable one."""
        try:
            return cls(folder, create=False)
        except (OSError, ValueError):
            return None

    def describe(self) -> str:
        record = self.record if isinstance(self.record, dict) else {}
        return f"pid {record.get('pid', '?')} on {record.get('host', '?')}"

    def dead_run_of(self, target_key: str) -> bool:
        """Provably a dead merge into the same target: same host, lock taken."""
        record = self.record if isinstance(self.record, dict) else {}
        return self.locked is True and record.get("host") == socket.gethostname() and record.get("target") == target_key

    def claim(self, target_key: str) -> None:
        record = {"host": socket.gethostname(), "pid": os.getpid(), "target": target_key, "started": time.time()}
        data = json.dumps(record).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        self.record = record

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class AtomicFolder:
    """Context manager: ``tmp`` is where to write; :meth:`commit` publishes it as ``target``.

    Local disk: ``tmp`` is a hidden sibling folder, renamed to ``target`` by :meth:`commit`; an
    existing target is replaced only with ``force``, and only after the new one is complete.
    With ``fsync``, the folders are synced before the rename and the parent after it (the files
    are synced by whoever writes them, see :func:`close_output`). The hidden folder is owned
    (:class:`_Owner`) while the merge runs; hidden folders of earlier merges into the same target
    are removed when their merge is provably dead, and otherwise named through ``notice``. With
    ``resume`` the newest one is adopted instead, unless a live merge owns it or it holds
    anything but files and folders (a link would be written through, a FIFO would block).

    Any other filesystem (object stores, ``memory://``): ``tmp`` is ``target`` itself and the
    caller's last file, :data:`MANIFEST_FILE`, is the commit marker. A target with a manifest is
    replaced only with ``force``: its manifest goes first (so it stops looking complete), then
    its other files, then the new files are written. A target without a manifest needs
    ``force`` too: it may be a crashed merge, but it may as well be any folder ``--out`` points
    at, and its files are not ours to delete unasked. An error before :meth:`commit` removes
    what was written (best effort; the manifest first), so nothing half-written looks complete.
    """

    def __init__(
        self,
        fs: FileSystem,
        target: str,
        force: bool = False,
        resume: bool = False,
        fsync: bool = True,
        notice: Callable[[str], None] | None = None,
    ) -> None:
        self.fs = fs
        self.target = target.rstrip("/")
        self.force = force
        self.resume = resume
        self.fsync = fsync
        self.notice = notice
        self.resumed = False
        self.in_place = not is_local(fs)
        parent, name = parent_and_name(fs, self.target)
        self._parent, self._name = parent, name
        self.tmp = self.target if self.in_place else join(fs, parent, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
        self._owner: _Owner | None = None
        self.committed = False

    def _check_target(self) -> None:
        if self.fs.exists(self.target) and not self.force:
            raise OutputError(f"output {display(self.fs, self.target)} already exists; pass --force to replace it")

    def __enter__(self) -> AtomicFolder:
        if self.in_place:
            if self.resume and self._unfinished_in_place():
                self.resumed = True
                return self
            self._clear_in_place()
            return self
        self._check_target()
        try:
            hidden = self._hidden_siblings()
            if self.resume and hidden:
                self._adopt(hidden[-1])
            self._sweep([h for h in hidden if h != self.tmp])
            self._name_replaced_outputs()
            if not self.resumed:
                self._create()
        except BaseException:
            self._release()  # no __exit__ follows a failed __enter__
            raise
        return self

    def _create(self) -> None:
        made = False
        try:
            self.fs.makedirs(self._parent, exist_ok=True)
            self.fs.makedirs(self.tmp, exist_ok=False)
            made = True
            self._owner = _Owner(self.tmp, create=True)
            self._owner.claim(location_key(self.fs, self.target))
        except OSError as exc:
            if made:
                with contextlib.suppress(OSError):
                    self.fs.rm(self.tmp, recursive=True)
            # Named by the target: the hidden folder is ours, the output folder is what was asked for.
            raise OutputError(f"cannot create output {display(self.fs, self.target)}: {exc.strerror or exc}") from exc

    def _hidden_siblings(self) -> list[str]:
        """The hidden folders interrupted merges into this target left, oldest first."""
        pattern = re.compile(rf"^\.{re.escape(self._name)}\.tmp-[0-9a-f]{{8}}$")
        try:
            entries = self.fs.ls(self._parent, detail=True)
        except FileNotFoundError:
            return []
        found = [
            (entry.get("mtime", 0), entry["name"].rstrip("/"))
            for entry in entries
            if entry.get("type") == "directory" and pattern.match(entry["name"].rstrip("/").rsplit("/", 1)[-1])
        ]
        return [name for _, name in sorted(found)]

    def _adopt(self, folder: str) -> None:
        """Take over the folder an interrupted merge into this target left. Whatever it holds is
        safe to adopt once it is only files and folders: a file is reused only where a journal
        of this same merge vouches for its sha256, and everything else is removed before
        publishing."""
        shown = display(self.fs, folder)
        _refuse_special_entries(folder, shown)
        owner = _Owner.probe(folder)
        if owner is not None and owner.locked is False:
            owner.release()
            raise OutputError(
                f"cannot resume from {shown}: a merge into {display(self.fs, self.target)} that is still running "
                f"({owner.describe()}) is writing it"
            )
        try:
            self._owner = owner or _Owner(folder, create=True)
            self._owner.claim(location_key(self.fs, self.target))
        except OSError as exc:
            raise OutputError(f"cannot resume from {shown}: {exc.strerror or exc}") from exc
        self.tmp, self.resumed = folder, True

    def _sweep(self, folders: Sequence[str]) -> None:
        """Remove the hidden folders of provably dead merges into this target; name the others."""
        target_key = location_key(self.fs, self.target)
        shown_target = display(self.fs, self.target)
        for folder in folders:
            owner = _Owner.probe(folder)
            try:
                if owner is not None and owner.dead_run_of(target_key) and self._removed(folder):
                    continue
                shown = display(self.fs, folder)
                if self.notice is None:
                    pass
                elif owner is not None and owner.locked is False:
                    self.notice(
                        f"{shown} belongs to a merge into {shown_target} that is still running "
                        f"({owner.describe()}); left alone"
                    )
                else:
                    by = f" ({owner.describe()})" if owner is not None else ""
                    self.notice(
                        f"{shown} is left by an unfinished merge into {shown_target}{by}: --resume picks it up, "
                        f"rm -r {shown} removes it"
                    )
            finally:
                if owner is not None:
                    owner.release()

    def _name_replaced_outputs(self) -> None:
        """A ``--force`` replace killed between its two renames leaves the output it replaced in
        ``.NAME.old-*``: never removed unasked (it may be the only complete output left), named."""
        if self.notice is None:
            return
        pattern = re.compile(rf"^\.{re.escape(self._name)}\.old-[0-9a-f]{{8}}$")
        with contextlib.suppress(FileNotFoundError):
            for entry in self.fs.ls(self._parent, detail=False):
                name = str(entry).rstrip("/").rsplit("/", 1)[-1]
                if pattern.match(name):
                    shown = display(self.fs, join(self.fs, self._parent, name))
                    self.notice(
                        f"{shown} holds an earlier output of {display(self.fs, self.target)} that an interrupted "
                        f"--force replace moved aside: rm -r {shown} removes it"
                    )

    def _removed(self, folder: str) -> bool:
        try:
            self.fs.rm(folder, recursive=True)
        except OSError:
            return False
        return True

    def _unfinished_in_place(self) -> bool:
        return not has_manifest(self.fs, self.target) and has_journal(self.fs, self.target)

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
            if has_manifest(self.fs, self.target):
                raise OutputError(f"output {shown} already exists; pass --force to replace it")
            raise OutputError(
                f"output {shown} already exists but has no {MANIFEST_FILE} (an unfinished merge?); "
                "pass --force to replace it"
            )
        try:
            self._remove_in_place()
        except OSError as exc:
            raise OutputError(f"cannot remove the old {shown}: {exc.strerror or exc}") from exc

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
            discard_file(self.fs, join(self.fs, self.tmp, OWNER_FILE))  # never published; the lock stays held
            for folder, _, _ in os.walk(self.tmp, topdown=False):
                sync_folder(self.fs, folder, self.fsync)
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
            raise OutputError(f"cannot publish output {shown}: {exc.strerror or exc}") from exc
        self.committed = True
        self._release()
        try:
            sync_folder(self.fs, self._parent, self.fsync)
        except OSError as exc:
            raise OutputError(
                f"output {shown} is published, but syncing {display(self.fs, self._parent)} failed, so a crash "
                f"could still undo it: {exc.strerror or exc}"
            ) from exc
        if old is not None:
            try:
                self.fs.rm(old, recursive=True)
            except OSError as exc:
                raise OutputError(
                    f"output {shown} is published, but the output it replaced is left in {display(self.fs, old)}: "
                    f"{exc.strerror or exc}"
                ) from exc

    def _release(self) -> None:
        if self._owner is not None:
            self._owner.release()
            self._owner = None

    def __exit__(self, *exc: object) -> None:
        if self.committed:
            return
        # Best effort: a failed clean-up must never hide the error that brought us here.
        try:
            with contextlib.suppress(Exception):
                if self.in_place:
                    self._remove_in_place()
                else:
                    self.fs.rm(self.tmp, recursive=True)
        finally:
            self._release()


def _refuse_special_entries(folder: str, shown: str) -> None:
    """Refuse a local folder that is, or holds at any depth, anything but files and folders;
    nothing is followed while looking (the folder itself is checked before it is listed)."""

    def entries() -> Iterator[str]:
        yield folder
        for parent, folders, files in os.walk(folder):
            yield from (os.path.join(parent, name) for name in folders + files)

    for entry in entries():
        kind = _kind_of_entry(os.lstat(entry).st_mode)
        if kind is not None:
            raise OutputError(
                f"cannot resume from {shown}: {entry} is a {kind}, not a file or a folder, so nothing in it is "
                f"trusted; remove it (rm -r {shown}) and merge again"
            )
