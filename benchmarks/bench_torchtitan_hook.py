"""The hook's stall per step inside torchtitan's training loop, on CPU, against the same loop without it.

Run with ``.venv/bin/python benchmarks/bench_torchtitan_hook.py`` (``make bench`` runs it too). One
process trains a llama3 of torchtitan's own modules (``--dim``, ``--layers``; fp32, AdamW) with
ckptavg's ``MergingTrainer`` (tests/titan_trainer.py builds the config, on CPU). Steps go in
blocks of ``--block`` steps, interleaved: a block without the hook (``Trainer.train_step``, the
loop torchtitan runs) then a block inside an accumulate window of the hook (``MergingTrainer.train_step``:
the optimizer step, then ``post_train_batch``), and so on, so that a noisy neighbour slows both
alike. Each window ends at its block's last step, so every second block also publishes a merge in
the background while the next plain block trains.

Reported: the median over blocks of each block's median step time, per kind; the stall (what a step
inside a window costs the training loop over one outside), the median of the differences of the
pairs of blocks; and the median time of the ``post_train_batch`` call alone. The first pair warms up
and is left out.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--block", type=int, default=5, help="steps per block")
    parser.add_argument("--pairs", type=int, default=6, help="blocks without and with the hook")
    args = parser.parse_args()

    import titan_trainer  # torchtitan's CPU shims first: the adapter imports its trainer

    titan_trainer.in_this_process()
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
        times: list[list[float]] = [[] for _ in range(steps // block)]  # per block, its steps' times
        for step in range(1, steps + 1):
            trainer.step = step
            begin = time.perf_counter()
            if ((step - 1) // block) % 2:  # every second block lies in a window of the hook
                MergingTrainer.train_step(trainer, data)
            else:
                Trainer.train_step(trainer, data)
            times[(step - 1) // block].append(time.perf_counter() - begin)
        trainer.merge_hook.close()
        trainer.close()
        # The first pair warms up (allocations, the hook's buffers): left out.
        medians = [statistics.median(block_times) for block_times in times[2:]]
        plain, hooked = medians[0::2], medians[1::2]
        stalls = [h - p for p, h in zip(plain, hooked, strict=True)]
        p, h, stall = statistics.median(plain), statistics.median(hooked), statistics.median(stalls)
        print(f"torchtitan Trainer on CPU, {parameters / 1e6:.1f}M fp32 parameters, {torch.get_num_threads()} threads")
        print(f"  step without the hook: {p * 1e3:.1f} ms (median of {len(plain)} block medians)")
        print(f"  step inside a window:  {h * 1e3:.1f} ms (median of {len(hooked)} block medians)")
        print(f"  stall per step:        {stall * 1e3:+.1f} ms ({stall / p:+.1%}; median of the pairs' differences)")
        print(f"  post_train_batch call: {statistics.median(calls[block:]) * 1e3:.2f} ms (median)")


if __name__ == "__main__":
    main()
