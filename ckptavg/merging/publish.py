"""The output folder of a merge, published so that nothing half-written ever looks finished.

On a local disk the folder is written beside the target under a hidden name and renamed when
complete: a crash leaves at most a hidden ``.NAME.tmp-*`` folder. Object stores have no rename
(``mv`` copies every byte), so there the files are written in place and the manifest, the last
file written, is what marks the folder complete.

Publishing never replaces an output this merge does not own. Without ``force`` it owns none:
the rename refuses to replace anything (:func:`~ckptavg.io.atomic.rename_no_replace`), so of
two merges into one output exactly one publishes and the other fails in one line. With
``force`` it owns the folder that was at the target when it started, and replaces that one
only. On an object store a merge claims the output with a conditional create of its owner
object before it writes anything, and creates the manifest the same way.

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
from typing import Any

from ..errors import CkptavgError, OutputError
from ..io.atomic import (
    create_object,
    discard_file,
    parent_and_name,
    rename_no_replace,
    sync_folder,
    write_bytes,
)
from ..io.files import read_json
from ..io.fs import FileSystem, display, is_local, join, location_key, location_within
from ..manifest import MANIFEST_FILE, encode, has_manifest
from ..manifest import write as write_manifest
from .journal import has_journal

# Inside a local hidden folder while a merge writes it: who writes it (host, pid, target), and
# locked (flock) for the life of that merge, so that a rerun can tell a dead merge from a live one.
# Inside an object-store output while a merge writes it: its claim (no lock: a unique record).
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
        record = _owner_record(target_key)
        data = json.dumps(record).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        self.record = record

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _owner_record(target_key: str) -> dict[str, Any]:
    """Who writes an output: host, pid, target and start time."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "target": target_key, "started": time.time()}


