"""``ckptavg verify``: a merged output against its manifest, and against its sources."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import make_run, run_cli
from safetensors.torch import load_file, save_file

import ckptavg
from ckptavg import CkptavgError
from ckptavg.verify import verify

SHAPES = {"model.embed.weight": (64, 16), "model.layers.0.w": (16, 16), "lm_head.weight": (64, 16)}


@pytest.fixture
def merged(tmp_path) -> tuple[Path, Path]:
    run = tmp_path / "run"
    make_run(run, [10, 20, 30], SHAPES, shards=2)
    ckptavg.merge(str(run), last=3, shard_size=3000)
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
    ckptavg.merge(str(run), last=2, output_format="dcp")
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

    def hang(_signum, _frame):
        raise TimeoutError("verify hangs")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(30)
    try:
        with pytest.raises(CkptavgError) as caught:
            verify(str(out))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
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
