"""CPU cost of reading column-split blocks, per row width: straight into place or via scratch.

Run with ``.venv/bin/python benchmarks/bench_column_reads.py`` (``--mib``, ``--repeat``,
``--dir``). A matrix of random bf16 stored as two column blocks (tensor-parallel ``Shard(1)`` by
2) in one cached file is read back through :class:`ckptavg.formats.blocks.Geometry` in 8 MiB
ranges, its rows either read straight into the output by ``preadv`` vectors
(:class:`~ckptavg.formats.blocks._RowReads`) or read into the reader's scratch buffer and copied
into place (``_read_rows``), interleaved width by width, and prints the medians of the CPU
seconds of each: where the two cross is ``blocks.SCATTER_ROW_BYTES``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from ckptavg.formats import blocks
from ckptavg.formats.blocks import Geometry, StoredBlock
from ckptavg.io.files import RandomAccessFile
from ckptavg.io.fs import resolve

WIDTHS = (512, 1024, 2048, 4096, 8192)  # bytes of one row of one block
RANGE = 8 * 2**20


def read_all(file: RandomAccessFile, row_bytes: int, total: int, out: torch.Tensor) -> None:
    columns = row_bytes // 2
    rows = total // (2 * row_bytes)
    half = rows * row_bytes
    stored = [StoredBlock(file, (0, c), (rows, columns), c * 2 * rows) for c in (0, columns)]
    geometry = Geometry((rows, 2 * columns), stored)
    view = _view(out)
    for offset in range(0, 2 * half, RANGE):
        geometry.read_into(2, offset, view[: min(RANGE, 2 * half - offset)])


def _view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as a writable memoryview (numpy is not installed)."""
    return memoryview((ctypes.c_char * tensor.numel()).from_address(tensor.data_ptr())).cast("B")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="size of the matrix")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the file (a temporary folder)")
    args = parser.parse_args(argv)
    total = args.mib * 2**20
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = os.path.join(folder, "columns.bin")
        with open(path, "wb") as handle:
            handle.write(os.urandom(total))
        out = torch.empty(RANGE, dtype=torch.uint8)
        samples: dict[tuple[int, str], list[float]] = {}
        with RandomAccessFile(*resolve(path)) as file:
            for _ in range(args.repeat):
                for width in WIDTHS:
                    for way, straight in (("straight", True), ("scratch", False)):
                        with mock.patch.object(blocks, "SCATTER_ROW_BYTES", 0 if straight else total):
                            start = time.process_time()
                            read_all(file, width, total, out)
                            samples.setdefault((width, way), []).append(time.process_time() - start)
    print(f"CPU seconds to read {args.mib} MiB of two column blocks, medians of {args.repeat}, interleaved")
    print(f"{'row bytes':>10}{'straight':>10}{'scratch':>10}{'ratio':>8}")
    for width in WIDTHS:
        straight, scratch = (statistics.median(samples[width, way]) for way in ("straight", "scratch"))
        print(f"{width:>10}{straight:>10.4f}{scratch:>10.4f}{straight / scratch:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
