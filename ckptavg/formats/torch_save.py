"""Files written by ``torch.save``, read as tables of byte ranges: no code runs, no data loads.

Since torch 1.6 ``torch.save`` writes an uncompressed zip: ``<prefix>/data.pkl`` pickles the
object, with each tensor's storage referenced by key and stored raw in ``<prefix>/data/<key>``.
Unpickling ``data.pkl`` with an allow-list (tensor rebuild, dicts, storage types; nothing that
imports code) gives each tensor's dtype, shape and place in its storage, and the zip directory
gives the storage's place in the file. The merge engine then reads any byte range of any tensor
straight from the file, as it does for safetensors: memory stays bounded by its buffers,
whatever the tensor size, and a remote file costs two small range requests plus the data.
``torch.load(weights_only=True, mmap=True)`` would bound memory too, but only for local files,
and it materialises every tensor of a file to list them.

DCP's ``.distcp`` files hold one such archive per tensor item, at offsets its metadata gives.
A format that needs more of the pickled object than its tensors (DeepSpeed's shapes and
partition counts) reads it with :func:`read_archive`, with its own globals added to the allow-list.
"""

from __future__ import annotations

import collections
import functools
import io
import operator
import pickle
import struct
import zipfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import CheckpointError
from ..io.files import RandomAccessFile
from ..units import numel
from .base import checked_shape, shown_value
from .dtypes import READ, TORCH_DTYPES
from .restricted_pickle import find_skipped, restricted_loads, skipped_global

# The storage classes torch.save names: a typed storage per dtype of torch 1.x (``FloatStorage``,
# still written for those dtypes), each tensor's own dtype its storage's; and for the dtypes
# added since (float8, uint16-64, e8m0, ...), ``UntypedStorage``, bytes, with the tensor's dtype
# passed to ``_rebuild_tensor_v3`` beside it (torch.storage._new_dtypes).
_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    # Read as what they are, then refused by name (formats.dtypes.READ) where a tensor is needed.
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
    "QInt8Storage": torch.qint8,
    "QInt32Storage": torch.qint32,
    "QUInt8Storage": torch.quint8,
    "QUInt4x2Storage": torch.quint4x2,
    "QUInt2x4Storage": torch.quint2x4,
    "UntypedStorage": torch.uint8,
}
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length
# What zipfile raises for a damaged archive; NotImplementedError and RuntimeError for features a
# corrupt header may claim (a zip64 version, patched data, encryption) that torch.save never uses.
_ZIP_ERRORS = (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, RuntimeError)
_CACHE_BLOCK = 64 * 2**10
# An archive of one tensor (a DCP item) holds its pickle and small records in its first few
# hundred bytes and its zip directory in its last: :func:`_directory_from_ends` reads this much
# of each end, once, and parses them with struct, where zipfile would cost a millisecond an item.
_END_SPAN = 4096
_END_RECORD = struct.Struct("<4s4H2LH")  # zipfile's structEndArchive
_CENTRAL_RECORD = struct.Struct("<4s4B4HL2L5H2L")  # zipfile's structCentralDir
_FULL_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zipfile's structFileHeader
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # zipfile's structEndArchive64Locator
_ZIP64_END = struct.Struct("<4sQ2H2L4Q")  # zipfile's structEndArchive64
_UNREAD_FLAGS = 0x1 | 0x20 | 0x40  # encrypted, patched data, strong encryption


class _Checked:
    """What the unpickler's callables return, checked as they are made. A BUILD opcode after
    them would set attributes past the checks (a frozen dataclass stops ``setattr``, not a
    pickle, which writes ``__dict__`` or calls ``__setstate__``): it is refused here."""

    def __setstate__(self, _state: Any) -> None:
        raise pickle.UnpicklingError(f"the pickle changes a {type(self).__name__.lstrip('_')} after it was made")


@dataclass(frozen=True)
class _Storage(_Checked):
    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class TensorRef(_Checked):
    """A tensor in the unpickled object: where in which storage, not its data. ``storage_offset``
    counts elements of ``dtype``, which is the storage's own unless the storage is untyped."""

    storage: _Storage
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of a torch.save archive: its bytes are ``offset`` onward, row-major."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute position in the file

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.dtype.itemsize


