"""Hugging Face ``transformers`` Trainer callback.

    from ckptavg import MergeHookConfig
    from ckptavg.hook.integrations.transformers import MergeCallback

    trainer = Trainer(..., callbacks=[MergeCallback(MergeHookConfig(save_folder="out/merges",
                                                                    merge_steps=[5000], window=100))])

The hook's state goes into each checkpoint folder as ``ckptavg-hook-state.json`` (so the
Trainer's own rotation deletes it with the checkpoint) and comes back on
``trainer.train(resume_from_checkpoint=...)``. The model's ``config.json`` is written into every
merged output, so ``from_pretrained`` loads it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from typing import Any

from . import require

require("transformers", "transformers")

from transformers import TrainerCallback  # noqa: E402

from ...errors import CkptavgError  # noqa: E402
from ...formats.base import HOOK_STATE_FILE  # noqa: E402
from ...io.atomic import atomic_write  # noqa: E402
from ...io.files import read_json  # noqa: E402
from ...io.fs import resolve  # noqa: E402
from ..hook import MergeHook, MergeHookConfig  # noqa: E402

STATE_FILE = HOOK_STATE_FILE  # where in checkpoint-N/ the hook's state goes
log = logging.getLogger("ckptavg")


class MergeCallback(TrainerCallback):
    """Runs a :class:`~ckptavg.MergeHook` inside ``transformers.Trainer``."""

    def __init__(self, config: MergeHookConfig) -> None:
        self.config = config
        self.hook: MergeHook | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        config = self.config
        if not config.extra_files and getattr(model, "config", None) is not None:
            config = replace(config, extra_files={"config.json": model.config.to_json_string().encode()})
        self.hook = MergeHook(config)
        if state.global_step > 0:
            found = self._find_state(args, state.global_step)
            if found is not None:
                path, saved = found
                try:
                    self.hook.load_state_dict(saved)
                except CkptavgError as exc:  # the file it came from, named
                    raise type(exc)(f"{path}: {exc}") from None
        self.hook.pre_train(state.global_step, state.max_steps or None)

    @staticmethod
    def _find_state(args: Any, step: int) -> tuple[str, dict] | None:
        """(path, content) of the hook state saved with the checkpoint of ``step``."""
        candidates = [os.path.join(args.output_dir, f"checkpoint-{step}")]
        if isinstance(args.resume_from_checkpoint, str):
            candidates.insert(0, args.resume_from_checkpoint)
        for folder in candidates:
            path = os.path.join(folder, STATE_FILE)
            if os.path.isfile(path):
                saved = read_json(*resolve(path), "a hook state file")
                if isinstance(saved, dict) and saved.get("step") == step:
                    return path, saved
        log.warning("ckptavg: no %s for step %d in %s", STATE_FILE, step, " or ".join(candidates))
        return None

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        assert self.hook is not None
        self.hook.post_train_batch(state.global_step, model)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.hook is not None
        saved = self.hook.state_dict()  # every process: each writes its own running sums
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if state.is_world_process_zero and os.path.isdir(folder):
            # Complete or absent, and durable like the trainer's own files: a resume trusts it.
            fs, path = resolve(os.path.join(folder, STATE_FILE))
            with atomic_write(fs, path, fsync=self.config.fsync) as handle:
                handle.write(json.dumps(saved).encode())

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.hook is not None:
            self.hook.close()
