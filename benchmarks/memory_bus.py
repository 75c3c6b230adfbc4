"""How fast this machine's cores read memory: the ceiling of the engine's in-memory rows.

Run as a child process by the benchmark: ``torch.sum`` over a 1 GiB float32 tensor (far larger
than any cache) with ``--threads`` intra-op threads, the fastest of ``--repeat`` passes. One core
of the 2-core VM reads ~33 GB/s; two read 35-37 GB/s or ~63 GB/s, depending on where the host
places the two virtual CPUs at the time, which is why the benchmark measures it beside the
engine's runs instead of quoting a figure. Prints one JSON line: ``{"bytes", "seconds",
"gb_per_s", "threads"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--gib", type=float, default=1.0, help="size of the tensor read")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    values = torch.ones(int(args.gib * 2**30) // 4, dtype=torch.float32)  # written once: no page faults timed
    seconds = []
    for _ in range(args.repeat):
        started = time.perf_counter()
        values.sum()
        seconds.append(time.perf_counter() - started)
    best = min(seconds)
    print(
        json.dumps(
            {"bytes": values.nbytes, "seconds": best, "gb_per_s": values.nbytes / best / 1e9, "threads": args.threads}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
