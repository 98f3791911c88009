"""``EvalDispatcher``: the one object a training loop talks to about evaluation.

The loop calls :meth:`EvalDispatcher.dispatch_initial` once before its first optimizer step (the
initial weights become the point of step 0; skip it to start the curve at the first interval),
:meth:`EvalDispatcher.maybe_dispatch` after every optimizer step and :meth:`EvalDispatcher.close`
once at the end; that is all. Every ``eval_interval`` steps the dispatcher makes a snapshot of the
step available to the eval fleet and goes on; finished points are ingested later, on a later call,
and logged at their *dispatch* step. Step 0 is dispatched once per run: a resumed trainer calling
:meth:`dispatch_initial` again finds it in the ledger and does nothing.

Cadence: a dataset with ``every`` > 1 (run.json) is part only of the points at multiples of
``every``, which must be a multiple of ``eval_interval`` (checked at construction); a step at which
no dataset is due is not dispatched at all (the final step excepted).

Settings: one :class:`ckpteval.jobs.trainer.config.DispatchConfig`, taken whole (its ``waits`` and
``stop_when`` too) and checked for this run at construction — before training. Snapshot source:

- **staging**: the weights are exported into the staging root by :class:`AsyncExporter` (the loop
  blocks only for the host copy).
- **reuse**: the trainer's periodic HF checkpoint ``<save_hf_dir>/checkpoint-<step>`` is marked
  ``.complete`` in place (:func:`ckpteval.coord.snapshots.snapshot.mark_complete`): zero extra export. The loop must
  have saved it before calling :meth:`maybe_dispatch` for that step; a missing one (or one without
  weights) is a ``ckpt_missing`` skip.

The snapshot root must be listed in ``run.json``'s ``snapshot_roots`` (else ``ValueError``): that is
where workers look.

Overflow — at most ``max_in_flight`` points dispatched and not yet ingested:

- ``skip``: the step is recorded as skipped ``busy`` (:func:`ckpteval.coord.results.files.write_point_skip`), nothing
  is exported, and ``eval/skipped_busy`` is logged at that step.
- ``backpressure``: the loop waits (ingesting meanwhile) until the oldest pending point lands, for
  at most ``backpressure_timeout_s``; on timeout the step is skipped ``busy`` as above rather than
  hang. The wait is logged with the point as ``eval/backpressure_wait_seconds``.
- the **final** point is never skipped as busy, whatever ``steps % eval_interval``: the loop passes
  ``final=True`` to :meth:`maybe_dispatch` at its last step, or :meth:`close` dispatches it.
- ``fleet == "none"`` (``--eval-fleet none``: "save checkpoints now, backfill later", reuse mode):
  no limit, no wait, no busy skip; every point stays pending and is ingested if a backfill lands
  while training runs; :meth:`close` does not drain.

Stop signals: ``should_stop`` (the trainer's SIGTERM/SIGUSR1 flag) ends every wait at once — the
backpressure wait (the step is then dispatched over the limit: the trainer is about to checkpoint
this step and leave, so its weights exist only now and a resumed trainer starts after it), the shared posture's wait for
in-flight producer requests (nothing is written: the point stays open for a backfill), the final
export wait in :meth:`close` (which then returns False, training not marked done) and the drain.

Failures never stop training: an export that fails, or finds no room on the staging filesystem, is
an ``export_failed`` skip at its step.

Ingestion (rate-limited to one results listing per ``poll_interval_s``, never waiting for eval): a
pending point whose units all have results goes through :func:`ckpteval.jobs.ingest.ingest_point` (the
service's ingestion path too): derived (:func:`ckpteval.coord.results.files.derive_point`), its
metrics (:func:`ckpteval.coord.results.files.point_metrics`, ``eval/lag_steps`` = trainer step now − dispatch
step, at least 0 — a resumed trainer re-trains steps below points it had dispatched —, ``eval/export_time_seconds``, ``eval/export_blocked_seconds``) logged at the dispatch step,
``ingested`` and ``retired`` appended to the ledger, and in staging mode the staging GC run
(``keep_snapshots`` newest retired kept, plus the best ``keep_best`` points by ``best_metric``; reused
checkpoints are never deleted).

Restart safety (SLURM requeue): the dispatcher replays ``ledger.jsonl`` on construction. Points
ingested before are never logged again (the ledger, and the sink's own ``eval/step`` check for a
crash between metrics line and ledger record); pending points are re-adopted and ingested once
they finish; a skip recorded in the ledger but not yet written is written again. A pending point
whose snapshot never got published (the trainer died mid-export, or between ledger and marker) is
*lost*: it is dispatched again if the resumed loop reaches that step again, else skipped
``crashed`` as soon as the loop is past it.

:meth:`close` dispatches the final step if needed (waiting for its export), then marks training done
(``RUN/TRAINING_DONE`` — only after the final snapshot is published, so a fleet that exits on
"training done and nothing left" cannot miss it), then drains for up to ``drain_timeout_s``. Points
still unfinished after that are logged with ``eval/skipped_drain_timeout`` = number of units without
a result (plus the datasets that did finish) and recorded ``ingested`` with ``outcome:
drain_timeout``. No result is written for them: results are facts, and the units stay open for a
fleet or a backfill to finish; only the trainer stops waiting. Their snapshots are not retired, so
GC leaves them for that backfill.

Shared posture: given a :class:`ckpteval.jobs.trainer.gate.SharedEval` (the trainer's own engine and its
producer gate), a dispatch is blocking instead: publish the snapshot, evaluate it (:meth:`SharedEval.evaluate`),
ingest it at once (lag 0). The eval's wall time (what training waited on top of the export) is logged as
``eval/shared_eval_seconds``; in-flight producer requests that do not finish within
``SharedEval.drain_timeout_s`` make the point a ``busy`` skip.

Limits: one dispatcher per run dir. Export times, the shared eval time and skips survive a restart
as their own ledger events (``exported``, ``evaluated_shared``, ``skipped``: :mod:`ckpteval.coord.run.ledger`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ckpteval.coord.results.conditions import Condition, parse_condition, point_value, top_steps
from ckpteval.coord.results.files import Result, ResultIndex, write_point_skip
from ckpteval.coord.results.points import Point, derive_point, point_metrics
from ckpteval.coord.run.identity import run_key
from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.gc import StagingGC, has_room
from ckpteval.coord.snapshots.saves import shards_present
from ckpteval.coord.snapshots.snapshot import mark_complete, read_marker, snapshot_path
from ckpteval.coord.work.units import WorkUnit, units_for_step
from ckpteval.jobs.eval.proof.canary import TrainerCanary
from ckpteval.jobs.ingest import ingest_point
from ckpteval.jobs.metrics import MetricsSink
from ckpteval.jobs.trainer.config import DispatchConfig
from ckpteval.jobs.trainer.cost import TrainingClock, trainer_gpus
from ckpteval.jobs.trainer.export.async_export import AsyncExporter, ExportOutcome, RoomCheck

if TYPE_CHECKING:  # the shared posture's parts are imported with a SharedEval (a fleet trainer needs none)
    from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
    from ckpteval.jobs.trainer.gate import SharedEval

Model = torch.nn.Module | Mapping[str, Any]
RECORDED_TIMES = ("export_time_seconds", "export_blocked_seconds", "backpressure_wait_seconds", "shared_eval_seconds")
WAIT_SLICE_S = 0.1


class EvalDispatcher:
    """See the module docstring."""

    def __init__(
        self,
        config: DispatchConfig,
        run: RunDir,
        sink: MetricsSink,
        base_model_dir: Path | None,
        *,
        shared: SharedEval | None = None,
        room_check: RoomCheck = has_room,
        clock: Callable[[], float] = time.monotonic,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        self.config = config.for_run(run.path)
        self.waits = self.config.waits
        self.should_stop = should_stop  # a stop signal arrived: every wait below ends at once
        self.run = run
        self.manifest = run.manifest()
        self.sink = sink
        self.shared = shared
        self.clock = clock
        self.key = run_key(self.manifest)
        self.root = self._snapshot_root()
        self._check_cadence()
        self.ledger = Ledger(run.ledger_path)
        self.index = ResultIndex(run.results)
        self.exporter: AsyncExporter | None = None
        self._canary = TrainerCanary(run, self.manifest, base_model_dir)
        self.gc: StagingGC | None = None
        if self.config.mode == "staging":
            self.exporter = AsyncExporter(self.root, base_model_dir, room_check=room_check, run=self.key)
            self.gc = StagingGC(self.root, run.leases, self.manifest.lease.duration_s, keep=self.config.keep_snapshots,
                                run=self.key)
        self._cache: DatasetCache | None = None if shared is None else shared.attach(run, self.manifest)
        self.step = 0  # the trainer's latest step seen
        self.landed = len(self.ledger.state.ingested)
        self._last_poll = -float("inf")
        self._lost: set[int] = set()
        self._exporting: set[int] = set()  # submitted, outcome not yet recorded (export times pending)
        self._ranked: dict[int, float] = {}  # retired step -> its best-metric value (--eval-keep-best)
        self.stop_when: Condition | None = (  # --eval-stop-when: a point meeting it asks training to end
            None if self.config.stop_when is None else parse_condition(self.config.stop_when, "--eval-stop-when"))
        self.stop_requested: int | None = min(self.ledger.state.stop_requested, default=None)  # that point's step
        gpus = self.config.trainer_gpus if self.config.trainer_gpus is not None else trainer_gpus()
        self._training = TrainingClock(gpus, self.ledger.state, clock)  # eval/cost/fraction_of_training
        self._replay()

    # -- construction ---------------------------------------------------------------------------------
    def _snapshot_root(self) -> Path:
        """This run's snapshot root as run.json lists it (:meth:`DispatchConfig.listed_snapshot_root`)."""
        root = self.config.listed_snapshot_root(self.manifest.snapshot_roots, self.key, self.run.path,
                                                self.run.manifest_path)
        root.mkdir(parents=True, exist_ok=True)
        return root

    def _check_cadence(self) -> None:
        interval = self.config.eval_interval or 1
        for i, ds in enumerate(self.manifest.eval.datasets):
            if ds.every > 1 and ds.every % interval:
                raise ValueError(
                    f"{self.run.manifest_path}: field eval.datasets[{i}].every is {ds.every}, not a multiple of "
                    f"the eval interval {interval}: dataset {ds.name!r} would never be evaluated on schedule"
                )

    def _replay(self) -> None:
        """Re-adopt what a previous incarnation left pending (see the module docstring)."""
        for step in self.ledger.state.pending:
            if step in self.ledger.state.skipped:
                reason, message = self.ledger.state.skipped[step]
                write_point_skip(self.run.results, self.manifest, step, reason, message)
            elif not self._snapshot_published(step) and not self._derive(step).complete:
                self._lost.add(step)
        # Nothing is ingested here: the lag needs the trainer's step, known at the first call.

    # -- names ---------------------------------------------------------------------------------------
    def snapshot_dir(self, step: int) -> Path:
        return snapshot_path(self.root, step, self.config.mode)

    def _snapshot_published(self, step: int) -> bool:
        """A marker of *this run* is there (a reused checkpoint dir may hold another run's marker)."""
        try:
            marker = read_marker(self.snapshot_dir(step))
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return False
        return marker.run == self.key

    # -- the training loop's API -----------------------------------------------------------------------
    @property
    def pending(self) -> list[int]:
        """Steps dispatched and not yet ingested (lost ones excluded): what counts as in flight."""
        return [s for s in self.ledger.state.pending if s not in self._lost]

    def maybe_dispatch(self, step: int, model: Model, *, final: bool = False) -> None:
        """Call after every optimizer step: ingests what finished; dispatches every ``eval_interval``.

        ``final``: this is the last step of training (whatever ``step % eval_interval``): its point is
        dispatched now and never skipped as busy (:meth:`close` then finds it dispatched)."""
        self.step = step
        self.poll()
        if final or (step % self.config.eval_interval == 0 and units_for_step(self.manifest, step)):
            self.dispatch(step, model, final=final)

    def dispatch_initial(self, model: Model) -> None:
        """Step 0: make the initial weights a point (call before the first optimizer step).

        Exactly once per run: a step 0 already in the ledger (a resumed trainer) is not dispatched again.
        """
        self.dispatch(0, model)

    def poll(self, force: bool = False) -> None:
        """Collect finished exports and ingest finished points (at most once per ``poll_interval_s``)."""
        now = self.clock()
        if not force and now - self._last_poll < self.waits.poll_interval_s:
            return
        self._last_poll = now
        self._collect_exports()
        self._skip_lost(before=self.step)
        self._ingest_ready()

    def dispatch(self, step: int, model: Model, final: bool = False) -> None:
        """Make ``step`` evaluable now (unless already dispatched by this run or a previous incarnation).
        The time spent here (export, backpressure, shared evaluation) is not charged as training."""
        if step in self.ledger.state.dispatched and step not in self._lost:
            return
        train_gpu_s = self._training.charge()
        try:
            self._dispatch(step, model, final, train_gpu_s)
        finally:
            self._training.resume()

    def _dispatch(self, step: int, model: Model, final: bool, train_gpu_s: float) -> None:
        self._lost.discard(step)
        waited = 0.0
        if not final and self.config.fleet != "none" and len(self.pending) >= self.config.max_in_flight:
            if self.config.overflow_policy == "backpressure":
                waited = self._wait_for_slot()
            if len(self.pending) >= self.config.max_in_flight and not self.should_stop():
                message = f"{len(self.pending)} points in flight (max {self.config.max_in_flight})"
                self._skip(step, "busy", message, extra={"backpressure_wait_seconds": waited})
                return
        self.ledger.append("dispatched", step, mode=self.config.mode, backpressure_wait_seconds=waited,
                           train_gpu_s=train_gpu_s, trainer_gpus=self._training.gpus)
        if self.config.mode == "staging":
            self._export(step, model)
        else:
            self._mark_checkpoint(step)
        if self.shared is not None:
            self._evaluate_shared(self.shared, step)

    def close(self, final_step: int, model: Model) -> bool:
        """End of training: dispatch the final point, mark training done, drain (bounded).

        Returns False if a stop signal (:attr:`should_stop`) ended the wait for the final export:
        training is then *not* marked done (the final snapshot is not published yet), and a resumed
        trainer's ``close`` finishes the job. A stop during the drain ends the drain at once (the
        points left are given up as on a drain timeout). With ``fleet == "none"`` nothing is drained:
        the points stay pending for a later backfill."""
        self.step = max(self.step, final_step)
        self.poll(force=True)
        self.dispatch(final_step, model, final=True)
        if self.exporter is not None:
            while not self.exporter.wait(WAIT_SLICE_S):
                if self.should_stop():
                    return False
            self._collect_exports()
        self.run.mark_training_done(final_step)
        self._skip_lost(before=final_step + 1)
        if self.config.fleet == "none":
            self.poll(force=True)  # a backfill that already landed is logged; the rest stays pending
            return True
        deadline = self.clock() + self.waits.drain_timeout_s
        while self.pending and self.clock() < deadline and not self.should_stop():
            self._sleep_and_poll()
        for step in self.pending:
            self._give_up(step)
        return True

    def suspend(self, timeout_s: float = 60.0) -> None:  # the exit path: bounded, not interrupted
        """Preemption: let an export in flight publish (bounded) and record it; training is not done."""
        if self.exporter is not None:
            self.exporter.wait(timeout_s)
            self._collect_exports()

    # -- dispatching -----------------------------------------------------------------------------------
    def _export(self, step: int, model: Model) -> None:
        if self.exporter is None:
            raise RuntimeError("staging export without an exporter")
        self._exporting.add(step)
        self.exporter.submit(step, model, canary=self._canary(model))
        if self.shared is not None:
            self.exporter.wait()
        self._collect_exports()

    def _mark_checkpoint(self, step: int) -> None:
        directory = self.snapshot_dir(step)
        if self._snapshot_published(step):
            return  # a resumed trainer re-running the step: marked before
        names = {p.name for p in directory.iterdir()} if directory.is_dir() else set()
        if not shards_present(directory, names):
            self._skip(step, "ckpt_missing", f"{directory}: no checkpoint with weights saved at step {step}")
            return
        try:
            mark_complete(directory, step, mode="reuse", run=self.key)
        except OSError as e:
            self._skip(step, "export_failed", f"cannot mark {directory} complete: {e}")

    def _collect_exports(self) -> None:
        if self.exporter is None:
            return
        for outcome in self.exporter.poll():
            self._record_export(outcome)

    def _record_export(self, outcome: ExportOutcome) -> None:
        self._exporting.discard(outcome.step)
        times = {"export_time_seconds": outcome.total_s, "export_blocked_seconds": outcome.blocked_s}
        if outcome.ok:
            self.ledger.append("exported", outcome.step, **times, snapshot=str(outcome.path))
        else:
            self._skip(outcome.step, "export_failed", outcome.error, extra=times)

    def _skip(self, step: int, reason: str, message: str, extra: dict[str, Any] | None = None) -> None:
        """Record the whole point as skipped for ``reason`` and ingest it at once."""
        fields = {"mode": self.config.mode, **(extra or {}), "reason": reason, "message": message}
        self.ledger.append("skipped", step, **fields)
        write_point_skip(self.run.results, self.manifest, step, reason, message)
        self._ingest_ready(steps=[step])

    def _skip_lost(self, before: int) -> None:
        for step in sorted(s for s in self._lost if s < before):
            self._lost.discard(step)
            self._skip(step, "crashed", "the trainer died before this step's snapshot was published")

    def _evaluate_shared(self, shared: SharedEval, step: int) -> None:
        if step not in self.ledger.state.pending or not self._snapshot_published(step):
            return  # skipped (export failed, checkpoint missing): nothing to evaluate
        try:
            seconds = shared.evaluate(self.run, step, self.snapshot_dir(step), self._cache, self.should_stop)
        except TimeoutError as e:  # producers' in-flight requests did not finish: the engine is busy
            self._skip(step, "busy", str(e))
            return
        if seconds is not None:  # None: preempted while producers drained; nothing written, the point stays open
            self.ledger.append("evaluated_shared", step, shared_eval_seconds=seconds)
            self._ingest_ready(steps=[step])

    def _wait_for_slot(self) -> float:
        """Backpressure: wait (ingesting) until a slot frees or the timeout passes; returns the wait."""
        start = self.clock()
        deadline = start + self.waits.backpressure_timeout_s
        while len(self.pending) >= self.config.max_in_flight and self.clock() < deadline and not self.should_stop():
            self._sleep_and_poll()
        return self.clock() - start

    def _sleep_and_poll(self) -> None:
        time.sleep(WAIT_SLICE_S)
        self.poll(force=True)

    # -- ingestion -------------------------------------------------------------------------------------
    def _results_for(self, step: int) -> dict[WorkUnit, Result]:
        return {u: r for u in units_for_step(self.manifest, step) if (r := self.index.get(u)) is not None}

    def _derive(self, step: int) -> Point:
        self.index.refresh(only_steps={step})
        return derive_point(self.manifest, step, self._results_for(step))

    def _ingest_ready(self, steps: list[int] | None = None) -> None:
        candidates = [s for s in (self.pending if steps is None else steps) if s not in self._exporting]
        if not candidates:
            return
        self.index.refresh(only_steps=set(candidates))
        for step in candidates:
            if step not in self.ledger.state.ingested:
                self._ingest(step)

    def _ingest(self, step: int, give_up: bool = False) -> None:
        """One point through :func:`ckpteval.jobs.ingest.ingest_point`; then retire it (and collect) if complete."""
        record = self.ledger.state.dispatched.get(step, {})
        extra = {f"eval/{key}": record[key] for key in RECORDED_TIMES if isinstance(record.get(key), int | float)}
        # a resumed trainer restarts below steps its previous incarnation dispatched: a point that lands
        # while it re-trains up to its step was there before the trainer got back to it — lag 0, never < 0
        point = ingest_point(self.manifest, step, self._results_for(step), sink=self.sink, ledger=self.ledger,
                             lag_steps=max(0, self.step - step), extra=extra, give_up=give_up, index=self.index)
        if point is None:
            return
        self.landed += 1
        if point.complete and not give_up:
            self._check_stop_when(step, point)
            self.ledger.append("retired", step)
            if self.gc is not None:
                self.gc.collect(self.ledger.state.retired, self._best_steps())

    def _check_stop_when(self, step: int, point: Point) -> None:
        """``--eval-stop-when``: record (ledger ``stop_requested``) the first point that meets it."""
        if self.stop_when is not None and self.stop_requested is None and self.stop_when.holds(point_metrics(point)):
            self.stop_requested = step
            self.ledger.append("stop_requested", step, condition=self.stop_when.text, at_step=self.step,
                               time=time.time())

    def _best_steps(self) -> set[int]:
        """``--eval-keep-best K``: the retired steps whose points rank in the best K by the best metric."""
        if self.config.keep_best < 1:
            return set()
        metric = self.config.best_metric or f"eval/{self.manifest.eval.datasets[0].name}"
        results = self.index.refresh(only_steps=self.ledger.state.retired - set(self._ranked))
        for step in self.ledger.state.retired - set(self._ranked):
            self._ranked[step] = point_value(self.manifest, results, step, metric)
        return top_steps(self._ranked, self.config.keep_best)

    def _give_up(self, step: int) -> None:
        """Drain timeout: log what exists, count the rest as skipped; write no result (see docstring)."""
        self.index.refresh(only_steps={step})
        self._ingest(step, give_up=True)
