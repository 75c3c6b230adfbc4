"""Benchmark the training hook's cost per step against no hook and a synchronous baseline.

Run with ``make bench`` (or ``.venv/bin/python benchmarks/bench_hook.py``). A CPU training loop
of a ~50M-parameter GPT (fp32, AdamW) runs, each configuration in its own process, interleaved
repetition by repetition so that a noisy neighbour hurts all of them alike:

  none        no hook;
  olmo        OLMo-core's ModelMergeCallback approach: every step, in the training thread,
              ``p.data.detach().to("cpu")`` and ``acc.add_(value.float())`` per parameter;
  accumulate  ``MergeHook(mode="accumulate", every=1)``;
  snapshot    ``MergeHook(mode="snapshot", every=1)`` (a 200 MB file per step);
  snapshot/4  ``MergeHook(mode="snapshot", every=4)``, the sparse sampling snapshots are meant for;
  ema         ``MergeHook(mode="ema")``: the run's EMA, folded in every step;
  blocks      ``MergeHook(mode="blocks")``: the running sum of the block.

Every step of every configuration is inside one open merge window (or block; it never closes),
so each step pays the full per-step cost. Per step it records the forward+backward time, the optimizer
step (which includes any wait for the hook's background read) and the time of the hook call
itself, and reports medians. The overhead of a configuration is its median step time minus
that of ``none``; the target is ``overhead(accumulate) <= overhead(olmo) / 3``, checked on
the stall.

Training runs on all cores but one, so that the hook's background thread has a core, as on a
GPU node where the trainer leaves host cores idle; ``--all-cores`` adds the case where the
background work competes with training for every core.

Reported per configuration: the *stall* (the time the training thread waits for the hook: its
call plus the wait inside the optimizer step, bracketed by two optimizer pre-hooks; precise) and
the *wall* overhead (step time over ``none``; noisy on a shared machine, so per-repetition medians
are printed beside it).

``--gpu`` adds a ~1B-parameter bf16 model on CUDA (optional; never in CI).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODES = ("none", "olmo", "accumulate", "snapshot", "snapshot/4", "ema", "blocks")
# What keeps each hook configuration's window open for the whole run.
NEVER_CLOSES = {"ema": {"merge_steps": [10**9]}, "blocks": {"block": 10**9}}
TARGET_RATIO = 1 / 3


def build_model(width: int, layers: int, vocab: int, heads: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(attended.transpose(1, 2).reshape(b, t, width))
            return x + self.mlp(self.norm2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    return GPT()


def child(args: argparse.Namespace) -> None:
    """One configuration in one process; prints a JSON line of per-step phase times."""
    import torch
    import torch.nn.functional as F
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    torch.set_num_threads(args.threads)
    device = "cuda" if args.gpu else "cpu"
    model = build_model(args.width, args.layers, args.vocab, args.heads).to(device)
    if args.gpu:
        model = model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    folder = tempfile.mkdtemp(prefix="ckptavg-bench-hook-", dir=args.tmp)
    hook = None
    accumulators = None
    # The time the training thread waits inside optimizer.step() for the hook's background read:
    # global optimizer pre-hooks run in registration order, so one registered before the
    # hook's and one after it bracket exactly that wait.
    marks: dict[str, float] = {}
    before = register_optimizer_step_pre_hook(lambda *_: marks.__setitem__("before", time.perf_counter()))
    if args.child != "none" and args.child != "olmo":
        from ckptavg import MergeHook, MergeHookConfig

        mode, _, every = args.child.partition("/")
        window = NEVER_CLOSES.get(mode, {"merge_steps": [10**9], "window": 10**9})
        config = MergeHookConfig(save_folder=folder, mode=mode, every=int(every or 1), **window)
        hook = MergeHook(config)
        hook.pre_train(0)
    after = register_optimizer_step_pre_hook(lambda *_: marks.__setitem__("after", time.perf_counter()))

    def sync() -> None:
        if args.gpu:
            # The training stream only: a device-wide sync would also wait for the hook's copy on
            # its side stream, which in training overlaps the next forward pass (the optimizer
            # step waits for it on the device, and that wait is timed).
            torch.cuda.current_stream().synchronize()

    phases: dict[str, list[float]] = {
        "step": [],
        "forward_backward": [],
        "optimizer": [],
        "hook": [],
        "optimizer_wait": [],
        "cpu": [],
    }
    try:
        for step in range(1, args.warmup + args.steps + 1):
            generator = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(device)
            sync()
            start = time.perf_counter()
            cpu_start = time.process_time()
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.reshape(-1, args.vocab).float(), tokens[:, 1:].reshape(-1)).backward()
            sync()
            backward_done = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            optimizer_done = time.perf_counter()
            if hook is not None:
                hook.post_train_batch(step, model)
            elif args.child == "olmo":
                # OLMo-core ModelMergeCallback.post_train_batch + _accumulate_weights, verbatim in effect.
                state = {k: p.data.detach().to("cpu") for k, p in model.named_parameters()}
                if accumulators is None:
                    accumulators = {k: torch.zeros_like(v, dtype=torch.float32, device="cpu") for k, v in state.items()}
                for k, v in state.items():
                    accumulators[k].add_(v.float())
            sync()
            end = time.perf_counter()
            if step > args.warmup:
                phases["step"].append(end - start)
                phases["forward_backward"].append(backward_done - start)
                phases["optimizer"].append(optimizer_done - backward_done)
                phases["hook"].append(end - optimizer_done)
                phases["optimizer_wait"].append(marks["after"] - marks["before"])
                phases["cpu"].append(time.process_time() - cpu_start)
        if hook is not None:
            hook.close()
    finally:
        before.remove()
        after.remove()
        shutil.rmtree(folder, ignore_errors=True)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"mode": args.child, "threads": args.threads, "params": params, "phases": phases}))


def run_child(mode: str, threads: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", mode, "--threads", str(threads)]
    for name in ("width", "layers", "vocab", "heads", "batch", "seq", "steps", "warmup", "tmp"):
        command += [f"--{name}", str(getattr(args, name))]
    if args.gpu:
        command.append("--gpu")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:7.1f}"


def report(results: dict[str, list[dict]], threads: int) -> dict[str, dict[str, float]]:
    """Print the table for one thread setting; return per-config figures (seconds).

    Per step: medians of the phases; the stall is a mean (a strided hook stalls one step in
    ``every``, and that is its cost per step); the step time is the median over repetitions of
    each repetition's mean, so that the one slow step in four counts and a noisy repetition
    does not."""
    print(f"\ntraining on {threads} thread(s), ms per step")
    print(
        f"{'config':<11} {'step':>8} {'fwd+bwd':>8} {'optim':>8} {'hook':>8} {'opt.wait':>8} {'stall':>8} "
        f"{'cpu':>8} {'wall +':>8}  per-repetition mean step"
    )
    figures: dict[str, dict[str, float]] = {}
    for mode in MODES:
        runs = results[mode]
        merged = {k: [v for r in runs for v in r["phases"][k]] for k in runs[0]["phases"]}
        row = {k: statistics.median(v) for k, v in merged.items()}
        # The training thread's wait for the hook: its call plus the wait inside optimizer.step().
        row["stall"] = statistics.fmean(h + w for h, w in zip(merged["hook"], merged["optimizer_wait"], strict=True))
        means = [statistics.fmean(r["phases"]["step"]) for r in runs]
        row["step"] = statistics.median(means)
        figures[mode] = row
        reps = ", ".join(f"{m * 1e3:.0f}" for m in means)
        print(
            f"{mode:<11} {ms(row['step'])} {ms(row['forward_backward'])} {ms(row['optimizer'])} {ms(row['hook'])} "
            f"{ms(row['optimizer_wait'])} {ms(row['stall'])} {ms(row['cpu'])} "
            f"{ms(row['step'] - figures['none']['step'])}   {reps}"
        )
    olmo = figures["olmo"]
    wall_olmo = olmo["step"] - figures["none"]["step"]
    for mode in MODES[2:]:
        ratio = figures[mode]["stall"] / olmo["stall"]
        verdict = "PASS" if ratio <= TARGET_RATIO else "FAIL"
        wall = figures[mode]["step"] - figures["none"]["step"]
        print(
            f"stall({mode}) / stall(olmo) = {ratio:.2f} (target <= {TARGET_RATIO:.2f}: {verdict}); "
            f"wall overhead {wall * 1e3:.1f} ms vs olmo's {wall_olmo * 1e3:.1f} ms"
        )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=MODES)
    parser.add_argument("--threads", type=int, default=0, help="for --child")
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tmp", default=str(REPO / "bench-data"), help="where snapshots are written")
    parser.add_argument("--gpu", action="store_true", help="a ~1B-parameter bf16 model on CUDA instead")
    parser.add_argument(
        "--all-cores", action="store_true", help="also train on every core (the hook's thread then competes with it)"
    )
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    Path(args.tmp).mkdir(parents=True, exist_ok=True)
    if args.gpu:
        args.width, args.layers, args.vocab, args.heads, args.batch, args.seq = 2048, 18, 32000, 16, 8, 1024
        thread_settings = [os.cpu_count() or 1]
    else:
        cores = os.cpu_count() or 1
        thread_settings = [max(1, cores - 1)] + ([cores] if args.all_cores and cores > 1 else [])
    print(
        f"ckptavg hook benchmark: GPT width {args.width}, {args.layers} layers, vocab {args.vocab}, "
        f"batch {args.batch}x{args.seq}, {args.steps} measured steps x {args.repeats} repetitions per config"
    )
    summary = {}
    for threads in thread_settings:
        results: dict[str, list[dict]] = {m: [] for m in MODES}
        for repeat in range(args.repeats):
            order = MODES if repeat % 2 == 0 else MODES[::-1]
            for mode in order:
                results[mode].append(run_child(mode, threads, args))
        params = results["none"][0]["params"]
        print(f"({params / 1e6:.1f}M parameters, {params * 4 / 1e6:.0f} MB of fp32 weights per step)")
        summary[threads] = report(results, threads)
    print("\nsummary, ms per step (stall = training thread waiting for the hook; wall + = step time over none):")
    for threads, medians in summary.items():
        none = medians["none"]["step"]
        cells = [
            f"{m} stall {medians[m]['stall'] * 1e3:.1f} wall+ {(medians[m]['step'] - none) * 1e3:.1f}"
            for m in MODES[1:]
        ]
        print(f"  {threads} thread(s): " + "; ".join(cells))


if __name__ == "__main__":
    main()
