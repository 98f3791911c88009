"""Results (facts) and points (views).

A *result* is one JSON file per work unit, ``results/<unit>.json``, published first-writer-wins: the
file is written and fsync'd under a temp name, then hard-linked to the final name, which fails if a
result already exists. So readers see at most one result per unit, never a torn one, and a rare
double evaluation (a lease is not a fence) lands in ``results/duplicates/`` for audit instead.
A result holds per-sample scores and the weight versions that produced them, timings, the worker's
identity, the lease token and attempt — or a skip record with a reason. A unit of an ``lm_eval`` entry
holds the task's ``metrics`` instead of per-sample scores, with the version read back before and after.

A *point* (one step) is derived from its units' results by any reader — trainer, status, plot,
backfill. It is complete when every unit of the step has a result. Sharding does not change a
point: scores are pooled per sample, not averaged per shard.

Limits: :class:`ResultIndex` caches what it has read; a result file is immutable once published, so
the cache is never stale, but a result deleted by hand stays in the cache until a new index is built.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coord import PROTOCOL_VERSION
from coord.atomic import TMP_PREFIX, dumps, publish_exclusive, read_json_object, write_json_atomic
from coord.manifest import RunManifest
from coord.snapshot import producer_identity
from coord.units import WorkUnit, units_for_step

SKIP_REASONS = ("busy", "export_failed", "ckpt_missing", "ckpt_corrupt", "unhealthy", "pin_violation", "crashed")


@dataclass(frozen=True)
class Result:
    unit: WorkUnit
    status: str  # "ok" | "skipped"
    scores: tuple[float, ...] = ()
    weight_versions: tuple[str | None, ...] = ()
    skip_reason: str | None = None
    message: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    worker: dict[str, Any] = field(default_factory=dict)
    lease_token: str | None = None
    attempt: int = 0
    snapshot: str | None = None
    written_at: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)  # harness units: the task's metrics

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict[str, Any]:
        return {
            "protocol": PROTOCOL_VERSION,
            "unit": self.unit.to_json(),
            "status": self.status,
            "n": len(self.scores),
            "score_sum": sum(self.scores),
            "scores": list(self.scores),
            "weight_versions": list(self.weight_versions),
            "skip_reason": self.skip_reason,
            "message": self.message,
            "timings": self.timings,
            "worker": self.worker,
            "lease_token": self.lease_token,
            "attempt": self.attempt,
            "snapshot": self.snapshot,
            "written_at": self.written_at,
            **({"metrics": self.metrics} if self.metrics else {}),
        }


def ok_result(unit: WorkUnit, scores: list[float], versions: list[str | None], **kw: Any) -> Result:
    if len(scores) != len(versions):
        raise ValueError(f"unit {unit.id}: {len(scores)} scores but {len(versions)} weight versions")
    return Result(unit, "ok", tuple(scores), tuple(versions), **kw)


def harness_result(unit: WorkUnit, metrics: dict[str, float], versions: list[str | None], **kw: Any) -> Result:
    """An lm-eval task's unit: its metrics, and the engine's version read back before and after it.

    lm-eval's adapters do not report a version per sample, so ``weight_versions`` holds the unit's
    read-backs (no ``scores``); the pin check around the unit is what makes them the unit's version.
    """
    if not metrics or not versions:
        raise ValueError(f"unit {unit.id}: a harness result needs metrics and the versions read back")
    return Result(unit, "ok", (), tuple(versions), metrics=dict(metrics), **kw)


def _parse_metrics(obj: Any, source: Path) -> dict[str, float]:
    """The optional ``metrics`` object of a result: metric name -> number."""
    raw = obj.get("metrics") or {}
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) for k, v in raw.items()
    ):
        raise ValueError(f"{source}: field metrics must be an object of metric name -> number")
    return {k: float(v) for k, v in raw.items()}


def skip_result(unit: WorkUnit, reason: str, message: str = "", **kw: Any) -> Result:
    if not reason or not reason.replace("_", "").isalnum():
        raise ValueError(f"skip reason {reason!r} must be a non-empty identifier (it becomes a metric name)")
    return Result(unit, "skipped", skip_reason=reason, message=message, **kw)


def parse_result(obj: Any, source: Path) -> Result:
    """Validate a decoded result; ValueError names the file and field."""
    if not isinstance(obj, dict):
        raise ValueError(f"{source}: result must be a JSON object")
    try:
        u = obj["unit"]
        unit = WorkUnit(int(u["step"]), str(u["dataset"]), int(u["shard"]))
        status = obj["status"]
        scores = tuple(float(s) for s in obj.get("scores", ()))
        versions = tuple(None if v is None else str(v) for v in obj.get("weight_versions", ()))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{source}: malformed result ({type(e).__name__}: {e})") from None
    if status not in {"ok", "skipped"}:
        raise ValueError(f"{source}: field status must be 'ok' or 'skipped', got {status!r}")
    if status == "skipped" and not obj.get("skip_reason"):
        raise ValueError(f"{source}: a skipped result needs a skip_reason")
    metrics = _parse_metrics(obj, source)
    if len(scores) != len(versions) and not (metrics and not scores):  # harness: versions read back per unit
        raise ValueError(f"{source}: {len(scores)} scores but {len(versions)} weight_versions")
    return Result(
        unit=unit,
        status=status,
        scores=scores,
        weight_versions=versions,
        skip_reason=obj.get("skip_reason"),
        message=str(obj.get("message", "")),
        timings=dict(obj.get("timings") or {}),
        worker=dict(obj.get("worker") or {}),
        lease_token=obj.get("lease_token"),
        attempt=int(obj.get("attempt", 0)),
        snapshot=obj.get("snapshot"),
        written_at=float(obj.get("written_at", 0.0)),
        metrics=metrics,
    )


def write_result(results_dir: Path, result: Result) -> bool:
    """Publish a unit's result; True if it is *the* result, False if one existed (kept as duplicate)."""
    results_dir = Path(results_dir)
    stamped = Result(**{**result.__dict__, "written_at": result.written_at or time.time()})
    if not stamped.worker:
        stamped = Result(**{**stamped.__dict__, "worker": producer_identity()})
    data = dumps(stamped.to_json())
    if publish_exclusive(results_dir / result.unit.result_name, data):
        return True
    dup_dir = results_dir / "duplicates"
    dup_dir.mkdir(exist_ok=True)
    write_json_atomic(dup_dir / f"{result.unit.id}.{os.getpid()}.{time.time_ns()}.json", stamped.to_json())
    return False


