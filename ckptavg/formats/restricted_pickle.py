"""Unpickling with an allow-list: checkpoints describe themselves in pickles, and a pickle
can import and call anything. Only the names a format needs are resolved, each to an object
chosen here; any other global refuses the whole file before anything runs."""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CkptavgError


class RefusedGlobal(CkptavgError):
    """The pickle names a global outside the allow-list (code it would import and run)."""


class RestrictedUnpickler(pickle.Unpickler):
    def __init__(
        self,
        data: bytes,
        allowed: Mapping[tuple[str, str], Any],
        persistent_load: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._allowed = allowed
        self._persistent = persistent_load

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise RefusedGlobal(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise pickle.UnpicklingError("persistent ids are not allowed here")
        return self._persistent(pid)


def restricted_loads(
    data: bytes,
    allowed: Mapping[tuple[str, str], Any],
    where: str,
    persistent_load: Callable[[Any], Any] | None = None,
) -> Any:
    """Unpickle ``data``; a refused global or a malformed pickle is a one-line error on ``where``."""
    try:
        return RestrictedUnpickler(data, allowed, persistent_load).load()
    except RefusedGlobal as exc:
        raise CkptavgError(
            f"{where}: refusing to unpickle it: it would import {exc} (arbitrary code, not tensor data)"
        ) from None
    except CkptavgError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is the file's fault
        raise CkptavgError(f"{where}: corrupt pickle ({type(exc).__name__}: {exc})") from None
