"""What happens between claim and result: verify, pin, score, check the pin again.

An :class:`Evaluator` turns one claimed unit into scores or raises a skip; :func:`evaluate_unit` maps every
expected failure to a skip reason (``ckpt_missing``/``ckpt_corrupt``/``pin_violation``/``unhealthy``/
``crashed``/a backend's own). Pinning lives in :meth:`EngineEvaluator._pin`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from coord.discovery import SnapshotRef
from coord.manifest import RunManifest
from coord.results import Result, ok_result, skip_result
from coord.snapshot import (
    SnapshotCorrupt,
    SnapshotError,
    verify_snapshot,
)
from coord.units import WorkUnit, shard_range
from jobs.eval.engines.base import Engine, EngineError
from jobs.eval.engines.fn import CheckpointEvalFn, EvalSkip, build_input, parse_output
from jobs.eval.options import WorkerOptions
from jobs.eval.scoring import DatasetCache, score_unit

# What scoring may raise and still be a ``crashed`` unit rather than a dead worker: engine/runtime, bad
# values, I/O, and the lookup/type/arithmetic errors a custom scorer or fn backend raises on bad input.
# Anything else is a bug in the worker itself: it stops (exit 1) with the unit's lease released.
SCORING_ERRORS = (RuntimeError, ValueError, OSError, LookupError, TypeError, ArithmeticError)


# -- skips raised while evaluating --------------------------------------------------------------------
class WorkerSkip(RuntimeError):
    """A unit outcome that is a skip with :attr:`reason`."""

    reason = "crashed"


class PinViolation(WorkerSkip):
    reason = "pin_violation"


class Unhealthy(WorkerSkip):
    reason = "unhealthy"


def call_with_timeout(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Run ``fn`` in a helper thread; :class:`EngineError` if it has not returned after ``timeout_s``.

    The helper thread cannot be killed: a wedged call keeps running in the background (and the engine
    typically stays unusable, which the health checks then report).
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 — carried to the calling thread and re-raised there
            box["error"] = e

    thread = threading.Thread(target=target, name=f"ckpteval-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise EngineError(f"{what} did not finish within {timeout_s:g}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


# -- evaluators: the part between claim and result ------------------------------------------------------
@dataclass
class Evaluation:
    scores: list[float]
    weight_versions: list[str | None]
    message: str = ""


class Evaluator(Protocol):
    def evaluate(self, unit: WorkUnit, ref: SnapshotRef, timings: dict[str, float]) -> Evaluation: ...

    def close(self) -> None: ...


class EngineEvaluator:
    """Engines (:class:`~jobs.eval.engines.base.Engine`): probe, heal, pin, score, check the pin again."""

    def __init__(
        self, engine: Engine, cache: DatasetCache, pin_timeout_s: float, load_timeout_s: float
    ) -> None:
        self.engine, self.cache = engine, cache
        self.pin_timeout_s, self.load_timeout_s = pin_timeout_s, load_timeout_s
        self._loaded_once = False

    def evaluate(self, unit: WorkUnit, ref: SnapshotRef, timings: dict[str, float]) -> Evaluation:
        want = str(unit.step)
        t0 = time.perf_counter()
        self._prepare(ref, want)
        timings["load_s"] = time.perf_counter() - t0
        try:
            scored = score_unit(self.engine, self.cache, unit)
        except EngineError:
            self._heal(ref, want)  # died mid-unit: bring it back, then one more try
            scored = score_unit(self.engine, self.cache, unit)
        timings["generate_s"] = scored.generate_s
        after = self.engine.weight_version()
        wrong = sorted({str(v) for v in scored.weight_versions if v != want})
        if wrong or after != want:
            raise PinViolation(
                f"want version {want}; samples carried {wrong or 'it'}, engine reports {after!r} after"
            )
        return Evaluation(scored.scores, scored.weight_versions)

    def _prepare(self, ref: SnapshotRef, want: str) -> None:
        """Probe (when something is loaded), pin, and probe again after a fresh load; heal on failure."""
        if self._loaded_once and not self.engine.healthy():
            self._heal(ref, want)
            return
        try:
            loaded = self._pin(ref, want)
        except EngineError:
            self._heal(ref, want)
            return
        if loaded and not self.engine.healthy():
            self._heal(ref, want)

    def _heal(self, ref: SnapshotRef, want: str) -> None:
        try:
            call_with_timeout(self.engine.restart, self.load_timeout_s, "engine restart")
            self._pin(ref, want)
        except EngineError as e:
            raise Unhealthy(f"engine dead after restart: {e}") from e
        if not self.engine.healthy():
            raise Unhealthy("engine failed its probe after restart and reload")

    def _pin(self, ref: SnapshotRef, want: str) -> bool:
        """Load ``ref`` as version ``want`` unless loaded; read the version back until it matches.

        Returns whether a load happened.
        """
        loaded = self.engine.weight_version() != want
        if loaded:
            try:
                call_with_timeout(lambda: self.engine.load(str(ref.path), want), self.load_timeout_s, "weight load")
            except EngineError as e:
                if not _is_version_mismatch(e):
                    raise
                # loaded, but the engine reads back another version: the read-back below decides
            self._loaded_once = True
        deadline, delay = time.monotonic() + self.pin_timeout_s, 0.02
        while (got := self.engine.weight_version()) != want:
            if time.monotonic() >= deadline:
                raise PinViolation(
                    f"engine reports version {got!r} after loading step {want} (waited {self.pin_timeout_s:g}s)"
                )
            time.sleep(delay)
            delay = min(2 * delay, 1.0)
        return loaded

    def close(self) -> None:
        self.engine.close()


class FnEvaluator:
    """A :class:`~jobs.eval.engines.fn.CheckpointEvalFn`: hands it the unit, checks what comes back."""

    def __init__(self, backend: CheckpointEvalFn, cache: DatasetCache) -> None:
        self.backend, self.cache = backend, cache

    def evaluate(self, unit: WorkUnit, ref: SnapshotRef, timings: dict[str, float]) -> Evaluation:
        manifest = self.cache.manifest
        spec = manifest.dataset(unit.dataset)
        rows = [self.cache.rows(spec)[i] for i in shard_range(manifest, unit)]
        want = str(unit.step)
        t0 = time.perf_counter()
        output = self.backend.evaluate_checkpoint(str(ref.path), build_input(manifest, spec, unit, rows))
        timings["generate_s"] = time.perf_counter() - t0
        parsed = parse_output(output, len(rows) * spec.n_samples, want)
        wrong = sorted({str(v) for v in parsed.weight_versions if v != want})
        if wrong:
            raise PinViolation(f"want version {want}; backend reported {wrong}")
        return Evaluation(parsed.scores, parsed.weight_versions, parsed.message)

    def close(self) -> None:
        self.backend.dispose()


def _is_version_mismatch(error: EngineError) -> bool:
    """An HTTP engine's load that succeeded but read back another version (not a dead engine)."""
    if type(error).__name__ != "WeightVersionMismatch":
        return False
    from jobs.eval.engines.http import WeightVersionMismatch

    return isinstance(error, WeightVersionMismatch)


