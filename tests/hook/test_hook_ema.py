"""The hook's horizon-free EMA (``mode="ema"``): one running average of the whole run, against a
float64 EMA computed beside a real training loop within the bound its arithmetic allows;
exported at each merge step; resumed bit for bit; its saved states kept where a resume needs
them and nowhere else."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from helpers import files_of, run_cli_in_process
from references import correctly_rounded, load_merged
from training import Run

from ckptavg import CkptavgError, MergeHookConfig

# Unit roundoffs: the accumulator's, and the reference's own (float64) added to it.
FP32, FP64 = 2.0**-24, 2.0**-53


def reference_ema(
    run: Run, last: int, every: int, fraction: float | None, halflife: float | None, unit: float
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The EMA of the weights the run saw at steps ``every, 2*every, ... last``, in float64, as
    the issue defines it (it starts as the first step's weights; a later captured step ``t``
    folds in as ``d * ema + (1 - d) * weights``, ``d = 2 ** (-(t - s) / (fraction * t))`` from the
    previous captured step ``s``, or ``2 ** (-(t - s) / halflife)``), and a bound on how far an
    EMA kept in a format of unit roundoff ``unit`` may lie from it.

    The bound: one fold computes ``fl(fl(d' * e) + fl(w' * x))`` with ``d'`` and ``w'`` the
    factors rounded to the format, five roundings of relative size at most ``unit`` along two
    products of three, so it adds at most ``g * (d * |e| + w * |x|)``, ``g = (1 + unit)**3 - 1``,
    ``|e| <= |ema| + bound``; an earlier error shrinks by ``d``. The first step is exact."""
    ema: dict[str, torch.Tensor] = {}
    bound: dict[str, torch.Tensor] = {}
    u = unit + FP64  # the reference's own float64 roundings count too
    g = u * (3 + 3 * u + u * u)  # (1 + u)**3 - 1, without rounding 1 + u to 1
    previous = None
    for step in range(every, last + 1, every):
        weights = run.seen[step]
        if previous is None:
            ema = {k: v.clone() for k, v in weights.items()}
            bound = {k: torch.zeros_like(v) for k, v in weights.items()}
        else:
            half_life = fraction * step if fraction is not None else halflife
            d = 2.0 ** (-(step - previous) / half_life)
            w = 1.0 - d
            for k, x in weights.items():
                bound[k] = d * bound[k] + g * (d * (ema[k].abs() + bound[k]) + w * x.abs())
                ema[k] = d * ema[k] + w * x
        previous = step
    return ema, bound


def assert_within(folder: Path, ema: dict[str, torch.Tensor], bound: dict[str, torch.Tensor], dtype) -> None:
    """Each element of the export lies between the roundings to its dtype of ``ema - bound``
    and ``ema + bound`` (rounding is monotonic: so does the rounding of any value between)."""
    merged = load_merged(folder)
    assert set(merged) == set(ema)
    for name, value in merged.items():
        assert value.dtype == dtype, name
        low = correctly_rounded(ema[name] - bound[name], dtype).double()
        high = correctly_rounded(ema[name] + bound[name], dtype).double()
        inside = (low <= value.double()) & (value.double() <= high)
        assert bool(inside.all()), (name, (value.double() - ema[name]).abs().max(), bound[name].max())


