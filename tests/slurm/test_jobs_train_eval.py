"""The heterogeneous train+eval job on the real cluster, on CPU: the reference trainer on component 0,
two ``hf`` workers on component 1 (fake GPUs, one each), every point landing pinned; and a trainer
that dies takes the fleet down with it (no orphan GPUs)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpteval.coord.results.files import ResultIndex
from ckpteval.jobs.launch import api
from tests.slurm.test_jobs_helpers import JOB_ENV, completed_job_log, job_log, pids_of, wait_until
from tests.support.workers import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]

FLEET = ["--trainer-cpus", "1", "--cpus", "2", "--workers", "2", "--gpus-per-worker", "1", "--device", "cpu"]


def _submit_cli(*argv: str) -> str:
    """The real command line: ``ckpteval submit train-eval ...``; returns the job id it prints."""
    args = list(argv)
    cut = args.index("--")
    cmd = [sys.executable, "-m", "ckpteval.jobs.cli", "submit", "train-eval", *args[:cut], *JOB_ENV, *args[cut:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=60, check=True)
    assert "squeue -j" in proc.stderr and "ckpteval status" in proc.stderr
    return proc.stdout.strip()


def _eval_points(run: Path) -> dict[int, dict]:
    points = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "eval/step" in row:
            points[int(row["eval/step"])] = row
    return points


def test_het_job_end_to_end_points_pinned(slurm_cluster, tmp_path: Path) -> None:
    run = tmp_path / "run"
    t0 = time.monotonic()
    job = _submit_cli("--run-dir", str(run), "--time", "10", *FLEET, "--",
                      "--steps", "20", "--eval-interval", "10", "--eval-n-prompts", "16", "--eval-shard-size", "8",
                      "--threads", "1", "--no-progress", "--lease-duration", "20", "--lease-heartbeat", "4")
    log = completed_job_log(slurm_cluster, job, run, 150, "het job", t0)

    # every point landed, pinned to its step
    points = _eval_points(run)
    assert sorted(points) == [0, 10, 20], log[-3000:]  # step 0: the initial weights
    for step, row in points.items():
        assert row["eval/addition/weight_version/mean"] == step
        assert row["eval/addition/weight_version/mixed_version_ratio"] == 0
    # every unit exactly once, by the fleet's two workers
    results = ResultIndex(run / "results").refresh()
    assert len(results) == 6 and all(r.ok for r in results.values())  # 3 points x 2 shards
    assert not list((run / "results" / "duplicates").glob("*.json"))
    assert {r.worker["worker_id"] for r in results.values()} <= {f"j{job}-w0", f"j{job}-w1"}
    assert {r.worker.get("slurm_job_id") for r in results.values()} <= {job, str(int(job) + 1)}

    # the trainer learned where everyone runs; each worker got its own fake GPU
    nodes = re.search(r"trainer on (\S+), fleet of 2 worker\(s\) on (\S+)", log)
    assert nodes and nodes.group(1) != nodes.group(2), log[:2000]
    slots = sorted(re.findall(r"slot (\d) on (\S+): CUDA_VISIBLE_DEVICES='(\d)' \(step saw '0,1'\)", log))
    assert slots == [("0", nodes.group(2), "0"), ("1", nodes.group(2), "1")], log[:3000]
    assert "done (exit 0)" in log


def test_trainer_death_ends_the_fleet(slurm_cluster, tmp_path: Path) -> None:
    """Submitted through the notebook API (ckpteval.jobs.launch.api.submit_train_eval -> rendered sbatch script)."""
    run = tmp_path / "run"
    env = [JOB_ENV[i + 1] for i in range(0, len(JOB_ENV), 2)]
    job = api.submit_train_eval(
        run, time="10", trainer_cpus=1, cpus=2, workers=2, gpus_per_worker=1, device="cpu", env=env, grace=20,
        trainer_args=["--steps", "100000", "--eval-interval", "5", "--eval-n-prompts", "16",
                      "--eval-shard-size", "8", "--threads", "1", "--no-progress", "--lease-duration", "20",
                      "--lease-heartbeat", "4"],
    )
    try:
        # the fleet is working (a result landed), then the trainer dies hard
        wait_until(lambda: job.state() == "RUNNING", 60, "the job to run")
        wait_until(lambda: list((run / "results").rglob("*.json")) if (run / "results").is_dir() else None,
                   120, "a first result")
        assert job.status()["run_dir"] == str(run.resolve())
        trainer = wait_until(lambda: pids_of("ckpteval.jobs.cli", " train ", str(run)), 10, "the trainer's pid")
        for pid in trainer:
            os.kill(pid, signal.SIGKILL)
        state = job.wait(timeout_s=60, poll_s=0.5)
    finally:
        job.cancel()
    log = job_log(run)
    assert state == "FAILED", log[-3000:]
    assert slurm_cluster.job_state(job.job_id) == "FAILED"
    assert "trainer FAILED" in log
    # both workers were stopped through their preemption path (exit 3: lease released), none left
    assert re.search(rf"worker j{job.job_id}-w0 stopped \(exit 3\)", log), log[-3000:]
    assert re.search(rf"worker j{job.job_id}-w1 stopped \(exit 3\)", log), log[-3000:]
    assert not pids_of("ckpteval.jobs.cli", " worker ", str(run))
    assert not list((run / "leases").rglob("*.lock"))
    assert not (run / "TRAINING_DONE").exists()


def test_tmpfs_staging_refused_across_nodes(slurm_cluster, tmp_path: Path) -> None:
    """The batch script hands the trainer both components' nodes; a node-local (tmpfs) staging dir the
    fleet's node cannot see is refused before training starts, and the fleet never starts."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    run = tmp_path / "run"
    staging = Path("/dev/shm") / f"ckpteval-test-{tmp_path.name}"
    job = _submit_cli("--run-dir", str(run), "--time", "5", "--signal-before", "60", *FLEET, "--",
                      "--steps", "20", "--eval-interval", "10", "--eval-staging-dir", str(staging), "--threads", "1")
    try:
        state = slurm_cluster.wait_job(job, timeout=90, poll=0.5)
    finally:
        slurm_cluster.cancel(job)
    log = job_log(run)
    assert state == "FAILED", log[-3000:]
    assert "node-local" in log and "trainer FAILED" in log, log[-3000:]
    assert "worker j" not in log  # no worker was ever started
    assert not staging.exists() or not any(staging.iterdir())
