"""Progress over bytes: a tqdm bar on a terminal, a plain line every few seconds in a log."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from ..units import format_bytes

LOG_INTERVAL_S = 5.0


class ByteCount:
    """Callable with the bytes just read, as the engine reports them: adds them up (``total``,
    the figure a merge or sweep result gives) and passes each on to ``progress``."""

    def __init__(self, progress: Callable[[int], None] | None = None) -> None:
        self.total = 0
        self._progress = progress

    def __call__(self, nbytes: int) -> None:
        self.total += nbytes
        if self._progress is not None:
            self._progress(nbytes)


class ByteProgress:
    """Callable with the bytes just processed. Chooses its form once, from ``stream.isatty()``:
    SLURM logs get no carriage-return spam, just a line at most every ``interval`` seconds."""

    def __init__(
        self,
        total: int,
        *,
        label: str = "merge",
        quiet: bool = False,
        stream: TextIO | None = None,
        interval: float = LOG_INTERVAL_S,
    ) -> None:
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.interval = interval
        self.done = 0
        self.started = time.perf_counter()
        self._last_log = self.started
        self._bar = None
        self.quiet = quiet
        if not quiet and self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=label, file=self.stream, leave=False
            )

    def start(self, total: int) -> None:
        """The merge knows the bytes it will read only once it has laid out its part of the work."""
        self.total = total
        if self._bar is not None:
            self._bar.reset(total=total)

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.update(nbytes)
            return
        now = time.perf_counter()
        if now - self._last_log >= self.interval:
            self._last_log = now
            rate = self.done / max(now - self.started, 1e-9)
            percent = 100.0 * self.done / self.total if self.total else 100.0
            print(
                f"ckptavg: {self.label}: {format_bytes(self.done)} of {format_bytes(self.total)} "
                f"({percent:.0f}%), {rate / 1e9:.2f} GB/s",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
