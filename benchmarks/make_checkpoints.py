"""Synthetic Llama-like run folders for the merge benchmark, generated once and cached.

Why synthetic: the benchmark must run anywhere without downloading weights, yet look like what
ckptavg meets in practice: Hugging Face sharded safetensors (3 shards + index + config.json) of
a ~0.95 GB bf16 model (hidden 2048, 8 layers, vocab 32000, intermediate 5632, tied embeddings:
476.6M parameters, 0.888 GiB), one folder per step, the steps drifting slightly apart.

Why it is fast: the base weights are drawn once per process; each step adds noise taken from
one seeded pool of normal samples at a per-(step, tensor) offset, so a step costs one bf16 add
per tensor plus the write, never a Python loop over elements. Every value depends only on the
seed, the step and the tensor's position, so lazily generating more steps later (the 16-input
case) gives the same bytes as generating them all at once.

Why the stamp: a step folder is built under a hidden temporary name, renamed into place, and
marked complete by ``.bench-complete.json`` (hidden files are never copied by ckptavg). A folder
whose stamp, spec or file sizes do not match is treated as missing and rebuilt.

The completeness checks import nothing heavy, so the benchmark driver can call them without
loading torch (which would raise the baseline of every child's peak RSS measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

INDEX_FILE = "model.safetensors.index.json"
STAMP_FILE = ".bench-complete.json"

SPEC: dict[str, Any] = {
    "version": 1,
    "hidden_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "intermediate_size": 5632,
    "vocab_size": 32000,
    "tie_word_embeddings": True,
    "dtype": "bfloat16",
    "shards": 3,
    "seed": 1234,
    "init_std": 0.02,
    "noise_std": 0.001,
    "noise_pool": 2**27,
}


def spec_with_layers(layers: int | None) -> dict[str, Any]:
    """The spec with ``layers`` decoder layers (None: the default 8, a 0.95 GB checkpoint; 18
    layers make 1.98 GB, the larger size the mergekit comparison runs on)."""
    return SPEC if layers is None else {**SPEC, "num_hidden_layers": layers}


def spec_with_experts(spec: dict[str, Any], experts: int | None) -> dict[str, Any]:
    """``spec`` as a Mixtral-style MoE of the same bytes (None: dense, ``spec`` itself): each
    layer's MLP split into ``experts`` experts of ``intermediate_size / experts`` rows, plus a
    router. With 16 experts the 0.95 GB checkpoint holds 442 tensors instead of 74."""
    return spec if experts is None else {**spec, "num_experts": experts}


def step_numbers(count: int) -> list[int]:
    """Steps 1000, 2000, ...: the first ``count`` of them (the 4-input set is a prefix of the 16)."""
    return [1000 * (i + 1) for i in range(count)]


def tensor_shapes(spec: dict[str, Any] = SPEC) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes in the order ``transformers`` lists a LlamaForCausalLM's state dict."""
    h, vocab = spec["hidden_size"], spec["vocab_size"]
    head_dim = h // spec["num_attention_heads"]
    kv = spec["num_key_value_heads"] * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(spec["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.self_attn.q_proj.weight", (h, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, h)),
            *_mlp_shapes(p, spec),
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    if not spec["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (vocab, h)))
    return shapes


def _mlp_shapes(prefix: str, spec: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """A layer's MLP: Llama's three projections, or Mixtral's router and experts."""
    h, inter, experts = spec["hidden_size"], spec["intermediate_size"], spec.get("num_experts")
    if experts is None:
        return [
            (f"{prefix}.mlp.gate_proj.weight", (inter, h)),
            (f"{prefix}.mlp.up_proj.weight", (inter, h)),
            (f"{prefix}.mlp.down_proj.weight", (h, inter)),
        ]
    moe, rows = f"{prefix}.block_sparse_moe", inter // experts
    shapes: list[tuple[str, tuple[int, ...]]] = [(f"{moe}.gate.weight", (experts, h))]
    for e in range(experts):
        shapes += [
            (f"{moe}.experts.{e}.w1.weight", (rows, h)),
            (f"{moe}.experts.{e}.w2.weight", (h, rows)),
            (f"{moe}.experts.{e}.w3.weight", (rows, h)),
        ]
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def itemsize(spec: dict[str, Any] = SPEC) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[spec["dtype"]]


def weight_map(spec: dict[str, Any] = SPEC) -> dict[str, str]:
    """Tensor name -> shard file: contiguous groups of about equal bytes, as trainers write them."""
    shapes = tensor_shapes(spec)
    n = spec["shards"]
    total = sum(_numel(s) for _, s in shapes)
    mapping: dict[str, str] = {}
    before = 0
    for name, shape in shapes:
        shard = min(n - 1, before * n // total)
        mapping[name] = f"model-{shard + 1:05d}-of-{n:05d}.safetensors"
        before += _numel(shape)
    return mapping


def checkpoint_bytes(spec: dict[str, Any] = SPEC) -> int:
    """Bytes of tensor data in one checkpoint (headers and config excluded)."""
    return sum(_numel(s) for _, s in tensor_shapes(spec)) * itemsize(spec)


def weight_files(step_dir: Path) -> list[Path]:
    """The shard files of a checkpoint folder, from its index (what every reader of it reads)."""
    index = json.loads((step_dir / INDEX_FILE).read_text())
    return [step_dir / name for name in sorted(set(index["weight_map"].values()))]


def is_complete(step_dir: Path, spec: dict[str, Any] = SPEC) -> bool:
    """Whether ``step_dir`` is a finished checkpoint of this spec (stamp present, sizes match)."""
    try:
        stamp = json.loads((step_dir / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    if stamp.get("spec") != spec:
        return False
    try:
        return all((step_dir / name).stat().st_size == size for name, size in stamp["files"].items())
    except (OSError, KeyError, AttributeError):
        return False


def missing_steps(run_dir: Path, steps: list[int], spec: dict[str, Any] = SPEC) -> list[int]:
    return [s for s in steps if not is_complete(run_dir / f"step{s}", spec)]


def llama_config(spec: dict[str, Any] = SPEC) -> dict[str, Any]:
    experts = spec.get("num_experts")
    moe = {} if experts is None else {"num_local_experts": experts, "num_experts_per_tok": 2}
    return {
        "architectures": ["MixtralForCausalLM" if experts else "LlamaForCausalLM"],
        "model_type": "mixtral" if experts else "llama",
        **moe,
        "hidden_size": spec["hidden_size"],
        "intermediate_size": spec["intermediate_size"] // (experts or 1),
        "num_hidden_layers": spec["num_hidden_layers"],
        "num_attention_heads": spec["num_attention_heads"],
        "num_key_value_heads": spec["num_key_value_heads"],
        "vocab_size": spec["vocab_size"],
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": spec["tie_word_embeddings"],
        "torch_dtype": spec["dtype"],
    }


def generate(run_dir: Path, steps: list[int], spec: dict[str, Any] = SPEC) -> None:
    """Write the checkpoint folders ``run_dir/step{N}`` for ``steps`` (existing ones are replaced)."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, spec["dtype"])
    shapes = tensor_shapes(spec)
    mapping = weight_map(spec)
    total = checkpoint_bytes(spec)
    generator = torch.Generator().manual_seed(spec["seed"])
    # Base weights: N(0, init_std) for matrices, ones for the RMSNorm gains, as at init.
    base: dict[str, torch.Tensor] = {}
    for name, shape in shapes:
        if len(shape) == 1:
            base[name] = torch.ones(shape, dtype=dtype)
        else:
            base[name] = torch.randn(shape, dtype=dtype, generator=generator).mul_(spec["init_std"])
    pool = torch.randn(spec["noise_pool"], dtype=dtype, generator=generator).mul_(spec["noise_std"])
    run_dir.mkdir(parents=True, exist_ok=True)
    for step in steps:
        started = time.perf_counter()
        final = run_dir / f"step{step}"
        tmp = run_dir / f".step{step}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        files: dict[str, int] = {}
        for file_name in sorted(set(mapping.values())):
            tensors = {}
            for position, (name, shape) in enumerate(shapes):
                if mapping[name] != file_name:
                    continue
                n = _numel(shape)
                # A different window of the pool for every (step, tensor): cheap, seeded, and
                # every element differs between steps.
                offset = (step * 7919 + position * 104729) % (spec["noise_pool"] - n + 1)
                tensors[name] = torch.add(base[name], pool[offset : offset + n].view(shape))
            save_file(tensors, str(tmp / file_name), metadata={"format": "pt"})
            files[file_name] = (tmp / file_name).stat().st_size
            del tensors
        index = {"metadata": {"total_size": total}, "weight_map": mapping}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(llama_config(spec), indent=2) + "\n")
        (tmp / STAMP_FILE).write_text(json.dumps({"spec": spec, "step": step, "files": files}, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        print(
            f"  wrote {final} ({sum(files.values()) / 1e9:.2f} GB) in {time.perf_counter() - started:.1f} s", flush=True
        )


def main(argv: list[str] | None = None) -> int:
    """Generate missing (or all, with ``--force``) steps of a run folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", required=True, help="comma-separated step numbers")
    parser.add_argument("--force", action="store_true", help="rewrite steps that are already complete")
    parser.add_argument("--layers", type=int, help="decoder layers (default 8: 0.95 GB per checkpoint)")
    parser.add_argument("--experts", type=int, help="a Mixtral-style MoE with this many experts per layer")
    args = parser.parse_args(argv)
    spec = spec_with_experts(spec_with_layers(args.layers), args.experts)
    steps = [int(s) for s in args.steps.split(",") if s.strip()]
    todo = steps if args.force else missing_steps(args.run_dir, steps, spec)
    if todo:
        generate(args.run_dir, todo, spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
