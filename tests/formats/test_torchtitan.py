"""torchtitan checkpoints saved by torchtitan's own ``CheckpointManager`` (tests/torchtitan_run.py):
full steps (model, optimizer, lr_scheduler, dataloader, train_state) and the model-only last
step, in one process (fp32) and under FSDP2 over two processes (bf16); merged with ``ckptavg
merge``, compared bit for bit with the correctly rounded float64 mean, and loaded back by
torchtitan as the checkpoint a run starts from (``initial_load_path``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoint_builders import load_dcp, read_dcp_metadata
from helpers import run_cli_in_process, run_scripts
from references import assert_equal, reference
from safetensors.torch import load_file
from torchtitan_run import STEPS

RUNS = {"single": (), "fsdp2": ("--world", "2", "--fsdp", "--dtype", "bfloat16")}


@pytest.fixture(scope="module")
def titan(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("torchtitan")
    run_scripts(*(("torchtitan_run.py", "write", str(root / name), *options) for name, options in RUNS.items()))
    return root


def _saved(root: Path, name: str) -> dict:
    return {step: load_file(root / f"{name}-weights" / f"step-{step}.safetensors") for step in STEPS}


def test_full_and_model_only_steps_merge_exactly_and_load_back_in_torchtitan(titan, tmp_path):
    outputs = []
    for name in RUNS:
        run = titan / name
        listing = json.loads(run_cli_in_process("ls", str(run), "--json").stdout)
        assert [(row["name"], row["format"], row["status"]) for row in listing] == [
            (f"step-{step}", "dcp", "complete") for step in STEPS
        ]
        full, model_only = (
            set(read_dcp_metadata(run / f"step-{s}").state_dict_metadata) for s in (STEPS[0], STEPS[-1])
        )
        assert any(key.startswith("optimizer.state.") for key in full) and "train_state.step" in full
        assert model_only < full and not any(key.startswith("optimizer.") for key in model_only)

        out = tmp_path / name
        result = run_cli_in_process("merge", str(run), "--last", "3", "--format", "dcp", "--out", str(out))
        assert result.returncode == 0, result.stderr
        expected = reference(_saved(titan, name), STEPS)
        assert set(read_dcp_metadata(out).state_dict_metadata) == set(expected)  # the model's weights, nothing else
        assert_equal(load_dcp(out, expected), expected)
        outputs.append((out, expected))

    run_scripts(("torchtitan_run.py", "load", *(str(out) for out, _ in outputs)))
    for out, expected in outputs:
        loaded = load_file(out.parent / f"{out.name}.loaded.safetensors")  # into an fp32 model
        assert_equal(loaded, {key: value.float() for key, value in expected.items()})
