"""ckptavg: average LLM checkpoints over training-step windows, streaming and exactly.

The command line (``ckptavg plan|merge|ls``) is a thin shell over these functions. Names
that need torch are imported on first use, so ``ckptavg plan`` in a SLURM script starts fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import CheckpointError, CkptavgError, ConfigError, OutputError
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
from .version import __version__ as __version__

_LAZY = {
    "Checkpoint": "merging.discovery",
    "KeyFilter": "merging.keys",
    "find_checkpoints": "merging.discovery",
    "select_checkpoints": "merging.discovery",
    "MergeHook": "hook.hook",
    "MergeHookConfig": "hook.hook",
    "MergeOptions": "merging.options",
    "MergeResult": "merging.api",
    "Weighting": "weighting",
    "average": "merging.api",
    "merge": "merging.api",
    "select": "merging.api",
    "select_sweep": "merging.api",
    "sweep": "merging.api",
    "SweepResult": "merging.api",
    "verify": "merging.verify",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'ckptavg' has no attribute {name!r}")


__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CkptavgError",
    "ConfigError",
    "KeyFilter",
    "MergeHook",
    "MergeHookConfig",
    "MergeOptions",
    "MergePlan",
    "MergeResult",
    "MergeWindow",
    "OutputError",
    "SweepResult",
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
    "select_sweep",
    "sweep",
    "validate_merge_steps",
    "verify",
    "window_start",
]