def _tensor_ref(storage: Any, storage_offset: Any, size: Any, stride: Any, dtype: Any) -> TensorRef:
    # operator.index takes only true integers: a float or a string here is a corrupt pickle (the
    # unpickler reports the TypeError), never a size to compute with.
    if not isinstance(storage, _Storage):
        raise TypeError(f"a tensor's storage is {type(storage).__name__}, not a storage reference")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"a tensor's dtype is {type(dtype).__name__}, not a dtype")
    return TensorRef(
        storage,
        operator.index(storage_offset),
        tuple(map(operator.index, size)),
        tuple(map(operator.index, stride)),
        dtype,
    )


def _rebuild_tensor(
    storage: Any, storage_offset: Any, size: Any, stride: Any, *_args: Any, **_kwargs: Any
) -> TensorRef:
    """``torch._utils._rebuild_tensor_v2``: a tensor of a typed storage, of the storage's dtype."""
    dtype = storage.dtype if isinstance(storage, _Storage) else None
    return _tensor_ref(storage, storage_offset, size, stride, dtype)


def _rebuild_tensor_v3(
    storage: Any, storage_offset: Any, size: Any, stride: Any, _requires_grad: Any, _hooks: Any, dtype: Any, *_args: Any
) -> TensorRef:
    """``torch._utils._rebuild_tensor_v3``: a tensor of an untyped storage, its dtype given."""
    return _tensor_ref(storage, storage_offset, size, stride, dtype)


def _rebuild_parameter(data: Any, *_args: Any) -> Any:
    return data


# Stand for ``torch.nn.Parameter`` and ``torch.Tensor`` in ``_rebuild_from_type_v2``: plain
# values, since the unpickler hands out callables as stand-ins, which an identity check would not
# recognise. A plain tensor comes this way when it carries Python attributes (DeepSpeed's ZeRO-3
# flat groups keep a ``ds_id``); the attributes are dropped.
_PARAMETER = "torch.nn.Parameter"
_TENSOR = "torch.Tensor"


def _rebuild_from_type(func: Any, new_type: Any, args: Any, _state: Any) -> Any:
    if skipped_global(new_type) is not None:  # a tensor subclass of unknown code: skipped as a whole
        return new_type()
    if new_type not in (_PARAMETER, _TENSOR):
        raise pickle.UnpicklingError(f"unsupported tensor subclass {new_type!r}")
    return func(*args)


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch.nn.parameter", "Parameter"): _PARAMETER,
    ("torch", "Tensor"): _TENSOR,
    ("torch", "Size"): torch.Size,  # shapes kept beside the weights (DeepSpeed's param_shapes)
    ("collections", "OrderedDict"): collections.OrderedDict,
    **{("torch", name): name for name in _STORAGE_DTYPES if name != "UntypedStorage"},
    ("torch.storage", "UntypedStorage"): "UntypedStorage",
    **{("torch", name): dtype for name, dtype in TORCH_DTYPES.items()},  # _rebuild_tensor_v3's dtype
}


class _Window(io.RawIOBase):
    """A byte range of a file as a seekable stream for :mod:`zipfile`, read through a few cached
    64-KiB blocks: the zip directory at the end and the pickle at the start each cost one read."""

    def __init__(self, file: RandomAccessFile, start: int, length: int) -> None:
        super().__init__()
        self.file, self.start, self.length = file, start, length
        self.position = 0
        self._blocks: dict[int, bytes] = {}
        self._kept: list[tuple[int, bytes]] = []

    def keep(self, begin: int, data: bytes) -> None:
        """Serve reads inside ``[begin, begin + len(data))`` from ``data`` (bytes read already)."""
        self._kept.append((begin, data))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(0, base + offset)
        return self.position

    def _block(self, index: int) -> bytes:
        if index not in self._blocks:
            if len(self._blocks) >= 8:
                self._blocks.pop(next(iter(self._blocks)))
            begin = index * _CACHE_BLOCK
            size = min(_CACHE_BLOCK, self.length - begin)
            self._blocks[index] = self.file.read(self.start + begin, size)
        return self._blocks[index]

    def read(self, size: int | None = -1) -> bytes:
        # RawIOBase.read allocates ``size`` bytes before reading, and zipfile asks for as much as
        # a record's (possibly corrupt) compressed size says, up to 2 GiB at a time: never more
        # than the window holds.
        left = max(0, self.length - self.position)
        return super().read(left if size is None or size < 0 else min(size, left))

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = max(0, min(len(view), self.length - self.position))  # a seek may pass the end
        for begin, data in self._kept:
            if begin <= self.position and self.position + wanted <= begin + len(data):
                view[:wanted] = data[self.position - begin : self.position - begin + wanted]
                self.position += wanted
                return wanted
        done = 0
        while done < wanted:
            index, within = divmod(self.position, _CACHE_BLOCK)
            block = self._block(index)
            n = min(wanted - done, len(block) - within)
            view[done : done + n] = block[within : within + n]
            done += n
            self.position += n
        return done


