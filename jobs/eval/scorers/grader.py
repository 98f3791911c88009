"""The ``math`` scorer: Hugging Face's math-verify, graded in a small process pool under a deadline.

What this module owns and promises:

- :func:`grade_math` grades one completion against one gold answer with math-verify (boxed answers,
  fractions vs decimals, LaTeX, percentages) and returns ``(score, extracted_answer)``. GSM8K's
  ``#### n`` is honoured first: the number after the *first* ``####`` is the answer (math-verify has no
  such anchor and would otherwise take the last number of a completion that kept talking). The
  extracted answer is a canonical key for majority voting (numbers as their decimal value, so ``1/2``,
  ``0.5`` and ``50%`` vote together), ``None`` when nothing could be extracted.
- math-verify's own timeouts use ``signal.alarm``, which fails outside the main thread (workers score
  in threads), so they are switched off and :class:`GraderPool` enforces a deadline itself: answers are
  graded in ``processes`` spawned processes; an answer not graded within ``timeout_s`` (measured from
  when the caller starts waiting for it, by which time it is running) scores 0 and is *counted* as a
  timeout, the pool is terminated (the stuck process with it) and the rest is graded by a fresh one.
  A pathological answer therefore costs at most ``timeout_s`` plus a pool start, never a hung unit.
- :func:`grade_inline` grades in the calling thread with no deadline (the bench baseline).

Limits: a pool start costs about a second (spawned processes import sympy; an answer's deadline
starts after that); the pool is created on first use and kept for the process's life. After a
timeout, answers that were in flight in the killed pool are graded again by the fresh one (answers
already finished are kept). A grading process that dies (OOM) is treated like a
timeout. The deadline is per answer, not per unit.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.pool
import os
import queue
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 120.0
GSM_ANSWER = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


@dataclass(frozen=True)
class Graded:
    """One graded answer: its score, the extracted answer (majority-vote key) and whether it timed out."""

    score: float
    answer: str | None
    timed_out: bool = False


def _quiet() -> None:
    # math-verify warns once per process that its timeouts are off: we know, we enforce our own
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def _pre_extract(text: str) -> str:
    """GSM8K: the number after the first ``#### `` when there is one, else the text unchanged."""
    m = GSM_ANSWER.search(text)
    return m.group(1).replace(",", "") if m else text


def answer_key(parsed: list[Any]) -> str | None:
    """A hashable canonical form of a math-verify parse (None when nothing was extracted)."""
    if not parsed:
        return None
    import sympy

    obj = parsed[0]
    if isinstance(obj, sympy.Basic) and obj.is_number:
        try:
            value = float(obj.doit())  # doit(): "50%" parses to an unevaluated 50*(1/100)
        except (TypeError, ValueError):  # complex and other non-real numbers: their sympy form
            return str(obj)
        return f"{value:.6f}".rstrip("0").rstrip(".") or "0"
    return str(obj)


def parse_gold(parse: Any, answer: str) -> list[Any]:
    """A reference answer as math-verify reads it: a bare one (no ``$``, no ``\\boxed``: MATH's ``\\left( 3,
    \\frac{\\pi}{2} \\right)``, ``p - q``, ``6+9i``) as the content of a ``\\boxed{}``, which its plain-text
    extraction would read as ``3``, nothing, or ``6``; else (or when that reads nothing) as written."""
    if "$" not in answer and "\\boxed" not in answer:
        gold = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
        if gold:
            return gold  # type: ignore[no-any-return]
    return parse(answer, parsing_timeout=None)  # type: ignore[no-any-return]


def grade_math(completion: str, answer: str) -> tuple[float, str | None]:
    """math-verify ``verify(gold, prediction)`` with its signal-based timeouts off; see the module doc."""
    from math_verify import parse, verify

    _quiet()
    gold = parse_gold(parse, _pre_extract(str(answer)))
    pred = parse(_pre_extract(completion), parsing_timeout=None)
    if not pred:
        return 0.0, None
    ok = bool(gold) and bool(verify(gold, pred, timeout_seconds=None))
    return float(ok), answer_key(pred)


def _grade_task(completion: str, answer: str) -> tuple[float, str | None]:
    return grade_math(completion, answer)


def _warm(ready: Any) -> None:
    _quiet()
    import math_verify  # noqa: F401 — import once per grading process, not per answer

    ready.put(os.getpid())  # the deadline of an answer must not include a process start


def grade_inline(pairs: Sequence[tuple[str, str]]) -> list[Graded]:
    """Grade in this thread, no deadline (what a pool is measured against)."""
    return [Graded(*grade_math(c, a)) for c, a in pairs]


class GraderPool:
    """math-verify in ``processes`` spawned processes with a per-answer deadline (see the module doc)."""

    def __init__(self, processes: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"grader timeout must be > 0 s, got {timeout_s}")
        self.processes = processes or max(1, min(2, os.cpu_count() or 1))
        self.timeout_s = timeout_s
        self.timeouts = 0  # ever, for this pool
        self._pool: multiprocessing.pool.Pool | None = None
        self._lock = threading.Lock()

    def _start(self) -> multiprocessing.pool.Pool:
        """The pool, started if needed; returns once every grading process has imported math-verify."""
        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")  # never fork a threaded worker
            ready = ctx.Queue()
            self._pool = ctx.Pool(self.processes, initializer=_warm, initargs=(ready,))
            try:
                for _ in range(self.processes):
                    ready.get(timeout=STARTUP_TIMEOUT_S)
            except queue.Empty:
                self._kill()
                raise RuntimeError(f"math grader processes did not start within {STARTUP_TIMEOUT_S:g}s") from None
            finally:
                ready.close()
        return self._pool

    def _kill(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def grade(self, pairs: Sequence[tuple[str, str]], timeout_s: float | None = None) -> list[Graded]:
        """Grade every ``(completion, gold)`` pair, in order; a timed-out one scores 0 and is marked.

        ``timeout_s``: this call's deadline per answer (default: the pool's).
        """
        deadline = self.timeout_s if timeout_s is None else timeout_s
        if deadline <= 0:
            raise ValueError(f"grader timeout must be > 0 s, got {deadline}")
        out: list[Graded | None] = [None] * len(pairs)
        with self._lock:
            todo = list(range(len(pairs)))
            while todo:
                pool = self._start()
                pending = {i: pool.apply_async(_grade_task, pairs[i]) for i in todo}
                todo = []
                for i, job in pending.items():
                    if out[i] is not None:
                        continue
                    try:
                        out[i] = Graded(*job.get(deadline))
                    except multiprocessing.TimeoutError:
                        out[i] = Graded(0.0, None, timed_out=True)
                        self.timeouts += 1
                        # keep what already finished, regrade the rest in a fresh pool
                        for j, other in pending.items():
                            if out[j] is None and other.ready() and other.successful():
                                out[j] = Graded(*other.get())
                        todo = [j for j in pending if out[j] is None]
                        self._kill()
                        break
        return [g for g in out if g is not None]

    def close(self) -> None:
        with self._lock:
            self._kill()


_DEFAULT: GraderPool | None = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> GraderPool:
    """The process's shared grading pool (created on first use, terminated at exit)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = GraderPool()
            atexit.register(_DEFAULT.close)
        return _DEFAULT
