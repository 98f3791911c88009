"""Requeue on the real cluster: ``scontrol requeue`` of the eval service in the middle of a unit, and
the pre-timeout USR1 (``--signal=B:USR1@T``): the worker releases its lease, the job requeues itself,
and every point still lands exactly once."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from ckpteval.coord.results.files import ResultIndex
from ckpteval.coord.run.rundir import RunDir
from tests.slurm.test_jobs_helpers import FN, finished_run, job_log, submit_job, unit_in_progress, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(170)]


def _service(run, watch: Path, delay_s: float, *extra: str) -> str:
    job, prepared = submit_job(
        "service", "--run-dir", str(run.path), "--watch", str(watch), "--engine", FN, "--gpus-per-worker", "0",
        "--cpus", "1", "--env", f"SUMBACKEND_DELAY_S={delay_s}", *extra, "--", "--poll-interval", "0.5",
    )
    assert "#SBATCH --requeue" in prepared.script
    return job


def _restarted(cluster, job: str, run) -> bool:
    """The job's second incarnation has started; meanwhile the idle test cluster's backfill scheduler is
    woken as a busy cluster's would be (:meth:`SlurmCluster.nudge`)."""
    cluster.nudge(job)
    return "restart 1 on" in job_log(run)


def test_scontrol_requeue_mid_unit(slurm_cluster, tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"  # "any trainer's" checkpoint dir, watched by the service
    run = finished_run(tmp_path, (10, 20), n_prompts=8, shard_size=4, snapshot_dir=ckpts)  # 4 units
    job = _service(run, ckpts, 4.0, "--time", "10")
    try:
        unit = wait_until(lambda: unit_in_progress(run), 90, "a unit in progress")
        t0 = time.time()
        slurm_cluster.run("scontrol", "requeue", job)
        wait_until(lambda: _restarted(slurm_cluster, job, run), 60, "the requeued job to start again")
        print(f"\n[service] scontrol requeue -> script running again: {time.time() - t0:.1f}s")
        wait_until(lambda: len(list(run.results.glob("step-*/*.json"))) == 4, 90, "every unit's result")
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
        wait_until(lambda: _restarted(slurm_cluster, job, run), 120, "the job to requeue itself and restart", poll=1)
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


# -- the heterogeneous train+eval job with an explicit staging dir (issue 16) -------------------------------
HET = ["--trainer-cpus", "1", "--cpus", "2", "--workers", "2", "--gpus-per-worker", "1", "--device", "cpu",
       "--engine", FN, "--env", "SUMBACKEND_DELAY_S=1.0"]
STEPS, INTERVAL = 60, 10


def _het_job(tmp_path: Path) -> tuple[Path, Path, str]:
    """A train+eval job whose snapshots go to an explicit ``--eval-staging-dir`` (shared: all nodes are this
    host); one point in flight at a time and 1 s units keep training going for a while."""
    run, staging = tmp_path / "run", tmp_path / "staging"
    job, _ = submit_job(
        "train-eval", "--run-dir", str(run), "--time", "10", *HET, "--",
        "--steps", str(STEPS), "--eval-interval", str(INTERVAL), "--eval-staging-dir", str(staging),
        "--eval-n-prompts", "8", "--eval-shard-size", "4", "--eval-max-in-flight", "1", "--ckpt-interval", "5",
        "--threads", "1", "--no-progress", "--lease-duration", "20", "--lease-heartbeat", "4",
    )
    return run, staging, job


def _every_point_once(run: Path, staging: Path, log: str) -> None:
    from tests.chaos.harness import tally

    manifest = RunDir.open(run).manifest()
    assert [Path(r).parent for r in manifest.snapshot_roots] == [staging.resolve()], manifest.snapshot_roots
    assert RunDir(run).training_done() == STEPS, log[-4000:]
    t = tally(run, range(0, STEPS + 1, INTERVAL))
    assert t.lost == [] and t.unexpected == [] and t.dup_ingestions == 0, (t, log[-3000:])
    assert t.units_without_result == [] and set(t.skips) <= {"crashed"}, (t, log[-3000:])
    assert "does not list" not in log and "trainer FAILED" not in log, log[-4000:]


def _training_in_progress(run: Path) -> bool:
    """A result landed and training is not done: the trainer is mid-run."""
    return (run / "results").is_dir() and any((run / "results").rglob("*.json")) \
        and not (run / "TRAINING_DONE").exists()


@pytest.mark.timeout(600)
def test_het_job_with_staging_dir_requeued_resumes_and_drains(slurm_cluster, tmp_path: Path) -> None:
    """``scontrol requeue`` mid-training: the batch script stops every step (TERM), SLURM requeues the
    job, the trainer resumes with ``--resume`` and the same explicit ``--eval-staging-dir`` (refused
    before the fix: "snapshot_roots ... does not list"), the fleet drains, every point is logged once."""
    run, staging, job = _het_job(tmp_path)
    try:
        wait_until(lambda: _training_in_progress(run), 150, "a result while training runs")
        slurm_cluster.run("scontrol", "requeue", job)
        wait_until(lambda: _restarted(slurm_cluster, job, run), 240, "the requeued job to start again", poll=1)
        state = slurm_cluster.wait_job(job, timeout=200, poll=1.0)
        records = slurm_cluster.job_records(job)
    finally:
        slurm_cluster.cancel(job)
    log = job_log(run)
    assert state == "COMPLETED", log[-4000:]
    assert records and records[0].get("Restarts") == "1", records
    _every_point_once(run, staging, log)


@pytest.mark.timeout(600)
def test_het_job_with_staging_dir_usr1_requeues_itself_and_finishes(slurm_cluster, tmp_path: Path) -> None:
    """The pre-timeout USR1 (what ``--signal=B:USR1@T`` sends the batch shell; sent here with ``scancel
    --batch --signal=USR1`` so it lands mid-training on a loaded machine): the trainer checkpoints and exits
    75, the workers release their leases, the job requeues itself, resumes and finishes; every point once."""
    run, staging, job = _het_job(tmp_path)
    try:
        wait_until(lambda: _training_in_progress(run), 150, "a result while training runs")
        slurm_cluster.run("scancel", "--batch", "--signal=USR1", job)
        wait_until(lambda: _restarted(slurm_cluster, job, run), 240, "the job to requeue itself and restart", poll=1)
        state = slurm_cluster.wait_job(job, timeout=200, poll=1.0)
    finally:
        slurm_cluster.cancel(job)
    log = job_log(run)
    first_run = log.split("restart 1 on")[0]
    assert "USR1 (time limit near" in first_run and f"scontrol requeue {job}" in first_run, first_run[-3000:]
    assert "trainer preempted" in first_run, first_run[-3000:]  # exit 75: checkpoint saved
    assert state == "COMPLETED", log[-4000:]
    _every_point_once(run, staging, log)
