"""sbatch/common.sh and jobs/lifecycle.py agree: the exit codes the batch scripts act on and the
signals they trap and forward are the ones the programs use (one definition, checked here)."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest

from ckpteval.jobs import lifecycle
from tests.support.sbatch import job_outcome

ROOT = Path(__file__).parents[1]
COMMON = ROOT / "sbatch" / "common.sh"


def _shell_value(name: str) -> str:
    """The value common.sh gives ``name`` once sourced (bash, not a regex, reads the script)."""
    proc = subprocess.run(["bash", "-c", f'source "{COMMON}" && printf %s "${name}"'],
                          capture_output=True, text=True, timeout=30, check=True)
    return proc.stdout


def test_exit_codes_in_common_sh_are_lifecycles() -> None:
    assert int(_shell_value("CKPTEVAL_WORKER_PREEMPTED")) == lifecycle.EXIT_PREEMPTED
    assert int(_shell_value("CKPTEVAL_WORKER_UNHEALTHY")) == lifecycle.EXIT_UNHEALTHY
    assert int(_shell_value("CKPTEVAL_TRAIN_PREEMPTED")) == lifecycle.EXIT_TRAIN_PREEMPTED
    # the header comment a reader of the script sees states the same numbers
    header = COMMON.read_text().split("\n\n", 1)[0]
    assert f"{lifecycle.EXIT_PREEMPTED} preempted" in header and f"{lifecycle.EXIT_UNHEALTHY} engine unhealthy" in header
    assert f"{lifecycle.EXIT_TRAIN_PREEMPTED} preempted" in header


def test_signals_common_sh_traps_and_forwards_are_the_preempt_signals() -> None:
    text = COMMON.read_text()
    trapped = {signal.Signals[f"SIG{name}"] for name in re.findall(r"^\s*trap '[^']*' (\w+)$", text, re.M)}
    forwarded = {signal.Signals[f"SIG{name}"] for name in re.findall(r"kill -([A-Z]\w*) ", text)}
    assert trapped == set(lifecycle.PREEMPT_SIGNALS), trapped
    assert forwarded and forwarded <= set(lifecycle.PREEMPT_SIGNALS) <= set(lifecycle.STOP_SIGNALS), forwarded


@pytest.mark.parametrize("code", [lifecycle.EXIT_DONE, lifecycle.EXIT_ERROR, lifecycle.EXIT_USAGE,
                                  lifecycle.EXIT_PREEMPTED, lifecycle.EXIT_UNHEALTHY])
def test_the_batch_scripts_requeue_only_on_preempted_and_unhealthy(code: int, tmp_path: Path) -> None:
    """common.sh's real supervise/finish on a worker that exits ``code`` each time (srun, scontrol stubbed):
    3 and 4 restart it in place, then requeue the job; a configuration error (2) is neither restarted nor
    requeued — the job ends with it."""
    out = job_outcome(code, tmp_path)
    retried = code in (lifecycle.EXIT_PREEMPTED, lifecycle.EXIT_UNHEALTHY)
    assert out.requeued is retried, out.log
    assert out.starts == (2 if retried else 1), out.log
    assert out.exit_code == (0 if retried else code), out.log  # a requeued job's script exits 0
