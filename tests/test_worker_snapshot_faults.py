"""A snapshot deleted or damaged *after* the worker verified it (between verification and the load, or
while a backend reads it) is that snapshot's skip — ``ckpt_missing`` / ``ckpt_corrupt`` — not ``unhealthy``
(which restarts a healthy engine and, repeated, makes the worker quit for a fresh node) nor ``crashed``.

Found by the chaos suite (tests/chaos/test_corrupt_snapshots.py). Real engines, real snapshots; the
damage is done by a wrapper around the real evaluator, at the one moment a test cannot otherwise hit.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.run.manifest import LeaseSettings
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery, SnapshotRef
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
from ckpteval.jobs.eval.worker.evaluators import EngineEvaluator, Evaluation, FnEvaluator, evaluate_unit
from ckpteval.jobs.eval.worker.loop import Worker
from ckpteval.jobs.eval.worker.options import WorkerOptions
from ckpteval.jobs.lifecycle import EXIT_DONE
from tests.support.workers import SumBackend, make_eval_run, publish_model, results


class DamageThenEvaluate:
    """The real evaluator, with ``damage(snapshot_dir)`` done after verification, before it runs."""

    def __init__(self, inner, damage: Callable[[Path], None]) -> None:
        self.inner, self.damage = inner, damage
        self.cache = inner.cache  # the Evaluator protocol's run datasets and manifest

    def evaluate(self, unit: WorkUnit, ref: SnapshotRef, timings: dict[str, float]) -> Evaluation:
        self.damage(ref.path)
        return self.inner.evaluate(unit, ref, timings)

    def close(self) -> None:
        self.inner.close()


def _delete(d: Path) -> None:
    shutil.rmtree(d)


def _truncate(d: Path) -> None:
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(4096)


def _setup(tmp_path: Path):
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4)
    publish_model(tmp_path, run.snapshots, 1)
    (ref,) = SnapshotDiscovery(run.snapshots).poll()
    return run, ref, DatasetCache(run, run.manifest())


@pytest.mark.parametrize(("damage", "reason"), [(_delete, "ckpt_missing"), (_truncate, "ckpt_corrupt")],
                         ids=["deleted", "truncated"])
def test_hf_engine_load_of_a_vanished_snapshot_is_not_unhealthy(tmp_path: Path, damage, reason: str) -> None:
    run, ref, cache = _setup(tmp_path)
    evaluator = DamageThenEvaluate(EngineEvaluator(HFEngine(device="cpu"), cache, 1.0, 60.0), damage)
    result = evaluate_unit(evaluator, WorkUnit(1, "addition", 0), ref, "fast")
    assert result.skip_reason == reason, result.message
    assert "after verification" in result.message


class StrictSumBackend(SumBackend):
    """Refuses a directory without weights, as a real loader does (SumBackend would score it as 0)."""

    def evaluate_checkpoint(self, checkpoint_dir: str, input: dict) -> dict:  # noqa: A002
        if not (Path(checkpoint_dir) / "model.safetensors").is_file():
            raise OSError(f"{checkpoint_dir}: no model.safetensors")
        return super().evaluate_checkpoint(checkpoint_dir, input)


def test_fn_backend_reading_a_vanished_snapshot_is_ckpt_missing(tmp_path: Path) -> None:
    run, ref, cache = _setup(tmp_path)
    evaluator = DamageThenEvaluate(FnEvaluator(StrictSumBackend(), cache), _delete)
    result = evaluate_unit(evaluator, WorkUnit(1, "addition", 0), ref, "fast")
    assert result.skip_reason == "ckpt_missing", result.message


def test_a_failing_engine_on_an_intact_snapshot_is_still_unhealthy(tmp_path: Path) -> None:
    run, ref, cache = _setup(tmp_path)

    class DeadOnLoad(HFEngine):
        def load(self, snapshot_dir: str, weight_version: str) -> None:
            raise OSError("device lost")

    evaluator = EngineEvaluator(DeadOnLoad(device="cpu"), cache, 1.0, 60.0)
    result = evaluate_unit(evaluator, WorkUnit(1, "addition", 0), ref, "fast")
    assert result.skip_reason in {"unhealthy", "crashed"}, result.message


def test_vanished_snapshots_never_retire_a_healthy_worker(tmp_path: Path) -> None:
    """Five snapshots deleted under the worker in a row: five ckpt_missing units, the worker carries on
    (before the fix: five ``unhealthy`` units and EXIT_UNHEALTHY with --max-unhealthy 5)."""
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4)
    for step in range(1, 6):
        publish_model(tmp_path, run.snapshots, step)
    opts = WorkerOptions(run_dir=run.path, once=True, poll_interval_s=0.05, pin_timeout_s=1.0, max_unhealthy=5)
    cache = DatasetCache(run, run.manifest())
    evaluator = DamageThenEvaluate(EngineEvaluator(HFEngine(device="cpu"), cache, 1.0, 60.0), _delete)
    worker = Worker(run, opts, evaluator, out=lambda _line: None)
    try:
        code = worker.run()
    finally:
        evaluator.close()
    assert code == EXIT_DONE
    assert {r.skip_reason for r in results(run).values()} == {"ckpt_missing"} and len(results(run)) == 5


# -- a dispatched snapshot that never shows up ------------------------------------------------------------
def _fleet_worker(run) -> Worker:
    opts = WorkerOptions(run_dir=run.path, poll_interval_s=0.05, pin_timeout_s=1.0)
    return Worker(run, opts, FnEvaluator(StrictSumBackend(), DatasetCache(run, run.manifest())),
                  out=lambda _line: None)


@pytest.mark.parametrize("fault", ["deleted before discovery", "unreadable marker"])
def test_fleet_ends_when_a_dispatched_snapshot_never_appears(tmp_path: Path, fault: str) -> None:
    """Training done, step 2 dispatched, its snapshot gone before any worker saw it (or its marker
    unreadable, so discovery never reports it): after one lease duration the fleet records the documented
    skip and exits, instead of waiting forever (and the trainer logging it only after its drain timeout)."""
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=2, lease=LeaseSettings(1.0, 0.2))
    ledger = Ledger(run.ledger_path)
    for step in (1, 2, 3):
        path = publish_model(tmp_path, run.snapshots, step)
        ledger.append("dispatched", step, mode="staging", snapshot=str(path))
    doomed = run.snapshots / "step-0000000002"
    if fault == "deleted before discovery":
        shutil.rmtree(doomed)
    else:
        (doomed / ".complete").write_text("{not json")
    run.mark_training_done(3)
    done_at = time.monotonic()
    worker = _fleet_worker(run)
    try:
        assert worker.run() == EXIT_DONE
    finally:
        worker.evaluator.close()
    waited = time.monotonic() - done_at
    want = "ckpt_missing" if fault == "deleted before discovery" else "ckpt_corrupt"
    got = {u: r.skip_reason for u, r in results(run).items()}
    assert got == {WorkUnit(s, "addition", i): (want if s == 2 else None) for s in (1, 2, 3) for i in (0, 1)}
    assert waited >= 1.0  # a lease duration: a slow shared filesystem may still show the snapshot


def test_fleet_keeps_waiting_for_a_missing_snapshot_while_training_runs(tmp_path: Path) -> None:
    """Before TRAINING_DONE a dispatched step without a snapshot is an export in flight: never given up."""
    run = make_eval_run(tmp_path, n_prompts=2, shard_size=2, lease=LeaseSettings(0.3, 0.1))
    Ledger(run.ledger_path).append("dispatched", 1, mode="staging")
    worker = _fleet_worker(run)
    polls: list[int] = []

    def on_poll(outstanding: int) -> None:
        polls.append(outstanding)
        if len(polls) == 20:  # 1 s: three lease durations with no snapshot, training still running
            assert results(run) == {}
            publish_model(tmp_path, run.snapshots, 1)
            run.mark_training_done(1)

    worker.on_poll = on_poll
    try:
        assert worker.run() == EXIT_DONE
    finally:
        worker.evaluator.close()
    (r,) = results(run).values()
    assert r.ok
