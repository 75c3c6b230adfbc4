"""The merge engine alone: average checkpoint folders into a sink that drops the bytes.

Run as a child process by the benchmark to see the arithmetic and reads without the output's
hashing and writing (which, on a slow disk, bound a whole merge): the thread-scaling figure is
about this part, the one the threads share. Prints one JSON line: ``{"bytes", "seconds",
"gb_per_s", "threads"}`` (seconds of ``StreamingAverage.run`` alone, inputs read per second).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ckptavg.formats import open_checkpoint
from ckptavg.formats.layout import layout_shards
from ckptavg.io.fs import resolve
from ckptavg.merging.engine import EngineOptions, StreamingAverage, output_specs


class _Drop:
    def write(self, data: memoryview) -> None:
        pass

    def close(self) -> str:
        return ""

    def abort(self) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--mmap", action="store_true")
    args = parser.parse_args(argv)
    readers = [open_checkpoint(*resolve(folder)) for folder in args.folders]
    options = EngineOptions(threads=args.threads, mmap=args.mmap)
    engine = StreamingAverage(readers, None, options)
    shards = layout_shards(output_specs(list(engine.tensors.values()), None), 5 * 10**9)
    started = time.perf_counter()
    engine.run(shards, lambda _shard: _Drop())
    seconds = time.perf_counter() - started
    total = engine.read_bytes(shards)
    print(json.dumps({"bytes": total, "seconds": seconds, "gb_per_s": total / seconds / 1e9, "threads": args.threads}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
