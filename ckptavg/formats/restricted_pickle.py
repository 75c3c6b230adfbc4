"""Unpickling with an allow-list: checkpoints describe themselves in pickles, and a pickle
can import and call anything. Only the names a format needs are resolved, each to an object
chosen here; any other global refuses the whole file before anything runs.

What an allow-list hands out, and what its callables return, is either immutable (sealed
stand-ins for callables, dtypes, strings, frozen records without ``__dict__``) or an object the
pickle makes afresh, which the reader checks only after the whole load: a BUILD opcode sets the
attributes of any object with a ``__dict__`` that the pickle holds, one already checked or one
the whole process shares alike.

Before the unpickler sees a byte, :func:`~.pickle_scan.prescan` bounds what the pickle claims
and how deeply it nests (CPython's unpickler believes the first and crashes on the second).

A reader that needs only part of a pickle (a Lightning checkpoint's ``state_dict``, beside
hyper-parameters and callback state of any class) may let the other globals through as
:class:`Skipped` classes, which import and run nothing, and then refuse the file only if one
sits in the part it reads (:func:`find_skipped`).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CheckpointError, CkptavgError
from .base import shown_value
from .pickle_scan import prescan


class RefusedGlobal(CheckpointError):
    """The pickle names a global outside the allow-list (code it would import and run)."""


class _Sealed(type):
    """The type of the stand-ins that ``find_class`` returns for allowed classes and functions.

    A pickle's BUILD opcode sets attributes on whatever object precedes it, and that may be the
    global itself rather than an object made from it: handed out as is, an allowed class or
    function (torch's DCP dataclasses, ``_get_layout`` and its cache) would take attributes from
    the file, for the whole process. A stand-in calls through to its target (REDUCE), makes the
    target's objects (NEWOBJ calls ``__new__``), and refuses every attribute.
    """

    target: Any  # what the stand-in stands for, set once when it is made

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls.target(*args, **kwargs)

    def __setattr__(cls, name: str, value: Any) -> None:
        raise pickle.UnpicklingError(f"the pickle sets attribute {name!r} of the global {cls.__name__}")

    def __delattr__(cls, name: str) -> None:
        raise pickle.UnpicklingError(f"the pickle deletes attribute {name!r} of the global {cls.__name__}")


def _stand_in(target: Any) -> _Sealed:
    def new(_cls: Any, *args: Any, **kwargs: Any) -> Any:
        return target.__new__(target, *args, **kwargs)

    return _Sealed(getattr(target, "__name__", "global"), (), {"__slots__": (), "target": target, "__new__": new})


class Skipped(type):
    """What a global outside the allow-list stands for when the reader lets the pickle keep what
    it cannot read, and everything made from it: a class per global (it names the global, for the
    refusal should one sit where the reader needs what it stood for), whose every use gives back
    the class itself and keeps nothing. Calling it (REDUCE), making an object of it (NEWOBJ, OBJ,
    INST), setting its state (BUILD) and adding to it (APPEND(S), SETITEM(S), ADDITEMS) all work,
    so nothing of the global is imported or run and no opcode fails on what it made: a pickle
    calls what a call returned (``zoneinfo.ZoneInfo`` pickles as ``getattr(ZoneInfo,
    "_unpickle")(key, 1)``) and makes objects of it (a nested class, ``getattr(Outer, "Inner")``,
    then NEWOBJ, which needs a class)."""

    global_name: str

    def __call__(cls, *_args: Any, **_kwargs: Any) -> Skipped:
        return cls

    def __setstate__(cls, _state: Any) -> None:
        pass

    def __setitem__(cls, _key: Any, _value: Any) -> None:
        pass

    def append(cls, _item: Any) -> None:
        pass

    def extend(cls, _items: Any) -> None:
        pass

    def add(cls, _item: Any) -> None:
        pass

    def __repr__(cls) -> str:
        return f"<{cls.global_name} object, not read>"


def _itself(cls: Skipped, *_args: Any, **_kwargs: Any) -> Skipped:
    """``__new__`` of a :class:`Skipped` class (NEWOBJ, OBJ): the class itself, never an object."""
    return cls


def _skipped(global_name: str) -> Skipped:
    return Skipped("Skipped", (), {"__slots__": (), "__new__": _itself, "global_name": global_name})


def skipped_global(value: Any) -> str | None:
    """The global that ``value`` stands for if it is a :class:`Skipped` class, else None."""
    return value.global_name if isinstance(value, Skipped) else None


_PATH_PART_CHARS = 100  # of each key of a path a message shows


def _path_part(key: Any) -> str:
    """A key or index of a path, for a message: at most about ``_PATH_PART_CHARS`` characters,
    whatever it is (an integer past Python's digit limit, a tuple nested past its recursion limit)."""
    text = key if isinstance(key, str) else shown_value(key, _PATH_PART_CHARS)
    return text if len(text) <= _PATH_PART_CHARS else text[:_PATH_PART_CHARS] + "..."


def _shown_path(path: Any) -> str:
    """The dotted path of a value found by :func:`find_skipped`, for a message (one line)."""
    parts = []
    while path is not None:
        path, key = path
        parts.append(_path_part(key))
    return _one_line(".".join(reversed(parts)))


def find_skipped(value: Any, budget: int, where: str) -> tuple[str, str] | None:
    """(the dotted path, the global) of the first :class:`Skipped` class in ``value`` or in the
    dicts (keys and values), lists, tuples and sets it holds; None when there is none.
    ``budget`` bounds the entries visited: a pickle can reference one container from many
    places, or from inside itself. Paths are kept as (parent, key) links and shown only for what
    is found: joined for every entry, one long key above many would take terabytes."""
    stack: list[tuple[Any, Any]] = [(None, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, dict):
            # A key lies at its dict's own path.
            children = [((path, key), child) for key, child in item.items()] + [(path, key) for key in item]
        elif isinstance(item, list | tuple | set | frozenset):
            children = [((path, index), child) for index, child in enumerate(item)]
        else:
            name = skipped_global(item)
            if name is not None:
                return _shown_path(path), name
            continue
        budget -= len(children)
        if budget < 0:
            raise CheckpointError(f"{where}: its objects nest or repeat without end")
        stack.extend(reversed(children))
    return None


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the allowed globals: callables as sealed stand-ins, other values (dtypes,
    strings: immutable) as they are; any other global is refused, or with ``skip_unknown``
    stands as a :class:`Skipped` class."""

    def __init__(
        self,
        data: bytes,
        allowed: Mapping[tuple[str, str], Any],
        persistent_load: Callable[[Any], Any] | None = None,
        skip_unknown: bool = False,
    ) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._allowed = allowed
        self._persistent = persistent_load
        self._skip_unknown = skip_unknown
        self._stand_ins: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key not in self._stand_ins:
            if key in self._allowed:
                value = self._allowed[key]
                self._stand_ins[key] = _stand_in(value) if callable(value) else value
            elif self._skip_unknown:
                self._stand_ins[key] = _skipped(_one_line(f"{module}.{name}"))  # inert already: no stand-in
            else:
                raise RefusedGlobal(f"{module}.{name}")
        return self._stand_ins[key]

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise pickle.UnpicklingError("persistent ids are not allowed here")
        return self._persistent(pid)


def _one_line(text: str, limit: int = 200) -> str:
    """``text`` from a pickle, fit for a one-line message: control characters (line breaks among
    them) escaped, and cut to ``limit`` characters (a global's name runs to the next newline,
    however far that is)."""
    if not text.isprintable():
        text = repr(text)[1:-1]
    return text if len(text) <= limit else text[:limit] + "..."


def restricted_loads(
    data: bytes,
    allowed: Mapping[tuple[str, str], Any],
    where: str,
    persistent_load: Callable[[Any], Any] | None = None,
    skip_unknown: bool = False,
) -> Any:
    """Unpickle ``data`` (after :func:`~.pickle_scan.prescan`); a refused global or a malformed
    pickle is a one-line error on ``where``. With ``skip_unknown``, globals outside ``allowed``
    become :class:`Skipped` classes instead: the caller checks the part it reads with
    :func:`find_skipped`."""
    prescan(data, where)
    try:
        return RestrictedUnpickler(data, allowed, persistent_load, skip_unknown).load()
    except RefusedGlobal as exc:
        raise CheckpointError(
            f"{where}: refusing to unpickle it: it would import {_one_line(str(exc))} (arbitrary code, not tensor data)"
        ) from None
    except CkptavgError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is the file's fault
        raise CheckpointError(f"{where}: corrupt pickle ({type(exc).__name__}: {_one_line(str(exc))})") from None
