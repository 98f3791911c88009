"""ckpteval.jobs.launch.api with submitit's SLURM executor on the real cluster: an eval fleet, and a service that
submitit preempts mid-unit (its USR2) -- the worker releases its lease, the job requeues, nothing is
lost or duplicated. (Backfill via map_array is in test_jobs_backfill.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import submitit

from ckpteval.coord.results.files import ResultIndex
from ckpteval.jobs.launch import api
from tests.slurm.test_jobs_helpers import FN, finished_run, unit_in_progress, wait_until
from tests.support.workers import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(150)]


@pytest.fixture
def executor(slurm_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> submitit.AutoExecutor:
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(REPO)
    ex = submitit.AutoExecutor(tmp_path / "submitit", cluster="slurm")
    ex.update_parameters(timeout_min=5, cpus_per_task=1, slurm_partition=slurm_cluster.partition)
    return ex


def test_submitit_fleet(executor: submitit.AutoExecutor, tmp_path: Path) -> None:
    run = finished_run(tmp_path, (3, 6), n_prompts=8, shard_size=4)
    jobs = api.submit_fleet(executor, run.path, 2, engine=FN)
    assert [j.result()["exit_code"] for j in jobs] == [0, 0]
    results = ResultIndex(run.results).refresh()
    assert len(results) == 4 and all(r.ok for r in results.values())
    assert {r.worker["worker_id"] for r in results.values()} <= {"fleet-w0", "fleet-w1"}
    assert not list((run.results / "duplicates").glob("*.json"))


def test_submitit_service_preempted_mid_unit_requeues(
    slurm_cluster, executor: submitit.AutoExecutor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpts = tmp_path / "ckpts"
    run = finished_run(tmp_path, (7,), n_prompts=12, shard_size=4, snapshot_dir=ckpts)  # 3 units
    monkeypatch.setenv("SUMBACKEND_DELAY_S", "3")
    job = api.submit_service(executor, run.path, ckpts, engine=FN, worker_args=["--poll-interval", "0.5"])
    try:
        unit = wait_until(lambda: unit_in_progress(run), 90, "a unit in progress")
        job._interrupt()  # submitit's preemption signal (scancel --signal USR2): checkpoint + requeue
        wait_until(lambda: len(list(run.results.glob("step-*/*.json"))) == 3, 100, "every unit's result")
        records = slurm_cluster.job_records(job.job_id)
    finally:
        job.cancel(check=False)
    results = ResultIndex(run.results).refresh()
    assert all(r.ok for r in results.values())
    assert not list((run.results / "duplicates").glob("*.json"))
    assert next(r for u, r in results.items() if u.id == unit).attempt == 2
    assert records and int(records[0].get("Restarts", "0")) >= 1