class AtomicFolder:
    """Context manager: ``tmp`` is where to write; :meth:`commit` publishes it as ``target``.

    Local disk: ``tmp`` is a hidden sibling folder, renamed to ``target`` by :meth:`commit`
    without ever replacing what is there (:func:`rename_no_replace`). An existing target is
    replaced only with ``force``, only after the new one is complete, and only if it is the
    folder that was there when the merge started (moved aside, then the new one renamed in; an
    output another process put there meanwhile is left as it is and nothing is published). With
    ``keep_identical`` (the training hook's redo after a resume), a target whose manifest equals
    the new one (every file's sha256 included) is kept untouched and the new folder dropped.
    With ``fsync``, the folders are synced before the rename and the parent after it (the files
    are synced by whoever writes them, see :func:`close_output`). The hidden folder is owned
    (:class:`_Owner`) while the merge runs; hidden folders of earlier merges into the same target
    are removed when their merge is provably dead, and otherwise named through ``notice``. With
    ``resume`` the newest one is adopted instead, unless a live merge owns it or it holds
    anything but files and folders (a link would be written through, a FIFO would block).

    Any other filesystem (object stores, ``memory://``): ``tmp`` is ``target`` itself and
    :meth:`commit` writes the commit marker, :data:`MANIFEST_FILE`, last. A target with a
    manifest is replaced only with ``force``: its manifest goes first (so it stops looking
    complete), then its other files, then the new files are written. A target without a manifest
    needs ``force`` too: it may be a crashed merge, but it may as well be any folder ``--out``
    points at, and its files are not ours to delete unasked. Before writing anything the merge
    claims the target with :data:`OWNER_FILE`, created only if absent (:func:`create_object`), so
    that of two merges starting together one fails at once; the manifest is created the same way,
    after checking that the claim is still this merge's. An error before :meth:`commit` removes
    what was written (best effort; the manifest first) while the claim is still this merge's, so
    nothing half-written looks complete and nothing of another merge is removed.
    """

    def __init__(
        self,
        fs: FileSystem,
        target: str,
        force: bool = False,
        resume: bool = False,
        fsync: bool = True,
        notice: Callable[[str], None] | None = None,
        keep_identical: bool = False,
    ) -> None:
        self.fs = fs
        self.target = target.rstrip("/")
        self.force = force
        self.resume = resume
        self.fsync = fsync
        self.notice = notice
        self.keep_identical = keep_identical
        self.resumed = False
        self.in_place = not is_local(fs)
        parent, name = parent_and_name(fs, self.target)
        self._parent, self._name = parent, name
        self.tmp = self.target if self.in_place else join(fs, parent, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
        self._owner: _Owner | None = None
        self._replaces: tuple[int, int] | None = None  # (device, inode) of the output `force` replaces
        self._claim: bytes | None = None  # this merge's claim on an object-store output, while it holds it
        self.committed = False
        self.kept = False  # set by commit() when keep_identical kept the published output as it was

    def _check_target(self) -> None:
        """Refuse an existing local target without ``force``; with it, remember which folder is
        there: the one output this merge may replace."""
        try:
            found = os.lstat(self.target)
        except FileNotFoundError:
            return
        if not self.force:
            raise OutputError(f"output {display(self.fs, self.target)} already exists; pass --force to replace it")
        self._replaces = (found.st_dev, found.st_ino)

    def __enter__(self) -> AtomicFolder:
        if self.in_place:
            if self.resume and self._unfinished_in_place():
                self.resumed = True
            else:
                self._clear_in_place()
            self._claim_in_place()
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

    def _claim_in_place(self) -> None:
        """Claim the object-store target before writing into it: :data:`OWNER_FILE`, created only
        if absent (taken over when resuming: the interrupted merge left it). A merge that ran to
        its end between the check of the target and the claim left files beside it: refused."""
        path, shown = join(self.fs, self.target, OWNER_FILE), display(self.fs, self.target)
        record = json.dumps({**_owner_record(location_key(self.fs, self.target)), "id": uuid.uuid4().hex}).encode()
        try:
            if self.resumed:
                write_bytes(self.fs, path, record, self.fsync)
            else:
                create_object(self.fs, path, record)
                if len(self._existing_files()) != 1:  # not the claim alone
                    discard_file(self.fs, path)
                    raise FileExistsError(path)
        except FileExistsError:
            raise OutputError(
                f"output {shown} is being written, or was just written, by another merge; this merge wrote nothing"
            ) from None
        except OSError as exc:
            raise OutputError(f"cannot create output {shown}: {exc.strerror or exc}") from exc
        self._claim = record

    def _holds_claim(self) -> bool:
        """Whether the target's claim is still this merge's (a ``--force`` or ``--resume``
        elsewhere takes it over without asking: object stores have no locks)."""
        try:
            return self._claim is not None and self.fs.cat_file(join(self.fs, self.target, OWNER_FILE)) == self._claim
        except OSError:
            return False

    def commit(self, manifest: dict[str, Any]) -> None:
        """Write ``manifest``, the last file, and publish the folder as the target."""
        if self.in_place:
            self._commit_in_place(manifest)
        elif self.keep_identical and self._published_as(manifest):
            self.kept = self.committed = True  # __exit__ leaves the target alone
            self._release()
            with contextlib.suppress(OSError):
                self.fs.rm(self.tmp, recursive=True)
        else:
            write_manifest(self.fs, self.tmp, manifest, self.fsync)
            self._rename_into_place()

    def _published_as(self, manifest: dict[str, Any]) -> bool:
        """Whether the target is a published output with exactly ``manifest``."""
        try:
            published = read_json(self.fs, join(self.fs, self.target, MANIFEST_FILE), "a manifest")
        except (CkptavgError, OSError):
            return False
        return bool(published == json.loads(encode(manifest)))

    def _commit_in_place(self, manifest: dict[str, Any]) -> None:
        shown = display(self.fs, self.target)
        if not self._holds_claim():
            self._claim = None  # another merge's now: __exit__ must remove nothing
            raise OutputError(
                f"output {shown} was taken over by another merge while this one ran (--force or --resume "
                "elsewhere); this merge published nothing"
            )
        try:
            create_object(self.fs, join(self.fs, self.target, MANIFEST_FILE), encode(manifest))
        except FileExistsError:
            self._claim = None
            raise OutputError(
                f"output {shown} was published by another merge while this one ran; this merge published nothing"
            ) from None
        except OSError as exc:
            raise OutputError(f"cannot write the manifest of {shown}: {exc.strerror or exc}") from exc
        self.committed = True
        # The manifest made the output complete; the claim goes after it, so that no moment
        # leaves the output unclaimed and unfinished. A claim a crash leaves here is ignored.
        with contextlib.suppress(OSError):
            discard_file(self.fs, join(self.fs, self.target, OWNER_FILE))

    def _rename_into_place(self) -> None:
        shown = display(self.fs, self.target)
        try:
            discard_file(self.fs, join(self.fs, self.tmp, OWNER_FILE))  # never published; the lock stays held
            for folder, _, _ in os.walk(self.tmp, topdown=False):
                sync_folder(self.fs, folder, self.fsync)
            old = self._move_replaced_aside()
        except OSError as exc:
            raise OutputError(f"cannot publish output {shown}: {exc.strerror or exc}") from exc
        try:
            rename_no_replace(self.tmp, self.target)
        except FileExistsError as exc:
            # Another process published the target while this merge ran, or after the output it
            # replaces was moved aside: theirs stays; the caller's __exit__ removes the new files.
            kept = "" if old is None else f", and the output it was replacing is kept in {display(self.fs, old)}"
            raise OutputError(
                f"cannot publish output {shown}: another process published it while this merge ran; it is left "
                f"as it is and this merge published nothing{kept}"
            ) from exc
        except OSError as exc:
            if old is not None:  # put back what was there
                with contextlib.suppress(OSError):
                    rename_no_replace(old, self.target)
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

    def _move_replaced_aside(self) -> str | None:
        """With ``force``, move the output this merge replaces to ``.NAME.old-*``: the folder that
        was at the target when the merge started, and no other. Returns where it went; None when
        there was none, or it is gone. An output another process put at the target meanwhile is
        put back, and nothing is published."""
        if self._replaces is None:
            return None
        aside = join(self.fs, self._parent, f".{self._name}.old-{uuid.uuid4().hex[:8]}")
        try:
            rename_no_replace(self.target, aside)
        except FileNotFoundError:
            return None  # removed meanwhile: nothing left to replace
        moved = os.lstat(aside)
        if (moved.st_dev, moved.st_ino) == self._replaces:
            return aside
        shown, where = display(self.fs, self.target), "it is left as it is"
        try:
            rename_no_replace(aside, self.target)
        except OSError:
            where = f"it is in {display(self.fs, aside)}"
        raise OutputError(
            f"cannot publish output {shown}: another process replaced it while this merge ran, so it is not the "
            f"output --force was to replace; {where} and this merge published nothing"
        )

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
                if not self.in_place:
                    self.fs.rm(self.tmp, recursive=True)
                elif self._holds_claim():
                    self._remove_in_place()
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
