"""The shared-engine posture: evaluate on the trainer's own engine without aborting anything (:class:`ProducerGate`).

On a server other processes also send rollouts to (a vLLM rollout server: :class:`~ckpteval.jobs.eval.engines.base.PausesRequests`)
the weight swap is also gated server-side (:func:`server_paused`): pause (``keep``), reload, stamp, read back,
checksum, resume, then generate. Limits: a producer that calls the engine without ``gate.submission()`` is not
gated in-process; requests the server froze go on during the eval, on the snapshot's weights; the gate is not
reentrant (``RuntimeError`` instead of a deadlock). See docs/USER_GUIDE.md "Postures", "vLLM-based trainers".
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ckpteval.coord.results.files import Result, skip_result, write_result
from ckpteval.coord.run.identity import run_key, weight_version
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.snapshot import producer_identity
from ckpteval.coord.work.units import WorkUnit, units_for_step
from ckpteval.jobs.eval.engines.base import Engine, EngineError, PausesRequests, engine_identity
from ckpteval.jobs.eval.kinds.evaluate import Evaluation, evaluate_pinned, unit_result
from ckpteval.jobs.eval.kinds.generate.prompts import NoChatTemplate
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
from ckpteval.jobs.eval.proof.attest import AttestFailed, attest_dir
from ckpteval.jobs.eval.proof.pinning import PinViolation, WorkerSkip, pin
from ckpteval.jobs.eval.proof.trust import check_run_code

STOP_SLICE_S = 0.1  # how often a paused() drain looks at its stop flag


class StopRequested(TimeoutError):
    """A stop signal ended the wait for in-flight producer submissions."""


class ProducerGate:
    """Blocks new producer submissions while an eval holds the engine; see the module docstring."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._paused_by: int | None = None  # thread id holding paused()
        self._in_flight = 0
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
    first-writer-wins (:func:`ckpteval.coord.results.files.write_result`), so re-running a step is harmless.
    """
    manifest = run.manifest() if cache is None else cache.manifest
    cache = cache or DatasetCache(run, manifest)
    units = units_for_step(manifest, step)
    version = weight_version(run_key(manifest), step)
    snapshot = str(snapshot_dir)
    worker = {**producer_identity(), "posture": "shared"}
    t0 = time.perf_counter()
    done: list[tuple[WorkUnit, Evaluation | Result]] = []
    with gate.paused(drain_timeout_s, should_stop):
        try:
            with server_paused(engine):
                pin(engine, snapshot, version, reload=True)
                attestation = attest_dir(engine, Path(snapshot_dir), run)
            identity = engine_identity(engine)
            for unit in units:
                try:
                    done.append((unit, evaluate_pinned(engine, cache, unit, snapshot, version)))
                except UNIT_SKIPS as e:  # this unit only: a skip with its own reason
                    done.append((unit, _unit_skip(unit, e, snapshot)))
        except (PinViolation, AttestFailed) as e:  # every unit of the point: one reason
            return _write_all(run, [skip_result(u, e.reason, str(e), snapshot=snapshot) for u in units])
        except EngineError as e:
            return _write_all(run, [skip_result(u, "unhealthy", str(e), snapshot=snapshot) for u in units])
    elapsed = time.perf_counter() - t0
    return _write_all(run, [
        out if isinstance(out, Result) else unit_result(
            u, out, snapshot=snapshot, worker=worker, attest=attestation.to_json(),
            engine={} if identity is None else identity.to_json(),
            timings={"generate_s": out.generate_s, "attest_s": attestation.seconds, "point_s": elapsed})
        for u, out in done
    ])


@contextlib.contextmanager
def server_paused(engine: Engine) -> Iterator[None]:
    """Freeze the requests a shared server holds while the block swaps its weights (nothing aborted), then let
    them go on, also when the block fails; nothing for an engine without a server-side pause."""
    if not isinstance(engine, PausesRequests):
        yield
        return
    engine.pause_requests()
    try:
        yield
    finally:
        engine.resume_requests()


@dataclass
class SharedEval:
    """The trainer's own engine and the gate its producers go through (shared posture); see the module docstring."""

    engine: Engine
    gate: ProducerGate
    drain_timeout_s: float | None = 600.0
    trust_run_code: bool = False  # import run.json's module:function scorers even from a run others can write

    def attach(self, run: RunDir, manifest: RunManifest) -> DatasetCache:
        """The run's datasets, once run.json's scorer code passed the trust check (``ValueError`` if not)."""
        check_run_code(run, manifest, trusted=self.trust_run_code)
        return DatasetCache(run, manifest)

    def evaluate(self, run: RunDir, step: int, snapshot_dir: Path, cache: DatasetCache | None,
                 should_stop: Callable[[], bool]) -> float | None:
        """:func:`shared_eval` of ``step``; its seconds, or None when a stop signal ended the producers' drain
        (nothing written). ``TimeoutError``: in-flight producer requests outlived ``drain_timeout_s``."""
        t0 = time.perf_counter()
        try:
            shared_eval(self.engine, self.gate, run, step, snapshot_dir, cache=cache,
                        drain_timeout_s=self.drain_timeout_s, should_stop=should_stop)
        except StopRequested:
            return None
        return time.perf_counter() - t0


# What ends one unit of a shared point, not the point: no chat template, a scorer's or a library task's own
# failure or its infrastructure (judge, sandbox), a request the engine refused. A pin violation or a dead
# engine ends every unit of the point.
UNIT_SKIPS = (NoChatTemplate, WorkerSkip, EngineError)


def _unit_skip(unit: WorkUnit, error: Exception, snapshot: str) -> Result:
    if isinstance(error, PinViolation) or (isinstance(error, EngineError) and error.restart_helps):
        raise error
    return skip_result(unit, error.reason, str(error), snapshot=snapshot,  # type: ignore[attr-defined]
                       blame=getattr(error, "blame", None))


def _write_all(run: RunDir, results: list[Result]) -> list[Result]:
    for result in results:
        write_result(run.results, result)
    return results
