"""Paths on any filesystem: fsspec without cached listings, and how a path is shown.

Everything above :mod:`ckptavg.io` speaks in ``(fs, path)`` pairs, so a local folder, ``file://``,
``memory://`` or an object store all go through the same code.
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import TypeAlias

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..errors import ConfigError

# Every ``fs`` in ckptavg: what ``fsspec.core.url_to_fs`` returns for a path or URL.
FileSystem: TypeAlias = fsspec.AbstractFileSystem


def resolve(url: str) -> tuple[FileSystem, str]:
    """Split a path or URL into an fsspec filesystem and the path inside it.

    Directory listings are never cached: fsspec's object-store filesystems (s3fs, gcsfs) keep
    every listing for the life of the process, so a long-running caller (the training hook
    waiting for other processes' files, a second ``ls`` after another writer) would never see
    new files, and ``exists``/``isfile`` answer from that stale listing too."""
    userinfo = _USERINFO.match(str(url))
    if userinfo and userinfo.group(1).lower() in _STORES_WITHOUT_USERINFO:
        raise ConfigError(
            f"{redact(str(url))}: {userinfo.group(1)} URLs take no user or password (removed from this "
            "message); the store's credentials come from its own configuration (for S3: AWS_ACCESS_KEY_ID "
            "and AWS_SECRET_ACCESS_KEY, or ~/.aws)"
        )
    try:
        try:
            fs, path = fsspec.core.url_to_fs(str(url), use_listings_cache=False)
        except TypeError:  # a filesystem that takes no caching options
            fs, path = fsspec.core.url_to_fs(str(url))
    except (ImportError, ValueError) as exc:
        raise ConfigError(redact(f"cannot open {url}: {exc}")) from exc
    return fs, path.rstrip("/") or "/"


def join(fs: FileSystem, *parts: str) -> str:
    sep = getattr(fs, "sep", "/")
    return sep.join(p.rstrip(sep) for p in parts if p)


def is_local(fs: FileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def location_key(fs: FileSystem, path: str) -> str:
    """Where ``path`` really is, as a string every spelling of the same place shares, for
    comparing places: on a local disk the real path (relative to the working folder, links
    resolved, ``.`` and ``..`` collapsed, so ``""``, ``.``, ``run/./step2`` and
    ``run/step1/../step2`` all find their folder); elsewhere the URL with ``//``, ``./``,
    ``..`` and a trailing ``/`` collapsed (an HTTP client may collapse them on the wire too)."""
    if is_local(fs):
        return os.path.realpath(os.path.abspath(path or "."))
    return fs.unstrip_protocol(posixpath.normpath(re.sub("/+", "/", fs._strip_protocol(path))))


def location_within(outer: str, inner: str) -> bool:
    """Whether the place keyed ``inner`` is the place keyed ``outer`` or lies inside it (keys
    from :func:`location_key`)."""
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


# ``scheme://user:password@host``: the userinfo of a URL, up to the last ``@`` before the path.
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")


# Object stores whose URLs name a bucket, never a user: credentials there are a mistake to refuse
# (s3fs would send "user:secret@bucket" as the bucket's name, and echo it in its error).
_STORES_WITHOUT_USERINFO = ("s3://", "s3a://", "gs://", "gcs://", "az://", "abfs://", "abfss://")

# Exceptions of the object-store clients (and fsspec) that mean "the store cannot be used as
# asked": no connection, no name, no credentials, a refusal. Matched by module, so that
# checking one never imports a client.
_STORE_ERROR_MODULES = (
    "botocore.",
    "aiobotocore.",
    "s3fs.",
    "gcsfs.",
    "google.auth.",
    "google.api_core.",
    "aiohttp.",
    "fsspec.",
)


def storage_error(exc: BaseException) -> str | None:
    """One line, credentials removed, for an error of the storage under a path (an unreachable
    endpoint, an unknown host, a bucket that does not exist, access denied, no credentials): its
    message's first line, with the query strings of the URLs it names cut; None for an exception
    that is not one."""
    module = type(exc).__module__ + "."
    if not isinstance(exc, OSError) and not module.startswith(_STORE_ERROR_MODULES):
        return None
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"\?[^\s\"']*", "", redact(text))  # the request's query: long and of no use
    kind = type(exc).__name__
    return text if kind in text else f"{kind}: {text}"


def redact(text: str) -> str:
    """``text`` with the ``user:password@`` of every URL in it removed: messages, logs and the
    manifest name paths, and a password must never reach them."""
    return _USERINFO.sub(r"\1", text)


def display(fs: FileSystem, path: str) -> str:
    """A path as the user should see it in messages and the manifest: with its protocol when not
    local, and without credentials."""
    if is_local(fs):
        return path
    return redact(fs.unstrip_protocol(path))


def folder_size(fs: FileSystem, path: str) -> int:
    """Bytes of the files below ``path``; what a link names counts, a dangling link nothing.
    (``fs.du`` asks for each file's size again, and a dangling link has none to give.)"""
    return sum(entry.get("size") or 0 for entry in fs.find(path, detail=True).values())


def folder_names(fs: FileSystem, path: str) -> list[str]:
    """Names of the entries of a folder; none when it does not exist."""
    try:
        return [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []
