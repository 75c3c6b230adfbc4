"""The hook's block averages (``mode="blocks"``) and the merges ``ckptavg merge`` builds from them:
each block the mean of its steps against float64 means of a real training loop, windows of
blocks within one ulp of the float64 mean of their steps (and correctly rounded almost
everywhere), many windows from one read, weightings at block granularity, bit-identical resumes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from helpers import alarm, files_of, run_cli_in_process, write_checkpoint
from references import correctly_rounded, load_merged, same_bits, weighted_correctly_rounded
from safetensors.torch import load_file
from training import Run

import ckptavg
from ckptavg import CkptavgError, MergeHookConfig
from ckptavg.formats import open_checkpoint
from ckptavg.formats.layout import TensorSpec
from ckptavg.formats.parts import Block, block_info, write_rank_file
from ckptavg.io.fs import resolve

BLOCK = 4
OPTIONS = {"mode": "blocks", "block": BLOCK}


def _trained(folder: Path, options: dict = OPTIONS, last: int = 24) -> Run:
    run = Run(folder, options)
    run.hook.pre_train(0)
    run.train(range(1, last + 1))
    run.hook.close()
    return run


def mean64(run: Run, steps: range) -> dict[str, torch.Tensor]:
    return {name: sum(run.seen[s][name] for s in steps) / len(steps) for name in run.seen[steps[-1]]}


def ulps(values: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """How many spacings of ``dtype`` (at the larger magnitude of the two) apart each pair is."""
    bits, smallest = {torch.bfloat16: (8, -133), torch.float32: (24, -149)}[dtype]
    _, exponent = torch.frexp(torch.maximum(values.double().abs(), reference.abs()))
    spacing = torch.ldexp(torch.ones_like(reference), torch.clamp(exponent - bits, min=smallest))
    return (values.double() - reference).abs() / spacing


def assert_close_to_the_mean(
    merged: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], share: float = 0.999
) -> None:
    """bf16, as trained: the correct rounding of the float64 reference in at least ``share`` of
    the elements, and within one ulp of it everywhere."""
    assert set(merged) == set(reference)
    equal = total = 0
    for name, value in merged.items():
        assert value.dtype == torch.bfloat16, name
        equal += int(same_bits(value, correctly_rounded(reference[name], torch.bfloat16)).sum())
        total += value.numel()
        assert float(ulps(value, reference[name], torch.bfloat16).max()) <= 1.0, name
    assert equal >= share * total, (equal, total)


def test_each_block_is_the_mean_of_its_steps(tmp_path):
    """fp32 sums of bf16 weights are exact here, so each block holds the correctly rounded fp32
    mean of its steps, with a record of them; ``ckptavg ls`` lists the blocks."""
    run = _trained(tmp_path)
    for end in range(BLOCK, 25, BLOCK):
        folder = tmp_path / f"step{end}-block"
        block = load_file(str(folder / "rank00000-of-00001.safetensors"))
        for name, expected in mean64(run, range(end - BLOCK + 1, end + 1)).items():
            assert block[name].dtype == torch.float32
            assert bool(same_bits(block[name], correctly_rounded(expected, torch.float32)).all()), (end, name)
        with open_checkpoint(*resolve(str(folder))) as reader:
            record = reader.block_record()
        assert (record.step, record.block, record.every, record.count, record.first_step) == (
            end,
            BLOCK,
            1,
            BLOCK,
            end - BLOCK + 1,
        )
        assert set(record.dtypes.values()) == {torch.bfloat16}
    listing = json.loads(run_cli_in_process("ls", str(tmp_path), "--json").stdout)
    assert [(r["name"], r["format"], r["status"]) for r in listing] == [
        (f"step{end}-block", "block", "complete") for end in range(BLOCK, 25, BLOCK)
    ]
    assert run.merged == []  # blocks are no merges: on_merged is not called


def test_windows_of_blocks_are_within_one_ulp_and_swept_from_one_read(tmp_path):
    """No per-step checkpoint exists: a window of whole blocks is built from them, bf16 as trained,
    and verified against them; three windows and two weightings from one read of the six blocks,
    ``wma`` weighing each block as one checkpoint (1, 2, ... from the oldest)."""
    run = _trained(tmp_path)
    result = run_cli_in_process("merge", str(tmp_path), "--merge-step", "24", "--window", "16")
    assert result.returncode == 0, result.stderr
    assert_close_to_the_mean(load_merged(tmp_path / "step24-merged"), mean64(run, range(9, 25)))
    manifest = json.loads((tmp_path / "step24-merged" / "ckptavg-manifest.json").read_text())
    assert [(s["format"], s["block"]["first_step"], s["block"]["count"]) for s in manifest["sources"]] == [
        ("block", end - BLOCK + 1, BLOCK) for end in (12, 16, 20, 24)
    ]
    assert manifest["dtype_policy"]["output"] == "same as the trained parameters"
    verified = run_cli_in_process("verify", str(tmp_path / "step24-merged"), "--against", str(tmp_path))
    assert verified.returncode == 0 and "4 tensors recomputed from the sources: identical" in verified.stdout

    args = ["--merge-step", "24", "--window", "8,16,24", "--weighting", "uniform,wma", "--out", str(tmp_path / "sw")]
    swept = run_cli_in_process("merge", str(tmp_path), *args, "--json")
    assert swept.returncode == 0, swept.stderr
    report = json.loads(swept.stdout)
    block_bytes = report["bytes_read"] // 6  # each of the six blocks read once
    assert report["bytes_read_by_separate_merges"] == block_bytes * 2 * (2 + 4 + 6)
    for window in (8, 16, 24):
        ends = range(24 - window + BLOCK, 25, BLOCK)
        means = [mean64(run, range(end - BLOCK + 1, end + 1)) for end in ends]
        uniform = {name: sum(m[name] for m in means) / len(means) for name in means[0]}
        wma = {
            name: sum((i + 1) * m[name] for i, m in enumerate(means)) / sum(range(1, len(means) + 1))
            for name in uniform
        }
        assert_close_to_the_mean(load_merged(tmp_path / "sw" / f"step24-merged-w{window}-uniform"), uniform)
        # Within one ulp of the ideal weighted mean of the blocks' exact means; and bit for bit the
        # exact weighted sum of the blocks as stored (their fp32 means), with the normalised weights
        # the manifest records, correctly rounded: where the ideal sum is a midpoint of bf16, the
        # weights' own rounding (1/3 and 2/3 sum to 1 - 2**-53) decides the side.
        folder = tmp_path / "sw" / f"step24-merged-w{window}-wma"
        merged = load_merged(folder)
        assert_close_to_the_mean(merged, wma, 0.95)
        sources = json.loads((folder / "ckptavg-manifest.json").read_text())["sources"]
        assert [s["block"]["first_step"] + BLOCK - 1 for s in sources] == list(ends)
        blocks = [load_file(str(tmp_path / f"step{end}-block" / "rank00000-of-00001.safetensors")) for end in ends]
        weights = [s["weight"] for s in sources]
        for name, value in merged.items():
            expected = weighted_correctly_rounded([b[name] for b in blocks], weights, value.dtype)
            assert bool(same_bits(value.reshape(-1), expected).all()), (window, name)


def _bf16(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.to(torch.bfloat16) for name, tensor in weights.items()}  # exact: they were bf16


def test_a_window_is_built_from_blocks_only_where_they_hold_more_of_its_steps(tmp_path):
    """Checkpoints of every step of the window win (their mean is exact); a window that misses
    one, or checkpoints saved every 4 steps, take the blocks; a window that blocks cannot tile
    says why in its error."""
    run = _trained(tmp_path)
    for step in range(17, 25):
        write_checkpoint(tmp_path / f"step{step}", _bf16(run.seen[step]))

    def chosen(window: int) -> list[str]:
        return [c.name for c in ckptavg.select(str(tmp_path), merge_step=24, window=window).checkpoints]

    assert chosen(8) == [f"step{s}" for s in range(17, 25)]
    assert chosen(16) == [f"step{s}-block" for s in (12, 16, 20, 24)]
    with pytest.raises(CkptavgError, match="windows 16 are built from the training hook's blocks, windows 8 from"):
        ckptavg.select_sweep(str(tmp_path), merge_step=24, windows=[8, 16])  # one pass reads one kind
    (tmp_path / "step19" / "model.safetensors").unlink()
    assert chosen(8) == ["step20-block", "step24-block"]
    with pytest.raises(CkptavgError, match=r"misses 1 step: 19 .*blocks of the training hook: they hold 4 steps each"):
        chosen(6)
    for step in (17, 18, 21, 22, 23):
        (tmp_path / f"step{step}" / "model.safetensors").unlink()
    assert chosen(8) == ["step20-block", "step24-block"]  # saves every 4 steps: 2 of the 8


@pytest.mark.parametrize("resume_at", [6, 8, 13])
def test_resumed_blocks_are_bit_identical_and_a_lost_timelines_are_withdrawn(tmp_path, resume_at):
    """Checkpoint at ``resume_at`` (inside a block, at a block's end, inside a later one), a lost
    timeline on other data that writes blocks, then a resume: the blocks wholly after the resume
    point are gone before training goes on, and in the end every block equals the uninterrupted
    run's."""
    straight = tmp_path / "straight"
    _trained(straight)
    folder = tmp_path / "resumed"
    first = Run(folder, OPTIONS)
    first.hook.pre_train(0)
    first.train(range(1, resume_at + 1))
    checkpoint = first.checkpoint()
    first.train(range(resume_at + 1, resume_at + 9), seed=1)  # the lost timeline
    first.hook.close()
    second = Run.resumed(folder, OPTIONS, checkpoint, resume_at)
    second.train([resume_at + 1])
    second.hook.state_dict()
    left = sorted(int(p.name.removesuffix("-block").removeprefix("step")) for p in folder.glob("*-block"))
    assert [end for end in left if end - BLOCK >= resume_at] == []
    second.train(range(resume_at + 2, 25))
    second.hook.close()
    assert sorted(p.name for p in folder.glob("*-block")) == sorted(p.name for p in straight.glob("*-block"))
    for block in straight.glob("*-block"):
        assert files_of(folder / block.name, "rank") == files_of(block, "rank"), block.name


def test_a_hook_begun_inside_a_block_starts_with_the_next(tmp_path, caplog):
    run = Run(tmp_path, OPTIONS)
    run.hook.pre_train(6)
    with caplog.at_level(logging.WARNING, logger="ckptavg"):
        run.train(range(7, 17))
    run.hook.close()
    assert "the hook starts after step 6, inside the block of steps 5-8: that block is not written" in caplog.text
    assert sorted(p.name for p in tmp_path.glob("*-block")) == ["step12-block", "step16-block"]
    result = run_cli_in_process("merge", str(tmp_path), "--merge-step", "16", "--window", "12")
    assert result.returncode == 1
    assert (
        "no checkpoint in the window 5-16" in result.stderr and "those ending at steps 8 are missing" in result.stderr
    )


def test_blocks_are_averaged_only_with_blocks_of_as_many_steps(tmp_path):
    """The library takes any folders: a block with one step's weights, or blocks of another
    length, would be a weighted average nobody asked for."""
    run = _trained(tmp_path / "a")
    _trained(tmp_path / "b", {"mode": "blocks", "block": 8}, last=16)
    write_checkpoint(tmp_path / "step24", _bf16(run.seen[24]))
    with pytest.raises(CkptavgError, match=r"step24-block is a block \(the mean of 4 steps\) and .*step24 one step's"):
        ckptavg.average([str(tmp_path / "a" / "step24-block"), str(tmp_path / "step24")], str(tmp_path / "out"))
    with pytest.raises(CkptavgError, match=r"step20-block is the mean of 4 steps, .*step16-block of 8"):
        ckptavg.average(
            [str(tmp_path / "a" / "step20-block"), str(tmp_path / "b" / "step16-block")], str(tmp_path / "o")
        )
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "blocks"}, "mode='blocks' needs block, the steps per block .* got None"),
        ({"mode": "blocks", "block": 0}, "needs block, the steps per block .* got 0"),
        ({"mode": "blocks", "block": 10, "every": 4}, "every=4 must divide block=10"),
        ({"mode": "blocks", "block": 10, "merge_steps": [10]}, "mode='blocks' writes a block every `block` steps"),
        ({"mode": "blocks", "block": 10, "weighting": "wma"}, "mode='blocks' takes no weighting"),
        ({"merge_steps": [10], "block": 10}, "block is for mode='blocks', not mode='accumulate'"),
    ],
)
def test_block_config_errors_name_the_value(tmp_path, options, message):
    with pytest.raises(CkptavgError, match=message):
        MergeHookConfig(save_folder=str(tmp_path), **options)