def evaluate_unit(evaluator: Evaluator, unit: WorkUnit, ref: SnapshotRef, verify: str) -> Result:
    """Verify the snapshot and evaluate ``unit``; every expected failure becomes a skip result."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        marker = verify_snapshot(ref.path, verify, marker=ref.marker if ref.foreign else None)
        if marker.step != unit.step:
            raise SnapshotCorrupt(ref.path, f"marker says step {marker.step}, expected {unit.step}")
        timings["verify_s"] = time.perf_counter() - t0
        ev = evaluator.evaluate(unit, ref, timings)
        return ok_result(unit, ev.scores, ev.weight_versions, message=ev.message, timings=timings)
    except (SnapshotError, WorkerSkip, EvalSkip) as e:
        reason, message = e.reason, str(e)
    except EngineError as e:
        reason, message = "unhealthy", str(e)
    except SCORING_ERRORS as e:
        reason, message = "crashed", f"{type(e).__name__}: {e}"
    if reason in {"unhealthy", "crashed"}:
        # The snapshot may have gone away (or been damaged) after it was verified: then the load or the
        # backend failed because of the snapshot, and blaming the engine would restart a healthy one.
        try:
            verify_snapshot(ref.path, "fast", marker=ref.marker if ref.foreign else None)
        except SnapshotError as gone:
            reason, message = gone.reason, f"{gone} (after verification; the evaluation failed: {message})"
    return skip_result(unit, reason, message, timings=timings)


def build_evaluator(opts: WorkerOptions, manifest: RunManifest, cache: DatasetCache) -> Evaluator:
    from jobs.eval.engines.factory import EnginePool, engine_settings, make_engine, resolve_specs, spec_kind

    specs = resolve_specs(opts.engines, opts.device)  # --engine auto: decided here, on the node
    if list(specs) != list(opts.engines):
        print(f"ckpteval worker: --engine auto -> {', '.join(specs)} (device {opts.device})", file=sys.stderr)
    kinds = [spec_kind(s) for s in specs]
    if kinds == ["fn"]:
        backend = make_engine(specs[0], opts.device, engine_settings(manifest.eval.engine, "fn"))
        return FnEvaluator(backend, cache)  # type: ignore[arg-type]
    if manifest.eval.adapters:
        raise ValueError(
            f"run {manifest.run_id} evaluates adapters {list(manifest.eval.adapters)}; engines here would score the "
            "bare base weights — use an fn: backend that applies them (a run whose snapshots are LoRA adapters "
            "names its base in eval.base_model instead)"
        )
    base_model = manifest.eval.base_model
    if base_model is not None and not Path(base_model).is_dir():
        raise FileNotFoundError(f"run {manifest.run_id}: eval.base_model {base_model} is not a directory")
    engines = [
        make_engine(spec, opts.device, engine_settings(manifest.eval.engine, kind), base_model)
        for spec, kind in zip(specs, kinds, strict=True)
        for _ in range(opts.replicas)
    ]
    engine: Engine = engines[0] if len(engines) == 1 else EnginePool(engines)  # type: ignore[assignment,arg-type]
    return EngineEvaluator(engine, cache, opts.pin_timeout_s, opts.load_timeout_s)
