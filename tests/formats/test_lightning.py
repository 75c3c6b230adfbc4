"""PyTorch Lightning ``.ckpt`` files: saved by Lightning itself (tests/lightning_run.py: fp32 and
bf16-true, ``ModelCheckpoint`` + ``EarlyStopping``, hyper-parameters that pickle a ``Path``, a
numpy scalar and a class of the user's), found as checkpoints of a run folder (``last.ckpt`` by
the step inside it), merged with ``ckptavg merge`` to the correctly rounded float64 mean of the
``state_dict`` tensors, and loaded back into the LightningModule. Hostile pickles among the
hyper-parameters are skipped, never run; no value among them stops a merge."""

from __future__ import annotations

import json
import shutil
import sys
import zoneinfo
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_builders import hostile_object, write_lightning_ckpt
from helpers import run_cli_in_process, run_scripts
from references import assert_equal, load_merged, reference
from safetensors.torch import load_file

STEPS = (10, 20, 30)  # lightning_run.STEPS (importing it imports Lightning)


class TaggedTensor(torch.Tensor):
    """A tensor subclass: its class is code the reader never imports."""


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lightning")
    run_scripts(("lightning_run.py", str(root)))
    return root


def _saved(root: Path, precision: str) -> dict[int, dict[str, torch.Tensor]]:
    return {step: load_file(root / f"{precision}-state_dicts" / f"step-{step}.safetensors") for step in STEPS}


def _listing(run: Path) -> list[tuple[int, str, str, str]]:
    rows = json.loads(run_cli_in_process("ls", str(run), "--json").stdout)
    return [(row["step"], row["name"], row["format"], row["status"]) for row in rows]


@pytest.mark.parametrize("precision", ["32", "bf16-true"])
def test_lightning_checkpoints_merge_exactly_and_load_into_the_module(lightning_runs, tmp_path, precision):
    run = lightning_runs / precision
    assert _listing(run) == [
        (10, "epoch=0-step=10.ckpt", "lightning", "complete"),
        (20, "epoch=1-step=20.ckpt", "lightning", "complete"),
        (30, "epoch=1-step=30.ckpt", "lightning", "complete"),
        (30, "last.ckpt", "lightning", "same save as epoch=1-step=30.ckpt"),  # not "stored twice"
    ]
    out = tmp_path / "avg"
    result = run_cli_in_process("merge", str(run), "--last", "3", "--out", str(out))
    assert result.returncode == 0, result.stderr

    expected = reference(_saved(lightning_runs, precision), STEPS)
    assert {t.dtype for t in expected.values()} == {torch.float32 if precision == "32" else torch.bfloat16}
    merged = load_merged(out)
    assert_equal(merged, expected)  # the state_dict, under the module's own names
    keys = json.loads((out / "ckptavg-manifest.json").read_text())["keys"]
    assert keys["left_out"] == 2 and all(k.startswith("callbacks.") for k in keys["left_out_examples"])
    verified = run_cli_in_process("verify", str(out), "--against", str(run))
    assert verified.returncode == 0, verified.stderr

    from lightning_run import Tiny  # here: importing it imports Lightning

    module = Tiny().to(next(iter(expected.values())).dtype)
    module.load_state_dict(merged)  # strict: every key of the module, no other
    assert_equal(module.state_dict(), expected)


