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
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from typing import Any

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


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the allowed globals: callables as sealed stand-ins, other values (dtypes,
    strings: immutable) as they are."""

    def __init__(
        self,
        data: bytes,
        allowed: Mapping[tuple[str, str], Any],
        persistent_load: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._allowed = allowed
        self._persistent = persistent_load
        self._stand_ins: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key not in self._stand_ins:
            try:
                value = self._allowed[key]
            except KeyError:
                raise RefusedGlobal(f"{module}.{name}") from None
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
) -> Any:
    """Unpickle ``data`` (after :func:`~.pickle_scan.prescan`); a refused global or a malformed
    pickle is a one-line error on ``where``."""
    prescan(data, where)
    try:
        return RestrictedUnpickler(data, allowed, persistent_load).load()
    except RefusedGlobal as exc:
        raise CheckpointError(
            f"{where}: refusing to unpickle it: it would import {_one_line(str(exc))} (arbitrary code, not tensor data)"
        ) from None
    except CkptavgError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is the file's fault
        raise CheckpointError(f"{where}: corrupt pickle ({type(exc).__name__}: {_one_line(str(exc))})") from None
