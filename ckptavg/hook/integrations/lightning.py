"""PyTorch Lightning callback.

    from ckptavg import MergeHookConfig
    from ckptavg.hook.integrations.lightning import MergeCallback

    trainer = lightning.Trainer(..., callbacks=[MergeCallback(MergeHookConfig(save_folder="merges",
                                                                             merge_steps=[5000]))])

Steps are Lightning's ``global_step`` (optimizer steps, so gradient accumulation is counted
right); the hook's state rides in Lightning's checkpoint through the callback state.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from . import require

require("lightning", "lightning")

from lightning.pytorch import Callback  # noqa: E402

from ..hook import MergeHook, MergeHookConfig  # noqa: E402


class MergeCallback(Callback):
    """Runs a :class:`~ckptavg.MergeHook` inside ``lightning.Trainer``."""

    def __init__(self, config: MergeHookConfig) -> None:
        self.config = config
        self.hook = MergeHook(config)
        self._last_step: int | None = None

    @property
    def state_key(self) -> str:
        return f"ckptavg.MergeCallback[{self.config.save_folder}]"

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        max_steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if max_steps is None and math.isfinite(trainer.estimated_stepping_batches):
            max_steps = int(trainer.estimated_stepping_batches)
        self.hook.pre_train(trainer.global_step, max_steps)
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Called per batch; with gradient accumulation only every few batches step the optimizer.
        if trainer.global_step != self._last_step:
            self._last_step = trainer.global_step
            self.hook.post_train_batch(trainer.global_step, pl_module)

    def state_dict(self) -> dict[str, Any]:
        return self.hook.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.hook.load_state_dict(state_dict)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.hook.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Training failed already: finish what is queued, but let that failure be the one reported.
        with contextlib.suppress(Exception):
            self.hook.close()
