"""Checkpoints written by the trainers' own code (OLMo-core, torchtitan under FSDP2, transformers,
torch.save), merged locally and on an S3 server, into each output format, checked against a
float64 reference and loaded back by the trainers' own loaders."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_builders import (
    TitanRun,
    load_dcp,
    load_olmo_core_model,
    write_hf_checkpoint,
    write_hyper_parallel_checkpoint,
    write_malicious_pt,
    write_olmo_core_checkpoint,
    write_torch_save_checkpoint,
    write_torchtitan_runs,
)
from helpers import other_writer, run_cli, upload
from references import assert_equal, correctly_rounded, load_merged, reference

import ckptavg
from ckptavg import CkptavgError, MergeOptions
from ckptavg.formats import open_checkpoint
from ckptavg.io.fs import resolve
from ckptavg.merging.keys import KeyFilter


@pytest.fixture(scope="module")
def olmo_run(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("olmo") / "run"
    saved = {step: write_olmo_core_checkpoint(root, step) for step in (10, 20, 30)}
    write_olmo_core_checkpoint(root, 40, incomplete="no_marker")
    write_olmo_core_checkpoint(root, 50, incomplete="tmp")
    return root, saved


def test_olmo_core_run_is_listed_and_merged_into_each_format(olmo_run, tmp_path):
    root, saved = olmo_run
    listing = {row["name"]: row for row in json.loads(run_cli("ls", str(root), "--json").stdout)}
    assert listing["step10"]["format"] == "dcp-olmo-core" and listing["step10"]["status"] == "complete"
    assert listing["step40"]["status"].startswith("incomplete: no .metadata.json")
    assert listing["step50-tmp"]["status"].startswith("incomplete")

    expected = reference(saved, [10, 20, 30])
    # Step 40 has no completeness marker, so it is a missing step of the window, like step 45.
    with pytest.raises(CkptavgError, match="window 6-45 misses 2 steps: 40, 45"):
        ckptavg.merge(str(root), merge_step=45, window=40, out=str(tmp_path / "st"))
    ckptavg.merge(str(root), merge_step=45, window=40, out=str(tmp_path / "st"), allow_partial_window=True)
    assert_equal(load_merged(tmp_path / "st"), expected)  # model.* only: optim.* left out
    assert (tmp_path / "st" / "config.json").read_bytes() == (root / "step30" / "config.json").read_bytes()

    ckptavg.merge(
        str(root), merge_step=30, window=30, out=str(tmp_path / "dcp"), options=MergeOptions(output_format="dcp")
    )
    assert (tmp_path / "dcp" / "model_and_optim" / ".metadata").is_file()
    assert_equal(load_olmo_core_model(tmp_path / "dcp"), expected)  # OLMo-core's own loader

    ckptavg.merge(
        str(root),
        last=3,
        out=str(tmp_path / "pt"),
        options=MergeOptions(output_format="pt", keys=KeyFilter(strip_prefix="model.")),
    )
    loaded = torch.load(tmp_path / "pt" / "pytorch_model-00001-of-00001.bin", weights_only=True)
    assert_equal(loaded, {k.removeprefix("model."): v for k, v in expected.items()})


def test_olmo_core_metadata_is_read_without_olmo_core(olmo_run, tmp_path):
    """OLMo-core's .metadata names its own class; the allow-list maps it, so merging works (and
    runs no code from the pickle) where OLMo-core is not installed."""
    root, saved = olmo_run
    script = (
        "import sys; sys.modules['olmo_core'] = None\n"
        "import ckptavg\n"
        f"ckptavg.merge({str(root)!r}, last=3, out={str(tmp_path / 'out')!r})\n"
        "assert not any(m.startswith('olmo_core') and sys.modules[m] for m in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert_equal(load_merged(tmp_path / "out"), reference(saved, [10, 20, 30]))


def test_olmo_core_optimizer_moments_only_when_asked(olmo_run, tmp_path):
    root, _ = olmo_run
    keys = KeyFilter(include=("optim.state.*.exp_avg",))
    ckptavg.merge(str(root), last=3, out=str(tmp_path / "m"), options=MergeOptions(keys=keys))
    merged = load_merged(tmp_path / "m")
    name = next(iter(merged))
    sources = [load_dcp(root / f"step{s}" / "model_and_optim", [name])[name] for s in (10, 20, 30)]
    assert merged and all(k.startswith("optim.state.") and k.endswith(".exp_avg") for k in merged)
    mean = torch.stack([t.double() for t in sources]).mean(0)
    assert torch.equal(merged[name], correctly_rounded(mean, torch.float32))


@pytest.fixture(scope="module")
def titan_runs(tmp_path_factory):
    """Two torchtitan runs from one spawn of 2 gloo processes with FSDP2-sharded parameters and
    AdamW state: modern (unprefixed model keys) and older (``model.`` prefix)."""
    root = tmp_path_factory.mktemp("titan")
    modern, prefixed = write_torchtitan_runs(
        [TitanRun(root / "modern", (1, 2, 3)), TitanRun(root / "prefixed", (1, 2), prefixed=True)]
    )
    return root, modern, prefixed


def test_fsdp2_sharded_dcp_reads_what_dcp_loads(titan_runs):
    """Every key of a 2-rank FSDP2 save (uneven and empty chunks included), read through byte
    ranges, equals DCP's own load of it."""
    root, _, _ = titan_runs
    folder = root / "modern" / "step-3"
    reader = open_checkpoint(*resolve(str(folder)))
    try:
        infos = reader.tensors()
        loaded = load_dcp(folder, [info.name for info in infos])
        for info in infos:
            buffer = bytearray(info.nbytes)
            reader.read_into(info.name, 0, memoryview(buffer))
            ours = torch.frombuffer(buffer, dtype=info.dtype).reshape(info.shape) if info.nbytes else None
            assert ours is None or torch.equal(ours, loaded[info.name]), info.name
        assert any(name.startswith("optimizer.state.") for name in loaded)
    finally:
        reader.close()


