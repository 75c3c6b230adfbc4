"""The command line through its real entry points: output formats, exit codes, one-line errors."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_merged, make_run, run_cli

from ckptavg.progress import ByteProgress


def _one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ckptavg: error: ")
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_console_script_is_installed():
    script = shutil.which("ckptavg") or str(Path(sys.executable).parent / "ckptavg")
    proc = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert proc.stdout.startswith("ckptavg ")


def test_plan_text_shows_table_fixed_steps_and_timeline():
    proc = run_cli(
        "plan", "--periods", "100B,100B", "--tokens-per-step", "4M", "--decay-fraction", "0.1", "--window", "100"
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "22500" in out and "22401-22500" in out and "90B" in out
    assert "47401-47500" in out
    assert "checkpoints to keep" in out and "(fixed steps): 22401 47401" in out
    assert "schedule" in out and "\\" in out and "^" in out


def test_plan_json_and_env_agree():
    args = [
        "plan",
        "--periods",
        "1T",
        "--periods",
        "500B",
        "--batch-size",
        "1024",
        "--seq-len",
        "4096",
        "--decay",
        "50B",
        "--window",
        "200",
    ]
    data = json.loads(run_cli(*args, "--format", "json").stdout)
    env = run_cli(*args, "--format", "env").stdout
    expected = [(10**12 - 5 * 10**10) // (1024 * 4096), (15 * 10**11 - 5 * 10**10) // (1024 * 4096)]
    assert data["merge_steps"] == expected
    assert data["tokens_per_step"] == 1024 * 4096
    sourced = subprocess.run(
        ["bash", "-c", f'{env}\necho "$CKPTAVG_MERGE_STEPS|$CKPTAVG_FIXED_STEPS|$CKPTAVG_WINDOW"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    merge_steps, fixed, window = sourced.split("|")
    assert [int(s) for s in merge_steps.split()] == expected
    assert [int(s) for s in fixed.split()] == data["fixed_steps"]
    assert window == "200"


def test_plan_interval():
    data = json.loads(
        run_cli("plan", "--interval", "1000", "--max-steps", "3500", "--window", "10", "--format", "json").stdout
    )
    assert data["merge_steps"] == [1000, 2000, 3000]
    assert data["fixed_steps"] == [991, 1991, 2991]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (
            ["--periods", "1000", "--tokens-per-step", "10", "--decay", "100", "--window", "100"],
            "smaller than the window",
        ),
        (
            ["--periods", "1000", "--tokens-per-step", "10", "--decay", "2000", "--window", "5"],
            "longer than the period",
        ),
        (["--interval", "500", "--max-steps", "100", "--window", "5"], "nothing to merge"),
        (["--periods", "12Q", "--tokens-per-step", "1", "--window", "5"], "unknown suffix 'Q'"),
        (["--periods", "100B", "--window", "5"], "needs --tokens-per-step"),
    ],
)
def test_plan_errors_are_one_line(args, fragment):
    _one_line_error(run_cli("plan", *args), fragment)


def test_merge_dry_run_json_and_ls(tmp_path):
    run = tmp_path / "run"
    saved = make_run(run, [100, 200, 300], {"w": (1000,), "v": (10, 10)}, shards=2)
    dry = run_cli("merge", str(run), "--merge-step", "300", "--window", "200", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would average 2 checkpoints" in dry.stdout and "step300-merged" in dry.stdout
    assert "4.40 kB to read" in dry.stdout  # 2 x (1000 + 100) x 2 bytes
    assert not (run / "step300-merged").exists()

    proc = run_cli("merge", str(run), "--merge-step", "300", "--window", "200", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert [s["step"] for s in result["sources"]] == [200, 300]
    assert result["bytes_read"] == 4400
    merged = load_merged(run / "step300-merged")
    assert merged["w"].dtype == saved[300]["w"].dtype

    listing = run_cli("ls", str(run))
    assert listing.returncode == 0
    lines = listing.stdout.splitlines()
    assert lines[0].split() == ["step", "folder", "format", "size", "status"]
    assert any(
        line.split()[:3] == ["300", "step300-merged", "safetensors"] and line.endswith("merged") for line in lines
    )
    rows = json.loads(run_cli("ls", str(run), "--json").stdout)
    assert [(r["step"], r["status"]) for r in rows] == [
        (100, "complete"),
        (200, "complete"),
        (300, "complete"),
        (300, "merged"),
    ]


def test_merge_summary_line_and_quiet(tmp_path):
    run = tmp_path / "run"
    make_run(run, [1, 2], {"w": (100,)})
    proc = run_cli("merge", str(run), "--last", "2", "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr
    assert "ckptavg: merged 2 checkpoints (steps 1, 2, 1 tensors)" in proc.stderr and "GB/s" in proc.stderr
    assert "\r" not in proc.stderr  # not a TTY: no progress bar
    assert load_merged(run / "step2-merged")["w"].dtype.itemsize == 4
    quiet = run_cli("merge", str(run), "--last", "2", "--force", "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == ""


def test_merge_errors_are_one_line(tmp_path):
    run = tmp_path / "run"
    make_run(run, [100, 200], {"w": (10,)})
    _one_line_error(run_cli("merge", str(run), "--merge-step", "50", "--window", "10"), "steps found: 100, 200")
    _one_line_error(run_cli("merge", str(tmp_path / "nope"), "--last", "1"), "does not exist")
    _one_line_error(run_cli("merge", str(run), "--last", "2", "--dtype", "int8"), "unknown --dtype")
    run_cli("merge", str(run), "--last", "2")
    _one_line_error(run_cli("merge", str(run), "--last", "2"), "already exists; pass --force")


def test_help_teaches_with_examples():
    proc = run_cli("merge", "--help")
    assert proc.returncode == 0
    for option in ("--merge-step", "--window", "--last", "--steps", "--dry-run", "--dtype", "--shard-size", "--force"):
        assert option in proc.stdout
    assert "ckptavg merge runs/llama --merge-step 5000 --window 100" in proc.stdout


def test_log_progress_without_tty_is_plain_lines():
    stream = io.StringIO()
    progress = ByteProgress(3000, stream=stream, interval=0.0)
    for _ in range(3):
        progress(1000)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in stream.getvalue()
    assert lines[-1].startswith("ckptavg: merge: 3.00 kB of 3.00 kB (100%)")
