"""The shared-engine posture: evaluate on the trainer's own engine without aborting anything.

With no dedicated eval GPUs, an eval point runs on the engine that serves the trainer's producers
(rollout generation). :class:`ProducerGate` makes that safe:

- every producer request runs inside ``with gate.submission():``;
- ``with gate.paused():`` stops *new* submissions from starting (they wait at the gate), waits until
  the submissions already in flight have finished — none is aborted — and holds the engine for the
  caller until the block ends; then waiting producers resume.

:func:`shared_eval` is one blocking eval point under the gate: it loads the step's snapshot from
disk into the engine (weights reach an engine only from disk) and reads the engine's version back
(must be ``<run key>@<step>``, :func:`coord.identity.weight_version`), scores every unit of the step
with :func:`jobs.eval.scoring.score_unit`, and checks the version again — the fleet's pin routine and
check (:mod:`jobs.eval.pinning`, which says why the settings differ) — then writes one result per unit.
A version other than that before or
after, or on any sample, makes *every* unit of the point a ``pin_violation`` skip: the point did not
provably measure the intended weights. Pinning comes from call order: nothing else may load weights
while the gate is paused, and nothing else can submit.

Limits: a producer that calls the engine without ``gate.submission()`` is not gated; the gate is not
reentrant (a thread must not enter ``submission()`` while it holds ``paused()``: that deadlocks, so
it raises ``RuntimeError`` instead); an engine reloaded by another *process* is detected (the
version read-back), not prevented.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from coord.identity import run_key, weight_version
from coord.results import Result, harness_result, ok_result, skip_result, write_result
from coord.rundir import RunDir
from coord.snapshot import producer_identity
from coord.units import WorkUnit, units_for_step
from jobs.eval.engines.base import Engine, EngineError, RequestRejected, SamplesAborted
from jobs.eval.pinning import PinViolation, check_pinned, pin
from jobs.eval.prompts import NoChatTemplate
from jobs.eval.scoring import DatasetCache, UnitScores, score_unit

STOP_SLICE_S = 0.1  # how often a paused() drain looks at its stop flag


class StopRequested(TimeoutError):
    """A stop signal ended the wait for in-flight producer submissions."""


class ProducerGate:
    """Blocks new producer submissions while an eval holds the engine; see the module docstring."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._paused_by: int | None = None  # thread id holding paused()
        self._in_flight = 0
        self.submissions = 0  # started, ever
        self.pauses = 0

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self._in_flight

    @property
    def is_paused(self) -> bool:
        with self._cond:
            return self._paused_by is not None

    @contextlib.contextmanager
    def submission(self) -> Iterator[None]:
        """Wrap one producer request: waits while the gate is paused, then counts as in flight."""
        me = threading.get_ident()
        with self._cond:
            if self._paused_by == me:
                raise RuntimeError("this thread holds gate.paused(); a submission here would deadlock")
            while self._paused_by is not None:
                self._cond.wait()
            self._in_flight += 1
            self.submissions += 1
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def paused(
        self, drain_timeout_s: float | None = None, should_stop: Callable[[], bool] | None = None
    ) -> Iterator[None]:
        """Hold the engine: no new submission starts; in-flight ones finish first (bounded wait).

        ``TimeoutError`` if in-flight submissions do not finish within ``drain_timeout_s``, and
        :class:`StopRequested` (a ``TimeoutError``) as soon as ``should_stop()`` (the trainer's stop
        signal, looked at every :data:`STOP_SLICE_S`) says so; the gate is reopened before either.
        """
        me = threading.get_ident()
        deadline = None if drain_timeout_s is None else time.monotonic() + drain_timeout_s
        with self._cond:
            while self._paused_by is not None:  # another pauser: take turns
                self._cond.wait()
            self._paused_by = me
            self.pauses += 1
            while self._in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                stop = should_stop is not None and should_stop()
                if stop or (left is not None and left <= 0):
                    self._paused_by = None
                    self._cond.notify_all()
                    n = self._in_flight
                    if stop:
                        raise StopRequested(f"stop signal while {n} producer submissions were in flight")
                    raise TimeoutError(f"{n} producer submissions still in flight after {drain_timeout_s}s")
                if should_stop is not None:
                    left = STOP_SLICE_S if left is None else min(left, STOP_SLICE_S)
                self._cond.wait(left)
        try:
            yield
        finally:
            with self._cond:
                self._paused_by = None
                self._cond.notify_all()


