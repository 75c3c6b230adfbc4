"""The framework adapters, each driven by the real framework on a tiny model, resumed mid-window."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from helpers import files_of
from references import correctly_rounded, load_merged, same_bits
from torch import nn
from trainers import hf_model_and_data, lightning_module_and_data, olmo_core_trainer_config_and_parts

import ckptavg
from ckptavg import CkptavgError, MergeHookConfig
from ckptavg.plan import sampled_steps


class Recorder:
    """Keeps float64 copies of the weights after each optimizer step (for the reference mean)."""

    def __init__(self) -> None:
        self.seen: dict[int, dict[str, torch.Tensor]] = {}

    def record(self, step: int, model: nn.Module) -> None:
        self.seen[step] = {k: v.detach().double().clone() for k, v in model.state_dict().items()}

    def assert_merge(self, folder: Path, merge_step: int, window: int, prefix: str = "") -> None:
        merged = load_merged(folder)
        steps = sampled_steps(merge_step, window)
        for name, tensor in merged.items():
            mean = sum(self.seen[s][prefix + name] for s in steps) / len(steps)
            assert bool(same_bits(tensor, correctly_rounded(mean, tensor.dtype)).all()), name


# -- Hugging Face transformers --------------------------------------------------------------


def _hf_trainer(output_dir: Path, merges: Path, stop_at: int | None = None, recorder: Recorder | None = None):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ckptavg.hook.integrations.transformers import MergeCallback

    model, data = hf_model_and_data()

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if recorder is not None:
                recorder.record(state.global_step, model)
            if stop_at is not None and state.global_step == stop_at:
                control.should_training_stop = True  # a crash after the checkpoint at step 4

    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=12,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        save_strategy="steps",
        save_steps=4,
        logging_steps=100,
        report_to=[],
        use_cpu=True,
        seed=0,
        lr_scheduler_type="constant",
        disable_tqdm=True,
        bf16=False,
    )
    hook_config = MergeHookConfig(save_folder=str(merges), merge_steps=[10], window=8)
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[MergeCallback(hook_config), Stop()])


def test_transformers_trainer_merges_and_resumes(tmp_path):
    from transformers import AutoModelForCausalLM

    recorder = Recorder()
    _hf_trainer(tmp_path / "straight", tmp_path / "straight-merges", recorder=recorder).train()
    out = tmp_path / "straight-merges" / "step10-merged"
    recorder.assert_merge(out, 10, 8)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded(torch.randint(0, 64, (1, 8))).logits.shape == (1, 8, 64)
    # An offline merge of the Trainer's checkpoints takes their config, never the hook's state.
    assert (tmp_path / "straight" / "checkpoint-12" / "ckptavg-hook-state.json").is_file()
    offline = ckptavg.merge(str(tmp_path / "straight"), last=2, out=str(tmp_path / "offline"))
    assert "config.json" in offline.files and "ckptavg-hook-state.json" not in offline.files
    assert not (tmp_path / "offline" / "ckptavg-hook-state.json").exists()

    _hf_trainer(tmp_path / "run", tmp_path / "merges", stop_at=6).train()
    assert (tmp_path / "run" / "checkpoint-4" / "ckptavg-hook-state.json").is_file()
    assert not (tmp_path / "merges" / "step10-merged").exists()
    _hf_trainer(tmp_path / "run", tmp_path / "merges").train(
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4")
    )
    assert files_of(tmp_path / "merges" / "step10-merged") == files_of(out)


def test_transformers_names_a_hook_state_file_it_cannot_resume_from(tmp_path):
    """The adapter reads the hook state back from its JSON file: a value of another JSON type
    there is one error naming that file."""
    from types import SimpleNamespace

    from ckptavg.hook.integrations.transformers import STATE_FILE, MergeCallback

    path = tmp_path / "run" / "checkpoint-4" / STATE_FILE
    path.parent.mkdir(parents=True)
    state = {"format": "ckptavg.MergeHook", "version": 1, "mode": "accumulate", "step": 4}
    path.write_text(json.dumps({**state, "windows": [[10, [3, 4]]]}))
    callback = MergeCallback(MergeHookConfig(save_folder=str(tmp_path / "merges"), merge_steps=[10], window=8))
    args = SimpleNamespace(output_dir=str(tmp_path / "run"), resume_from_checkpoint=None)
    with pytest.raises(CkptavgError, match=f"^{path}: not a MergeHook state: step 4, windows"):
        callback.on_train_begin(args, SimpleNamespace(global_step=4, max_steps=12), None)
    callback.hook.close()


# -- PyTorch Lightning ----------------------------------------------------------------------


def _lightning_fit(root: Path, merges: Path, max_steps: int, ckpt_path: str | None = None, recorder=None):
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckptavg.hook.integrations.lightning import MergeCallback

    module, loader = lightning_module_and_data(None if recorder is None else recorder.record)
    trainer = lightning.Trainer(
        default_root_dir=str(root),
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            MergeCallback(MergeHookConfig(save_folder=str(merges), merge_steps=[10], window=8)),
            ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_train_steps=4, save_top_k=-1),
        ],
    )
    trainer.fit(module, loader, ckpt_path=ckpt_path)


def test_lightning_merges_and_resumes(tmp_path):
    recorder = Recorder()
    _lightning_fit(tmp_path / "straight", tmp_path / "straight-merges", 12, recorder=recorder)
    out = tmp_path / "straight-merges" / "step10-merged"
    recorder.assert_merge(out, 10, 8)

    _lightning_fit(tmp_path / "run", tmp_path / "merges", 6)  # the run dies after step 6
    (checkpoint,) = (tmp_path / "run" / "ckpt").glob("*step=4.ckpt")
    _lightning_fit(tmp_path / "run", tmp_path / "merges", 12, ckpt_path=str(checkpoint))
    assert files_of(tmp_path / "merges" / "step10-merged") == files_of(out)


def test_integrations_say_what_to_install(monkeypatch):
    import builtins
    import importlib
    import sys

    real_import = builtins.__import__

    def no_lightning(name, *args, **kwargs):
        if name.startswith("lightning"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_lightning)
    monkeypatch.delitem(sys.modules, "ckptavg.hook.integrations.lightning", raising=False)
    for name in [m for m in sys.modules if m.startswith("lightning")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match="needs lightning: pip install lightning"):
        importlib.import_module("ckptavg.hook.integrations.lightning")


# -- OLMo-core ------------------------------------------------------------------------------


def _olmo_fit(root: Path, merges: Path, max_steps: int, resume_from: Path | None = None, recorder=None) -> None:
    from ckptavg.hook.integrations.olmo_core import MergeCallback

    record = None if recorder is None else recorder.record
    config, module, data_loader = olmo_core_trainer_config_and_parts(root, max_steps, record)
    hook_config = MergeHookConfig(save_folder=str(merges), merge_steps=[10], window=8)
    config = config.with_callback("ckptavg", MergeCallback(config=hook_config))
    trainer = config.build(module, data_loader)
    if resume_from is not None:
        trainer.load_checkpoint(str(resume_from))
    trainer.fit()


def test_olmo_core_trainer_merges_and_resumes(tmp_path, recwarn):
    recorder = Recorder()
    _olmo_fit(tmp_path / "straight", tmp_path / "straight-merges", 12, recorder=recorder)
    out = tmp_path / "straight-merges" / "step10-merged"
    recorder.assert_merge(out, 10, 8)

    _olmo_fit(tmp_path / "run", tmp_path / "merges", 6)  # the run dies after step 6
    assert not (tmp_path / "merges" / "step10-merged").exists()
    _olmo_fit(tmp_path / "run", tmp_path / "merges", 12, resume_from=tmp_path / "run" / "checkpoints" / "step4")
    assert files_of(tmp_path / "merges" / "step10-merged") == files_of(out)
    gc.collect()  # every callback and its copies gone: none of them may claim it never ran
    assert not [w for w in recwarn if "no trainer ever ran it" in str(w.message)]


def test_an_olmo_core_callback_left_out_of_the_config_says_so(tmp_path):
    """``with_callback`` returns a new config; dropping it trains without the callback. The
    callback says so once nothing can run it any more (here: collected; at exit at the latest)."""
    from ckptavg.hook.integrations.olmo_core import MergeCallback

    config, module, data_loader = olmo_core_trainer_config_and_parts(tmp_path, max_steps=2)
    hook_config = MergeHookConfig(save_folder=str(tmp_path / "merges"), merge_steps=[10], window=8)
    with pytest.warns(RuntimeWarning, match=r"no trainer ever ran it.*trainer_config = trainer_config.with_callback"):
        config.with_callback("ckptavg", MergeCallback(config=hook_config))  # the new config dropped
        config.build(module, data_loader).fit()
        gc.collect()
    assert not (tmp_path / "merges").exists()
