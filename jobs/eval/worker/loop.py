"""The worker loop: poll, claim, evaluate, publish, release — one :class:`Worker`.

See :mod:`ckpteval.jobs.eval.worker.main` for the promises (outcomes, leases, preemption, when it exits).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpteval.coord.layouts import FALLBACK
from ckpteval.coord.results.files import INFRA_SKIPS, Result, ResultIndex
from ckpteval.coord.run.identity import run_key, snapshots_key
from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.discovery import CAPTURED, SnapshotDiscovery, SnapshotRef
from ckpteval.coord.snapshots.gc import CaptureGC
from ckpteval.coord.snapshots.snapshot import Marker, VerifiedSnapshots, producer_identity, snapshot_path
from ckpteval.coord.work.claims import Claim, UnitClaimer, order_units
from ckpteval.coord.work.grants import GRANTS_FILE, Grants
from ckpteval.coord.work.steps import run_step_selection
from ckpteval.coord.work.units import WorkUnit, units_for_step
from ckpteval.jobs.eval.kinds.generate.tokenizer_files import TokenizerMissing, has_tokenizer
from ckpteval.jobs.eval.proof.attest import lost, overturn_lost
from ckpteval.jobs.eval.worker.evaluators import Evaluator, evaluate_unit
from ckpteval.jobs.eval.worker.options import WorkerOptions
from ckpteval.jobs.eval.worker.policy import RetryPolicy
from ckpteval.jobs.eval.worker.runner import UnitRunner
from ckpteval.jobs.lifecycle import EXIT_DONE, EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_UNHEALTHY

WAIT_SLICE_S = 0.05  # how often the main thread looks at the stop flag while a unit runs


def dispatched_steps(ledger_path: Path) -> set[int]:
    """Steps the trainer dispatched, read as a reader (``repair=False``: never truncates a live ledger)."""
    return set(dispatch_records(ledger_path))


def dispatch_records(ledger_path: Path) -> dict[int, dict[str, Any]]:
    """step -> the trainer's latest ``dispatched`` record (read-only, like :func:`dispatched_steps`)."""
    return Ledger(ledger_path, repair=False).state.dispatched


# -- the loop ---------------------------------------------------------------------------------------------
@dataclass
class _Discovered:
    discovery: SnapshotDiscovery
    foreign: bool


