"""A stand-in trainer for ``train_then_merge.sbatch``: replace it with yours.

It trains a small MLP (CPU or GPU, seconds) and saves Hugging Face-style safetensors checkpoints
``SAVE_FOLDER/stepN/model.safetensors`` at exactly the steps a merge needs: every step of each
merge window (``--windows START:END,...``, from ``ckptavg plan``'s ``CKPTAVG_WINDOW_STARTS`` and
``CKPTAVG_MERGE_STEPS``), the fixed steps a resume needs (``--keep-steps``) and the last step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def parse_windows(text: str) -> list[range]:
    windows = []
    for item in filter(None, text.replace(" ", ",").split(",")):
        start, end = (int(v) for v in item.split(":"))
        windows.append(range(start, end + 1))
    return windows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save-folder", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--windows", default="", help="START:END,... steps to save densely (inclusive)")
    parser.add_argument("--keep-steps", default="", help="comma/space-separated steps to save as well")
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args(argv)

    save = {int(s) for s in args.keep_steps.replace(",", " ").split()} | {args.max_steps}
    for window in parse_windows(args.windows):
        save.update(window)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, args.width), torch.nn.GELU(), torch.nn.Linear(args.width, 1)).to(
        device
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    target = torch.randn(32, 1, device=device)
    for step in range(1, args.max_steps + 1):
        inputs = torch.randn(64, 32, device=device)
        loss = torch.nn.functional.mse_loss(model(inputs), torch.sin(inputs @ target))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step in save:
            folder = args.save_folder / f"step{step}"
            folder.mkdir(parents=True, exist_ok=True)
            weights = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
            save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
            (folder / "config.json").write_text(json.dumps({"model_type": "mlp", "width": args.width}))
    print(f"trained {args.max_steps} steps, saved {len(save)} checkpoints in {args.save_folder}")


if __name__ == "__main__":
    main()