@pytest.mark.parametrize(
    ("start", "trained", "skipped"), [(0, [3], 1), (0, [1, 2, 5], 3), (0, [1, 2, 3, 4, 7], 5), (6, [13], 9)]
)
def test_a_skipped_step_of_a_block_is_an_error(tmp_path, start, trained, skipped):
    """From the first call on, and across whole blocks (a hook begun inside a block skips only
    that one)."""
    run = Run(tmp_path, OPTIONS)
    run.hook.pre_train(start)
    end = -(-skipped // BLOCK) * BLOCK
    message = f"post_train_batch was not called for step {skipped}, which the block ending at step {end} averages"
    with pytest.raises(CkptavgError, match=message):
        run.train(trained)
    run.hook.close()


def test_a_window_of_blocks_past_any_run_is_counted_not_listed(tmp_path):
    """A block at step 10**16 and a window of as many steps: the missing blocks are counted and
    the first few named, at once (their list would never end)."""
    step = 10**16
    folder = tmp_path / f"step{step}-block"
    w = torch.zeros(4)
    write_rank_file(
        *resolve(str(folder)),
        0,
        1,
        [TensorSpec("w", w.dtype, (4,))],
        [Block("w", (0,), w)],
        block_info(step, BLOCK, 1, BLOCK, {"w": torch.bfloat16}),
    )
    with alarm(20), pytest.raises(CkptavgError, match=r"those ending at steps 4, 8, 12, 16, 20 \.\.\. are missing"):
        ckptavg.select(str(tmp_path), merge_step=step, window=step)
