"""benchmarks/gpu_check.py (``make gpu-check``): its CPU smoke run, and that it fails when the merge is wrong."""

from __future__ import annotations

import json
import subprocess
import sys
from types import ModuleType

import pytest
import torch
from helpers import REPO, load_script
from training import store_reads_wait_for_the_optimizer

from ckptavg.hook.capture import WeightCapture

SCRIPT = REPO / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    """The script as a module."""
    return load_script(SCRIPT, "ckptavg_gpu_check")


def test_the_cpu_smoke_run_passes_and_reports_json():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--params", "2e6", "--steps", "6"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["device"] == "cpu" and record["steps"] == 6 and record["dtype"] == "bf16"
    assert 1e6 <= record["params"] <= 4e6
    assert record["correct"] is True
    check = record["check"]
    assert check["elements"] == record["params"]  # every parameter of every step compared
    assert check["mirror_differs"] == 0 and check["max_ulps"] <= 1 and check["exact_fraction"] >= 0.9999
    assert record["median_step_s"]["none"] > 0 and record["median_step_s"]["accumulate"] > 0
    assert "PASS" in done.stdout


def test_a_capture_that_does_not_hold_the_optimizer_back_fails_the_check(gpu_check, monkeypatch, capsys):
    """The fault the check is for: weights read after the next optimizer step changed them (each
    read waits for that step: no timing)."""
    monkeypatch.setattr(WeightCapture, "_hold_back_changes", lambda self: None)
    with store_reads_wait_for_the_optimizer("finished"), pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--device", "cpu", "--params", "3e5", "--steps", "3", "--warmup", "1"])
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    record = json.loads(out.strip().splitlines()[-1])
    assert record["correct"] is False and record["check"]["mirror_differs"] > 0
    assert "FAIL" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is absent")
def test_cuda_asked_for_without_cuda_is_one_clear_line(gpu_check):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--device", "cuda"])
    message = str(exit_info.value.code)
    assert message.startswith("gpu_check: error: --device cuda, but torch") and "no CUDA device" in message
    assert "\n" not in message
