"""The Python API for notebooks: eval fleets, backfills and services as submitit jobs.

Owns wrapping ``ckpteval worker`` / ``backfill`` as requeueable submitit jobs (:class:`WorkerTask`) and handing
heterogeneous train+eval jobs to ``ckpteval submit``. Limits: submitit needs ``sacct`` to follow SLURM jobs; the
worker's flags are checked in the job. See docs/USER_GUIDE.md "Running on an existing SLURM cluster".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit
from submitit.helpers import Checkpointable, DelayedSubmission

from ckpteval.jobs.launch import submit as submit_mod
from ckpteval.jobs.lifecycle import EXIT_DONE, EXIT_PREEMPTED


def _ignore_usr2() -> None:  # runs in the child between fork and exec
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


class WorkerTask(Checkpointable):
    """``python -m ckpteval.jobs.cli <command> <argv>`` as a requeueable submitit job (command: worker|backfill)."""

    def __init__(
        self,
        argv: Sequence[str],
        command: str = "worker",
        *,
        python: str | None = None,
        grace_s: float = 30.0,
        preempted_wait_s: float = 60.0,
    ) -> None:
        if command not in ("worker", "backfill"):
            raise ValueError(f"WorkerTask: command must be worker or backfill, not {command!r}")
        self.argv = list(argv)
        self.command = command
        self.python = python
        self.grace_s = grace_s
        self.preempted_wait_s = preempted_wait_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = False

    # submitit pickles the task (at submission and in checkpoint): never the child process
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_proc"] = None
        state["_stopping"] = False
        return state

    def command_line(self, task_index: int | None = None) -> list[str]:
        argv = list(self.argv)
        if "--worker-id" not in argv:
            argv += ["--worker-id", _worker_id(task_index)]
        # -P: the job's working directory (the submit dir, maybe with its own jobs/ package) is not imported from
        return [self.python or sys.executable, "-P", "-m", "ckpteval.jobs.cli", self.command, *argv]

    def __call__(self, task_index: int | None = None) -> dict[str, Any]:
        cmd = self.command_line(task_index)
        self._proc = subprocess.Popen(cmd, preexec_fn=_ignore_usr2)  # noqa: PLW1509 (only a signal reset)
        try:
            code = _poll_until_exit(self._proc)
        finally:  # leaving early (SystemExit after a requeue, KeyboardInterrupt on cancel): no orphan
            self._stop_child()
        if code == EXIT_DONE:
            return {"exit_code": code, "argv": cmd[3:]}
        if code == EXIT_PREEMPTED and not self._stopping:
            # SLURM is ending this job (requeue / preemption): let it, rather than record a failure
            time.sleep(self.preempted_wait_s)
        raise RuntimeError(f"{' '.join(cmd[2:5])} ... exited with {code}")

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        """Stop the worker (USR1: lease released at once), then resubmit a fresh copy of this task."""
        self._stopping = True
        self._stop_child()
        fresh = WorkerTask(self.argv, self.command, python=self.python, grace_s=self.grace_s,
                           preempted_wait_s=self.preempted_wait_s)
        return DelayedSubmission(fresh, *args, **kwargs)

    def _stop_child(self) -> None:
        """USR1 (the worker releases its lease and exits), SIGKILL after ``grace_s``.

        Runs inside submitit's signal handler, possibly while ``__call__`` polls the same child: it
        only ever *polls* (``Popen.wait`` could deadlock on the Popen's non-reentrant waitpid lock).
        """
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGUSR1)
        if _poll_until_exit(proc, self.grace_s) is None:
            proc.kill()
            _poll_until_exit(proc, 5.0)


def _poll_until_exit(proc: subprocess.Popen[bytes], timeout_s: float | None = None) -> int | None:
    """The child's exit code, polling every 0.2 s; None if still running after ``timeout_s``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while (code := proc.poll()) is None:
        if deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(0.2)
    return code


def _worker_id(task_index: int | None) -> str:
    try:
        job_id = submitit.JobEnvironment().job_id
    except RuntimeError:
        job_id = f"pid{os.getpid()}"
    return f"submitit-{job_id}" if task_index is None else f"submitit-{job_id}-t{task_index}"


RUN_WAIT_S = 600  # how long a submitted worker/backfill waits for its run.json (--wait-for-run)


def worker_argv(
    run_dir: str | Path, *, engine: str | Sequence[str] = "hf", device: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The worker flags every API entry point shares."""
    engines = [engine] if isinstance(engine, str) else list(engine)
    if not engines:
        raise ValueError("engine: give at least one engine spec (hf, http:URL, sglang, fn:module:Class)")
    # a job that starts before its trainer has written run.json waits for it (``extra`` may override)
    argv = ["--run-dir", str(Path(run_dir).expanduser().resolve()), "--wait-for-run", str(RUN_WAIT_S)]
    for spec in engines:
        argv += ["--engine", spec]
    if device:
        argv += ["--device", device]
    return argv + list(extra)


def submit_fleet(
    executor: submitit.Executor, run_dir: str | Path, n_workers: int, *, engine: str | Sequence[str] = "hf",
    device: str | None = None, worker_args: Sequence[str] = (),
) -> list[submitit.Job]:
    """``n_workers`` fleet workers over one run, each its own (requeueable) job; they end once
    training is done and every dispatched unit has a result."""
    if n_workers < 1:
        raise ValueError(f"n_workers must be >= 1, got {n_workers}")
    base = worker_argv(run_dir, engine=engine, device=device, extra=worker_args)
    with executor.batch():
        jobs = [executor.submit(WorkerTask([*base, "--worker-id", f"fleet-w{i}"])) for i in range(n_workers)]
    return jobs


def submit_backfill(
    executor: submitit.Executor, run_dir: str | Path, n_tasks: int, parallelism: int | None = None, *,
    engine: str | Sequence[str] = "hf", device: str | None = None, worker_args: Sequence[str] = (),
) -> list[submitit.Job]:
    """An array of ``n_tasks`` backfill tasks over one run (``parallelism`` at once on SLURM).

    Idempotent: over a run whose units all have results, every task finds nothing to do and ends.
    """
    if n_tasks < 1:
        raise ValueError(f"n_tasks must be >= 1, got {n_tasks}")
    if parallelism is not None:
        if parallelism < 1:
            raise ValueError(f"parallelism must be >= 1, got {parallelism}")
        _set_array_parallelism(executor, parallelism)
    task = WorkerTask(worker_argv(run_dir, engine=engine, device=device, extra=worker_args), "backfill")
    return executor.map_array(task, list(range(n_tasks)))


def _set_array_parallelism(executor: submitit.Executor, parallelism: int) -> None:
    if isinstance(executor, submitit.AutoExecutor):
        executor.update_parameters(slurm_array_parallelism=parallelism)
    elif isinstance(executor, submitit.SlurmExecutor):
        executor.update_parameters(array_parallelism=parallelism)
    # other executors (local, debug) run the array as they see fit


def submit_service(
    executor: submitit.Executor, run_dir: str | Path, watch_dir: str | Path | Sequence[str | Path], *,
    engine: str | Sequence[str] = "hf", device: str | None = None, eval_config: str | Path | None = None,
    worker_args: Sequence[str] = (),
) -> submitit.Job:
    """A long-running worker evaluating any trainer's checkpoints in ``watch_dir``; it requeues itself
    at the executor's time limit (submitit's timeout signal -> :meth:`WorkerTask.checkpoint`)."""
    dirs = [watch_dir] if isinstance(watch_dir, str | Path) else list(watch_dir)
    extra: list[str] = []
    for d in dirs:
        extra += ["--watch", str(Path(d).expanduser().resolve())]
    if eval_config is not None:
        extra += ["--eval-config", str(Path(eval_config).expanduser().resolve())]
    argv = worker_argv(run_dir, engine=engine, device=device, extra=[*extra, *worker_args])
    return executor.submit(WorkerTask(argv))


# ---------------------------------------------------------------------- heterogeneous train+eval
@dataclass
class SbatchJob:
    """A job submitted from a rendered script: id, scheduler state, and the run's own status."""

    job_id: str
    run_dir: Path
    script: str

    def state(self) -> str | None:
        """``RUNNING``, ``PENDING``, ``COMPLETED``, ... (the leader's, for a het job); None if unknown."""
        out = _run_quiet(["squeue", "-h", "-j", self.job_id, "-o", "%T"])
        if out:
            return out.split()[0]
        out = _run_quiet(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", self.job_id])
        for line in out.splitlines():
            jid, _, state = line.partition("|")
            if jid in (self.job_id, f"{self.job_id}+0") and state:
                return state.split()[0]
        return None

    def done(self) -> bool:
        state = self.state()
        return state is not None and state not in _ACTIVE

    def wait(self, timeout_s: float | None = None, poll_s: float = 5.0) -> str | None:
        """Block until the job left the queue (or ``timeout_s``); returns the last state seen."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            state = self.state()
            if state is not None and state not in _ACTIVE:
                return state
            if deadline is not None and time.monotonic() > deadline:
                return state
            time.sleep(poll_s)

    def status(self) -> dict[str, Any]:
        """What ``ckpteval status RUN --json`` prints: snapshots, units, points, leases."""
        from ckpteval.jobs.views.status.main import collect_status

        return collect_status(self.run_dir)

    def cancel(self) -> None:
        _run_quiet(["scancel", self.job_id])


_ACTIVE = frozenset({"PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING", "SUSPENDED",
                     "RESIZING", "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT", "STOPPED"})


def _run_quiet(cmd: list[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def _flag(name: str, value: Any) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, list | tuple):
        return [f"{flag}={v}" for v in value]
    return [flag, str(value)]


def prepare_train_eval(run_dir: str | Path, *, trainer_args: Sequence[str] = (), **options: Any) -> submit_mod.Prepared:
    """Render ``sbatch/train_eval.sbatch``; ``options`` are ``ckpteval submit train-eval`` flags by
    their Python names (``partition="gpu"``, ``workers=2``, ``gpus_per_worker=1``,
    ``env=["OMP_NUM_THREADS=1"]``, ``worker_arg=["--verify=full"]``, ...)."""
    argv = ["train-eval", "--run-dir", str(run_dir)]
    for name, value in options.items():
        argv += _flag(name, value)
    return submit_mod.prepare([*argv, "--", *trainer_args])


def submit_train_eval(run_dir: str | Path, *, trainer_args: Sequence[str] = (), **options: Any) -> SbatchJob:
    """Submit trainer + eval fleet as one heterogeneous job (see :func:`prepare_train_eval`)."""
    prepared = prepare_train_eval(run_dir, trainer_args=trainer_args, **options)
    job_id = submit_mod.submit_prepared(prepared)
    return SbatchJob(job_id, prepared.run_dir, prepared.script)


__all__ = [
    "SbatchJob",
    "WorkerTask",
    "prepare_train_eval",
    "submit_backfill",
    "submit_fleet",
    "submit_service",
    "submit_train_eval",
    "worker_argv",
]
