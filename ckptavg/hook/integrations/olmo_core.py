"""OLMo-core trainer callback: ``ModelMergeCallback``'s job, without the stall or the skipped merges.

    from ckptavg import MergeHookConfig
    from ckptavg.hook.integrations.olmo_core import MergeCallback

    trainer_config = trainer_config.with_callback(
        "ckptavg", MergeCallback(config=MergeHookConfig(save_folder=save_folder, merge_steps=[22500], window=100))
    )

``with_callback`` returns a new config: a call whose result is dropped adds nothing, and the
callback then says so (a ``RuntimeWarning`` once no copy of it can run any more, at the end of
the process at the latest), rather than letting a run end without its merges unnoticed.

Steps are the trainer's ``global_step``; the hook's state rides in the trainer's own checkpoint
(``train/rank{r}.pt``) through the callback state; ``max_steps`` comes from the trainer for
``merge_interval``. OLMo-core's ``ModelMergeCallback`` blocks ephemeral checkpoints inside
merge windows to make skipped merges rarer; this callback does not need to.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar

from . import require

require("olmo_core", "ai2-olmo-core")

from olmo_core.train.callbacks import Callback  # noqa: E402

from ..hook import MergeHook, MergeHookConfig  # noqa: E402


def _report_if_never_ran(ran: list[bool], save_folder: str) -> None:
    if not ran[0]:
        warnings.warn(
            f"ckptavg: a MergeCallback (save_folder {save_folder}) was made but no trainer ever ran it, so it "
            "merged nothing: TrainerConfig.with_callback returns a new config, which must be kept "
            "(trainer_config = trainer_config.with_callback(...))",
            RuntimeWarning,
            stacklevel=1,
        )


class _Wiring:
    """Whether a trainer ever ran a :class:`MergeCallback` or one of the copies OLMo-core's configs
    make of it (``deepcopy`` shares this object): reported once none can run any more."""

    def __init__(self, save_folder: str) -> None:
        self.ran = [False]
        weakref.finalize(self, _report_if_never_ran, self.ran, save_folder)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Wiring:
        return self


@dataclass
class MergeCallback(Callback):
    """Runs a :class:`~ckptavg.MergeHook` inside ``olmo_core.train.Trainer``."""

    # Before the CheckpointerCallback (priority 1), so that a checkpoint of a step comes after
    # the step's capture, as with ModelMergeCallback.
    priority: ClassVar[int] = 2

    config: MergeHookConfig | None = None
    _hook: MergeHook | None = field(default=None, repr=False)
    _failed: bool = field(default=False, repr=False)
    _wiring: _Wiring | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        folder = "?" if self.config is None else str(self.config.save_folder)
        self._wiring = self._wiring or _Wiring(folder)

    @property
    def hook(self) -> MergeHook:
        if self._hook is None:
            if self.config is None:
                raise ValueError("MergeCallback needs config=MergeHookConfig(...)")
            self._hook = MergeHook(self.config)
        return self._hook

    def pre_train(self) -> None:
        if self._wiring is not None:
            self._wiring.ran[0] = True
        self.hook.pre_train(self.step, self.trainer.max_steps)

    def post_train_batch(self) -> None:
        # Every OLMo-core train module of a model has ``model`` (OLMo-core's own callbacks read it
        # so); the TrainModule base class does not declare it.
        self.hook.post_train_batch(self.step, self.trainer.train_module.model)  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        return self.hook.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.hook.load_state_dict(state_dict)

    def on_error(self, exc: BaseException) -> None:
        self._failed = True

    def close(self) -> None:
        if self._hook is None:
            return
        if self._failed:  # training failed already: that error is the one to report
            with contextlib.suppress(Exception):
                self._hook.close()
            return
        self._hook.close()
