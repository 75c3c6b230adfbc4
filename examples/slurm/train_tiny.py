"""A stand-in trainer for ``train_then_merge.sbatch``: replace it with yours.

It trains a small MLP (CPU or GPU, seconds) and saves Hugging Face-style safetensors checkpoints
``SAVE_FOLDER/stepN/model.safetensors`` at exactly the steps a merge needs: every step of each
merge window (``--windows START:END,...``, from ``ckptavg plan``'s ``CKPTAVG_WINDOW_STARTS`` and
``CKPTAVG_MERGE_STEPS``), the fixed steps a resume needs (``--keep-steps``) and the last step.

It resumes as a requeued SLURM job must: the whole training state (weights, optimizer, random
generator) goes to ``SAVE_FOLDER/resume/state.pt`` at the fixed steps, at the last step and when
SIGTERM arrives (preemption, ``scontrol requeue``, ``scancel``: it then finishes its step, saves
and exits), and a run that finds that file goes on from its step. A resumed run saves the same
checkpoints, bit for bit, as one that was never stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def parse_windows(text: str) -> list[range]:
    windows = []
    for item in filter(None, text.replace(" ", ",").split(",")):
        start, end = (int(v) for v in item.split(":"))
        windows.append(range(start, end + 1))
    return windows


def save_weights(model: torch.nn.Module, folder: Path, width: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "mlp", "width": width}))


def save_state(path: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, data) -> None:
    """The training state after ``step``, replacing the previous one only once written whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "data": data.get_state()}
    torch.save(state, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save-folder", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--windows", default="", help="START:END,... steps to save densely (inclusive)")
    parser.add_argument("--keep-steps", default="", help="comma/space-separated steps to save as well")
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args(argv)

    keep = {int(s) for s in args.keep_steps.replace(",", " ").split()} | {args.max_steps}
    save = set(keep)
    for window in parse_windows(args.windows):
        save.update(window)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, args.width), torch.nn.GELU(), torch.nn.Linear(args.width, 1)).to(
        device
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    target = torch.randn(32, 1).to(device)
    data = torch.Generator().manual_seed(1)  # batches drawn on the CPU: the same on any device

    state_file = args.save_folder / "resume" / "state.pt"
    start = 0
    if state_file.exists():
        state = torch.load(state_file, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        data.set_state(state["data"])
        start = state["step"]
        print(f"resumed from step {start}", flush=True)

    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    for step in range(start + 1, args.max_steps + 1):
        inputs = torch.randn(64, 32, generator=data).to(device)
        loss = torch.nn.functional.mse_loss(model(inputs), torch.sin(inputs @ target))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step in save:
            save_weights(model, args.save_folder / f"step{step}", args.width)
        if step in keep or stopping:
            save_state(state_file, step, model, optimizer, data)
        if stopping:
            print(f"SIGTERM: saved the state after step {step}; a rerun resumes there", flush=True)
            sys.exit(128 + signal.SIGTERM)
    print(f"trained to step {args.max_steps}; checkpoints saved in {args.save_folder}", flush=True)


if __name__ == "__main__":
    main()
