"""The bad-input corpus of ``ckptavg merge``: one case per broken, hostile or impossible input.

Every case runs the command line (in process: the typer app of ``python -m ckptavg``, so that
two dozen merges cost no interpreter start each and faults can be injected into OS calls) and
must end the same way: exit status 1; one ``ckptavg: error:`` line, without a traceback, naming
the file and the tensor or key involved; and nothing written: the test's folder (run folder,
``--out`` parent and any folder a link points to) is byte for byte what it was before.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import socket
import struct
import tracemalloc
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_builders import (
    FP8_WEIGHTS,
    deepspeed_states,
    hostile_object,
    write_deepspeed_step,
    write_fp8_checkpoint,
    write_generic_dcp,
    write_lightning_ckpt,
    write_malicious_pt,
)
from helpers import alarm, fail_writes, make_run, run_cli, run_cli_in_process, tree_of, write_checkpoint
from references import load_merged, same_bits
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

import ckptavg
import ckptavg.merging.publish as publish
from ckptavg import CheckpointError
from ckptavg.formats.layout import TensorSpec
from ckptavg.formats.parts import METADATA_KEY, Block, block_info, write_rank_file
from ckptavg.io.fs import resolve

RUN = "run"


def _weights(**overrides: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"w": torch.linspace(-1, 1, 1000, dtype=torch.bfloat16), **overrides}


def _two_steps(root: Path, step1: dict | None = None, step2: dict | None = None, shards: int = 1) -> Path:
    """run/step1 and run/step2 with the given tensors (by default the same bf16 ``w``)."""
    run = root / RUN
    write_checkpoint(run / "step1", step1 or _weights(), shards=shards)
    write_checkpoint(run / "step2", step2 or _weights(), shards=shards)
    return run


def _raw_safetensors(path: Path, header: bytes | dict, data: bytes) -> None:
    """A safetensors file with a hand-written header (the writers refuse to make broken ones)."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _index(folder: Path, weight_map: dict[str, str]) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


# -- the cases: each builds its input under ``root`` and returns the arguments after ``merge`` ----

Build = Callable[[Path, pytest.MonkeyPatch], list[str]]


@dataclass(frozen=True)
class Case:
    id: str
    build: Build
    names: tuple[str, ...]  # what the error line must name (file, tensor, rule)


def truncated(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _two_steps(root)
    path = run / "step2" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    return [str(run), "--last", "2"]


def header_length_past_end(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _two_steps(root)
    path = run / "step2" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(data) + 4096) + data[8:])
    return [str(run), "--last", "2"]


