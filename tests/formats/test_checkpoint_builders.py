"""The checkpoint builders write what the trainers write, where ``checkpoint_builders`` says, and
the weights they return are exactly what the trainers' own loaders read back."""

from __future__ import annotations

import io
import json
import pickle

import pytest
import torch
from checkpoint_builders import (
    TitanRun,
    load_dcp,
    load_olmo_core_model,
    olmo_core_model,
    pickle_classes,
    read_dcp_metadata,
    write_generic_dcp,
    write_hf_checkpoint,
    write_malicious_pt,
    write_olmo_core_checkpoint,
    write_torch_save_checkpoint,
    write_torchtitan_runs,
)
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

OLMO_STORAGE_INFO = ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo")
TORCH_STORAGE_INFO = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")
ADAMW_GROUP_OPTIONS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable"}


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype, key
        assert actual[key].shape == tensor.shape, key
        assert torch.equal(actual[key], tensor), key


def tensor_keys(metadata) -> dict[str, TensorStorageMetadata]:
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def stored_entry(folder, key: str) -> torch.Tensor:
    """The bytes DCP's storage index gives for a key's first chunk: a whole torch.save archive."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    metadata = read_dcp_metadata(folder)
    chunk = metadata.state_dict_metadata[key].chunks[0]
    info = metadata.storage_data[MetadataIndex(key, chunk.offsets)]
    with open(folder / info.relative_path, "rb") as f:
        f.seek(info.offset)
        raw = f.read(info.length)
    assert raw[:2] == b"PK"  # a zip: torch.save's format
    return torch.load(io.BytesIO(raw), weights_only=True)


def assert_steps_differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    assert all(not torch.equal(a[k], b[k]) for k in a if a[k].is_floating_point())


# --------------------------------------------------------------------------------------------
# OLMo-core


def test_olmo_core_checkpoint_layout_keys_and_loaders(tmp_path):
    from olmo_core.distributed.checkpoint import save_state_dict
    from olmo_core.train.checkpoint import Checkpointer

    run = tmp_path / "run"
    fp32 = write_olmo_core_checkpoint(run, 10)
    bf16 = write_olmo_core_checkpoint(run, 20, dtype=torch.bfloat16, ephemeral=True)
    incomplete = {
        kind: write_olmo_core_checkpoint(run, 30 + i, incomplete=kind)
        for i, kind in enumerate(("no_marker", "tmp", "partial"))
    }
    assert {p.name for p in run.iterdir()} == {"step10", "step20", "step30", "step31-tmp", "step32-tmp"}

    # Files, marker and trainer state.
    step10 = run / "step10"
    assert {p.name for p in step10.iterdir()} == {".metadata.json", "config.json", "train", "model_and_optim"}
    assert json.loads((step10 / ".metadata.json").read_text()) == {"ephemeral": False, "version": "3.0.0"}
    assert json.loads((run / "step20" / ".metadata.json").read_text())["ephemeral"] is True
    assert json.loads((step10 / "config.json").read_text())["model"]["d_model"] == 12
    assert {p.name for p in (step10 / "model_and_optim").iterdir()} == {".metadata", "__0_0.distcp", "__0_1.distcp"}
    with pytest.raises(pickle.UnpicklingError):
        torch.load(step10 / "train" / "rank0.pt", weights_only=True)  # numpy RNG state in it
    assert torch.load(step10 / "train" / "rank0.pt", weights_only=False)["global_step"] == 10

    # OLMo-core's own view: complete checkpoints only, the ephemeral flag from the marker.
    assert sorted(step for step, _ in Checkpointer.find_checkpoints(str(run))) == [10, 20]
    assert [step for step, _ in Checkpointer.find_checkpoints(str(run), ephemeral=True)] == [20]
    assert not Checkpointer.dir_is_checkpoint(str(run / "step30"))
    assert (
        not (run / "step30" / ".metadata.json").exists() and (run / "step30" / "model_and_optim" / ".metadata").exists()
    )
    assert {p.name for p in (run / "step31-tmp").iterdir()} == {"train", "model_and_optim"}
    assert not (run / "step32-tmp" / "model_and_optim" / ".metadata").exists()
    assert set(incomplete["tmp"]) == set(fp32)

    # Keys and dtypes in the DCP metadata.
    fqns = {key.removeprefix("model.") for key in fp32}
    assert len(fqns) == 25 and "embeddings.weight" in fqns and "lm_head.w_out.weight" in fqns
    for step, weights, dtype in ((10, fp32, torch.float32), (20, bf16, torch.bfloat16)):
        metadata = read_dcp_metadata(run / f"step{step}" / "model_and_optim")
        tensors = tensor_keys(metadata)
        expected = {f"model.{f}" for f in fqns} | {
            f"optim.state.{f}.{s}" for f in fqns for s in ("step", "exp_avg", "exp_avg_sq")
        }
        assert set(tensors) == expected
        assert {k: v.properties.dtype for k, v in tensors.items() if k.startswith("model.")} == dict.fromkeys(
            weights, dtype
        )
        assert {tensors[f"optim.state.{f}.exp_avg"].properties.dtype for f in fqns} == {dtype}
        assert {
            (tensors[f"optim.state.{f}.step"].properties.dtype, tensors[f"optim.state.{f}.step"].size) for f in fqns
        } == {(torch.float32, torch.Size([]))}
        groups = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
        assert {k.rsplit(".", 1)[1] for k in groups} >= ADAMW_GROUP_OPTIONS
        assert all(k.startswith("optim.param_groups.") for k in groups)
        assert OLMO_STORAGE_INFO in pickle_classes(run / f"step{step}" / "model_and_optim" / ".metadata")
        assert {info.relative_path for info in metadata.storage_data.values()} == {"__0_0.distcp", "__0_1.distcp"}
    assert_steps_differ(fp32, bf16)
    entry = stored_entry(run / "step20" / "model_and_optim", "model.lm_head.w_out.weight")
    assert torch.equal(entry, bf16["model.lm_head.w_out.weight"]) and entry.dtype == torch.bfloat16

    # Read back by OLMo-core's loader (into a fresh model) and by DCP's loader.
    assert_same(load_olmo_core_model(step10), fp32)
    assert_same(load_olmo_core_model(run / "step20" / "model_and_optim"), bf16)
    assert_same(load_dcp(run / "step20" / "model_and_optim", bf16), bf16)

    # A model-only DCP folder (what ModelMergeCallback writes) loads the same way.
    model = olmo_core_model()
    model.load_state_dict({k.removeprefix("model."): v for k, v in fp32.items()})
    save_state_dict(str(tmp_path / "merged" / "model_and_optim"), {"model": model.state_dict()})
    assert_same(load_olmo_core_model(tmp_path / "merged"), fp32)
    assert all(
        k.startswith("model.") for k in read_dcp_metadata(tmp_path / "merged" / "model_and_optim").state_dict_metadata
    )


# --------------------------------------------------------------------------------------------
# torchtitan


def test_torchtitan_runs_sharded_layouts(tmp_path):
    modern, old, final = write_torchtitan_runs(
        [
            TitanRun(tmp_path / "modern", (3, 5)),
            TitanRun(tmp_path / "old", (4,), prefixed=True),
            TitanRun(tmp_path / "final", (6,), model_only=True, export_dtype=torch.bfloat16),
        ]
    )
    assert sorted(modern) == [3, 5] and sorted(old) == [4] and sorted(final) == [6]
    assert_steps_differ(modern[3], modern[5])
    fqns = set(modern[5])
    assert "tok_embeddings.weight" in fqns and all(not k.startswith("model.") for k in fqns)
    assert set(old[4]) == {f"model.{f}" for f in fqns}

    for folder in ("modern/step-3", "modern/step-5", "old/step-4", "final/step-6"):
        assert {p.name for p in (tmp_path / folder).iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
        classes = pickle_classes(tmp_path / folder / ".metadata")
        assert TORCH_STORAGE_INFO in classes and ("pathlib", "PosixPath") in classes
        assert not any(m.startswith("olmo_core") for m, _ in classes)

    metadata = read_dcp_metadata(tmp_path / "modern" / "step-5")
    everything = metadata.state_dict_metadata
    tensors = tensor_keys(metadata)
    optim = {f"optimizer.state.{f}.{s}" for f in fqns for s in ("step", "exp_avg", "exp_avg_sq")}
    assert set(tensors) == fqns | optim
    assert {v.properties.dtype for v in tensors.values()} == {torch.float32}
    assert {k.split(".")[0] for k in everything} - fqns == {
        "optimizer",
        "lr_scheduler",
        "dataloader",
        "train_state",
    } | {f.split(".")[0] for f in fqns}
    assert {"lr_scheduler.last_epoch", "dataloader.dp_rank_0", "dataloader.dp_rank_1", "train_state.step"} <= set(
        everything
    )
    assert isinstance(everything["train_state.step"], BytesStorageMetadata)

    # Uneven FSDP2 shards along dimension 0, one per rank; the 1-row tensor leaves rank 1 empty.
    def chunks(key):
        return [(tuple(c.offsets), tuple(c.sizes)) for c in tensors[key].chunks]

    assert chunks("layers.0.feed_forward.w1.weight") == [((0, 0), (3, 8)), ((3, 0), (2, 8))]
    assert chunks("tok_embeddings.weight") == [((0, 0), (6, 8)), ((6, 0), (5, 8))]
    assert chunks("norm.weight") == [((0,), (4,)), ((4,), (4,))]
    assert chunks("value_head.weight") == [((0, 0), (1, 8)), ((1, 0), (0, 8))]
    assert chunks("optimizer.state.output.weight.exp_avg") == chunks("output.weight")
    assert len(tensors["optimizer.state.output.weight.step"].chunks) == 1  # replicated: stored once
    assert torch.equal(stored_entry(tmp_path / "modern" / "step-5", "output.weight"), modern[5]["output.weight"][:6])

    # The old layout: model.<fqn>, and TrainState's tensor step.
    old_meta = read_dcp_metadata(tmp_path / "old" / "step-4")
    assert set(tensor_keys(old_meta)) == set(old[4]) | optim | {"train_state.step"}
    assert tensor_keys(old_meta)["train_state.step"].properties.dtype == torch.int32
    # The last step, model only, exported in bfloat16.
    final_meta = read_dcp_metadata(tmp_path / "final" / "step-6")
    assert set(final_meta.state_dict_metadata) == fqns
    assert {v.dtype for v in final[6].values()} == {torch.bfloat16}

    for weights, folder in (
        (modern[3], "modern/step-3"),
        (modern[5], "modern/step-5"),
        (old[4], "old/step-4"),
        (final[6], "final/step-6"),
    ):
        assert_same(load_dcp(tmp_path / folder, weights), weights)
    steps = load_dcp(tmp_path / "old" / "step-4", ["train_state.step"])
    assert steps["train_state.step"].item() == 4


# --------------------------------------------------------------------------------------------
# Hugging Face


def _load_hf_folder(folder, index_name, load):
    index_path = folder / index_name
    if not index_path.exists():
        return None
    index = json.loads(index_path.read_text())
    out = {}
    for file_name in sorted(set(index["weight_map"].values())):
        out.update(load(folder / file_name))
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out


def test_hf_checkpoints(tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    def torch_load(path):
        return torch.load(path, weights_only=True)

    plain = write_hf_checkpoint(tmp_path / "a", 7)
    sharded = write_hf_checkpoint(tmp_path / "b", 8, sharded=True, trainer_files=True)
    bin_plain = write_hf_checkpoint(tmp_path / "c", 7, safe_serialization=False, dtype=torch.bfloat16)
    bin_sharded = write_hf_checkpoint(tmp_path / "d", 8, sharded=True, safe_serialization=False)
    assert len(plain) == 21 and "lm_head.weight" in plain and "model.embed_tokens.weight" in plain
    assert_steps_differ(plain, sharded)
    assert {v.dtype for v in bin_plain.values()} == {torch.bfloat16}

    configs = {"config.json", "generation_config.json"}
    a, b, c, d = (tmp_path / x / f"checkpoint-{s}" for x, s in (("a", 7), ("b", 8), ("c", 7), ("d", 8)))
    assert {p.name for p in a.iterdir()} == configs | {"model.safetensors"}
    shards = {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    trainer = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json", "training_args.bin"}
    assert {p.name for p in b.iterdir()} == configs | shards | {"model.safetensors.index.json"} | trainer
    assert {p.name for p in c.iterdir()} == configs | {"pytorch_model.bin"}
    bins = {f"pytorch_model-0000{i}-of-00003.bin" for i in (1, 2, 3)}
    assert {p.name for p in d.iterdir()} == configs | bins | {"pytorch_model.bin.index.json"}

    assert_same(load_file(a / "model.safetensors"), plain)
    assert_same(_load_hf_folder(b, "model.safetensors.index.json", load_file), sharded)
    assert_same(torch_load(c / "pytorch_model.bin"), bin_plain)
    assert_same(_load_hf_folder(d, "pytorch_model.bin.index.json", torch_load), bin_sharded)
    assert json.loads((b / "trainer_state.json").read_text())["global_step"] == 8
    with pytest.raises(pickle.UnpicklingError):
        torch.load(b / "training_args.bin", weights_only=True)

    # transformers itself reads both layouts.
    for folder, weights in ((b, sharded), (d, bin_sharded)):
        model = LlamaForCausalLM.from_pretrained(folder)
        assert_same({k: v for k, v in model.state_dict().items()}, weights)


# --------------------------------------------------------------------------------------------
# torch.save


def test_torch_save_checkpoints(tmp_path):
    flat = write_torch_save_checkpoint(tmp_path, 2)
    nested = write_torch_save_checkpoint(tmp_path, 3, name="checkpoint.pth", nested=True, optimizer=True)
    assert "tok_embeddings.weight" in flat and all(k.startswith("model.") for k in nested)
    assert_same(torch.load(tmp_path / "step2" / "model.pt", weights_only=True), flat)
    obj = torch.load(tmp_path / "step3" / "checkpoint.pth", weights_only=True)
    assert obj["step"] == 3 and "state" in obj["optimizer"]
    assert_same({f"model.{k}": v for k, v in obj["model"].items()}, nested)
    assert_steps_differ(flat, {k.removeprefix("model."): v for k, v in nested.items()})


@pytest.mark.parametrize("payload", ["system", "mkdir", "exec"])
def test_malicious_pt_runs_its_payload_only_when_fully_unpickled(tmp_path, payload):
    marker = write_malicious_pt(tmp_path / "step1" / "model.pt", tmp_path / "pwned", payload=payload)
    assert marker == tmp_path / "pwned"
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "step1" / "model.pt", weights_only=True)
    assert not marker.exists()
    obj = torch.load(tmp_path / "step1" / "model.pt", weights_only=False)  # the unsafe way: the payload runs
    assert marker.exists() and torch.equal(obj["weight"], torch.ones(3, 2))


# --------------------------------------------------------------------------------------------
# plain DCP


def test_generic_dcp(tmp_path):
    first, second = write_generic_dcp(tmp_path, 4), write_generic_dcp(tmp_path, 5)
    assert {p.name for p in (tmp_path / "step4").iterdir()} == {".metadata", "__0_0.distcp"}
    assert {k: v.dtype for k, v in first.items()} == {
        "weights.linear.weight": torch.float32,
        "weights.linear.bias": torch.float32,
        "weights.embed": torch.bfloat16,
        "scale": torch.float32,
        "counter": torch.int64,
    }
    metadata = read_dcp_metadata(tmp_path / "step4")
    assert set(tensor_keys(metadata)) == set(first)
    assert {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)} == {
        "step",
        "note",
        "lrs",
    }
    classes = pickle_classes(tmp_path / "step4" / ".metadata")
    assert {TORCH_STORAGE_INFO, ("torch", "bfloat16"), ("torch", "int64"), ("pathlib", "PosixPath")} <= set(classes)
    assert_same(load_dcp(tmp_path / "step4"), first)
    assert_same(load_dcp(tmp_path / "step5"), second)
    assert not torch.equal(first["weights.embed"], second["weights.embed"])
