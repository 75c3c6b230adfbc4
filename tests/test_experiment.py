"""examples/experiment.py --quick: the averaging experiment's plumbing, end to end, in seconds.

The numbers of a quick run mean nothing; what is checked is that every compared model exists,
that the averages were written by the library from the hook's snapshots (and equal independent
float64 averages of them), and that the losses in the table are those of the merged folders.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from helpers import load_script
from references import correctly_rounded, load_merged, same_bits
from safetensors.torch import load_file

import ckptavg
from ckptavg.plan import sampled_steps

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "experiment.py"
METHODS = [
    "last",
    "uniform-5%",
    "uniform-10%",
    "uniform-20%",
    "ema",
    "wma",
    "wsm:1-sqrt",
    "wsm:cosine",
    "cooldown",
    "cooldown-1-sqrt",
]


@pytest.fixture(scope="module")
def experiment() -> ModuleType:
    """The script as a module, for its model and validation set."""
    return load_script(SCRIPT, "ckptavg_experiment")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, Any]]:
    """One ``--quick`` run in a fresh folder: (output folder, stdout, results.json)."""
    out = tmp_path_factory.mktemp("experiment") / "out"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout, json.loads((out / "results.json").read_text())


def snapshot_tensors(snapshots: Path, step: int) -> dict[str, torch.Tensor]:
    """A snapshot's weights, read straight from its single rank file (one process wrote it)."""
    return load_file(str(snapshots / f"step{step}-snapshot" / "rank00000-of-00001.safetensors"))


def test_table_json_and_plot(quick_run: tuple[Path, str, dict[str, Any]]) -> None:
    out, stdout, results = quick_run
    assert [row["method"] for row in results["table"]] == METHODS
    for row in results["table"]:
        assert row["description"] in stdout
        assert len(row["losses"]) == len(results["seeds"]) == 1
        assert all(math.isfinite(loss) for loss in row["losses"])
        assert math.isfinite(row["mean"])
    rows = {row["method"]: row for row in results["table"]}
    assert rows["last"]["delta_vs_last"] == 0
    cooldown_steps = round(0.2 * results["config"]["steps"])
    assert rows["cooldown"]["extra_steps"] == rows["cooldown-1-sqrt"]["extra_steps"] == cooldown_steps
    assert rows["cooldown"]["cooldown_gain_recovered"] == pytest.approx(1.0)
    assert "of cooldown gain" in stdout
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (run,) = results["runs"]
    assert run["curve"][0][0] == 0 and run["curve"][-1][0] == results["config"]["steps"]
    for key in ("cooldown", "cooldown-1-sqrt"):
        fork = run["cooldown_curves"][key]
        assert fork[0] == run["curve"][-1] and fork[-1][0] == results["config"]["steps"] + cooldown_steps
        assert fork[-1][1] == run["losses"][key]
    assert run["losses"]["cooldown"] != run["losses"]["cooldown-1-sqrt"]


def test_snapshots_and_averaged_steps(quick_run: tuple[Path, str, dict[str, Any]]) -> None:
    """The hook wrote a snapshot of every sampled step of the 20 % window, and each average
    records (in its manifest) the steps of its own window and its scheme's weights."""
    out, _, results = quick_run
    config = results["config"]
    fork, stride = config["steps"], config["steps"] // 100
    snapshots = out / "runs" / "seed0" / "snapshots"
    window = round(0.2 * fork)
    expected = list(sampled_steps(fork, window, stride))
    assert sorted(int(p.name.split("-")[0][4:]) for p in snapshots.glob("step*-snapshot")) == expected
    averages = results["runs"][0]["averages"]
    for key, fraction in (("uniform-5%", 0.05), ("uniform-10%", 0.10), ("uniform-20%", 0.20)):
        assert averages[key]["steps"] == list(sampled_steps(fork, round(fraction * fork), stride)), key
    ema = ckptavg.Weighting("ema", ema_halflife=0.05 * fork)
    assert averages["ema"]["steps"] == expected
    assert averages["ema"]["weights"] == pytest.approx(ema.weights(expected), rel=1e-12)
    assert averages["uniform-20%"]["folder"] == str(snapshots / f"step{fork}-merged")  # the hook's own merge


def test_averages_equal_independent_means(quick_run: tuple[Path, str, dict[str, Any]]) -> None:
    """The hook's uniform merge is the correctly rounded float64 mean of the snapshots, bit for
    bit; the EMA merge is their float64 weighted sum up to fp32 rounding."""
    out, _, results = quick_run
    averages = results["runs"][0]["averages"]
    snapshots = out / "runs" / "seed0" / "snapshots"
    steps = averages["uniform-20%"]["steps"]
    weights = {s: snapshot_tensors(snapshots, s) for s in steps}
    merged = load_merged(Path(averages["uniform-20%"]["folder"]))
    assert set(merged) == set(weights[steps[0]])
    for name, tensor in merged.items():
        mean = sum(weights[s][name].double() for s in steps) / len(steps)
        assert bool(same_bits(tensor, correctly_rounded(mean, torch.float32)).all()), name
    ema = load_merged(Path(averages["ema"]["folder"]))
    for name, tensor in ema.items():
        expected = sum(w * weights[s][name].double() for s, w in zip(steps, averages["ema"]["weights"], strict=True))
        torch.testing.assert_close(tensor.double(), expected, rtol=1e-6, atol=1e-7)


def megatron_wsm(decay, count: int) -> list[float]:
    """Megatron-LM's WSM coefficients (weighted_merge.py), restated: d[i] = f(i/N), c[N-1] =
    d[N-1], c[i] = d[i] - d[i+1], c[0] = 1 - d[1]; oldest first."""
    d = [decay(i / count) for i in range(count)]
    c = [d[i] - d[i + 1] for i in range(count - 1)] + [d[-1]]
    c[0] = 1 - d[1]
    return c


