"""sbatch/common.sh's decision on a worker's exit code, without a cluster: the real functions the batch
scripts call (``ckpteval_start_workers``, ``ckpteval_supervise``, ``ckpteval_finish``), with ``srun`` and
``scontrol`` on PATH replaced by scripts that log their call (``srun`` then exits with the code under test)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

COMMON = Path(__file__).resolve().parents[2] / "sbatch" / "common.sh"

# the order backfill.sbatch and eval_service.sbatch run them in, on one planned worker
SCRIPT = f"""source "{COMMON}"
ckpteval_init
CKPTEVAL_WNODE=(node0); CKPTEVAL_WSLOT=(0); CKPTEVAL_WRESTARTS=(0); CKPTEVAL_WORKER_CMD=(ckpteval worker)
ckpteval_start_workers
ckpteval_supervise
ckpteval_finish
"""


@dataclass(frozen=True)
class JobOutcome:
    exit_code: int  # the batch script's own exit code
    starts: int  # how many times the worker was started (1 + in-place restarts)
    requeued: bool  # ``scontrol requeue`` was called
    log: str  # common.sh's log lines (stderr)


def job_outcome(worker_rc: int, tmp: Path, restarts: int = 1) -> JobOutcome:
    """What the batch job does when its worker exits ``worker_rc`` every time (``restarts`` in place)."""
    bin_dir, calls = tmp / "bin", tmp / "calls.log"
    bin_dir.mkdir(parents=True, exist_ok=True)
    calls.write_text("")
    for name, body in (("srun", f'echo srun >> "{calls}"\nexit {worker_rc}'), ("scontrol", f'echo "scontrol $*" >> "{calls}"')):
        stub = bin_dir / name
        stub.write_text(f"#!/bin/bash\n{body}\n")
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0",
           "CKPTEVAL_WORKER_RESTARTS": str(restarts), "CKPTEVAL_RESTART_PAUSE_S": "0"}
    proc = subprocess.run(["bash", "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    lines = calls.read_text().splitlines()
    return JobOutcome(proc.returncode, lines.count("srun"), any(x.startswith("scontrol requeue") for x in lines),
                      proc.stderr)
