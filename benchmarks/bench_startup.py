"""Start-up of ``ckptavg``: what a command costs before (and besides) averaging any bytes.

Each figure is a fresh interpreter, timed from the outside, median of ``--repeat`` (5) with
min-max, run in turn so that load drifts alike for all:

  python            ``python -c pass``: the interpreter alone
  import torch      ``python -c "import torch"``: the floor of any merge
  + ckptavg         ``import torch`` and the modules a merge loads (``ckptavg.cli``,
                    ``ckptavg.merging.api``): what ckptavg adds to torch's import
  --help            ``ckptavg --help``: no torch, no fsspec
  tiny merge        ``ckptavg merge`` of two 2-tensor safetensors checkpoints (4 KB) into a local
                    folder (``--no-fsync``), and its averaging phase (the ``seconds`` of its
                    ``--json`` summary: from the first read of tensor data to the last write)

Printed: the medians, and the differences that matter: ckptavg's imports beyond torch, and the
tiny merge beyond ``import torch`` (imports, listing, headers, buffers, averaging, publishing;
nothing else happens before the first byte is averaged). The machine's load average is printed
with them: on a shared machine every figure moves with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def write_safetensors(path: Path, tensors: dict[str, tuple[list[int], bytes]]) -> None:
    """A float32 safetensors file, written by hand so that the driver imports no torch."""
    header: dict[str, object] = {}
    offset = 0
    for name, (shape, data) in tensors.items():
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"".join(data for _, data in tensors.values()))


def tiny_run(root: Path) -> None:
    for step in (1, 2):
        values = [float(step + i) / 7 for i in range(32 * 32)]
        weight = struct.pack(f"<{len(values)}f", *values)
        bias = struct.pack("<32f", *values[:32])
        write_safetensors(root / f"step{step}" / "model.safetensors", {"w": ([32, 32], weight), "b": ([32], bias)})


def timed(command: list[str], timeout: float) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"bench_startup: {' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return seconds, done.stdout


def spread(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:7.0f} ms ({min(values) * 1000:.0f}-{max(values) * 1000:.0f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each command (default 5)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run (default 300)")
    args = parser.parse_args(argv)

    python = sys.executable
    scratch = Path(tempfile.mkdtemp(prefix="ckptavg-bench-startup-"))
    try:
        tiny_run(scratch / "run")
        out = scratch / "out"
        merge = [python, "-m", "ckptavg", "merge", str(scratch / "run"), "--last", "2", "--out", str(out)]
        merge += ["--force", "--no-fsync", "--quiet", "--json"]
        commands = {
            "python": [python, "-c", "pass"],
            "import torch": [python, "-c", "import torch"],
            "import torch + ckptavg's merge modules": [python, "-c", "import torch, ckptavg.cli, ckptavg.merging.api"],
            "ckptavg --help": [python, "-m", "ckptavg", "--help"],
            "ckptavg merge, 2 tiny checkpoints": merge,
        }
        for command in commands.values():  # untimed: the files and byte code are warm for every run
            timed(command, args.timeout)
        walls: dict[str, list[float]] = {name: [] for name in commands}
        averaging: list[float] = []
        loads = [os.getloadavg()[0]]
        for _ in range(args.repeat):
            for name, command in commands.items():
                seconds, stdout = timed(command, args.timeout)
                walls[name].append(seconds)
                if command is merge:
                    averaging.append(json.loads(stdout)["seconds"])
            loads.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print(f"bench_startup: median of {args.repeat} (min-max), fresh interpreters; {os.cpu_count()} CPUs")
    for name, values in walls.items():
        print(f"  {name:<44} {spread(values)}")
    print(f"  {'  of which averaging (--json seconds)':<44} {spread(averaging)}")
    median = {name: statistics.median(values) for name, values in walls.items()}
    torch_s = median["import torch"]
    with_ckptavg = median["import torch + ckptavg's merge modules"]
    print(f"  ckptavg's imports beyond torch: {(with_ckptavg - torch_s) * 1000:.0f} ms")
    print(
        f"  tiny merge beyond import torch: {(median['ckptavg merge, 2 tiny checkpoints'] - torch_s) * 1000:.0f} ms "
        f"(whole command / import torch: {median['ckptavg merge, 2 tiny checkpoints'] / torch_s:.2f})"
    )
    print(f"  load average (1 min) during the runs: {', '.join(f'{x:.2f}' for x in loads)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
