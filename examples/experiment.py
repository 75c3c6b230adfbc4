"""Does averaging the checkpoints of a constant-LR window buy what a cooldown buys, for free?

A tiny byte-level transformer trains on the Python standard library's own source (read from the
running interpreter's ``stdlib`` folder, nothing downloaded) with a linear warmup and then a
constant learning rate. The training hook (``ckptavg.MergeHook``, ``mode="snapshot"``) writes a
snapshot every ``stride`` steps over the last 20 % of the run and merges that window at the last
constant-LR step, the *fork step* ``T``. From the same state, a linear cooldown to LR 0 then trains
20 % more steps on the continuation of the same data stream. Compared on one fixed validation set:

* the last checkpoint (the weights at ``T``);
* uniform averages of the last 5 / 10 / 20 % of steps, and EMA / WMA / minus-sqrt weightings of
  the 20 % window: all 12 windows x weightings come from ONE read of the snapshots
  (``ckptavg.sweep``), each checked byte for byte against its separate ``ckptavg.merge`` (and the
  uniform 20 % one against the hook's own merge); the read savings are printed;
* WSM's merge weights (arXiv 2507.17634) of two decay shapes, 1-sqrt (the minus-sqrt weights,
  checked equal) and cosine, over each window;
* the 20 % cooldowns, linear and 1-sqrt (Hägele et al. 2024), from the same state. They cost 20 %
  extra training steps; an average, whose window ends at the fork step, costs none. The uniform
  average is the linear decay's merge counterpart, WSM 1-sqrt the 1-sqrt decay's.

Each seed runs in its own process with one torch thread. ``--quick`` is a plumbing check of about a
minute or less. Writes ``results.json`` and ``loss.png`` (and the run folders) under ``--out``.

Run with ``make experiment``.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from byte_lm import ByteGPT, lm_loss
from safetensors.torch import load_file, save_file
from torch import nn

import ckptavg
from ckptavg.plan import sampled_steps

# Folder names that hold tests or third-party code rather than the standard library's own modules.
SKIPPED_FOLDERS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
VAL_PER_MILLE = 50  # files whose path hashes below this (of 1000) are validation: about 5 %
WINDOW_FRACTIONS = (0.05, 0.10, 0.20)  # uniform averages over these last fractions of the steps
COOLDOWN_FRACTION = 0.20  # extra steps of the cooldown fork; also the window of the weighted averages
EMA_HALFLIFE_FRACTION = 0.05
WSM_SHAPES = ("1-sqrt", "cosine")  # decay shapes whose WSM merge weights are compared
COOLDOWNS = ("linear", "1-sqrt")  # decay shapes of the cooldown forks
SNAPSHOTS_PER_RUN = 100  # snapshot stride = steps / 100, so the 20 % window holds 20 snapshots
CURVE_POINTS = 40  # validation evaluations along the constant-LR run


@dataclass(frozen=True)
class Config:
    """Everything that decides a run's numbers; recorded in the JSON."""

    steps: int  # warmup + constant LR; the last of them is the fork (merge) step
    dim: int
    heads: int
    layers: int
    context: int  # bytes a sequence predicts
    batch: int
    peak_lr: float
    warmup_steps: int
    weight_decay: float
    train_bytes: int  # caps on the bytes read, so that start-up stays fast
    val_bytes: int
    val_sequences: int

    @property
    def stride(self) -> int:
        return max(1, self.steps // SNAPSHOTS_PER_RUN)

    @property
    def cooldown_steps(self) -> int:
        return round(COOLDOWN_FRACTION * self.steps)

    def window(self, fraction: float) -> int:
        """Steps in the last ``fraction`` of the run, a whole number of snapshot strides."""
        return max(1, round(fraction * self.steps / self.stride)) * self.stride


FULL = Config(
    steps=3000,
    dim=64,
    heads=4,
    layers=2,
    context=64,
    batch=16,
    peak_lr=6e-3,
    warmup_steps=100,
    weight_decay=0.1,
    train_bytes=8_000_000,
    val_bytes=1_000_000,
    val_sequences=512,
)
QUICK = replace(
    FULL, steps=200, dim=32, layers=1, context=32, batch=8, warmup_steps=10, train_bytes=300_000, val_sequences=64
)


# -- data ------------------------------------------------------------------------------------


def stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files (no tests, no site-packages), in a sorted walk."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(name for name in subfolders if name not in SKIPPED_FOLDERS)
        found.extend(Path(folder, name) for name in sorted(files) if name.endswith(".py"))
    return found


def path_hash(path: Path) -> int:
    """sha256 of the path relative to the stdlib folder: the same split on every machine with this Python."""
    relative = path.relative_to(sysconfig.get_paths()["stdlib"]).as_posix()
    return int.from_bytes(hashlib.sha256(relative.encode()).digest()[:8], "big")


def load_corpus(train_cap: int, val_cap: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """Training and validation bytes, split by file so that validation measures generalisation.

    Files are taken in hash order (a stable shuffle) until each split's cap is reached, so a capped
    corpus still spans the whole library rather than its alphabetically first packages.
    """
    parts: dict[bool, list[bytes]] = {True: [], False: []}
    sizes = {True: 0, False: 0}
    caps = {True: val_cap, False: train_cap}
    for digest, path in sorted((path_hash(p), p) for p in stdlib_sources()):
        is_val = digest % 1000 < VAL_PER_MILLE
        if sizes[is_val] >= caps[is_val]:
            continue
        data = path.read_bytes()[: caps[is_val] - sizes[is_val]]
        parts[is_val].append(data)
        sizes[is_val] += len(data) + 1

    def tensor(chunks: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"\n".join(chunks)), dtype=torch.uint8).long()

    info = {"train_files": len(parts[False]), "val_files": len(parts[True])}
    return tensor(parts[False]), tensor(parts[True]), info


def train_batch(data: torch.Tensor, config: Config, seed: int, step: int) -> torch.Tensor:
    """The sequences of optimizer step ``step``: a function of (seed, step) alone, so the cooldown
    fork sees exactly the batches that a longer constant-LR run would have seen."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - config.context - 1, (config.batch, 1), generator=generator)
    return data[starts + torch.arange(config.context + 1)]


def val_batch(data: torch.Tensor, config: Config) -> torch.Tensor:
    """Fixed validation sequences, evenly spaced over all validation files; the same for every model."""
    starts = torch.linspace(0, len(data) - config.context - 1, config.val_sequences).long().unsqueeze(1)
    return data[starts + torch.arange(config.context + 1)]


# -- model -----------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model: nn.Module, sequences: torch.Tensor) -> float:
    """Validation loss, in chunks of 64 sequences to bound the attention's memory."""
    total = sum(lm_loss(model, chunk).item() * len(chunk) for chunk in sequences.split(64))
    return total / len(sequences)


def learning_rate(config: Config, step: int, cooldown: str = "linear") -> float:
    """LR of optimizer step ``step`` (1-based): linear warmup, constant up to the fork step, then
    (on a cooldown fork only) down towards 0 over ``cooldown_steps``: the multiplier is ``1 - x``
    (``linear``) or ``1 - sqrt(x)`` (``1-sqrt``) of ``x = (step - fork) / (cooldown_steps + 1)``."""
    if step <= config.warmup_steps:
        return config.peak_lr * step / config.warmup_steps
    if step <= config.steps:
        return config.peak_lr
    x = (step - config.steps) / (config.cooldown_steps + 1)
    return config.peak_lr * (1 - (x if cooldown == "linear" else math.sqrt(x)))


def load_model(folder: Path, config: Config) -> nn.Module:
    """A model with the weights of a safetensors folder: one file, or shards listed by the HF index."""
    index = folder / "model.safetensors.index.json"
    names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else []
    weights: dict[str, torch.Tensor] = {}
    for name in names or ["model.safetensors"]:
        weights.update(load_file(str(folder / name)))
    model = ByteGPT(config.dim, config.heads, config.layers, config.context)
    model.load_state_dict(weights)
    return model


# -- one seed --------------------------------------------------------------------------------


def pct(fraction: float) -> str:
    """``0.05`` -> ``"5%"``: method keys and labels name windows by their share of the run."""
    return f"{round(100 * fraction)}%"


def methods(config: Config) -> list[tuple[str, str, int]]:
    """(key, description, extra training steps) of each compared model, in table order."""
    window = f"{pct(COOLDOWN_FRACTION)} window"
    end = config.steps + config.cooldown_steps
    return [
        ("last", f"last checkpoint (step {config.steps})", 0),
        *((f"uniform-{pct(f)}", f"uniform average, last {pct(f)}", 0) for f in WINDOW_FRACTIONS),
        ("ema", f"EMA halflife {pct(EMA_HALFLIFE_FRACTION)}, {window}", 0),
        ("wma", f"WMA, {window}", 0),
        ("wsm:1-sqrt", f"WSM 1-sqrt (= minus-sqrt), {window}", 0),
        ("wsm:cosine", f"WSM cosine, {window}", 0),
        ("cooldown", f"linear cooldown {pct(COOLDOWN_FRACTION)} (step {end})", config.cooldown_steps),
        ("cooldown-1-sqrt", f"1-sqrt cooldown {pct(COOLDOWN_FRACTION)} (step {end})", config.cooldown_steps),
    ]


def weightings(config: Config) -> dict[str, ckptavg.Weighting]:
    """The weightings every window is averaged with in one sweep, by method key."""
    return {
        "uniform": ckptavg.Weighting(),
        "ema": ckptavg.Weighting("ema", ema_halflife=EMA_HALFLIFE_FRACTION * config.steps),
        "wma": ckptavg.Weighting("wma"),
        "minus-sqrt": ckptavg.Weighting("minus-sqrt"),
    }


def wsm_coefficients(shape: str, count: int) -> list[float]:
    """WSM's merge weights of ``count`` checkpoints, oldest first, for a decay of this shape,
    by Megatron-LM's recurrence: ``d[i] = f(i / count)``, ``c[count-1] = d[count-1]``,
    ``c[i] = d[i] - d[i+1]``, ``c[0] = 1 - d[1]``, with f(x) = 1 - sqrt(x) (``1-sqrt``:
    minus-sqrt's weights) or (1 + cos(pi x)) / 2 (``cosine``); 1 - x would give uniform weights.
    Averaging iterates of a constant learning rate with these weights applies each update with
    the tail sum of the weights after it: the decay f."""
    if count == 1:
        return [1.0]
    decay = {"1-sqrt": lambda x: 1 - math.sqrt(x), "cosine": lambda x: (1 + math.cos(math.pi * x)) / 2}[shape]
    d = [decay(i / count) for i in range(count)]
    return [1 - d[1], *(d[i] - d[i + 1] for i in range(1, count - 1)), d[count - 1]]


def averages(config: Config, snapshots: Path, merged: Path) -> tuple[dict[str, Path], dict[str, Path], dict[str, Any]]:
    """Every window x weighting of the run's snapshots from ONE read of them (``ckptavg.sweep``):
    the table's averages per method, the whole grid (``"<weighting> <window %>"``), and what the
    pass read against separate merges of the same candidates (also merged, timed and compared
    byte for byte here, which is cheap at this size).

    The table's uniform average of the cooldown-sized window is the hook's own merge at the fork
    step, which the sweep's candidate of that window must equal byte for byte."""
    fork = config.steps
    windows = {config.window(f): f for f in WINDOW_FRACTIONS}
    schemes = weightings(config)
    started = time.perf_counter()
    result = ckptavg.sweep(
        str(snapshots),
        merge_step=fork,
        windows=list(windows),
        weightings=list(schemes.values()),
        every=config.stride,
        out=str(merged / "sweep"),
        # A small model: 1 MiB accumulator blocks instead of 16 MiB for each of the 12 candidates.
        options=ckptavg.MergeOptions(chunk_bytes=2**20),
    )
    one_pass = time.perf_counter() - started
    grid: dict[str, Path] = {}
    outputs = iter(result.candidates)
    for fraction in windows.values():
        for key in schemes:
            grid[f"{key} {pct(fraction)}"] = Path(next(outputs).output)
    started = time.perf_counter()
    for window, fraction in windows.items():
        for key, weighting in schemes.items():
            out = merged / "separate" / f"{key}-{pct(fraction)}"
            ckptavg.merge(
                str(snapshots), merge_step=fork, window=window, every=config.stride, weighting=weighting, out=str(out)
            )
            if _files(out) != _files(grid[f"{key} {pct(fraction)}"]):
                raise SystemExit(f"experiment: the sweep's {key} {pct(fraction)} differs from its separate merge")
    separate = time.perf_counter() - started
    for window, fraction in windows.items():
        steps = list(sampled_steps(fork, window, config.stride))
        for shape in WSM_SHAPES:
            out = merged / "wsm" / f"{shape}-{pct(fraction)}"
            ckptavg.merge(
                str(snapshots),
                merge_step=fork,
                window=window,
                every=config.stride,
                weighting=ckptavg.Weighting("wsm", shape=shape),  # checked below against Megatron's recurrence
                out=str(out),
            )
            if not _weighs(out, wsm_coefficients(shape, len(steps))):
                raise SystemExit(f"experiment: WSM {shape} {pct(fraction)} is not Megatron's recurrence")
            grid[f"wsm:{shape} {pct(fraction)}"] = out
        if not _weighs(grid[f"wsm:1-sqrt {pct(fraction)}"], ckptavg.Weighting("minus-sqrt").weights(steps)):
            raise SystemExit(f"experiment: WSM 1-sqrt {pct(fraction)} differs from minus-sqrt")
    hook_merge = snapshots / f"step{fork}-merged"
    if _files(hook_merge) != _files(grid[f"uniform {pct(COOLDOWN_FRACTION)}"]):
        raise SystemExit("experiment: the sweep's uniform average differs from the hook's merge of the same window")
    twenty = pct(COOLDOWN_FRACTION)
    folders = {f"uniform-{pct(f)}": grid[f"uniform {pct(f)}"] for f in WINDOW_FRACTIONS}
    folders[f"uniform-{twenty}"] = hook_merge
    folders.update({key: grid[f"{key} {twenty}"] for key in ("ema", "wma")})
    folders.update({f"wsm:{shape}": grid[f"wsm:{shape} {twenty}"] for shape in WSM_SHAPES})
    sweep = {
        "candidates": len(result.candidates),
        "bytes_read": result.bytes_read,
        "bytes_read_by_separate_merges": result.bytes_separately,
        "seconds_one_pass": one_pass,
        "seconds_separate_merges": separate,
    }
    return folders, grid, sweep


def _weighs(folder: Path, weights: Sequence[float]) -> bool:
    """Whether a merge weighed its sources so, as its manifest records (normalised, to a few ulps)."""
    recorded = averaged_steps(folder)["weights"]
    return len(recorded) == len(weights) and all(
        math.isclose(x, y, rel_tol=1e-13) for x, y in zip(recorded, weights, strict=True)
    )


def _files(folder: Path) -> dict[str, bytes]:
    """The bytes of an output's weight files and manifest."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name.startswith(("model", "ckptavg"))}


def averaged_steps(folder: Path) -> dict[str, list]:
    """The steps and normalised weights a merged folder averaged, as its manifest records them."""
    sources = json.loads((folder / "ckptavg-manifest.json").read_text())["sources"]
    return {"steps": [s["step"] for s in sources], "weights": [s["weight"] for s in sources]}


def run_seed(config: Config, seed: int, folder: str) -> dict[str, Any]:
    """Train one seed to the fork step with the hook, merge, evaluate, then run the cooldown fork."""
    # One thread per process: two processes on two cores, and no spin-waiting thread teams.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    started = time.perf_counter()
    run = Path(folder)
    shutil.rmtree(run, ignore_errors=True)
    train_data, val_data, corpus = load_corpus(config.train_bytes, config.val_bytes)
    val = val_batch(val_data, config)
    model = ByteGPT(config.dim, config.heads, config.layers, config.context)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.peak_lr, betas=(0.9, 0.95), weight_decay=config.weight_decay
    )
    hook = ckptavg.MergeHook(
        ckptavg.MergeHookConfig(
            save_folder=str(run / "snapshots"),
            merge_steps=[config.steps],
            window=config.window(COOLDOWN_FRACTION),
            every=config.stride,
            mode="snapshot",
        )
    )
    eval_every = max(1, config.steps // CURVE_POINTS)

    def train_step(step: int, cooldown: str = "linear") -> None:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step, cooldown)
        loss = lm_loss(model, train_batch(train_data, config, seed, step))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    curve = [(0, evaluate(model, val))]
    hook.pre_train(0)
    for step in range(1, config.steps + 1):
        train_step(step)
        hook.post_train_batch(step, model)
        if step % eval_every == 0 or step == config.steps:
            curve.append((step, evaluate(model, val)))
    hook.close()  # waits for the snapshots and the hook's merge of the last window
    last = run / f"step{config.steps}"
    last.mkdir()
    save_file({k: t.contiguous() for k, t in model.state_dict().items()}, str(last / "model.safetensors"))
    trained = time.perf_counter() - started

    folders, grid, sweep = averages(config, run / "snapshots", run / "merged")
    losses = {"last": evaluate(load_model(last, config), val)}
    losses.update({key: evaluate(load_model(folder, config), val) for key, folder in folders.items()})
    grid_losses = {key: evaluate(load_model(folder, config), val) for key, folder in grid.items()}

    # Each cooldown forks from the same state at the fork step, and sees the same batches.
    fork_state = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    cooldown_curves = {}
    end = config.steps + config.cooldown_steps
    for shape in COOLDOWNS:
        model.load_state_dict(fork_state[0])
        optimizer.load_state_dict(fork_state[1])
        key = "cooldown" if shape == "linear" else f"cooldown-{shape}"
        cooldown_curves[key] = [curve[-1]]
        for step in range(config.steps + 1, end + 1):
            train_step(step, shape)
            if (step - config.steps) % eval_every == 0 or step == end:
                cooldown_curves[key].append((step, evaluate(model, val)))
        losses[key] = cooldown_curves[key][-1][1]
    return {
        "seed": seed,
        "corpus": {**corpus, "train_bytes": len(train_data), "val_bytes": len(val_data)},
        "parameters": sum(p.numel() for p in model.parameters()),
        "losses": losses,
        "averages": {key: {"folder": str(f), **averaged_steps(f)} for key, f in folders.items()},
        "grid": grid_losses,
        "sweep": sweep,
        "curve": curve,
        "cooldown_curves": cooldown_curves,
        "seconds": {"to_fork": trained, "total": time.perf_counter() - started},
    }


# -- report ----------------------------------------------------------------------------------


def summarize(config: Config, results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per method: losses per seed, their mean, the change against the last checkpoint, and
    the fraction of the cooldown's gain (on the means) that the method recovers."""
    mean = {k: math.fsum(r["losses"][k] for r in results) / len(results) for k, _, _ in methods(config)}
    gain = mean["last"] - mean["cooldown"]
    rows = []
    for key, description, extra in methods(config):
        rows.append(
            {
                "method": key,
                "description": description,
                "extra_steps": extra,
                "losses": [r["losses"][key] for r in results],
                "mean": mean[key],
                "delta_vs_last": mean[key] - mean["last"],
                "cooldown_gain_recovered": (mean["last"] - mean[key]) / gain if gain > 0 else None,
            }
        )
    return rows


def print_table(config: Config, seeds: Sequence[int], rows: Sequence[dict[str, Any]]) -> None:
    """The comparison, with the pairing of the 20 % average and the 20 % cooldown spelled out."""
    seed_cols = "".join(f"{'seed ' + str(s):>9}" for s in seeds)
    header = f"{'method':<44}{'extra steps':>12}{seed_cols}{'mean':>9}{'vs last':>9}{'of cooldown gain':>18}"
    print("\nvalidation loss (nats/byte, lower is better)")
    print(header)
    print("-" * len(header))
    for row in rows:
        recovered = row["cooldown_gain_recovered"]
        share = "" if row["method"] == "last" or recovered is None else f"{100 * recovered:.0f}%"
        losses = "".join(f"{loss:>9.4f}" for loss in row["losses"])
        print(
            f"{row['description']:<44}{row['extra_steps']:>12}{losses}{row['mean']:>9.4f}"
            f"{row['delta_vs_last']:>+9.4f}{share:>18}"
        )
    window = config.window(COOLDOWN_FRACTION)
    print(
        f"\nThe fork step is {config.steps}: every average ends there and costs no training step. The uniform "
        f"{pct(COOLDOWN_FRACTION)} average\n(steps {config.steps - window + 1}-{config.steps}, one snapshot "
        f"every {config.stride}) is the free counterpart of the linear {pct(COOLDOWN_FRACTION)} cooldown, "
        f"WSM 1-sqrt that of the 1-sqrt one;\neach cooldown trains {config.cooldown_steps} extra steps from the "
        "same state. 'of cooldown gain' = (last - method) / (last - linear cooldown), on the means over seeds."
    )


def print_sweep(config: Config, results: Sequence[dict[str, Any]]) -> None:
    """Every window x weighting of the one sweep pass (mean loss over seeds), and what reading the
    snapshots once saved against merging each candidate on its own."""
    schemes = [*weightings(config), *(f"wsm:{shape}" for shape in WSM_SHAPES)]
    print(f"\nevery window and weighting (mean validation loss over {len(results)} seed(s)); WSM merged apart:")
    print(f"{'weighting':<12}" + "".join(f"{'last ' + pct(f):>11}" for f in WINDOW_FRACTIONS))
    for key in schemes:
        means = [math.fsum(r["grid"][f"{key} {pct(f)}"] for r in results) / len(results) for f in WINDOW_FRACTIONS]
        print(f"{key:<12}" + "".join(f"{m:>11.4f}" for m in means))
    sweep = results[0]["sweep"]
    once, separately = sweep["bytes_read"], sweep["bytes_read_by_separate_merges"]
    print(
        f"one pass wrote {sweep['candidates']} candidates per seed, reading the snapshots once: {once / 1e6:.2f} MB "
        f"instead of {separately / 1e6:.2f} MB by {sweep['candidates']} separate merges ({separately / once:.1f}x); "
        f"wall {sweep['seconds_one_pass']:.2f} s vs {sweep['seconds_separate_merges']:.2f} s "
        f"(seed {results[0]['seed']}; each candidate byte-identical to its separate merge)"
    )


def plot(config: Config, results: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Three panels: the whole run; its tail, with each seed's averages as markers at the fork step
    (their merge step) next to the cooldown fork; the mean loss of each method as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (whole, tail, bars) = plt.subplots(
        1, 3, figsize=(18, 5.5), layout="constrained", gridspec_kw={"width_ratios": [1, 1.3, 0.9]}
    )
    zoom_from = int(0.6 * config.steps)
    averaged = [r for r in rows if r["method"] != "last" and not r["method"].startswith("cooldown")]
    for i, result in enumerate(results):
        color = f"C{i}"
        for ax, curve in ((whole, result["curve"]), (tail, [p for p in result["curve"] if p[0] >= zoom_from])):
            ax.plot(*zip(*curve, strict=True), color=color, label=f"seed {result['seed']}, constant LR")
            for shape, fork, style in zip(COOLDOWNS, result["cooldown_curves"].values(), ("--", ":"), strict=True):
                ax.plot(*zip(*fork, strict=True), color=color, ls=style, label=f"{shape} cooldown fork")
        for row, marker in zip(averaged, "osD^v<>Pp*", strict=False):
            tail.scatter(
                config.steps,
                row["losses"][i],
                marker=marker,
                s=45,
                zorder=3,
                facecolors="none",
                edgecolors=color,
                label=row["description"] if i == 0 else None,
            )
    early = [loss for result in results for step, loss in result["curve"] if step >= config.steps // 10]
    whole.set_ylim(min(r["mean"] for r in rows) - 0.05, max(early) + 0.05)
    whole.set_title("validation loss along training")
    tail.set_title(f"from step {zoom_from}; markers: averages at the fork step {config.steps}")
    tail.legend(fontsize=7, ncol=2, loc="upper right")
    for ax in (whole, tail):
        ax.axvline(config.steps, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
    labels = [f"{r['method']} (+{r['extra_steps']} steps)" if r["extra_steps"] else r["method"] for r in rows]
    colors = ["grey" if r["method"] == "last" else "C3" if r["method"].startswith("cooldown") else "C2" for r in rows]
    drawn = bars.barh(labels, [r["mean"] for r in rows], color=colors)
    bars.bar_label(drawn, fmt="%.4f", padding=3, fontsize=8)
    bars.invert_yaxis()
    low, high = min(r["mean"] for r in rows), max(r["mean"] for r in rows)
    bars.set_xlim(low - 0.5 * (high - low), high + 0.3 * (high - low))
    bars.set_xlabel(f"validation loss, mean of {len(results)} seed(s)")
    bars.tick_params(axis="y", labelsize=8)
    bars.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the seeds in parallel processes, then print the table and write the JSON and the plot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="steps to the fork step (default: 3000, or 200 with --quick)")
    parser.add_argument("--seeds", type=int, nargs="+", help="default: 0 1 (0 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and few steps: checks the plumbing")
    parser.add_argument("--out", type=Path, default=Path("experiment-out"), help="folder for runs, JSON and PNG")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    if args.steps is not None:
        config = replace(config, steps=args.steps, warmup_steps=min(config.warmup_steps, args.steps // 10 or 1))
    seeds = args.seeds or ([0] if args.quick else [0, 1])
    if config.steps < 20:
        sys.exit("experiment: --steps must be at least 20, so that the 5, 10 and 20% windows differ")
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"training seed(s) {', '.join(map(str, seeds))}, one process each: {config.steps} steps "
        f"(warmup {config.warmup_steps}, LR {config.peak_lr:g}) + {config.cooldown_steps}-step cooldown forks "
        f"({', '.join(COOLDOWNS)}); snapshots every {config.stride} steps over the last "
        f"{config.window(COOLDOWN_FRACTION)}",
        flush=True,
    )
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: torch threads set before any work
    with ProcessPoolExecutor(max_workers=len(seeds), mp_context=context) as pool:
        futures = [pool.submit(run_seed, config, s, str(args.out / "runs" / f"seed{s}")) for s in seeds]
        results = [f.result() for f in futures]
    rows = summarize(config, results)
    first = results[0]
    print(
        f"{first['parameters']:,}-parameter byte-level transformer; corpus: {first['corpus']['train_bytes']:,} "
        f"training bytes from {first['corpus']['train_files']} files, {first['corpus']['val_bytes']:,} validation "
        f"bytes from {first['corpus']['val_files']} files ({config.val_sequences} validation sequences)"
    )
    for result in results:
        seconds = result["seconds"]
        print(f"seed {result['seed']}: {seconds['total']:.0f} s ({seconds['to_fork']:.0f} s to the fork)")
    print_table(config, seeds, rows)
    print_sweep(config, results)
    report = {"config": asdict(config), "seeds": list(seeds), "table": rows, "runs": results}
    (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(config, results, rows, args.out / "loss.png")
    print(f"\nwrote {args.out / 'results.json'} and {args.out / 'loss.png'} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
