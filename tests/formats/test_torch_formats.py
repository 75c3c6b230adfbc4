"""torch.save archives and DCP folders read as byte ranges; DCP and .pt outputs; key selection."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_builders import read_dcp_metadata
from helpers import run_cli, write_checkpoint
from references import correctly_rounded, grid_of, load_merged, nearest_by_search, same_bits

import ckptavg
from ckptavg import CkptavgError, MergeOptions
from ckptavg.formats import open_checkpoint
from ckptavg.formats.torch_save import read_tensor_table
from ckptavg.io.files import RandomAccessFile
from ckptavg.io.fs import resolve
from ckptavg.merging.keys import KeyFilter


def _table(path: Path):
    file = RandomAccessFile(*resolve(str(path)))
    try:
        table = read_tensor_table(file, 0, file.size, str(path))
        out = {}
        for key, stored in table.items():
            buffer = bytearray(stored.nbytes)
            file.read_into(stored.offset, memoryview(buffer))
            out[key] = torch.frombuffer(buffer, dtype=stored.dtype).reshape(stored.shape) if stored.nbytes else None
        return out
    finally:
        file.close()


def test_torch_save_tables_match_torch_load(tmp_path):
    linear = torch.nn.Linear(5, 3)
    embed = torch.randn(7, 2).bfloat16()
    obj = {
        "model": {**linear.state_dict(), "embed": embed, "tied": embed, "count": torch.tensor(4)},
        "p": torch.nn.Parameter(torch.ones(2, dtype=torch.float64)),
        "step": 3,
        "name": "run",
        "groups": [{"lr": 0.1}],
    }
    torch.save(obj, tmp_path / "a.pt")
    got = _table(tmp_path / "a.pt")
    expected = torch.load(tmp_path / "a.pt", weights_only=True)
    flat = {f"model.{k}": v for k, v in expected["model"].items()} | {"p": expected["p"]}
    assert set(got) == set(flat)
    for key, value in flat.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value.detach()), key


def test_a_pickle_that_runs_code_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"w": torch.ones(2), "x": Payload()}, tmp_path / "evil.pt")
    (tmp_path / "run" / "step1").mkdir(parents=True)
    (tmp_path / "evil.pt").rename(tmp_path / "run" / "step1" / "model.pt")
    result = run_cli("merge", str(tmp_path / "run"), "--last", "1")
    assert result.returncode == 1
    assert "refusing to unpickle" in result.stderr and "model.pt" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not marker.exists()
    assert not (tmp_path / "run" / "step1-merged").exists()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: torch.save({"w": torch.ones(3)}, p, _use_new_zipfile_serialization=False), "legacy"),
        (lambda p: torch.save({"w": torch.ones(3, 4).t()}, p), "strided view"),
        (lambda p: p.write_bytes(b"PK\x03\x04 not really a zip"), "not a torch.save archive"),
    ],
)
def test_unreadable_torch_files_get_one_clean_error(tmp_path, make, message):
    make(tmp_path / "x.pt")
    with pytest.raises(CkptavgError, match=message):
        _table(tmp_path / "x.pt")


def test_truncated_pt_is_named(tmp_path):
    torch.save({"w": torch.ones(1000)}, tmp_path / "x.pt")
    data = (tmp_path / "x.pt").read_bytes()
    (tmp_path / "x.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CkptavgError, match="x.pt"):
        _table(tmp_path / "x.pt")


def _dcp_run(root: Path, steps=(10, 20, 30)):
    """Plain DCP saves of a nested state dict with weights, an integer buffer, a module's
    non-tensor state, optimizer state and a non-tensor value, as trainers write them."""
    saved = {}
    for step in steps:
        g = torch.Generator().manual_seed(step)
        state = {
            "model": {
                "w": torch.randn(6, 5, generator=g),
                "b": torch.randn(7, generator=g).bfloat16(),
                "count": torch.tensor(11),
                "extra": {"note": f"step {step}"},
            },
            "optimizer": {"state": {"w": {"exp_avg": torch.randn(6, 5, generator=g)}}},
            "train_state": {"step": step},
        }
        dcp.save(state, checkpoint_id=str(root / f"step-{step}"), no_dist=True)
        saved[step] = state
    return saved


def _mean(tensors, dtype):
    return correctly_rounded(torch.stack([t.double() for t in tensors]).mean(0), dtype)


def test_dcp_fast_path_reads_what_dcp_loads(tmp_path):
    """Every key read through byte ranges equals what DCP's own loader gives."""
    _dcp_run(tmp_path, steps=(10,))
    folder = tmp_path / "step-10"
    reader = open_checkpoint(*resolve(str(folder)))
    try:
        for info in reader.tensors():
            buffer = bytearray(info.nbytes)
            reader.read_into(info.name, 0, memoryview(buffer))
            ours = torch.frombuffer(buffer, dtype=info.dtype).reshape(info.shape)
            target = {info.name: torch.empty(info.shape, dtype=info.dtype)}
            dcp.load(target, checkpoint_id=str(folder), no_dist=True)
            assert torch.equal(ours, target[info.name]), info.name
    finally:
        reader.close()


