"""PyTorch Lightning ``.ckpt`` files: saved by Lightning itself (tests/lightning_run.py: fp32 and
bf16-true, ``ModelCheckpoint`` + ``EarlyStopping``, hyper-parameters that pickle a ``Path``, a
numpy scalar and a class of the user's), found as checkpoints of a run folder (``last.ckpt`` by
the step inside it), merged with ``ckptavg merge`` to the correctly rounded float64 mean of the
``state_dict`` tensors, and loaded back into the LightningModule. Hostile pickles among the
hyper-parameters are skipped, never run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_builders import hostile_object, write_lightning_ckpt
from helpers import run_cli_in_process, run_scripts
from references import assert_equal, load_merged, reference
from safetensors.torch import load_file

STEPS = (10, 20, 30)  # lightning_run.STEPS (importing it imports Lightning)


class TaggedTensor(torch.Tensor):
    """A tensor subclass: its class is code the reader never imports."""


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lightning")
    run_scripts(("lightning_run.py", str(root)))
    return root


def _saved(root: Path, precision: str) -> dict[int, dict[str, torch.Tensor]]:
    return {step: load_file(root / f"{precision}-state_dicts" / f"step-{step}.safetensors") for step in STEPS}


def _listing(run: Path) -> list[tuple[int, str, str, str]]:
    rows = json.loads(run_cli_in_process("ls", str(run), "--json").stdout)
    return [(row["step"], row["name"], row["format"], row["status"]) for row in rows]


@pytest.mark.parametrize("precision", ["32", "bf16-true"])
def test_lightning_checkpoints_merge_exactly_and_load_into_the_module(lightning_runs, tmp_path, precision):
    run = lightning_runs / precision
    assert _listing(run) == [
        (10, "epoch=0-step=10.ckpt", "lightning", "complete"),
        (20, "epoch=1-step=20.ckpt", "lightning", "complete"),
        (30, "epoch=1-step=30.ckpt", "lightning", "complete"),
        (30, "last.ckpt", "lightning", "same save as epoch=1-step=30.ckpt"),  # not "stored twice"
    ]
    out = tmp_path / "avg"
    result = run_cli_in_process("merge", str(run), "--last", "3", "--out", str(out))
    assert result.returncode == 0, result.stderr

    expected = reference(_saved(lightning_runs, precision), STEPS)
    assert {t.dtype for t in expected.values()} == {torch.float32 if precision == "32" else torch.bfloat16}
    merged = load_merged(out)
    assert_equal(merged, expected)  # the state_dict, under the module's own names
    keys = json.loads((out / "ckptavg-manifest.json").read_text())["keys"]
    assert keys["left_out"] == 2 and all(k.startswith("callbacks.") for k in keys["left_out_examples"])
    verified = run_cli_in_process("verify", str(out), "--against", str(run))
    assert verified.returncode == 0, verified.stderr

    from lightning_run import Tiny  # here: importing it imports Lightning

    module = Tiny().to(next(iter(expected.values())).dtype)
    module.load_state_dict(merged)  # strict: every key of the module, no other
    assert_equal(module.state_dict(), expected)


def test_last_ckpt_takes_the_step_inside_it_when_no_name_tells_it(lightning_runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(lightning_runs / "32", run)
    (run / "epoch=1-step=30.ckpt").unlink()
    assert [row[:2] + row[3:] for row in _listing(run)][-1] == (30, "last.ckpt", "complete")
    result = run_cli_in_process("merge", str(run), "--steps", "10,20,30", "--out", str(tmp_path / "avg"))
    assert result.returncode == 0, result.stderr
    assert_equal(load_merged(tmp_path / "avg"), reference(_saved(lightning_runs, "32"), STEPS))


def test_hostile_hyper_parameters_are_skipped_and_never_run(tmp_path):
    """Lightning pickles hyper-parameters and callback state of any class: outside the
    state_dict, a global the allow-list does not know is never imported or called."""
    run, marker = tmp_path / "run", tmp_path / "pwned"
    saved = {step: {"w": torch.full((3, 2), float(step)), "b": torch.arange(3.0) * step} for step in (1, 2)}
    hyper_parameters = {"config": hostile_object(marker), "path": Path("/data"), "temperature": np.float64(0.5)}
    write_lightning_ckpt(run / "epoch=0-step=1.ckpt", saved[1], 1, hyper_parameters=hyper_parameters)
    callbacks = {"Mine": {"fn": hostile_object(marker, "exec"), "seen": torch.ones(2).as_subclass(TaggedTensor)}}
    write_lightning_ckpt(run / "last.ckpt", saved[2], 2, callbacks=callbacks)
    assert [row[:2] for row in _listing(run)] == [(1, "epoch=0-step=1.ckpt"), (2, "last.ckpt")]
    result = run_cli_in_process("merge", str(run), "--last", "2", "--out", str(tmp_path / "avg"))
    assert result.returncode == 0, result.stderr
    assert_equal(load_merged(tmp_path / "avg"), reference(saved, (1, 2)))
    assert not marker.exists()