@dataclass
class Worker:
    """One worker's state across polls; :meth:`run` may be called again after it returns."""

    rundir: RunDir
    opts: WorkerOptions
    evaluator: Evaluator
    out: Callable[[str], None] = field(default=lambda line: print(line, flush=True))
    on_poll: Callable[[int], None] | None = None  # called with the number of outstanding units
    on_result: Callable[[Result], None] | None = None  # called with each result this worker published first
    # no unit of a step above this (from the results) is started: backfill --until's first passing step
    step_limit: Callable[[dict[WorkUnit, Result]], int | None] | None = None

    def __post_init__(self) -> None:
        self.manifest = self.rundir.manifest()
        self.selection = run_step_selection(self.manifest.trainer, str(self.rundir.manifest_path))
        self.claimer = UnitClaimer(self.rundir.leases, self.manifest.lease, results_dir=self.rundir.results)
        self.index = ResultIndex(self.rundir.results, self.manifest)
        self.discoveries = self._make_discoveries()
        self.identity = {
            **producer_identity(),
            "worker_id": self.opts.worker_id or f"{producer_identity()['host']}:{os.getpid()}",
            "engine": "+".join(self.opts.engines)
            + (f" x{self.opts.replicas}" if self.opts.replicas > 1 else ""),
        }
        self.refs: dict[int, SnapshotRef] = {}
        self.settled: set[int] = set()
        self.grants = Grants(self.rundir.path / GRANTS_FILE)  # adaptive evaluation's added units (coord.work.grants)
        self.written = 0
        self.training_done = False  # as of the last poll
        self.stop_signal: int | None = None
        self.runner = UnitRunner()
        self.verified = VerifiedSnapshots()  # each snapshot's --verify check, once per process
        self.policy = RetryPolicy(self.opts, self.manifest.lease.duration_s)  # when to poll, retry, give up
        self._tried: set[WorkUnit] = set()
        self._warned: set[str] = set()
        self.released_last = False  # the last unit was released for another worker, nothing written
        self._dispatches: dict[int, dict[str, Any]] = {}  # ledger records, read once training is done
        self.captures = CaptureGC(self.rundir.path / CAPTURED, self.rundir.leases, self.manifest.lease.duration_s)
        self._final: set[int] = set()  # settled steps no later evaluation supersedes (no infra skip)

    def _make_discoveries(self) -> list[_Discovered]:
        foreign = {
            str(Path(r).resolve())
            for r in self.manifest.trainer.get("foreign_roots", [])
            if isinstance(r, str)
        }
        foreign |= {str(Path(w).resolve()) for w in self.opts.watch}
        own = [str(Path(r).resolve()) for r in self.manifest.snapshot_roots]
        roots = list(dict.fromkeys(own + sorted(foreign)))
        # a re-evaluation adopts its source run's snapshot dirs (its snapshot_roots): that run's markers only
        key, source = run_key(self.manifest), snapshots_key(self.manifest)
        return [
            _Discovered(
                SnapshotDiscovery(
                    Path(r),
                    admit_foreign=r in foreign,
                    quiescence_s=self.opts.quiescence_s,
                    adoption_dir=self.rundir.adopted,
                    run=key,
                    adopt_only=source if source != key and r in own else None,
                    layout=self.opts.layout if r in foreign else FALLBACK,
                    lost_dir=self.rundir.lost,
                    wanted=lambda step: bool(units_for_step(self.manifest, step)),
                ),
                r in foreign,
            )
            for r in roots
        ]

    # -- stopping ----------------------------------------------------------------------------------
    def request_stop(self, signum: int) -> None:
        """Signal-handler safe: only sets a flag, which the main thread acts on within ~50 ms."""
        self.stop_signal = signum

    def _stop_code(self) -> int:
        return EXIT_INTERRUPTED if self.stop_signal == signal.SIGINT else EXIT_PREEMPTED

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while self.stop_signal is None and (left := end - time.monotonic()) > 0:
            time.sleep(min(WAIT_SLICE_S * 2, left))

    # -- polling -----------------------------------------------------------------------------------
    def poll(self) -> tuple[list[WorkUnit], int]:
        """(claimable units, number of outstanding units incl. those without a snapshot yet)."""
        current: dict[int, SnapshotRef] = {}
        for d in self.discoveries:
            for ref in d.discovery.poll():
                current.setdefault(ref.step, ref)
            for key, line in d.discovery.problems.items():
                self._warn_once(f"{d.discovery.root}:{key}", line)
        self.refs.update(current)  # a vanished snapshot keeps its ref: its units become ckpt_missing
        steps = self._steps()
        seen = self.grants.version
        if self.grants.refresh().version != seen:  # new grants reopen their steps
            self.settled -= set(self.grants.by_step)
        results = self._refresh(steps)
        self._forget_finished(results)
        for name, why in self.index.errors.items():
            self._warn_once(name, f"unit left alone: its result file is malformed ({why})")
        broken = {WorkUnit.from_id(Path(n).stem) for n in self.index.errors if self._parsable_id(Path(n).stem)}
        outstanding = [
            u
            for s in sorted(steps)
            if s not in self.settled
            for u in self._open_units(s, results)
            if u not in broken  # a human must look at it; re-evaluating could never publish
        ]
        self._collect_captures()  # after _open_units: the steps settled by this poll's results
        if self.step_limit is not None and (limit := self.step_limit(results)) is not None:
            outstanding = [u for u in outstanding if u.step <= limit]
        self._give_up_finding(outstanding)
        claimable = [u for u in outstanding if u.step in self.refs  # an overloaded skip waits its backoff
                     and self.policy.claim_due(results.get(u), self.index.generation(u))]
        if self.on_poll is not None:
            self.on_poll(len(outstanding))
        return claimable, len(outstanding)

    def _refresh(self, steps: set[int]) -> dict[WorkUnit, Result]:  # only unsettled ``steps``' dirs
        return self.index.refresh(self.settled, only_steps=steps)

    def _collect_captures(self) -> None:
        """Captured broadcasts (``RUN/captured/``) of final steps are deleted (:class:`CaptureGC`): settled, and
        no unit's result an infrastructure skip that a ``--retry-infra-skips`` pass could still supersede."""
        if not self.captures.root.is_dir():
            return  # one stat per poll when nothing was ever captured
        for step in self.settled - self._final:
            if all((r := self.index.get(u)) is not None and r.skip_reason not in INFRA_SKIPS
                   for u in units_for_step(self.manifest, step)):
                self._final.add(step)
        self.captures.collect(self._final)

    def _give_up_finding(self, outstanding: list[WorkUnit]) -> None:
        """Training is done, so every snapshot the trainer will publish is published: a dispatched step no
        poll has found for one lease duration (on this process's monotonic clock, which also covers a
        shared filesystem's slow visibility) gets a ref to where its snapshot should be. Its units then
        take the normal path and verification makes them ``ckpt_missing`` (or ``ckpt_corrupt`` for an
        unreadable marker) — instead of the fleet waiting forever for a snapshot that is gone."""
        unfound = {u.step for u in outstanding if u.step not in self.refs and u.step in self._dispatches}
        for step in self.policy.unfound_given_up(unfound):
            path = self._expected_snapshot(step)
            self.refs[step] = SnapshotRef(step, path, Marker(step, str(step), {}, {}, "missing", 0.0))
            self._warn_once(f"unfound:{step}", f"step {step} was dispatched but its snapshot {path} never appeared")

    def _expected_snapshot(self, step: int) -> Path:
        record = self._dispatches.get(step, {})
        if isinstance(record.get("snapshot"), str):
            return Path(record["snapshot"])
        root = Path(self.manifest.snapshot_roots[0]) if self.manifest.snapshot_roots else self.rundir.snapshots
        return snapshot_path(root, step, str(record.get("mode", "staging")))

    def _open_units(self, step: int, results: dict[WorkUnit, Result]) -> list[WorkUnit]:
        units = [u for u in units_for_step(self.manifest, step, self.grants)
                 if u not in results or self.policy.to_retry(u, results[u]) or self._tokenizer_found(u, results[u])]
        if not units:
            self.settled.add(step)
        return units

    def _tokenizer_found(self, unit: WorkUnit, result: Result) -> bool:
        """A ``no_tokenizer`` skip whose snapshot or ``RUN/base/`` now holds tokenizer files (the fix its message
        names was applied): re-evaluated, once per process, as a result of the next generation."""
        if result.skip_reason != TokenizerMissing.reason or unit in self.policy.retried:
            return False
        ref = self.refs.get(unit.step)
        return ref is not None and (has_tokenizer(ref.path) or has_tokenizer(self.rundir.base))

    def _generations(self, units: list[WorkUnit]) -> dict[WorkUnit, int]:
        """The result generation a claim of each unit writes: one past its current result, if it has one."""
        return {u: self.index.generation(u) + 1 for u in units if self.index.get(u) is not None}

    def _steps(self) -> set[int]:
        # TRAINING_DONE (or INTERRUPTED: a supervisor stopped the run) is read once per poll, *before* the
        # ledger: the trainer appends its last dispatch before either, so a worker that sees the run ended
        # also sees every dispatched step.
        self.training_done = self.rundir.ended()
        self.policy.saw_ended(self.training_done)
        steps = set(self.refs)
        if self.training_done:
            try:
                self._dispatches = dispatch_records(self.rundir.ledger_path)
                steps |= set(self._dispatches)
            except ValueError as e:  # the trainer reports it; the fleet still ends on what it discovered
                self._warn_once("ledger", f"cannot read the trainer's dispatches: {e}")
        if self.selection is not None:  # a re-evaluation run: only its selected steps
            steps = {s for s in steps if s in self.selection}
        if self.opts.catchup == "latest":
            return {max(steps)} if steps else set()
        return steps

    @staticmethod
    def _parsable_id(name: str) -> bool:
        try:
            WorkUnit.from_id(name)
        except ValueError:
            return False
        return True

    def _forget_finished(self, results: dict[WorkUnit, Result]) -> None:
        for unit in [u for u in self._tried if u in results]:
            self.claimer.forget(unit)
            self._tried.discard(unit)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            print(f"ckpteval worker: {message}", file=sys.stderr, flush=True)

    def _finished(self, outstanding: int) -> bool:
        awaiting = self.opts.once and self.policy.awaiting(  # --once: marker-less dirs not yet quiescent
            (str(d.discovery.root), name) for d in self.discoveries if d.foreign
            for name in d.discovery.awaiting_quiescence)
        return self.policy.finished(outstanding, self.training_done, awaiting)

    # -- units ---------------------------------------------------------------------------------------
    def run(self) -> int:
        """Work until done (see the module docstring); returns an exit code."""
        self.written = 0
        todo: deque[WorkUnit] = deque()  # the last poll's claimable units, in claim order, not yet tried
        generations: dict[WorkUnit, int] = {}
        while self.stop_signal is None:
            if self.policy.poll_due(bool(todo)):
                claimable, outstanding = self.poll()
                self.policy.polled()
                if not claimable:
                    if self._finished(outstanding):
                        return EXIT_DONE
                    self._sleep(self.opts.poll_interval_s)
                    continue
                todo = deque(order_units(claimable, self.opts.newest_first, spread=os.getpid()))
                generations = self._generations(claimable)
            claim = self.claimer.claim_next(todo, generations)  # between polls its result check skips units done since
            if claim is None:  # all held by other workers: wait, take over expired ones later
                self._sleep(self.opts.poll_interval_s)
                continue
            claimed_at = time.perf_counter()  # before the step-limit read: a unit's total_s covers that check
            if self._above_step_limit(claim.unit):  # a step passed between the poll and this claim
                claim.release()
                continue
            self._tried.add(claim.unit)
            self.released_last = False
            result = self._process(claim, claimed_at)
            if self.stop_signal is not None:
                break
            if self.policy.unhealthy_exit(result, self.released_last):
                self.out(f"engine unhealthy or failing for {self.policy.unhealthy_streak} units in a row: "
                         "exiting for a fresh start")
                return EXIT_UNHEALTHY
            if self.opts.max_units is not None and self.written >= self.opts.max_units:
                return EXIT_DONE
        return self._stop_code()

    def _above_step_limit(self, unit: WorkUnit) -> bool:
        """``backfill --until``: whether ``unit`` lies above the first passing step, re-read *after* the claim,
        so a step that passed before this claim was taken is never started (results written later are after
        the claim: that unit was already running)."""
        if self.step_limit is None:
            return False
        limit = self.step_limit(self._refresh(set(self.refs) | set(self._dispatches)))
        return limit is not None and unit.step > limit

    def _process(self, claim: Claim, claimed_at: float) -> Result | None:
        """Evaluate one claimed unit and publish its result; None when abandoned (nothing written).
        ``claimed_at`` (``perf_counter``) starts the result's ``total_s``, and ``written_at`` is stamped with it,
        so ``written_at - total_s`` is the wall time this worker held the claim from."""
        unit = claim.unit
        try:
            if claim.generation:
                self.policy.retried.add(unit)
            if self.stop_signal is not None:  # signalled between claim and start: same as mid-unit
                self.out(f"step={unit.step} {unit.label} abandoned: stop signal, lease released")
                return None
            result = self._evaluate_interruptibly(unit, self.refs[unit.step])
            if result is None:
                self.out(
                    f"step={unit.step} {unit.label} abandoned: stop signal, lease released"
                )
                return None
            if not claim.still_ours():  # not lost, its marker still its own (no syscall while fresh)
                self.out(f"step={unit.step} {unit.label} abandoned: lease lost (taken over)")
                return None
            if self.policy.leave_for_another(result, claim.attempt):
                self.released_last = True
                self.out(
                    f"step={unit.step} {unit.label} released after attempt {claim.attempt}: "
                    f"{result.skip_reason}: {result.message} (left for another worker, nothing written)"
                )
                return None
            result = dataclasses.replace(
                result,
                timings={**result.timings, "total_s": time.perf_counter() - claimed_at},
                written_at=time.time(),
                worker=self.identity,
                lease_token=claim.token,
                attempt=claim.attempt,
                snapshot=str(self.refs[unit.step].path),
                kept=result.kept if self.opts.keep_completions else None,
            )
            first = self.index.publish(result, claim.generation)
            self._overturn_if_lost(result)
            self.written += 1
            if first and self.on_result is not None:
                self.on_result(result)
            self.policy.proven |= result.ok
            self.out(_unit_line(result, first))
            return result
        finally:
            claim.release()

    def _overturn_if_lost(self, result: Result) -> None:
        """A result attested by a checksum not yet compared: if another checksum stood meanwhile, the units it
        scored are superseded (:func:`~ckpteval.jobs.eval.proof.attest.overturn_lost`) and its step is open again.
        The step's results are read only when this result's own checksum lost (one look at the standing record
        otherwise): results already there when a checksum stood were superseded by whoever made it stand."""
        if result.attest.get("checksums") and result.attest.get("state") != "compared" and lost(self.rundir, result):
            if overturn_lost(self.rundir, result.unit.step):
                self.settled.discard(result.unit.step)

    def _evaluate_interruptibly(self, unit: WorkUnit, ref: SnapshotRef) -> Result | None:
        """Run the unit in the helper thread so a stop signal can release the lease at once (None then)."""
        job = self.runner.submit(lambda: evaluate_unit(self.evaluator, unit, ref, self.opts.verify, self.verified))
        next_watch = time.monotonic() + self.opts.poll_interval_s
        while not job.done.wait(WAIT_SLICE_S):
            if self.stop_signal is not None:
                return None
            if time.monotonic() >= next_watch:
                self._watch_foreign()
                next_watch = time.monotonic() + self.opts.poll_interval_s
        if job.error is not None:
            raise job.error
        return job.result

    def _watch_foreign(self) -> None:
        """While a unit runs, keep polling the watched (foreign) roots: a trainer that rotates its saves
        faster than units finish still has every save seen — admitted, or counted lost — never missed."""
        for d in self.discoveries:
            if d.foreign:
                for ref in d.discovery.poll():
                    self.refs.setdefault(ref.step, ref)

    @property
    def busy(self) -> bool:
        """A unit's evaluation is still running (only after an abandoning stop)."""
        return self.runner.busy


def _unit_line(result: Result, first: bool) -> str:
    u, secs = result.unit, result.timings.get("total_s", 0.0)
    head = f"step={u.step} {u.label}"
    dup = "" if first else " (duplicate: another result was first)"
    if result.ok and result.metrics:  # an lm-eval task
        shown = " ".join(f"{k}={v:.4f}" for k, v in sorted(result.metrics.items()))
        return f"{head} {shown} {secs:.2f}s{dup}"
    if result.ok:
        n = len(result.scores)
        score = sum(result.scores) / n if n else float("nan")
        return f"{head} score={score:.4f} n={n} {secs:.2f}s{dup}"
    return f"{head} SKIP {result.skip_reason}: {result.message} {secs:.2f}s{dup}"