def test_dcp_merge_defaults_to_model_weights_and_loads_back_in_each_format(tmp_path):
    saved = _dcp_run(tmp_path / "run")
    ref_w = _mean([s["model"]["w"] for s in saved.values()], torch.float32)
    ref_b = _mean([s["model"]["b"] for s in saved.values()], torch.bfloat16)

    ckptavg.merge(str(tmp_path / "run"), last=3, out=str(tmp_path / "st"))
    merged = load_merged(tmp_path / "st")
    assert set(merged) == {"model.w", "model.b", "model.count"}
    assert torch.equal(merged["model.w"], ref_w) and torch.equal(merged["model.b"], ref_b)
    assert int(merged["model.count"]) == 11
    manifest = json.loads((tmp_path / "st" / "ckptavg-manifest.json").read_text())
    assert manifest["keys"]["left_out"] == 1 and manifest["sources"][0]["format"] == "dcp"

    # The model's pickled object comes from the newest source, as stored; trainer state does not.
    ckptavg.merge(str(tmp_path / "run"), last=3, out=str(tmp_path / "d"), options=MergeOptions(output_format="dcp"))
    model = {"w": torch.zeros(6, 5), "b": torch.zeros(7, dtype=torch.bfloat16), "count": torch.tensor(0)}
    target = {"model": {**model, "extra": {"note": ""}}}
    dcp.load(target, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    assert torch.equal(target["model"]["w"], ref_w) and torch.equal(target["model"]["b"], ref_b)
    assert int(target["model"]["count"]) == 11 and target["model"]["extra"]["note"] == "step 30"
    manifest = json.loads((tmp_path / "d" / "ckptavg-manifest.json").read_text())
    assert list(manifest["copied"]["items"]) == ["model.extra.note"]
    assert manifest["copied"]["source"] == str(tmp_path / "run" / "step-30")

    ckptavg.merge(str(tmp_path / "run"), last=3, out=str(tmp_path / "p"), options=MergeOptions(output_format="pt"))
    loaded = torch.load(tmp_path / "p" / "pytorch_model-00001-of-00001.bin", weights_only=True)
    assert torch.equal(loaded["model.w"], ref_w) and torch.equal(loaded["model.b"], ref_b)
    index = json.loads((tmp_path / "p" / "pytorch_model.bin.index.json").read_text())
    assert set(index["weight_map"]) == set(loaded)


def test_dcp_and_pt_outputs_are_read_back_as_sources(tmp_path):
    """A merged DCP or .pt folder is itself a checkpoint ckptavg reads (round trip)."""
    saved = _dcp_run(tmp_path / "run", steps=(10, 20))
    ref = _mean([s["model"]["w"] for s in saved.values()], torch.float32)
    for fmt in ("dcp", "pt"):
        out = tmp_path / f"{fmt}-out"
        ckptavg.merge(str(tmp_path / "run"), last=2, out=str(out), options=MergeOptions(output_format=fmt))
        ckptavg.average([str(out)], str(tmp_path / f"{fmt}-again"))
        assert torch.equal(load_merged(tmp_path / f"{fmt}-again")["model.w"], ref), fmt


def test_include_exclude_and_strip_prefix(tmp_path):
    saved = _dcp_run(tmp_path / "run", steps=(10, 20))
    keys = KeyFilter(include=("model.*", "optimizer.state.*.exp_avg"), exclude=("*.count",), strip_prefix="model.")
    ckptavg.merge(str(tmp_path / "run"), last=2, out=str(tmp_path / "o"), options=MergeOptions(keys=keys))
    merged = load_merged(tmp_path / "o")
    assert set(merged) == {"w", "b", "optimizer.state.w.exp_avg"}
    ref = _mean([s["optimizer"]["state"]["w"]["exp_avg"] for s in saved.values()], torch.float32)
    assert torch.equal(merged["optimizer.state.w.exp_avg"], ref)

    result = run_cli(
        "merge", str(tmp_path / "run"), "--last", "2", "--include", "nothing.*", "--out", str(tmp_path / "none")
    )
    assert result.returncode == 1 and "no tensor selected" in result.stderr
    assert not (tmp_path / "none").exists()


def test_strip_prefix_collisions_are_refused(tmp_path):
    state = {"model": {"w": torch.ones(2)}, "w": torch.zeros(2)}
    dcp.save(state, checkpoint_id=str(tmp_path / "run" / "step-1"), no_dist=True)
    with pytest.raises(CkptavgError, match="both become 'w'"):
        ckptavg.merge(str(tmp_path / "run"), last=1, options=MergeOptions(keys=KeyFilter(strip_prefix="model.")))


def test_dcp_without_metadata_is_incomplete(tmp_path):
    _dcp_run(tmp_path / "run", steps=(10, 20))
    (tmp_path / "run" / "step-20" / ".metadata").unlink()
    result = run_cli("ls", str(tmp_path / "run"))
    assert "incomplete: no .metadata" in result.stdout
    selected = ckptavg.select(str(tmp_path / "run"), last=1)
    assert [c.step for c in selected.checkpoints] == [10]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "code"])
