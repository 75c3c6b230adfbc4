"""``ckptavg-manifest.json``: what a merged output is, and the mark that it is complete.

One module for its name, what goes into it (:func:`build`), writing it (:func:`write`, always
the last file of an output: its presence is what makes the output complete) and reading it back
(:func:`read`, with every field checked where it is read, so that a manifest edited by hand is
one line naming the manifest and the field, not a traceback far from it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .errors import OutputError
from .io.atomic import write_bytes
from .io.files import read_json
from .io.fs import FileSystem, join
from .version import __version__
from .weighting import Weighting

MANIFEST_FILE = "ckptavg-manifest.json"


def has_manifest(fs: FileSystem, folder: str) -> bool:
    """Whether ``folder`` holds a manifest: a merged output that finished (whatever its format)."""
    return bool(fs.isfile(join(fs, folder, MANIFEST_FILE)))


def build(
    *,
    output_format: str,
    sources: list[dict[str, Any]],
    tensor_count: int,
    total_size: int,
    input_dtypes: Iterable[str],
    output_dtype: str,
    accumulate: str | None,
    weighting: Weighting | None,
    weights: Sequence[float] | None,
    keys: Mapping[str, Any] | None,
    hashes: Mapping[str, str],
    copied: Mapping[str, Any] | None = None,
    copy_rules: Mapping[str, Any] | None = None,
    method: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest: what was merged and how, and the sha256 of every file (nothing that
    differs between runs of the same merge, such as times or process counts).

    ``weights`` are the unnormalised weights of the sources that ``weighting`` gave (None for
    the exact uniform mean, and where the sources are running sums that carry their weights);
    ``keys`` the key filter, described, with what it left out; ``copied`` the objects taken
    over byte for byte from the newest source (its path, and each object's name and why);
    ``copy_rules`` the ``--copy`` patterns, the source they take from and the tensors they took.
    Negative weights are marked (``weighting.negative_weights``).
    ``method`` what the source is where it is no weighted sum of steps (the training hook's EMA),
    recorded instead of a scheme."""
    scheme = weighting if weighting is not None and not weighting.uniform else None
    signed = weights is not None and min(weights) < 0
    manifest: dict[str, Any] = {
        "tool": "ckptavg",
        "version": __version__,
        "method": method["scheme"] if method is not None else scheme.scheme if scheme else "uniform",
        "format": output_format,
        "sources": sources,
        "tensor_count": tensor_count,
        "total_size": total_size,
        "dtype_policy": {
            "input_dtypes": sorted(set(input_dtypes)),
            "output": output_dtype,
            "accumulate": accumulate
            or (
                "float64, each element checked and settled exactly where in doubt: the exact weighted sum "
                "correctly rounded (fp64 outputs: float64 sums, compensated with each product exact for "
                "negative weights); "
                if weights is not None
                else "float32 for 16-bit floats, float64 for float8 and 32/64-bit floats; "
            )
            + "integer and bool tensors copied from the newest source, and so are float8_e8m0fnu tensors "
            "and the scales of float8 tensors",
            "rounding": "round to nearest even of the mean",
        },
        "files": {name: {"sha256": digest} for name, digest in sorted(hashes.items())},
    }
    if method is not None:
        manifest["weighting"] = dict(method)
    elif scheme is not None:
        manifest["weighting"] = scheme.describe()
    if scheme is not None and weights is not None:
        # The numbers before normalising: `verify --against` feeds them back to reproduce the
        # normalisation's rounding exactly (normalising the normalised weights need not).
        manifest["weighting"]["unnormalised"] = list(weights)
        if signed:
            manifest["weighting"]["negative_weights"] = True
    if keys is not None:
        manifest["keys"] = dict(keys)
    if copied is not None:
        manifest["copied"] = {"why": "pickled objects, not tensors: never averaged, copied as stored", **copied}
    if copy_rules is not None:
        manifest["copy"] = {"why": "--copy: taken from one source, never averaged", **copy_rules}
    return manifest


def encode(manifest: dict[str, Any]) -> bytes:
    """The bytes of the manifest file."""
    return (json.dumps(manifest, indent=2) + "\n").encode()


def write(fs: FileSystem, folder: str, manifest: dict[str, Any], fsync: bool = True) -> str:
    """Write the manifest into ``folder`` (the last file of an output); return its sha256."""
    return write_bytes(fs, join(fs, folder, MANIFEST_FILE), encode(manifest), fsync)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_weight(value: Any) -> bool:
    return _is_number(value) and value >= 0


# What a field of the manifest may hold, checked where it is read.
_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "count": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a whole number >= 0"),
    "text": (lambda v: isinstance(v, str), "a string"),
    "texts": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "table": (lambda v: isinstance(v, dict), "an object"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "weight": (_is_weight, "a finite number >= 0"),
    "weights": (lambda v: isinstance(v, list) and all(_is_weight(x) for x in v), "a list of finite numbers >= 0"),
    "numbers": (lambda v: isinstance(v, list) and all(_is_number(x) for x in v), "a list of finite numbers"),
    "file": (lambda v: isinstance(v, dict) and isinstance(v.get("sha256"), str), "an object with a 'sha256' string"),
}


def invalid(where: str, name: str, expected: str, value: Any) -> OutputError:
    """The error for field ``name`` of the manifest at ``where``, which is not ``expected``."""
    shown = json.dumps(value)
    shown = shown if len(shown) <= 60 else f"{shown[:57]}..."
    return OutputError(f"{where}: field {name!r} must be {expected}, got {shown}")


def field(
    where: str, table: dict[str, Any], key: str, kind: str, name: str | None = None, required: bool = False
) -> Any:
    """``table[key]`` if it is of ``kind`` (a key of ``_KINDS``); ``None`` if absent or null and
    not ``required``. ``name`` is its path in the manifest (``keys.include``) for the message."""
    value = table.get(key)
    valid, expected = _KINDS[kind]
    if (value is None and required) or (value is not None and not valid(value)):
        raise invalid(where, name or key, expected, value)
    return value


def read(fs: FileSystem, path: str, where: str) -> dict[str, Any]:
    """The manifest of the output folder ``path`` (``where`` names it in messages), with its
    ``files`` table and sizes checked."""
    manifest_path = join(fs, path, MANIFEST_FILE)
    if not fs.exists(manifest_path):
        raise OutputError(f"{where}: missing; the output is not a finished ckptavg merge")
    manifest = read_json(fs, manifest_path, "a manifest")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise OutputError(f"{where}: unreadable (no 'files' table)")
    for name in manifest["files"]:
        field(where, manifest["files"], name, "file", f"files.{name}", required=True)
    field(where, manifest, "tensor_count", "count")
    field(where, manifest, "total_size", "count")
    return manifest