def malformed_header(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _two_steps(root)
    _raw_safetensors(run / "step2" / "model.safetensors", b'{"w": {"dtype": "BF16", "shape": [1000], ', bytes(2000))
    return [str(run), "--last", "2"]


def offsets_out_of_bounds(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _two_steps(root)
    # The file is whole; only the header lies about where ``w`` ends.
    header = {"w": {"dtype": "BF16", "shape": [1000], "data_offsets": [2000, 4000]}}
    _raw_safetensors(run / "step2" / "model.safetensors", header, bytes(2000))
    return [str(run), "--last", "2"]


def header_repeats_a_key(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    """``w`` twice: Python's json keeps the last, the safetensors library refuses the file, so a
    merge would average bytes that every other reader rejects."""
    run = _two_steps(root)
    entry = '{"dtype": "BF16", "shape": [1000], "data_offsets": [%d, %d]}'
    header = f'{{"w": {entry % (0, 2000)}, "w": {entry % (2000, 4000)}}}'.encode()
    _raw_safetensors(run / "step2" / "model.safetensors", header, bytes(4000))
    return [str(run), "--last", "2"]


def header_repeats_a_key_where_colons_hide_it(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    """A tensor's ``shape`` key twice, inside its entry, amid ``:`` in strings (one written
    ``\\u003a``) and an object nested in the entry: the text's ``:`` outnumber the keys that
    :func:`ckptavg.io.files.parse_json` counts, so it checks the pairs one by one."""
    run = _two_steps(root)
    header = (
        b'{"__metadata__": {"note": "x\\u003ay"}, "w": {"dtype": "BF16", "shape": [1000], "shape": [1000], '
        b'"data_offsets": [0, 2000], "extra": {"a:b": 1}}}'
    )
    _raw_safetensors(run / "step2" / "model.safetensors", header, bytes(2000))
    return [str(run), "--last", "2"]


def header_integer_past_the_digit_limit(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    # Python refuses to convert an integer of more than 4300 digits (a plain ValueError).
    run = _two_steps(root)
    header = b'{"w": {"dtype": "BF16", "shape": [1' + b"0" * 5000 + b'], "data_offsets": [0, 2000]}}'
    _raw_safetensors(run / "step2" / "model.safetensors", header, bytes(2000))
    return [str(run), "--last", "2"]


def index_integer_past_the_digit_limit(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _sharded(root)
    index = run / "step2" / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"total_size": ', '"total_size": 1' + "0" * 5000, 1))
    return [str(run), "--last", "2"]


def offsets_overlap(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    tensors = {"a": torch.zeros(500, dtype=torch.bfloat16), "b": torch.zeros(500, dtype=torch.bfloat16)}
    run = _two_steps(root, tensors, tensors)
    header = {
        "a": {"dtype": "BF16", "shape": [500], "data_offsets": [0, 1000]},
        "b": {"dtype": "BF16", "shape": [500], "data_offsets": [998, 1998]},
    }
    _raw_safetensors(run / "step2" / "model.safetensors", header, bytes(2000))
    return [str(run), "--last", "2"]


def dtype_disagrees(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _two_steps(root, step2=_weights(w=torch.zeros(1000, dtype=torch.float16)))
    return [str(run), "--last", "2"]


def shape_disagrees(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _two_steps(root, step2=_weights(w=torch.zeros(10, 100, dtype=torch.bfloat16)))
    return [str(run), "--last", "2"]


def missing_key(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _two_steps(root, step1=_weights(bias=torch.zeros(4, dtype=torch.bfloat16)))
    return [str(run), "--last", "2"]


def extra_key(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _two_steps(root, step2=_weights(extra=torch.zeros(4, dtype=torch.bfloat16)))
    return [str(run), "--last", "2"]


def _sharded(root: Path) -> Path:
    return _two_steps(root, _weights(b=torch.ones(8)), _weights(b=torch.ones(8)), shards=2)


def index_names_missing_shard(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _sharded(root)
    (run / "step2" / "model-00002-of-00002.safetensors").unlink()
    return [str(run), "--last", "2"]


def index_entry_with_dotdot(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _two_steps(root)
    _index(run / "step2", {"w": "../step1/model.safetensors"})
    return [str(run), "--last", "2"]


def index_entry_absolute(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _two_steps(root)
    # A real, readable safetensors file holding ``w``: only the name rule can stop it.
    _index(run / "step2", {"w": str(run / "step1" / "model.safetensors")})
    return [str(run), "--last", "2"]


def index_entry_links_outside(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _sharded(root)
    shard = run / "step2" / "model-00001-of-00002.safetensors"
    elsewhere = root / "elsewhere" / "x.safetensors"
    elsewhere.parent.mkdir()
    shard.rename(elsewhere)  # the same tensors: without the link rule this merge would succeed
    shard.symlink_to(elsewhere)
    return [str(run), "--last", "2"]


def index_links_outside(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _sharded(root)
    index = run / "step2" / "model.safetensors.index.json"
    elsewhere = root / "elsewhere" / "index.json"
    elsewhere.parent.mkdir()
    index.rename(elsewhere)  # the same index: without the link rule this merge would succeed
    index.symlink_to(elsewhere)
    return [str(run), "--last", "2"]


def dcp_metadata_links_outside(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    write_generic_dcp(root / RUN, 10)
    metadata = root / RUN / "step10" / ".metadata"
    elsewhere = root / "elsewhere" / ".metadata"
    elsewhere.parent.mkdir()
    metadata.rename(elsewhere)
    metadata.symlink_to(elsewhere)
    return [str(root / RUN), "--last", "1"]


def dcp_data_file_is_a_fifo(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    """Opening a FIFO for reading waits for a writer: forever."""
    write_generic_dcp(root / RUN, 10)
    (data,) = (root / RUN / "step10").glob("*.distcp")
    data.unlink()
    os.mkfifo(data)
    return [str(root / RUN), "--last", "1"]


def dcp_item_pickle_fails_its_crc(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    """A byte of a chunk's pickle changed, its CRC kept: the read of the archive's two ends
    hands it to zipfile, which refuses it."""
    write_generic_dcp(root / RUN, 10)
    (data,) = (root / RUN / "step10").glob("*.distcp")
    blob = bytearray(data.read_bytes())
    at = blob.index(b"_rebuild_tensor_v2")  # in the first item's data.pkl
    blob[at] ^= 0x20
    data.write_bytes(bytes(blob))
    return [str(root / RUN), "--last", "1"]


def dcp_item_record_past_its_end(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    """The first chunk's zip directory places its tensor's record past the end of the archive
    (it was a SystemError: a read there returned a negative count)."""
    write_generic_dcp(root / RUN, 10)
    (data,) = (root / RUN / "step10").glob("*.distcp")
    blob = bytearray(data.read_bytes())
    record = blob.index(b"PK\x01\x02")
    while not blob[record + 46 : record + 46 + struct.unpack_from("<H", blob, record + 28)[0]].endswith(b"/data/0"):
        record = blob.index(b"PK\x01\x02", record + 4)
    struct.pack_into("<L", blob, record + 42, 2**31)  # the record's local header offset
    data.write_bytes(bytes(blob))
    return [str(root / RUN), "--last", "1"]


def dcp_data_file_truncated(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    """The data file lost its last bytes (a copy cut short): its last key's chunk lies past its
    end, refused when the checkpoint opens, whatever the layout's reads would have been."""
    write_generic_dcp(root / RUN, 10)
    (data,) = (root / RUN / "step10").glob("*.distcp")
    data.write_bytes(data.read_bytes()[:-100])
    return [str(root / RUN), "--last", "1"]


def weight_file_links_outside(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _two_steps(root)
    weights = run / "step2" / "model.safetensors"
    elsewhere = root / "elsewhere" / "model.safetensors"
    elsewhere.parent.mkdir()
    weights.rename(elsewhere)
    weights.symlink_to(elsewhere)
    return [str(run), "--last", "2"]


def copied_file_links_outside(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    """The newest source's config.json is copied into the output: a link to a secret must not be."""
    run = _two_steps(root)
    secret = root / "elsewhere" / "id_rsa"
    secret.parent.mkdir()
    secret.write_text("-----BEGIN PRIVATE KEY-----\n")
    (run / "step2" / "config.json").unlink()
    (run / "step2" / "config.json").symlink_to(secret)
    return [str(run), "--last", "2"]


def window_holds_none(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    make_run(root / RUN, [100, 200], {"w": (8,)})
    return [str(root / RUN), "--merge-step", "50", "--window", "10"]


def empty_run_folder(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    (root / RUN).mkdir()
    return [str(root / RUN), "--last", "1"]


def _nonfinite(root: Path, value: float) -> list[str]:
    bad = _weights()["w"].clone()
    bad[123] = value
    run = _two_steps(root, step2=_weights(w=bad))
    return [str(run), "--last", "2"]


def nan(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return _nonfinite(root, float("nan"))


def inf(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return _nonfinite(root, float("-inf"))


def nan_in_a_run_of_small_tensors(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    # 300 small bf16 tensors lie one after another in both files: the engine reads and averages
    # them as a few steps, and must still name the one tensor (not the first of its run).
    tensors = {f"expert.{i:03d}": torch.linspace(-1, 1, 17 + i % 5, dtype=torch.bfloat16) for i in range(300)}
    bad = {**tensors, "expert.137": tensors["expert.137"].clone()}
    bad["expert.137"][4] = float("nan")
    run = _two_steps(root, step1=bad, step2=tensors)
    return [str(run), "--last", "2"]


def pt_that_imports_code(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    # Unpickling it runs os.system("touch <root>/pwned") (test_checkpoint_builders shows torch.load
    # does); the merge runs in this process, so the tree check would see the marker.
    write_malicious_pt(root / RUN / "step1" / "model.pt", root / "pwned")
    return [str(root / RUN), "--last", "1"]


def dcp_damaged_metadata(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    write_generic_dcp(root / RUN, 10)
    metadata = root / RUN / "step10" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])
    return [str(root / RUN), "--last", "1"]


def _megatron_folder(root: Path, backend: str, version: int, iteration: Any = 10) -> list[str]:
    """run/iter_0000010 as Megatron's dist_checkpointing leaves it, with another sharded backend
    in metadata.json: zarr (a folder per key), or a torch_dist version after 1 (DCP files)."""
    folder = root / RUN / "iter_0000010"
    if backend == "zarr":
        (folder / "embedding.word_embeddings.weight").mkdir(parents=True)
        (folder / "embedding.word_embeddings.weight" / ".zarray").write_text("{}")
    else:
        write_generic_dcp(root / RUN, 10, name=folder.name)
    torch.save({"iteration": iteration}, folder / "common.pt")
    config = {"sharded_backend": backend, "sharded_backend_version": version, "common_backend": "torch"}
    (folder / "metadata.json").write_text(json.dumps({**config, "common_backend_version": 1}))
    return [str(root / RUN), "--last", "1"]


def megatron_zarr(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return _megatron_folder(root, "zarr", 1)


def megatron_torch_dist_v2(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return _megatron_folder(root, "torch_dist", 2)


def megatron_iteration_not_a_step(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    """A DCP output of a Megatron run is named by the iteration its common.pt records
    (``iter_NNNNNNN/`` and the tracker file): one that is no step names nothing."""
    return [*_megatron_folder(root, "torch_dist", 1, iteration="10"), "--format", "dcp"]


def megatron_common_pt_without_a_storage(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    """A DCP output of a Megatron run writes common.pt anew (what it holds, how it was made): a
    tensor of it (the optimizer's step counter) whose storage record the archive lacks."""
    args = _megatron_folder(root, "torch_dist", 1)
    path = root / RUN / "iter_0000010" / "common.pt"
    torch.save({"iteration": 10, "optimizer": {"state": {"common_step": torch.tensor(10.0)}}}, path)
    with zipfile.ZipFile(path) as archive:
        records = {info: archive.read(info) for info in archive.infolist() if not info.filename.endswith("data/0")}
    with zipfile.ZipFile(path, "w") as archive:
        for info, data in records.items():
            archive.writestr(info, data)
    return [*args, "--format", "dcp"]


def read_only_output(root: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    run = _two_steps(root)
    (root / "ro").mkdir()
    fail_writes(monkeypatch, root / "ro", errno.EROFS)
    return [str(run), "--last", "2", "--out", str(root / "ro" / "merged")]


def disk_full(root: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    run = _two_steps(root)
    (root / "full").mkdir()
    # Room for the header and part of the 2000 data bytes of the only shard.
    fail_writes(monkeypatch, root / "full", errno.ENOSPC, budget=1200)
    return [str(run), "--last", "2", "--out", str(root / "full" / "merged")]


def integers_disagree(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _two_steps(
        root,
        _weights(counter=torch.tensor([5, 6], dtype=torch.int64)),
        _weights(counter=torch.tensor([5, 7], dtype=torch.int64)),
    )
    return [str(run), "--last", "2"]


def float8_nan(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    bad = torch.linspace(-1, 1, 1000).to(torch.float8_e4m3fn)
    bad.view(torch.uint8)[123] = 0x7F  # e4m3fn has no Inf; 0x7f and 0xff are its NaN
    run = _two_steps(root, _weights(w=torch.linspace(-1, 1, 1000).to(torch.float8_e4m3fn)), _weights(w=bad))
    return [str(run), "--last", "2"]


SCALED = next(iter(FP8_WEIGHTS))  # layers.0.mlp.down_proj.weight
SCALE = f"{SCALED}_scale_inv"


def float8_scales_differ(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    """DeepSeek-V3's layout, written by transformers' FP8 quantizer: each step's weights get
    their own block scales, so their raw float8 values cannot be averaged."""
    for step in (1, 2):
        write_fp8_checkpoint(root / RUN, step, shared_scales=False)
    return [str(root / RUN), "--last", "2"]


def float8_scale_holds_nan(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    # The scales agree (both NaN at one place): a scale is copied, never averaged, and checked all the same.
    for step in (1, 2):
        tensors = write_fp8_checkpoint(root / RUN, step, shared_scales=True)
        tensors[SCALE][1, 1] = float("nan")
        save_file(tensors, str(root / RUN / f"step{step}" / "model.safetensors"))
    return [str(root / RUN), "--last", "2"]


def float8_scaled_weight_with_dtype(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    for step in (1, 2):
        write_fp8_checkpoint(root / RUN, step, shared_scales=True)
    return [str(root / RUN), "--last", "2", "--dtype", "bf16"]


def float8_scale_left_out(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    for step in (1, 2):
        write_fp8_checkpoint(root / RUN, step, shared_scales=False)
    return [str(root / RUN), "--last", "2", "--exclude", "*_scale_inv"]


def copy_takes_a_float8_scale_without_its_weight(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    for step in (1, 2):
        write_fp8_checkpoint(root / RUN, step, shared_scales=False)
    return [str(root / RUN), "--last", "2", "--copy", "*_scale_inv"]


def copy_from_a_step_outside_the_window(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return [str(_two_steps(root)), "--last", "2", "--copy", "w", "--copy-from", "7"]


def copy_from_an_unknown_source(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return [str(_two_steps(root)), "--last", "2", "--copy", "w", "--copy-from", "latest"]


def negative_weights_without_permission(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return [str(_two_steps(root)), "--last", "2", "--weights", "2,-1"]


def negative_weights_summing_to_zero(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return [str(_two_steps(root)), "--last", "2", "--weights", "1,-1", "--allow-negative-weights"]


def unknown_wsm_shape(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return [str(_two_steps(root)), "--last", "2", "--weighting", "wsm:quadratic"]


def wsm_positions_without_wsm(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return [str(_two_steps(root)), "--last", "2", "--weighting", "uniform,wma", "--positions", "steps"]


def _pt_steps(root: Path, step1: dict, step2: dict) -> Path:
    for step, tensors in ((1, step1), (2, step2)):
        (root / RUN / f"step{step}").mkdir(parents=True)
        torch.save(tensors, root / RUN / f"step{step}" / "model.pt")
    return root / RUN


def pt_unsigned_integers_disagree(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    # torch.save writes uint16 through _rebuild_tensor_v3 and an untyped storage.
    counts = torch.tensor([1, 2, 3], dtype=torch.int32)
    run = _pt_steps(
        root,
        {"w": torch.ones(2), "n": counts.to(torch.uint16)},
        {"w": torch.ones(2), "n": (counts + 1).to(torch.uint16)},
    )
    return [str(run), "--last", "2"]


def pt_tensor_of_an_unread_dtype(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _pt_steps(
        root,
        {"w": torch.ones(2), "z": torch.ones(2, dtype=torch.complex64)},
        {"w": torch.ones(2), "z": torch.ones(2, dtype=torch.complex64)},
    )
    return [str(run), "--last", "2"]


def pt_tensor_under_an_unprintable_key(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    # Python writes no integer of more than 4300 digits as text: the key cannot be a name.
    run = _pt_steps(root, {"w": torch.ones(2), 10**5000: torch.ones(2)}, {"w": torch.ones(2), 10**5000: torch.ones(2)})
    return [str(run), "--last", "2"]


def lightning_global_step_past_int64(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _lightning_step1(root)
    write_lightning_ckpt(run / "last.ckpt", _weights(), 10**5000)  # its step is only inside it
    return [str(run), "--last", "1"]


def _lightning_step1(root: Path, **trainer_state: object) -> Path:
    write_lightning_ckpt(root / RUN / "epoch=0-step=1.ckpt", _weights(), 1, **trainer_state)
    return root / RUN


def lightning_state_dict_holds_unknown_class(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    # Skipped among the hyper-parameters; in the state_dict it could stand for a weight.
    write_lightning_ckpt(root / RUN / "epoch=0-step=1.ckpt", {**_weights(), "extra": hostile_object(root / "pwned")}, 1)
    return [str(root / RUN), "--last", "1"]


def lightning_step_stored_twice(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _lightning_step1(root)
    write_lightning_ckpt(run / "epoch=0-step=1-v1.ckpt", _weights(), 1)  # Lightning's name for a second save
    return [str(run), "--last", "1"]


def lightning_unreadable_last_ckpt(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    run = _lightning_step1(root)
    (run / "last.ckpt").write_bytes(b"PK\x03\x04 not a zip")  # its step is only inside it
    return [str(run), "--last", "1"]


def lightning_file_without_state_dict(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    (root / RUN).mkdir()
    torch.save(_weights(), root / RUN / "epoch=0-step=1.ckpt")  # a plain state dict, named as Lightning names
    return [str(root / RUN), "--last", "1"]


def safetensors_shape_past_int64(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    """No element, so no byte to hold, but no loader can lay it out: 2**124 elements once the 0
    is left aside (the safetensors library and torch multiply the dimensions with overflow checks)."""
    (root / RUN / "step2").mkdir(parents=True)
    header = {"w": {"dtype": "BF16", "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]}}
    _raw_safetensors(root / RUN / "step2" / "model.safetensors", header, b"")
    return [str(root / RUN), "--last", "1"]


def _edit_dcp_metadata(folder: Path, edit: Callable[[Any], None]) -> None:
    """DCP's own ``.metadata`` of ``folder``, changed by ``edit`` and pickled again (the test's
    own file: trusted)."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    edit(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def dcp_shape_past_int64(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    write_generic_dcp(root / RUN, 10)

    def edit(metadata: Any) -> None:
        entry = metadata.state_dict_metadata["weights.linear.bias"]
        entry.size, entry.chunks = torch.Size([2**62, 2**62, 0]), []  # no elements: no chunk to hold them

    _edit_dcp_metadata(root / RUN / "step10", edit)
    return [str(root / RUN), "--last", "1"]


def write_claiming_dcp(folder: Path, claimed: int) -> None:
    """A real DCP save of a 64-element ``w`` whose ``.metadata`` then claims ``claimed`` more
    elements, as a second chunk stored in the first one's item: every read of the first chunk
    works, and only the files' sizes tell that the claim cannot be held."""
    dcp.save({"w": torch.arange(64.0), "b": torch.ones(3)}, checkpoint_id=str(folder), no_dist=True)

    def edit(metadata: Any) -> None:
        entry = metadata.state_dict_metadata["w"]
        entry.size = torch.Size([64 + claimed])
        entry.chunks.append(ChunkStorageMetadata(offsets=torch.Size([64]), sizes=torch.Size([claimed])))
        stored = next(info for index, info in metadata.storage_data.items() if index.fqn == "w")
        metadata.storage_data[MetadataIndex("w", torch.Size([64]), 0)] = stored

    _edit_dcp_metadata(folder, edit)


def dcp_chunks_claim_more_than_the_files_hold(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    write_claiming_dcp(root / RUN / "step10", 2**20)
    return [str(root / RUN), "--last", "1"]


def _deepspeed_zero3(root: Path, edit: Callable[[dict[str, dict[str, Any]]], None]) -> list[str]:
    """run/global_step1: ZeRO-3 of two ranks as DeepSpeed lays it out, changed by ``edit``."""
    states = deepspeed_states(3)
    edit(states)
    write_deepspeed_step(root / RUN / "global_step1", states)
    return [str(root / RUN), "--last", "1"]


def deepspeed_rank_weights_of_another_dtype(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    """Rank 1's flat fp32 groups as bf16 of as many elements: read as rank 0's fp32, they were
    wrong numbers."""

    def edit(states: dict[str, dict[str, Any]]) -> None:
        states[ZERO3_OPTIM_1]["optimizer_state_dict"]["fp32_flat_groups"] = [torch.ones(9, dtype=torch.bfloat16)]

    return _deepspeed_zero3(root, edit)


def deepspeed_stray_rank_file(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    """A file that parses as rank 1's optimizer states too (its model-parallel rank unpadded):
    it took the real file's place."""

    def edit(states: dict[str, dict[str, Any]]) -> None:
        stray = {"optimizer_state_dict": {"zero_stage": 3, "partition_count": 2, "fp32_flat_groups": [torch.zeros(9)]}}
        states["zero_pp_rank_1_mp_rank_0_optim_states.pt"] = stray

    return _deepspeed_zero3(root, edit)


def deepspeed_parameter_shape_holds_a_bool(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    """``(5, True)``: as many elements as ``(5,)``, so the layout fits, but no output holds it."""

    def edit(states: dict[str, dict[str, Any]]) -> None:
        states[ZERO3_MODEL_0]["param_shapes"] = [{"w": torch.Size([3, 4]), "b": (5, True)}]

    return _deepspeed_zero3(root, edit)


def _snapshot(root: Path, edit: Callable[[dict[str, Any]], None]) -> list[str]:
    """run/step1-snapshot as the training hook writes it (one process), its rank table changed by
    ``edit``: ``w`` of shape [1, 1000], ``e`` of no elements."""
    folder = root / RUN / "step1-snapshot"
    tensors = {"w": _weights()["w"].reshape(1, 1000), "e": torch.zeros(0)}
    table = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    blocks = [Block(name, (0,) * t.dim(), t) for name, t in tensors.items()]
    write_rank_file(*resolve(str(folder)), 0, 1, table, blocks, {"kind": "weights", "step": 1})
    path = folder / SNAPSHOT_RANK_FILE
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    described = json.loads(header["__metadata__"][METADATA_KEY])
    edit(described)
    header["__metadata__"][METADATA_KEY] = json.dumps(described)
    _raw_safetensors(path, header, data[8 + length :])
    return [str(root / RUN), "--last", "1"]


def snapshot_rank_table_is_a_list(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return _snapshot(root, lambda described: described.update(tensors=[["w", "BF16", [1, 1000]]]))


def snapshot_dimension_is_a_bool(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return _snapshot(root, lambda described: described["tensors"].update(w=["BF16", [True, 1000]]))


def snapshot_dimension_of_2_to_the_63(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return _snapshot(root, lambda described: described["tensors"].update(e=["F32", [2**63, 0]]))


def _blocks(root: Path, edit: Callable[[dict[str, Any]], None], ranks: int = 1, block_of_4: int = 4) -> list[str]:
    """run/step4-block and run/step8-block as the training hook writes them (blocks of 4 steps of
    ``w``; ``block_of_4`` the first one's length, by ``ranks`` processes), the record in the
    newest one's last rank file changed by ``edit``; a window of both asked for."""
    w = _weights()["w"].float()
    for end, size in ((4, block_of_4), (8, 4)):
        folder = root / RUN / f"step{end}-block"
        for rank in range(ranks):
            record = block_info(end, size, 1, size, {"w": torch.bfloat16})
            if end == 8 and rank == ranks - 1:
                edit(record)
            blocks = [Block("w", (0,), w)] if rank == 0 else []  # rank 0 holds the tensor
            write_rank_file(*resolve(str(folder)), rank, ranks, [TensorSpec("w", w.dtype, (1000,))], blocks, record)
    return [str(root / RUN), "--merge-step", "8", "--window", "8"]


def block_count_does_not_tile_it(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return _blocks(root, lambda record: record.update(count=3))


def block_records_another_step(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return _blocks(root, lambda record: record.update(step=12))


def block_dtypes_miss_a_tensor(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return _blocks(root, lambda record: record.update(dtypes={}))


def block_ranks_disagree(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return _blocks(root, lambda record: record.update(first_step=1), ranks=2)


def blocks_of_two_lengths_in_a_window(root: Path, _: pytest.MonkeyPatch) -> list[str]:
    return _blocks(root, lambda record: None, block_of_4=2)


ST1, ST2 = "step1/model.safetensors", "step2/model.safetensors"
ZERO3_MODEL_0 = "zero_pp_rank_0_mp_rank_00_model_states.pt"
ZERO3_OPTIM_1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
SNAPSHOT_RANK_FILE = "rank00000-of-00001.safetensors"
SNAPSHOT = f"step1-snapshot/{SNAPSHOT_RANK_FILE}"
# Shapes no output can hold: refused whatever the output format (test below).
BAD_SHAPES = [
    Case(
        "safetensors-shape-past-int64",
        safetensors_shape_past_int64,
        (ST2, "'w'", "[4611686018427387904, 4611686018427387904, 0]", "2**63-1"),
    ),
    Case("dcp-shape-past-int64", dcp_shape_past_int64, ("step10/.metadata", "'weights.linear.bias'", "2**63-1")),
    Case(
        "deepspeed-parameter-shape-holds-a-bool",
        deepspeed_parameter_shape_holds_a_bool,
        (f"global_step1/{ZERO3_MODEL_0}", "'b'", "(5, True)", "not a list of integers"),
    ),
    Case(
        "snapshot-dimension-is-a-bool",
        snapshot_dimension_is_a_bool,
        (SNAPSHOT, "'w'", "[True, 1000]", "not a list of integers"),
    ),
    Case(
        "snapshot-dimension-of-2**63",
        snapshot_dimension_of_2_to_the_63,
        (SNAPSHOT, "'e'", "[9223372036854775808, 0]", "2**63-1"),
    ),
]
CORPUS = [
    Case("truncated-safetensors", truncated, (ST2, "'w'", "lies outside the file")),
    Case("header-length-past-end", header_length_past_end, (ST2, "header length")),
    Case("malformed-header-json", malformed_header, (ST2, "corrupt safetensors header")),
    Case("data-offsets-out-of-bounds", offsets_out_of_bounds, (ST2, "'w'", "lies outside the file")),
    Case("data-offsets-overlap", offsets_overlap, (ST2, "'a'", "'b'", "overlap")),
    Case("header-repeats-a-key", header_repeats_a_key, (ST2, "duplicate key 'w'")),
    Case("header-repeats-a-key-colons-hide", header_repeats_a_key_where_colons_hide_it, (ST2, "duplicate key 'shape'")),
    Case("header-integer-past-digit-limit", header_integer_past_the_digit_limit, (ST2, "4300 digits")),
    Case(
        "index-integer-past-digit-limit",
        index_integer_past_the_digit_limit,
        ("step2/model.safetensors.index.json", "4300 digits"),
    ),
    Case("dtype-disagrees", dtype_disagrees, (ST1, ST2, "'w'", "torch.bfloat16", "torch.float16")),
    Case("shape-disagrees", shape_disagrees, (ST1, ST2, "'w'", "[1000]", "[10, 100]")),
    Case("missing-key", missing_key, (ST1, "/step2", "'bias'", "missing")),
    Case("extra-key", extra_key, (ST2, "/step1", "'extra'", "missing")),
    Case("index-names-missing-shard", index_names_missing_shard, ("step2/model-00002-of-00002.safetensors", "missing")),
    Case("index-entry-dotdot", index_entry_with_dotdot, ("step2/model.safetensors.index.json", "../step1")),
    Case("index-entry-absolute", index_entry_absolute, ("step2/model.safetensors.index.json", f"/{RUN}/{ST1}")),
    Case(
        "index-entry-links-outside",
        index_entry_links_outside,
        ("step2/model-00001-of-00002.safetensors", "symbolic link", "elsewhere/x.safetensors"),
    ),
    Case("index-links-outside", index_links_outside, ("step2/model.safetensors.index.json", "symbolic link")),
    Case("dcp-metadata-links-outside", dcp_metadata_links_outside, ("step10/.metadata", "symbolic link")),
    Case("dcp-data-file-is-a-fifo", dcp_data_file_is_a_fifo, ("step10/__0_0.distcp", "not a regular file")),
    Case("dcp-item-pickle-fails-its-crc", dcp_item_pickle_fails_its_crc, ("step10/__0_0.distcp", "tensor '", "CRC")),
    Case(
        "dcp-item-record-past-its-end",
        dcp_item_record_past_its_end,
        ("step10/__0_0.distcp", "tensor '", "corrupt zip entry"),
    ),
    Case("dcp-data-file-truncated", dcp_data_file_truncated, ("step10/__0_0.distcp", "key '", "truncated")),
    Case("weight-file-links-outside", weight_file_links_outside, (ST2, "symbolic link", "elsewhere/model.safetensors")),
    Case("copied-file-links-outside", copied_file_links_outside, ("step2/config.json", "symbolic link")),
    Case("window-holds-none", window_holds_none, (f"/{RUN}: no checkpoint in the window 41-50", "100, 200")),
    Case("empty-run-folder", empty_run_folder, (f"/{RUN}: no complete checkpoint",)),
    Case("nan", nan, (ST2, "'w'", "NaN", "element 123")),
    Case("inf", inf, (ST2, "'w'", "Inf", "element 123")),
    Case("nan-in-a-run-of-small-tensors", nan_in_a_run_of_small_tensors, (ST1, "'expert.137'", "NaN", "element 4")),
    Case("float8-nan", float8_nan, (ST2, "'w'", "NaN", "element 123")),
    Case(
        "float8-scales-differ",
        float8_scales_differ,
        (ST1, ST2, f"'{SCALED}'", f"'{SCALE}'", "does not dequantize"),
    ),
    Case("float8-scale-holds-nan", float8_scale_holds_nan, (ST2, f"'{SCALE}'", "NaN", "element 4")),
    Case(
        "float8-scaled-weight-with-dtype",
        float8_scaled_weight_with_dtype,
        (ST2, f"'{SCALED}'", f"'{SCALE}'", "torch.bfloat16", "does not dequantize"),
    ),
    Case("float8-scale-left-out", float8_scale_left_out, (f"/{RUN}/step1", f"'{SCALED}'", f"'{SCALE}'", "leaves out")),
    Case(
        "copy-takes-a-float8-scale-without-its-weight",
        copy_takes_a_float8_scale_without_its_weight,
        (ST2, "--copy", f"'{SCALE}'", f"'{SCALED}'", "copy both or neither"),
    ),
    Case(
        "copy-from-a-step-outside-the-window",
        copy_from_a_step_outside_the_window,
        ("--copy-from 7", "no source of this merge is step 7", "(its steps: 1, 2)"),
    ),
    Case(
        "copy-from-an-unknown-source", copy_from_an_unknown_source, ("--copy-from must be newest, oldest", "'latest'")
    ),
    Case(
        "negative-weights-without-permission",
        negative_weights_without_permission,
        ("--weights", "2.0,-1.0", "--allow-negative-weights"),
    ),
    Case("negative-weights-summing-to-zero", negative_weights_summing_to_zero, ("--weights 1.0,-1.0", "sum to zero")),
    Case("unknown-wsm-shape", unknown_wsm_shape, ("--weighting", "unknown wsm shape 'quadratic'", "wsm:quadratic")),
    Case("wsm-positions-without-wsm", wsm_positions_without_wsm, ("--positions", "not 'uniform'")),
    Case(
        "pt-unsigned-integers-disagree",
        pt_unsigned_integers_disagree,
        ("step1/model.pt", "step2/model.pt", "torch.uint16 tensor 'n'", "must agree"),
    ),
    Case(
        "pt-tensor-of-an-unread-dtype",
        pt_tensor_of_an_unread_dtype,
        ("step1/model.pt", "'z'", "torch.complex64, a dtype ckptavg does not read"),
    ),
    Case(
        "pt-tensor-under-an-unprintable-key",
        pt_tensor_under_an_unprintable_key,
        ("step1/model.pt", "<an integer of 16610 bits>", "cannot be part of its name"),
    ),
    Case(
        "lightning-global-step-past-int64",
        lightning_global_step_past_int64,
        ("last.ckpt", "global_step", "<an integer of 16610 bits>", "from 0 to 2**63-1"),
    ),
    Case("pt-that-imports-code", pt_that_imports_code, ("step1/model.pt", "refusing to unpickle", "system")),
    Case("dcp-damaged-metadata", dcp_damaged_metadata, ("step10/.metadata",)),
    Case("megatron-zarr", megatron_zarr, ("iter_0000010/metadata.json", "sharded backend 'zarr' version 1")),
    Case(
        "megatron-torch-dist-v2",
        megatron_torch_dist_v2,
        ("iter_0000010/metadata.json", "sharded backend 'torch_dist' version 2", "version 1 only"),
    ),
    Case(
        "megatron-iteration-not-a-step",
        megatron_iteration_not_a_step,
        ("iter_0000010/common.pt", "iteration is '10', not a step from 0 to 2**63-1"),
    ),
    Case(
        "megatron-common-pt-without-a-storage",
        megatron_common_pt_without_a_storage,
        ("iter_0000010/common.pt", "storage record 'common/data/0' is missing"),
    ),
    Case(
        "lightning-state-dict-holds-unknown-class",
        lightning_state_dict_holds_unknown_class,
        ("epoch=0-step=1.ckpt", "state_dict.extra", "posix.system"),
    ),
    Case(
        "lightning-step-stored-twice",
        lightning_step_stored_twice,
        ("step 1 is stored twice", "/epoch=0-step=1.ckpt", "/epoch=0-step=1-v1.ckpt"),
    ),
    Case("lightning-unreadable-last-ckpt", lightning_unreadable_last_ckpt, ("last.ckpt", "not a torch.save archive")),
    Case(
        "lightning-file-without-state-dict",
        lightning_file_without_state_dict,
        ("epoch=0-step=1.ckpt", "not a Lightning checkpoint"),
    ),
    Case("read-only-output", read_only_output, ("ro/merged", "Read-only file system")),
    Case("disk-full", disk_full, ("full/merged/model-00001-of-00001.safetensors", "No space left on device")),
    Case(
        "integer-tensors-disagree",
        integers_disagree,
        (ST1, ST2, "'counter'", "not averaged but copied from the newest source", "must agree"),
    ),
    *BAD_SHAPES,
    Case(
        "dcp-chunks-claim-more-than-the-files-hold",
        dcp_chunks_claim_more_than_the_files_hold,
        ("step10/.metadata", "'w'", "4194560 bytes", "more than the", "data files they name"),
    ),
    Case(
        "deepspeed-rank-weights-of-another-dtype",
        deepspeed_rank_weights_of_another_dtype,
        (f"global_step1/{ZERO3_OPTIM_1}", "torch.bfloat16", "rank 0's are torch.float32"),
    ),
    Case(
        "deepspeed-stray-rank-file",
        deepspeed_stray_rank_file,
        (
            "global_step1: two files for rank 1's optimizer states",
            ZERO3_OPTIM_1,
            "zero_pp_rank_1_mp_rank_0_optim_states.pt",
        ),
    ),
    Case(
        "snapshot-rank-table-is-a-list",
        snapshot_rank_table_is_a_list,
        (SNAPSHOT, "not a ckptavg rank file", "'tensors'"),
    ),
    Case(
        "block-count-does-not-tile-it",
        block_count_does_not_tile_it,
        ("step8-block", "not a block of the training hook", "3 steps every 1 in a block of 4 ending at step 8"),
    ),
    Case("block-records-another-step", block_records_another_step, ("step8-block", "records step 12, its name step 8")),
    Case("block-dtypes-miss-a-tensor", block_dtypes_miss_a_tensor, ("step8-block", "'dtypes'", "one per tensor")),
    Case(
        "block-ranks-disagree",
        block_ranks_disagree,
        ("step8-block/rank00001-of-00002.safetensors", "'first_step': 1", "differs from rank 0's"),
    ),
    Case(
        "blocks-of-two-lengths-in-a-window",
        blocks_of_two_lengths_in_a_window,
        ("step4-block", "a block of 2 steps", "step8-block", "one of 4", "must be alike"),
    ),
]


@pytest.mark.parametrize(
    ("tracker", "said"),
    [
        (b"10", None),
        (b"10\n", None),  # as Megatron-LM's weighted_merge.py writes it
        (b"abc", "latest_checkpointed_iteration.txt: 'abc' is neither an iteration nor 'release'"),
        (b"-10", "'-10' is neither an iteration nor 'release'"),
        (b"9" * 30, "is neither an iteration nor 'release'"),
        (b"1" * 65, "latest_checkpointed_iteration.txt: 65 bytes, more than the 64 bytes"),
        (b"20", "incomplete checkpoint: latest_checkpointed_iteration.txt names iter_0000020/, which is not there"),
    ],
)
def test_a_megatron_load_folder_is_read_through_its_tracker_file(tmp_path, tracker, said):
    """The folder Megatron-LM's --load takes (a DCP output of a Megatron run is one) is read as
    the checkpoint its tracker file names; a tracker that names none is one line naming it."""
    _megatron_folder(tmp_path, "torch_dist", 1)
    run = tmp_path / RUN
    (run / "latest_checkpointed_iteration.txt").write_bytes(tracker)
    if said is None:
        result = ckptavg.average([str(run)], str(tmp_path / "out"))
        assert [s["path"] for s in result.sources] == [str(run / "iter_0000010")]
        return
    with pytest.raises(CheckpointError) as refused:
        ckptavg.average([str(run)], str(tmp_path / "out"))
    assert said in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", CORPUS, ids=[case.id for case in CORPUS])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, monkeypatch, case):
    args = case.build(tmp_path, monkeypatch)
    before = tree_of(tmp_path)
    with alarm():
        result = run_cli_in_process("merge", *args)
    monkeypatch.undo()
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptavg: error: "), result.stderr
    missing = [name for name in case.names if name not in lines[0]]
    assert not missing, f"{lines[0]!r} does not name {missing}"
    after = tree_of(tmp_path)
    assert [p for p in after if ".tmp-" in p or p.endswith("ckptavg-manifest.json")] == []
    assert after == before  # nothing written, nothing removed or changed


@pytest.mark.parametrize("output", ["pt", "dcp"])
@pytest.mark.parametrize("case", BAD_SHAPES, ids=[case.id for case in BAD_SHAPES])
def test_a_shape_no_loader_can_hold_is_refused_for_every_output_format(tmp_path, case, output):
    """The outputs that build each tensor with torch (``.pt`` and DCP) never see such a shape
    either: one line, no traceback, nothing written."""
    args = case.build(tmp_path, pytest.MonkeyPatch())
    before = tree_of(tmp_path)
    result = run_cli_in_process("merge", *args, "--format", output)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.splitlines()
    assert all(name in line for name in case.names), line
    assert tree_of(tmp_path) == before


@pytest.mark.parametrize("output", ["safetensors", "pt", "dcp"])
def test_a_dcp_metadata_claiming_more_than_its_files_hold_is_refused_before_allocating(tmp_path, output):
    """8 GiB claimed, 3 kB on disk: refused from the metadata and the files' sizes, in a process
    capped at 2 GiB of address space, whatever the output (a ``.pt`` or DCP output gathers each
    tensor whole). A 64-byte chunk makes the first step fit in the real chunk, so only the claim
    can stop the merge."""
    write_claiming_dcp(tmp_path / RUN / "step10", 2**31)
    before = tree_of(tmp_path)
    args = ["merge", str(tmp_path / RUN), "--last", "1", "--format", output, "--chunk-size", "64"]
    result = run_cli(*args, address_space=2 * 2**30, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.splitlines()
    assert "step10/.metadata: key 'w' chunk at [64]" in line and "8589934848 bytes, more than the" in line, line
    assert tree_of(tmp_path) == before


def test_a_merge_takes_no_memory_for_the_part_of_a_tensor_it_has_not_reached(tmp_path):
    """An 8 GiB tensor (a sparse file: no disk) whose first element is NaN, merged in 64-byte
    chunks by a process capped at 2 GiB of address space: the merge stops at its first step, in
    one line, having planned no more of the tensor than it read (a list of its 2**28 chunks,
    made up front, did not fit)."""
    count = 2**31
    path = tmp_path / RUN / "step1" / "model.safetensors"
    path.parent.mkdir(parents=True)
    _raw_safetensors(path, {"w": {"dtype": "F32", "shape": [count], "data_offsets": [0, 4 * count]}}, b"")
    with open(path, "r+b") as handle:
        handle.seek(0, os.SEEK_END)
        handle.write(struct.pack("<f", float("nan")))
        handle.truncate(handle.tell() - 4 + 4 * count)
    result = run_cli("merge", str(tmp_path / RUN), "--last", "1", "--chunk-size", "64", address_space=2 * 2**30)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.splitlines()
    assert "step1/model.safetensors" in line and "'w'" in line and "NaN" in line and "element 0" in line, line


def test_agreeing_integer_tensors_are_copied_bit_exactly_from_the_newest_source(tmp_path):
    """Integers are never averaged, not even through float64: int64 values past 2**53 and the
    extremes of each type would not survive a float round trip; ``--dtype`` leaves them alone."""
    exact = {
        "steps": torch.tensor([2**62 + 1, -(2**63), 2**63 - 1, 3], dtype=torch.int64),
        "ids": torch.tensor([-(2**31), 2**31 - 1, 0], dtype=torch.int32),
        "bytes": torch.arange(256, dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
    }
    run = tmp_path / RUN
    for step, value in ((1, 0.25), (2, 0.75), (3, 2.0)):
        write_checkpoint(run / f"step{step}", {"w": torch.full((4,), value, dtype=torch.bfloat16), **exact})
    result = run_cli_in_process("merge", str(run), "--last", "3", "--dtype", "fp32")
    assert result.returncode == 0, result.stderr
    merged = load_merged(run / "step3-merged")
    assert torch.equal(merged["w"], torch.full((4,), 1.0, dtype=torch.float32))
    for name, tensor in exact.items():
        assert merged[name].dtype == tensor.dtype and bool(same_bits(merged[name], tensor).all()), name
    manifest = json.loads((run / "step3-merged" / "ckptavg-manifest.json").read_text())
    assert "integer and bool tensors copied from the newest source" in manifest["dtype_policy"]["accumulate"]


def test_a_linked_run_folder_and_links_inside_a_checkpoint_are_fine(tmp_path):
    """The link rule is about what a checkpoint folder names: the folders above it may be links
    (a run on another disk), and a name may link to a file in the same folder."""
    saved = make_run(tmp_path / "storage", [1, 2], {"w": (16,)})
    run = tmp_path / RUN
    run.symlink_to(tmp_path / "storage", target_is_directory=True)
    (tmp_path / "storage" / "step1").rename(tmp_path / "disk2")  # and a checkpoint folder that is a link
    (run / "step1").symlink_to(tmp_path / "disk2", target_is_directory=True)
    (run / "step2" / "model.safetensors").rename(run / "step2" / "weights.safetensors")
    (run / "step2" / "model.safetensors").symlink_to("weights.safetensors")
    (run / "step2" / "config.json").rename(run / "step2" / "shared-config.json")
    (run / "step2" / "config.json").symlink_to("shared-config.json")
    result = run_cli_in_process("merge", str(run), "--last", "2", "--dtype", "fp64")
    assert result.returncode == 0, result.stderr
    mean = (saved[1]["w"].double() + saved[2]["w"].double()) / 2
    assert torch.equal(load_merged(run / "step2-merged")["w"], mean)
    # A linked config is copied (as a file), not dropped.
    copied = run / "step2-merged" / "config.json"
    assert not copied.is_symlink() and copied.read_text() == (run / "step2" / "shared-config.json").read_text()


@pytest.mark.parametrize(
    ("layout", "name", "limit"),
    [
        ("safetensors", "model.safetensors.index.json", 64 * 2**20),
        ("pt", "pytorch_model.bin.index.json", 64 * 2**20),
        ("dcp", ".metadata", 2**30),
    ],
)
def test_a_metadata_file_past_its_size_limit_is_refused_unread(tmp_path, layout, name, limit):
    """An index or a DCP ``.metadata`` is read whole, so its size is checked first: a sparse
    file of any size costs its writer nothing, and must cost the reader nothing either."""
    run = tmp_path / RUN
    if layout == "dcp":
        write_generic_dcp(run, 1)
    else:
        (run / "step1").mkdir(parents=True)
        if layout == "pt":
            torch.save({"w": torch.ones(2)}, run / "step1" / "pytorch_model.bin")
    with open(run / "step1" / name, "wb") as handle:
        handle.truncate(limit + 1)
    tracemalloc.start()
    try:
        result = run_cli_in_process("merge", str(run), "--last", "1")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.splitlines()
    assert f"step1/{name}: {limit + 1} bytes" in line and f"more than the {limit} " in line, line
    assert peak < limit // 2


def test_ls_lists_step_folders_that_hold_dangling_links(tmp_path):
    run = tmp_path / RUN
    make_run(run, [1, 2], {"w": (4,)})
    (run / "step1" / "model.safetensors.index.json").symlink_to(tmp_path / "gone.json")
    (run / "step2" / "config.json").unlink()
    (run / "step2" / "config.json").symlink_to(tmp_path / "gone.json")
    result = run_cli_in_process("ls", str(run), "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(row["name"], row["status"]) for row in rows] == [("step1", "complete"), ("step2", "complete")]
    for row in rows:  # a dangling link has no size
        assert row["bytes"] == sum(p.stat().st_size for p in (run / row["name"]).iterdir() if p.exists())


def test_a_disk_that_fills_at_any_point_leaves_nothing(tmp_path, monkeypatch):
    """The disk fills after 0, 64, 128, ... bytes, until a merge fits: every write (shard,
    journal, index, copied config, manifest) fails cleanly and leaves the folders as they were."""
    run = _two_steps(tmp_path)
    out = tmp_path / "full"
    out.mkdir()
    before = tree_of(tmp_path)
    failed_files = set()
    for budget in range(0, 1 << 16, 64):  # fine steps: a small file is a narrow window
        with monkeypatch.context() as patch:
            fail_writes(patch, out, errno.ENOSPC, budget=budget)
            result = run_cli_in_process("merge", str(run), "--last", "2", "--out", str(out / "merged"))
        if result.returncode == 0:
            break
        line = result.stderr.strip()
        assert "\n" not in line and line.startswith("ckptavg: error: cannot "), line
        assert line.endswith(": No space left on device") and str(out) in line, line
        failed_files.add(line.split(": ")[-2].rsplit("/", 1)[-1])
        assert tree_of(tmp_path) == before, f"left behind after {line!r}"
    else:
        pytest.fail("the merge never fitted")
    assert torch.equal(load_merged(out / "merged")["w"], _weights()["w"])
    # The sweep reached each kind of file the merge writes.
    written = {".ckptavg-journal-00000.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"}
    assert written | {"ckptavg-manifest.json"} <= failed_files, failed_files


@pytest.mark.parametrize("force", [False, True], ids=["new-output", "replacing-with-force"])
def test_a_refused_final_rename_publishes_nothing_and_keeps_the_old_output(tmp_path, monkeypatch, force):
    """Another merge publishes the same output between our check and our rename (or the rename
    is refused for another reason): one line, our files gone, whatever was there kept."""
    run = _two_steps(tmp_path)
    target = tmp_path / "out" / "merged"
    target.mkdir(parents=True)
    (target / "theirs.txt").write_text("another merge")
    if not force:  # the other merge publishes after our existence check
        target.rename(tmp_path / "out" / "later")
    real_rename = publish.rename_no_replace

    def rename(src, dst):
        if Path(dst) == target and ".tmp-" in Path(src).name:
            if force:
                raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(dst))
            os.rename(tmp_path / "out" / "later", target)  # then the real rename finds it
        return real_rename(src, dst)

    monkeypatch.setattr(publish, "rename_no_replace", rename)
    args = ["merge", str(run), "--last", "2", "--out", str(target)] + (["--force"] if force else [])
    result = run_cli_in_process(*args)
    monkeypatch.undo()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"ckptavg: error: cannot publish output {target}: ")
    assert len(result.stderr.splitlines()) == 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["merged"]
    assert sorted(p.name for p in target.iterdir()) == ["theirs.txt"]


# -- an output that would destroy what it reads: refused before anything is created or renamed ---

# (id, working folder under the test's root, --out as typed, what the error must say). The run
# folder is root/run with run/step1 and run/step2; "latest" is a link to run/step2.
OVERLAPS = [
    ("the-run-folder", ".", "run", "is the run folder"),
    ("the-run-folder-slash", ".", "run/", "is the run folder"),
    ("a-source-with-dot", ".", "run/./step2", "is the source checkpoint"),
    ("a-source-with-dotdot", ".", "run/step1/../step2", "is the source checkpoint"),
    ("a-link-to-a-source", ".", "latest", "is the source checkpoint"),
    ("inside-a-source", ".", "run/step2/merged", "lies inside the source checkpoint"),
    ("above-the-run-folder", "run", "..", "contains the run folder"),
    ("empty-above-the-run-folder", ".", "", "contains the run folder"),
    ("the-cwd-as-dot", "work", ".", "is the current directory"),
    ("the-cwd-as-empty", "work", "", "is the current directory"),
    ("above-the-cwd", "work/deep", "..", "contains the current directory"),
]


@pytest.mark.parametrize("force", [False, True], ids=["", "force"])
@pytest.mark.parametrize(("cwd", "out", "said"), [c[1:] for c in OVERLAPS], ids=[c[0] for c in OVERLAPS])
def test_an_output_over_a_source_the_run_or_the_cwd_is_refused(tmp_path, monkeypatch, cwd, out, said, force):
    """Compared as real paths, whatever the spelling, with or without --force: the sources and
    everything else stay byte for byte what they were."""
    _two_steps(tmp_path)
    (tmp_path / "latest").symlink_to(tmp_path / RUN / "step2", target_is_directory=True)
    (tmp_path / "work" / "deep").mkdir(parents=True)
    before = tree_of(tmp_path)
    monkeypatch.chdir(tmp_path / cwd)
    run = os.path.relpath(tmp_path / RUN)
    result = run_cli_in_process("merge", run, "--last", "2", "--out", out, *(["--force"] if force else []))
    monkeypatch.undo()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptavg: error: output "), result.stderr
    assert said in lines[0] and "choose another --out" in lines[0], lines[0]
    assert tree_of(tmp_path) == before


# -- --resume adopts a hidden folder: nothing in it may lead elsewhere or block -----------------


def _plant(entry: Path, kind: str, precious: Path) -> str:
    """Put a non-regular entry at ``entry``; returns what the refusal must call it."""
    if kind == "fifo":
        os.mkfifo(entry)
        return "FIFO"
    if kind == "socket":
        here = os.getcwd()
        os.chdir(entry.parent)  # bound by a relative name: a socket's path is limited to about 100 bytes
        try:
            with socket.socket(socket.AF_UNIX) as server:
                server.bind(entry.name)
        finally:
            os.chdir(here)
        return "socket"
    entry.symlink_to(precious.parent if kind == "link-to-folder" else precious)
    return "symbolic link"


PLANTED = [
    ("link-to-file", "config.json"),
    ("link-to-file", "model.safetensors.index.json"),
    ("link-to-file", "model-00001-of-00001.safetensors"),
    ("link-to-file", ".ckptavg-journal-00000.json"),
    ("link-to-folder", "sub"),
    ("fifo", ".ckptavg-journal-00000.json"),
    ("fifo", "config.json"),
    ("socket", "model-00001-of-00001.safetensors"),
]


@pytest.mark.parametrize(("kind", "name"), PLANTED, ids=[f"{k}-{n}" for k, n in PLANTED])
def test_resume_refuses_a_hidden_folder_holding_anything_but_files_and_folders(tmp_path, kind, name):
    """A link planted in an interrupted merge's folder would be written through (or, for a
    folder, its files pruned) and a FIFO would block the merge forever: --resume refuses the
    folder in one line naming the entry, and follows nothing."""
    run = _two_steps(tmp_path)
    precious = tmp_path / "elsewhere" / "precious.txt"
    precious.parent.mkdir()
    precious.write_text("not the merge's to touch")
    hidden = tmp_path / ".merged.tmp-0badc0de"
    (hidden / "nested").mkdir(parents=True)  # folders are fine; the bad entry may sit anywhere
    entry = hidden / "nested" / name if name == "sub" else hidden / name
    said = _plant(entry, kind, precious)
    before = tree_of(tmp_path)
    with alarm(60):
        result = run_cli_in_process("merge", str(run), "--last", "2", "--out", str(tmp_path / "merged"), "--resume")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ckptavg: error: cannot resume from {hidden}: "), lines
    assert str(entry) in lines[0] and said in lines[0], lines[0]
    assert precious.read_text() == "not the merge's to touch"
    assert tree_of(tmp_path) == before


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_an_output_file_is_never_written_through_a_link_at_its_name(tmp_path, link):
    """Whatever sits at an output file's name when it is opened (a link planted while the merge
    runs, or a hard link to a file elsewhere) is replaced, never written through."""
    from ckptavg.formats.layout import ShardSpec, TensorSpec
    from ckptavg.formats.writers.safetensors import SafetensorsFileWriter
    from ckptavg.io.atomic import write_bytes
    from ckptavg.io.fs import resolve

    precious = tmp_path / "precious.txt"
    precious.write_text("keep")
    fs = resolve(str(tmp_path))[0]
    shard = ShardSpec("x.safetensors", (TensorSpec("w", torch.float32, (2,)),))
    for name in ("config.json", "x.safetensors"):
        path = tmp_path / "out" / name
        path.parent.mkdir(exist_ok=True)
        if link == "symbolic":
            path.symlink_to(precious)
        else:
            os.link(precious, path)
        if name == "config.json":
            write_bytes(fs, str(path), b"{}")
        else:
            writer = SafetensorsFileWriter(fs, str(path), shard, str(path))
            writer.write(memoryview(bytes(8)))
            writer.close()
        assert not path.is_symlink() and path.stat().st_ino != precious.stat().st_ino
        assert precious.read_text() == "keep"
