"""Megatron-core ``dist_checkpointing`` (torch_dist) checkpoints saved by the real megatron-core on
CPU (a 2-process tensor-parallel run in fp32, a 1-process run in bf16 with fp32 master weights),
listed and merged through the command line, checked against a float64 mean read independently
with torch's DCP loader, loaded back with ``dist_checkpointing.load``, and resumed from as
Megatron-LM's ``--load`` with ``--no-load-optim --no-load-rng`` does."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from checkpoint_builders import load_dcp, read_dcp_metadata
from helpers import run_cli_in_process
from megatron_builder import LoadedShard, MegatronWorkers
from references import correctly_rounded, load_merged

import ckptavg

if importlib.util.find_spec("megatron.core") is None:  # a find, not an import: megatron takes ~5 s to import
    pytest.skip("megatron-core is not installed (pip install megatron-core)", allow_module_level=True)

STEPS = (10, 20, 30)
NEWEST = f"iter_{STEPS[-1]:07d}"
TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class Runs:
    workers: MegatronWorkers
    tp2: Path
    """fp32, saved by 2 processes with tensor parallelism 2."""
    bf16: Path
    """bf16 parameters (fp32 master weights in the optimizer), saved by 1 process."""


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """Both runs, written once; the workers stay up to load the merged outputs."""
    workers = MegatronWorkers()
    try:
        root = tmp_path_factory.mktemp("megatron")
        workers.save_run(root / "tp2", list(STEPS), world=2)
        workers.save_run(root / "bf16", list(STEPS), world=1, dtype="bf16")
        yield Runs(workers, root / "tp2", root / "bf16")
    finally:
        workers.close()


def merge(*args: str) -> None:
    result = run_cli_in_process("merge", *args)
    assert result.returncode == 0, result.stderr


def mean_of_sources(run: Path, steps: tuple[int, ...] = STEPS) -> dict[str, torch.Tensor]:
    """Every tensor key of the run's checkpoints at ``steps``, averaged in float64 and correctly
    rounded to its dtype: the sources read by torch's own DCP loader."""
    sources = [load_dcp(run / f"iter_{step:07d}") for step in steps]
    return {
        key: correctly_rounded(torch.stack([s[key].double() for s in sources]).mean(0), value.dtype)
        for key, value in sources[0].items()
    }


def model_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value for key, value in tensors.items() if not key.startswith("optimizer.")}