def test_wsm_averages_weigh_each_window_by_megatrons_recurrence(quick_run: tuple[Path, str, dict[str, Any]]) -> None:
    """WSM 1-sqrt and cosine over every window: the weights in each manifest are Megatron's
    coefficients (N=4 of 1-sqrt: 0.5, 0.2071, 0.1589, 0.1340; 1-sqrt equals minus-sqrt), and the
    merged cosine 20 % average is the float64 weighted sum of the snapshots up to fp32 rounding."""
    assert megatron_wsm(lambda x: 1 - math.sqrt(x), 4) == pytest.approx([0.5, 0.2071, 0.1589, 0.1340], abs=5e-5)
    out, _, results = quick_run
    fork, stride = results["config"]["steps"], results["config"]["steps"] // 100
    snapshots = out / "runs" / "seed0" / "snapshots"
    shapes = {"1-sqrt": lambda x: 1 - math.sqrt(x), "cosine": lambda x: (1 + math.cos(math.pi * x)) / 2}
    for fraction in (0.05, 0.10, 0.20):
        steps = list(sampled_steps(fork, round(fraction * fork), stride))
        for shape, decay in shapes.items():
            folder = out / "runs" / "seed0" / "merged" / "wsm" / f"{shape}-{round(100 * fraction)}%"
            sources = json.loads((folder / "ckptavg-manifest.json").read_text())["sources"]
            assert [s["step"] for s in sources] == steps
            expected = megatron_wsm(decay, len(steps))
            assert [s["weight"] for s in sources] == pytest.approx(expected, rel=1e-13, abs=1e-16)
    minus_sqrt = ckptavg.Weighting("minus-sqrt").weights(steps)
    assert megatron_wsm(shapes["1-sqrt"], len(steps)) == pytest.approx(minus_sqrt, rel=1e-13)
    averages = results["runs"][0]["averages"]
    assert averages["wsm:1-sqrt"]["weights"] == pytest.approx(minus_sqrt, rel=1e-13)
    assert averages["wsm:cosine"]["weights"] != pytest.approx(minus_sqrt, rel=1e-3)
    weights = {s: snapshot_tensors(snapshots, s) for s in steps}
    cosine = averages["wsm:cosine"]
    for name, tensor in load_merged(Path(cosine["folder"])).items():
        exact = sum(w * weights[s][name].double() for s, w in zip(steps, cosine["weights"], strict=True))
        torch.testing.assert_close(tensor.double(), exact, rtol=1e-6, atol=1e-7)


def test_the_cooldowns_decay_linearly_and_as_one_minus_sqrt(experiment: ModuleType) -> None:
    config = experiment.QUICK
    fork, steps = config.steps, config.cooldown_steps
    for k in range(1, steps + 1):
        x = k / (steps + 1)
        assert experiment.learning_rate(config, fork + k) == pytest.approx(config.peak_lr * (1 - x), rel=1e-12)
        rate = experiment.learning_rate(config, fork + k, "1-sqrt")
        assert rate == pytest.approx(config.peak_lr * (1 - math.sqrt(x)), rel=1e-12)
    assert experiment.learning_rate(config, fork, "1-sqrt") == config.peak_lr


def test_losses_are_those_of_the_merged_folders(
    quick_run: tuple[Path, str, dict[str, Any]], experiment: ModuleType
) -> None:
    out, _, results = quick_run
    config = experiment.Config(**results["config"])
    _, val_data, _ = experiment.load_corpus(config.train_bytes, config.val_bytes)
    val = experiment.val_batch(val_data, config)
    run = results["runs"][0]
    folders = {key: Path(a["folder"]) for key, a in run["averages"].items()}
    folders["last"] = out / "runs" / "seed0" / f"step{config.steps}"
    for key, folder in folders.items():
        loss = experiment.evaluate(experiment.load_model(folder, config), val)
        assert loss == pytest.approx(run["losses"][key], rel=1e-5), key
    assert run["losses"]["last"] != run["losses"]["uniform-20%"]


def test_every_window_and_weighting_comes_from_one_sweep_pass(quick_run: tuple[Path, str, dict[str, Any]]) -> None:
    """12 candidates (3 windows x 4 weightings) written by one read of the 20 % window's snapshots;
    the script itself checked each against its separate merge and the hook's merge."""
    out, stdout, results = quick_run
    run = results["runs"][0]
    fork, stride = results["config"]["steps"], results["config"]["steps"] // 100
    windows = [round(f * fork) for f in (0.05, 0.10, 0.20)]
    tags = ["uniform", f"ema{round(0.05 * fork)}", "wma", "minus-sqrt"]
    sweep_folder = out / "runs" / "seed0" / "merged" / "sweep"
    assert sorted(p.name for p in sweep_folder.iterdir()) == sorted(
        f"step{fork}-merged-w{w}-{t}" for w in windows for t in tags
    )
    swept = [key for key in run["grid"] if not key.startswith("wsm:")]  # WSM's are merged apart
    assert len(swept) == run["sweep"]["candidates"] == 12 and len(run["grid"]) == 12 + 6
    assert all(math.isfinite(loss) for loss in run["grid"].values())
    counts = [len(sampled_steps(fork, w, stride)) for w in windows]
    # Once: each snapshot of the widest window; separately: each candidate's own snapshots.
    assert run["sweep"]["bytes_read"] * 4 * sum(counts) == run["sweep"]["bytes_read_by_separate_merges"] * counts[-1]
    assert "reading the snapshots once" in stdout and "byte-identical to its separate merge" in stdout