@pytest.mark.parametrize(
    ("options", "param_dtype", "out_dtype", "unit"),
    [
        ({"dtype": "fp32"}, torch.bfloat16, torch.float32, FP32),  # the EMA itself, as kept
        ({"every": 2, "ema_halflife": 3}, torch.bfloat16, torch.bfloat16, FP32),  # rounded to the parameters'
        ({"float64_accumulator": True, "ema_horizon_fraction": 0.1}, torch.float32, torch.float32, FP64),
    ],
    ids=["bf16-fraction-fp32-out", "bf16-halflife-every-2", "fp32-in-fp64"],
)
def test_the_ema_stays_within_its_bound_of_a_float64_ema(tmp_path, options, param_dtype, out_dtype, unit):
    """A real training loop; at each merge step the export lies within the bound of the float64
    EMA of the same steps (so it is that EMA, as the arithmetic can keep it), and says what it
    is: its name, method, decay and the steps it averages."""
    every = options.get("every", 1)
    run = Run(tmp_path, {"mode": "ema", "merge_steps": [8, 20], **options}, dtype=param_dtype)
    run.hook.pre_train(0)
    run.train(range(1, 22))
    run.hook.close()
    fraction = options.get("ema_horizon_fraction", None if "ema_halflife" in options else 0.05)
    halflife = options.get("ema_halflife")
    tag = f"ema-halflife{halflife}" if halflife else f"ema-horizon{fraction}"
    assert run.merged == [(str(tmp_path / f"step{s}-merged-{tag}"), s) for s in (8, 20)]
    for merge_step in (8, 20):
        ema, bound = reference_ema(run, merge_step, every, fraction, halflife, unit)
        assert_within(tmp_path / f"step{merge_step}-merged-{tag}", ema, bound, out_dtype)
    manifest = json.loads((tmp_path / f"step20-merged-{tag}" / "ckptavg-manifest.json").read_text())
    assert manifest["method"] == "running-ema"
    assert manifest["weighting"]["ema_halflife_steps" if halflife else "ema_horizon_fraction"] == (halflife or fraction)
    (source,) = manifest["sources"]
    assert (source["first_step"], source["step"], source["steps_averaged"]) == (every, 20, 20 // every)
    result = run_cli_in_process("verify", str(tmp_path / f"step20-merged-{tag}"))
    assert result.returncode == 0, result.stderr


def test_the_bound_is_tight_enough_to_tell_a_wrong_decay(tmp_path):
    """The check above fails an EMA of another decay (the step before's, ``fraction * (t - 1)``):
    the bound leaves no room for it."""
    run = Run(tmp_path, {"mode": "ema", "merge_steps": [20], "dtype": "fp32"})
    run.hook.pre_train(0)
    run.train(range(1, 21))
    run.hook.close()
    ema, bound = reference_ema(run, 20, 1, 0.05, None, FP32)
    assert_within(tmp_path / "step20-merged-ema-horizon0.05", ema, bound, torch.float32)
    shifted = {s - 1: w for s, w in run.seen.items()}  # the same weights, each a step earlier
    run.seen = shifted
    wrong, _ = reference_ema(run, 19, 1, 0.05, None, FP32)
    with pytest.raises(AssertionError):
        assert_within(tmp_path / "step20-merged-ema-horizon0.05", wrong, bound, torch.float32)


RESUME = {"mode": "ema", "merge_steps": [8, 14], "ema_horizon_fraction": 0.1}


def _straight(folder: Path, options: dict) -> Run:
    run = Run(folder, options)
    run.hook.pre_train(0)
    run.train(range(1, 17))
    run.hook.close()
    return run


@pytest.mark.parametrize(
    ("every", "resume_at"), [(1, 3), (1, 8), (1, 11), (2, 5)], ids=["early", "at-export", "late", "every-2"]
)
def test_a_resumed_ema_is_bit_identical_to_an_uninterrupted_one(tmp_path, every, resume_at):
    """Checkpoint at ``resume_at``, a lost timeline on other data (it exports step 14 when it gets
    there), then a resume from the checkpoint: every export equals the uninterrupted run's."""
    options = {**RESUME, "every": every}
    _straight(tmp_path / "straight", options)
    folder = tmp_path / "resumed"
    first = Run(folder, options)
    first.hook.pre_train(0)
    first.train(range(1, resume_at + 1))
    checkpoint = first.checkpoint()
    json.dumps(checkpoint["hook"])  # small and JSON-serialisable
    last = resume_at - resume_at % every
    assert checkpoint["hook"]["ema"] == {"first_step": every, "last_step": last, "count": last // every}
    first.train(range(resume_at + 1, resume_at + 5), seed=1)  # the lost timeline
    first.hook.close()
    second = Run.resumed(folder, options, checkpoint, resume_at)
    second.train(range(resume_at + 1, 17))
    second.hook.close()
    for merge_step in (8, 14):
        name = f"step{merge_step}-merged-ema-horizon0.1"
        assert files_of(folder / name) == files_of(tmp_path / "straight" / name), name
    assert [s for _, s in second.merged] == [s for s in (8, 14) if s > resume_at]


def test_saved_emas_stay_for_checkpoints_and_go_for_merge_steps(tmp_path):
    """A merge step's saved EMA goes at the next checkpoint unless that checkpoint is at the
    merge step itself (then it is that checkpoint's state); a checkpoint's stays."""
    run = Run(tmp_path, {"mode": "ema", "merge_steps": [4, 8]})
    run.hook.pre_train(0)
    run.train(range(1, 7))
    state = tmp_path / ".ckptavg-state"
    run.hook.state_dict()
    assert sorted(p.name for p in state.iterdir()) == ["step6"]  # step 4's went
    run.train([7, 8])
    run.checkpoint()
    run.train([9])
    run.checkpoint()
    run.hook.close()
    assert sorted(p.name for p in state.iterdir()) == ["step6", "step8", "step9"]
    assert [p.name for p in (state / "step8").iterdir()] == ["ema-ema-horizon0.05"]


def _checkpointed(folder: Path, options: dict = RESUME, steps: int = 5) -> dict:
    run = Run(folder, options)
    run.hook.pre_train(0)
    run.train(range(1, steps + 1))
    checkpoint = run.checkpoint()
    run.hook.close()
    return checkpoint


def test_an_ema_without_its_saved_state_is_refused(tmp_path):
    checkpoint = _checkpointed(tmp_path)
    shutil.rmtree(tmp_path / ".ckptavg-state" / "step5")
    resumed = Run.resumed(tmp_path, RESUME, checkpoint, 5)
    with pytest.raises(
        CkptavgError,
        match=r"resumes after step 5 with the EMA of steps 1-5, but its saved state is missing from .*step5",
    ):
        resumed.train([6])
    resumed.hook.close()


def test_a_resume_that_forgot_the_hook_state_is_refused_not_restarted(tmp_path):
    """A fresh hook at step 5 of a run whose EMA was saved there would quietly start another EMA."""
    checkpoint = _checkpointed(tmp_path)
    second = Run(tmp_path, RESUME)
    second.model.load_state_dict(checkpoint["model"])
    second.hook.pre_train(5)
    with pytest.raises(CkptavgError, match="resumes after step 5 without a hook state, but this run had an EMA"):
        second.train([6])
    second.hook.close()


def test_a_hook_begun_mid_run_starts_its_ema_there(tmp_path, caplog):
    """Where no run had an EMA, one starts at the first step the hook sees: the export says so."""
    run = Run(tmp_path, {"mode": "ema", "merge_steps": [12]})
    run.hook.pre_train(5)
    with caplog.at_level(logging.INFO, logger="ckptavg"):
        run.train(range(6, 13))
    run.hook.close()
    assert "the EMA starts at the first captured step after step 5" in caplog.text
    manifest = json.loads((tmp_path / "step12-merged-ema-horizon0.05" / "ckptavg-manifest.json").read_text())
    assert manifest["sources"][0]["first_step"] == 6


def test_a_corrupt_saved_ema_is_detected(tmp_path):
    checkpoint = _checkpointed(tmp_path)
    (part,) = (tmp_path / ".ckptavg-state" / "step5" / "ema-ema-horizon0.1").glob("*.safetensors")
    data = bytearray(part.read_bytes())
    data[-3] ^= 0x40
    part.write_bytes(bytes(data))
    resumed = Run.resumed(tmp_path, RESUME, checkpoint, 5)
    with pytest.raises(CkptavgError, match=r"rank00000-of-00001.safetensors is corrupt: its sha256 differs"):
        resumed.train([6])
    resumed.hook.close()


def test_a_saved_ema_of_another_step_is_refused(tmp_path):
    """Whole files (their sha256 right) that hold the EMA of another step than the hook state's."""
    run = Run(tmp_path, RESUME)
    run.hook.pre_train(0)
    run.train(range(1, 5))
    run.checkpoint()
    run.train([5])
    checkpoint = run.checkpoint()
    run.hook.close()
    state = tmp_path / ".ckptavg-state"
    shutil.rmtree(state / "step5")
    shutil.copytree(state / "step4", state / "step5")
    resumed = Run.resumed(tmp_path, RESUME, checkpoint, 5)
    with pytest.raises(CkptavgError, match=r"ema-ema-horizon0.1 holds step 4, but the hook state says 5"):
        resumed.train([6])
    resumed.hook.close()


def test_a_resume_with_another_decay_is_refused(tmp_path):
    checkpoint = _checkpointed(tmp_path)
    with pytest.raises(CkptavgError, match=r"'ema_horizon_fraction': 0.1.*this hook weighs .*'ema_halflife_steps'"):
        Run.resumed(tmp_path, {**RESUME, "ema_horizon_fraction": None, "ema_halflife": 5}, checkpoint, 5)


# The EMA's record in the hook state, of other types or values than state_dict() writes.
DAMAGED = {
    "a-list": lambda ema: [1, 5, 5],
    "first-after-last": lambda ema: {**ema, "first_step": 6},
    "last-after-the-step": lambda ema: {**ema, "last_step": 9},
    "count-a-string": lambda ema: {**ema, "count": "5"},
    "count-zero": lambda ema: {**ema, "count": 0},
}


@pytest.mark.parametrize("damage", DAMAGED.values(), ids=DAMAGED)
def test_a_damaged_ema_record_is_refused_when_loaded(tmp_path, damage):
    state = json.loads(json.dumps(_checkpointed(tmp_path)["hook"]))
    state["ema"] = damage(state["ema"])
    run = Run(tmp_path, RESUME)
    with pytest.raises(CkptavgError, match="not a MergeHook state: its EMA .* is not what state_dict"):
        run.hook.load_state_dict(state)
    run.hook.close()


def test_a_skipped_step_is_an_error(tmp_path):
    run = Run(tmp_path, RESUME)
    run.hook.pre_train(0)
    run.train(range(1, 4))
    with pytest.raises(CkptavgError, match="post_train_batch was not called for step 4, which the EMA averages"):
        run.train([5])
    run.hook.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"merge_steps": [10], "ema_horizon_fraction": 0.05}, "ema_horizon_fraction is for mode='ema', not mode='acc"),
        ({"mode": "ema", "merge_steps": [10], "ema_halflife": 5, "ema_horizon_fraction": 0.1}, "one of ema_horizon"),
        ({"mode": "ema", "merge_steps": [10], "ema_horizon_fraction": 0.0}, "positive finite number, got 0.0"),
        ({"mode": "ema", "merge_steps": [10], "ema_halflife": float("nan")}, "positive finite number, got nan"),
        ({"mode": "ema", "merge_steps": [10], "weighting": "wma"}, "mode='ema' takes no weighting"),
        ({"mode": "ema"}, "give exactly one of merge_steps or merge_interval"),
    ],
)
def test_ema_config_errors_name_the_value(tmp_path, options, message):
    with pytest.raises(CkptavgError, match=message):
        MergeHookConfig(save_folder=str(tmp_path), **options)


def test_an_export_step_the_ema_does_not_capture_is_refused(tmp_path):
    run = Run(tmp_path, {"mode": "ema", "merge_steps": [9], "every": 2})
    with pytest.raises(CkptavgError, match="merge step 9 is no multiple of every=2"):
        run.hook.pre_train(0)
    run.hook.close()
