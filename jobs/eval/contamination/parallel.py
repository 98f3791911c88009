"""Training batches scanned in this process or in ``procs`` worker processes (``--procs``): each worker builds
its own index of the eval rows once; batches go out in file order, at most two per worker in flight (memory
stays a few batches), and their hits come back in the same order."""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor

from ckpteval.jobs.eval.contamination.index import EvalIndex, Hit, Settings
from ckpteval.jobs.eval.contamination.train_data import Batch

_INDEX: list[EvalIndex] = []  # a worker process's index (set by _start)


def _start(texts: list[str], settings: Settings, groups: list[str]) -> None:
    _INDEX[:] = [EvalIndex(texts, settings, groups)]


def _scan(texts: list[str], tiers: tuple[str, ...]) -> list[Hit]:
    return _INDEX[0].scan(texts, tiers)


def scanned(texts: list[str], groups: list[str], settings: Settings, tiers: Sequence[str], batches: Iterable[Batch],
            procs: int = 1) -> Iterator[tuple[Batch, list[Hit]]]:
    """Each batch with the hits of the eval ``texts`` (of eval sets ``groups``) in it (hit ids: positions in
    ``texts``), in order."""
    if procs <= 1:
        index = EvalIndex(texts, settings, groups)
        for batch in batches:
            yield batch, index.scan(batch.texts, tiers)
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    with ProcessPoolExecutor(procs, mp_context=context, initializer=_start, initargs=(texts, settings, groups)) as pool:
        pending: deque[tuple[Batch, Future[list[Hit]]]] = deque()
        for batch in batches:
            pending.append((batch, pool.submit(_scan, batch.texts, tuple(tiers))))
            if len(pending) > 2 * procs:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()
