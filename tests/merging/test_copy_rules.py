"""Per-tensor copy rules: ``--copy PATTERN`` takes the matching tensors from one source
(``--copy-from newest|oldest|STEP``) instead of averaging them, even where the sources differ:
MoE ``expert_bias`` buffers, counters, Transformer Engine ``_extra_state`` bytes, integer
tensors that change between steps (refused without a rule). Recorded in the manifest and
honoured by ``verify --against``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoint_builders import FP8_WEIGHTS, write_fp8_checkpoint
from helpers import files_of, write_checkpoint
from helpers import run_cli_in_process as run_cli
from references import load_merged, reference

STEPS = [10, 20, 30]
COPY = ["--copy", "*.expert_bias,*.tokens_per_expert", "--copy", "*._extra_state"]


class MoELayer(torch.nn.Module):
    """A router with DeepSeek-V3's auxiliary-loss-free balancing: ``expert_bias`` is updated by
    rule, not by gradients, and differs at every step; a token counter; and a Transformer
    Engine-style ``_extra_state`` (serialized bytes as a uint8 tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(6, 4, bias=False, dtype=torch.bfloat16)
        self.register_buffer("expert_bias", torch.zeros(4))
        self.register_buffer("tokens_per_expert", torch.zeros(4, dtype=torch.int64))
        self.register_buffer("_extra_state", torch.zeros(5, dtype=torch.uint8))

    def train_step(self, step: int) -> None:
        generator = torch.Generator().manual_seed(step)
        with torch.no_grad():
            self.router.weight.add_(torch.randn(4, 6, generator=generator).bfloat16() * 0.01)
            load = torch.randint(0, 100, (4,), generator=generator)
            self.tokens_per_expert += load
            self.expert_bias += 0.001 * torch.sign(load.float().mean() - load.float())
            self._extra_state.copy_(torch.tensor(list(f"{step:05d}".encode())))


def _moe_run(run: Path) -> dict[int, dict[str, torch.Tensor]]:
    layer, saved = MoELayer(), {}
    for step in range(1, STEPS[-1] + 1):
        layer.train_step(step)
        if step in STEPS:
            saved[step] = {f"layers.0.{k}": v.clone() for k, v in layer.state_dict().items()}
            write_checkpoint(run / f"step{step}", saved[step])
    return saved


@pytest.mark.parametrize(("copy_from", "source"), [("newest", 30), ("oldest", 10), ("20", 20)])
def test_copy_takes_matching_tensors_from_the_chosen_source(tmp_path: Path, copy_from: str, source: int) -> None:
    saved = _moe_run(tmp_path / "run")
    result = run_cli("merge", str(tmp_path / "run"), "--last", "3", *COPY, "--copy-from", copy_from)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "run" / "step30-merged"
    merged = load_merged(out)
    copied = ["layers.0.expert_bias", "layers.0.tokens_per_expert", "layers.0._extra_state"]
    for name in copied:
        assert merged[name].dtype == saved[source][name].dtype and torch.equal(merged[name], saved[source][name])
    assert not torch.equal(saved[10]["layers.0.expert_bias"], saved[30]["layers.0.expert_bias"])  # they differ
    expected = reference(saved, STEPS)
    assert torch.equal(merged["layers.0.router.weight"], expected["layers.0.router.weight"])  # still averaged
    manifest = json.loads((out / "ckptavg-manifest.json").read_text())
    assert manifest["copy"] == {
        "why": "--copy: taken from one source, never averaged",
        "patterns": ["*.expert_bias", "*.tokens_per_expert", "*._extra_state"],
        "from": int(copy_from) if copy_from.isdigit() else copy_from,
        "source": str(tmp_path / "run" / f"step{source}"),
        "tensors": 3,
        "tensor_examples": sorted(copied),
    }
    verified = run_cli("verify", str(out), "--against", str(tmp_path / "run"), "--sample", "4")
    assert verified.returncode == 0, verified.stderr
    assert "4 tensors recomputed from the sources: identical" in verified.stdout


def test_verify_takes_the_copy_rules_from_the_manifest(tmp_path: Path) -> None:
    """A manifest that names another source than the one copied from fails verification at the
    copied tensor: the recomputation follows the recorded rules, it does not assume them."""
    _moe_run(tmp_path / "run")
    assert run_cli("merge", str(tmp_path / "run"), "--last", "3", *COPY, "--copy-from", "oldest").returncode == 0
    out = tmp_path / "run" / "step30-merged"
    path = out / "ckptavg-manifest.json"
    manifest = json.loads(path.read_text())
    manifest["copy"]["from"] = 20
    path.write_text(json.dumps(manifest))
    result = run_cli("verify", str(out), "--against", str(tmp_path / "run"), "--sample", "4")
    assert result.returncode == 1
    assert "tensor 'layers.0._extra_state' differs from the average of its sources at element 3" in result.stderr


def test_differing_counters_without_a_rule_are_refused_naming_the_option(tmp_path: Path) -> None:
    _moe_run(tmp_path / "run")
    result = run_cli("merge", str(tmp_path / "run"), "--last", "3", "--copy", "*._extra_state,*.expert_bias")
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert "torch.int64 tensor 'layers.0.tokens_per_expert' differs between" in line
    assert "(--copy 'layers.0.tokens_per_expert' takes it from one source instead)" in line
    assert not (tmp_path / "run" / "step30-merged").exists()


def test_a_rule_that_matches_nothing_is_a_note(tmp_path: Path) -> None:
    _moe_run(tmp_path / "run")
    result = run_cli("merge", str(tmp_path / "run"), "--last", "3", *COPY, "--copy", "*.expert_biases")
    assert result.returncode == 0, result.stderr
    assert "ckptavg: note: --copy '*.expert_biases' matches no tensor" in result.stderr


def test_each_window_of_a_sweep_copies_from_its_own_oldest_checkpoint(tmp_path: Path) -> None:
    saved = _moe_run(tmp_path / "run")
    sweep = ["--merge-step", "30", "--window", "10,30", *COPY, "--copy-from", "oldest", "--out", str(tmp_path / "s")]
    result = run_cli("merge", str(tmp_path / "run"), *sweep)
    assert result.returncode == 0, result.stderr
    for window, oldest in ((10, 30), (30, 10)):
        folder = tmp_path / "s" / f"step30-merged-w{window}-uniform"
        assert torch.equal(load_merged(folder)["layers.0.expert_bias"], saved[oldest]["layers.0.expert_bias"])
        alone = ["--merge-step", "30", "--window", str(window), *COPY, "--copy-from", "oldest"]
        assert run_cli("merge", str(tmp_path / "run"), *alone, "--out", str(tmp_path / f"w{window}")).returncode == 0
        assert files_of(folder) == files_of(tmp_path / f"w{window}") != {}
    # A step that the narrower window does not hold: refused before anything is read.
    stepped = run_cli("merge", str(tmp_path / "run"), *sweep[:-2], "--copy-from", "20", "--out", str(tmp_path / "t"))
    assert stepped.returncode == 1
    assert stepped.stderr.strip().splitlines() == [
        "ckptavg: error: --copy-from 20: no source of this merge is step 20 (its steps: 30)"
    ]
    assert not (tmp_path / "t").exists()


def test_a_copied_float8_weight_takes_its_scale_with_it(tmp_path: Path) -> None:
    """Scales that differ refuse an average (ckptavg does not dequantize); copied, a float8
    weight and its scale come from one checkpoint together."""
    saved = {step: write_fp8_checkpoint(tmp_path / "run", step, shared_scales=False) for step in (1, 2)}
    rules = [arg for name in FP8_WEIGHTS for arg in ("--copy", name)]
    result = run_cli("merge", str(tmp_path / "run"), "--last", "2", *rules, "--copy-from", "oldest")
    assert result.returncode == 0, result.stderr
    merged = load_merged(tmp_path / "run" / "step2-merged")
    for name in FP8_WEIGHTS:
        for key in (name, f"{name}_scale_inv"):
            assert merged[key].view(torch.uint8).equal(saved[1][key].view(torch.uint8)), key
    assert json.loads((tmp_path / "run" / "step2-merged" / "ckptavg-manifest.json").read_text())["copy"]["tensors"] == 4
