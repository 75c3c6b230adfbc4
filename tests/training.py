"""A tiny deterministic training loop for the hook tests: the batch of a step depends only on
(seed, step), so a run resumed from a checkpoint retraces an uninterrupted one bit for bit. The
model lives on any device; the weights a run saw are kept on the CPU in float64."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from references import correctly_rounded, load_merged, same_bits
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ckptavg.hook import MergeHook, MergeHookConfig
from ckptavg.hook.capture import Capture, WeightCapture
from ckptavg.hook.stores import AccumulateStore
from ckptavg.plan import sampled_steps


def make_model(dtype: torch.dtype = torch.bfloat16, seed: int = 0, device: str = "cpu") -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 6))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.to(device=device, dtype=dtype)


class RunningMean(nn.Module):
    """A buffer that the forward pass changes, like BatchNorm's running statistics."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.mean.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return x


def batch(step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randn(16, 8, generator=generator), torch.randn(16, 6, generator=generator)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, seed: int = 0) -> None:
    inputs, targets = batch(step, seed)
    param = next(model.parameters())
    prediction = model(inputs.to(device=param.device, dtype=param.dtype)).float()
    loss = nn.functional.mse_loss(prediction, targets.to(param.device))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """float64 CPU copies of every state-dict entry (gathered when sharded), copied synchronously."""
    out = {}
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        out[name] = tensor.detach().to("cpu", torch.float64, copy=True)
    return out


@dataclass
class Run:
    """A model, its optimizer and a hook, trained step by step, recording the weights."""

    folder: Path
    hook_options: dict
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    seen: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.model = make_model(self.dtype, device=self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.02)
        self.merged: list[tuple[str, int]] = []
        self.hook = MergeHook(
            MergeHookConfig(
                save_folder=str(self.folder), on_merged=lambda p, s: self.merged.append((p, s)), **self.hook_options
            )
        )

    def train(self, steps: Iterable[int], seed: int = 0) -> None:
        for step in steps:
            train_step(self.model, self.optimizer, step, seed)
            self.hook.post_train_batch(step, self.model)
            self.seen[step] = full_weights(self.model)

    def checkpoint(self) -> dict:
        """What a trainer saves: model, optimizer and the hook's state."""
        return {
            "model": copy.deepcopy(self.model.state_dict()),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "hook": self.hook.state_dict(),
        }

    @classmethod
    def resumed(
        cls, folder: Path, hook_options: dict, checkpoint: dict, step: int, dtype=torch.bfloat16, device: str = "cpu"
    ) -> Run:
        run = cls(folder, hook_options, dtype, device)
        run.model.load_state_dict(checkpoint["model"])
        run.optimizer.load_state_dict(checkpoint["optimizer"])
        run.hook.load_state_dict(checkpoint["hook"])
        run.hook.pre_train(step)
        return run


def expected_mean(run: Run, merge_step: int, window: int, every: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Correctly rounded float64 mean of the weights the run saw at the window's sampled steps."""
    steps = sampled_steps(merge_step, window, every)
    return {
        name: correctly_rounded(sum(run.seen[s][name] for s in steps) / len(steps), dtype)
        for name in run.seen[merge_step]
    }


def assert_exact(folder: Path, expected: dict[str, torch.Tensor]) -> None:
    merged = load_merged(folder)
    assert set(merged) == set(expected)
    for name, tensor in expected.items():
        assert merged[name].dtype == tensor.dtype, name
        assert bool(same_bits(merged[name], tensor).all()), name


@contextmanager
def store_reads_wait_for_the_optimizer(until: str) -> Iterator[None]:
    """Make each of the accumulate store's background reads wait, with no timing, until the
    training thread has ``"begun"`` or ``"finished"`` an optimizer step since its capture (or
    until the hook closes: no optimizer step follows the last capture).

    ``"begun"``: the read comes as the next step is about to change the weights, so only the
    capture's hold-back keeps them as they were (this must be entered before the hook is made,
    for the waiting pre-hook to run before the hook's own). ``"finished"``: the read comes after
    the step changed them, the fault a capture without a hold-back has."""
    moment = threading.Condition()
    steps = 0
    closing = False

    def count(*_args: object) -> None:
        nonlocal steps
        with moment:
            steps += 1
            moment.notify_all()

    add, close, take = AccumulateStore.add, MergeHook.close, WeightCapture.take
    steps_at_capture: dict[int, int] = {}

    def take_counting(self: WeightCapture, *args: Any) -> Capture:
        # Counted in the training thread as the capture is taken: a read that starts late in the
        # background must still wait for the step after its capture, not for one after that.
        capture = take(self, *args)
        with moment:
            steps_at_capture[id(capture)] = steps
        return capture

    def late_add(self: AccumulateStore, capture: Capture, *args: Any) -> None:
        with moment:
            seen = steps_at_capture.pop(id(capture))
            moment.wait_for(lambda: steps > seen or closing)
        add(self, capture, *args)

    def release_reads() -> None:
        nonlocal closing
        with moment:
            closing = True
            moment.notify_all()

    def close_releasing_reads(self: MergeHook) -> None:
        release_reads()
        close(self)

    register = {"begun": register_optimizer_step_pre_hook, "finished": register_optimizer_step_post_hook}[until]
    handle = register(count)
    AccumulateStore.add, MergeHook.close = late_add, close_releasing_reads  # type: ignore[method-assign]
    WeightCapture.take = take_counting  # type: ignore[method-assign]
    try:
        yield
    finally:  # a test that failed before closing its hook leaves no read waiting forever
        release_reads()
        AccumulateStore.add, MergeHook.close, WeightCapture.take = add, close, take  # type: ignore[method-assign]
        handle.remove()
