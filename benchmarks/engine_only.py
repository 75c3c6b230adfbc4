"""The merge engine alone: average checkpoint folders into a sink that drops the bytes.

Run as a child process by the benchmark to see the arithmetic and reads without the output's
hashing and writing (which, on a slow disk, bound a whole merge). With ``--resident`` every
input tensor is loaded into memory before the clock starts and handed to the engine in place,
as a mapped file's pages would be, so nothing but the arithmetic (and the engine's own
bookkeeping: steps, threads, writer hand-off) is timed: the compute-bound case the thread
scaling target is about. Without it the reader threads copy the files from the page cache,
which on a 2-core machine takes CPU from the arithmetic. Prints one JSON line: ``{"bytes",
"written", "seconds", "gb_per_s", "threads", "resident"}`` (seconds of ``StreamingAverage.run``
alone, inputs averaged per second; ``written``: the output's bytes, for the memory traffic).

``--processes N`` (with ``--resident``) splits the tensors into N parts of about equal size and
averages each part in its own process, one thread each, all passes started together: the same
arithmetic with no GIL shared, what the machine's cores give side by side. The benchmark prints
it beside the threads' scaling, as the raw read stands beside the merge's GB/s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from collections.abc import Sequence
from typing import Any

from ckptavg.formats import open_checkpoint
from ckptavg.formats.base import CheckpointReader
from ckptavg.formats.layout import ShardSpec, TensorSpec, layout_shards
from ckptavg.io.fs import resolve
from ckptavg.merging.engine import EngineOptions, StreamingAverage, output_specs
from ckptavg.merging.native import native_mean


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

    def adjacent(names: Sequence[str]) -> list[bool]:
        # Each tensor is its own buffer here: a view never reads on into the next tensor's bytes.
        return [False] * max(0, len(names) - 1)

    # Instance attributes on purpose: only this benchmark's readers answer from memory.
    reader.local_view = local_view  # type: ignore[method-assign,assignment]
    reader.adjacent = adjacent  # type: ignore[method-assign]
    return keep


def part_of(specs: Sequence[TensorSpec], part: int, parts: int) -> list[TensorSpec]:
    """Part ``part`` of ``parts`` contiguous runs of ``specs`` of about equal bytes (a tensor
    goes to the part its middle byte falls in)."""
    total, before, chosen = sum(s.nbytes for s in specs), 0, []
    for spec in specs:
        if (2 * before + spec.nbytes) * parts // (2 * total) == part:
            chosen.append(spec)
        before += spec.nbytes
    return chosen


def _engine(
    folders: Sequence[str], threads: int | None, mmap: bool, native: bool = True
) -> tuple[StreamingAverage, list[TensorSpec]]:
    readers = [open_checkpoint(*resolve(folder)) for folder in folders]
    engine = StreamingAverage(readers, None, EngineOptions(threads=threads, mmap=mmap, native=native))
    return engine, output_specs(list(engine.tensors.values()), None)


def _shards(specs: Sequence[TensorSpec]) -> list[ShardSpec]:
    return layout_shards(list(specs), 5 * 10**9)


def _part_process(
    folders: Sequence[str], part: int, parts: int, repeat: int, barrier: Any, native: bool = True
) -> None:
    """One part's process: inputs loaded into memory, then ``repeat`` passes, each started and
    ended at the barrier that the parent times."""
    engine, specs = _engine(folders, 1, True, native)
    kept = [make_resident(reader) for reader in engine.readers]
    shards = _shards(part_of(specs, part, parts))
    barrier.wait()  # loaded
    for _ in range(repeat):
        barrier.wait()
        engine.run(shards, lambda _shard: _Drop())
        barrier.wait()
    del kept


def run_processes(folders: Sequence[str], parts: int, repeat: int, native: bool = True) -> list[float]:
    """Seconds of each pass of ``parts`` processes averaging a part each, side by side."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter each, as a merge is
    barrier = context.Barrier(parts + 1)
    children = [
        context.Process(target=_part_process, args=(list(folders), part, parts, repeat, barrier, native))
        for part in range(parts)
    ]
    for child in children:
        child.start()
    try:
        barrier.wait(timeout=600)
        seconds = []
        for _ in range(repeat):
            barrier.wait(timeout=600)
            started = time.perf_counter()
            barrier.wait(timeout=600)
            seconds.append(time.perf_counter() - started)
    finally:
        for child in children:
            child.join(timeout=60)
    if any(child.exitcode != 0 for child in children):
        raise SystemExit("a part's process failed")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--mmap", action="store_true")
    parser.add_argument("--resident", action="store_true", help="load the inputs into memory before timing")
    parser.add_argument("--repeat", type=int, default=1, help="runs over the same inputs; the fastest is printed")
    parser.add_argument("--processes", type=int, default=None, help="parts averaged side by side (with --resident)")
    parser.add_argument("--no-native", action="store_true", help="torch's ops instead of the compiled mean loop")
    args = parser.parse_args(argv)
    if args.processes is not None and not (args.resident and args.processes >= 1 and args.threads in (None, 1)):
        parser.error("--processes needs --resident, at least 1, and one thread per process")
    engine, specs = _engine(args.folders, args.threads, args.mmap or args.resident, not args.no_native)
    shards = _shards(specs)
    total = engine.read_bytes(shards)
    if args.processes is not None:
        seconds = run_processes(args.folders, args.processes, args.repeat, not args.no_native)
    else:
        kept = [make_resident(reader) for reader in engine.readers] if args.resident else []
        seconds = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            engine.run(shards, lambda _shard: _Drop())
            seconds.append(time.perf_counter() - started)
        del kept
    best = min(seconds)
    print(
        json.dumps(
            {
                "bytes": total,
                "written": sum(spec.nbytes for spec in specs),
                "seconds": best,
                "gb_per_s": total / best / 1e9,
                "threads": args.threads,
                "resident": args.resident,
                "processes": args.processes,
                "native": not args.no_native and native_mean() is not None,
                "all_seconds": seconds,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