def assert_same(merged: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(merged) == sorted(expected)
    for key, value in expected.items():
        assert merged[key].dtype == value.dtype and torch.equal(merged[key], value), key


def assert_loaded(ranks: list, expected: dict[str, torch.Tensor]) -> None:
    """Every rank got back every key it asked for (its own shard of it), equal to the merge."""
    for shards, _ in ranks:
        assert {shard.key for shard in shards} == set(expected)
        for shard in shards:
            assert isinstance(shard, LoadedShard)
            want = shard.of(expected[shard.key])
            assert shard.tensor.dtype == want.dtype and torch.equal(shard.tensor, want), (shard.key, shard.offset)


def byte_items(folder: Path) -> dict[str, bytes]:
    """The stored bytes of every byte item of a DCP folder (a pickle, never loaded here)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_dcp_metadata(folder)
    items = {}
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata):
            with open(folder / info.relative_path, "rb") as handle:
                handle.seek(info.offset)
                items[index.fqn] = handle.read(info.length)
    return items


def test_iteration_folders_are_listed(megatron, tmp_path):
    assert (megatron.tp2 / "latest_checkpointed_iteration.txt").read_text() == str(STEPS[-1])
    run = tmp_path / "run"
    shutil.copytree(megatron.tp2, run)
    (run / "iter_0000040").mkdir()  # a save that died before metadata.json, written last
    shutil.copy(run / NEWEST / "common.pt", run / "iter_0000040")
    shutil.copy(run / NEWEST / "__0_0.distcp", run / "iter_0000040")
    result = run_cli_in_process("ls", str(run), "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert sorted(rows) == ["iter_0000010", "iter_0000020", "iter_0000030", "iter_0000040"]
    assert [rows[f"iter_{s:07d}"]["step"] for s in STEPS] == list(STEPS)
    assert {rows[f"iter_{s:07d}"]["format"] for s in STEPS} == {"dcp-megatron"}
    assert {rows[f"iter_{s:07d}"]["status"] for s in STEPS} == {"complete"}
    assert (
        rows["iter_0000040"]["status"]
        == "incomplete: no metadata.json (Megatron writes it last: the save did not finish)"
    )


def test_tensor_parallel_run_merges_to_the_mean_and_loads_back_in_megatron(megatron, tmp_path):
    out = tmp_path / "merged"
    merge(str(megatron.tp2), "--last", "3", "--format", "dcp", "--out", str(out))
    checkpoint = out / NEWEST  # the layout Megatron-LM's --load takes (the next test)
    expected = model_weights(mean_of_sources(megatron.tp2))
    assert_same(load_dcp(checkpoint), expected)  # weights only: no optimizer state
    assert not any("_extra_state" in key or key.startswith("rng_state") for key in expected)

    # The pickled objects and files megatron needs, as the newest source holds them (common.pt
    # rewritten for the output: test_common_pt_records_the_merge_and_lists_no_optimizer_state...).
    newest = megatron.tp2 / NEWEST
    source_items = byte_items(newest)
    assert any(name.startswith("rng_state/") for name in source_items)
    assert any("._extra_state/" in name for name in source_items)
    assert byte_items(checkpoint) == source_items
    assert (checkpoint / "metadata.json").read_bytes() == (newest / "metadata.json").read_bytes()
    manifest = json.loads((out / "ckptavg-manifest.json").read_text())
    assert manifest["copied"]["source"] == str(newest)
    assert sorted(manifest["copied"]["items"]) == sorted(source_items)
    assert all(why for why in manifest["copied"]["items"].values())
    assert {f"{NEWEST}/common.pt", f"{NEWEST}/metadata.json", TRACKER} <= set(manifest["files"])

    # Megatron's own loader, into the sharded state dict the model builds: with the same tensor
    # parallelism (RNG state too), and resharded to one process (the RNG state is per TP rank).
    assert_loaded(megatron.workers.load(checkpoint, world=2), expected)
    assert_loaded(megatron.workers.load(checkpoint, world=1, rng=False), expected)


def test_dcp_output_is_the_folder_megatron_loads_named_by_the_iteration_it_resumes_from(megatron, tmp_path):
    """``--format dcp`` of a Megatron run writes what Megatron-LM's --load takes as it is (as
    the peer, Megatron-LM's weighted_merge.py, does): ``iter_NNNNNNN/`` beside the tracker file
    naming it, the iteration that the carried common.pt records (the newest source's: the merge
    step whenever the window holds it); ``ls`` and ``verify --against`` read the output."""
    run = tmp_path / "run"
    shutil.copytree(megatron.tp2, run)
    merge(str(run), "--merge-step", "30", "--window", "30", "--min-gap", "20", "--format", "dcp")
    out = run / "step30-merged"
    assert sorted(p.name for p in out.iterdir()) == ["ckptavg-manifest.json", NEWEST, TRACKER]
    assert (out / TRACKER).read_text() == "30"  # as Megatron-LM writes it
    assert sorted(p.name for p in (out / NEWEST).iterdir()) == sorted(
        [".metadata", "__0_0.distcp", "__0_1.distcp", "common.pt", "metadata.json"]
    )
    assert_same(load_dcp(out / NEWEST), model_weights(mean_of_sources(run, (10, 30))))  # --min-gap 20: 30, 10

    listed = {row["name"]: row for row in json.loads(run_cli_in_process("ls", str(run), "--json").stdout)}
    assert (listed["step30-merged"]["format"], listed["step30-merged"]["status"]) == ("dcp-megatron", "merged")
    verified = run_cli_in_process("verify", str(out), "--against", str(run), "--sample", "100", "--json")
    assert verified.returncode == 0, verified.stderr
    assert sorted(json.loads(verified.stdout)["recomputed"]) == sorted(model_weights(mean_of_sources(run, (10, 30))))

    # A window that misses its merge step: the newest source's common.pt says 20, and so do the
    # folder and the tracker (Megatron-LM would resume from 20 whatever the folder's name).
    merge(str(run), "--merge-step", "25", "--window", "20", "--allow-partial-window", "--format", "dcp")
    assert (run / "step25-merged" / TRACKER).read_text() == "20"
    assert load_common(run / "step25-merged" / "iter_0000020")["iteration"] == 20


def test_megatron_resumes_from_the_merge_without_optimizer_and_rng(megatron, tmp_path):
    """Megatron-LM's resume from ``--load`` with ``--no-load-optim --no-load-rng`` (as the peer
    documents for its merges), as far as megatron-core goes without Megatron-LM's training loop:
    the tracker, then the folder it names, the iteration from common.pt, the model's weights
    into the model (at the saved tensor parallelism and resharded), a bf16 model's fp32 master
    weights taken from it, and a training step from there."""
    tp2, bf16 = tmp_path / "tp2", tmp_path / "bf16"
    merge(str(megatron.tp2), "--merge-step", "30", "--window", "20", "--format", "dcp", "--out", str(tp2))
    merge(str(megatron.bf16), "--last", "3", "--format", "dcp", "--out", str(bf16))
    for out, run, steps, dtype, worlds in (
        (tp2, megatron.tp2, (20, 30), "fp32", (2, 1)),
        (bf16, megatron.bf16, STEPS, "bf16", (1,)),
    ):
        expected = model_weights(mean_of_sources(run, steps))
        for world in worlds:
            ranks = megatron.workers.resume(out, world=world, dtype=dtype, flags=("--no-load-optim", "--no-load-rng"))
            assert [(iteration, rng) for iteration, _, rng in ranks] == [(30, None)] * world
            assert_loaded([(shards, None) for _, shards, _ in ranks], expected)


def test_bf16_run_merges_weights_and_on_request_the_fp32_master_weights(megatron, tmp_path):
    means = mean_of_sources(megatron.bf16)
    masters = {k: v for k, v in means.items() if k.startswith("optimizer.state.fp32_param.")}
    assert masters and all(v.dtype == torch.float32 for v in masters.values())
    weights = model_weights(means)
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}

    merge(str(megatron.bf16), "--last", "3", "--out", str(tmp_path / "default"))
    assert_same(load_merged(tmp_path / "default"), weights)  # Megatron's key names, layers stacked

    prefix = "optimizer.state.fp32_param."
    merge(
        str(megatron.bf16),
        "--last",
        "3",
        "--include",
        f"{prefix}*",
        "--strip-prefix",
        prefix,
        "--out",
        str(tmp_path / "fp32"),
    )
    assert_same(load_merged(tmp_path / "fp32"), {k.removeprefix(prefix): v for k, v in masters.items()})

    # Everything, optimizer included, loads back with megatron's bf16 optimizer.
    merge(str(megatron.bf16), "--last", "3", "--include", "*", "--format", "dcp", "--out", str(tmp_path / "all"))
    assert_same(load_dcp(tmp_path / "all" / NEWEST), means)
    assert_loaded(megatron.workers.load(tmp_path / "all" / NEWEST, world=1, dtype="bf16", optimizer=True), means)


def load_common(folder: Path) -> dict:
    """A folder's common.pt, as torch loads it with weights only (Megatron-LM's args: a Namespace)."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(folder / "common.pt", weights_only=True)


