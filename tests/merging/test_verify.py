"""``ckptavg verify``: a merged output against its manifest, and against its sources."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from helpers import alarm, make_run, run_cli, run_cli_in_process, tree_of
from safetensors.torch import load_file, save_file

import ckptavg
from ckptavg import CkptavgError, MergeOptions
from ckptavg.merging.verify import verify
from ckptavg.weighting import Weighting

SHAPES = {"model.embed.weight": (64, 16), "model.layers.0.w": (16, 16), "lm_head.weight": (64, 16)}


@pytest.fixture
def merged(tmp_path) -> tuple[Path, Path]:
    run = tmp_path / "run"
    make_run(run, [10, 20, 30], SHAPES, shards=2)
    ckptavg.merge(str(run), last=3, options=MergeOptions(shard_size=3000))
    return run, run / "step30-merged"


def _shard(out: Path) -> Path:
    return sorted(out.glob("model-*.safetensors"))[0]


def _rehash(out: Path, name: str) -> None:
    """What a tampering tool or a buggy writer could do: keep the manifest consistent."""
    manifest = json.loads((out / "ckptavg-manifest.json").read_text())
    manifest["files"][name]["sha256"] = hashlib.sha256((out / name).read_bytes()).hexdigest()
    (out / "ckptavg-manifest.json").write_text(json.dumps(manifest))


def test_a_good_output_verifies_and_recomputes(merged):
    run, out = merged
    report = verify(str(out), against=str(run), sample=10)
    assert report.files_checked == len(list(out.iterdir())) - 1
    assert report.tensors_checked == 3 and sorted(report.recomputed) == sorted(SHAPES)
    result = run_cli("verify", str(out), "--against", str(run))
    assert result.returncode == 0 and "3 tensors recomputed from the sources: identical" in result.stdout


def test_dcp_output_in_olmo_layout_verifies(tmp_path):
    from checkpoint_builders import write_olmo_core_checkpoint

    run = tmp_path / "run"
    for step in (1, 2):
        write_olmo_core_checkpoint(run, step)
    ckptavg.merge(str(run), last=2, options=MergeOptions(output_format="dcp"))
    report = verify(str(run / "step2-merged"), against=str(run), sample=100)
    assert report.recomputed and all(name.startswith("model.") for name in report.recomputed)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("flip", "sha256 differs"),
        ("missing", "listed in the manifest but missing"),
        ("extra", "not listed in the manifest"),
        ("no-manifest", "missing; the output is not a finished ckptavg merge"),
        ("count", "the manifest says 4"),
    ],
)
def test_damage_is_named_in_one_line(merged, damage, message):
    _, out = merged
    shard = _shard(out)
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[-1] ^= 1
        shard.write_bytes(bytes(data))
    elif damage == "missing":
        shard.unlink()
    elif damage == "extra":
        (out / "model-99999-of-99999.safetensors").write_bytes(b"x")
    elif damage == "no-manifest":
        (out / "ckptavg-manifest.json").unlink()
    else:
        manifest = json.loads((out / "ckptavg-manifest.json").read_text())
        manifest["tensor_count"] = 4
        (out / "ckptavg-manifest.json").write_text(json.dumps(manifest))
    result = run_cli("verify", str(out))
    assert result.returncode == 1, result.stdout
    assert (
        message in result.stderr and len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    )


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("fifo", "not a regular file"),
        ("link-to-dev-zero", "symbolic link that leaves"),
        ("link-out-of-the-output", "symbolic link that leaves"),
    ],
)
def test_only_regular_files_inside_the_output_are_hashed(tmp_path, merged, kind, message):
    """A listed file that is a FIFO (its reader waits for a writer forever), a link to an endless
    device or a link out of the output: one line naming it, never a hang or a read elsewhere.
    Run in process under an alarm, so that a hang fails the test instead of stalling it."""
    _, out = merged
    shard = _shard(out) if kind != "link-out-of-the-output" else out / "config.json"
    if kind == "fifo":
        shard.unlink()
        os.mkfifo(shard)
    elif kind == "link-to-dev-zero":
        shard.unlink()
        shard.symlink_to("/dev/zero")
    else:  # the same bytes elsewhere: without the rule, verify would vouch for a file it does not hold
        shard.rename(tmp_path / shard.name)
        shard.symlink_to(tmp_path / shard.name)

    with alarm(30), pytest.raises(CkptavgError) as caught:
        verify(str(out))
    assert message in str(caught.value) and str(shard) in str(caught.value)
    assert "\n" not in str(caught.value)


def test_values_that_are_not_the_average_or_not_finite_are_caught(merged):
    run, out = merged
    shard = _shard(out)
    tensors = load_file(str(shard))
    name = sorted(tensors)[0]
    changed = dict(tensors)
    changed[name] = tensors[name].clone()
    changed[name].view(-1)[5] += 1
    save_file(changed, str(shard), metadata={"format": "pt"})
    _rehash(out, shard.name)
    verify(str(out))  # consistent with its manifest: only the sources can tell
    with pytest.raises(CkptavgError, match=rf"tensor '{name}' differs from the average of its sources at element 5"):
        verify(str(out), against=str(run), sample=10)
    changed[name].view(-1)[7] = float("inf")
    save_file(changed, str(shard), metadata={"format": "pt"})
    _rehash(out, shard.name)
    with pytest.raises(CkptavgError, match=rf"tensor '{name}' .* not finite at element 7"):
        verify(str(out))
    assert torch.isinf(load_file(str(shard))[name]).any()


def _set(path: str, value):
    """An edit of the manifest that sets the field at ``path`` (``keys.include``, ``sources.0``)."""

    def edit(manifest: dict) -> dict:
        *parents, last = path.split(".")
        table = manifest
        for key in parents:
            table = table[key]
        if isinstance(table, list):
            table[int(last)] = value
        else:
            table[last] = value
        return manifest

    return edit


def _record_weight_a_string(manifest: dict) -> dict:
    del manifest["weighting"]["unnormalised"]  # verify then takes each source's weight
    manifest["sources"][1]["weight"] = "0.5"
    return manifest


def _file_entry_a_string(manifest: dict) -> dict:
    manifest["files"][sorted(manifest["files"])[0]] = "0" * 64
    return manifest


HAND_EDITS = {
    "sources-not-a-list": (_set("sources", "step10,step20"), "field 'sources' must be a list"),
    "source-not-an-object": (_set("sources.0", "step10"), "field 'sources[0]' must be an object"),
    "weighting-not-an-object": (_set("weighting", "explicit"), "field 'weighting' must be an object"),
    "weights-as-strings": (_set("weighting.unnormalised", ["1", "2", "3"]), "'weighting.unnormalised' must be a list"),
    "weights-of-wrong-length": (_set("weighting.unnormalised", [1, 2]), "'weighting.unnormalised' must be 3 weights"),
    "weights-all-zero": (_set("weighting.unnormalised", [0, 0, 0]), "'weighting.unnormalised': weights must be"),
    "weights-negative": (_set("weighting.unnormalised", [1, -2, 3]), "'weighting.unnormalised' must be a list of"),
    "record-weight-a-string": (_record_weight_a_string, "field 'sources[1].weight' must be a finite number"),
    "method-a-number": (_set("method", 3), "field 'method' must be a string"),
    "keys-a-list": (_set("keys", ["model.*"]), "field 'keys' must be an object"),
    "keys-include-a-string": (_set("keys.include", "model.*"), "field 'keys.include' must be a list of strings"),
    "keys-strip-prefix-a-number": (_set("keys.strip_prefix", 7), "field 'keys.strip_prefix' must be a string"),
    "file-entry-a-string": (_file_entry_a_string, "must be an object with a 'sha256' string"),
    "tensor-count-a-string": (_set("tensor_count", "3"), "field 'tensor_count' must be a whole number"),
    "total-size-negative": (_set("total_size", -1), "field 'total_size' must be a whole number >= 0"),
    "manifest-a-list": (lambda manifest: [manifest], "unreadable"),
}


@pytest.mark.parametrize("name", sorted(HAND_EDITS))
def test_a_hand_edited_manifest_is_one_line_naming_the_field(tmp_path, name):
    """``verify --against`` reads the manifest's sources, weights and key selection: a field of
    the wrong type is named in one line, with the manifest, not a traceback."""
    run = tmp_path / "run"
    make_run(run, [10, 20, 30], {"model.w": (16,)})
    ckptavg.merge(str(run), last=3, weighting=Weighting.from_options(weights=[1, 2, 3]))
    path = run / "step30-merged" / "ckptavg-manifest.json"
    edit, message = HAND_EDITS[name]
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    before = tree_of(tmp_path)
    result = run_cli_in_process("verify", str(run / "step30-merged"), "--against", str(run))
    assert result.returncode == 1, result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"ckptavg: error: {path}: ") and message in lines[0], lines[0]
    assert tree_of(tmp_path) == before
