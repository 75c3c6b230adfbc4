"""torchtitan Trainer with merged checkpoints: ``MergingTrainer``, a subclass of ``torchtitan.trainer.Trainer``.

    from ckptavg import MergeHookConfig
    from ckptavg.hook.integrations.torchtitan import MergingTrainer

    def llama3_8b_merged() -> MergingTrainer.Config:  # a function of your config_registry
        config = llama3_8b()  # torchtitan's Trainer.Config
        return MergingTrainer.Config.of(config, MergeHookConfig(
            save_folder="merges", merge_steps=[22500], window=100, output_format="dcp"
        ))

A subclass, as torchtitan's own trainers extend it (``FluxTrainer``, ``FaultTolerantTrainer``):
torchtitan 0.3 has no training-loop callback (an optimizer step hook sees no step number), and its
``train()`` loop calls ``train_step()`` (whose optimizer step ends it) and then
``checkpointer.save(step)``; overriding ``train_step`` puts each capture after the optimizer step
and before the checkpoint of that step. With FSDP2 or TP (DTensor parameters) each process
captures its own shards. The hook's state is registered in the
``CheckpointManager``'s states as ``ckptavg``, so torchtitan's own DCP checkpoints (sync or async)
save it and its resume restores it. A relative ``save_folder`` is taken from ``dump_folder``, so
``merges/`` lies beside torchtitan's ``checkpoint/``; with ``output_format="dcp"`` the merges are
DCP folders that torchtitan loads as ``--checkpoint.initial_load_path``.

A run whose checkpoints were saved without the hook resumes with the hook after
``--checkpoint.exclude_from_loading ckptavg``. Pipeline parallelism is refused (each process
holds other layers, which the hook would take for replicas).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, fields, replace
from typing import Annotated, Any

from . import require

require("torchtitan.trainer", "torchtitan")

import tyro  # noqa: E402  (torchtitan's config parser)
from torchtitan.trainer import Trainer  # noqa: E402

from ...errors import CheckpointError, CkptavgError, ConfigError  # noqa: E402
from ...formats.base import shown_value  # noqa: E402
from ..hook import MergeHook, MergeHookConfig  # noqa: E402

STATE_KEY = "ckptavg"
"""The hook state's key in torchtitan's checkpoints (and in ``--checkpoint.exclude_from_loading``)."""


class HookState:
    """The hook as one of the ``CheckpointManager``'s ``Stateful`` states: a JSON string, which DCP
    saves as one object and gives back whatever the hook held when the load began. ``folder``
    (torchtitan's checkpoint folder) names where a state that cannot be read came from."""

    def __init__(self, hook: MergeHook, folder: str) -> None:
        self.hook = hook
        self.folder = folder
        self.started = False  # before the first step a save (a seed checkpoint) has no state to hold

    def state_dict(self) -> dict[str, Any]:
        return {"json": json.dumps(self.hook.state_dict()) if self.started else ""}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("json")
        if saved == "":
            return  # saved before the first step
        try:
            state = json.loads(saved) if isinstance(saved, str) else None
        except json.JSONDecodeError:
            state = None
        if not isinstance(state, dict):
            raise CheckpointError(
                f"{self.folder}: the state {STATE_KEY!r} of a torchtitan checkpoint there is not the JSON object "
                f"of a MergeHook state ({shown_value(saved)})"
            )
        try:
            self.hook.load_state_dict(state)
        except CkptavgError as exc:  # the checkpoint it came from, named
            raise type(exc)(f"{self.folder}: the state {STATE_KEY!r} of a torchtitan checkpoint there: {exc}") from None


class MergingTrainer(Trainer):
    """A torchtitan ``Trainer`` that runs a :class:`~ckptavg.MergeHook` after each optimizer step."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        # Set in Python (a config_registry function), as model_spec is: a MergeHookConfig holds
        # callables and dtypes that no command line spells.
        merge: Annotated[MergeHookConfig | None, tyro.conf.Suppress] = None

        @classmethod
        def of(cls, config: Trainer.Config, merge: MergeHookConfig) -> MergingTrainer.Config:
            """``config`` (a ``Trainer.Config``, e.g. from torchtitan's config_registry) with ``merge``."""
            given = {f.name: getattr(config, f.name) for f in fields(config) if f.name != "merge"}
            return cls(**given, merge=merge)

    def __init__(self, config: Config) -> None:
        if config.merge is None:
            raise ConfigError("MergingTrainer.Config needs merge=MergeHookConfig(...)")
        super().__init__(config)
        if len(self.model_parts) != 1:
            raise ConfigError(
                "the ckptavg hook does not run with pipeline parallelism: each process holds other layers"
            )
        self.merge_hook = MergeHook(_in_dump_folder(config.merge, config.dump_folder))
        self._hook_state = HookState(self.merge_hook, getattr(self.checkpointer, "folder", ""))
        if self.checkpointer.enable:  # its states (and folder) exist only then
            self.checkpointer.states[STATE_KEY] = self._hook_state

    def train_step(self, data_iterator: Any) -> None:
        if not self._hook_state.started:  # after checkpointer.load(): self.step is the resumed step + 1
            self.merge_hook.pre_train(self.step - 1, self.config.training.steps)
        super().train_step(data_iterator)
        self.merge_hook.post_train_batch(self.step, self.model_parts[0])
        self._hook_state.started = True

    def train(self) -> None:
        super().train()
        self.merge_hook.close()  # waits for the last merge; raises a background failure

    def close(self) -> None:
        # After a failed train() too (torchtitan's main closes then): that failure is the one to report.
        with contextlib.suppress(Exception):
            self.merge_hook.close()
        super().close()


def _in_dump_folder(config: MergeHookConfig, dump_folder: str) -> MergeHookConfig:
    """The config with a relative local ``save_folder`` taken under torchtitan's ``dump_folder``."""
    if "://" in config.save_folder or os.path.isabs(config.save_folder):
        return config
    return replace(config, save_folder=os.path.join(dump_folder, config.save_folder))
