"""Tiny models and data for the real trainers (Hugging Face ``Trainer``, Lightning, OLMo-core, torchtitan),
shared by the adapter tests (tests/hook/test_integrations.py) and the docs' examples of them.

Each batch depends on its step alone, so a run resumed from a checkpoint retraces an
uninterrupted one. ``record(step, model)``, where given, sees the weights after every step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from training import batch, make_model

Record = Callable[[int, nn.Module], None]


def hf_model_and_data() -> tuple[Any, list[dict[str, torch.Tensor]]]:
    """A one-layer Llama in bf16 and 64 sequences of 12 tokens for ``transformers.Trainer``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (64, 12), generator=generator)]
    return model, data


def lightning_module_and_data(record: Record | None = None) -> tuple[Any, torch.utils.data.DataLoader]:
    """A ``LightningModule`` over :func:`training.make_model` and a loader of 64 steps."""
    import lightning

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, data: Any, index: int) -> torch.Tensor:
            inputs, targets = batch(self.global_step + 1)
            return nn.functional.mse_loss(self.net(inputs.to(torch.bfloat16)).float(), targets)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=0.02)

        def on_train_batch_end(self, outputs: Any, data: Any, index: int) -> None:
            if record is not None:
                record(self.global_step, self)

    return Module(), torch.utils.data.DataLoader(torch.zeros(64, 1), batch_size=1)


def olmo_core_trainer_config_and_parts(
    root: str | Path, max_steps: int = 12, record: Record | None = None
) -> tuple[Any, Any, Any]:
    """An OLMo-core ``TrainerConfig`` (checkpoints every 4 steps under ``root/checkpoints``), a
    train module of a tiny bf16 model with AdamW, and its data loader."""
    from olmo_core.data.data_loader import DataLoaderBase
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import Callback, CheckpointerCallback
    from olmo_core.train.train_module import BasicTrainModule

    root = Path(root)

    class StepBatches(DataLoaderBase):
        """Batch i of the epoch depends on i alone."""

        def __init__(self, work_dir: Path) -> None:
            super().__init__(work_dir=work_dir, global_batch_size=48)

        @property
        def total_batches(self) -> int:
            return 64

        def state_dict(self) -> dict[str, Any]:
            return {"batches_processed": self.batches_processed, "epoch": self._epoch}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.batches_processed, self._epoch = state_dict["batches_processed"], state_dict["epoch"]

        def reshuffle(self, epoch: int | None = None, **kwargs: Any) -> None:
            self._epoch = epoch or 1

        def _iter_batches(self) -> Any:
            for index in range(self.batches_processed, self.total_batches):
                yield {"input_ids": torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(index))}

        def get_mock_batch(self) -> dict[str, torch.Tensor]:
            return {"input_ids": torch.zeros(4, 12, dtype=torch.long)}

        def global_num_tokens_in_batch(self, batch: Any) -> int:
            return 48

    class TrainModule(BasicTrainModule):
        def global_num_flops_in_batch(self, batch: Any) -> None:
            return None

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(input_ids))

    class Record(Callback):
        def post_train_batch(self) -> None:
            assert record is not None
            record(self.step, self.trainer.train_module.model)

    model = Tiny().to(torch.bfloat16)
    module = TrainModule(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank_microbatch_size=48)
    config = TrainerConfig(
        save_folder=str(root / "checkpoints"),
        save_overwrite=True,
        max_duration=Duration.steps(max_steps),
        device="cpu",
        metrics_collect_interval=1000,
    )
    config = config.with_callback("checkpointer", CheckpointerCallback(save_interval=4, ephemeral_save_interval=None))
    if record is not None:
        config = config.with_callback("record", Record())
    return config, module, StepBatches(root / "work")


def torchtitan_in_this_process(dump_folder: str | Path, steps: int = 12) -> Callable[[], Any]:
    """A config_registry function of torchtitan's: the ``Trainer.Config`` of a 2-layer llama3
    (tests/titan_trainer.py, checkpoints every 2 steps in ``dump_folder/checkpoint``), made to run
    in this process on CPU as a process group of one; ``titan_trainer.leave()`` ends that group."""
    import titan_trainer

    titan_trainer.in_this_process()
    return lambda: titan_trainer.trainer_config(str(dump_folder), steps, "disabled")
