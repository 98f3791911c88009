"""A snapshot deleted or damaged *after* the worker verified it (between verification and the load, or
while a backend reads it) is that snapshot's skip — ``ckpt_missing`` / ``ckpt_corrupt`` — not ``unhealthy``
(which restarts a healthy engine and, repeated, makes the worker quit for a fresh node) nor ``crashed``.

Found by the chaos suite (tests/chaos/test_corrupt_snapshots.py). Real engines, real snapshots; the
damage is done by a wrapper around the real evaluator, at the one moment a test cannot otherwise hit.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from coord.discovery import SnapshotDiscovery, SnapshotRef
from coord.units import WorkUnit
from jobs.engines.hf import HFEngine
from jobs.scoring import DatasetCache
from jobs.worker import (
    EXIT_DONE,
    EngineEvaluator,
    Evaluation,
    FnEvaluator,
    Worker,
    WorkerOptions,
    evaluate_unit,
)
from tests.workerutil import SumBackend, make_eval_run, publish_model, results


class DamageThenEvaluate:
    """The real evaluator, with ``damage(snapshot_dir)`` done after verification, before it runs."""

    def __init__(self, inner, damage: Callable[[Path], None]) -> None:
        self.inner, self.damage = inner, damage

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
