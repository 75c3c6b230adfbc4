"""DeepSpeed checkpoints saved by DeepSpeed itself (CPU, gloo, 2 ranks), ZeRO stages 0 to 3: listed
with their stage, merged through the CLI to the correctly rounded mean of the weights DeepSpeed's
own ``zero_to_fp32`` (or ``module``, stage 0) gives, and refused in one line where the weights
cannot be put back together exactly. DeepSpeed runs only in ``deepspeed_writer.py``'s subprocess."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from deepspeed_writer import _model
from helpers import run_cli_in_process, tree_of
from references import correctly_rounded, load_merged
from safetensors.torch import load_file, save_file

from ckptavg.errors import CheckpointError
from ckptavg.formats import open_checkpoint
from ckptavg.io.files import RandomAccessFile
from ckptavg.io.fs import resolve

# Found, not imported: DeepSpeed runs only in the writer's subprocess.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed): these tests save with it",
)

WRITER = Path(__file__).parents[1] / "deepspeed_writer.py"
STEPS = [2, 4, 6]
# name: (ZeRO stage, dtype). z1_fp32's optimizer files carry an fp16 run's DynamicLossScaler;
# z2_fp32 and z3_bf16 optimize two parameter groups.
RUNS = {
    "z0_fp32": (0, "fp32"),
    "z1_fp32": (1, "fp32"),
    "z2_fp32": (2, "fp32"),
    "z3_fp32": (3, "fp32"),
    "z2_bf16": (2, "bf16"),
    "z3_bf16": (3, "bf16"),
}
Views = dict[int, dict[str, dict[str, torch.Tensor]]]


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory) -> dict[str, tuple[Path, Views]]:
    """Every run of RUNS, saved by one DeepSpeed spawn (~15 s on 2 cores), with DeepSpeed's own
    view of each step's weights."""
    root = tmp_path_factory.mktemp("deepspeed")
    runs = [
        {
            "dir": str(root / name),
            "stage": stage,
            "dtype": dtype,
            "steps": STEPS,
            "fp16_loss_scaler": name == "z1_fp32",
            "two_groups": name in ("z2_fp32", "z3_bf16"),
        }
        for name, (stage, dtype) in RUNS.items()
    ]
    spec = root / "spec.json"
    spec.write_text(json.dumps({"world_size": 2, "result": str(root / "views.pt"), "runs": runs}))
    result = subprocess.run([sys.executable, str(WRITER), str(spec)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    views = torch.load(root / "views.pt", weights_only=True)
    return {name: (root / name, views[i]) for i, name in enumerate(RUNS)}


def _mean(views: Views, which: str) -> dict[str, torch.Tensor]:
    """The correctly rounded float64 mean over STEPS of DeepSpeed's ``which`` view, in its dtypes."""
    first = views[STEPS[0]][which]
    return {
        name: correctly_rounded(torch.stack([views[s][which][name].double() for s in STEPS]).mean(0), t.dtype)
        for name, t in first.items()
    }


def _assert_equal(merged: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(merged) == sorted(expected)
    for name, value in expected.items():
        assert merged[name].dtype == value.dtype and torch.equal(merged[name], value), name


def _merge(run: Path, out: Path, *options: str) -> dict[str, torch.Tensor]:
    result = run_cli_in_process("merge", str(run), "--last", "3", "--out", str(out), *options)
    assert result.returncode == 0, result.stderr
    return load_merged(out)


def _refusal(args: list[str], folder: Path) -> str:
    """The one error line of a merge that must fail without touching ``folder``."""
    before = tree_of(folder)
    result = run_cli_in_process(*args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("ckptavg: error: "), result.stderr
    assert tree_of(folder) == before
    return lines[0]


def test_ls_shows_each_folder_with_its_zero_stage(deepspeed_runs):
    for name, (stage, _) in RUNS.items():
        run, _ = deepspeed_runs[name]
        assert {"latest", "zero_to_fp32.py"} <= {p.name for p in run.iterdir()} or stage == 0
        rows = json.loads(run_cli_in_process("ls", str(run), "--json").stdout)
        assert [(r["name"], r["format"], r["status"]) for r in rows] == [
            (f"global_step{s}", f"deepspeed-zero{stage}", "complete") for s in STEPS
        ], name


@pytest.mark.parametrize("name", ["z0_fp32", "z1_fp32", "z2_fp32", "z3_fp32", "z3_bf16"])
def test_each_stage_merges_to_the_mean_of_what_deepspeed_reads(deepspeed_runs, tmp_path, name):
    """Stage 0: ``module``. Stages 1-3: zero_to_fp32's state dict, which under fp32 is what
    ``module`` holds (stage 1 leaves the frozen parameter out of it; ``module`` has it)."""
    run, views = deepspeed_runs[name]
    merged = _merge(run, tmp_path / "out")
    stage = RUNS[name][0]
    expected = _mean(views, "module") if stage == 0 else _mean(views, "fp32")
    if stage == 1:
        expected["frozen"] = _mean(views, "module")["frozen"]
    _assert_equal(merged, expected)
    if name == "z3_bf16":  # fp32 master weights; the frozen parameter as saved, in bf16
        assert merged["fc1.weight"].dtype == torch.float32 and merged["frozen"].dtype == torch.bfloat16
    # The merge loads back into the module DeepSpeed trained: every parameter, no other key.
    module = _model(torch)
    module.load_state_dict(merged, strict=True)
    for key, value in module.state_dict().items():
        assert torch.equal(value, merged[key].to(value.dtype)), key


def test_bf16_zero2_averages_module_and_the_fp32_masters_on_request(deepspeed_runs, tmp_path):
    run, views = deepspeed_runs["z2_bf16"]
    merged = _merge(run, tmp_path / "module")
    _assert_equal(merged, _mean(views, "module"))
    assert merged["fc1.weight"].dtype == torch.bfloat16

    masters = _merge(run, tmp_path / "fp32", "--include", "fp32.*", "--strip-prefix", "fp32.")
    _assert_equal(masters, _mean(views, "fp32"))
    assert masters["fc1.weight"].dtype == torch.float32


def test_an_fp16_runs_loss_scaler_is_read_as_an_inert_object(deepspeed_runs):
    """Optimizer files pickle DeepSpeed classes; the allow-list maps them to objects that keep
    nothing and run nothing, so DeepSpeed need not be installed (nor is it imported) to read."""
    run, views = deepspeed_runs["z1_fp32"]
    step = run / "global_step6"
    assert b"DynamicLossScaler" in (step / "zero_pp_rank_0_mp_rank_00_optim_states.pt").read_bytes()
    script = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "from ckptavg.formats import open_checkpoint\n"
        "from ckptavg.io.fs import resolve\n"
        f"reader = open_checkpoint(*resolve({str(step)!r}))\n"
        "print(reader.format_name, len(reader.tensors()))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["deepspeed-zero1", str(2 * len(views[6]["module"]))]


def _read(reader, info, chunk: int) -> torch.Tensor:
    data = bytearray(info.nbytes)
    for start in range(0, info.nbytes, chunk):
        reader.read_into(info.name, start, memoryview(data)[start : start + chunk])
    return torch.frombuffer(data, dtype=info.dtype).reshape(info.shape)


def test_zero3_reads_only_the_bytes_asked_for(deepspeed_runs, monkeypatch):
    """Each parameter is a list of byte ranges in the ranks' flat groups: a read of n bytes reads
    n bytes (never a partition), whatever the chunk, and gives zero_to_fp32's values."""
    run, views = deepspeed_runs["z3_fp32"]
    reader = open_checkpoint(*resolve(str(run / "global_step4")))
    read_bytes: list[int] = []
    original = RandomAccessFile.read_into

    def counted(self, offset, buffer):
        read_bytes.append(len(buffer))
        original(self, offset, buffer)

    monkeypatch.setattr(RandomAccessFile, "read_into", counted)
    try:
        for chunk in (4, 12, 1000):
            for info in reader.tensors():
                read_bytes.clear()
                value = _read(reader, info, chunk)
                assert sum(read_bytes) == info.nbytes and max(read_bytes) <= chunk, (info.name, chunk)
                assert torch.equal(value, views[4]["fp32"][info.name]), info.name
    finally:
        reader.close()


def test_verify_against_recomputes_a_zero3_merge(deepspeed_runs, tmp_path):
    run, _ = deepspeed_runs["z3_fp32"]
    out = tmp_path / "out"
    merged = _merge(run, out)
    result = run_cli_in_process("verify", str(out), "--against", str(run), "--sample", "100")
    assert result.returncode == 0, result.stderr
    assert f"{len(merged)} tensors recomputed from the sources: identical" in result.stdout

    # A wrong value, with the manifest's hash made to fit: only recomputing can tell.
    shard = next(out.glob("model-*.safetensors"))
    tensors = load_file(shard)
    tensors["fc2.bias"][3] += 1
    save_file(tensors, shard, metadata={"format": "pt"})
    manifest = json.loads((out / "ckptavg-manifest.json").read_text())
    manifest["files"][shard.name]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (out / "ckptavg-manifest.json").write_text(json.dumps(manifest))
    result = run_cli_in_process("verify", str(out), "--against", str(run), "--sample", "100")
    assert result.returncode == 1 and "fc2.bias" in result.stderr


def _copy(deepspeed_runs, name: str, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(deepspeed_runs[name][0], run)
    return run


@pytest.mark.parametrize("ranks_left", [2, 1])
def test_zero3_model_states_without_optimizer_files_are_refused(deepspeed_runs, tmp_path, ranks_left):
    """The model-states files of ZeRO-3 hold only placeholders; the weights are in the optimizer
    files. With those gone (one rank left: a single .pt file), nothing may be averaged."""
    run = _copy(deepspeed_runs, "z3_fp32", tmp_path)
    for path in run.glob("global_step*/*"):
        if path.name.endswith("optim_states.pt") or (ranks_left == 1 and "rank_1_" in path.name):
            path.unlink()
    line = _refusal(["merge", str(run), "--last", "3", "--out", str(tmp_path / "out")], tmp_path)
    assert "global_step" in line and "empty placeholders" in line and "zero_to_fp32.py" in line


def test_zero3_placeholders_in_a_stage_0_layout_are_refused_first(deepspeed_runs, tmp_path):
    """A placeholder ``module`` however it is named: never averaged as weights."""
    run = _copy(deepspeed_runs, "z3_fp32", tmp_path)
    for step in run.glob("global_step*"):
        for path in step.iterdir():
            if "rank_1_" in path.name or path.name.endswith("optim_states.pt"):
                path.unlink()
        (step / "zero_pp_rank_0_mp_rank_00_model_states.pt").rename(step / "mp_rank_00_model_states.pt")
    line = _refusal(["merge", str(run), "--last", "3", "--out", str(tmp_path / "out")], tmp_path)
    assert "mp_rank_00_model_states.pt" in line and "'scale' is an empty placeholder (shape [0])" in line
    assert "zero_to_fp32.py" in line


@pytest.mark.parametrize("name", ["z2_fp32", "z3_fp32"])
def test_a_world_size_that_does_not_match_the_files_is_refused(deepspeed_runs, tmp_path, name):
    """Rank 2's files, left by an earlier save with 3 ranks: the weights are split over 2."""
    run = _copy(deepspeed_runs, name, tmp_path)
    for path in run.glob("global_step*/*rank_1_*"):
        shutil.copy(path, path.with_name(path.name.replace("rank_1_", "rank_2_")))
    args = ["merge", str(run), "--last", "3", "--out", str(tmp_path / "out")]
    if name == "z2_fp32":  # ZeRO-2's module is whole; its fp32 masters are not
        args += ["--include", "fp32.*"]
    line = _refusal(args, tmp_path)
    assert "partitioned over 2 ranks" in line and "3 optimizer files" in line and "zero_to_fp32.py" in line


@pytest.mark.parametrize(
    ("extra", "what"),
    [
        ("mp_rank_01_model_states.pt", "tensor-parallel"),
        ("layer_01-model_states.pt", "pipeline-parallel or expert (MoE)"),
    ],
)
def test_saves_of_other_parallel_layouts_are_refused(deepspeed_runs, tmp_path, extra, what):
    """A model-states file per tensor-parallel slice or per pipeline layer: module alone is not the
    model, so the folder is refused rather than averaged."""
    run = _copy(deepspeed_runs, "z2_fp32", tmp_path)
    shutil.copy(run / "global_step6" / "mp_rank_00_model_states.pt", run / "global_step6" / extra)
    line = _refusal(["merge", str(run), "--last", "3", "--out", str(tmp_path / "out")], tmp_path)
    assert f"{extra} belongs to a {what} save" in line and "zero_to_fp32.py" in line


@pytest.mark.parametrize("name", ["z2_fp32", "z3_fp32"])
def test_a_folder_missing_a_ranks_files_is_incomplete(deepspeed_runs, tmp_path, name):
    """A save in progress (each rank writes its own files): listed as incomplete, never selected;
    opened all the same, it is refused."""
    run = _copy(deepspeed_runs, name, tmp_path)
    for path in (run / "global_step6").glob("*rank_1_*"):
        path.unlink()
    rows = {r["name"]: r["status"] for r in json.loads(run_cli_in_process("ls", str(run), "--json").stdout)}
    assert rows["global_step6"] == "incomplete: optimizer files of 1 of 2 ranks"
    result = run_cli_in_process("merge", str(run), "--last", "2", "--out", str(tmp_path / "out"), "--dry-run")
    assert result.returncode == 0 and "global_step6" not in result.stdout and "global_step4" in result.stdout
    with pytest.raises(CheckpointError, match=r"partitioned over 2 ranks .* 1 optimizer files.*zero_to_fp32\.py"):
        open_checkpoint(*resolve(str(run / "global_step6")))


def _edit_pickle(path: Path, old: bytes, new: bytes) -> None:
    """``path`` (a torch.save archive) with ``old`` replaced by ``new`` in its pickle, once: an
    edit at the opcode level, the data records untouched."""
    with zipfile.ZipFile(path) as archive:
        records = {info.filename: archive.read(info) for info in archive.infolist()}
    name = next(n for n in records if n.endswith("/data.pkl"))
    assert records[name].count(old) == 1, f"{old!r} is not in {path.name}'s pickle once"
    records[name] = records[name].replace(old, new)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for record, data in records.items():
            archive.writestr(record, data)


def _resave(edits: dict[Path, str]) -> None:
    """Each file of ``edits`` loaded, changed by its Python statement (on ``state``) and saved
    again by torch, in a subprocess: unpickling DeepSpeed's classes imports DeepSpeed."""
    script = "import torch\n" + "".join(
        f"state = torch.load({str(path)!r}, weights_only=False)\n{edit}\ntorch.save(state, {str(path)!r})\n"
        for path, edit in edits.items()
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_rank_whose_flat_groups_are_of_another_dtype_is_refused(deepspeed_runs, tmp_path):
    """Rank 1's flat fp32 groups turned bf16 of as many elements (the pickle names another
    storage class; the bytes stay): read as rank 0's fp32 they gave wrong numbers for most of the
    11 tensors, with exit status 0. Every rank's groups must be of rank 0's (floating) dtype."""
    run = _copy(deepspeed_runs, "z3_fp32", tmp_path)
    rank1 = run / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _edit_pickle(rank1, b"ctorch\nFloatStorage\n", b"ctorch\nBFloat16Storage\n")
    line = _refusal(["merge", str(run), "--last", "3", "--out", str(tmp_path / "out")], tmp_path)
    assert f"{rank1}: its fp32 weights are torch.bfloat16, rank 0's are torch.float32" in line


# A parameter's elements moved from rank 0's partition to rank 1's (the file sizes as DeepSpeed
# never cuts them), rank 1's values shifted by two: the concatenation zero_to_fp32.py reads is
# the same length, so only the layout can tell. (run, file, statement on ``state``, expected)
MISCUT = {
    "zero2-group": (
        "z2_fp32",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "g = state['optimizer_state_dict']['single_partition_of_fp32_groups']; g[1] = g[1][:20].clone()",
        "g = state['optimizer_state_dict']['single_partition_of_fp32_groups']; g[1] = torch.cat([g[1][:2], g[1]])",
        "its group 1 holds 20 elements where DeepSpeed saves 22 of the group's 43 over 2 ranks",
    ),
    "zero3-frozen-fragment": (
        "z3_fp32",
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
        "f = state['frozen_param_fragments']; f['frozen'] = f['frozen'][:1].clone()",
        "f = state['frozen_param_fragments']; f['frozen'] = torch.cat([f['frozen'][:1], f['frozen']])",
        "frozen parameter 'frozen' has a fragment of 1 elements, not the 2 of [4] over 2 ranks",
    ),
}


@pytest.mark.parametrize("case", MISCUT)
def test_partitions_cut_otherwise_than_deepspeed_cuts_them_are_refused(deepspeed_runs, tmp_path, case):
    name, rank0, rank1, edit0, edit1, said = MISCUT[case]
    run = _copy(deepspeed_runs, name, tmp_path)
    step = run / "global_step6"
    _resave({step / rank0: edit0, step / rank1: edit1})
    args = [
        "merge",
        str(run),
        "--last",
        "3",
        "--out",
        str(tmp_path / "out"),
        "--include",
        "fp32.*" if name == "z2_fp32" else "*",
    ]
    line = _refusal(args, tmp_path)
    assert f"{step / rank0}: {said}" in line and "zero_to_fp32.py" in line, line


# Files that name a rank's role a second time, or by a name DeepSpeed does not write, in the
# newest step: (file to add or rename to, what it is made from, the error's words).
STRAY = {
    "optim-mp-rank-unpadded": (
        "zero_pp_rank_1_mp_rank_0_optim_states.pt",
        "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "two files for rank 1's optimizer states: zero_pp_rank_1_mp_rank_00_optim_states.pt and "
        "zero_pp_rank_1_mp_rank_0_optim_states.pt",
    ),
    "model-mp-rank-unpadded": (
        "zero_pp_rank_1_mp_rank_0_model_states.pt",
        "global_step2/zero_pp_rank_1_mp_rank_00_model_states.pt",
        "two files for rank 1's model states: zero_pp_rank_1_mp_rank_00_model_states.pt and "
        "zero_pp_rank_1_mp_rank_0_model_states.pt",
    ),
    "another-save's-prefix": (
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "two files for rank 1's optimizer states: bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt and "
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ),
    "dp-rank-zero-padded": (
        "zero_pp_rank_01_mp_rank_00_optim_states.pt",
        "global_step6/zero_pp_rank_1_mp_rank_00_optim_states.pt",  # renamed: the only file of rank 1
        "zero_pp_rank_01_mp_rank_00_optim_states.pt is not a name DeepSpeed writes (it names rank 1's "
        "optimizer states zero_pp_rank_1_mp_rank_00_optim_states.pt)",
    ),
}


@pytest.mark.parametrize("case", STRAY)
def test_a_second_or_misnamed_file_for_a_rank_is_refused_naming_both(deepspeed_runs, tmp_path, case):
    """DeepSpeed names each rank's files one way (the data-parallel rank as it is, the
    model-parallel rank in two digits): a file that parses as the same rank's, left by another
    save, used to replace the real one silently; a name DeepSpeed would spell otherwise is not
    its file. Either is refused in one line naming both files."""
    name, source, said = STRAY[case]
    run = _copy(deepspeed_runs, "z3_fp32", tmp_path)
    target = run / "global_step6" / name
    if source.startswith("global_step6/"):
        (run / source).rename(target)
    else:
        shutil.copy(run / source, target)
    line = _refusal(["merge", str(run), "--last", "3", "--out", str(tmp_path / "out")], tmp_path)
    assert f"{run}/global_step6: {said}" in line, line


@pytest.mark.parametrize("output", ["safetensors", "pt", "dcp"])
def test_a_parameter_shape_holding_a_bool_is_refused(deepspeed_runs, tmp_path, output):
    """``param_shapes`` pickled with a plain tuple ``(True, 3)`` (torch.Size would make it
    ``(1, 3)``): as many elements as ``(3,)``, so the layout fits, but it published an output no
    loader reads, and ``--format pt``/``dcp`` ended in a traceback. One line, whatever the output."""
    run = _copy(deepspeed_runs, "z3_fp32", tmp_path)
    rank0 = run / "global_step6" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    _resave({rank0: "state['param_shapes'][0]['scale'] = (True, 3)"})
    line = _refusal(["merge", str(run), "--last", "3", "--out", str(tmp_path / "out"), "--format", output], tmp_path)
    assert f"{rank0}: tensor 'scale' in 'param_shapes' has shape (True, 3), not a list of integers" in line, line
