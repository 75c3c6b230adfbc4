"""Checkpoints saved by PyTorch Lightning itself, for tests/formats/test_lightning.py.

Run as a script (``python lightning_run.py OUT``), in a process of its own: the Trainer changes
process-wide state (seeds, logging). It trains :class:`Tiny` for 30 steps on CPU, once per
precision, into ``OUT/<precision>/``: ``ModelCheckpoint`` every 10 steps (``epoch=E-step=S.ckpt``,
``last.ckpt``) beside ``EarlyStopping``, with hyper-parameters that Lightning pickles as globals:
a ``pathlib.Path``, a numpy scalar and, in the fp32 run, a :class:`RunConfig` (a class ckptavg
has never heard of), a :class:`RunConfig.Schedule` (a nested class: pickled as a call of
``getattr``, then an object made of what that call returned) and a start time in a
``zoneinfo`` zone (pickled through a classmethod: ``getattr(ZoneInfo, "_unpickle")(key, 1)``).
The ``state_dict`` of each save, as Lightning hands it to the file, also goes to
``OUT/<precision>-state_dicts/step-S.safetensors``, for the test's reference. Imported, it gives
:class:`Tiny` to load merged weights back into.
"""

from __future__ import annotations

import datetime
import math
import pathlib
import sys
import warnings
import zoneinfo

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from safetensors.torch import save_file

STEPS = (10, 20, 30)
PRECISIONS = ("32", "bf16-true")
# Hyper-parameters that pickle as globals (pathlib.PosixPath; numpy's scalar, dtype, _codecs.encode).
DATA_DIR = pathlib.Path("/tmp/data")
TEMPERATURE = np.float64(0.5)


class RunConfig:
    """A user's own config object among the hyper-parameters."""

    class Schedule:
        def __init__(self, name: str) -> None:
            self.name = name

    def __init__(self, name: str, widths: tuple[int, ...]) -> None:
        self.name, self.widths = name, widths


class Tiny(L.LightningModule):
    def __init__(
        self,
        vocab: int = 32,
        hidden: int = 8,
        lr: float = 1e-2,
        data_dir: pathlib.Path = DATA_DIR,
        temperature: np.float64 = TEMPERATURE,
        config: RunConfig | None = None,
        schedule: RunConfig.Schedule | None = None,
        started: datetime.datetime | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, 16)
        self.fc2 = torch.nn.Linear(16, vocab)
        self.register_buffer("pos", torch.arange(4, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.norm(self.emb(x)))))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class StateDicts(Callback):
    """Keeps each saved ``state_dict`` apart, in a format read without unpickling."""

    def __init__(self, folder: pathlib.Path) -> None:
        self.folder = folder

    def on_save_checkpoint(self, trainer: L.Trainer, _module: L.LightningModule, checkpoint: dict) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        weights = {key: value.detach().clone() for key, value in checkpoint["state_dict"].items()}
        save_file(weights, self.folder / f"step-{trainer.global_step}.safetensors")


def train(out: pathlib.Path, precision: str) -> None:
    L.seed_everything(0, verbose=False)
    tokens = torch.randint(0, 32, (64, 4), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, (tokens + 1) % 32), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS[-1],
        precision=precision,
        callbacks=[
            ModelCheckpoint(dirpath=out, every_n_train_steps=math.gcd(*STEPS), save_top_k=-1, save_last=True),
            EarlyStopping(monitor="train_loss", patience=1000, mode="min"),
            StateDicts(out.with_name(f"{out.name}-state_dicts")),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if precision == "32":
        start = datetime.datetime(2025, 1, 1, tzinfo=zoneinfo.ZoneInfo("UTC"))
        module = Tiny(config=RunConfig("tiny", (8, 16)), schedule=RunConfig.Schedule("cosine"), started=start)
    else:
        module = Tiny()
    trainer.fit(module, loader)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    for precision in PRECISIONS:
        train(pathlib.Path(sys.argv[1]) / precision, precision)
