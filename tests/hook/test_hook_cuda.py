"""The hook's CUDA path (pinned host buffers, a side stream, events), with the same checks on the CPU.

Each check runs on "cpu" (always) and on "cuda" (only where CUDA exists: skipped elsewhere, so
in CI these have not run on a GPU). On the CPU the worker reads parameters in place and the next
optimizer step waits for that read; on CUDA they are copied into reused pinned buffers on a side
stream, and the next optimizer step's stream waits for the copy on the device. Every expected
value is a float64 mean computed here from weights copied to the CPU synchronously after each
step, never by the hook.
"""

from __future__ import annotations

import time

import pytest
import torch
from training import Run, RunningMean, assert_exact, expected_mean, full_weights, make_model, train_step

from ckptavg.hook.capture import WeightCapture
from ckptavg.hook.stores import AccumulateStore, SnapshotStore

NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the hook's pinned-buffer / side-stream path"
)
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]
MODES = ["accumulate", "snapshot"]
READ_DELAY_S = 0.1  # the worker's sleep before each read in the "late" tests
GPU_DELAY_CYCLES = 50_000_000  # the side stream's spin before each copy: tens of milliseconds


def delay_reads(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every store's worker sleeps before it reads a capture."""
    for store in (AccumulateStore, SnapshotStore):

        def late_add(self, capture, layout, factors, _add=store.add):
            time.sleep(seconds)
            _add(self, capture, layout, factors)

        monkeypatch.setattr(store, "add", late_add)


def make_captures_late(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """The worker reads late and, on CUDA, the side stream copies late: a change to the weights
    that is not ordered after the read then lands in the merge, and a host buffer handed out
    again before its reader is done gets overwritten under it."""
    delay_reads(monkeypatch, READ_DELAY_S)
    if device != "cuda":
        return
    copy = WeightCapture._copy

    def late_copy(self, pairs):
        for cuda in {tensor.device for tensor, _ in pairs if tensor.is_cuda}:
            if cuda not in self._streams:
                self._streams[cuda] = torch.cuda.Stream(cuda)
            with torch.cuda.stream(self._streams[cuda]):
                torch.cuda._sleep(GPU_DELAY_CYCLES)  # queued before the copies, on their stream
        return copy(self, pairs)

    monkeypatch.setattr(WeightCapture, "_copy", late_copy)


def with_forward_buffer(run: Run) -> Run:
    """A buffer the forward pass changes: copied at once, unlike parameters."""
    run.model.insert(1, RunningMean(24).to(run.device))
    return run


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("device", DEVICES)
def test_bf16_merges_are_the_exact_mean_of_each_steps_weights(tmp_path, device, mode):
    """Overlapping windows (steps 2-6 and 5-9), every step captured: each merge is the correctly
    rounded float64 mean, bit for bit, of parameters and of a buffer the forward pass changes."""
    run = with_forward_buffer(Run(tmp_path, {"merge_steps": [6, 9], "window": 5, "mode": mode}, device=device))
    run.hook.pre_train(0)
    run.train(range(1, 10))
    run.hook.close()
    assert [step for _, step in run.merged] == [6, 9]
    for merge_step in (6, 9):
        expected = expected_mean(run, merge_step, 5, 1, torch.bfloat16)
        assert "1.mean" in expected
        assert_exact(tmp_path / f"step{merge_step}-merged", expected)


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_weights_summed_in_fp64_are_exact(tmp_path, device):
    options = {"merge_steps": [6], "window": 6, "float64_accumulator": True}
    run = Run(tmp_path, options, dtype=torch.float32, device=device)
    run.hook.pre_train(0)
    run.train(range(1, 7))
    run.hook.close()
    assert_exact(tmp_path / "step6-merged", expected_mean(run, 6, 6, 1, torch.float32))


def change_by_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    optimizer.zero_grad()


def change_by_hand(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.5)


@pytest.mark.parametrize(("release", "change"), [("optimizer", change_by_optimizer), ("copy", change_by_hand)])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("device", DEVICES)
def test_weights_changed_right_after_the_call_are_captured_as_they_were(
    tmp_path, monkeypatch, device, mode, release, change
):
    """Right after each ``post_train_batch`` the weights change in place (an optimizer step, or
    by hand under release="copy"; the forward buffer by hand), while the captures are late: the
    merge still averages the weights as they were at the call."""
    make_captures_late(monkeypatch, device)
    run = with_forward_buffer(
        Run(tmp_path, {"merge_steps": [5], "window": 5, "mode": mode, "release": release}, device=device)
    )
    changer = torch.optim.SGD(run.model.parameters(), lr=0.25)
    run.hook.pre_train(0)
    for step in range(1, 6):
        train_step(run.model, run.optimizer, step)
        run.hook.post_train_batch(step, run.model)
        run.seen[step] = full_weights(run.model)
        change(run.model, changer)
        with torch.no_grad():
            run.model[1].mean.add_(1.0)
    run.hook.close()
    assert not torch.equal(full_weights(run.model)["0.weight"], run.seen[5]["0.weight"])  # it did change
    assert_exact(tmp_path / "step5-merged", expected_mean(run, 5, 5, 1, torch.bfloat16))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("device", DEVICES)
def test_resume_mid_window_merges_the_resumed_timeline(tmp_path, device, mode):
    """Checkpoint at step 5 inside the window 3-10, train on along another timeline, resume from
    the checkpoint: the merge averages steps 3-5 from before and 6-10 after the resume, nothing
    of the lost timeline."""
    options = {"merge_steps": [10], "window": 8, "mode": mode}
    first = Run(tmp_path, options, device=device)
    first.hook.pre_train(0)
    first.train(range(1, 6))
    checkpoint = first.checkpoint()
    first.train(range(6, 9), seed=1)  # the lost timeline
    first.hook.close()
    second = Run.resumed(tmp_path, options, checkpoint, 5, device=device)
    second.train(range(6, 11))
    second.hook.close()
    assert not torch.equal(first.seen[6]["0.weight"], second.seen[6]["0.weight"])
    second.seen.update({step: first.seen[step] for step in range(1, 6)})
    assert_exact(tmp_path / "step10-merged", expected_mean(second, 10, 8, 1, torch.bfloat16))


@NEEDS_CUDA
def test_cuda_weights_are_copied_into_pinned_host_buffers():
    model = make_model(device="cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    capturer = WeightCapture()
    try:
        train_step(model, optimizer, 1)
        capture = capturer.take(1, model)
        expected = full_weights(model)
        capture.wait_ready()
        assert not capture.in_place
        for block in capture.blocks:
            assert block.data.device.type == "cpu" and block.data.is_pinned(), block.name
            assert torch.equal(block.data.double(), expected[block.name]), block.name
        capture.release()
    finally:
        capturer.close()


@NEEDS_CUDA
def test_a_skipped_optimizer_step_does_not_wait_for_the_reader(tmp_path, monkeypatch):
    """A step without an optimizer step (AMP's skip on overflow): the next capture neither waits
    for the worker to read the previous CUDA copy nor mixes the two up."""
    delay_reads(monkeypatch, 0.5)
    run = Run(tmp_path, {"merge_steps": [3], "window": 3}, device="cuda")
    run.hook.pre_train(0)
    run.train([1])
    started = time.perf_counter()
    run.hook.post_train_batch(2, run.model)  # no optimizer step since step 1
    assert time.perf_counter() - started < 0.25
    run.seen[2] = full_weights(run.model)
    run.train([3])
    run.hook.close()
    assert_exact(tmp_path / "step3-merged", expected_mean(run, 3, 3, 1, torch.bfloat16))
