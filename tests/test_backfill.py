"""``ckpteval backfill``: idempotent, and safe as concurrent array tasks over one run.

Real processes on real snapshots; the backend is the real fn backend ``tests.support.workers:SumBackend``
(one HF-engine backfill runs too, to show the default engine path end to end).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.run.manifest import LeaseSettings
from ckpteval.coord.run.rundir import STEP_SUMMARY, step_dir_name
from ckpteval.coord.work.settle import settle_vanished
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.lifecycle import EXIT_DONE
from ckpteval.jobs.views.status.main import collect_status
from tests.support.workers import (
    duplicates,
    finish,
    kill_all,
    make_eval_run,
    publish_model,
    results,
    spawn,
    version,
)

FN = "fn:tests.support.workers:SumBackend"


def test_backfill_twice_second_finds_nothing(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=2)
    for step in (100, 200, 300):
        publish_model(tmp_path, run.snapshots, step)
    code, out = finish(spawn("backfill", "--run-dir", str(run.path), "--engine", "hf", "--poll-interval", "0.1"), 120)
    assert code == EXIT_DONE, out
    assert "backfill: done" in out and "6 units" in out and "backfill: 6/6 units" in out  # progress lines, no tty
    first = results(run)
    assert sorted(first) == [WorkUnit(s, "addition", i) for s in (100, 200, 300) for i in (0, 1)]
    assert all(r.ok and set(r.weight_versions) == {version(run, r.unit.step)} for r in first.values())
    summaries = sorted(p.parent.name for p in run.results.glob(f"step-*/{STEP_SUMMARY}"))  # status, plot read them
    assert summaries == [step_dir_name(s) for s in (100, 200, 300)]
    code, out = finish(spawn("backfill", "--run-dir", str(run.path), "--engine", FN, "--poll-interval", "0.1"), 30)
    assert code == EXIT_DONE and "nothing to do" in out and "step=" not in out, out
    assert results(run) == first


def test_concurrent_backfills_evaluate_each_unit_once(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=8, shard_size=4, engine={"fn": {"delay_s": 0.1}})
    for step in range(1, 11):
        publish_model(tmp_path, run.snapshots, step)
    procs = [spawn("backfill", "--run-dir", str(run.path), "--engine", FN, "--poll-interval", "0.1",
                   "--worker-id", f"task{i}") for i in range(2)]
    try:
        outs = [finish(p, timeout=60) for p in procs]
    finally:
        kill_all(procs)
    assert [code for code, _ in outs] == [EXIT_DONE, EXIT_DONE], outs
    got = results(run)
    assert len(got) == 20 and all(r.ok for r in got.values())
    assert duplicates(run) == []
    by_task = Counter(r.worker["worker_id"] for r in got.values())
    assert set(by_task) == {"task0", "task1"}, by_task  # both did work; neither repeated the other's


def test_backfill_of_an_interrupted_run_settles_units_whose_snapshot_is_gone_and_says_why(tmp_path: Path) -> None:
    """A run stopped early (RUN/INTERRUPTED) whose dispatched step 10 lost its snapshot (tmpfs wiped) and whose
    step 20 still has one: backfill scores step 20, makes step 10's units ``ckpt_missing`` (after one lease
    duration, as for TRAINING_DONE) instead of leaving them pending forever, and its last line counts the
    skips and names the reason — not a bare "done"."""
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=2, lease=LeaseSettings(1.0, 0.2))
    ledger = Ledger(run.ledger_path)
    for step in (10, 20):
        ledger.append("dispatched", step)
    publish_model(tmp_path, run.snapshots, 20)
    run.mark_interrupted("test", "SIGINT")
    code, out = finish(spawn("backfill", "--run-dir", str(run.path), "--engine", FN, "--poll-interval", "0.1"), 60)
    assert code == EXIT_DONE, out
    got = results(run)
    assert {u: r.skip_reason for u, r in got.items()} == {
        WorkUnit(10, "addition", 0): "ckpt_missing", WorkUnit(10, "addition", 1): "ckpt_missing",
        WorkUnit(20, "addition", 0): None, WorkUnit(20, "addition", 1): None}
    last = out.strip().splitlines()[-1]
    assert "4 evaluated here: 2 scored, 2 skipped (ckpt_missing x2" in last, out
    assert collect_status(run.path)["units"]["pending"] == []


def test_settle_vanished_marks_only_an_ended_runs_dispatched_steps_without_snapshot(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=2)
    ledger = Ledger(run.ledger_path)
    for step in (10, 20):
        ledger.append("dispatched", step)
    publish_model(tmp_path, run.snapshots, 20)
    assert settle_vanished(run, "why") == []  # still running: a snapshot may yet appear
    run.mark_interrupted("test", "SIGTERM")
    assert settle_vanished(run, "why") == [WorkUnit(10, "addition", 0), WorkUnit(10, "addition", 1)]
    assert {r.skip_reason for r in results(run).values()} == {"ckpt_missing"}
    assert settle_vanished(run, "why") == []  # idempotent: they have results now
