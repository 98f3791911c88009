"""Helpers shared by tests/slurm/test_jobs_*.py (this module holds no tests).

Jobs are submitted the way users do it: ``ckpteval.jobs.launch.submit.prepare`` renders the real ``sbatch/`` script
from ``ckpteval submit`` arguments and ``submit_prepared`` runs ``sbatch --parsable`` on it. Runs
live under pytest's tmp dirs: all logical nodes are this host and jobs run as root, so that is the
"shared filesystem".
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.launch import submit
from tests.support.workers import REPO, make_eval_run, publish_model

FN = "fn:tests.support.workers:SumBackend"

# every job: one thread per process (2 shared cores), the repo importable for the test backend
JOB_ENV = ["--env", "OMP_NUM_THREADS=1", "--env", "MKL_NUM_THREADS=1", "--env", "TOKENIZERS_PARALLELISM=false",
           "--env", f"PYTHONPATH={REPO}"]


def submit_job(*argv: str) -> tuple[str, submit.Prepared]:
    """``ckpteval submit <argv>`` (kind first; trainer/worker args after ``--``): (job id, script)."""
    args = list(argv)
    cut = args.index("--") if "--" in args else len(args)
    prepared = submit.prepare([*args[:cut], *JOB_ENV, "--grace", "20", *args[cut:]])
    return submit.submit_prepared(prepared), prepared


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)


def completed_job_log(cluster: Any, job: str, run: Path | RunDir, timeout: float, label: str, t0: float) -> str:
    """Wait for ``job`` (cancelled whatever happens), print how long it took, require COMPLETED; its log."""
    try:
        state = cluster.wait_job(job, timeout=timeout, poll=1.0)
    finally:
        cluster.cancel(job)
    log = job_log(run)
    print(f"\n[{label}] submit -> {state} in {time.monotonic() - t0:.1f}s")
    assert state == "COMPLETED", log[-4000:]
    return log


def job_log(run: Path | RunDir) -> str:
    """Everything the run's jobs wrote to RUN/slurm/*.out."""
    path = run.path if isinstance(run, RunDir) else Path(run)
    return "".join(p.read_text(errors="replace") for p in sorted((path / "slurm").glob("*.out")))


def finished_run(tmp: Path, steps: tuple[int, ...], *, n_prompts: int = 8, shard_size: int = 4,
                 snapshot_dir: Path | None = None) -> RunDir:
    """A run whose training is over: real tiny-model snapshots for ``steps``, no results yet."""
    run = make_eval_run(tmp, n_prompts=n_prompts, shard_size=shard_size)
    for step in steps:
        publish_model(tmp, snapshot_dir or run.snapshots, step)
    run.mark_training_done(steps[-1])
    return run


def unit_in_progress(run: RunDir) -> str | None:
    """A unit whose lease is held and which has no result yet (someone is evaluating it now)."""
    for lock in run.leases.rglob("*.lock"):
        unit = lock.name[: -len(".lock")]
        if next(run.results.rglob(f"{unit}.json"), None) is None and lock.exists():
            return unit
    return None


def pids_of(*needles: str) -> list[int]:
    """PIDs of this host's processes (not srun) whose command line contains every needle."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        cmdline = b" ".join(argv).decode(errors="replace")
        if Path(argv[0].decode(errors="replace")).name == "srun":
            continue
        if all(n in cmdline for n in needles) and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found