class ResultIndex:
    """Reads ``results/`` incrementally: one listing per refresh, each result file read once.

    Malformed result files are not trusted and not fatal to readers: they are collected in
    :attr:`errors` (path → message) so status can show them, and the unit counts as unfinished.
    """

    def __init__(self, results_dir: Path) -> None:
        self.results_dir = Path(results_dir)
        self._by_unit: dict[WorkUnit, Result] = {}
        self._seen: set[str] = set()
        self.errors: dict[str, str] = {}

    def refresh(self) -> dict[WorkUnit, Result]:
        try:
            names = [n for n in os.listdir(self.results_dir) if n.endswith(".json")]
        except FileNotFoundError:
            names = []
        for name in names:
            if name in self._seen or name.startswith((TMP_PREFIX, ".")):
                continue
            path = self.results_dir / name
            try:
                result = parse_result(read_json_object(path), path)
            except (ValueError, FileNotFoundError) as e:
                self.errors[name] = str(e)
                continue
            self._seen.add(name)
            self.errors.pop(name, None)
            self._by_unit[result.unit] = result
        return self._by_unit

    def get(self, unit: WorkUnit) -> Result | None:
        return self._by_unit.get(unit)

    def for_step(self, step: int) -> dict[WorkUnit, Result]:
        return {u: r for u, r in self._by_unit.items() if u.step == step}

    def steps(self) -> set[int]:
        return {u.step for u in self._by_unit}


