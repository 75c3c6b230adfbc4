"""Where a bench script leaves its key figures for ``targets.py``: one JSON file per script.

``make bench`` sets ``CKPTAVG_BENCH_RESULTS`` to a folder; a script that measures an issue's
target calls ``record(<its name>, <figures>)`` once it has measured, which writes
``<folder>/<name>.json`` (``bench_merge.run_and_report`` records the whole report of each script
it ends: bench_merge's, and bench_formats's, which no target reads). Run alone (the variable
unset), a script writes nothing. Only figures measured in this run are written, raw (every
repetition), so that ``targets.py`` derives each median and range itself and a script that
failed before recording leaves no file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ENV = "CKPTAVG_BENCH_RESULTS"


def results_folder() -> Path | None:
    folder = os.environ.get(ENV)
    return Path(folder) if folder else None


def record(name: str, figures: dict[str, Any]) -> None:
    """Write ``figures`` as ``<results folder>/<name>.json``; nothing when no folder is set."""
    folder = results_folder()
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(figures, indent=1) + "\n")