def seeded_rng(step: int) -> torch.Tensor:
    """torch's RNG state that the builder saves at ``step`` (megatron_builder._rng_state)."""
    return torch.Generator().manual_seed(step).get_state()


def test_common_pt_records_the_merge_and_lists_no_optimizer_state_the_output_lacks(megatron, tmp_path):
    """The output's common.pt is the carried source's with the merge's provenance under
    Megatron-LM's weighted_merge.py's key and field names; where the output holds no optimizer
    state, its common part is left out and the args say no_save_optim (as a --no-save-optim
    save); where it holds all of it (--include '*'), the optimizer part stays as it was."""
    run = megatron.tp2
    merge(str(run), "--steps", "10,20,30", "--weights", "1,2,3", "--format", "dcp", "--out", str(tmp_path / "w"))
    source, merged = load_common(run / NEWEST), load_common(tmp_path / "w" / NEWEST)
    assert merged.pop("weighted_merge_provenance") == {
        "format_version": 1,
        "tool": "ckptavg",
        "tool_version": ckptavg.__version__,
        "input_paths": [str(run / f"iter_{step:07d}") for step in STEPS],
        "source_iterations": list(STEPS),
        "weights": pytest.approx([1 / 6, 2 / 6, 3 / 6], rel=1e-15),
        "normalize": True,
        "merge_style": "explicit",
        "output_dtype": "same as input",
        "extra_state_source_index": 2,
        "extra_state_source_path": str(run / NEWEST),
        "output_iteration": 30,
        "optimizer_merged": False,
        "rng_merged": False,
    }
    assert "optimizer" in source and "optimizer" not in merged
    assert vars(merged.pop("args")) == {**vars(source.pop("args")), "no_save_optim": True}
    source.pop("optimizer")
    assert merged == source

    merge(str(megatron.bf16), "--last", "3", "--include", "*", "--format", "dcp", "--out", str(tmp_path / "all"))
    source, merged = load_common(megatron.bf16 / NEWEST), load_common(tmp_path / "all" / NEWEST)
    provenance = merged.pop("weighted_merge_provenance")
    assert (provenance["optimizer_merged"], provenance["merge_style"]) == (True, "uniform")
    common_step = source["optimizer"]["optimizer"]["state"].pop("common_step")
    assert torch.equal(merged["optimizer"]["optimizer"]["state"].pop("common_step"), common_step)
    assert vars(merged.pop("args")) == vars(source.pop("args"))
    assert merged == source


