"""What a trainer does when one of its points retires: the stop condition, the keep-best ranking, staging GC.

Owns three decisions of :class:`~ckpteval.jobs.trainer.dispatcher.EvalDispatcher` about a point ingested
*complete*, taken in this order by :meth:`Retirement.retire`:

- ``--eval-stop-when``: the first such point whose metrics (:func:`ckpteval.coord.points.point_metrics`) meet
  the condition is recorded in the ledger (``stop_requested``: the condition, the trainer's step, the time)
  and is :attr:`Retirement.stop_requested` from then on, across restarts (read back from the ledger). The
  training loop decides when to end.
- the point is recorded ``retired`` in the ledger;
- in staging mode the staging GC runs (:class:`ckpteval.coord.gc.StagingGC`): the ``keep_snapshots`` newest
  retired snapshots kept, plus those of the best ``keep_best`` points by ``best_metric`` (default: the first
  dataset's), each step ranked once. Reused checkpoints are never deleted (reuse mode has no GC).

Limits: a point given up at the drain timeout never retires, so GC leaves its snapshot for a backfill.
"""

from __future__ import annotations

import time
from pathlib import Path

from ckpteval.coord.conditions import Condition, parse_condition, point_value, top_steps
from ckpteval.coord.gc import StagingGC
from ckpteval.coord.ledger import Ledger
from ckpteval.coord.manifest import RunManifest
from ckpteval.coord.points import Point, point_metrics
from ckpteval.coord.results import ResultIndex
from ckpteval.coord.rundir import RunDir
from ckpteval.jobs.trainer.config import DispatchConfig


class Retirement:
    """See the module docstring; ``config`` is the dispatcher's, already checked for this run."""

    def __init__(self, config: DispatchConfig, run: RunDir, manifest: RunManifest, root: Path, key: str,
                 ledger: Ledger, index: ResultIndex) -> None:
        self.config, self.manifest, self.ledger, self.index = config, manifest, ledger, index
        self.gc: StagingGC | None = None
        if config.mode == "staging":
            self.gc = StagingGC(root, run.leases, manifest.lease.duration_s, keep=config.keep_snapshots, run=key)
        self.stop_when: Condition | None = (
            None if config.stop_when is None else parse_condition(config.stop_when, "--eval-stop-when"))
        self.stop_requested: int | None = min(ledger.state.stop_requested, default=None)  # that point's step
        self._ranked: dict[int, float] = {}  # retired step -> its best-metric value (--eval-keep-best)

    def retire(self, step: int, point: Point, trainer_step: int) -> None:
        """``point`` (of ``step``) was ingested complete while the trainer is at ``trainer_step``."""
        if self.stop_when is not None and self.stop_requested is None and self.stop_when.holds(point_metrics(point)):
            self.stop_requested = step
            self.ledger.append("stop_requested", step, condition=self.stop_when.text, at_step=trainer_step,
                               time=time.time())
        self.ledger.append("retired", step)
        if self.gc is not None:
            self.gc.collect(self.ledger.state.retired, self._best_steps())

    def _best_steps(self) -> set[int]:
        """``--eval-keep-best K``: the retired steps whose points rank in the best K by the best metric."""
        if self.config.keep_best < 1:
            return set()
        metric = self.config.best_metric or f"eval/{self.manifest.eval.datasets[0].name}"
        results = self.index.refresh(only_steps=self.ledger.state.retired - set(self._ranked))
        for step in self.ledger.state.retired - set(self._ranked):
            self._ranked[step] = point_value(self.manifest, results, step, metric)
        return top_steps(self._ranked, self.config.keep_best)
