"""The throw-away cluster really does what the product relies on: het jobs with GPUs, requeue,
pre-timeout signals, accounting (sacct) and several jobs at once on one small host."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]


def _wait_file(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size > 0:
            return True
        time.sleep(0.2)
    return False


def _kv(text: str) -> dict[str, dict[str, str]]:
    """Lines "tag: k=v k=v" -> {tag: {k: v}}."""
    out = {}
    for line in text.splitlines():
        tag, sep, rest = line.partition(":")
        if sep:
            out[tag.strip()] = dict(tok.split("=", 1) for tok in rest.split() if "=" in tok)
    return out


def test_het_job_components_on_distinct_nodes_with_gpus(slurm_cluster, tmp_path):
    out = tmp_path / "het.out"
    script = """#!/bin/bash
#SBATCH --ntasks=1 --cpus-per-task=1
#SBATCH hetjob
#SBATCH --ntasks=1 --gpus=2
echo "batch: t=$(date +%s.%N) node=$SLURMD_NODENAME hg0=$SLURM_JOB_NODELIST_HET_GROUP_0 hg1=$SLURM_JOB_NODELIST_HET_GROUP_1"
srun --het-group=1 bash -c 'echo "step1: node=$SLURMD_NODENAME cvd=$CUDA_VISIBLE_DEVICES hg1=$SLURM_JOB_NODELIST_HET_GROUP_1"'
"""
    t_submit = time.time()
    job = slurm_cluster.submit(script, f"--output={out}")
    state = slurm_cluster.wait_job(job, timeout=60)
    text = out.read_text() if out.exists() else "<no output>"
    assert state == "COMPLETED", text
    info = _kv(text)
    batch, step1 = info["batch"], info["step1"]
    print(f"\n[het job] submit->batch start {float(batch['t']) - t_submit:.1f}s: {info}")

    # components on different nodes, the batch script on component 0's node
    assert batch["hg0"] and batch["hg1"] and batch["hg0"] != batch["hg1"], text
    assert batch["node"] == batch["hg0"], text
    # component 1's step runs on component 1's node, sees its node list and both fake GPUs
    assert step1["node"] == batch["hg1"] != batch["node"], text
    assert step1.get("hg1") == batch["hg1"], text
    assert len(step1.get("cvd", "").split(",")) == 2, text

    records = slurm_cluster.job_records(job)
    if records:  # still in slurmctld memory: two components, disjoint nodes
        assert len(records) == 2
        assert records[0]["NodeList"] != records[1]["NodeList"]


def test_requeue_brings_running_job_back(slurm_cluster, tmp_path):
    script = f"""#!/bin/bash
#SBATCH --requeue --open-mode=append
date +%s.%N > {tmp_path}/started.${{SLURM_RESTART_COUNT:-0}}
sleep 300
"""
    job = slurm_cluster.submit(script, f"--output={tmp_path}/rq.out")
    try:
        assert slurm_cluster.wait_job(job, {"RUNNING"}, timeout=30) == "RUNNING"
        assert _wait_file(tmp_path / "started.0", 15), "batch script did not start"
        t0 = time.time()
        slurm_cluster.run("scontrol", "requeue", job)
        assert _wait_file(tmp_path / "started.1", 50), (
            f"not restarted within 50s; state {slurm_cluster.job_state(job)}"
        )
        t_restart = float((tmp_path / "started.1").read_text())
        assert slurm_cluster.job_state(job) == "RUNNING"
        rec = slurm_cluster.job_records(job)[0]
        assert rec.get("Restarts") == "1"
        print(f"\n[requeue] scontrol requeue -> script running again: {t_restart - t0:.1f}s")
    finally:
        slurm_cluster.cancel(job)


def test_pre_timeout_signal_reaches_batch_script(slurm_cluster, tmp_path):
    marker = tmp_path / "usr1"
    # USR1 is due 55 s before the 60 s limit; slurmctld checks limits about every 30 s.
    script = f"""#!/bin/bash
#SBATCH --time=1 --signal=B:USR1@55
t0=$(date +%s.%N)
trap 'echo "$t0 $(date +%s.%N)" > {marker}; exit 0' USR1
while true; do sleep 1 & wait $!; done
"""
    job = slurm_cluster.submit(script, f"--output={tmp_path}/sig.out")
    try:
        state = slurm_cluster.wait_job(job, timeout=100)
        assert marker.exists(), f"no USR1 before the job ended ({state})"
        start, got = map(float, marker.read_text().split())
        print(f"\n[signal] USR1 {got - start:.1f}s after start (limit 60s)")
        assert got - start < 60
        assert state == "COMPLETED"  # the trap's exit 0, not TIMEOUT
    finally:
        slurm_cluster.cancel(job)


def test_sacct_reports_failed_and_cancelled_jobs(slurm_cluster, tmp_path):
    failed = slurm_cluster.submit("#!/bin/bash\nexit 3\n", f"--output={tmp_path}/f.out")
    cancelled = slurm_cluster.submit("#!/bin/bash\nsleep 300\n", f"--output={tmp_path}/c.out")
    assert slurm_cluster.wait_job(cancelled, {"RUNNING"}, timeout=30) == "RUNNING"
    slurm_cluster.cancel(cancelled)
    assert slurm_cluster.wait_job(failed, timeout=30) == "FAILED"
    assert slurm_cluster.wait_job(cancelled, timeout=30) == "CANCELLED"

    # what submitit reads: sacct must know both jobs, with their final states
    deadline = time.monotonic() + 20
    while True:
        out = slurm_cluster.run(
            "sacct", "-n", "-P", "-X", "-o", "JobID,State,ExitCode", "-j", f"{failed},{cancelled}"
        ).stdout
        rows = {line.split("|")[0]: line.split("|")[1:] for line in out.splitlines() if line}
        if rows.get(failed, [""])[0] == "FAILED" and rows.get(cancelled, [""])[0].startswith("CANCELLED"):
            break
        assert time.monotonic() < deadline, f"sacct does not report the jobs: {out!r}"
        time.sleep(0.5)
    assert rows[failed][1] == "3:0"


def test_several_small_jobs_run_at_once(slurm_cluster, tmp_path):
    n = len(slurm_cluster.nodes) * 2
    jobs = [
        slurm_cluster.submit("#!/bin/bash\nsleep 300\n", "--ntasks=1", f"--output={tmp_path}/%j.out")
        for _ in range(n)
    ]
    try:
        states = [slurm_cluster.wait_job(j, {"RUNNING"}, timeout=30) for j in jobs]
        assert states == ["RUNNING"] * n
    finally:
        slurm_cluster.cancel(*jobs)
