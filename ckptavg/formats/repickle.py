"""A ``torch.save`` file edited without running it: Megatron's ``common.pt``, rewritten for a
merged output (what it holds, and how it was made).

:func:`read_graph` unpickles the archive's pickle after the same bounds as every pickle here
(:func:`~.pickle_scan.prescan`), with every global standing as a :class:`Recorded` class that
imports and runs nothing and only records what the pickle does with it: called (REDUCE) or made
(NEWOBJ) with which arguments, then given which state (BUILD), items (APPENDS) and entries
(SETITEMS), each as a :class:`Made`. Persistent ids (torch's storages) stay the tuples the
pickle wrote. Plain values (dicts, lists, tuples, strings, numbers) are themselves, to be edited.
:meth:`Graph.saved` pickles an edited root back, each recorded object as the same opcodes, into
an archive beside the storage records it references, copied byte for byte: what ``torch.load``
builds from it is what it built from the original, but for the edits. Unlike an allow-list,
this reads objects of any class (Megatron's ``args`` holds ``argparse.Namespace`` and enums of
its own) and writes them back as they were, since it never makes one.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError, CkptavgError
from .pickle_scan import prescan

_NO_STATE = object()


class Recorded(type):
    """What a global of the pickle stands for: a class named after it, which imports nothing, and
    whose every use records itself (calling it is REDUCE, making an object of it NEWOBJ)."""

    global_module: str
    global_name: str

    def __call__(cls, *args: Any, **kwargs: Any) -> Made:
        return Made(cls, args, kwargs, newobj=False)

    def __setattr__(cls, name: str, value: Any) -> None:
        raise pickle.UnpicklingError(f"the pickle sets attribute {name!r} of the global {cls.global_name}")


def _made_by_newobj(cls: Recorded, *args: Any, **kwargs: Any) -> Made:
    """``__new__`` of a :class:`Recorded` class: NEWOBJ records, it makes nothing."""
    return Made(cls, args, kwargs, newobj=True)


def _recorded(module: str, name: str) -> Recorded:
    if "\n" in module or "\n" in name:  # GLOBAL, which writes it back, ends each at a newline
        raise pickle.UnpicklingError(f"the global name {module!r}.{name!r} holds a line break")
    namespace = {"__slots__": (), "__new__": _made_by_newobj, "global_module": module, "global_name": name}
    return Recorded(name, (), namespace)


class Made:
    """An object the pickle made from a recorded global (or from what such a call returned):
    the call, and what the pickle then did to the object, in the order pickle writes them back."""

    def __init__(self, made_by: Any, args: tuple[Any, ...], kwargs: dict[str, Any], newobj: bool) -> None:
        if kwargs:  # NEWOBJ_EX: protocol 4, which torch.save does not write
            raise pickle.UnpicklingError("an object made with keyword arguments (NEWOBJ_EX)")
        self.made_by, self.args, self.newobj = made_by, args, newobj
        self.state: Any = _NO_STATE
        self.items: list[Any] = []
        self.entries: list[tuple[Any, Any]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Made:
        return Made(self, args, kwargs, newobj=False)

    def __setstate__(self, state: Any) -> None:
        if self.state is not _NO_STATE:
            raise pickle.UnpicklingError("the pickle sets the state of one object twice")
        self.state = state

    def append(self, item: Any) -> None:
        self.items.append(item)

    def extend(self, items: Any) -> None:
        self.items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.entries.append((key, value))

    def global_name(self) -> str | None:
        """``module.name`` of the global this object was made from, if it was made from one."""
        made_by = self.made_by
        return f"{made_by.global_module}.{made_by.global_name}" if isinstance(made_by, Recorded) else None


@dataclass(frozen=True)
class _Persistent:
    pid: Any


class _Reader(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._globals: dict[tuple[str, str], Recorded] = {}
        self.storage_keys: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key not in self._globals:
            self._globals[key] = _recorded(module, name)
        return self._globals[key]

    def persistent_load(self, pid: Any) -> Any:
        # torch.save's storage reference: ("storage", type, key, location, numel); its record is
        # data/<key>, looked up by name among the archive's records, never opened as a path.
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[2], str)):
            raise pickle.UnpicklingError("a persistent id that is not a torch storage")
        self.storage_keys.append(pid[2])
        return _Persistent(pid)


# The Python pickler, whose save() a subclass extends per object (typeshed types it as the C one).
_PythonPickler: Any = pickle._Pickler


class _Writer(_PythonPickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, _Persistent) else None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if not isinstance(obj, Recorded | Made):
            super().save(obj, save_persistent_id)
            return
        memoized = self.memo.get(id(obj))
        if memoized is not None:
            self.write(self.get(memoized[0]))
        elif isinstance(obj, Recorded):
            self.write(pickle.GLOBAL + f"{obj.global_module}\n{obj.global_name}\n".encode())
            self.memoize(obj)
        else:
            self._save_made(obj)

    def _save_made(self, made: Made) -> None:
        self.save(made.made_by)
        self.save(made.args)
        self.write(pickle.NEWOBJ if made.newobj else pickle.REDUCE)
        self.memoize(made)
        if made.items:
            self.write(pickle.MARK)
            for item in made.items:
                self.save(item)
            self.write(pickle.APPENDS)
        if made.entries:
            self.write(pickle.MARK)
            for key, value in made.entries:
                self.save(key)
                self.save(value)
            self.write(pickle.SETITEMS)
        if made.state is not _NO_STATE:
            self.save(made.state)
            self.write(pickle.BUILD)


@dataclass(frozen=True)
class Graph:
    """The object a ``torch.save`` archive holds, as recorded (:attr:`root`), and the storage
    records its tensors reference."""

    root: Any
    storages: dict[str, bytes]
    where: str

    def saved(self, root: Any) -> bytes:
        """A ``torch.save`` archive of ``root`` (this graph's root, edited) with the storages."""
        pickled = io.BytesIO()
        try:
            _Writer(pickled, protocol=2).dump(root)
        except (pickle.PicklingError, RecursionError) as exc:
            raise CheckpointError(f"{self.where}: cannot write it back ({exc})") from None
        data, out = pickled.getvalue(), io.BytesIO()
        archive = torch._C.PyTorchFileWriter(out)  # as torch.save writes its archives
        for name, record in (
            ("data.pkl", data),
            (".format_version", b"1"),
            (".storage_alignment", b"64"),
            ("byteorder", b"little"),
            *((f"data/{key}", payload) for key, payload in self.storages.items()),
        ):
            archive.write_record(name, record, len(record))
        archive.write_end_of_file()
        return out.getvalue()


def _stored(archive: zipfile.ZipFile, info: zipfile.ZipInfo, where: str) -> bytes:
    """A record's bytes, CRC checked; torch.save stores them as they are (a compressed record
    could inflate to any size, and an encrypted one asks for a password)."""
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
        raise CheckpointError(f"{where}: record {info.filename!r} is compressed or encrypted; torch.save does neither")
    return archive.read(info)


def read_graph(data: bytes, where: str) -> Graph:
    """The object of the ``torch.save`` archive ``data`` (``where`` names the file), recorded."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        records = {info.filename: info for info in archive.infolist()}
        pickles = [name for name in records if name.endswith("/data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise CheckpointError(f"{where}: not a torch.save archive (no single */data.pkl)")
        prefix = pickles[0].removesuffix("data.pkl")
        order = records.get(prefix + "byteorder")
        if order is not None and _stored(archive, order, where) != b"little":
            raise CheckpointError(f"{where}: big-endian torch.save archives are not supported")
        payload = _stored(archive, records[pickles[0]], where)
        prescan(payload, where)
        reader = _Reader(payload)
        root = reader.load()
        storages = {
            key: _stored(archive, records[f"{prefix}data/{key}"], where) for key in dict.fromkeys(reader.storage_keys)
        }
    except CkptavgError:
        raise
    except KeyError as exc:
        raise CheckpointError(f"{where}: a tensor's storage record {exc} is missing") from None
    except Exception as exc:  # noqa: BLE001 - a malformed archive or pickle is the file's fault
        raise CheckpointError(f"{where}: corrupt torch.save archive ({type(exc).__name__}: {exc})") from None
    return Graph(root, storages, where)
