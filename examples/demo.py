"""End-to-end demo of ckptavg on a model trained right here, in well under a minute on a laptop CPU.

1. Plan the merges of a two-period warmup-stable-decay run, with the library and with ``ckptavg plan``.
2. Train a tiny byte-level transformer on Python standard-library source read from disk (no downloads),
   saving bf16 safetensors checkpoints ``demo-run/step{N}/`` densely inside each merge window.
   The training-side hook (``ckptavg.MergeHook``, accumulate mode) merges the same windows while training
   runs, from the fp32 weights, into ``demo-run/merges/``.
3. ``ckptavg ls`` and ``ckptavg merge`` the run through the command line, as a user would.
4. Compare the validation loss of the raw checkpoint at each merge step with the merged ones.

Run with ``make demo``. Any failing step ends the demo with a non-zero exit status.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from byte_lm import ByteGPT, lm_loss
from safetensors.torch import load_file, save_file
from torch import nn

from ckptavg import MergeHook, MergeHookConfig, MergePlan, plan_from_schedule

ROOT = Path(__file__).resolve().parent.parent
RUN_NAME = "demo-run"  # relative to ROOT, so that the CLI output shows short paths
RUN_DIR = ROOT / RUN_NAME
HOOK_DIR = RUN_DIR / "merges"  # where the training hook writes its merges

SEED = 0
# Distinct modules for training and validation: the validation loss measures generalisation, not recall.
TRAIN_MODULES = ("argparse", "dataclasses", "enum", "functools", "textwrap", "typing", "configparser")
VAL_MODULES = ("contextlib", "shlex")
VAL_SEQUENCES = 256

SEQ_LEN = 64
BATCH_SIZE = 16
TOKENS_PER_STEP = BATCH_SIZE * SEQ_LEN
DIM, HEADS, LAYERS = 64, 4, 2

# Two periods of 200 steps; the last 20% of each is the decay phase.
PERIOD_STEPS = 200
PERIOD_TOKENS = [PERIOD_STEPS * TOKENS_PER_STEP] * 2
DECAY_FRACTION = 0.2
WARMUP_STEPS = 10
PEAK_LR = 3e-3
WINDOW = 40  # steps averaged by each merge
SAVE_EVERY_IN_WINDOW = 5  # 8 checkpoints per window
SAVE_EVERY = 50  # elsewhere, enough to show a run folder that holds more than the windows


def source_bytes(modules: tuple[str, ...]) -> torch.Tensor:
    """The source code of standard-library modules as a byte tensor: local text, nothing downloaded."""
    text = "\n".join(inspect.getsource(importlib.import_module(name)) for name in modules)
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def learning_rate(plan: MergePlan, step: int) -> float:
    """Warmup-stable-decay LR of the optimizer step that takes the weights from ``step`` to ``step + 1``.

    The phase boundaries come from the plan's periods, so the trainer and the merge plan agree on where
    each decay starts: the merge step is the last checkpoint trained at the stable LR.
    """
    period = next(p for p in plan.periods if p.start_step <= step < p.end_step)
    if step - period.start_step < WARMUP_STEPS:
        return PEAK_LR * (step - period.start_step + 1) / WARMUP_STEPS
    if step < period.decay_start_step:
        return PEAK_LR
    return PEAK_LR * (period.end_step - step) / (period.end_step - period.decay_start_step)


def checkpoint_steps(plan: MergePlan) -> set[int]:
    """Every ``SAVE_EVERY_IN_WINDOW`` steps back from each merge step within its window, plus a sparse grid."""
    steps = set(range(SAVE_EVERY, plan.max_steps + 1, SAVE_EVERY))
    for window in plan.windows:
        steps.update(range(window.merge_step, window.start - 1, -SAVE_EVERY_IN_WINDOW))
    return steps


def save_checkpoint(model: nn.Module, step: int) -> None:
    """``stepN/model.safetensors`` in bf16 plus a ``config.json``: the layout ckptavg discovers."""
    folder = RUN_DIR / f"step{step}"
    folder.mkdir()
    weights = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "byte-gpt", "vocab_size": 256, "dim": DIM, "heads": HEADS, "layers": LAYERS}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


@torch.no_grad()
def evaluate(model: nn.Module, val_data: torch.Tensor) -> float:
    """Validation loss on the first ``VAL_SEQUENCES`` non-overlapping windows of the held-out modules."""
    count = min(VAL_SEQUENCES, (len(val_data) - 1) // SEQ_LEN)
    starts = torch.arange(count).unsqueeze(1) * SEQ_LEN
    was_training = model.training
    model.eval()
    loss = lm_loss(model, val_data[starts + torch.arange(SEQ_LEN + 1)]).item()
    model.train(was_training)
    return loss


def train(plan: MergePlan, save_steps: set[int], train_data: torch.Tensor, val_data: torch.Tensor) -> None:
    """Train for ``plan.max_steps`` steps on random windows of ``train_data``, saving after ``save_steps``."""
    model = ByteGPT(DIM, HEADS, LAYERS, SEQ_LEN)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=0.1)
    params = sum(p.numel() for p in model.parameters())
    print(f"\ntraining a {params:,}-parameter byte-level transformer for {plan.max_steps} steps")
    print(f"  {len(train_data):,} training bytes, {len(val_data):,} validation bytes ({', '.join(VAL_MODULES)})")
    generator = torch.Generator().manual_seed(SEED)
    offsets = torch.arange(SEQ_LEN + 1)
    started = time.perf_counter()
    # The same windows and stride as the saved checkpoints, summed in fp32 in a background thread.
    hook = MergeHook(
        MergeHookConfig(
            save_folder=str(HOOK_DIR),
            merge_steps=plan.merge_steps,
            window=WINDOW,
            every=SAVE_EVERY_IN_WINDOW,
            dtype="bf16",
            on_merged=lambda path, step: print(
                f"  hook: merge of step {step} written to {Path(path).relative_to(ROOT)}"
            ),
        )
    )
    hook.pre_train(0)
    for step in range(plan.max_steps):
        lr = learning_rate(plan, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(len(train_data) - SEQ_LEN - 1, (BATCH_SIZE, 1), generator=generator)
        loss = lm_loss(model, train_data[starts + offsets])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        hook.post_train_batch(step + 1, model)
        if step + 1 in save_steps:
            save_checkpoint(model, step + 1)
        if (step + 1) % 50 == 0:
            print(
                f"  step {step + 1:>4}  lr {lr:.2e}  train loss {loss.item():.3f}  "
                f"val loss {evaluate(model, val_data):.3f}  ({time.perf_counter() - started:.1f} s)"
            )
    hook.close()
    print(f"saved {len(save_steps)} checkpoints to {RUN_NAME}/")


def load_weights(folder: Path) -> nn.Module:
    """A model with the weights of a checkpoint folder: a single file, or shards through the HF index."""
    index_file = folder / "model.safetensors.index.json"
    if index_file.exists():
        shard_names = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
    else:
        shard_names = ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for name in shard_names:
        weights.update(load_file(str(folder / name)))
    model = ByteGPT(DIM, HEADS, LAYERS, SEQ_LEN)
    model.load_state_dict({name: t.float() for name, t in weights.items()})
    return model


def ckptavg(*args: str) -> None:
    """Run the CLI as a user would, from the repository root; a non-zero exit stops the demo."""
    print(f"\n$ ckptavg {' '.join(args)}", flush=True)
    returncode = subprocess.run([sys.executable, "-m", "ckptavg", *args], cwd=ROOT, check=False).returncode
    if returncode != 0:
        sys.exit(f"demo: `ckptavg {' '.join(args)}` failed with exit status {returncode}")


def main() -> None:
    """Each stage prints what a user would see; the first failure ends the demo with a non-zero status."""
    started = time.perf_counter()
    torch.manual_seed(SEED)
    # One thread: on a busy 2-core machine a team of two spin-waits, and training ran 3-8x slower.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    plan = plan_from_schedule(PERIOD_TOKENS, TOKENS_PER_STEP, WINDOW, decay_fraction=DECAY_FRACTION)
    windows = ", ".join(f"{w.start}-{w.end}" for w in plan.windows)
    print(f"library plan: merge steps {plan.merge_steps}, windows {windows} of a {plan.max_steps}-step run")
    ckptavg(
        "plan",
        "--periods",
        ",".join(str(tokens) for tokens in PERIOD_TOKENS),
        "--tokens-per-step",
        str(TOKENS_PER_STEP),
        "--decay-fraction",
        str(DECAY_FRACTION),
        "--window",
        str(WINDOW),
    )

    shutil.rmtree(RUN_DIR, ignore_errors=True)
    RUN_DIR.mkdir()
    val_data = source_bytes(VAL_MODULES)
    save_steps = checkpoint_steps(plan)
    train(plan, save_steps, source_bytes(TRAIN_MODULES), val_data)

    ckptavg("ls", RUN_NAME)
    first = plan.windows[0]
    ckptavg("merge", RUN_NAME, "--merge-step", str(first.merge_step), "--window", str(WINDOW), "--dry-run")
    for window in plan.windows:
        ckptavg("merge", RUN_NAME, "--merge-step", str(window.merge_step), "--window", str(WINDOW))

    merged_folder = RUN_DIR / f"step{first.merge_step}-merged"
    print(f"\n{RUN_NAME}/{merged_folder.name}/ holds:")
    for path in sorted(merged_folder.iterdir()):
        print(f"  {path.name:<32} {path.stat().st_size:>9,} bytes")

    print("\nvalidation loss (nats/byte; lower is better)")
    header = (
        f"{'merge step':>10}  {'raw checkpoint':>14}  {'merged window':>13}  {'change':>7}  {'hook merge':>10}  "
        f"{'after decay':>16}"
    )
    print(header)
    print("-" * len(header))
    for window, period in zip(plan.windows, plan.periods, strict=True):
        raw = evaluate(load_weights(RUN_DIR / f"step{window.merge_step}"), val_data)
        merged = evaluate(load_weights(RUN_DIR / f"step{window.merge_step}-merged"), val_data)
        hooked = evaluate(load_weights(HOOK_DIR / f"step{window.merge_step}-merged"), val_data)
        decayed = evaluate(load_weights(RUN_DIR / f"step{period.end_step}"), val_data)
        if not all(math.isfinite(x) for x in (raw, merged, hooked, decayed)):
            sys.exit("demo: a validation loss is not finite")
        print(
            f"{window.merge_step:>10}  {raw:>14.4f}  {merged:>13.4f}  {merged - raw:>+7.4f}  {hooked:>10.4f}  "
            f"{decayed:>8.4f} (step {period.end_step})"
        )
    averaged = sum(first.start <= step <= first.merge_step for step in save_steps)
    print(
        f"\nmerged = mean of the {averaged} checkpoints saved in each {WINDOW}-step window; "
        "'hook merge' is the training hook's mean of the fp32 weights of the same steps;\n"
        "'after decay' is the end of the period, for reference."
    )
    print(f"demo finished in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
