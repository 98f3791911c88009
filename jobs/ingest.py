"""Ingestion: turn a step's results into one logged point, exactly once — the one path for it.

:func:`ingest_point` is what every ingester calls: derive the point (:func:`ckpteval.coord.results.files.derive_point`),
its metrics (:func:`ckpteval.coord.results.files.point_metrics`), add ``eval/lag_steps``, ``eval/cost/fraction_of_training``
(when the ledger knows the trainer's GPU-seconds: :mod:`ckpteval.jobs.trainer.cost`) and the caller's extras, log
it (:class:`ckpteval.jobs.metrics.MetricsSink`, which drops an ``eval/step`` it already has; the scorers' identities
go into the wandb config as ``eval/scorer/<ds>``) and only then append ``ingested`` to the caller's ledger. The two callers differ only in what lag means and which
ledger and sink they own.

In the fleet postures the trainer's :class:`~ckpteval.jobs.trainer.dispatcher.EvalDispatcher` ingests points. In the
service posture the trainer knows nothing of eval, so the service does it: after each poll,
:class:`ServiceIngester` derives the points of every step that has results and logs each complete
one once — to ``RUN/service_metrics.jsonl`` and, with ``--wandb``, into the *training* run's wandb
run (``eval/*`` against ``eval/step``, so late points land at their checkpoint's step).

Exactly once: a point is logged, then recorded in ``RUN/service_ledger.jsonl`` (ckpteval.coord.run.ledger); a
restarted service replays the ledger, and the sink drops an ``eval/step`` already in its file, so a
crash between the two writes does not log twice. ``eval/lag_steps`` here is the newest
checkpoint the service has discovered (or with any result) minus the point's step: how far the
service trails the trainer's checkpoints.

Limits: one ingesting service per run (run other workers without ``--wandb``); the wandb copy is
at-least-once (see ckpteval.jobs.metrics).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from ckpteval.coord.results.contamination import clean_metrics, dirty_rows, read_matches
from ckpteval.coord.results.files import Result, ResultIndex
from ckpteval.coord.results.points import Point, derive_point, point_metrics
from ckpteval.coord.results.summary import write_step_summary
from ckpteval.coord.results.training_cost import fraction_of_training
from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.saves import lost_steps
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.metrics import MetricsSink

DRAIN_TIMEOUT = "drain_timeout"


def ingest_point(
    manifest: RunManifest,
    step: int,
    results: Mapping[WorkUnit, Result],
    *,
    sink: MetricsSink,
    ledger: Ledger,
    lag_steps: int,
    extra: Mapping[str, float] | None = None,
    give_up: bool = False,
    index: ResultIndex | None = None,
) -> Point | None:
    """Derive the point of ``step`` -> metrics -> lag -> log -> ``ingested``; the point, or None if not done.

    A point with units still open is not ingested (None) unless ``give_up`` (the trainer's drain
    timeout): then what exists is logged with ``eval/skipped_drain_timeout`` = units without a result,
    and the ledger records ``outcome: drain_timeout``. ``extra`` metrics (export, backpressure and
    shared-eval times) are logged with the point. ``index``: the index ``results`` came from; given, the
    step's summary for status and plot is written from it once the point is logged
    (:func:`ckpteval.coord.results.summary.write_step_summary`: only if that read of the step is whole and current).
    """
    point = derive_point(manifest, step, dict(results))
    if not point.complete and not give_up:
        return None
    metrics = point_metrics(point)
    if give_up:
        metrics["eval/skipped_drain_timeout"] = point.units_total - point.units_done
    metrics["eval/lag_steps"] = lag_steps
    metrics.update(clean_series(manifest, point, results, sink))
    point_gpu_s = point.cost.get("gpu_s", 0.0)
    if (fraction := fraction_of_training(ledger.state, step, point_gpu_s)) is not None:
        metrics["eval/cost/fraction_of_training"] = fraction
    metrics.update(extra or {})
    if sink.log_eval(metrics):
        sink.record_config(scorer_config(step, results))
    ledger.append(
        "ingested",
        step,
        outcome=DRAIN_TIMEOUT if give_up else "complete",
        lag_steps=lag_steps,
        units_done=point.units_done,
        units_total=point.units_total,
        eval_gpu_s=point_gpu_s,
        time=time.time(),  # wall clock of ingestion: latency = this - result written_at (bench)
    )
    if index is not None:
        write_step_summary(index, manifest, step)
    return point


def clean_series(manifest: RunManifest, point: Point, results: Mapping[WorkUnit, Result],
                 sink: MetricsSink) -> dict[str, float]:
    """``eval/<ds>/clean`` of each dataset the contamination gate checked (its record in the run dir, beside
    the sink's metrics file; none: no series). A malformed record logs none (``status`` names it)."""
    try:
        dirty = dirty_rows(read_matches(sink.path.parent))
    except ValueError:
        return {}
    return clean_metrics(manifest, point, results, dirty) if dirty else {}


def scorer_config(step: int, results: Mapping[WorkUnit, Result]) -> dict[str, Any]:
    """``{"eval/scorer/<ds>": identity}`` of the step's units that recorded one (the wandb config's record of
    what scored each dataset: a judge's model id as the judge reported it, its template hash, sampling)."""
    out: dict[str, Any] = {}
    for unit, result in sorted(results.items()):
        if unit.step == step and result.scorer:
            out.setdefault(f"eval/scorer/{unit.dataset}", result.scorer)
    return out


class ServiceIngester:
    def __init__(self, run: RunDir, sink: MetricsSink, newest_step: Callable[[], int] | None = None) -> None:
        self.run = run
        self.newest_step = newest_step
        self.sink = sink
        self.manifest = run.manifest()
        self.ledger = Ledger(run.service_ledger_path)
        self.index = ResultIndex(run.results, self.manifest)

    def poll(self) -> list[int]:
        """Log every newly complete point; returns their steps."""
        results = self.index.refresh(skip_steps=self.ledger.state.ingested)  # logged points: not listed again
        steps = self.index.steps()
        newest = max(steps | {self.newest_step() if self.newest_step else 0})
        logged = []
        lost = len(lost_steps(self.run.lost))  # saves the watcher saw but lost to rotation: never silent
        extra = {"eval/ckpt_lost_before_admission": float(lost)} if lost else None
        for step in sorted(steps - self.ledger.state.ingested):
            if ingest_point(self.manifest, step, results, sink=self.sink, ledger=self.ledger, lag_steps=newest - step,
                            extra=extra, index=self.index):
                logged.append(step)
        return logged
