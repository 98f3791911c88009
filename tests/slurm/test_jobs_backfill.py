"""Backfill of a finished run on the real cluster: the sbatch array job and submitit's map_array.
Every unit is evaluated exactly once; resubmitting after completion submits nothing (`submit`) or does
nothing (submitit)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import submitit

from ckpteval.coord.results.files import ResultIndex
from ckpteval.jobs.launch import api
from ckpteval.jobs.launch.submit_checks import NothingToDo
from tests.slurm.test_jobs_helpers import FN, finished_run, job_log, submit_job
from tests.support.workers import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(150)]


def _written(run) -> dict[str, float]:
    return {u.id: r.written_at for u, r in ResultIndex(run.results).refresh().items()}


def test_array_backfill_once_then_nothing(slurm_cluster, tmp_path: Path) -> None:
    run = finished_run(tmp_path, (1, 2, 3), n_prompts=8, shard_size=2)  # 3 steps x 4 shards
    argv = ["backfill", "--run-dir", str(run.path), "--tasks", "3", "--parallelism", "2", "--engine", FN,
            "--gpus-per-worker", "0", "--cpus", "1", "--time", "5"]
    job, prepared = submit_job(*argv)
    assert "#SBATCH --array=0-2%2" in prepared.script
    states = [slurm_cluster.wait_job(f"{job}_{k}", timeout=90, poll=0.5) for k in range(3)]
    log = job_log(run)
    assert states == ["COMPLETED"] * 3, log[-3000:]

    results = ResultIndex(run.results).refresh()
    assert len(results) == 12 and all(r.ok for r in results.values())
    assert not list((run.results / "duplicates").glob("*.json"))
    attempts = [len(p.read_text().splitlines()) for p in run.leases.rglob("*.attempts")]
    assert attempts == [1] * 12  # each unit claimed once, by one array task
    assert {r.worker["worker_id"] for r in results.values()} <= {f"j{job}_{k}-w0" for k in range(3)}
    written = _written(run)

    # Resubmitting a run with nothing left: refused on the submit host, nothing queued, nothing rewritten
    with pytest.raises(NothingToDo, match="nothing to do"):
        submit_job(*argv)
    assert _written(run) == written
    assert [len(p.read_text().splitlines()) for p in run.leases.rglob("*.attempts")] == [1] * 12


def _slurm_executor(slurm_cluster, folder: Path) -> submitit.AutoExecutor:
    ex = submitit.AutoExecutor(folder, cluster="slurm")
    ex.update_parameters(timeout_min=5, cpus_per_task=1, slurm_partition=slurm_cluster.partition)
    return ex


@pytest.fixture
def job_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(REPO)


def test_submitit_map_array_backfill(slurm_cluster, tmp_path: Path, job_env: None) -> None:
    run = finished_run(tmp_path, (4, 8), n_prompts=8, shard_size=4)
    ex = _slurm_executor(slurm_cluster, tmp_path / "submitit")
    jobs = api.submit_backfill(ex, run.path, n_tasks=2, parallelism=1, engine=FN)
    assert len({j.job_id.split("_")[0] for j in jobs}) == 1  # one SLURM array
    assert [j.result()["exit_code"] for j in jobs] == [0, 0]
    results = ResultIndex(run.results).refresh()
    assert len(results) == 4 and all(r.ok for r in results.values())
    assert not list((run.results / "duplicates").glob("*.json"))
    written = _written(run)
    again = api.submit_backfill(ex, run.path, n_tasks=1, engine=FN)
    assert again[0].result()["exit_code"] == 0
    assert _written(run) == written
