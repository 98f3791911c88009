"""The throw-away SLURM cluster for tests under tests/slurm/ (mark them ``@pytest.mark.slurm``).

``slurm_cluster`` (session scope) runs ``cluster.sh up`` once: it installs Debian's slurm-wlm,
munge, slurmdbd and mariadb-server if missing, and starts munged, MariaDB, slurmdbd, slurmctld
and 3 logical nodes (n1..n3, each 4 CPUs and 2 fake GPUs) on this host; it returns in well under
a second when the cluster is already up. The cluster is deliberately left running at session end
so the next session reuses it; ``tests/slurm/cluster.sh down`` stops it.

The fixture skips (with the reason) only when SLURM truly cannot start here: not installed and
not installable (not root / no apt), or ``CKPTEVAL_SKIP_SLURM=1``. Any other start-up failure is a
test error carrying the script's message and log tails.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CLUSTER_SH = Path(__file__).with_name("cluster.sh")

# States a job cannot leave by itself (REQUEUED / PENDING / RUNNING / COMPLETING ... are transient).
TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "REVOKED",
    }
)


class SlurmCommandError(RuntimeError):
    pass


@dataclass
class SlurmCluster:
    """Handle on the running cluster.

    state_dir: the cluster's state dir ($CKPTEVAL_SLURM_DIR, default /tmp/ckpteval-slurm)
    partition: the (default) partition holding every node
    nodes:     node names, e.g. ["n1", "n2", "n3"]
    conf:      slurm.conf path (also exported as SLURM_CONF in this process)
    jobs_dir:  world-writable scratch dir; ``submit`` runs sbatch there by default
    """

    state_dir: Path
    partition: str
    nodes: list[str]
    conf: Path
    jobs_dir: Path
    env: dict[str, str] = field(repr=False, default_factory=dict)

    def run(self, *cmd: str, check: bool = True, timeout: float = 30.0, cwd: str | os.PathLike | None = None):
        """Run a SLURM client command (sbatch, scontrol, sacct, ...) against this cluster."""
        proc = subprocess.run(
            list(cmd), capture_output=True, text=True, env=self.env, timeout=timeout, cwd=cwd
        )
        if check and proc.returncode != 0:
            raise SlurmCommandError(
                f"{shlex.join(cmd)} -> rc {proc.returncode}\n{proc.stdout}{proc.stderr}".strip()
            )
        return proc

    def nudge(self, job: str) -> None:
        """Wake the backfill scheduler, the only one that starts heterogeneous jobs. It runs only when a
        job, node, partition or reservation changed since its last pass (``_more_work`` in slurm's
        ``src/plugins/sched/backfill/backfill.c``), and a requeued job's BeginTime (now + cred_expire + 1)
        passing is no such change: on a busy cluster other jobs' events wake it within seconds, on this
        idle one the next change came 60-190 s later. A no-op update of the job's comment is a change."""
        self.run("scontrol", "update", f"JobId={job}", "Comment=ckpteval-test", check=False)

    def submit(self, script_text: str, *args: str, cwd: str | os.PathLike | None = None) -> str:
        """``sbatch --parsable *args <script>``; returns the job id (the leader's for a het job).

        The script is written to ``cwd`` (default ``jobs_dir``) and sbatch runs there, so the default
        ``slurm-%j.out`` lands there too. Extra sbatch options go in ``args``.
        """
        workdir = Path(cwd) if cwd is not None else self.jobs_dir
        script = workdir / f"job-{uuid.uuid4().hex[:8]}.sbatch"
        script.write_text(script_text)
        script.chmod(0o755)
        out = self.run("sbatch", "--parsable", *args, str(script), cwd=workdir).stdout.strip()
        return out.split(";")[0]

    def job_records(self, job_id: str) -> list[dict[str, str]]:
        """``scontrol show job -o`` parsed: one dict per record (het components: one each, leader
        first). Empty once slurmctld has forgotten the job (MinJobAge=300 s after it ended)."""
        proc = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if proc.returncode != 0:
            return []
        records = []
        for line in proc.stdout.splitlines():
            rec = {}
            for tok in line.split():
                key, sep, value = tok.partition("=")
                if sep and key not in rec:
                    rec[key] = value
            if rec:
                records.append(rec)
        return records

    def job_state(self, job_id: str) -> str | None:
        """Current state of the job (for a het job, of its leader component), e.g. "RUNNING";
        from scontrol, else from sacct; None when neither knows the job (yet)."""
        job_id = str(job_id)
        records = self.job_records(job_id)
        if records:
            mine = [r for r in records if r.get("JobId") == job_id] or records
            return mine[0].get("JobState")
        proc = self.run("sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", job_id, check=False)
        for line in proc.stdout.splitlines():
            jid, _, state = line.partition("|")
            if jid in (job_id, f"{job_id}+0") and state:
                return state.split()[0]  # "CANCELLED by 0" -> "CANCELLED"
        return None

    def wait_job(
        self,
        job_id: str,
        states: Iterable[str] = TERMINAL_STATES,
        timeout: float = 60.0,
        poll: float = 0.25,
    ) -> str:
        """Poll until the job's state is in ``states`` and return that state.

        Also returns early with a terminal state that is not in ``states`` (a job that FAILED will
        never become RUNNING): callers assert on the value. Raises TimeoutError after ``timeout``.
        """
        wanted = set(states)
        deadline = time.monotonic() + timeout
        state = None
        while True:
            state = self.job_state(job_id)
            if state is not None and (state in wanted or state in TERMINAL_STATES):
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} still {state} after {timeout:.0f}s (wanted {sorted(wanted)})"
                )
            time.sleep(poll)

    def cancel(self, *job_ids: str) -> None:
        self.run("scancel", *map(str, job_ids), check=False)


