"""The hook's copy rules (``MergeHookConfig(copy=[...], copy_from=...)``): matching buffers are
taken from one captured step of each window, the newest or the oldest, in both modes, and a
resume inside a window gives the bytes of an uninterrupted run."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import files_of
from references import correctly_rounded, load_merged
from training import make_model, train_step

from ckptavg import CkptavgError, MergeHook, MergeHookConfig

MODES = ["accumulate", "snapshot"]
RULES = ["expert_bias", "tokens_seen"]
OPTIONS = {"merge_steps": [12], "window": 7, "every": 2, "release": "copy", "copy": RULES}  # steps 6-12


def _model() -> torch.nn.Module:
    model = make_model()
    model.register_buffer("expert_bias", torch.zeros(6))  # DeepSeek-V3's balancing bias: set by rule
    model.register_buffer("tokens_seen", torch.zeros(1, dtype=torch.int64))
    return model


def _train(model, optimizer, hook: MergeHook, steps, seen: dict) -> None:
    for step in steps:
        train_step(model, optimizer, step)
        with torch.no_grad():
            model.expert_bias.add_(torch.linspace(-1, 1, 6) * 1e-3 * step)
            model.tokens_seen += 16
        hook.post_train_batch(step, model)
        seen[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(folder: Path, options: dict, steps=range(1, 13), state: dict | None = None) -> dict:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: dict = {}
    hook = MergeHook(MergeHookConfig(save_folder=str(folder), **options))
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        hook.load_state_dict(state["hook"])
    hook.pre_train(steps[0] - 1)
    _train(model, optimizer, hook, steps, seen)
    if state is None and steps[-1] < 12:
        seen["checkpoint"] = {
            "model": copy.deepcopy(model.state_dict()),
            "optimizer": copy.deepcopy(optimizer.state_dict()),
            "hook": hook.state_dict(),
        }
    hook.close()
    return seen


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("copy_from", "source"), [("newest", 12), ("oldest", 6)])
def test_copied_buffers_come_from_the_windows_newest_or_oldest_step(
    tmp_path: Path, mode: str, copy_from: str, source: int
) -> None:
    seen = _run(tmp_path, {**OPTIONS, "mode": mode, "copy_from": copy_from})
    merged = load_merged(tmp_path / "step12-merged")
    for name in RULES:
        assert merged[name].dtype == seen[source][name].dtype and torch.equal(merged[name], seen[source][name])
    assert not torch.equal(seen[6]["expert_bias"], seen[12]["expert_bias"])
    # The parameters are still the exact mean of the window's steps.
    steps = range(6, 13, 2)
    for name in ("0.weight", "2.bias"):
        mean = sum(seen[s][name].double() for s in steps) / len(steps)
        assert torch.equal(merged[name], correctly_rounded(mean, torch.bfloat16))


@pytest.mark.parametrize("resume_at", [7, 9])
def test_a_resume_inside_the_window_keeps_the_copied_values_bit_identical(tmp_path: Path, resume_at: int) -> None:
    options = {**OPTIONS, "copy_from": "oldest"}
    _run(tmp_path / "straight", options)
    first = _run(tmp_path / "resumed", options, steps=range(1, resume_at + 1))
    _run(tmp_path / "resumed", options, steps=range(resume_at + 1, 13), state=first["checkpoint"])
    straight = files_of(tmp_path / "straight" / "step12-merged")
    assert files_of(tmp_path / "resumed" / "step12-merged") == straight != {}
    # Resumed under other rules, the saved values would be read as sums (or the other way round).
    with pytest.raises(CkptavgError, match="the hook state's open windows copy .*'oldest'.* this hook copies"):
        _run(
            tmp_path / "other",
            {**OPTIONS, "copy_from": "newest"},
            steps=range(resume_at + 1, 13),
            state=first["checkpoint"],
        )


def test_a_changing_counter_without_a_rule_names_the_rule(tmp_path: Path) -> None:
    with pytest.raises(CkptavgError, match=r"tokens_seen' changed at step 8.*\(copy=\['tokens_seen'\] takes it"):
        _run(tmp_path, {**OPTIONS, "copy": ["expert_bias"]})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"copy": "expert_bias"}, "copy must be a list of globs"),
        ({"copy_from": 8}, "copy_from must be 'newest' or 'oldest'"),
    ],
)
def test_bad_copy_options_are_refused(tmp_path: Path, options: dict, message: str) -> None:
    with pytest.raises(CkptavgError, match=message):
        MergeHookConfig(save_folder=str(tmp_path), merge_steps=[4], window=2, **options)
