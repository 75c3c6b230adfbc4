"""The hook inside torchtitan's real ``Trainer`` (``MergingTrainer``, tests/titan_trainer.py, in
processes of their own), killed inside a merge window and resumed through torchtitan's own
checkpoint: merges equal to the float64 mean of the weights the trainer reached (accumulate and
snapshot mode; one process, and FSDP2 over 2 gloo processes with async checkpoints and a DCP merge
that torchtitan loads back), and an EMA bit-identical to a run never interrupted."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_scripts
from references import correctly_rounded, load_merged, same_bits
from safetensors.torch import load_file

from ckptavg import CkptavgError, MergeHook, MergeHookConfig

MERGE_STEP, WINDOW = 6, 4  # as titan_trainer.py: checkpoints at steps 2, 4, 6; killed before step 5


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Runs killed before step 5 (after torchtitan's checkpoint at step 4, inside the window of
    steps 3-6), then resumed: accumulate, snapshot, EMA, and accumulate on 2 processes with FSDP2,
    async checkpoints and a DCP merge; an EMA run never interrupted (its weights are every
    one-process run's). A round's runs go at once."""
    root = tmp_path_factory.mktemp("titan")
    resumed = [
        ("titan_trainer.py", "train", str(root / "accumulate"), "--record"),
        ("titan_trainer.py", "train", str(root / "snapshot"), "--mode", "snapshot", "--record"),
        ("titan_trainer.py", "train", str(root / "ema"), "--mode", "ema"),
        ("titan_trainer.py", "train", str(root / "fsdp"), "--world", "2", "--format", "dcp", "--async", "--record"),
    ]
    whole = ("titan_trainer.py", "train", str(root / "ema-whole"), "--mode", "ema", "--record")
    run_scripts(whole, *(command + ("--die-at", "5") for command in resumed))
    for command in resumed:
        run = Path(command[2])
        assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["step-2", "step-4"]
        assert not list((run / "merges").glob("step*-merged*")), "the killed run merged"
    run_scripts(*resumed)
    merged = root / "fsdp" / "merges" / "step6-merged"
    run_scripts(("titan_trainer.py", "load", str(merged), str(root / "fsdp-loaded.safetensors")))
    return root


def _assert_mean_of_window(merged: dict, weights: Path) -> None:
    steps = range(MERGE_STEP - WINDOW + 1, MERGE_STEP + 1)
    saved = [load_file(weights / f"step-{s}.safetensors") for s in steps]
    assert merged.keys() == saved[0].keys()
    for name, tensor in merged.items():
        mean = sum(step[name].double() for step in saved) / len(saved)
        assert bool(same_bits(tensor, correctly_rounded(mean, tensor.dtype)).all()), name


@pytest.mark.parametrize("mode", ["accumulate", "snapshot"])
def test_merging_trainer_killed_inside_the_window_merges_it_after_torchtitans_resume(runs, mode):
    _assert_mean_of_window(load_merged(runs / mode / "merges" / "step6-merged"), runs / mode / "weights")
    # ... which is the mean an uninterrupted run averages: torchtitan's resume retraces its steps.
    for step in range(MERGE_STEP - WINDOW + 1, MERGE_STEP + 1):
        resumed = load_file(runs / mode / "weights" / f"step-{step}.safetensors")
        whole = load_file(runs / "ema-whole" / "weights" / f"step-{step}.safetensors")
        assert all(bool(same_bits(tensor, whole[name]).all()) for name, tensor in resumed.items()), step


def test_merging_trainer_ema_resumed_through_torchtitans_checkpoint_is_bit_identical(runs):
    whole = load_merged(runs / "ema-whole" / "merges" / "step6-merged-ema-halflife2")
    resumed = load_merged(runs / "ema" / "merges" / "step6-merged-ema-halflife2")
    assert whole.keys() == resumed.keys() and whole
    for name, tensor in whole.items():
        assert bool(same_bits(tensor, resumed[name]).all()), name


def test_merging_trainer_with_fsdp2_and_async_checkpoints_writes_a_dcp_merge_torchtitan_loads(runs):
    assert (runs / "fsdp" / "merges" / "step6-merged" / ".metadata").is_file()
    _assert_mean_of_window(load_file(runs / "fsdp-loaded.safetensors"), runs / "fsdp" / "weights")


@pytest.mark.parametrize("saved", ["{not json", "[1, 2]", None, '{"format": "other", "version": 1}'])
def test_a_damaged_hook_state_in_a_torchtitan_checkpoint_is_one_error_naming_the_checkpoint(tmp_path, saved):
    import titan_trainer

    titan_trainer.install_cpu_shims()  # the adapter imports torchtitan's trainer
    from ckptavg.hook.integrations.torchtitan import HookState

    state = HookState(
        MergeHook(MergeHookConfig(save_folder=str(tmp_path), merge_steps=[6], window=4)), "/run/checkpoint"
    )
    with pytest.raises(
        CkptavgError, match=r"^/run/checkpoint: the state 'ckptavg' of a torchtitan checkpoint there"
    ) as raised:
        state.load_state_dict({"json": saved})
    assert "\n" not in str(raised.value)