def test_megatron_resume_from_the_merge_by_default_and_with_each_flag(megatron, tmp_path):
    """Megatron-LM's load_checkpoint (tests/megatron_builder._resume) from the output: by
    default it asks the output for no optimizer state (common.pt's args say none was saved), loads
    the model and stops with its own message at the optimizer, which has nothing to load (an
    optimizer cannot resume without its state: no common.pt avoids that); with --no-load-optim it
    resumes with the carried RNG state at the saved tensor parallelism (ignored at another), with
    --finetune from iteration 0; an output that averaged the optimizer state too resumes by
    default."""
    out = tmp_path / "merged"
    merge(str(megatron.tp2), "--last", "3", "--format", "dcp", "--out", str(out))
    expected = model_weights(mean_of_sources(megatron.tp2))
    refused = "Unable to load optimizer from checkpoint .*Specify --no-load-optim or --finetune"
    with pytest.raises(RuntimeError, match=refused):
        megatron.workers.resume(out, world=2)
    for world, flags, iteration, rng in (
        (2, ("--no-load-optim",), 30, seeded_rng(30)),
        (1, ("--no-load-optim",), 30, None),
        (2, ("--finetune",), 0, None),
    ):
        ranks = megatron.workers.resume(out, world=world, flags=flags)
        assert [resumed for resumed, _, _ in ranks] == [iteration] * world
        assert all((restored is None) if rng is None else torch.equal(restored, rng) for _, _, restored in ranks)
        assert_loaded([(shards, None) for _, shards, _ in ranks], expected)

    merge(str(megatron.tp2), "--last", "3", "--include", "*", "--format", "dcp", "--out", str(tmp_path / "all"))
    ranks = megatron.workers.resume(tmp_path / "all", world=2)
    assert [(resumed, torch.equal(rng, seeded_rng(30))) for resumed, _, rng in ranks] == [(30, True)] * 2


def test_copy_from_chooses_the_source_of_common_pt_rng_and_extra_state(megatron, tmp_path):
    """--copy-from (the newest by default) names the source whose common.pt, metadata.json and
    byte items (RNG state, each layer's _extra_state) a DCP output carries, and so the iteration
    it is laid out as and resumes from; the weights are still the mean of every source."""
    run, out = megatron.tp2, tmp_path / "merged"
    merge(str(run), "--last", "3", "--copy-from", "20", "--format", "dcp", "--out", str(out))
    chosen, folder = run / "iter_0000020", out / "iter_0000020"
    assert sorted(p.name for p in out.iterdir()) == ["ckptavg-manifest.json", "iter_0000020", TRACKER]
    assert (out / TRACKER).read_text() == "20"
    assert_same(load_dcp(folder), model_weights(mean_of_sources(run)))
    assert byte_items(folder) == byte_items(chosen) != byte_items(run / NEWEST)
    assert (folder / "metadata.json").read_bytes() == (chosen / "metadata.json").read_bytes()
    merged, source = load_common(folder), load_common(chosen)
    assert (merged["iteration"], merged["opt_param_scheduler"]) == (20, source["opt_param_scheduler"])
    provenance = merged["weighted_merge_provenance"]
    assert (provenance["extra_state_source_index"], provenance["extra_state_source_path"]) == (1, str(chosen))
    assert json.loads((out / "ckptavg-manifest.json").read_text())["copied"]["source"] == str(chosen)
    ranks = megatron.workers.resume(out, world=2, flags=("--no-load-optim",))
    assert [(resumed, torch.equal(rng, seeded_rng(20))) for resumed, _, rng in ranks] == [(20, True)] * 2
    # Carried from another source, it is another merge: no rerun of this one, refused over it.
    again = run_cli_in_process("merge", str(run), "--last", "3", "--format", "dcp", "--out", str(out))
    assert again.returncode == 1 and "already merged" not in again.stderr, again.stderr
