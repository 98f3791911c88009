"""``ckpteval backfill``: idempotent, and safe as concurrent array tasks over one run.

Real processes on real snapshots; the backend is the real fn backend ``tests.support.workers:SumBackend``
(one HF-engine backfill runs too, to show the default engine path end to end).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from coord.units import WorkUnit
from jobs.lifecycle import EXIT_DONE
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
    assert "backfill: done" in out and "6 units" in out and "100%" in out  # the tqdm bar
    first = results(run)
    assert sorted(first) == [WorkUnit(s, "addition", i) for s in (100, 200, 300) for i in (0, 1)]
    assert all(r.ok and set(r.weight_versions) == {version(run, r.unit.step)} for r in first.values())
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
