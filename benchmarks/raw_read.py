"""Read files end to end into one reused buffer: the I/O floor a merge cannot beat.

Run as a child process by the benchmark (also to warm the page cache before timing). It
imports nothing but the standard library, so its wall time is the read itself plus a few
tens of milliseconds of interpreter start, and its peak RSS is the interpreter plus the buffer.
Prints one JSON line: ``{"bytes": ..., "seconds": ..., "gb_per_s": ...}`` (seconds measured
inside the process, excluding interpreter start).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_BUFFER = 16 * 2**20


def read_all(paths: list[Path], buffer_bytes: int = DEFAULT_BUFFER) -> int:
    """Read every byte of ``paths`` with unbuffered ``readinto`` into one buffer; return the count."""
    buffer = bytearray(buffer_bytes)
    view = memoryview(buffer)
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while n := handle.readinto(view):
                total += n
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--buffer", type=int, default=DEFAULT_BUFFER, help="buffer bytes (default 16 MiB)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    total = read_all(args.files, args.buffer)
    seconds = time.perf_counter() - started
    print(json.dumps({"bytes": total, "seconds": seconds, "gb_per_s": total / max(seconds, 1e-9) / 1e9}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
