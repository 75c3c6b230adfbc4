"""A worker thread for the training hook: jobs run in order, failures wait to be asked for.

A background failure cannot raise into the training loop by itself, so the hook asks at every
call (:meth:`BackgroundWorker.check`) and re-raises it there. The first failure sticks: jobs
after it still run (each releases what it holds in its ``finally``), but the worker stays
failed, because a half-updated running sum must never be published.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class BackgroundWorker:
    """One daemon thread; ``submit`` blocks while ``max_pending`` jobs wait (backpressure)."""

    def __init__(self, name: str, max_pending: int = 2, initializer: Callable[[], None] | None = None) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], Future] | None] = queue.Queue(max_pending)
        self._error: BaseException | None = None
        self._initializer = initializer
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._initializer is not None:
            self._initializer()
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
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
