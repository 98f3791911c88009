"""The worker's unit thread: units run in one long-lived helper thread so that the main thread stays free to
act on stop signals (release the lease at once) while a unit runs.

Promises: a unit costs no thread start (one ``clone`` per worker, not per unit); a job still running when the
next is submitted (a unit abandoned after a stop signal) keeps its thread and the new job gets a fresh one,
so an abandoned unit never delays the next; the threads are daemons, so an exiting worker never waits for an
abandoned unit. Limits: nothing here interrupts a running job.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Job:
    run: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any | None = None
    error: BaseException | None = None


class UnitRunner:
    """Runs submitted jobs one after another in one daemon thread (see the module docstring)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._current: _Job | None = None

    @property
    def busy(self) -> bool:
        return self._current is not None and not self._current.done.is_set()

    def submit(self, run: Callable[[], Any]) -> _Job:
        job = _Job(run)
        if self._thread is None or self.busy:
            self._jobs = queue.SimpleQueue()  # the busy thread ends after its job; the fresh one serves this queue
            self._thread = threading.Thread(target=self._serve, args=(self._jobs,), name="ckpteval-unit", daemon=True)
            self._thread.start()
        self._current = job
        self._jobs.put(job)
        return job

    def _serve(self, jobs: queue.SimpleQueue[_Job]) -> None:
        while jobs is self._jobs:
            job = jobs.get()
            try:
                job.result = job.run()
            except BaseException as e:  # noqa: BLE001 — carried to the main thread and re-raised there
                job.error = e
            job.done.set()
