"""Merging checkpoints: choosing them (:mod:`.discovery`), the key filter (:mod:`.keys`), the
streaming average (:mod:`.engine`), one merge from sources to published output (:mod:`.job`,
:mod:`.publish`, :mod:`.journal`), several processes (:mod:`.distributed`), checking an output
(:mod:`.verify`); the library entry points are in :mod:`.api`, their options in :mod:`.options`.

Nothing is imported here: ``import ckptavg.merging.keys`` must not pull in the engine.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    """``Candidate`` (one average of a one-pass sweep, :meth:`.engine.StreamingAverage.run_many`),
    imported on first use so that this package stays free of torch."""
    if name == "Candidate":
        from .engine import Candidate  # here: the engine needs torch, this package must not

        return Candidate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Candidate"]
