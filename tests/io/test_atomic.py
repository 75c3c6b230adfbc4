"""Publishing without replacing: ``rename_no_replace`` (local folders) and ``create_object``
(object stores) never replace what another process put at the name, on every path they take."""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import uuid

import pytest
from helpers import tree_of

import ckptavg.io.atomic as atomic
from ckptavg.io.fs import resolve


def _folder(path, content: bytes) -> None:
    path.mkdir()
    (path / "ckptavg-manifest.json").write_bytes(content)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")
def test_renameat2_refuses_even_an_empty_folder_at_the_target(tmp_path):
    """A plain rename replaces an empty folder; RENAME_NOREPLACE replaces nothing."""
    assert atomic.renameat2() is not None
    _folder(tmp_path / "new", b"ours")
    (tmp_path / "target").mkdir()
    with pytest.raises(FileExistsError):
        atomic.rename_no_replace(str(tmp_path / "new"), str(tmp_path / "target"))
    assert tree_of(tmp_path) == {"new": "folder", "new/ckptavg-manifest.json": b"ours", "target": "folder"}
    atomic.rename_no_replace(str(tmp_path / "new"), str(tmp_path / "free"))
    assert tree_of(tmp_path) == {"free": "folder", "free/ckptavg-manifest.json": b"ours", "target": "folder"}


def _refused(code: int):
    def renameat2(*args: object) -> int:
        ctypes.set_errno(code)
        return -1

    return lambda: renameat2


@pytest.mark.parametrize(
    "without",
    [_refused(errno.EINVAL), _refused(errno.ENOSYS), lambda: None],
    ids=["filesystem-refuses-the-flag", "kernel-without-renameat2", "no-renameat2-in-libc"],
)
def test_without_renameat2_a_rename_still_never_replaces_an_output(tmp_path, monkeypatch, without):
    """The fallback checks the name, then renames: an output made at the name in between (it
    holds its manifest) makes the rename fail, and is kept."""
    monkeypatch.setattr(atomic, "renameat2", without)
    _folder(tmp_path / "new", b"ours")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileExistsError):
        atomic.rename_no_replace(str(tmp_path / "new"), str(tmp_path / "empty"))
    real_lexists = os.path.lexists

    def published_after_the_check(path):
        found = real_lexists(path)
        if str(path) == str(tmp_path / "theirs") and not found:
            _folder(tmp_path / "theirs", b"theirs")
        return found

    monkeypatch.setattr(os.path, "lexists", published_after_the_check)
    with pytest.raises(FileExistsError):
        atomic.rename_no_replace(str(tmp_path / "new"), str(tmp_path / "theirs"))
    assert (tmp_path / "theirs" / "ckptavg-manifest.json").read_bytes() == b"theirs"
    assert (tmp_path / "new" / "ckptavg-manifest.json").read_bytes() == b"ours"
    atomic.rename_no_replace(str(tmp_path / "new"), str(tmp_path / "free"))
    assert (tmp_path / "free" / "ckptavg-manifest.json").read_bytes() == b"ours"


def test_another_error_of_renameat2_is_raised_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "renameat2", _refused(errno.EACCES))
    _folder(tmp_path / "new", b"ours")
    with pytest.raises(PermissionError):
        atomic.rename_no_replace(str(tmp_path / "new"), str(tmp_path / "target"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new"]


@pytest.mark.parametrize("store", ["memory", "s3"])
def test_create_object_refuses_an_object_that_exists(request, store):
    url = request.getfixturevalue("s3_prefix") if store == "s3" else f"memory://ckptavg-test/{uuid.uuid4().hex[:12]}"
    fs, root = resolve(url)
    path = f"{root}/out/.ckptavg-owner.json"
    atomic.create_object(fs, path, b"first")
    with pytest.raises(FileExistsError):
        atomic.create_object(fs, path, b"second")
    assert fs.cat_file(path) == b"first"


def test_on_s3_the_conditional_write_refuses_what_the_existence_check_missed(s3_prefix, monkeypatch):
    """Another merge created the object just after this one checked: S3 itself refuses the
    second create (If-None-Match: *), so of two racing claims exactly one is made."""
    fs, root = resolve(s3_prefix)
    path = f"{root}/out/.ckptavg-owner.json"
    atomic.create_object(fs, path, b"first")
    monkeypatch.setattr(type(fs), "exists", lambda self, path, **kwargs: False)
    with pytest.raises(FileExistsError):
        atomic.create_object(fs, path, b"second")
    monkeypatch.undo()
    assert fs.cat_file(path) == b"first"
