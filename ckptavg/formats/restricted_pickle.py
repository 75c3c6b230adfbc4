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
:class:`Skipped` stand-ins, which import and run nothing, and then refuse the file only if one
sits in the part it reads (:func:`find_skipped`).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from ..errors import CheckpointError, CkptavgError
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


class Skipped:
    """What a global outside the allow-list makes when the reader lets the pickle keep what it
    cannot read: the class and its objects take any arguments, items and state (every opcode
    that builds an object: REDUCE, NEWOBJ, BUILD, APPEND(S), SETITEM(S), ADDITEMS) and keep
    none of them, so nothing of the global is imported or run. A subclass per global names it,
    for the refusal should one sit where the reader needs what it stood for."""

    __slots__ = ()
    global_name: ClassVar[str] = ""

    def __new__(cls, *_args: Any, **_kwargs: Any) -> Skipped:
        return object.__new__(cls)

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def __setstate__(self, _state: Any) -> None:
        pass

    def __setitem__(self, _key: Any, _value: Any) -> None:
        pass

    def append(self, _item: Any) -> None:
        pass

    def extend(self, _items: Any) -> None:
        pass

    def add(self, _item: Any) -> None:
        pass

    def __repr__(self) -> str:
        return f"<{self.global_name} object, not read>"


def skipped_global(value: Any) -> str | None:
    """The global that ``value`` stands for if it is a :class:`Skipped` object or class, else None."""
    if isinstance(value, Skipped):
        return value.global_name
    target = getattr(value, "target", None) if isinstance(value, _Sealed) else None
    return target.global_name if isinstance(target, type) and issubclass(target, Skipped) else None


def find_skipped(value: Any, budget: int, where: str) -> tuple[str, str] | None:
    """(the dotted path, the global) of the first :class:`Skipped` object or class in ``value``
    or in the dicts (keys and values), lists, tuples and sets it holds; None when there is none.
    ``budget`` bounds the entries visited: a pickle can reference one container from many
    places, or from inside itself."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, dict):
            children = [(str(key), child) for key, child in item.items()] + [("", key) for key in item]
        elif isinstance(item, list | tuple | set | frozenset):
            children = [(str(index), child) for index, child in enumerate(item)]
        else:
            name = skipped_global(item)
            if name is not None:
                return path, name
            continue
        budget -= len(children)
        if budget < 0:
            raise CheckpointError(f"{where}: its objects nest or repeat without end")
        stack.extend((".".join(filter(None, (path, key))), child) for key, child in reversed(children))
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
            try:
                value = self._allowed[key]
            except KeyError:
                if not self._skip_unknown:
                    raise RefusedGlobal(f"{module}.{name}") from None
                value = type("Skipped", (Skipped,), {"__slots__": (), "global_name": _one_line(f"{module}.{name}")})
            self._stand_ins[key] = _stand_in(value) if callable(value) else value
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
    become :class:`Skipped` stand-ins instead: the caller checks the part it reads with
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