def test_torchtitan_runs_merge_to_the_same_weights_either_layout(titan_runs, tmp_path):
    root, modern, prefixed = titan_runs
    ckptavg.merge(str(root / "modern"), last=3, out=str(tmp_path / "modern"))
    assert_equal(load_merged(tmp_path / "modern"), reference(modern, [1, 2, 3]))  # no optimizer.* etc.

    ckptavg.merge(
        str(root / "prefixed"),
        last=2,
        out=str(tmp_path / "old"),
        options=MergeOptions(keys=KeyFilter(strip_prefix="model.")),
    )
    expected = {k.removeprefix("model."): v for k, v in reference(prefixed, [1, 2]).items()}
    assert_equal(load_merged(tmp_path / "old"), expected)

    ckptavg.merge(str(root / "modern"), last=3, out=str(tmp_path / "dcp"), options=MergeOptions(output_format="dcp"))
    expected = reference(modern, [1, 2, 3])
    assert_equal(load_dcp(tmp_path / "dcp", list(expected)), expected)


def test_hf_checkpoints_safetensors_and_bin_load_with_from_pretrained(tmp_path):
    from transformers import LlamaForCausalLM

    saved_st = {s: write_hf_checkpoint(tmp_path / "st", s, sharded=True, trainer_files=True) for s in (1, 2)}
    saved_bin = {s: write_hf_checkpoint(tmp_path / "bin", s, sharded=True, safe_serialization=False) for s in (1, 2)}
    for name, saved in (("st", saved_st), ("bin", saved_bin)):
        result = run_cli("merge", str(tmp_path / name), "--last", "2", "--out", str(tmp_path / f"{name}-avg"))
        assert result.returncode == 0, result.stderr
        expected = reference(saved, [1, 2])
        assert_equal(load_merged(tmp_path / f"{name}-avg"), expected)
        model = LlamaForCausalLM.from_pretrained(tmp_path / f"{name}-avg")
        assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    copied = {p.name for p in (tmp_path / "st-avg").iterdir()}
    assert {"config.json", "generation_config.json"} <= copied
    assert not copied & {"optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "trainer_state.json"}


def test_pt_checkpoints_plain_and_nested(tmp_path):
    plain = {step: write_torch_save_checkpoint(tmp_path / "plain", step) for step in (1, 2, 3)}
    nested = {s: write_torch_save_checkpoint(tmp_path / "nested", s, nested=True, optimizer=True) for s in (1, 2)}
    ckptavg.merge(str(tmp_path / "plain"), last=3, out=str(tmp_path / "a"))
    assert_equal(load_merged(tmp_path / "a"), reference(plain, [1, 2, 3]))
    ckptavg.merge(str(tmp_path / "nested"), last=2, out=str(tmp_path / "b"), options=MergeOptions(output_format="dcp"))
    expected = reference(nested, [1, 2])  # model.* only; optimizer.* left out
    assert_equal(load_dcp(tmp_path / "b", list(expected)), expected)


@pytest.mark.parametrize("payload", ["system", "mkdir", "exec"])
def test_pt_that_would_run_code_is_refused_and_not_run(tmp_path, payload):
    marker = write_malicious_pt(tmp_path / "run" / "step1" / "model.pt", payload=payload)
    result = run_cli("merge", str(tmp_path / "run"), "--last", "1")
    assert result.returncode == 1 and "refusing to unpickle" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not marker.exists()
    assert not (tmp_path / "run" / "step1-merged").exists()


def test_trainer_runs_on_s3_into_dcp_on_s3(olmo_run, titan_runs, s3_prefix, tmp_path):
    """DCP inputs read from the S3 server by byte ranges; DCP outputs written there, manifest
    last; downloaded and loaded back by OLMo-core and by DCP."""
    olmo_root, olmo_saved = olmo_run
    titan_root, modern, _ = titan_runs
    upload(olmo_root, f"{s3_prefix}/olmo")
    upload(titan_root / "modern", f"{s3_prefix}/titan")
    for name in ("olmo", "titan"):
        ckptavg.merge(
            f"{s3_prefix}/{name}", last=3, out=f"{s3_prefix}/{name}-avg", options=MergeOptions(output_format="dcp")
        )
        fs, path = other_writer(f"{s3_prefix}/{name}-avg")
        fs.get(path, str(tmp_path / name), recursive=True)
        manifest = json.loads((tmp_path / name / "ckptavg-manifest.json").read_text())
        assert manifest["format"] == "dcp" and manifest["sources"][0]["path"].startswith("s3://")
    assert_equal(load_olmo_core_model(tmp_path / "olmo"), reference(olmo_saved, [10, 20, 30]))
    expected = reference(modern, [1, 2, 3])
    assert_equal(load_dcp(tmp_path / "titan", list(expected)), expected)


def test_pt_run_on_s3_into_pt_on_s3(s3_prefix, tmp_path):
    saved = {step: write_torch_save_checkpoint(tmp_path / "run", step) for step in (1, 2)}
    upload(tmp_path / "run", f"{s3_prefix}/run")
    ckptavg.merge(f"{s3_prefix}/run", last=2, out=f"{s3_prefix}/avg", options=MergeOptions(output_format="pt"))
    fs, path = other_writer(f"{s3_prefix}/avg")
    fs.get(path, str(tmp_path / "avg"), recursive=True)
    loaded = torch.load(tmp_path / "avg" / "pytorch_model-00001-of-00001.bin", weights_only=True)
    assert_equal(loaded, reference(saved, [1, 2]))


def test_hyper_parallel_layout_merges_without_hyper_parallel(tmp_path):
    """HyperParallel's layout (own metadata classes, per-rank safetensors), written by a writer
    modelled on its code: merged exactly, in a process where its modules cannot be imported."""
    saved = {step: write_hyper_parallel_checkpoint(tmp_path / "run", step) for step in (100, 200)}
    listing = json.loads(run_cli("ls", str(tmp_path / "run"), "--json").stdout)
    assert [(row["step"], row["format"], row["status"]) for row in listing] == [
        (100, "dcp-hyper-parallel", "complete"),
        (200, "dcp-hyper-parallel", "complete"),
    ]
    result = run_cli("merge", str(tmp_path / "run"), "--last", "2", "--out", str(tmp_path / "avg"))
    assert result.returncode == 0, result.stderr
    assert_equal(load_merged(tmp_path / "avg"), reference(saved, [100, 200]))


def test_megatron_output_carries_the_model_objects_not_the_trainer_state(tmp_path):
    """A Megatron folder whose optimizer state is a pickled object (the DistributedOptimizer's
    layouts store it so; they need CUDA to write): the dcp output carries the model's objects
    from the newest source, never the newest optimizer's beside averaged weights."""
    import torch.distributed.checkpoint as dcp

    for step in (10, 20):
        folder = tmp_path / "run" / f"iter_{step:07d}"
        state = {
            "decoder.weight": torch.full((3,), float(step)),
            "decoder.linear._extra_state/shard_0_1": [None],
            "rng_state/shard_0.0_1.1": [{"seed": step}],
            "optimizer.distributed.dp_group_idx_0/shard_0_1": [{"step": step}],
        }
        # Not flattened: each list is one byte item, as Megatron saves a ShardedObject.
        dcp.save(
            state, checkpoint_id=str(folder), no_dist=True, planner=dcp.DefaultSavePlanner(flatten_state_dict=False)
        )
        torch.save({"iteration": step}, folder / "common.pt")
        (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))

    ckptavg.merge(str(tmp_path / "run"), last=2, out=str(tmp_path / "d"), options=MergeOptions(output_format="dcp"))
    manifest = json.loads((tmp_path / "d" / "ckptavg-manifest.json").read_text())
    assert sorted(manifest["copied"]["items"]) == ["decoder.linear._extra_state/shard_0_1", "rng_state/shard_0.0_1.1"]
    target = {"decoder.weight": torch.zeros(3), "rng_state/shard_0.0_1.1": [{}]}
    assert (tmp_path / "d" / "latest_checkpointed_iteration.txt").read_text() == "20"
    dcp.load(
        target,
        checkpoint_id=str(tmp_path / "d" / "iter_0000020"),
        no_dist=True,
        planner=dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
    )
    assert torch.equal(target["decoder.weight"], torch.full((3,), 15.0))
    assert target["rng_state/shard_0.0_1.1"] == [{"seed": 20}]
    # What dist_checkpointing.load needs: metadata.json as saved, common.pt with the merge's
    # provenance, which says the optimizer's state (an object) was not merged.
    newest, carried = tmp_path / "run" / "iter_0000020", tmp_path / "d" / "iter_0000020"
    assert (carried / "metadata.json").read_bytes() == (newest / "metadata.json").read_bytes()
    common = torch.load(carried / "common.pt", weights_only=True)
    assert common["iteration"] == 20 and common["weighted_merge_provenance"]["optimizer_merged"] is False
    # Outputs of weights only take none of the trainer's files: common.pt holds its args and the
    # optimizer's param groups, and metadata.json would call a safetensors folder torch_dist.
    for output_format in ("safetensors", "pt"):
        out = tmp_path / output_format
        ckptavg.merge(str(tmp_path / "run"), last=2, out=str(out), options=MergeOptions(output_format=output_format))
        names = {p.name for p in out.iterdir()}
        assert not names & {"common.pt", "metadata.json"}, names
        assert json.loads((out / "ckptavg-manifest.json").read_text()).get("copied") is None
