"""ckptavg: average LLM checkpoints over training-step windows, streaming and exactly.

The command line (``ckptavg plan|merge|ls``) is a thin shell over these functions. Names
that need torch are imported on first use, so ``ckptavg plan`` in a SLURM script starts fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import CkptavgError
from .plan import (
    MergePlan,
    MergeWindow,
    compute_interval_merge_steps,
    compute_merge_steps_from_decay_schedule,
    compute_merge_window_starts,
    plan_from_interval,
    plan_from_schedule,
    validate_merge_steps,
    window_start,
)

__version__ = "0.1.0"

_LAZY = {
    "Checkpoint": "discovery",
    "KeySelection": "selection",
    "find_checkpoints": "discovery",
    "select_checkpoints": "discovery",
    "MergeHook": "hook",
    "MergeHookConfig": "hook",
    "MergeResult": "merging",
    "Weighting": "weighting",
    "average": "merging",
    "merge": "merging",
    "select": "merging",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'ckptavg' has no attribute {name!r}")


__all__ = [
    "Checkpoint",
    "CkptavgError",
    "KeySelection",
    "MergeHook",
    "MergeHookConfig",
    "MergePlan",
    "MergeResult",
    "MergeWindow",
    "Weighting",
    "average",
    "compute_interval_merge_steps",
    "compute_merge_steps_from_decay_schedule",
    "compute_merge_window_starts",
    "find_checkpoints",
    "merge",
    "plan_from_interval",
    "plan_from_schedule",
    "select",
    "select_checkpoints",
    "validate_merge_steps",
    "window_start",
]
