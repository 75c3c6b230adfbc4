"""ckptavg: average LLM checkpoints over training-step windows, streaming and exactly.

The command line (``ckptavg plan|merge|ls``) is a thin shell over these functions.
"""

__version__ = "0.1.0"

from .discovery import Checkpoint, find_checkpoints, select_checkpoints  # noqa: E402
from .errors import CkptavgError  # noqa: E402
from .merge import MergeResult, average, merge, select  # noqa: E402
from .plan import (  # noqa: E402
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

__all__ = [
    "Checkpoint",
    "CkptavgError",
    "MergePlan",
    "MergeResult",
    "MergeWindow",
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
