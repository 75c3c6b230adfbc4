"""Which keys of a checkpoint a merge averages, and under which names it writes them.

(Choosing *checkpoints* is :mod:`ckptavg.merging.discovery`'s "select"; keys are filtered.)"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from typing import Any

from ..errors import ConfigError
from ..formats import CheckpointReader, StoredObject, TensorInfo
from ..formats.base import BlockRecord, DcpPlacement, MergedOutput
from ..formats.dtypes import float8_scales
from ..io.files import MappedRange
from ..io.fs import FileSystem


@dataclass(frozen=True)
class KeyFilter:
    """Which stored keys a merge averages and how it names them in the output. The default
    keeps each format's model weights (not optimizer or trainer state) under their own names."""

    include: tuple[str, ...] = ()
    """Globs over stored keys that replace the format's default choice (``--include``)."""
    exclude: tuple[str, ...] = ()
    """Globs removed from the choice (``--exclude``)."""
    strip_prefix: str = ""
    """Removed from the front of every output name that has it (``--strip-prefix``): ``model.``
    turns trainer keys into Hugging Face names."""

    def chooses(self, reader: CheckpointReader, name: str) -> bool:
        if self.include:
            chosen = any(fnmatchcase(name, pattern) for pattern in self.include)
        else:
            chosen = reader.is_model_weight(name)
        # Asked per stored key (100k and more): no generator made where nothing is excluded.
        return chosen and not (self.exclude and any(fnmatchcase(name, pattern) for pattern in self.exclude))

    def output_name(self, name: str) -> str:
        if self.strip_prefix and name.startswith(self.strip_prefix) and len(name) > len(self.strip_prefix):
            return name[len(self.strip_prefix) :]
        return name

    def unused(self, stored: Sequence[str], chosen: Sequence[str]) -> list[str]:
        """What of this filter changes nothing here (a likely typo, worth a note): a glob that
        matches no stored key, a prefix that begins no chosen key's name."""
        found = [
            f"--{option} {pattern!r} matches no tensor"
            for option, patterns in (("include", self.include), ("exclude", self.exclude))
            for pattern in patterns
            if not any(fnmatchcase(name, pattern) for name in stored)
        ]
        if self.strip_prefix and not any(name.startswith(self.strip_prefix) for name in chosen):
            found.append(f"--strip-prefix {self.strip_prefix!r} begins no averaged tensor's name")
        return found

    def describe(self) -> dict[str, Any]:
        return {"include": list(self.include), "exclude": list(self.exclude), "strip_prefix": self.strip_prefix}


class FilteredReader(CheckpointReader):
    """A reader seen through a :class:`KeyFilter`: only the chosen keys, under output names."""

    def __init__(self, inner: CheckpointReader, keys: KeyFilter) -> None:
        super().__init__(inner.fs, inner.path)
        self.inner = inner
        self.keys = keys
        self.format_name = inner.format_name  # type: ignore[misc]
        self._stored_name: dict[str, str] = {}
        self._tensors: list[TensorInfo] = []
        self.left_out: list[str] = []
        for info in inner.tensors():
            if not keys.chooses(inner, info.name):
                self.left_out.append(info.name)
                continue
            name = keys.output_name(info.name)
            if name in self._stored_name:
                raise ConfigError(
                    f"{inner.display_path}: keys {self._stored_name[name]!r} and {info.name!r} both become "
                    f"{name!r} after --strip-prefix {keys.strip_prefix!r}"
                )
            self._stored_name[name] = info.name
            # Renamed only where the name changes: a copy's shape would be checked again.
            self._tensors.append(info if name == info.name else replace(info, name=name))
        self._keep_float8_scales(inner)
        self.unused_keys = [
            f"{inner.display_path}: {note}"
            for note in keys.unused([info.name for info in inner.tensors()], list(self._stored_name.values()))
        ]
        """What of the key filter changes nothing in this checkpoint, one note each."""
        if not self._tensors:
            stored = len(self._tensors) + len(self.left_out)
            raise ConfigError(
                f"{inner.display_path}: no tensor selected of {stored} "
                f"(include {list(keys.include) or 'model weights'}, exclude {list(keys.exclude)})"
            )

    def _keep_float8_scales(self, inner: CheckpointReader) -> None:
        """Refuse a choice that keeps one of a float8 tensor and its scale without the other:
        alone, the float8 tensor would be averaged over sources whose scales were never compared,
        and the scale averaged as if it were a weight."""
        chosen = set(self._stored_name.values())
        for scale, weight in float8_scales((t.name, t.dtype) for t in inner.tensors()).items():
            if (weight in chosen) != (scale in chosen):
                kept, left = (weight, scale) if weight in chosen else (scale, weight)
                raise ConfigError(
                    f"{inner.display_path}: the key filter keeps {kept!r} but leaves out {left!r} (a float8 "
                    "tensor and its scale): choose both or neither"
                )

    @classmethod
    def detect(cls, fs: FileSystem, path: str) -> bool:
        raise NotImplementedError("a view, never detected")

    def tensors(self) -> list[TensorInfo]:
        return list(self._tensors)

    def read_into(self, name: str, byte_offset: int, buffer: memoryview) -> None:
        self.inner.read_into(self._stored_name[name], byte_offset, buffer)

    def local_view(self, name: str, byte_offset: int, nbytes: int) -> MappedRange | None:
        return self.inner.local_view(self._stored_name[name], byte_offset, nbytes)

    def adjacent(self, names: Sequence[str]) -> list[bool]:
        return self.inner.adjacent([self._stored_name[name] for name in names])

    def weight_files(self) -> set[str]:
        return self.inner.weight_files()

    def extra_files(self) -> list[str]:
        return self.inner.extra_files()

    def companion_files(self) -> list[str]:
        return self.inner.companion_files()

    def companion_for(self, name: str, output: MergedOutput) -> bytes | None:
        return self.inner.companion_for(name, output)

    def carried_objects(self) -> list[StoredObject]:
        return self.inner.carried_objects()

    def dcp_placement(self) -> DcpPlacement:
        return self.inner.dcp_placement()

    def read_object_into(self, name: str, byte_offset: int, buffer: memoryview) -> None:
        self.inner.read_object_into(name, byte_offset, buffer)

    def block_record(self) -> BlockRecord | None:
        """The inner block's record, its dtypes under the output names of the chosen keys."""
        record = self.inner.block_record()
        if record is None:
            return None
        dtypes = {name: record.dtypes[stored] for name, stored in self._stored_name.items()}
        return replace(record, dtypes=dtypes)

    def close(self) -> None:
        self.inner.close()


def note_unused_keys(readers: Sequence[CheckpointReader], notice: Callable[[str], None] | None) -> None:
    """Tell ``notice`` what of the key filter matched nothing in the newest checkpoint."""
    newest = readers[-1] if readers else None
    if notice is not None and isinstance(newest, FilteredReader):
        for note in newest.unused_keys:
            notice(note)