# -- points ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DatasetScore:
    score: float
    n: int
    weight_version_mean: float
    mixed_version_ratio: float


@dataclass(frozen=True)
class Point:
    step: int
    complete: bool
    datasets: dict[str, DatasetScore]
    skips: dict[str, int]  # reason -> number of units skipped for it
    units_total: int
    units_done: int
    completed_at: float | None
    metrics: dict[str, float] = field(default_factory=dict)  # lm-eval tasks: "<task>/<metric>" -> value

    @property
    def skipped(self) -> bool:
        return bool(self.skips)


def _version_stats(step: int, versions: list[str | None]) -> tuple[float, float]:
    numeric = []
    for v in versions:
        try:
            numeric.append(float(v))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            pass
    mean = sum(numeric) / len(numeric) if numeric else math.nan
    mixed = sum(v != str(step) for v in versions) / len(versions) if versions else 0.0
    return mean, mixed


def derive_point(manifest: RunManifest, step: int, results: dict[WorkUnit, Result]) -> Point:
    """The point of ``step`` from whatever results exist (possibly incomplete)."""
    units = units_for_step(manifest, step)
    done = [results[u] for u in units if u in results]
    skips: dict[str, int] = {}
    for r in done:
        if not r.ok:
            skips[r.skip_reason or "unknown"] = skips.get(r.skip_reason or "unknown", 0) + 1
    datasets = {}
    for ds in manifest.eval.datasets:
        mine = [results.get(WorkUnit(step, ds.name, s)) for s in range(ds.n_shards)]
        if any(r is None or not r.ok for r in mine):
            continue
        scores = [s for r in mine if r for s in r.scores]
        versions = [v for r in mine if r for v in r.weight_versions]
        mean_v, mixed = _version_stats(step, versions)
        score = sum(scores) / len(scores) if scores else math.nan
        datasets[ds.name] = DatasetScore(score, len(scores), mean_v, mixed)
    complete = len(done) == len(units)
    return Point(
        metrics=harness_point_metrics(manifest, step, results),
        step=step,
        complete=complete,
        datasets=datasets,
        skips=skips,
        units_total=len(units),
        units_done=len(done),
        completed_at=max((r.written_at for r in done), default=None) if complete else None,
    )


def harness_point_metrics(manifest: RunManifest, step: int, results: dict[WorkUnit, Result]) -> dict[str, float]:
    """``"<task>/<metric>"`` for every lm-eval task of ``step`` with an ok result, plus its pin evidence."""
    out: dict[str, float] = {}
    for spec in manifest.eval.harness:
        for i, task in enumerate(spec.tasks):
            r = results.get(WorkUnit(step, spec.name, i))
            if r is None or not r.ok:
                continue
            out.update({f"{task}/{name}": value for name, value in r.metrics.items()})
            mean_v, mixed = _version_stats(step, list(r.weight_versions))
            out[f"{task}/weight_version/mean"] = mean_v
            out[f"{task}/weight_version/mixed_version_ratio"] = mixed
    return out


def point_metrics(point: Point) -> dict[str, float]:
    """The metric names of DESIGN.md for one point (``eval/lag_steps`` is added by the ingester)."""
    metrics: dict[str, float] = {"eval/step": point.step}
    for name, ds in point.datasets.items():
        metrics[f"eval/{name}"] = ds.score
        metrics[f"eval/{name}/weight_version/mean"] = ds.weight_version_mean
        metrics[f"eval/{name}/weight_version/mixed_version_ratio"] = ds.mixed_version_ratio
    metrics.update({f"eval/{name}": value for name, value in point.metrics.items()})
    for reason, n in point.skips.items():
        metrics[f"eval/skipped_{reason}"] = n
    return metrics


def write_point_skip(results_dir: Path, manifest: RunManifest, step: int, reason: str, message: str = "") -> None:
    """Record a whole point as skipped (trainer-side reasons: busy, export_failed): one skip per unit."""
    for unit in units_for_step(manifest, step):
        write_result(results_dir, skip_result(unit, reason, message))