@dataclass(frozen=True)
class _Entry:
    """A zip directory entry as :func:`_directory_from_ends` reads it (the fields of
    ``zipfile.ZipInfo`` that this module uses)."""

    filename: str
    header_offset: int
    file_size: int
    compress_size: int
    compress_type: int
    flag_bits: int
    CRC: int  # noqa: N815 (ZipInfo's name)
    end_offset: int  # where the next record (or the directory) begins


@dataclass(frozen=True)
class Ends:
    """The first and last :data:`_END_SPAN` bytes of an archive of ``length`` bytes (the whole
    archive, as both, when it is no longer than the two), as :func:`read_ends_in_order` reads them."""

    head: bytes
    tail: bytes
    tail_start: int  # where ``tail`` begins in the archive
    length: int


def _read_ends(file: RandomAccessFile, start: int, length: int) -> Ends:
    return next(read_ends_in_order(file, [(start, length)]))


# Archives whose ends :func:`read_ends_in_order` reads and holds at a time (at most 8 KiB each).
_ENDS_BATCH = 128


def read_ends_in_order(file: RandomAccessFile, archives: Sequence[tuple[int, int]]) -> Iterator[Ends]:
    """The :class:`Ends` of the archives ``(start, length)`` of ``file``, in the order given.
    Where an archive starts right where the previous one ends (DCP's items in a ``.distcp``, in
    file order), the tail of the one and the head of the other are one read: a file of many
    small archives costs one read per archive rather than two."""
    for batch in range(0, len(archives), _ENDS_BATCH):
        group = archives[batch : batch + _ENDS_BATCH]
        spans = [span for start, length in group for span in _end_spans(start, length)]
        parts = iter(_read_spans(file, spans))
        for _start, length in group:
            if length <= 2 * _END_SPAN:
                whole = next(parts)
                yield Ends(whole, whole, 0, length)
            else:
                yield Ends(next(parts), next(parts), length - _END_SPAN, length)


def _end_spans(start: int, length: int) -> list[tuple[int, int]]:
    """The byte ranges of the file that the :class:`Ends` of the archive at ``start`` hold."""
    if length <= 2 * _END_SPAN:
        return [(start, start + length)]
    return [(start, start + _END_SPAN), (start + length - _END_SPAN, start + length)]


def _read_spans(file: RandomAccessFile, spans: list[tuple[int, int]]) -> list[bytes]:
    """The bytes of each ``(begin, end)`` of ``spans``, one read for each run of spans that
    follow one another without a gap."""
    out: list[bytes] = []
    first = 0
    for last in range(len(spans)):
        if last + 1 < len(spans) and spans[last + 1][0] == spans[last][1]:
            continue  # the next span goes on from this one: the same read
        base = spans[first][0]
        data = file.read(base, spans[last][1] - base)
        out += [data[begin - base : end - base] for begin, end in spans[first : last + 1]]
        first = last + 1
    return out