def test_last_ckpt_takes_the_step_inside_it_when_no_name_tells_it(lightning_runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(lightning_runs / "32", run)
    (run / "epoch=1-step=30.ckpt").unlink()
    assert [row[:2] + row[3:] for row in _listing(run)][-1] == (30, "last.ckpt", "complete")
    result = run_cli_in_process("merge", str(run), "--steps", "10,20,30", "--out", str(tmp_path / "avg"))
    assert result.returncode == 0, result.stderr
    assert_equal(load_merged(tmp_path / "avg"), reference(_saved(lightning_runs, "32"), STEPS))


def test_hostile_hyper_parameters_are_skipped_and_never_run(tmp_path):
    """Lightning pickles hyper-parameters and callback state of any class: outside the
    state_dict, a global the allow-list does not know is never imported or called."""
    run, marker = tmp_path / "run", tmp_path / "pwned"
    saved = {step: {"w": torch.full((3, 2), float(step)), "b": torch.arange(3.0) * step} for step in (1, 2)}
    hyper_parameters = {"config": hostile_object(marker), "path": Path("/data"), "temperature": np.float64(0.5)}
    write_lightning_ckpt(run / "epoch=0-step=1.ckpt", saved[1], 1, hyper_parameters=hyper_parameters)
    callbacks = {"Mine": {"fn": hostile_object(marker, "exec"), "seen": torch.ones(2).as_subclass(TaggedTensor)}}
    write_lightning_ckpt(run / "last.ckpt", saved[2], 2, callbacks=callbacks)
    assert [row[:2] for row in _listing(run)] == [(1, "epoch=0-step=1.ckpt"), (2, "last.ckpt")]
    result = run_cli_in_process("merge", str(run), "--last", "2", "--out", str(tmp_path / "avg"))
    assert result.returncode == 0, result.stderr
    assert_equal(load_merged(tmp_path / "avg"), reference(saved, (1, 2)))
    assert not marker.exists()


class Outer:
    class Inner:
        """Pickled (protocol 2, as torch.save) as ``getattr(Outer, "Inner")``, then an object made
        of what that call returned (NEWOBJ): code the reader never runs makes the class."""

        def __init__(self) -> None:
            self.value = 1


def _tuple_nested(depth: int) -> tuple:
    key: tuple = ()
    for _ in range(depth):
        key = (key,)
    return key


HYPER_PARAMETERS = {
    # Python writes no integer of more than 4300 digits as text, so none can be part of a name.
    "integer-key-of-5000-digits": lambda: {10**5000: "lr"},
    "tensor-under-a-key-of-5000-digits": lambda: {10**5000: torch.ones(2)},
    # Hashed as a dict key in C (bounded below 1000 levels by the pickle pre-scan), printed in Python.
    "tuple-key-nested-990-deep": lambda: {_tuple_nested(990): 1},
    # zoneinfo pickles through a classmethod: getattr(ZoneInfo, "_unpickle")(key, 1), a call of a call.
    "zoneinfo": lambda: {"zone": zoneinfo.ZoneInfo("UTC")},
    "datetime-in-a-zone": lambda: {"started": datetime(2025, 1, 1, tzinfo=zoneinfo.ZoneInfo("Europe/Paris"))},
    "nested-class": lambda: {"schedule": Outer.Inner()},
    "tensor-of-a-dtype-ckptavg-does-not-read": lambda: {"phase": torch.ones(2, dtype=torch.complex64)},
}


@pytest.mark.parametrize("name", HYPER_PARAMETERS)
def test_no_hyper_parameter_stops_a_merge(tmp_path, name):
    """Each of these, saved by torch.save among a Lightning checkpoint's hyper-parameters, made
    the checkpoint fail to list or merge (a traceback, or the file refused as corrupt). Nothing
    outside the state_dict is ever needed: the merge is the exact mean of the state_dict."""
    run = tmp_path / "run"
    saved = {step: {"w": torch.full((3, 2), float(step)), "b": torch.arange(3.0) * step} for step in (1, 2)}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)  # for the pickler, which recurses once per level of the tuple
    try:
        for step, state_dict in saved.items():
            write_lightning_ckpt(
                run / f"epoch=0-step={step}.ckpt", state_dict, step, hyper_parameters=HYPER_PARAMETERS[name]()
            )
    finally:
        sys.setrecursionlimit(limit)
    assert [row[:2] for row in _listing(run)] == [(1, "epoch=0-step=1.ckpt"), (2, "epoch=0-step=2.ckpt")]
    result = run_cli_in_process("merge", str(run), "--last", "2", "--out", str(tmp_path / "avg"))
    assert result.returncode == 0, result.stderr
    assert_equal(load_merged(tmp_path / "avg"), reference(saved, (1, 2)))


@pytest.mark.parametrize("global_step", [10**5000, 2**63, -1], ids=["5000-digits", "2**63", "negative"])
@pytest.mark.parametrize("command", ["ls", "merge"])
def test_a_global_step_that_is_no_int64_step_is_one_line_naming_the_file(tmp_path, global_step, command):
    """``last.ckpt`` tells its step only inside it; a step past int64 (or below 0) is a damaged
    file, refused as any unreadable ``last.ckpt`` is: by ``ls`` too, since a listing that left it
    out would present the run's newest save as missing without a word."""
    run = tmp_path / "run"
    write_lightning_ckpt(run / "epoch=0-step=1.ckpt", {"w": torch.ones(2)}, 1)
    write_lightning_ckpt(run / "last.ckpt", {"w": torch.ones(2)}, global_step)
    args = [str(run)] if command == "ls" else [str(run), "--last", "1", "--out", str(tmp_path / "avg")]
    result = run_cli_in_process(command, *args)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("ckptavg: error: ") and "/run/last.ckpt: global_step is " in line, line
    assert "not a step from 0 to 2**63-1" in line and len(line) < 300, line
    assert not (tmp_path / "avg").exists()
