"""``EvalDispatcher``: the one object a training loop talks to about evaluation.

The loop calls :meth:`~EvalDispatcher.dispatch_initial` (optional: step 0 is a point),
:meth:`~EvalDispatcher.maybe_dispatch` after every optimizer step and :meth:`~EvalDispatcher.close` once;
:meth:`EvalDispatcher.open` builds it (reads run.json, replays the ledger). Usage, settings, overflow
(``skip``/``backpressure``, ``fleet == "none"``), stop signals and skip reasons: docs/USER_GUIDE.md
"Your trainer", "Flags" and "Skip reasons and what to do"; the ledger's events: docs/PROTOCOL.md §8.

Guarantees: failures never stop training (a failed or room-less export is an ``export_failed`` skip);
the final point is never skipped ``busy``; a stop signal (``should_stop``) ends every wait at once;
restart-safe through ``ledger.jsonl`` — a point ingested before is never logged again, a pending one is
re-adopted, one whose snapshot was never published is dispatched again or skipped ``crashed``; points
a drain gives up on are logged ``drain_timeout`` and keep their units open (no result written) for a
backfill; ``TRAINING_DONE`` is written only after the final snapshot is published.
Limits: one dispatcher per run dir; the snapshot root must be listed in run.json (else ``ValueError``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ckpteval.coord.entries import scored_per_sample
from ckpteval.coord.results.conditions import Condition, parse_condition, point_value, top_steps
from ckpteval.coord.results.files import Result, ResultIndex, write_point_skip
from ckpteval.coord.results.points import Point, derive_point, point_metrics
from ckpteval.coord.run.identity import run_key
from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.run.manifest import RunManifest
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

if TYPE_CHECKING:  # imported with a SharedEval / --eval-stop-plateau / --eval-adaptive only (scipy: ``open``)
    from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
    from ckpteval.jobs.trainer.adaptive.spend import AdaptiveSpender
    from ckpteval.jobs.trainer.gate import SharedEval
    from ckpteval.jobs.trainer.plateau import PlateauRule, PlateauVerdict, PointValue

Model = torch.nn.Module | Mapping[str, Any]
RECORDED_TIMES = ("export_time_seconds", "export_blocked_seconds", "backpressure_wait_seconds", "shared_eval_seconds")
WAIT_SLICE_S = 0.1


def _check_cadence(config: DispatchConfig, run: RunDir, manifest: RunManifest) -> None:
    interval = config.eval_interval or 1
    for i, ds in enumerate(manifest.eval.entries):  # i: the entry's index in run.json's eval.datasets
        if ds.every > 1 and ds.every % interval:
            raise ValueError(
                f"{run.manifest_path}: field eval.datasets[{i}].every is {ds.every}, not a multiple of "
                f"the eval interval {interval}: dataset {ds.name!r} would never be evaluated on schedule"
            )


class EvalDispatcher:
    """See the module docstring; build it with :meth:`open`."""

    def __init__(
        self,
        config: DispatchConfig,
        run: RunDir,
        manifest: RunManifest,
        sink: MetricsSink,
        ledger: Ledger,
        *,
        root: Path,
        canary: TrainerCanary,
        training: TrainingClock,
        exporter: AsyncExporter | None = None,
        gc: StagingGC | None = None,
        shared: SharedEval | None = None,
        cache: DatasetCache | None = None,
        stop_when: Condition | None = None,
        plateau: PlateauRule | None = None,
        adaptive: AdaptiveSpender | None = None,
        clock: Callable[[], float] = time.monotonic,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        """Only assigns the built parts; :meth:`open` builds them for a run dir."""
        self.config, self.waits, self.run, self.manifest = config, config.waits, run, manifest
        self.sink, self.ledger, self.root, self.key = sink, ledger, root, run_key(manifest)
        self.index = ResultIndex(run.results, manifest)
        self.exporter, self.gc, self._canary, self._training = exporter, gc, canary, training
        self.shared, self._cache = shared, cache
        self.clock = clock
        self.should_stop = should_stop  # a stop signal arrived: every wait ends at once
        self.stop_when = stop_when  # --eval-stop-when: a point meeting it asks training to end
        self.plateau = plateau  # --eval-stop-plateau: a plateau over the last N points asks training to end
        self.adaptive = adaptive  # --eval-adaptive: grants more samples where a decision is open
        self.grants = adaptive.grants if adaptive is not None else None
        self._history: dict[int, PointValue | None] = {}  # retired step -> the plateau metric's value and stderr
        self.stop_requested: int | None = min(ledger.state.stop_requested, default=None)  # that point's step
        self.step = 0  # the trainer's latest step seen
        self.landed = len(ledger.state.ingested)
        self._last_poll = -float("inf")
        self._lost: set[int] = set()
        self._exporting: set[int] = set()  # submitted, outcome not yet recorded (export times pending)
        self._ranked: dict[int, float] = {}  # retired step -> its best-metric value (--eval-keep-best)

    @classmethod
    def open(
        cls,
        config: DispatchConfig,
        run: RunDir,
        sink: MetricsSink,
        base_model_dir: Path | None,
        *,
        shared: SharedEval | None = None,
        room_check: RoomCheck = has_room,
        clock: Callable[[], float] = time.monotonic,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> EvalDispatcher:
        """The run's dispatcher: ``config`` checked for this run, run.json read, the snapshot root made,
        the ledger replayed (pending points re-adopted: the module docstring)."""
        config = config.for_run(run.path)
        manifest = run.manifest()
        key = run_key(manifest)
        root = config.listed_snapshot_root(manifest.snapshot_roots, key, run.path, run.manifest_path)  # as listed
        root.mkdir(parents=True, exist_ok=True)
        _check_cadence(config, run, manifest)
        ledger = Ledger(run.ledger_path)
        canary = TrainerCanary(run, manifest, base_model_dir)
        exporter, gc = None, None
        if config.mode == "staging":
            exporter = AsyncExporter(root, base_model_dir, room_check=room_check, run=key)
            gc = StagingGC(root, run.leases, manifest.lease.duration_s, keep=config.keep_snapshots, run=key)
        cache = None if shared is None else shared.attach(run, manifest)
        stop_when = None if config.stop_when is None else parse_condition(config.stop_when, "--eval-stop-when")
        plateau = adaptive = None  # their modules (scipy) only for a run that asks for them
        if config.stop_plateau is not None:
            from ckpteval.jobs.trainer.plateau import parse_plateau
            plateau = parse_plateau(config.stop_plateau, "--eval-stop-plateau")
        if config.adaptive is not None:
            from ckpteval.jobs.trainer.adaptive.spend import open_spender
            adaptive = open_spender(config.adaptive, run.path, manifest, stop_when)
        gpus = config.trainer_gpus if config.trainer_gpus is not None else trainer_gpus()
        dispatcher = cls(config, run, manifest, sink, ledger, root=root, canary=canary,
                         training=TrainingClock(gpus, ledger.state, clock), exporter=exporter, gc=gc,
                         shared=shared, cache=cache, stop_when=stop_when, plateau=plateau, adaptive=adaptive, clock=clock, should_stop=should_stop)
        dispatcher._replay()
        return dispatcher

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
                refused = self.run.config_refused()  # RUN/CONFIG_REFUSED: no worker can run this config
                reason = "busy" if refused is None else "config_refused"
                if refused is not None:
                    message = f"{message}; a worker refused the run's configuration: {refused.get('message')}"
                self._skip(step, reason, message, extra={"backpressure_wait_seconds": waited})
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
        if self.adaptive is not None:
            self._spend_final(self.adaptive, deadline)
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
        while (len(self.pending) >= self.config.max_in_flight and self.clock() < deadline and not self.should_stop()
               and self.run.config_refused() is None):  # a refused config: no fleet will free a slot
            self._sleep_and_poll()
        return self.clock() - start

    def _sleep_and_poll(self) -> None:
        time.sleep(WAIT_SLICE_S)
        self.poll(force=True)

    # -- ingestion -------------------------------------------------------------------------------------
    def _results_for(self, step: int) -> dict[WorkUnit, Result]:
        return {u: r for u in units_for_step(self.manifest, step, self.grants) if (r := self.index.get(u)) is not None}

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
        if self.adaptive is not None and not give_up and self._held(self.adaptive, step):
            return
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

    def _held(self, adaptive: AdaptiveSpender, step: int) -> bool:
        """``--eval-adaptive``: a complete point waits while units granted to it are out, or when the look its
        completion makes grants it more (a retired step may be granted more too, while its snapshot is there)."""
        if not self._derive(step).complete:
            return False
        if adaptive.outstanding(step, self._results_for(step)):
            return True
        made = adaptive.spend(self._complete_results({step}), self.ledger.state, self._snapshot_published)
        return any(g.step == step for g in made)

    def _spend_final(self, adaptive: AdaptiveSpender, deadline: float) -> None:
        """Training ended: look again (``final``: no lag) until nothing is open or granted units are out, within
        the drain's deadline; what is still out then is the fleet's to finish."""
        while self.clock() < deadline and not self.should_stop():
            by_step = self._complete_results(set())
            if not any(adaptive.outstanding(s, r) for s, r in by_step.items()) and not adaptive.spend(
                    by_step, self.ledger.state, self._snapshot_published, final=True):
                return
            time.sleep(WAIT_SLICE_S)

    def _complete_results(self, also: set[int]) -> dict[int, dict[WorkUnit, Result]]:
        steps = (self.ledger.state.retired | also) - set(self.ledger.state.skipped)
        self.index.refresh(only_steps=steps)
        return {s: self._results_for(s) for s in steps}

    def _check_stop_when(self, step: int, point: Point) -> None:
        """Record (ledger ``stop_requested``) the first point meeting --eval-stop-when or --eval-stop-plateau."""
        if self.stop_requested is not None:
            return
        if self.stop_when is not None and self.stop_when.holds(point_metrics(point)):
            self._request_stop(step, self.stop_when.text)
        elif self.plateau is not None and (verdict := self._plateau_verdict(self.plateau, step, point)) is not None:
            self._request_stop(step, self.plateau.text, rule="plateau", reason=verdict.message(self.plateau.metric),
                               best_step=verdict.best_step)

    def _request_stop(self, step: int, condition: str, **fields: Any) -> None:
        self.stop_requested = step
        self.ledger.append("stop_requested", step, condition=condition, at_step=self.step, time=time.time(), **fields)

    def _plateau_verdict(self, rule: PlateauRule, step: int, point: Point) -> PlateauVerdict | None:
        """The plateau rule over every retired point and ``step``'s (restart-safe: earlier points re-derived)."""
        for earlier in sorted(self.ledger.state.retired - set(self._history) - {step}):
            self._history[earlier] = rule.value_of(earlier, point_metrics(self._derive(earlier)))
        self._history[step] = rule.value_of(step, point_metrics(point))
        return rule.verdict([v for _, v in sorted(self._history.items()) if v is not None])

    def _best_steps(self) -> set[int]:
        """``--eval-keep-best K``: the retired steps whose points rank in the best K by the best metric."""
        if self.config.keep_best < 1:
            return set()
        metric = self.config.best_metric or f"eval/{[e for e in self.manifest.eval.entries if scored_per_sample(e)][0].name}"
        results = self.index.refresh(only_steps=self.ledger.state.retired - set(self._ranked))
        for step in self.ledger.state.retired - set(self._ranked):
            self._ranked[step] = point_value(self.manifest, results, step, metric)
        return top_steps(self._ranked, self.config.keep_best)

    def _give_up(self, step: int) -> None:
        """Drain timeout: log what exists, count the rest as skipped; write no result (see docstring)."""
        self.index.refresh(only_steps={step})
        self._ingest(step, give_up=True)
