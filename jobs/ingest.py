"""Ingestion for the external-service posture: log each finished point exactly once.

In the fleet postures the trainer's :class:`~jobs.trainer.dispatcher.EvalDispatcher` ingests points. In the
service posture the trainer knows nothing of eval, so the service does it: after each poll,
:class:`ServiceIngester` derives the points of every step that has results and logs each complete
one once — to ``RUN/service_metrics.jsonl`` and, with ``--wandb``, into the *training* run's wandb
run (``eval/*`` against ``eval/step``, so late points land at their checkpoint's step).

Exactly once: a point is logged, then recorded in ``RUN/service_ledger.jsonl`` (coord.ledger); a
restarted service replays the ledger, and the sink drops an ``eval/step`` already in its file, so a
crash between the two writes does not log twice. ``eval/lag_steps`` here is the newest
checkpoint the service has discovered (or with any result) minus the point's step: how far the
service trails the trainer's checkpoints.

Limits: one ingesting service per run (run other workers without ``--wandb``); the wandb copy is
at-least-once (see jobs.metrics).
"""

from __future__ import annotations

from collections.abc import Callable

from coord.ledger import Ledger
from coord.results import ResultIndex, derive_point, point_metrics
from coord.rundir import RunDir
from jobs.metrics import MetricsSink


class ServiceIngester:
    def __init__(self, run: RunDir, sink: MetricsSink, newest_step: Callable[[], int] | None = None) -> None:
        self.run = run
        self.newest_step = newest_step
        self.sink = sink
        self.manifest = run.manifest()
        self.ledger = Ledger(run.service_ledger_path)
        self.index = ResultIndex(run.results)

    def poll(self) -> list[int]:
        """Log every newly complete point; returns their steps."""
        results = self.index.refresh()
        steps = self.index.steps()
        newest = max(steps | {self.newest_step() if self.newest_step else 0})
        logged = []
        for step in sorted(steps - self.ledger.state.ingested):
            point = derive_point(self.manifest, step, results)
            if not point.complete:
                continue
            metrics = point_metrics(point)
            metrics["eval/lag_steps"] = newest - step
            self.sink.log_eval(metrics)
            self.ledger.append("ingested", step, lag_steps=newest - step)
            logged.append(step)
        return logged
