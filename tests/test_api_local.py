"""ckpteval.jobs.launch.api on submitit's local executor (no SLURM): fleet, array backfill, checkpoint + requeue.

Real worker processes on real tiny-model snapshots; the backend is the real fn backend
``tests.support.workers:SumBackend`` (reads the snapshot's safetensors; ``SUMBACKEND_DELAY_S`` slows each
unit down so a preemption lands in the middle of one).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import submitit

from ckpteval.coord.run.rundir import unit_dir
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.launch import api
from tests.support.workers import (
    REPO,
    duplicates,
    lease_holder_pid,
    make_eval_run,
    publish_model,
    results,
    wait_for,
)

FN = "fn:tests.support.workers:SumBackend"

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def worker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the submitit job processes inherit: the repo importable, one thread each."""
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(REPO)


def _finished_run(tmp_path: Path, steps: tuple[int, ...], n_prompts: int = 8, shard_size: int = 4):
    run = make_eval_run(tmp_path, n_prompts=n_prompts, shard_size=shard_size)
    for step in steps:
        publish_model(tmp_path, run.snapshots, step)
    run.mark_training_done(steps[-1])
    return run


def _executor(tmp_path: Path) -> submitit.AutoExecutor:
    ex = submitit.AutoExecutor(tmp_path / "submitit", cluster="local")
    ex.update_parameters(timeout_min=5)
    return ex


FAST_POLL = ["--poll-interval", "0.2"]  # a worker whose units are all held by the other polls again soon (default 2 s)


def _results(jobs: list[submitit.Job]) -> list[Any]:
    """Each job's result, once all are done: polled every 0.05 s (``Job.result`` itself sleeps in 1 s steps)."""
    wait_for(lambda: all(job.done() for job in jobs), 170, 0.05, "the submitit jobs to end")
    return [job.result() for job in jobs]


def test_fleet_on_local_executor(tmp_path: Path, worker_env: None) -> None:
    run = _finished_run(tmp_path, (10, 20))
    jobs = api.submit_fleet(_executor(tmp_path), run.path, 2, engine=FN, worker_args=FAST_POLL)
    outcomes = _results(jobs)
    assert [o["exit_code"] for o in outcomes] == [0, 0]
    got = results(run)
    assert len(got) == 4 and all(r.ok for r in got.values())
    assert {r.worker["worker_id"] for r in got.values()} <= {"fleet-w0", "fleet-w1"}
    assert duplicates(run) == []


def test_backfill_map_array_is_idempotent(tmp_path: Path, worker_env: None) -> None:
    run = _finished_run(tmp_path, (1, 2, 3))
    ex = _executor(tmp_path)
    first = api.submit_backfill(ex, run.path, n_tasks=2, parallelism=2, engine=FN, worker_args=FAST_POLL)
    assert [r["exit_code"] for r in _results(first)] == [0, 0]
    got = results(run)
    assert len(got) == 6 and all(r.ok for r in got.values())
    written = {u: r.written_at for u, r in got.items()}
    tasks = {r.worker["worker_id"].rsplit("-t", 1)[-1] for r in got.values()}
    assert tasks <= {"0", "1"}

    again = api.submit_backfill(ex, run.path, n_tasks=2, engine=FN, worker_args=FAST_POLL)
    assert [r["exit_code"] for r in _results(again)] == [0, 0]
    assert {u: r.written_at for u, r in results(run).items()} == written  # nothing re-evaluated
    assert "nothing to do" in again[0].stdout()
    assert duplicates(run) == []


def test_checkpoint_stops_the_worker_and_requeues(tmp_path: Path, worker_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _finished_run(tmp_path, (5,), n_prompts=12, shard_size=4)  # 3 units
    monkeypatch.setenv("SUMBACKEND_DELAY_S", "1")  # a unit lasts 1 s: the lease is seen (0.1 s polls) and signalled mid-unit
    job = api.submit_fleet(_executor(tmp_path), run.path, 1, engine=FN)[0]

    # a unit is in progress: its lease file names the worker's pid; its parent is the submitit task
    def holder() -> tuple[str, int] | None:
        held = lease_holder_pid(run)
        return next(((u, pid) for u, pid in held.items()
                     if not (unit_dir(run.results, WorkUnit.from_id(u).step) / f"{u}.json").exists()), None)

    unit, worker_pid = wait_for(holder, 60, 0.1, "a worker holding a lease")
    with open(f"/proc/{worker_pid}/stat") as f:
        task_pid = int(f.read().rsplit(")", 1)[1].split()[1])
    os.kill(task_pid, signal.SIGUSR2)  # what submitit's timeout/preemption signal does

    assert _results([job])[0]["exit_code"] == 0  # the requeued task finished the run
    got = results(run)
    assert len(got) == 3 and all(r.ok for r in got.values())
    assert duplicates(run) == []
    interrupted = next(r for u, r in got.items() if u.id == unit)
    assert interrupted.attempt == 2  # released mid-unit, then taken again by the requeued task
    assert {r.worker["pid"] for r in got.values()} != {worker_pid}  # the requeued task did work
    log = job.stdout() + (job.stderr() or "")
    assert "Requeued" in log or "requeue" in log.lower(), log[-3000:]
