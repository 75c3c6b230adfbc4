"""The journal of an unfinished merge: which output files are finished, with their sha256.

Each process rewrites its own ``.ckptavg-journal-RRRRR.json`` (atomically) inside the output's
temporary folder after every file it finishes. A merge killed at any point leaves the folder
hidden (or, on object stores, without a manifest) and the journals with it; ``--resume`` reuses
the files whose bytes still hash to what the journal recorded, for the same merge only (the
fingerprint covers sources, layout, dtypes, format and keys), and redoes the rest. Journals are
removed before the manifest is written, so a resumed output has exactly the files of an
uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from ..errors import CkptavgError
from ..io.atomic import atomic_write, discard_file
from ..io.files import read_json
from ..io.fs import FileSystem, folder_names, join

_JOURNAL = re.compile(r"^\.ckptavg-journal-(\d{5})\.json$")


def journal_name(rank: int) -> str:
    return f".ckptavg-journal-{rank:05d}.json"


def fingerprint(description: Any) -> str:
    """A stable digest of what a merge is (JSON with sorted keys)."""
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()


def has_journal(fs: FileSystem, folder: str) -> bool:
    return any(_JOURNAL.match(name) for name in folder_names(fs, folder))


def finished_files(fs: FileSystem, folder: str, merge_fingerprint: str) -> dict[str, dict[str, Any]]:
    """{file name: {"sha256", "record"}} over every process's journal of this same merge;
    journals of another merge, or unreadable ones (a kill mid-rename cannot make one, but a
    damaged disk can), and entries that are not JSON objects count for nothing."""
    done: dict[str, dict[str, Any]] = {}
    for name in folder_names(fs, folder):
        if not _JOURNAL.match(name):
            continue
        try:
            journal = read_json(fs, join(fs, folder, name), "a journal")
        except CkptavgError:
            continue
        if (
            isinstance(journal, dict)
            and journal.get("fingerprint") == merge_fingerprint
            and isinstance(journal.get("files"), dict)
        ):
            done.update((file, entry) for file, entry in journal["files"].items() if isinstance(entry, dict))
    return done


def remove_journals(fs: FileSystem, folder: str) -> None:
    for name in folder_names(fs, folder):
        if _JOURNAL.match(name):
            discard_file(fs, join(fs, folder, name))


class Journal:
    """This process's journal; :meth:`record` is called once per finished file."""

    def __init__(
        self, fs: FileSystem, folder: str, rank: int, merge_fingerprint: str, reused: dict[str, Any], fsync: bool = True
    ) -> None:
        self.fs, self.path = fs, join(fs, folder, journal_name(rank))
        self.fsync = fsync  # durable before it replaces the last one: --resume trusts what it says
        self.content: dict[str, Any] = {"fingerprint": merge_fingerprint, "files": dict(reused)}
        self._write()  # at once: a run killed before its first file is still found by --resume

    def _write(self) -> None:
        with atomic_write(self.fs, self.path, self.fsync) as handle:
            handle.write(json.dumps(self.content).encode())

    def record(self, name: str, sha256: str, record: Any) -> None:
        self.content["files"][name] = {"sha256": sha256, "record": record}
        self._write()
