"""The merge engine alone: average checkpoint folders into a sink that drops the bytes.

Run as a child process by the benchmark to see the arithmetic and reads without the output's
hashing and writing (which, on a slow disk, bound a whole merge). With ``--resident`` every
input tensor is loaded into memory before the clock starts and handed to the engine in place,
as a mapped file's pages would be, so nothing but the arithmetic (and the engine's own
bookkeeping: steps, threads, writer hand-off) is timed: the compute-bound case the thread
scaling target is about. Without it the reader threads copy the files from the page cache,
which on a 2-core machine takes CPU from the arithmetic. Prints one JSON line: ``{"bytes",
"seconds", "gb_per_s", "threads", "resident"}`` (seconds of ``StreamingAverage.run`` alone,
inputs averaged per second).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ckptavg.formats import open_checkpoint
from ckptavg.formats.base import CheckpointReader
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


class _InMemory:
    """A tensor's bytes already in memory, in the shape of io.files.MappedRange."""

    def __init__(self, data: memoryview) -> None:
        self.data = data

    def populate(self) -> None:
        pass

    def release(self) -> None:
        pass


def make_resident(reader: CheckpointReader) -> list[Any]:
    """Serve the engine every tensor of ``reader`` in place, already in memory: the file's
    pages mapped and populated once (the files are in the page cache: no copy, no fresh
    memory), or a copy where the reader maps nothing. Returns what keeps the mappings alive."""
    stored, keep = {}, []
    for info in reader.tensors():
        mapped = reader.local_view(info.name, 0, info.nbytes)
        if mapped is not None:
            mapped.populate()
            keep.append(mapped)
            stored[info.name] = mapped.data
        else:
            buffer = bytearray(info.nbytes)
            reader.read_into(info.name, 0, memoryview(buffer))
            stored[info.name] = memoryview(buffer)

    def local_view(name: str, offset: int, nbytes: int) -> _InMemory:
        return _InMemory(stored[name][offset : offset + nbytes])

    # An instance attribute on purpose: only this benchmark's readers answer from memory.
    reader.local_view = local_view  # type: ignore[method-assign,assignment]
    return keep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--mmap", action="store_true")
    parser.add_argument("--resident", action="store_true", help="load the inputs into memory before timing")
    parser.add_argument("--repeat", type=int, default=1, help="runs over the same inputs; the fastest is printed")
    args = parser.parse_args(argv)
    readers = [open_checkpoint(*resolve(folder)) for folder in args.folders]
    kept = [make_resident(reader) for reader in readers] if args.resident else []
    options = EngineOptions(threads=args.threads, mmap=args.mmap or args.resident)
    engine = StreamingAverage(readers, None, options)
    shards = layout_shards(output_specs(list(engine.tensors.values()), None), 5 * 10**9)
    seconds = []
    for _ in range(args.repeat):
        started = time.perf_counter()
        engine.run(shards, lambda _shard: _Drop())
        seconds.append(time.perf_counter() - started)
    total = engine.read_bytes(shards)
    del kept
    best = min(seconds)
    print(
        json.dumps(
            {
                "bytes": total,
                "seconds": best,
                "gb_per_s": total / best / 1e9,
                "threads": args.threads,
                "resident": args.resident,
                "all_seconds": seconds,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
