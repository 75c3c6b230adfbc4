"""End to end with the real producer and consumer: ``save_pretrained`` in, ``from_pretrained`` out."""

from __future__ import annotations

import torch
import transformers
from checkpoint_builders import hf_config
from helpers import run_cli
from references import correctly_rounded, same_bits


def test_merge_of_save_pretrained_checkpoints_loads_with_from_pretrained(tmp_path):
    config = hf_config()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    run = tmp_path / "run"
    saved = {}
    for step in (10, 20, 30):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        model.save_pretrained(run / f"checkpoint-{step}", max_shard_size="20KB")
        saved[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert (run / "checkpoint-30" / "model.safetensors.index.json").exists()

    proc = run_cli("merge", str(run), "--merge-step", "30", "--window", "30", "--shard-size", "30KB")
    assert proc.returncode == 0, proc.stderr
    merged = transformers.AutoModelForCausalLM.from_pretrained(run / "step30-merged", dtype=torch.bfloat16)
    state = merged.state_dict()
    assert set(state) == set(saved[30])
    for name, tensor in state.items():
        mean = sum(saved[s][name].double() for s in (10, 20, 30)) / 3
        assert tensor.dtype == torch.bfloat16
        assert bool(same_bits(tensor, correctly_rounded(mean, torch.bfloat16)).all()), name
    # And it runs.
    logits = merged(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 128) and bool(torch.isfinite(logits).all())
