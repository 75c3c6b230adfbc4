"""The training hook: merged checkpoints while a run trains (:mod:`.hook`), the weights taken
off the model without stalling it (:mod:`.capture`), where a window's steps go
(:mod:`.stores`), the hook's worker threads (:mod:`.workers`), and adapters for training
frameworks (:mod:`.integrations`)."""

from __future__ import annotations

from .hook import MergeHook, MergeHookConfig

__all__ = ["MergeHook", "MergeHookConfig"]
