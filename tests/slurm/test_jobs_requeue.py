"""Requeue on the real cluster: ``scontrol requeue`` of the eval service in the middle of a unit, and
the pre-timeout USR1 (``--signal=B:USR1@T``): the worker releases its lease, the job requeues itself,
and every point still lands exactly once."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from coord.results import ResultIndex
from tests.slurm.test_jobs_helpers import FN, finished_run, job_log, submit_job, unit_in_progress, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(170)]


def _service(run, watch: Path, delay_s: float, *extra: str) -> str:
    job, prepared = submit_job(
        "service", "--run-dir", str(run.path), "--watch", str(watch), "--engine", FN, "--gpus-per-worker", "0",
        "--cpus", "1", "--env", f"SUMBACKEND_DELAY_S={delay_s}", *extra, "--", "--poll-interval", "0.5",
    )
    assert "#SBATCH --requeue" in prepared.script
    return job


def test_scontrol_requeue_mid_unit(slurm_cluster, tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"  # "any trainer's" checkpoint dir, watched by the service
    run = finished_run(tmp_path, (10, 20), n_prompts=8, shard_size=4, snapshot_dir=ckpts)  # 4 units
    job = _service(run, ckpts, 4.0, "--time", "10")
    try:
        unit = wait_until(lambda: unit_in_progress(run), 90, "a unit in progress")
        t0 = time.time()
        slurm_cluster.run("scontrol", "requeue", job)
        wait_until(lambda: "restart 1 on" in job_log(run), 60, "the requeued job to start again")
        print(f"\n[service] scontrol requeue -> script running again: {time.time() - t0:.1f}s")
        wait_until(lambda: len(list(run.results.glob("*.json"))) == 4, 90, "every unit's result")
    finally:
        slurm_cluster.cancel(job)
    log = job_log(run)
    results = ResultIndex(run.results).refresh()
    assert len(results) == 4 and all(r.ok for r in results.values())
    assert not list((run.results / "duplicates").glob("*.json"))
    interrupted = next(r for u, r in results.items() if u.id == unit)
    assert interrupted.attempt == 2, log[-3000:]  # abandoned mid-unit, redone after the requeue
    assert "TERM (job cancelled, requeued" in log


def test_usr1_before_time_limit_releases_and_requeues(slurm_cluster, tmp_path: Path) -> None:
    run = finished_run(tmp_path, (10, 20), n_prompts=8, shard_size=4)  # 4 units of 15 s: outlives USR1
    # USR1 is due 50 s before the 1-minute limit; slurmctld checks limits about every 30 s
    job = _service(run, run.snapshots, 15.0, "--time", "1", "--signal-before", "50")
    try:
        wait_until(lambda: "restart 1 on" in job_log(run), 120, "the job to requeue itself and restart", poll=1)
        restarted = slurm_cluster.job_records(job)
    finally:
        slurm_cluster.cancel(job)
    log = job_log(run)
    first_run = log.split("restart 1 on")[0]
    assert "USR1 (time limit near" in first_run
    assert re.search(rf"worker j{job}-w0 stopped \(exit 3\)", first_run), first_run[-3000:]  # lease released
    assert f"scontrol requeue {job}" in first_run
    assert restarted and restarted[0].get("Restarts") == "1"
    assert not list((run.results / "duplicates").glob("*.json"))