def _skip_reason() -> str | None:
    if os.environ.get("CKPTEVAL_SKIP_SLURM") == "1":
        return "CKPTEVAL_SKIP_SLURM=1 is set"
    if os.name != "posix" or not Path("/bin/bash").exists():
        return "the SLURM test cluster needs Linux and bash"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    reason = _skip_reason()
    if reason:
        pytest.skip(f"SLURM cluster unavailable: {reason}")
    env = dict(os.environ)
    state_dir = Path(env.get("CKPTEVAL_SLURM_DIR", "/tmp/ckpteval-slurm"))
    # A file, not a pipe, for the script's output: no daemon can then hold our pipe open.
    with tempfile.TemporaryFile(mode="w+") as log:
        t0 = time.monotonic()
        rc = subprocess.run(
            ["bash", str(CLUSTER_SH), "up"], stdout=log, stderr=subprocess.STDOUT, env=env, timeout=600
        ).returncode
        log.seek(0)
        output = log.read().strip()
    if rc == 3:
        pytest.skip(f"SLURM cannot start on this machine: {output.splitlines()[-1] if output else rc}")
    if rc != 0:
        pytest.fail(f"tests/slurm/cluster.sh up failed (rc {rc}):\n{output}", pytrace=False)
    print(f"\n[slurm_cluster] {output.splitlines()[-1]} (fixture: {time.monotonic() - t0:.1f}s)")

    conf = state_dir / "etc" / "slurm.conf"
    env["SLURM_CONF"] = str(conf)
    os.environ["SLURM_CONF"] = str(conf)  # for product code under test that shells out to sbatch
    partition, nodes = "", []
    for line in conf.read_text().splitlines():
        if line.startswith("PartitionName="):
            partition = line.split()[0].split("=", 1)[1]
        elif line.startswith("NodeName="):
            nodes.append(line.split()[0].split("=", 1)[1])
    return SlurmCluster(
        state_dir=state_dir,
        partition=partition,
        nodes=nodes,
        conf=conf,
        jobs_dir=state_dir / "jobs",
        env=env,
    )
