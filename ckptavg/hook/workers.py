"""Worker threads for the training hook: jobs run in order, failures wait to be asked for.

A background failure cannot raise into the training loop by itself, so the hook asks at every
call (:meth:`BackgroundWorker.check`) and re-raises it there. The first failure sticks: jobs
after it still run (each releases what it holds in its ``finally``), but the worker stays
failed, because a half-updated running sum must never be published.

Torch arithmetic in these threads goes through :func:`inline_copy`, :func:`inline_start` and
:func:`inline_add`, which work in slices of at most :data:`INLINE_ELEMENTS`; the sums use the
merge engine's block kernel (:mod:`ckptavg.merging.kernel`), so they round exactly as a merge
does. At or below ATen's grain size an
elementwise op runs in the calling thread instead of starting an OpenMP team. A long-lived
thread's team keeps spinning after each op and starves the training loop's own team (measured
with a 2-thread CPU loop: it fell from 1.94 to 1.6 busy cores, 80-130 ms more per step, for
~30 ms of additions), and it can abort the process at exit. ``torch.set_num_threads`` is no
way out: it is process-wide and would take training's threads too.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from ..merging.kernel import INLINE_ELEMENTS, fold_in, start_sum


def _slices(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensor, flat, in slices of INLINE_ELEMENTS: cut in one call, because each Python-level
    slicing is a torch call that holds the GIL (a 1B-parameter model is 30,000 slices a step)."""
    return tensor.reshape(-1).split(INLINE_ELEMENTS)


def inline_copy(destination: torch.Tensor, source: torch.Tensor) -> None:
    """``destination.copy_(source)`` (contiguous destination), slice by slice."""
    for out, values in zip(_slices(destination.view(-1)), _slices(source), strict=True):
        out.copy_(values)


def inline_start(destination: torch.Tensor, source: torch.Tensor, weight: float) -> None:
    """A fresh sum: ``destination = source * weight`` (contiguous destination), slice by slice."""
    for out, values in zip(_slices(destination.view(-1)), _slices(source), strict=True):
        start_sum(out, values, weight)


def inline_add(
    destinations: Sequence[torch.Tensor],
    source: torch.Tensor,
    scratch: torch.Tensor,
    factors: Sequence[tuple[float, float]] | None = None,
) -> None:
    """``d.mul_(decay).add_(source, alpha=weight)`` for each contiguous ``d`` and its
    ``(decay, weight)`` in ``factors`` (plain ``d.add_(source)`` without them), slice by slice;
    a source of another dtype is converted once per slice into ``scratch`` (at least
    INLINE_ELEMENTS of the sums' dtype)."""
    outs = [_slices(d.view(-1)) for d in destinations]
    for i, part in enumerate(_slices(source)):
        conversion = scratch if scratch.numel() == part.numel() else scratch[: part.numel()]
        fold_in([out[i] for out in outs], part, conversion, factors)


def inline_divide(tensor: torch.Tensor, divisor: float) -> None:
    """``tensor /= divisor`` (contiguous), slice by slice: each element rounded once, as
    :func:`ckptavg.merging.kernel.finish_mean` divides a sum of the same dtype."""
    for part in _slices(tensor.view(-1)):
        torch.div(part, divisor, out=part)


def inline_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() == b.numel() and all(torch.equal(x, y) for x, y in zip(_slices(a), _slices(b), strict=True))


def _stop(jobs: queue.Queue, thread: threading.Thread) -> None:
    if thread.is_alive():
        jobs.put(None)
        thread.join()


class BackgroundWorker:
    """One daemon thread; ``submit`` blocks while ``max_pending`` jobs wait (backpressure)."""

    def __init__(self, name: str, max_pending: int = 2) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], Future] | None] = queue.Queue(max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        # A hook never closed still finishes its queued work before the interpreter goes.
        self._finalizer = weakref.finalize(self, _stop, self._jobs, self._thread)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            try:
                if item is None:
                    return
                job, future = item
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(job())
                except BaseException as exc:  # noqa: BLE001 - kept for the owner's thread
                    if self._error is None:
                        self._error = exc
                    future.set_exception(exc)
            finally:
                self._jobs.task_done()

    def submit(self, job: Callable[[], Any]) -> Future:
        if not self._thread.is_alive():
            raise RuntimeError(f"{self._thread.name} is closed")
        future: Future = Future()
        self._jobs.put((job, future))
        return future

    def check(self) -> None:
        """Re-raise the first failure of any job so far, in the caller's thread."""
        if self._error is not None:
            raise self._error

    def drain(self) -> None:
        """Wait until every submitted job has finished, then :meth:`check`."""
        self._jobs.join()
        self.check()

    def close(self) -> None:
        """Finish the queued jobs and stop the thread (failures stay for :meth:`check`)."""
        self._finalizer()