def _directory_from_ends(ends: Ends) -> tuple[dict[str, _Entry], str, bytes] | None:
    """(records by name, the pickle's prefix, the pickle) of the archive whose two ends are
    ``ends``, where the archive is laid out as torch.save lays out a small one: its zip
    directory right before its end records, no extras or comments, its pickle and byte order
    record inside the first span, stored and CRC-correct. None otherwise, and then zipfile
    reads the archive (and refuses what it must): this parses only archives that zipfile reads
    the same way."""
    head = ends.head
    records = _central_directory(ends.tail, ends.tail_start, ends.length)
    if records is None:
        return None
    pickles = [name for name in records if name.endswith("data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        return None
    prefix = pickles[0][: -len("data.pkl")]
    order = records.get(prefix + "byteorder")
    if order is not None and _stored_bytes(head, order) != b"little":
        return None
    data = _stored_bytes(head, records[pickles[0]])
    return None if data is None else (records, prefix, data)


def _central_directory(tail: bytes, tail_start: int, length: int) -> dict[str, _Entry] | None:
    """The entries of the zip directory at the end of ``tail`` (the archive's bytes from
    ``tail_start`` on), read as zipfile reads it: the end record without a comment, the zip64
    end record that its locator names (torch.save writes both), and the directory they say lies
    right before them. None where zipfile could read it otherwise (an archive inside a longer
    file, a comment, extras, zip64 sizes in entries)."""
    end = len(tail) - _END_RECORD.size
    if end < _ZIP64_LOCATOR.size:
        return None
    signature, _, _, _, _, cd_size, cd_offset, comment = _END_RECORD.unpack_from(tail, end)
    if signature != b"PK\x05\x06" or comment:
        return None
    directory_end = end
    if tail[end - _ZIP64_LOCATOR.size : end - _ZIP64_LOCATOR.size + 4] == b"PK\x06\x07":
        _, disk, _, disks = _ZIP64_LOCATOR.unpack_from(tail, end - _ZIP64_LOCATOR.size)
        directory_end = end - _ZIP64_LOCATOR.size - _ZIP64_END.size
        if disk or disks > 1 or directory_end < 0:
            return None
        zip64 = _ZIP64_END.unpack_from(tail, directory_end)
        if zip64[0] != b"PK\x06\x06":
            return None
        cd_size, cd_offset = zip64[-2:]
    if cd_offset + cd_size != tail_start + directory_end or cd_offset < tail_start:
        return None
    found: dict[str, tuple[int, int, int, int, int, int]] = {}
    position = cd_offset - tail_start
    while position < directory_end:
        if position + _CENTRAL_RECORD.size > directory_end:
            return None
        fields = _CENTRAL_RECORD.unpack_from(tail, position)
        (signature, _, _, version, _, flags, method, _, _, crc, packed, size, name_length, extra, note) = fields[:15]
        offset = fields[-1]
        name = tail[position + _CENTRAL_RECORD.size : position + _CENTRAL_RECORD.size + name_length]
        if (
            signature != b"PK\x01\x02"
            or version > zipfile.MAX_EXTRACT_VERSION
            or extra
            or note
            or 0xFFFFFFFF in (packed, size, offset)
            or not name.isascii()
            or b"\0" in name  # zipfile cuts a name at NUL
            or name.decode() in found
        ):
            return None
        found[name.decode()] = (offset, size, packed, method, flags, crc)
        position += _CENTRAL_RECORD.size + name_length
    if position != directory_end:
        return None
    # Each record ends where the next begins (zipfile since 3.12 refuses records that overlap).
    starts = sorted({fields[0] for fields in found.values()} | {cd_offset})
    if len(starts) != len(found) + 1:
        return None  # two records at one place, or one where the directory is
    ends = dict(zip(starts, starts[1:], strict=False))
    return {name: _Entry(name, *fields, ends.get(fields[0], cd_offset)) for name, fields in found.items()}


def _stored_bytes(head: bytes, entry: _Entry) -> bytes | None:
    """A small record's bytes, as zipfile would read them, when they lie in ``head``, stored,
    their local header agreeing with the directory and their CRC right; else None."""
    at = entry.header_offset
    if (
        entry.compress_type != zipfile.ZIP_STORED
        or entry.flag_bits & _UNREAD_FLAGS
        or entry.compress_size != entry.file_size
        or at + _FULL_LOCAL_HEADER.size > len(head)
    ):
        return None
    local = _FULL_LOCAL_HEADER.unpack_from(head, at)
    name_at = at + _FULL_LOCAL_HEADER.size
    start = name_at + local[-2] + local[-1]
    if local[0] != b"PK\x03\x04" or head[name_at : name_at + local[-2]] != entry.filename.encode():
        return None
    data = head[start : start + entry.file_size]
    if len(data) != entry.file_size or start + entry.file_size > entry.end_offset:
        return None
    return data if zlib.crc32(data) == entry.CRC else None


def _check_plain(info: zipfile.ZipInfo | _Entry, where: str) -> None:
    """A record as torch.save writes it: stored, not compressed or encrypted (zipfile would pick a
    decompressor, or ask for a password, as a corrupt directory entry says)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise CheckpointError(f"{where}: record {info.filename!r} is compressed; torch.save never compresses")
    if info.flag_bits & 0x1:
        raise CheckpointError(f"{where}: record {info.filename!r} is encrypted; torch.save never encrypts")


def _read_record(archive: zipfile.ZipFile, info: zipfile.ZipInfo, where: str) -> bytes:
    """A small record's bytes, CRC checked."""
    _check_plain(info, where)
    return archive.read(info)


def _data_offset(window: _Window, info: zipfile.ZipInfo | _Entry, where: str) -> int:
    """Where a stored record's bytes begin in the window (past its local header)."""
    _check_plain(info, where)
    window.seek(info.header_offset)
    header = window.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise CheckpointError(f"{where}: corrupt zip entry {info.filename!r}")
    _, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    if start + info.file_size > window.length:
        raise CheckpointError(f"{where}: record {info.filename!r} runs past the end; the file is truncated")
    return start


# A state dict nests a few levels (``{"model": {...}, "optim": {...}}``); deeper is not one.
_MAX_DEPTH = 64
# Characters of tensor names a pickle may make per byte of it, beyond a first MiB. A name is
# built from the keys above the tensor, and a pickle can put one long key above millions of
# (memoized) tensors: their names would take terabytes. A state dict's names take less than
# its pickle does.
_NAME_CHARS_PER_BYTE = 4


class _Unnamable(Exception):
    """A dict key that cannot be part of a tensor's name."""


def _key_name(key: Any) -> str:
    """A dict key as a part of a dotted tensor name: a string as it is, anything else as ``str``
    shows it (an optimizer's parameter index: ``0``). An integer past Python's 4300-digit limit
    for text, or a tuple nested past the recursion limit, cannot be shown: :class:`_Unnamable`."""
    if isinstance(key, str):
        return key
    try:
        return str(key)
    except (ValueError, RecursionError):
        raise _Unnamable(key) from None


# Where a value lies in the unpickled object: None at the root, else (the path of the dict that
# holds it, its key). Names are joined only for tensors: a pickle's other keys are never named.
_Path = tuple[Any, Any] | None


def _dotted(path: _Path) -> str:
    keys = []
    while path is not None:
        path, key = path
        keys.append(_key_name(key))
    return ".".join(reversed(keys))


def _flatten(obj: Any, budget: int, where: str, lenient: bool = False) -> dict[str, TensorRef]:
    """Tensors of nested dicts, by dotted key; other leaves (numbers, strings) are not weights.

    ``budget`` bounds the dict entries visited: a pickle can reference one dict many times (or
    from inside itself) and so describe more keys than it has bytes; a state dict never does.
    Two paths to one name (``{"a.b": t, "a": {"b": u}}``, ``{"1": t, 1: u}``) are an error: keeping
    either tensor would drop the other unseen. A tensor under a key that cannot be part of a name
    is an error too. With ``lenient`` (trainer state, which a merge never needs) such tensors are
    left out instead, both of two that share a name.
    """
    out: dict[str, TensorRef] = {}
    shared: set[str] = set()
    name_chars = _NAME_CHARS_PER_BYTE * budget + 2**20
    stack: list[tuple[_Path, Any, int]] = [(None, obj, 0)]
    while stack:
        path, value, depth = stack.pop()
        if isinstance(value, TensorRef):
            try:
                name = _dotted(path)
            except _Unnamable as exc:
                if lenient:
                    continue
                raise CheckpointError(
                    f"{where}: a tensor lies under key {shown_value(exc.args[0])}, which cannot be part of its name"
                ) from None
            name_chars -= len(name)
            if name_chars < 0:
                raise CheckpointError(f"{where}: not a state dict (its tensor names are longer than the file)")
            if name in out and not lenient:
                raise CheckpointError(
                    f"{where}: two tensors are both named {name!r:.200} once nested keys are joined with dots"
                )
            if name in out:
                shared.add(name)
            out[name] = value
        elif isinstance(value, dict):
            budget -= len(value)
            if budget < 0 or depth >= _MAX_DEPTH:
                raise CheckpointError(f"{where}: not a state dict (its dicts nest or repeat without end)")
            stack.extend(reversed([((path, key), child, depth + 1) for key, child in value.items()]))  # in order
    return {name: ref for name, ref in out.items() if name not in shared}


def _row_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


class TorchSaveArchive:
    """The torch.save archive at ``file[start:start+length]``, its pickle loaded: :attr:`root` is
    the saved object, each tensor in it a :class:`TensorRef` (dtype, shape, storage) to bytes still
    in the file; :meth:`locate` and :meth:`tensors` say where those bytes lie. ``extra_globals``
    widens the allow-list with a format's own classes (mapped to inert stand-ins); with
    ``skip_unknown`` the pickle's other globals stand as :class:`~.restricted_pickle.Skipped`
    classes (for a reader that reads only part of it; see :meth:`check_readable`). ``small``
    (with neither of those) is what the many small archives of one reader share
    (:class:`SmallArchives`): the archive's directory is then read from its two ends first
    (:func:`_directory_from_ends`; ``ends`` where they were read already) and its pickle
    unpickled once per distinct pickle."""

    def __init__(
        self,
        file: RandomAccessFile,
        start: int,
        length: int,
        where: str,
        extra_globals: Mapping[tuple[str, str], Any] | None = None,
        skip_unknown: bool = False,
        small: SmallArchives | None = None,
        ends: Ends | None = None,
    ) -> None:
        self.where = where
        self._window = _Window(file, start, length)
        self.ends = None if small is None else ends or _read_ends(file, start, length)
        found = None
        if self.ends is not None:
            self._window.keep(0, self.ends.head)  # the reads that locate its tensors
            self._window.keep(self.ends.tail_start, self.ends.tail)
            found = _directory_from_ends(self.ends)
        # Its records where it was read from its two ends (laid out as torch.save lays out a small one).
        self.quick_records = None if found is None else found[0]
        self._records: Mapping[str, zipfile.ZipInfo | _Entry]
        if found is None:
            data = self._read_zip(where)
        else:
            self._records, self._prefix, data = found

        def persistent_load(pid: Any) -> _Storage:
            if not (
                isinstance(pid, tuple)
                and len(pid) == 5
                and pid[0] == "storage"
                and isinstance(pid[1], str)
                and pid[1] in _STORAGE_DTYPES
                and isinstance(pid[2], str)
                and type(pid[4]) is int
                and 0 <= pid[4] < 2**63
            ):
                raise CheckpointError(f"{where}: unsupported storage reference {shown_value(pid, 100)}")
            return _Storage(pid[2], _STORAGE_DTYPES[pid[1]], pid[4])

        # Entries a walk over the object may visit: no more than the pickle's bytes.
        self.pickle_size = len(data)
        # Only pickles of the quick read (at most _END_SPAN bytes each) are kept: the memo holds
        # what small archives share, never a large pickle read once.
        memo = small.pickles if small is not None and found is not None else None
        if memo is not None and data in memo:
            self.root = memo[data]
            return
        allowed = {**_ALLOWED, **extra_globals} if extra_globals else _ALLOWED
        self.root = restricted_loads(data, allowed, where, persistent_load, skip_unknown)
        if memo is not None:
            memo[data] = self.root

    def _read_zip(self, where: str) -> bytes:
        """Read the archive's directory with zipfile (:attr:`_records`, :attr:`_prefix`);
        returns its pickle."""
        try:
            archive = zipfile.ZipFile(self._window)
        except _ZIP_ERRORS as exc:
            raise CheckpointError(
                f"{where}: not a torch.save archive ({exc}); legacy (pre-1.6) or corrupt files are not supported"
            ) from None
        try:
            records = {info.filename: info for info in archive.infolist()}
            self._records = records
            pickles = [name for name in records if name.endswith("data.pkl") and name.count("/") == 1]
            if len(pickles) != 1:
                raise CheckpointError(f"{where}: not a torch.save archive (no single */data.pkl)")
            self._prefix = pickles[0][: -len("data.pkl")]
            order = records.get(self._prefix + "byteorder")
            if order is not None and _read_record(archive, order, where) != b"little":
                raise CheckpointError(f"{where}: big-endian torch.save archives are not supported")
            if records[pickles[0]].file_size > 256 * 2**20:
                raise CheckpointError(f"{where}: {pickles[0]!r} is implausibly large for a state dict")
            return _read_record(archive, records[pickles[0]], where)
        except (*_ZIP_ERRORS, KeyError) as exc:
            raise CheckpointError(f"{where}: corrupt torch.save archive ({exc})") from None

    def check_readable(self, part: Any, what: str) -> None:
        """Refuse the file if ``part`` of :attr:`root` holds an object that was skipped: what it
        stood for (a tensor subclass, a module's extra state) cannot be read without its code."""
        found = find_skipped(part, self.pickle_size, self.where)
        if found is not None:
            path, name = found
            raise CheckpointError(
                f"{self.where}: refusing to read it: {what}{'.' + path if path else ''} holds a {name} object, "
                "which only its own code could unpickle (arbitrary code, not tensor data)"
            )

    def locate(self, ref: TensorRef, shown: str) -> StoredTensor:
        """Where ``ref``'s bytes lie in the file, checked against its storage record; ``shown``
        names the tensor in messages."""
        if ref.dtype not in READ:
            raise CheckpointError(f"{shown} is {ref.dtype}, a dtype ckptavg does not read")
        storage, itemsize = ref.storage, ref.dtype.itemsize
        count = numel(checked_shape(ref.shape, shown, itemsize))
        if len(ref.stride) != len(ref.shape):
            raise CheckpointError(f"{shown} has {len(ref.stride)} strides for shape {list(ref.shape)}")
        if count and not _row_major(ref.shape, ref.stride):
            raise CheckpointError(
                f"{shown} is stored as a strided view (stride {list(ref.stride)}); save it contiguous"
            )
        storage_bytes = storage.numel * storage.dtype.itemsize
        if ref.storage_offset < 0 or (ref.storage_offset + count) * itemsize > storage_bytes:
            raise CheckpointError(f"{shown} lies outside its storage")
        info = self._records.get(f"{self._prefix}data/{storage.key}")
        if info is None or info.file_size < storage_bytes:
            raise CheckpointError(f"{shown}: its storage record {'data/' + storage.key!r} is missing or short")
        start = self._window.start + _data_offset(self._window, info, self.where)
        return StoredTensor(ref.dtype, ref.shape, start + ref.storage_offset * itemsize)

    def layout(self, tensor: StoredTensor) -> _Layout | None:
        """The :class:`_Layout` of this quickly read archive of one tensor, ``tensor``; None
        where a record it read lies past the tensor's first byte or outside the first span."""
        assert self.ends is not None and self.quick_records is not None
        ends, records = self.ends, self.quick_records
        head_end = tensor.offset - self._window.start
        read = [self._prefix + "data.pkl", self._prefix + "byteorder"]
        if head_end > len(ends.head) or any(records[n].end_offset > head_end for n in read if n in records):
            return None
        directory_at = max(entry.end_offset for entry in records.values())  # the last record ends there
        directory = ends.tail[directory_at - ends.tail_start :]
        unread, position = [], 0
        for _ in records:
            (name_length,) = _NAME_LENGTH.unpack_from(directory, position + _NAME_LENGTH_AT)
            name = directory[position + _CENTRAL_RECORD.size : position + _CENTRAL_RECORD.size + name_length]
            if name.decode() not in read:
                unread.append(position + _CRC_AT)
            position += _CENTRAL_RECORD.size + name_length
        cleared = _cleared(directory, unread)
        return _Layout(ends.head[:head_end], directory_at, cleared, tuple(unread), replace(tensor, offset=head_end))

    def tensors(self, part: Any, lenient: bool = False) -> dict[str, StoredTensor]:
        """The tensors of ``part`` (:attr:`root` or an object inside it), by dotted key (``""``
        when it is one bare tensor, as DCP items are), each located in the file. With
        ``lenient`` (trainer state, which a merge reads only if asked), tensors that cannot be
        named, or of a dtype ckptavg does not read, are left out instead of refusing the file."""
        refs = _flatten(part, self.pickle_size, self.where, lenient)
        return {
            key: self.locate(ref, f"{self.where}: tensor {key!r}" if key else self.where)
            for key, ref in refs.items()
            if not lenient or ref.dtype in READ
        }


# Layouts a reader of small archives keeps (each a few KiB: its records and its directory).
_MAX_LAYOUTS = 256
_CRC_AT = 16  # where a central directory record's CRC lies in it
_NAME_LENGTH = struct.Struct("<H")
_NAME_LENGTH_AT = 28


@dataclass(frozen=True)
class _Layout:
    """What the quick read of one small archive of one tensor depended on, and found: its first
    ``len(head)`` bytes (every record it read: the pickle, the byte order, the tensor record's
    local header), its directory from ``directory_at`` on with the CRCs of the records it never
    read cleared (``unread_crcs``: the tensor's, the save's id), and the tensor there. Another
    archive of the same length with those same bytes is the same parse: the same tensor at the
    same place."""

    head: bytes
    directory_at: int
    directory: bytes
    unread_crcs: tuple[int, ...]  # positions in ``directory``
    tensor: StoredTensor  # its offset counted from the archive's start

    def matches(self, ends: Ends) -> bool:
        if not ends.head.startswith(self.head):
            return False
        tail, at = ends.tail, self.directory_at - ends.tail_start
        if len(tail) - at != len(self.directory):
            return False
        # Byte for byte but for the cleared CRCs, compared where they lie (no cleared copy).
        return all(tail[at + begin : at + end] == self.directory[begin:end] for begin, end in self._compared)

    @functools.cached_property
    def _compared(self) -> tuple[tuple[int, int], ...]:
        """The ranges of :attr:`directory` between its cleared CRCs."""
        bounds = [0, *(b for at in sorted(self.unread_crcs) for b in (at, at + 4)), len(self.directory)]
        return tuple(zip(bounds[::2], bounds[1::2], strict=True))


def _cleared(directory: bytes, crcs: Sequence[int]) -> bytes:
    """``directory`` with the CRCs at ``crcs`` set to zero."""
    cleared = bytearray(directory)
    for at in crcs:
        cleared[at : at + 4] = bytes(4)
    return bytes(cleared)


class SmallArchives:
    """What the many small archives of one reader (DCP's items: one tensor each, thousands for
    a save of many ranks) share: each distinct pickle unpickled once (:attr:`pickles`), and each
    distinct layout parsed once (:meth:`table`), so an item costs its two end reads and a few
    byte comparisons. Reader threads share one: its lists only grow, and two threads may at
    worst both learn one layout."""

    def __init__(self) -> None:
        self.pickles: dict[bytes, Any] = {}
        self._layouts: dict[int, list[_Layout]] = {}  # by archive length
        self.learnt = 0  # layouts held

    def table(
        self, file: RandomAccessFile, start: int, length: int, where: str, ends: Ends | None = None
    ) -> dict[str, StoredTensor]:
        """The tensors of the archive at ``file[start:start+length]`` (whose ends
        :func:`read_ends_in_order` may have read already)."""
        ends = ends or _read_ends(file, start, length)
        for layout in self._layouts.get(length, ()):
            if layout.matches(ends):
                found = layout.tensor
                return {"": StoredTensor(found.dtype, found.shape, start + found.offset)}
        archive = TorchSaveArchive(file, start, length, where, small=self, ends=ends)
        table = archive.tensors(archive.root)
        if self.learnt < _MAX_LAYOUTS and archive.quick_records is not None and list(table) == [""]:
            learned = archive.layout(table[""])
            if learned is not None:
                self._layouts.setdefault(length, []).append(learned)
                self.learnt += 1
        return table


def read_tensor_table(
    file: RandomAccessFile, start: int, length: int, where: str, small: SmallArchives | None = None
) -> dict[str, StoredTensor]:
    """The tensors of the torch.save archive at ``file[start:start+length]``, by dotted key
    (``""`` when the archive holds one bare tensor, as DCP items do). ``small`` (a reader of
    many small archives passes one: DCP's items) parses each distinct pickle and layout once
    (:class:`SmallArchives`)."""
    if small is not None:
        return small.table(file, start, length, where)
    archive = TorchSaveArchive(file, start, length, where)
    return archive.tensors(archive.root)