def shared_eval(
    engine: Engine,
    gate: ProducerGate,
    run: RunDir,
    step: int,
    snapshot_dir: Path,
    *,
    cache: DatasetCache | None = None,
    drain_timeout_s: float | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[Result]:
    """Evaluate ``step`` on the trainer's engine under the gate; writes and returns one result per unit.

    Engine failures (:class:`EngineError`) become ``unhealthy`` skips of every unit; a unit the engine refused
    (``rejected``: a prompt over the model's context) or aborted is that unit's skip alone. Results are published
    first-writer-wins (:func:`coord.results.write_result`), so re-running a step is harmless.
    """
    manifest = run.manifest() if cache is None else cache.manifest
    cache = cache or DatasetCache(run, manifest)
    units = units_for_step(manifest, step)
    version = weight_version(run_key(manifest), step)
    snapshot = str(snapshot_dir)
    t0 = time.perf_counter()
    scored: dict[WorkUnit, UnitScores | dict[str, float]] = {}
    skipped: list[Result] = []
    with gate.paused(drain_timeout_s, should_stop):
        try:
            pin(engine, snapshot, version, reload=True)
            for unit in units:
                try:
                    scored[unit] = _score(engine, cache, unit, snapshot)
                except (NoChatTemplate, RequestRejected, SamplesAborted) as e:  # this unit's own fault (a
                    # prompt over the context, no chat template): its skip, as a worker writes it; no restart
                    skipped.append(skip_result(unit, e.reason, str(e), snapshot=snapshot))
            samples = [v for s in scored.values() if isinstance(s, UnitScores) for v in s.weight_versions]
            check_pinned(engine, version, samples)
        except PinViolation as e:
            return _write_all(run, [skip_result(u, "pin_violation", str(e), snapshot=snapshot) for u in units])
        except EngineError as e:
            return _write_all(run, [skip_result(u, "unhealthy", str(e), snapshot=snapshot) for u in units])
    elapsed = time.perf_counter() - t0
    read_backs: list[str | None] = [version, version]  # pinned before and checked after, by check_pinned
    return _write_all(run, [_ok(u, s, snapshot, elapsed, read_backs) for u, s in scored.items()] + skipped)


def _score(engine: Engine, cache: DatasetCache, unit: WorkUnit, snapshot: str) -> UnitScores | dict[str, float]:
    """A JSONL unit's scores, or an lm-eval task's metrics (:mod:`jobs.eval.harness`)."""
    spec = cache.manifest.harness_entry(unit.dataset)
    if spec is None:
        return score_unit(engine, cache, unit, snapshot)
    from jobs.eval.harness import run_task

    return run_task(engine, cache.run, spec, spec.tasks[unit.shard], snapshot)


def _ok(
    unit: WorkUnit, scores: UnitScores | dict[str, float], snapshot: str, elapsed: float, read_backs: list[str | None]
) -> Result:
    if isinstance(scores, dict):  # an lm-eval task: its metrics, pinned by the read-backs around the point
        return harness_result(unit, scores, read_backs, snapshot=snapshot, timings={"point_s": elapsed},
                              worker={**producer_identity(), "posture": "shared"})
    return ok_result(
        unit,
        scores.scores,
        scores.weight_versions,
        scores.answers,
        grader_timeouts=scores.grader_timeouts,
        snapshot=snapshot,
        timings={"generate_s": scores.generate_s, "point_s": elapsed},
        worker={**producer_identity(), "posture": "shared"},
    )


def _write_all(run: RunDir, results: list[Result]) -> list[Result]:
    for result in results:
        write_result(run.results, result)
    return results
