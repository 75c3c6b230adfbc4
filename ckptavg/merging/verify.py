"""``ckptavg verify``: is a merged output what its manifest says, and (optionally) what its
sources average to?

Checks, each failing with one line that names the file or tensor: the manifest is there and
readable; every file it lists exists with the recorded sha256, and no weight file is unlisted;
the weights open (index, headers, shapes and dtypes consistent) and match the manifest's tensor
count and total size; every floating value is finite. With ``against``, a sample of tensors is
averaged again from the sources the manifest names, found in that run folder, and compared
byte for byte, streaming, chunk by chunk.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CkptavgError, ConfigError, OutputError
from ..formats import CheckpointReader, open_checkpoint
from ..formats.layout import ShardSpec, TensorSpec
from ..io.files import sha256_file
from ..io.fs import FileSystem, display, join, resolve
from ..manifest import MANIFEST_FILE, invalid
from ..manifest import field as manifest_field
from ..manifest import read as read_manifest
from ..weighting import normalised
from .engine import DEFAULT_CHUNK_BYTES, EngineOptions, StreamingAverage
from .job import copy_index
from .kernel import finite, is_finite
from .keys import FilteredReader, KeyFilter
from .options import copy_source


@dataclass
class VerifyReport:
    """What :func:`verify` checked (it raises on the first problem, so all of it passed)."""

    output: str
    files_checked: int = 0
    """Files whose sha256 matches the manifest."""
    tensors_checked: int = 0
    """Tensors found consistent with the index and manifest, and finite."""
    bytes_hashed: int = 0
    recomputed: list[str] = field(default_factory=list)
    """Tensors averaged again from the sources (``against``) and found identical."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "files_checked": self.files_checked,
            "tensors_checked": self.tensors_checked,
            "bytes_hashed": self.bytes_hashed,
            "recomputed": self.recomputed,
        }


def _all_files(fs: FileSystem, path: str) -> set[str]:
    """Every file below ``path``, relative to it (a DCP output of OLMo-core has a subfolder)."""
    prefix = path.rstrip("/") + "/"
    return {str(name)[len(prefix) :] for name in fs.find(path) if str(name).startswith(prefix)}


def _check_files(fs: FileSystem, path: str, shown: str, manifest: dict[str, Any], report: VerifyReport) -> None:
    listed = manifest["files"]
    present = _all_files(fs, path) - {MANIFEST_FILE}
    for name, entry in sorted(listed.items()):
        if name not in present:
            raise OutputError(f"{shown}/{name}: listed in the manifest but missing")
        digest, size = sha256_file(fs, join(fs, path, name))
        report.bytes_hashed += size
        if digest != entry.get("sha256"):
            raise OutputError(f"{shown}/{name}: sha256 differs from the manifest's; the file changed or is corrupt")
        report.files_checked += 1
    unlisted = sorted(name for name in present - set(listed) if not name.rsplit("/", 1)[-1].startswith("."))
    if unlisted:
        raise OutputError(f"{shown}/{unlisted[0]}: not listed in the manifest")


def _check_tensors(reader: CheckpointReader, manifest: dict[str, Any], report: VerifyReport) -> None:
    tensors = reader.tensors()
    if manifest.get("tensor_count") is not None and len(tensors) != manifest["tensor_count"]:
        raise OutputError(
            f"{reader.display_path}: holds {len(tensors)} tensors, the manifest says {manifest['tensor_count']}"
        )
    total = sum(t.nbytes for t in tensors)
    if manifest.get("total_size") is not None and total != manifest["total_size"]:
        raise OutputError(
            f"{reader.display_path}: holds {total} bytes of tensors, the manifest says {manifest['total_size']}"
        )
    chunk = DEFAULT_CHUNK_BYTES
    buffer = bytearray(chunk)
    for info in tensors:
        if info.dtype.is_floating_point:
            per = chunk // info.dtype.itemsize
            for start in range(0, info.numel, per):
                count = min(per, info.numel - start)
                view = memoryview(buffer)[: count * info.dtype.itemsize]
                reader.read_into(info.name, start * info.dtype.itemsize, view)
                values = torch.frombuffer(buffer, dtype=info.dtype, count=count)
                if not is_finite(values):
                    bad = int((~finite(values)).nonzero()[0])
                    raise OutputError(f"tensor {info.name!r} in {info.file} is not finite at element {start + bad}")
        report.tensors_checked += 1


class _CompareSink:
    """Receives the recomputed bytes of one tensor and compares them with the output's."""

    def __init__(self, output: CheckpointReader, spec: TensorSpec) -> None:
        self.output, self.spec, self.offset = output, spec, 0

    def write(self, data: memoryview) -> None:
        stored = bytearray(len(data))
        self.output.read_into(self.spec.name, self.offset, memoryview(stored))
        if stored != data:
            mine = torch.frombuffer(bytearray(data), dtype=self.spec.dtype)
            theirs = torch.frombuffer(stored, dtype=self.spec.dtype)
            first = int((mine != theirs).nonzero()[0]) if bool((mine != theirs).any()) else 0
            element = self.offset // self.spec.dtype.itemsize + first
            raise OutputError(
                f"tensor {self.spec.name!r} differs from the average of its sources at element {element} "
                f"(stored {theirs[first].item()!r}, recomputed {mine[first].item()!r})"
            )
        self.offset += len(data)

    def close(self) -> str:
        return ""

    def abort(self) -> None:
        pass


