"""``make demo``, the README's first command: it trains a tiny model, plans, hooks and merges, and
exits 0 only if every stage worked (each one exits non-zero on a failure of its own)."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO, clean_env


def test_the_demo_runs_to_the_end():
    done = subprocess.run(
        [sys.executable, "examples/demo.py"],  # what `make demo` runs once the venv is set up
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=clean_env(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "validation loss" in done.stdout and "demo finished in" in done.stdout
    merged = sorted(p.name for p in (REPO / "demo-run").glob("step*-merged"))
    hooked = sorted(p.name for p in (REPO / "demo-run" / "merges").glob("step*-merged"))
    assert merged and merged == hooked  # the CLI and the hook merged the same windows
