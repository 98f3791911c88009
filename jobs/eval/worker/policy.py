"""The worker's poll, backoff and retry decisions, apart from the loop that acts on them (no I/O).

What each decision promises — when a failed unit is written or left for another worker, infra-skip
retries, ``--max-unhealthy``, when an unfound snapshot is given up on, when the worker exits:
docs/USER_GUIDE.md "Self-healing" and "Skip reasons and what to do"; docs/PROTOCOL.md §5-6.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ckpteval.coord.results.files import INFRA_SKIPS, Result, retry_due
from ckpteval.coord.snapshots.weight_checksums import OVERTURNED
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.worker.options import WorkerOptions

# Outcomes that may be the worker's own fault (its engine died, its setup makes scoring raise): such a
# result is written only when the unit, not the worker, is to blame (RetryPolicy.leave_for_another) —
# at once when the result names user code to blame (a scorer, a library task raised). A disputed checksum
# (ckpteval.jobs.eval.proof.attest.AttestDisputed) is left for another worker's independent load the same way.
RETRYABLE = frozenset({"unhealthy", "crashed", "attest_disputed"})


@dataclass
class RetryPolicy:
    """One worker's poll cadence, backoff and retry state; the loop asks, this answers."""

    opts: WorkerOptions
    lease_s: float
    """the run's lease duration: the unit of every patience below"""
    clock: Callable[[], float] = time.monotonic
    proven: bool = False
    """this worker has scored a unit of this run: its engine and setup work"""
    done_seen_at: float | None = None
    """when this worker first saw the run ended (TRAINING_DONE or INTERRUPTED)"""
    unhealthy_streak: int = 0
    retried: set[WorkUnit] = field(default_factory=set)
    """infra skips re-evaluated by this process (once each)"""
    _polled_at: float = -float("inf")
    _unfound_since: dict[int, float] = field(default_factory=dict)
    _pending_since: dict[tuple[str, str], float] = field(default_factory=dict)

    # -- polling -------------------------------------------------------------------------------------
    def poll_due(self, todo: bool) -> bool:
        """Poll again when nothing is left to try from the last poll, or a poll interval has passed."""
        return not todo or self.clock() - self._polled_at >= self.opts.poll_interval_s

    def polled(self) -> None:
        self._polled_at = self.clock()

    def saw_ended(self, ended: bool) -> None:
        if ended and self.done_seen_at is None:
            self.done_seen_at = self.clock()

    def finished(self, outstanding: int, ended: bool, awaiting_foreign: bool) -> bool:
        """Exit: ``--once`` when nothing is outstanding or arriving; never in service; else at the run's end."""
        if self.opts.once:
            return outstanding == 0 and not awaiting_foreign
        if self.opts.service:
            return False
        return outstanding == 0 and ended

    def awaiting(self, dirs: Iterable[tuple[str, str]]) -> bool:
        """``--once``: whether a marker-less (root, dir) may still become quiescent (bounded wait per dir)."""
        now, waiting = self.clock(), False
        bound = 2 * self.opts.quiescence_s + 5 * self.opts.poll_interval_s
        for key in dirs:
            waiting |= now - self._pending_since.setdefault(key, now) < bound
        return waiting

    def unfound_given_up(self, unfound: set[int]) -> list[int]:
        """Dispatched steps no poll has found for one lease duration (on this clock) since first missed."""
        now = self.clock()
        for step in set(self._unfound_since) - unfound:
            del self._unfound_since[step]
        return [s for s in sorted(unfound) if now - self._unfound_since.setdefault(s, now) >= self.lease_s]

    # -- retries -------------------------------------------------------------------------------------
    def to_retry(self, unit: WorkUnit, result: Result) -> bool:
        """A result overturned by the checksum that stands (always re-run); with ``--retry-infra-skips``, an
        infrastructure skip this process has not re-evaluated yet."""
        if result.skip_reason == OVERTURNED:
            return True
        return self.opts.retry_infra_skips and result.skip_reason in INFRA_SKIPS and unit not in self.retried

    def claim_due(self, result: Result | None, generation: int) -> bool:
        """A unit without a result, or one whose (overloaded) skip's ``--retry-backoff`` has passed."""
        return result is None or retry_due(result, generation, self.opts.retry_backoff_s)

    def leave_for_another(self, result: Result, attempt: int) -> bool:
        """Whether a failed unit is released unwritten: a result is a permanent fact, so a failure that
        may be this worker's own (:data:`RETRYABLE`) is written only when the unit is to blame — this
        worker has scored a unit of the run (its engine works) and the unit has been claimed
        ``--max-attempts`` times — or when no healthy worker can be expected: the run ended and
        ``max_attempts`` lease durations have passed since this worker first saw it (the step's
        deadline), with the unit claimed ``--max-attempts`` times."""
        if result.skip_reason not in RETRYABLE or result.blame is not None:  # user code failed: the unit's
            return False
        if attempt < self.opts.max_attempts:
            return True
        deadline = self.opts.max_attempts * self.lease_s
        past_deadline = self.done_seen_at is not None and self.clock() - self.done_seen_at >= deadline
        return not (self.proven or past_deadline)

    def unhealthy_exit(self, result: Result | None, released: bool) -> bool:
        """Count a unit released or skipped ``unhealthy``; True at ``--max-unhealthy`` in a row."""
        if released or (result is not None and result.skip_reason == "unhealthy"):
            self.unhealthy_streak += 1
            return bool(self.opts.max_unhealthy) and self.unhealthy_streak >= self.opts.max_unhealthy
        if result is not None:
            self.unhealthy_streak = 0
        return False