def _sources(manifest: dict[str, Any], where: str, run_dir: str) -> tuple[list[str], list[float] | None, int]:
    """The sources' paths in ``run_dir``, their normalised weights (None: uniform) and the one
    that the copy rules take from."""
    records = manifest_field(where, manifest, "sources", "list") or []
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise invalid(where, f"sources[{index}]", "an object", record)
    paths = [r.get("path") for r in records]
    if not records or not all(isinstance(p, str) and p for p in paths):
        raise ConfigError(f"{where} names no sources to recompute from (a training-hook merge?)")
    fs, root = resolve(run_dir)
    located = [join(fs, root, p.rstrip("/").rsplit("/", 1)[-1]) for p in paths]
    for path, record in zip(located, paths, strict=True):
        if not fs.exists(path):  # a step folder, or a checkpoint file
            raise ConfigError(f"source {record} of the manifest is not in {display(fs, root)}")
    shown = [display(fs, p) for p in located]
    copy_from = _copy_from(manifest, where, records)
    if manifest_field(where, manifest, "method", "text") == "uniform":
        return shown, None, copy_from
    weighting = manifest_field(where, manifest, "weighting", "table") or {}
    signed = weighting.get("negative_weights") is True
    kind = "numbers" if signed else "weights"
    weights = manifest_field(where, weighting, "unnormalised", kind, "weighting.unnormalised")
    name = "weighting.unnormalised"
    if weights is None:
        weights = [
            manifest_field(where, r, "weight", "weight", f"sources[{i}].weight", required=True)
            for i, r in enumerate(records)
        ]
        name = "sources[].weight"
    if len(weights) != len(records):
        raise invalid(where, name, f"{len(records)} weights, one per source", weights)
    try:
        return shown, normalised([float(w) for w in weights], allow_negative=signed), copy_from
    except CkptavgError as exc:
        raise OutputError(f"{where}: field {name!r}: {exc}") from None


def _copy_rules(manifest: dict[str, Any], where: str) -> tuple[str, ...]:
    """The ``--copy`` patterns the manifest records (none without a ``copy`` table)."""
    rules = manifest_field(where, manifest, "copy", "table") or {}
    return tuple(manifest_field(where, rules, "patterns", "texts", "copy.patterns") or ())


def _copy_from(manifest: dict[str, Any], where: str, records: list[dict[str, Any]]) -> int:
    """The index of the source the manifest's copy rules took from (the newest without rules)."""
    rules = manifest_field(where, manifest, "copy", "table") or {}
    try:
        chosen = copy_source(rules.get("from", "newest"), "it")
        return copy_index(chosen, [r.get("step") for r in records], len(records))
    except CkptavgError as exc:
        raise OutputError(f"{where}: field 'copy.from': {exc}") from None


def _recompute(
    output: CheckpointReader,
    manifest: dict[str, Any],
    where: str,
    run_dir: str,
    sample: int,
    seed: int,
    report: VerifyReport,
) -> None:
    keys_record = manifest_field(where, manifest, "keys", "table") or {}
    keys = KeyFilter(
        tuple(manifest_field(where, keys_record, "include", "texts", "keys.include") or ()),
        tuple(manifest_field(where, keys_record, "exclude", "texts", "keys.exclude") or ()),
        manifest_field(where, keys_record, "strip_prefix", "text", "keys.strip_prefix") or "",
    )
    paths, weights, copy_from = _sources(manifest, where, run_dir)
    readers: list[CheckpointReader] = []
    try:
        for path in paths:
            readers.append(FilteredReader(open_checkpoint(*resolve(path)), keys))
        stored = {t.name: t for t in output.tensors()}
        names = sorted(stored)
        chosen = sorted(random.Random(seed).sample(names, min(sample, len(names))))
        options = EngineOptions(dtype={n: stored[n].dtype for n in names}, copy=_copy_rules(manifest, where))
        engine = StreamingAverage(readers, weights, options, copy_from=copy_from)
        for name in chosen:
            if name not in engine.tensors:
                raise OutputError(f"tensor {name!r} of the output is not in the sources")
            spec = TensorSpec(name, stored[name].dtype, stored[name].shape)
            engine.run([ShardSpec(name, (spec,))], lambda shard: _CompareSink(output, shard.tensors[0]))
            report.recomputed.append(name)
    finally:
        for reader in readers:
            reader.close()


def verify(out: str, against: str | None = None, sample: int = 8, seed: int = 0) -> VerifyReport:
    """Verify the merged output ``out`` (see the module docstring); raise a
    :class:`~ckptavg.CkptavgError` naming the first problem.

    Args:
        out: the merged output folder (path or fsspec URL).
        against: the run folder holding its sources: a sample of tensors is recomputed from
            them and compared byte for byte.
        sample: how many tensors ``against`` recomputes.
        seed: which tensors the sample takes.

    Example::

        report = ckptavg.verify("runs/llama/step5000-merged", against="runs/llama", sample=16)
        print(report.files_checked, report.recomputed)
    """
    fs, path = resolve(out)
    shown = display(fs, path)
    if not fs.isdir(path):
        raise OutputError(f"{shown}: no such folder")
    where = f"{shown}/{MANIFEST_FILE}"
    manifest = read_manifest(fs, path, where)
    report = VerifyReport(shown)
    _check_files(fs, path, shown, manifest, report)
    reader = open_checkpoint(fs, path)
    try:
        _check_tensors(reader, manifest, report)
        if against is not None:
            _recompute(reader, manifest, where, against, sample, seed, report)
    finally:
        reader.close()
    return report