def test_damaged_dcp_metadata_gets_one_clean_error(tmp_path, damage):
    _dcp_run(tmp_path / "run", steps=(10,))
    path = tmp_path / "run" / "step-10" / ".metadata"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "garbage":
        path.write_bytes(b"\x80\x04garbage")
    else:
        path.write_bytes(pickle.dumps(Path.touch))  # names a global outside the allow-list
    result = run_cli("merge", str(tmp_path / "run"), "--last", "1")
    assert result.returncode == 1, result.stderr
    assert ".metadata" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_dcp_data_file_names_are_not_trusted(tmp_path):
    _dcp_run(tmp_path / "run", steps=(10,))
    folder = tmp_path / "run" / "step-10"
    metadata = read_dcp_metadata(folder)  # torch's own classes, to pickle again
    for info in metadata.storage_data.values():
        info.relative_path = "../../secret.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CkptavgError, match="refusing file name"):
        ckptavg.merge(str(tmp_path / "run"), last=1)


def test_pt_folders_single_nested_and_sharded(tmp_path):
    generator = torch.Generator().manual_seed(0)
    steps = {}
    for step in (1, 2, 3):
        weights = {"a.weight": torch.randn(4, 4, generator=generator), "b.bias": torch.randn(3, generator=generator)}
        folder = tmp_path / "run" / f"step{step}"
        folder.mkdir(parents=True)
        if step == 1:
            torch.save(weights, folder / "model.pt")
        elif step == 2:
            optimizer = {"state": {0: {"m": torch.ones(1)}}}
            torch.save({"model": weights, "optimizer": optimizer, "step": 2}, folder / "x.pt")
        else:
            torch.save({"a.weight": weights["a.weight"]}, folder / "pytorch_model-00001-of-00002.bin")
            torch.save({"b.bias": weights["b.bias"]}, folder / "pytorch_model-00002-of-00002.bin")
            index = {"a.weight": "pytorch_model-00001-of-00002.bin", "b.bias": "pytorch_model-00002-of-00002.bin"}
            (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": index}))
        steps[step] = weights
    # The nested file's keys are model.*; strip the prefix so the three layouts agree.
    for step in (1, 3):
        ckptavg.average([str(tmp_path / "run" / f"step{step}")], str(tmp_path / f"single{step}"))
    ckptavg.average(
        [str(tmp_path / "run" / "step2")],
        str(tmp_path / "single2"),
        options=MergeOptions(keys=KeyFilter(strip_prefix="model.")),
    )
    for step in (1, 2, 3):
        merged = load_merged(tmp_path / f"single{step}")
        assert set(merged) == {"a.weight", "b.bias"}, step
        assert all(torch.equal(merged[k], steps[step][k]) for k in merged)


@pytest.mark.parametrize(
    ("state", "name"),
    [
        ({"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, "a.b"),
        ({"1": torch.ones(2), 1: torch.zeros(2)}, "1"),
    ],
    ids=["dotted-and-nested", "string-and-integer-key"],
)
def test_keys_that_flatten_to_one_name_are_refused(tmp_path, state, name):
    """Nested keys are joined with dots and integer keys written as text, so two paths can give
    one name; keeping either tensor would silently drop the other."""
    torch.save(state, tmp_path / "x.pt")
    with pytest.raises(CkptavgError, match=rf"x.pt: two tensors are both named '{name}'"):
        _table(tmp_path / "x.pt")


def test_keys_that_python_cannot_print_never_stop_a_pt_merge(tmp_path):
    """Only a tensor's keys become its name: a key of 5000 digits or a tuple nested 990 deep
    (past what Python prints) above other values is never turned into text. (Above a tensor,
    such a key is one error line: tests/cli/test_bad_inputs.py.)"""
    deep: tuple = ()
    for _ in range(990):
        deep = (deep,)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)  # for the pickler, which recurses once per level of the tuple
    try:
        for step in (1, 2):
            (tmp_path / "run" / f"step{step}").mkdir(parents=True)
            state = {"w": torch.full((3,), float(step)), "meta": {10**5000: "seed", deep: "shape"}}
            torch.save(state, tmp_path / "run" / f"step{step}" / "model.pt")
    finally:
        sys.setrecursionlimit(limit)
    ckptavg.merge(str(tmp_path / "run"), last=2, out=str(tmp_path / "avg"))
    assert torch.equal(load_merged(tmp_path / "avg")["w"], torch.full((3,), 1.5))


AVERAGED_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _float8_and_unsigned(step: int) -> dict[str, torch.Tensor]:
    """Every float8 dtype (values drawn from the whole range, a new draw each step), and the
    tensors a merge copies: unsigned integers (the largest of each; uint64 past int64) and e8m0
    block scales, the same at every step."""
    generator = torch.Generator().manual_seed(step)
    tensors = {}
    for dtype in AVERAGED_FLOAT8:
        grid, _ = grid_of(dtype)
        tensors[str(dtype).split(".")[1]] = grid[torch.randint(len(grid), (4, 65), generator=generator)].to(dtype)
    tensors["uint16"] = torch.tensor([0, 1, 2**16 - 1], dtype=torch.int32).to(torch.uint16)
    tensors["uint32"] = torch.tensor([0, 2**32 - 1], dtype=torch.int64).to(torch.uint32)
    tensors["uint64"] = torch.tensor([0, -1], dtype=torch.int64).view(torch.uint64)  # 2**64 - 1
    tensors["e8m0"] = torch.tensor([0, 127, 254], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2**-127, 1, 2**127
    return tensors


def _save(folder: Path, tensors: dict[str, torch.Tensor], source_format: str) -> None:
    if source_format == "safetensors":
        write_checkpoint(folder, tensors)
    elif source_format == "pt":
        folder.mkdir(parents=True)
        torch.save(tensors, folder / "model.pt")  # float8, uint16-64, e8m0: _rebuild_tensor_v3, untyped storages
    else:
        dcp.save(tensors, checkpoint_id=str(folder), no_dist=True)


def _load_output(folder: Path, output_format: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The merged tensors as each output format's own loader gives them."""
    if output_format == "safetensors":
        return load_merged(folder)
    if output_format == "pt":
        return torch.load(folder / "pytorch_model-00001-of-00001.bin", weights_only=True)
    target = {name: torch.empty_like(tensor) for name, tensor in like.items()}
    dcp.load(target, checkpoint_id=str(folder), no_dist=True)
    return target


@pytest.mark.parametrize("source_format", ["safetensors", "pt", "dcp"])
def test_float8_and_unsigned_tensors_merge_from_and_into_every_format(tmp_path, source_format):
    """Float8 tensors of each dtype are averaged exactly (the value nearest to the mean, by
    search), unsigned integers and e8m0 scales copied, reading safetensors, torch.save and DCP
    files (written by their own libraries) and writing each output format, which its own loader
    reads back and ``verify --against`` recomputes."""
    saved = {step: _float8_and_unsigned(step) for step in (1, 2, 3)}
    for step, tensors in saved.items():
        _save(tmp_path / "run" / f"step{step}", tensors, source_format)
    for output_format in ("safetensors", "pt", "dcp"):
        out = tmp_path / output_format
        options = MergeOptions(output_format=output_format)
        ckptavg.merge(str(tmp_path / "run"), last=3, out=str(out), options=options)
        merged = _load_output(out, output_format, saved[3])
        assert set(merged) == set(saved[3])
        for name, newest in saved[3].items():
            assert merged[name].dtype == newest.dtype, (output_format, name)
            if newest.dtype in AVERAGED_FLOAT8:
                sums = sum(saved[step][name].double() for step in saved)
                assert bool((merged[name].double() == nearest_by_search(sums, 3, newest.dtype)).all()), name
            else:
                assert bool(same_bits(merged[name], newest).all()), (output_format, name)
        assert len(ckptavg.verify(str(out), against=str(tmp_path / "run"), sample=20).recomputed) == len(saved[3])
