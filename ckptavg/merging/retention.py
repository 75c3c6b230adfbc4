"""Removing the training hook's snapshots once a published merge has consumed them.

A snapshot (``stepN-snapshot/``, rank files the hook wrote) exists only to be merged; a trainer
checkpoint is what a run resumes from. So only snapshots are ever removed, and only after the
merge that read them is published, synced and verified: a merged output that fails its check
against its manifest removes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import CkptavgError, OutputError
from ..formats import detect_format
from ..formats.parts import PartsReader, remove_rank_files
from ..io.fs import FileSystem, display, resolve
from .discovery import parse_step_dir
from .verify import verify


@dataclass(frozen=True)
class SnapshotRemoval:
    """What a merge with ``remove_consumed_snapshots`` did with its inputs."""

    removed: list[str] = field(default_factory=list)
    """The snapshot folders removed."""
    kept: list[str] = field(default_factory=list)
    """Every other input: trainer checkpoints, and snapshots that could not be removed."""


def is_snapshot(fs: FileSystem, path: str) -> bool:
    """Is ``path`` a snapshot of the training hook: a folder named as discovery names one
    (``stepN-snapshot``) that holds the hook's rank files? A name alone is not enough."""
    parsed = parse_step_dir(path.rstrip("/").rsplit("/", 1)[-1])
    if parsed is None or parsed[1] != "-snapshot":
        return False
    with contextlib.suppress(OSError):
        if fs.info(path).get("islink"):
            return False  # a linked folder is the user's arrangement: its target is not ours to remove
    return detect_format(fs, path, single_file=False) is PartsReader


def remove_snapshot(fs: FileSystem, path: str) -> None:
    """Remove a snapshot folder; raises OSError. Its rank files go first, markers before data
    (as process 0 of a world that no longer exists: every process's files), so that a removal
    cut short never leaves a folder that looks like a complete snapshot."""
    remove_rank_files(fs, path, 0, 0)
    fs.rm(path, recursive=True)


def verify_before_removal(output: str) -> None:
    """Check the published output against its manifest (every file's sha256, the tensors)
    before anything it was made from goes."""
    try:
        verify(output)
    except CkptavgError as exc:
        raise OutputError(f"{exc}; the merged output failed verification, so no snapshot was removed") from None


def remove_consumed_snapshots(
    output: str, sources: Sequence[str], notice: Callable[[str], None] | None = None
) -> SnapshotRemoval:
    """After ``output`` is published: verify it, then remove those of ``sources`` that are
    snapshots (:func:`is_snapshot`); every other source is kept. A snapshot that cannot be
    removed is kept, with a ``notice``: the merge itself succeeded."""
    verify_before_removal(output)
    removed: list[str] = []
    kept: list[str] = []
    for source in sources:
        fs, path = resolve(source)
        if not is_snapshot(fs, path):
            kept.append(source)
            continue
        try:
            remove_snapshot(fs, path)
        except OSError as exc:
            if notice is not None:
                notice(f"could not remove the snapshot {display(fs, path)}: {exc.strerror or exc}")
            kept.append(source)
            continue
        removed.append(source)
    return SnapshotRemoval(removed, kept)
