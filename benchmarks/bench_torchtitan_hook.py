"""The hook's stall per step inside torchtitan's training loop, on CPU, against the same loop without it.

Run with ``.venv/bin/python benchmarks/bench_torchtitan_hook.py`` (``make bench`` runs it too). One
process trains a llama3 of torchtitan's own modules (``--dim``, ``--layers``; fp32, AdamW) with
ckptavg's ``MergingTrainer`` (tests/titan_trainer.py builds the config, on CPU). Steps go in
blocks of ``--block`` steps, interleaved: a block without the hook (``Trainer.train_step``, the
loop torchtitan runs) then a block inside an accumulate window of the hook (``MergingTrainer.train_step``:
the optimizer step, then ``post_train_batch``), and so on, so that a noisy neighbour slows both
alike. Each window ends at its block's last step, so every second block also publishes a merge in
the background while the next plain block trains.

Reported: the median wall time of a step in each kind of block, their difference (the stall: what
a step inside a window costs the training loop over one outside), and the median time of the
``post_train_batch`` call alone.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--block", type=int, default=5, help="steps per block")
    parser.add_argument("--pairs", type=int, default=4, help="blocks without and with the hook")
    args = parser.parse_args()

    import titan_trainer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    titan_trainer.install_cpu_shims()
    import logging

    logging.disable(logging.WARNING)
    import torch
    from torchtitan.trainer import Trainer

    from ckptavg import MergeHookConfig
    from ckptavg.hook.integrations.torchtitan import MergingTrainer

    block, steps = args.block, 2 * args.block * args.pairs
    with tempfile.TemporaryDirectory(prefix="bench-titan-") as folder:
        config = titan_trainer.trainer_config(folder, steps, "disabled", dim=args.dim, layers=args.layers, seq=64)
        config.checkpoint.enable = False
        merge_steps = list(range(2 * block, steps + 1, 2 * block))  # windows: every second block
        merge = MergeHookConfig(save_folder="merges", merge_steps=merge_steps, window=block)
        trainer = MergingTrainer(MergingTrainer.Config.of(config, merge))
        parameters = sum(p.numel() for p in trainer.model_parts[0].parameters())
        calls: list[float] = []
        hook_call = trainer.merge_hook.post_train_batch

        def timed_call(*call_args, **kwargs):
            begin = time.perf_counter()
            hook_call(*call_args, **kwargs)
            calls.append(time.perf_counter() - begin)

        trainer.merge_hook.post_train_batch = timed_call
        data = trainer.batch_generator(trainer.dataloader)
        plain: list[float] = []
        hooked: list[float] = []
        for step in range(1, steps + 1):
            trainer.step = step
            inside = any(m - block < step <= m for m in merge_steps)
            begin = time.perf_counter()
            if inside:
                MergingTrainer.train_step(trainer, data)
            else:
                Trainer.train_step(trainer, data)
            (hooked if inside else plain).append(time.perf_counter() - begin)
        trainer.merge_hook.close()
        trainer.close()
        # The first block of each kind warms up (allocations, the hook's buffers): left out.
        plain, hooked = plain[block:], hooked[block:]
        inside_calls = calls[block:]
        p, h = statistics.median(plain), statistics.median(hooked)
        print(f"torchtitan Trainer on CPU, {parameters / 1e6:.1f}M fp32 parameters, {torch.get_num_threads()} threads")
        print(f"  step without the hook: {p * 1e3:.1f} ms (median of {len(plain)})")
        print(f"  step inside a window:  {h * 1e3:.1f} ms (median of {len(hooked)})")
        print(f"  stall per step:        {(h - p) * 1e3:+.1f} ms ({(h - p) / p:+.1%})")
        print(f"  post_train_batch call: {statistics.median(inside_calls) * 1e3:.2f} ms (median)")


if __name__ == "__main__":
    main()
