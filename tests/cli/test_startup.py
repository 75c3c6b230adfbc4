"""Start-up: a local merge imports torch and little else before it reads the files' headers.

Each check runs the command in a fresh interpreter and lists what it imported: a module imported
at the top of a file that every merge loads (a format reader, the CLI) costs every run its import
time, and some of these cost seconds (DCP pulls in much of torch.distributed; torch._dynamo,
sympy) or start threads and event loops (fsspec's async backends).
"""

from __future__ import annotations

import subprocess
import sys

from helpers import clean_env, make_run

# Imported only by what needs them: DCP checkpoints, object stores, the hook, plots, tests.
HEAVY = (
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "torch._inductor",
    "sympy",
    "fsspec.asyn",
    "fsspec.implementations.http",
    "s3fs",
    "gcsfs",
    "adlfs",
    "aiohttp",
    "botocore",
    "rich",
    "matplotlib",
    "safetensors",
    "transformers",
    "deepspeed",
    "lightning",
    "hypothesis",
    "ckptavg.hook",
    "ckptavg.plan.plot",
)


def imported_by(argv: list[str]) -> set[str]:
    """The module names ``ckptavg *argv`` leaves in ``sys.modules`` (run in a fresh interpreter)."""
    code = (
        "import sys\n"
        "from ckptavg.cli import app\n"
        "try:\n"
        f"    app({argv!r}, prog_name='ckptavg')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code in (0, None), exc.code\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.splitlines())


def test_a_local_safetensors_merge_imports_nothing_heavy(tmp_path):
    make_run(tmp_path / "run", [10, 20], {"model.w": (8, 8), "model.b": (8,)})
    out = tmp_path / "out"
    modules = imported_by(["merge", str(tmp_path / "run"), "--last", "2", "--out", str(out), "--quiet"])
    assert (out / "ckptavg-manifest.json").is_file()  # it did merge
    assert "torch" in modules and "ckptavg.formats.safetensors" in modules
    assert sorted(name for name in HEAVY if name in modules) == []


def test_help_imports_neither_torch_nor_fsspec():
    modules = imported_by(["--help"])
    assert {name.split(".")[0] for name in modules} & {"torch", "fsspec"} == set()


def test_a_merge_without_numpy_prints_only_its_own_lines(tmp_path):
    """torch does not need numpy, nor does ckptavg, and `pip install ckptavg` does not bring it;
    torch then warns on import. The command hides that warning: it prints only its own lines.
    (Here numpy is hidden from a fresh interpreter; CI checks the same in a venv without it.)"""
    hidden = tmp_path / "no-numpy"
    hidden.mkdir()
    (hidden / "numpy.py").write_text('raise ModuleNotFoundError("No module named numpy", name="numpy")\n')
    make_run(tmp_path / "run", [1, 2], {"w": (8,)})
    command = [sys.executable, "-m", "ckptavg", "merge", str(tmp_path / "run"), "--last", "2"]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, check=False, env=clean_env(PYTHONPATH=str(hidden))
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() and all(line.startswith("ckptavg: ") for line in done.stderr.splitlines()), (
        done.stderr
    )
    probe = [sys.executable, "-c", "import torch"]  # the warning it hides is there to hide
    plain = subprocess.run(
        probe, capture_output=True, text=True, timeout=300, check=False, env=clean_env(PYTHONPATH=str(hidden))
    )
    assert "Failed to initialize NumPy" in plain.stderr
